"""The SGLang backend of the `Engine` Protocol, through SGLang's offline `sglang.Engine` API.

UNTESTED: SGLang has no CPU kernels on PyPI, so this backend has never run on the CPU machines
this project is developed on. It is written from SGLang's documented API (`Engine.generate` with
`input_ids`, per-request `sampling_params`, `return_logprob`/`top_logprobs_num`;
`update_weights_from_tensor`/`update_weights_from_disk`) and needs a CUDA GPU.

It owns: starting `sglang.Engine` sized from our capacity knobs, translating requests and
results, bringing SGLang's log-probs to the convention of `base.py`, and weight updates. It leaves
scheduling and KV reuse between turns to SGLang (its radix cache matches an episode's earlier
turns by content, so `release` has nothing to do).

Log-probs: SGLang reports log_softmax(logits / temperature) *before* top-k/top-p (greedy requests
become temperature 1, top-k 1, so they report log_softmax(logits), as base.py asks). For a request
with a top-k or top-p filter we also ask for the top candidates' log-probs and renormalise over the
kept set (`filtered_logprob`), which gives exactly log_softmax(filter(logits / T)). Leave the
environment variable SGLANG_RETURN_ORIGINAL_LOGPROB unset: it switches SGLang to raw log-probs.

Stops: SGLang always stops at the model's own EOS tokens as well as at `stop_token_ids` (its
`ignore_eos` would disable both), so list the EOS tokens in `stop_token_ids` for identical behaviour
across backends. Per-request seeds are honoured only with `deterministic=True`
(`--enable-deterministic-inference`).

Out of memory (UNTESTED, like the rest of this backend): an out-of-memory failure that reaches this process
as an exception (`oom_restart.oom_evidence` on its chain), starting or generating, stops SGLang and starts
it again lower (`oom_restart.RestartPolicy`: `max_total_tokens` halved, down to one sequence of the context
length, and after a failure while generating `max_running_requests` too), then re-issues the requests that
were in flight under the current weights; each restart counts as a shed (`oom_shed_total`, reported by the
rollout worker's heartbeat as `oom_sheds`, and `earl_rollout_oom_shed_total`). A limit: SGLang's scheduler
runs in a child process and, when it fails (an allocation failure included), signals this process with
SIGQUIT, whose handler (installed by `sglang.Engine`) kills the whole process tree; such a failure is a
dead rollout worker, whose unpulled samples and prompts the supervisor re-issues, not a restart.

Streaming: the offline `Engine.generate` returns whole turns, so a request's `on_token` is never
called; the OpenAI endpoint's streamed replies then arrive in one piece when the turn ends.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import shutil
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from earl_stream import metrics as M
from earl_stream.errors import EngineError
from earl_stream.workers.engines.base import EngineCapacity, FinishReason, GenerateRequest, GenerateResult, check_request
from earl_stream.workers.engines.model_files import clamp_capacity, read_model_shape, shm_root, state_problems, write_checkpoint
from earl_stream.workers.engines.oom_restart import (
    BatchOutOfMemory,
    EngineSettings,
    OomPhase,
    OomRestart,
    RestartPolicy,
    RestartRecord,
    exception_text,
    oom_evidence,
)

_LOG = logging.getLogger(__name__)

SGLANG_INSTALL_HINT = "on a machine with a CUDA GPU, `pip install \"sglang[all]\"` (SGLang has no CPU build on PyPI)"
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}
_HINT = "rollout.max_batch_size (max_running_requests) or rollout.memory_bytes (the KV budget, max_total_tokens)"


def filtered_logprob(chosen: float, candidates: Sequence[float], top_k: int, top_p: float) -> float | None:
    """Log-prob of a token under the top-k then top-p filtered, renormalised distribution.

    `chosen` is its log-prob under log_softmax(logits / T); `candidates` the log-probs of the most
    likely tokens under the same distribution (at least `top_k` of them if top_k > 0). Returns None
    when the candidates do not reach the end of the top-p nucleus (more candidates are needed).
    Matches the torch engine: top-k keeps exactly k tokens by rank; top-p then keeps a token while
    the renormalised mass before it is below p.
    """
    ranked = sorted(candidates, reverse=True)
    if top_k > 0:
        ranked = ranked[:top_k]
    if not ranked:
        return None
    if top_p >= 1.0:
        return chosen - _logsumexp(ranked) if top_k > 0 else chosen
    # Probabilities the top-p rule sees: renormalised over the top-k set, or the plain distribution.
    base = _logsumexp(ranked) if top_k > 0 else 0.0
    before = 0.0
    for kept, lp in enumerate(ranked):
        if before >= top_p:
            return chosen - _logsumexp(ranked[:kept])
        before += math.exp(lp - base)
    # Every candidate is kept: the set is complete if it is the top-k set or already holds mass p.
    if top_k > 0 or before >= top_p:
        return chosen - _logsumexp(ranked)
    return None


def _logsumexp(values: Sequence[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


class SglangEngine(RestartRecord):
    """Generates with `sglang.Engine` started on the Hugging Face directory `model_dir` (GPU only).

    `max_batch_size` becomes `max_running_requests`, `kv_budget_tokens` becomes `max_total_tokens`
    (the KV pool in tokens); like vLLM, both are start-up values that `set_capacity` can lower
    but not raise. `weight_update="tensor"` sends tensors to the scheduler
    (`update_weights_from_tensor`); `"disk"` writes a safetensors directory in RAM and calls
    `update_weights_from_disk`. Thread-safe: `generate` and `load_state_dict` share one lock.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        max_batch_size: int = 64,
        kv_budget_tokens: int = 65536,
        seed: int = 0,
        dtype: str = "float32",
        deterministic: bool = False,
        weight_update: str = "tensor",
        top_p_candidates: int = 256,
        engine_kwargs: Mapping[str, Any] | None = None,
        oom_factor: float = 0.5,
        oom_max_restarts: int = 4,
    ) -> None:
        if max_batch_size < 1 or kv_budget_tokens < 1:
            raise EngineError(f"invalid engine capacity ({max_batch_size}, {kv_budget_tokens}): both must be >= 1")
        if weight_update not in ("tensor", "disk"):
            raise EngineError(f"weight_update={weight_update!r}: must be 'tensor' or 'disk'")
        if not torch.cuda.is_available():
            raise EngineError(
                "rollout.engine=sglang: SGLang needs a CUDA GPU and none is visible here "
                f"(use rollout.engine=torch or vllm on CPU); {SGLANG_INSTALL_HINT}"
            )
        try:
            import sglang
        except ImportError as exc:
            raise EngineError(
                f"rollout.engine=sglang but sglang cannot be imported ({exc}); {SGLANG_INSTALL_HINT}"
            ) from None
        self._model_dir = Path(model_dir)
        self._shape = read_model_shape(self._model_dir)
        self._max_len = min(self._shape.max_positions, kv_budget_tokens)
        self._weight_update = weight_update
        self._top_p_candidates = top_p_candidates
        self._root: Path | None = None
        kwargs: dict[str, Any] = dict(
            model_path=str(self._model_dir),
            dtype=dtype,
            random_seed=seed,
            max_running_requests=max_batch_size,
            max_total_tokens=kv_budget_tokens,
            context_length=self._max_len,
            skip_tokenizer_init=True,  # token ids in, token ids out
            enable_deterministic_inference=deterministic,
            log_level="error",
        )
        kwargs.update(engine_kwargs or {})
        self._kwargs = kwargs
        self._settings = EngineSettings(int(kwargs["max_running_requests"]), float(kwargs["max_total_tokens"]),
                                        "max_running_requests", "max_total_tokens")
        self._policy = RestartPolicy(min_memory=self._max_len, factor=oom_factor, max_restarts=oom_max_restarts)
        self._init_restart_record()
        self._last_state: Mapping[str, torch.Tensor] | None = None  # "tensor" updates: what a restart loads again
        self._version = 0
        self._engine: Any = None
        self._engine = self._start_fitting(sglang, None)
        self._started = EngineCapacity(self._settings.seqs, int(self._settings.memory))
        self._capacity = self._started
        self._lock = threading.Lock()
        self._loads = 0
        _LOG.info("SGLang engine ready on %s (%s)", self._model_dir, self._settings.describe())

    # ---------------------------------------------------------------- Engine protocol

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def capacity(self) -> EngineCapacity:
        return self._capacity

    def set_capacity(self, capacity: EngineCapacity) -> None:
        """Lower (or restore) the knobs; values above the start-up ones are clamped with a warning."""
        self._capacity = clamp_capacity(capacity, self._started, "SGLang")

    def release(self, cache_key: str) -> None:
        """Nothing to do: SGLang's radix cache finds an episode's earlier turns by content."""

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        """Extend every request; results in input order. Raises EngineError on a bad request or a failed run."""
        reqs = list(requests)
        max_len = min(self._max_len, self._capacity.kv_budget_tokens)
        for i, req in enumerate(reqs):
            check_request(i, req, self._shape.vocab_size, max_len)
        results: list[GenerateResult] = []
        with self._lock:
            while len(results) < len(reqs):
                cap = self._capacity.max_concurrent_sequences
                step = len(reqs) if cap >= self._started.max_concurrent_sequences else max(cap, 1)
                chunk = reqs[len(results) : len(results) + step]
                try:
                    results.extend(self._run(chunk))
                except BatchOutOfMemory as oom:  # restart smaller, re-issue the chunk under the current weights
                    self._stop()
                    self._engine = self._start_fitting(importlib.import_module("sglang"),
                                                       (OomPhase.GENERATE, oom.evidence, len(chunk)))
        return results

    def load_state_dict(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Update the live engine's weights (tensors or a directory, see the class) and flush its cache."""
        problems = state_problems(state, self._shape)
        if problems:
            raise EngineError(f"load_state_dict(version={version}) rejected, nothing was loaded: {'; '.join(problems)}")
        with self._lock:
            try:
                if self._weight_update == "tensor":
                    ret = self._engine.update_weights_from_tensor(
                        named_tensors=list(state.items()), flush_cache=True
                    )
                else:
                    ret = self._engine.update_weights_from_disk(model_path=str(self._write_dir(state, version)))
            except Exception as exc:
                raise EngineError(f"SGLang could not update weights (version {version}): {exc}") from exc
            ok, message = _outcome(ret)
            if not ok:
                raise EngineError(
                    f"SGLang refused the weights of version {version}: {message}. The engine's weights may be "
                    "partly replaced: load a complete state again or restart it."
                )
            if self._weight_update == "disk":
                self._engine.flush_cache()
            else:
                self._last_state = state
            self._version = version
        _LOG.info("loaded policy version %d (%d tensors) into SGLang", version, len(state))

    def close(self) -> None:
        """Stop SGLang's processes and delete weight directories (idempotent)."""
        self._stop()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)

    def _stop(self) -> None:
        engine = getattr(self, "_engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as exc:  # best effort: a failed engine may be half gone
                _LOG.warning("SGLang shutdown: %s", exc)
            self._engine = None

    # ---------------------------------------------------------------- out-of-memory restarts

    def _start_fitting(self, sglang: Any, failure: tuple[OomPhase, str, int] | None) -> Any:
        """Start SGLang, first lowered after `failure` (phase, evidence, requests in flight), and lowered again
        while it runs out of memory starting; `EngineOutOfMemory` past the policy's limit or floor."""
        while True:
            before = self._settings
            if failure is not None:
                self._lower(*failure)
            began = time.monotonic()
            try:
                engine = sglang.Engine(**self._kwargs)
            except Exception as exc:
                evidence = oom_evidence(exception_text(exc))
                if failure is not None:
                    self._record_restart(OomRestart(time.time(), failure[0], before, self._settings,
                                                     time.monotonic() - began, failure[2], failure[1]))
                if evidence is None:
                    raise EngineError(f"SGLang could not start on {self._model_dir}: {type(exc).__name__}: {exc}") from exc
                failure = (OomPhase.START, evidence, 0)
                continue
            if failure is not None:
                self._restore_weights(engine)
                seconds = time.monotonic() - began
                self._record_restart(OomRestart(time.time(), failure[0], before, self._settings, seconds, failure[2],
                                                 failure[1]))
                _LOG.warning("SGLang restarted after running out of memory in %.1f s with %s; re-issuing %d request(s)",
                             seconds, self._settings.describe(), failure[2])
            return engine

    def _restore_weights(self, engine: Any) -> None:
        """A restarted engine serves the current version: from its directory ("disk", set in `_lower`) or, with
        "tensor" updates, from the last state loaded (kept for this: one host copy of the weights)."""
        if self._weight_update == "tensor" and self._last_state is not None:
            ok, message = _outcome(engine.update_weights_from_tensor(named_tensors=list(self._last_state.items()),
                                                                     flush_cache=True))
            if not ok:
                raise EngineError(f"SGLang restarted after running out of memory but refused the weights of version "
                                  f"{self._version}: {message}")

    def _lower(self, phase: OomPhase, evidence: str, reissued: int) -> None:
        before = self._settings
        self._settings = self._policy.next(before, phase, self._restart_total, "SGLang", evidence, _HINT)
        self._kwargs.update(max_running_requests=self._settings.seqs, max_total_tokens=int(self._settings.memory))
        self._count_restart()
        M.ROLLOUT_OOM_SHED.inc()
        if hasattr(self, "_started"):  # a restart while serving: capacity follows the lower start-up values
            self._started = EngineCapacity(self._settings.seqs, int(self._settings.memory))
            self._capacity = EngineCapacity(min(self._capacity.max_concurrent_sequences, self._settings.seqs),
                                            min(self._capacity.kv_budget_tokens, int(self._settings.memory)))
        if self._weight_update == "disk" and self._root is not None and self._version > 0:
            self._kwargs["model_path"] = str(max(self._root.iterdir(), key=lambda p: p.stat().st_mtime))
        _LOG.warning("SGLang ran out of memory (%s, %d request(s) in flight): restarting it with %s (was %s). Cause: %s",
                     phase.value, reissued, self._settings.describe(), before.describe(), evidence)

    # ---------------------------------------------------------------- helpers

    def _candidates(self, req: GenerateRequest) -> int:
        if req.temperature <= 0 or (req.top_k == 0 and req.top_p >= 1.0):
            return 0
        return req.top_k if req.top_k > 0 else min(self._top_p_candidates, self._shape.vocab_size)

    def _run(self, reqs: list[GenerateRequest]) -> list[GenerateResult]:
        params = [
            {
                "max_new_tokens": r.max_new_tokens,
                "temperature": r.temperature,
                "top_p": r.top_p,
                "top_k": r.top_k if r.top_k > 0 else -1,
                "stop_token_ids": sorted(r.stop_token_ids),
                "no_stop_trim": True,  # keep the stop token in output_ids, as the Protocol requires
                **({"sampling_seed": r.seed} if r.seed is not None else {}),
            }
            for r in reqs
        ]
        if self._engine is None:
            raise EngineError("this SglangEngine was closed")
        try:
            outputs = self._engine.generate(
                input_ids=[list(r.prompt_ids) for r in reqs],
                sampling_params=params,
                return_logprob=True,
                top_logprobs_num=[self._candidates(r) for r in reqs],
            )
        except Exception as exc:
            message = f"SGLang failed on a batch of {len(reqs)} requests: {type(exc).__name__}: {exc}"
            evidence = oom_evidence(exception_text(exc))
            if evidence is not None:
                raise BatchOutOfMemory(message, evidence) from exc
            raise EngineError(message) from exc
        if isinstance(outputs, dict):
            outputs = [outputs]
        return [self._result(r, out) for r, out in zip(reqs, outputs)]

    def _result(self, req: GenerateRequest, output: Mapping[str, Any]) -> GenerateResult:
        meta = output["meta_info"]
        # Each entry is (logprob, token_id, text-or-None); the ids come from the same place as the log-probs.
        steps = meta["output_token_logprobs"]
        tokens = [int(s[1]) for s in steps]
        logprobs = [float(s[0]) for s in steps]
        top = meta.get("output_top_logprobs") or [None] * len(steps)
        if self._candidates(req) > 0:
            for i, cands in enumerate(top):
                lp = filtered_logprob(logprobs[i], [float(c[0]) for c in cands or ()], req.top_k, req.top_p)
                if lp is None:
                    raise EngineError(
                        f"top_p={req.top_p} nucleus is wider than the {self._top_p_candidates} candidates SGLang "
                        "returned, so the log-prob cannot be renormalised: set top_k too, or raise top_p_candidates"
                    )
                logprobs[i] = lp
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, Mapping) else str(finish)
        reason = _FINISH.get(str(kind))
        if reason is None:
            raise EngineError(f"SGLang ended a request with finish_reason={finish!r}")
        return GenerateResult(tokens, logprobs, reason, self._version)

    def _write_dir(self, state: Mapping[str, torch.Tensor], version: int) -> Path:
        import json

        if self._root is None:
            self._root = shm_root()
            weakref.finalize(self, shutil.rmtree, self._root, True)
        self._loads += 1
        for old in self._root.iterdir():
            shutil.rmtree(old, ignore_errors=True)
        config = json.loads((self._model_dir / "config.json").read_text())
        return write_checkpoint(state, self._root / f"v{version}-{self._loads}", config)


def _outcome(ret: Any) -> tuple[bool, str]:
    """(success, message) from what SGLang's weight-update calls return (a tuple or an object)."""
    if isinstance(ret, tuple | list) and ret:
        return bool(ret[0]), str(ret[1]) if len(ret) > 1 else ""
    if isinstance(ret, Mapping):
        return bool(ret.get("success", True)), str(ret.get("message", ""))
    success = getattr(ret, "success", None)
    return (True, "") if success is None else (bool(success), str(getattr(ret, "message", "")))
