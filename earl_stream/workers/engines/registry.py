"""Engine backends by name: "torch" (built in), "vllm", "sglang".

It owns the map from `rollout.engine` names to factories, `make_engine`, and the one place that
says why a backend cannot run here (`unavailable_reason`), which tests use to skip cleanly. The
backends themselves import their heavy dependencies lazily, so importing this module is cheap.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from earl_stream.errors import EngineError
from earl_stream.workers.engines.base import Engine

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_LOG = logging.getLogger(__name__)

# (model_dir, model or None, max_batch_size, kv_budget_tokens, seed) -> Engine
EngineFactory = Callable[[Path, "PreTrainedModel | None", int, int, int], Engine]


def _torch(model_dir: Path, model: PreTrainedModel | None, max_batch_size: int, kv_budget_tokens: int,
           seed: int) -> Engine:
    from earl_stream.workers.engines.torch_engine import TorchEngine

    if model is None:
        from earl_stream.model import load_model

        model, _ = load_model(model_dir)
    return TorchEngine(model, max_batch_size=max_batch_size, kv_budget_tokens=kv_budget_tokens, seed=seed)


def _vllm(model_dir: Path, model: PreTrainedModel | None, max_batch_size: int, kv_budget_tokens: int,
          seed: int, lora_rank: int = 0) -> Engine:
    from earl_stream.workers.engines.vllm_engine import VllmEngine

    return VllmEngine(model_dir, max_batch_size=max_batch_size, kv_budget_tokens=kv_budget_tokens, seed=seed,
                      lora_rank=lora_rank)


def _sglang(model_dir: Path, model: PreTrainedModel | None, max_batch_size: int, kv_budget_tokens: int,
            seed: int) -> Engine:
    from earl_stream.workers.engines.sglang_engine import SglangEngine

    return SglangEngine(model_dir, max_batch_size=max_batch_size, kv_budget_tokens=kv_budget_tokens, seed=seed)


_FACTORIES: dict[str, EngineFactory] = {"torch": _torch, "vllm": _vllm, "sglang": _sglang}


def engine_names() -> list[str]:
    """The registered backend names, sorted."""
    return sorted(_FACTORIES)


def register_engine(name: str, factory: EngineFactory) -> None:
    """Add a backend under `name`; a name can be registered once."""
    if name in _FACTORIES:
        raise EngineError(f"an engine named {name!r} is already registered (known: {', '.join(engine_names())})")
    _FACTORIES[name] = factory


def unavailable_reason(name: str) -> str | None:
    """Why backend `name` cannot run in this environment, or None if it can (cheap: imports nothing heavy)."""
    if name not in _FACTORIES:
        return f"unknown engine {name!r}; known engines: {', '.join(engine_names())}"
    if name == "vllm" and importlib.util.find_spec("vllm") is None:
        from earl_stream.workers.engines.vllm_engine import VLLM_INSTALL_HINT

        return f"vllm is not installed; {VLLM_INSTALL_HINT}"
    if name == "sglang":
        import torch

        from earl_stream.workers.engines.sglang_engine import SGLANG_INSTALL_HINT

        if not torch.cuda.is_available():
            return f"SGLang needs a CUDA GPU and none is visible here; {SGLANG_INSTALL_HINT}"
        if importlib.util.find_spec("sglang") is None:
            return f"sglang is not installed; {SGLANG_INSTALL_HINT}"
    return None


def make_engine(
    name: str,
    model_dir: str | os.PathLike[str],
    model: PreTrainedModel | None = None,
    *,
    max_batch_size: int = 64,
    kv_budget_tokens: int = 65536,
    seed: int = 0,
    weight_swap: str = "drain",
    lora_rank: int = 0,
    batch_invariant: bool = False,
    prefill_chunk_tokens: int | None = None,
) -> Engine:
    """Start backend `name` on the Hugging Face directory `model_dir`.

    `model` is the already loaded HF model: the torch engine generates with it (it loads
    `model_dir` itself if None); vLLM and SGLang load the directory in their own processes and
    ignore it, so pass None there to save memory. Raises EngineError naming the known backends, or
    saying what to install, when `name` cannot run here, and before starting anything when it cannot
    swap weights by `weight_swap` (`weight_swap.SwapMode`; only the built-in engine has all three).
    `lora_rank` > 0 (a `model.lora` run): vLLM starts able to serve adapters of that rank (the built-in
    engine applies them unmerged and needs nothing at start). `batch_invariant` (`rollout.batch_invariant`): a row's
    tokens do not depend on which rows share its batch; only backends with `set_batch_invariant` (the built-in
    one) can, any other is refused. `prefill_chunk_tokens` (`rollout.prefill_chunk_tokens`): the most positions one
    prefill forward runs, for backends with `set_prefill_chunk_tokens` (the built-in one; the others size their own
    prefills); None keeps the backend's default.
    """
    reason = unavailable_reason(name)
    if reason is not None:
        raise EngineError(f"rollout.engine={name}: {reason}")
    from earl_stream.workers.engines.weight_swap import SwapMode, swap_mode_problem

    mode = SwapMode(weight_swap)
    if (problem := swap_mode_problem(name, mode.value)) is not None:
        raise EngineError(problem)
    if model is not None and name != "torch":
        _LOG.info("engine %s loads %s itself; the model passed in is not used", name, model_dir)
    if name == "vllm" and lora_rank > 0:
        engine = _vllm(Path(model_dir), model, max_batch_size, kv_budget_tokens, seed, lora_rank)
    else:
        engine = _FACTORIES[name](Path(model_dir), model, max_batch_size, kv_budget_tokens, seed)
    if mode is not SwapMode.DRAIN:
        setter = getattr(engine, "set_weight_swap", None)
        if setter is None:
            raise EngineError(f"rollout.weight_swap={mode.value}: engine {name!r} swaps weights only by draining "
                              "(it has no set_weight_swap); use rollout.weight_swap=drain")
        setter(mode)
    if batch_invariant:
        make_invariant = getattr(engine, "set_batch_invariant", None)
        if make_invariant is None:
            raise EngineError(f"rollout.batch_invariant: engine {name!r} cannot make a row's tokens independent of "
                              "its batch; use rollout.engine=torch or rollout.batch_invariant=never")
        make_invariant(True)
    chunking = getattr(engine, "set_prefill_chunk_tokens", None)
    if prefill_chunk_tokens is not None and chunking is not None:
        chunking(prefill_chunk_tokens)
    return engine
