"""What `VllmEngine` needs to restart vLLM smaller after it ran out of memory (the policy is `oom_restart`'s).

Owns: which of vLLM's start-up knobs holds its memory (`memory_settings`: the `VLLM_CPU_KVCACHE_SPACE`
environment variable where it is set on CPU, else `kv_cache_memory_bytes` where the engine sized the KV
cache exactly, else `gpu_memory_utilization`) and its floor, writing lowered settings back
(`apply_settings`), and the file vLLM's child processes write their errors to (`ErrorLog`).

Why a file: vLLM runs its scheduler (EngineCore) and model (Worker) in child processes. When one of them
runs out of memory, the engine's process sees only "Engine core initialization failed. See root cause
above" or `EngineDeadError`; the allocator's message is in the child's log. vLLM applies a
`LoggingConfig` in every one of its processes, so its own configuration plus a file handler at ERROR
level brings that message back to this process, where `oom_restart.oom_evidence` reads it.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from earl_stream.workers.engines.oom_restart import EngineSettings, RestartPolicy

_LOG = logging.getLogger(__name__)

CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB, an integer (vLLM's legacy CPU knob; overrides kv_cache_memory_bytes)
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
        config["handlers"]["earl_errors"] = {"class": "logging.FileHandler", "filename": str(self._path),
                                             "level": "ERROR", "formatter": "vllm", "delay": True}
        config["loggers"]["vllm"]["handlers"] = [*config["loggers"]["vllm"]["handlers"], "earl_errors"]
        config_file = self._root / f"vllm-logging-{attempt}.json"
        config_file.write_text(json.dumps(config))
        return LoggingConfig(pylogging_config_file=str(config_file))

    def text(self) -> str:
        if self._path is None or not self._path.exists():
            return ""
        return self._path.read_text(errors="replace")
