"""A real vLLM that runs out of memory is restarted smaller and every request completes (run by
`make test-vllm`; skipped where vllm is absent).

The real failures, in a child process whose address space is capped (`RLIMIT_AS`: set on vLLM's live
EngineCore and Worker with prlimit, at what each holds plus HEADROOM_MIB, and on the child itself, which
the processes it starts next inherit):
- while generating: 8 prompts of 500 tokens prefilled in one step (the test model's MLP is wide on purpose,
  16,384, so that step's activations are hundreds of MB) do not fit in the headroom: the Worker's allocator
  fails, the EngineCore dies, the engine restarts with max_num_seqs 8 -> 4 (4 prompts per step) and its KV
  cache at its floor, and re-issues the 8 requests;
- at start: a KV cache of 1.5 x HEADROOM_MIB does not fit, 0.75 x does.
Tokens and policy versions after each restart equal those of the uncapped engine (log-probs to 1e-4).
Measured here (2 shared cores): ~75 s per restart, ~6 min for the whole test.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

MiB = 1 << 20
HEADROOM_MIB = 600
PROMPTS, LONG, SHORT, NEW = 8, 500, 16, 8
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # K and V x 2 layers x 2 KV heads x head_dim 32 x fp32 (the model below)

if __name__ not in ("__main__", "__mp_main__"):  # pytest's import, not the child's (nor vLLM's spawned ones)
    from engine_skip import require_engine

    pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux")]
    require_engine("vllm")


def _model_dir(out: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=16384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


def _requests(length: int) -> list:
    import torch

    from earl_stream.workers.engines import GenerateRequest

    gen = torch.Generator().manual_seed(length)
    return [GenerateRequest(torch.randint(2, 512, (length,), generator=gen).tolist(), NEW, temperature=0.0)
            for _ in range(PROMPTS)]


def _engine_processes() -> list:
    import psutil

    return [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")]


def _cap(headroom: int) -> int:
    """Cap vLLM's live processes at what each holds plus `headroom`, and this process (inherited by the ones it
    starts from now on) at what the largest of them holds plus `headroom`; returns that cap."""
    held = 0
    for proc in _engine_processes():
        vms = proc.memory_info().vms
        proc.rlimit(resource.RLIMIT_AS, (vms + headroom, vms + headroom))
        held = max(held, vms)
    resource.setrlimit(resource.RLIMIT_AS, (held + headroom, held + headroom))
    return held + headroom


def _restarts(engine: object) -> list[dict]:
    return [{"phase": r.phase.value, "before": [r.before.seqs, r.before.memory], "after": [r.after.seqs, r.after.memory],
             "seconds": r.seconds, "reissued": r.reissued, "evidence": r.evidence} for r in engine.oom_restarts]


def _results(results: list) -> list:
    return [[r.token_ids, r.logprobs, r.policy_version] for r in results]


def main(model: Path, out: Path) -> None:
    """The child: the uncapped reference, then the capped runs; writes what happened as JSON."""
    from earl_stream.workers.engines.vllm_engine import VllmEngine

    long, short = _requests(LONG), _requests(SHORT)
    report: dict = {}
    llm_kwargs = {"max_num_batched_tokens": PROMPTS * LONG + 96}  # all 8 long prompts in one prefill step
    # no prefix caching: the capped run must prefill the long prompts again, not find them cached
    engine = VllmEngine(model, max_batch_size=PROMPTS, kv_budget_tokens=8192, llm_kwargs=llm_kwargs,
                        enable_prefix_caching=False)
    report["reference_long"] = _results(engine.generate(long))
    report["reference_short"] = _results(engine.generate(short))
    report["cap_mib"] = _cap(HEADROOM_MIB * MiB) // MiB
    began = time.monotonic()
    report["capped_long"] = _results(engine.generate(long))
    report["generate_seconds"] = time.monotonic() - began
    report["generate_restarts"] = _restarts(engine)
    report["generate_capacity"] = [engine.capacity.max_concurrent_sequences, engine.capacity.kv_budget_tokens]
    report["generate_sheds"] = engine.oom_shed_total
    engine.close()

    kv_tokens = int(1.5 * HEADROOM_MIB * MiB) // KV_BYTES_PER_TOKEN
    began = time.monotonic()
    engine = VllmEngine(model, max_batch_size=PROMPTS, kv_budget_tokens=kv_tokens, llm_kwargs=llm_kwargs)
    report["start_seconds"] = time.monotonic() - began
    report["start_restarts"] = _restarts(engine)
    report["capped_short"] = _results(engine.generate(short))
    report["start_sheds"] = engine.oom_shed_total
    engine.close()
    from prometheus_client import REGISTRY

    report["counter"] = REGISTRY.get_sample_value("earl_rollout_oom_shed_total")
    out.write_text(json.dumps(report))


def _same(got: list, want: list) -> None:
    """The same tokens and policy version (0) per request; log-probs to float32 noise (the batches differ)."""
    assert [(g[0], g[2]) for g in got] == [(w[0], w[2]) for w in want]
    assert max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g[1], w[1])) < 1e-4


def test_vllm_out_of_memory_restarts_smaller_and_every_request_completes(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "wide")
    out = tmp_path / "report.json"
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    proc = subprocess.run([sys.executable, __file__, str(model), str(out)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-6000:]
    report = json.loads(out.read_text())
    print(json.dumps({k: v for k, v in report.items() if "reference" not in k and "capped" not in k}, indent=1))

    # while generating: one restart, both knobs halved, the 8 requests re-issued and answered exactly
    (restart,) = report["generate_restarts"]
    assert restart["phase"] == "generate" and restart["reissued"] == PROMPTS
    floor = (4096 // 256 + 1) * 256 * KV_BYTES_PER_TOKEN  # one 4,096-token sequence in whole blocks
    assert restart["after"] == [PROMPTS // 2, max(floor, restart["before"][1] // 2)]
    assert "DefaultCPUAllocator: can't allocate memory" in restart["evidence"]
    assert report["generate_sheds"] == 1 and report["generate_capacity"][0] == PROMPTS // 2
    _same(report["capped_long"], report["reference_long"])

    # at start: the KV cache that does not fit is halved until it does
    assert report["start_restarts"] and all(r["phase"] == "start" for r in report["start_restarts"])
    assert report["start_restarts"][0]["after"][1] == report["start_restarts"][0]["before"][1] // 2
    assert report["start_sheds"] == len(report["start_restarts"])
    _same(report["capped_short"], report["reference_short"])
    assert report["counter"] == report["generate_sheds"] + report["start_sheds"]  # earl_rollout_oom_shed_total


def test_the_error_log_brings_back_what_vllm_logs_and_outlives_its_directory(tmp_path: Path) -> None:
    """What `ErrorLog` configures is applied as vLLM applies it (here in this process): an error reaches the
    file and `oom_evidence`; once the engine's directory is deleted, an error logged later raises nothing."""
    import logging
    import shutil

    from vllm.logger import configure_logging

    from earl_stream.workers.engines.oom_restart import oom_evidence
    from earl_stream.workers.engines.vllm_oom import ErrorLog

    root = tmp_path / "engine"
    root.mkdir()
    log = ErrorLog(root)
    configure_logging(log.logging_config(1))
    try:
        logging.getLogger("vllm.v1.worker").info("not an error: not kept")
        logging.getLogger("vllm.v1.worker").error("RuntimeError: DefaultCPUAllocator: can't allocate memory: 1 bytes")
        assert "not kept" not in log.text()
        assert "DefaultCPUAllocator: can't allocate memory: 1 bytes" in (oom_evidence(log.text()) or "")
        shutil.rmtree(root)
        for handler in logging.getLogger("vllm").handlers:
            handler.close()
        logging.getLogger("vllm.v1.worker").error("logged after the engine was closed")
    finally:
        from vllm.config.logging import LoggingConfig

        configure_logging(LoggingConfig())  # vLLM's own configuration again


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
