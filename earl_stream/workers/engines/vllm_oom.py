"""What `VllmEngine` needs to restart vLLM smaller after it ran out of memory (the policy is `oom_restart`'s).

Owns: the restart itself (`VllmRestarts`, which `VllmEngine` mixes in: stop, lower, start again while the
start runs out of memory, record, count as a shed), which of vLLM's start-up knobs holds its memory
(`memory_settings`: the `VLLM_CPU_KVCACHE_SPACE` environment variable where it is set on CPU, else
`kv_cache_memory_bytes` where the engine sized the KV cache exactly, else `gpu_memory_utilization`) and its
floor, writing lowered settings back (`apply_settings`), and the file vLLM's child processes write their
errors to (`ErrorLog`). Re-issuing the requests in flight is the engine's (`VllmEngine.generate`).

Why a file: vLLM runs its scheduler (EngineCore) and model (Worker) in child processes. When one of them
runs out of memory, the engine's process sees only "Engine core initialization failed. See root cause
above" or `EngineDeadError`; the allocator's message is in the child's log. vLLM applies a
`LoggingConfig` in every one of its processes, so its own configuration plus a file handler at ERROR
level brings that message back to this process, where `oom_restart.oom_evidence` reads it.
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from earl_stream import metrics as M
from earl_stream.errors import EngineError
from earl_stream.workers.engines.base import EngineCapacity
from earl_stream.workers.engines.oom_restart import (
    EngineSettings,
    OomPhase,
    OomRestart,
    RestartPolicy,
    RestartRecord,
    exception_text,
    oom_evidence,
)

_LOG = logging.getLogger(__name__)

CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB, an integer (vLLM's legacy CPU knob; overrides kv_cache_memory_bytes)
# KV blocks are allocated whole and vLLM keeps one block back; rounding the budget up to this many
# tokens and adding as many covers every block size.
KV_ROUND_TOKENS = 256
MIN_GPU_MEMORY_UTILIZATION = 0.05  # below this share of a device, vLLM holds little more than the weights
HINT = ("rollout.max_batch_size (max_num_seqs), rollout.memory_bytes (the KV budget, kv_cache_memory_bytes), "
        f"or gpu_memory_utilization / {CPU_KV_ENV} where those size vLLM's KV cache")


def memory_settings(kwargs: dict[str, Any], min_kv_bytes: int, on_cpu: bool,
                    factor: float = 0.5, max_restarts: int = 4) -> tuple[EngineSettings, RestartPolicy]:
    """The settings `vllm.LLM(**kwargs)` starts with and the restart policy for its memory knob.

    `min_kv_bytes`: the KV cache that holds one sequence of the engine's maximum length (the floor of an
    explicit KV size: a request the engine accepted must still fit after a restart)."""
    seqs = int(kwargs["max_num_seqs"])
    env = os.environ.get(CPU_KV_ENV, "")
    if on_cpu and env:
        gib = max(1, math.ceil(min_kv_bytes / (1 << 30)))
        settings = EngineSettings(seqs, float(int(env)), "max_num_seqs", CPU_KV_ENV)
        return settings, RestartPolicy(min_memory=gib, factor=factor, max_restarts=max_restarts)
    if kwargs.get("kv_cache_memory_bytes") is not None:
        settings = EngineSettings(seqs, float(kwargs["kv_cache_memory_bytes"]), "max_num_seqs", "kv_cache_memory_bytes")
        return settings, RestartPolicy(min_memory=min_kv_bytes, factor=factor, max_restarts=max_restarts)
    settings = EngineSettings(seqs, float(kwargs.get("gpu_memory_utilization", 0.9)), "max_num_seqs",
                              "gpu_memory_utilization")
    return settings, RestartPolicy(min_memory=MIN_GPU_MEMORY_UTILIZATION, factor=factor, max_restarts=max_restarts,
                                   integer_memory=False)


def apply_settings(settings: EngineSettings, kwargs: dict[str, Any]) -> None:
    """Write `settings` into `kwargs` (or the environment variable, for `VLLM_CPU_KVCACHE_SPACE`)."""
    kwargs["max_num_seqs"] = settings.seqs
    if settings.memory_knob == CPU_KV_ENV:
        os.environ[CPU_KV_ENV] = str(int(settings.memory))
    elif settings.memory_knob == "kv_cache_memory_bytes":
        kwargs["kv_cache_memory_bytes"] = int(settings.memory)
    else:
        kwargs[settings.memory_knob] = settings.memory


class ErrorFileHandler(logging.FileHandler):
    """The file handler of `ErrorLog` (in vLLM's processes): silent when the file cannot be written, as after the
    engine was closed and its directory deleted (vLLM keeps the logging configuration of its last start)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:  # FileHandler opens a delayed or closed file outside its own error handling
            super().emit(record)
        except OSError:
            pass

    def handleError(self, record: logging.LogRecord) -> None:
        pass


class ErrorLog:
    """A file per vLLM start that vLLM's processes (this one and its children) append their errors to.

    `logging_config(attempt)` returns the `vllm.config.LoggingConfig` to start vLLM with (None when the user
    configures vLLM's logging: theirs is kept, and an out-of-memory failure in a child is then recognised
    only where its message reaches this process); `text()` what the current start's processes logged."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._path: Path | None = None
        self.enabled = os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0" and not os.environ.get(
            "VLLM_LOGGING_CONFIG_PATH")
        if not self.enabled:
            _LOG.warning("vLLM's logging is configured outside earl_stream: an out-of-memory failure in vLLM's "
                         "child processes is not recognised (the engine then fails instead of restarting smaller)")

    def logging_config(self, attempt: int) -> Any:
        if not self.enabled:
            return None
        from vllm import envs
        from vllm.config.logging import LoggingConfig
        from vllm.logger import DEFAULT_LOGGING_CONFIG

        self._path = self._root / f"vllm-errors-{attempt}.log"
        self._path.unlink(missing_ok=True)
        config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)  # what vLLM applies by default, refreshed as vLLM does
        config["handlers"]["vllm"].update(level=envs.VLLM_LOGGING_LEVEL, stream=envs.VLLM_LOGGING_STREAM)
        config["handlers"]["earl_errors"] = {"()": f"{__name__}.ErrorFileHandler", "filename": str(self._path),
                                             "level": "ERROR", "formatter": "vllm", "delay": True}
        config["loggers"]["vllm"]["handlers"] = [*config["loggers"]["vllm"]["handlers"], "earl_errors"]
        config_file = self._root / f"vllm-logging-{attempt}.json"
        config_file.write_text(json.dumps(config))
        return LoggingConfig(pylogging_config_file=str(config_file))

    def text(self) -> str:
        if self._path is None or not self._path.exists():
            return ""
        return self._path.read_text(errors="replace")


Failure = tuple[OomPhase, str, int]  # (phase, evidence, requests in flight)


class VllmRestarts(RestartRecord):
    """The out-of-memory restarts of `VllmEngine` (mixed in: its vLLM handle and start-up values are the engine's;
    when vLLM ran out of memory, stopping, lowering and starting it again is this class's)."""

    _llm: Any
    _kwargs: dict[str, Any]
    _started: EngineCapacity
    _capacity: EngineCapacity
    _max_len: int
    _kv_bytes_per_token: int
    _weights_dir: Path | None
    _model_dir: Path
    _root: Path

    def _start(self, vllm: Any, kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError

    def _init_restarts(self, kwargs: dict[str, Any], min_kv_bytes: int, factor: float, max_restarts: int) -> None:
        from vllm.platforms import current_platform

        self._kwargs = kwargs
        self._errors = ErrorLog(self._root)
        self._errors.enabled = self._errors.enabled and "logging_config" not in kwargs
        self._settings, self._policy = memory_settings(kwargs, min_kv_bytes, current_platform.is_cpu(), factor,
                                                       max_restarts)
        self._init_restart_record()
        self._starts = 0

    def _oom_evidence(self, exc: BaseException) -> str | None:
        """What says `exc` (a failed start or batch) was vLLM running out of memory: its chain or a child's log."""
        return oom_evidence(exception_text(exc), self._errors.text())

    def _restart(self, phase: OomPhase, evidence: str, reissued: int) -> None:
        """vLLM ran out of memory in `phase` with `reissued` requests in flight: stop it, start it lower."""
        self._stop()
        self._llm = self._start_fitting(importlib.import_module("vllm"), (phase, evidence, reissued))

    def _start_fitting(self, vllm: Any, failure: Failure | None = None) -> Any:
        """Start vLLM, first lowered after `failure`, and lowered again while it runs out of memory starting;
        `EngineOutOfMemory` past the policy's limit or floor."""
        while True:
            before = self._settings
            if failure is not None:
                self._lower(*failure)
            began = time.monotonic()
            try:
                llm = self._start(vllm, self._attempt_kwargs())
            except EngineError as exc:
                evidence = self._oom_evidence(exc)
                if failure is not None:
                    self._record(failure, before, time.monotonic() - began, started=False)
                if evidence is None:
                    raise
                failure = (OomPhase.START, evidence, 0)
                continue
            if failure is not None:
                self._record(failure, before, time.monotonic() - began, started=True)
            return llm

    def _lower(self, phase: OomPhase, evidence: str, reissued: int) -> None:
        """Lower the settings after a failure (raises `EngineOutOfMemory` past the limit); capacity follows."""
        before = self._settings
        self._settings = self._policy.next(before, phase, self._restart_total, "vLLM", evidence, HINT)
        apply_settings(self._settings, self._kwargs)
        self._count_restart()
        M.ROLLOUT_OOM_SHED.inc()
        kv_tokens = self._started.kv_budget_tokens
        if self._settings.memory_knob == "kv_cache_memory_bytes":  # vLLM keeps one block back
            kv_tokens = min(kv_tokens, max(self._max_len, int(self._settings.memory) // self._kv_bytes_per_token
                                           - KV_ROUND_TOKENS))
        self._started = EngineCapacity(self._settings.seqs, kv_tokens)
        self._capacity = EngineCapacity(min(self._capacity.max_concurrent_sequences, self._settings.seqs),
                                        min(self._capacity.kv_budget_tokens, kv_tokens))
        self._kwargs["model"] = str(self._weights_dir or self._model_dir)  # the current version's weights
        _LOG.warning("vLLM ran out of memory (%s, %d request(s) in flight): restarting it with %s (was %s); "
                     "capacity now %s. Cause: %s", phase.value, reissued, self._settings.describe(),
                     before.describe(), self._capacity, evidence)

    def _record(self, failure: Failure, before: EngineSettings, seconds: float, started: bool) -> None:
        phase, evidence, reissued = failure
        self._record_restart(OomRestart(time.time(), phase, before, self._settings, seconds, reissued, evidence))
        if started:
            _LOG.warning("vLLM restarted after running out of memory in %.1f s with %s; re-issuing %d request(s)",
                         seconds, self._settings.describe(), reissued)

    def _attempt_kwargs(self) -> dict[str, Any]:
        self._starts += 1
        config = self._errors.logging_config(self._starts)
        return self._kwargs if config is None else {**self._kwargs, "logging_config": config}
