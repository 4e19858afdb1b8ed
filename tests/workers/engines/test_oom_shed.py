"""The built-in engine sheds load on an allocation failure instead of failing its requests or dying.

The real failure: a child process caps its own address space (`RLIMIT_AS`) a little above what it holds
once the model and engine are built, then plays two turns of 8 episodes. The first turn (256-token prompts)
fits; the second (contexts grown to ~1.3k tokens, admitted together) does not: the allocator fails for
real, the engine sheds, and every turn completes with the greedy tokens and log-probs of an uncapped run.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from earl_stream.workers.engines import GenerateRequest, GenerateResult, TorchEngine
from earl_stream.workers.engines.fast_decoder import FastDecoder
from earl_stream.workers.engines.shedding import RequestOutOfMemory, StepPhase
from earl_stream.workers.oom import attempted_bytes, is_allocation_failure

EPISODES, FIRST, GROWN, NEW = 8, 256, 1024, 6
# Address space the child may add to what it holds before the turns: the 8-row prefill of ~1.3k-token
# contexts (kept KV reused) fails, 4 rows without it fail, 2 fit (large blocks are mmapped, so freed ones return).
HEADROOM_MIB = 200
ALONE_HEADROOM_MIB = 60  # a 2k-token prompt alone does not fit, a 16-token one does
_LINUX = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc to size the cap")


def _model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=4, intermediate_size=1024, tie_word_embeddings=False,
                         max_position_embeddings=4096)
    return Qwen2ForCausalLM(config).eval()


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _two_turns(engine: TorchEngine) -> list[list[GenerateResult]]:
    """Turn 1 of every episode, then turn 2 on the grown context (prompt, turn 1, a long new message)."""
    first = [GenerateRequest(_tokens(FIRST, i), NEW, temperature=0.0, cache_key=f"ep{i}") for i in range(EPISODES)]
    got = engine.generate(first)
    second = [GenerateRequest([*r.prompt_ids, *g.token_ids, *_tokens(GROWN, 100 + i)], NEW, temperature=0.0,
                              cache_key=f"ep{i}") for i, (r, g) in enumerate(zip(first, got))]
    return [got, engine.generate(second)]


def _vm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


def _child(mode: str) -> None:
    """Run the two turns (`turns`), or a request too large alone then a small one (`alone`), under an
    address-space cap; print the results and sheds as one JSON line."""
    from prometheus_client import REGISTRY

    torch.set_num_threads(1)
    chunk = 512 if mode == "alone_chunked" else 0  # whole prefills: their transient is what runs out
    engine = TorchEngine(_model(), max_batch_size=64, kv_budget_tokens=1 << 20, max_prefill_tokens=0,
                         prefill_chunk_tokens=chunk)
    cap = _vm_bytes() + (HEADROOM_MIB if mode == "turns" else ALONE_HEADROOM_MIB) * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.RLIM_INFINITY))
    if mode.startswith("alone"):
        big, small = GenerateRequest(_tokens(2048, 0), NEW, temperature=0.0), GenerateRequest(_tokens(16, 1), NEW)
        try:
            tokens = engine.generate([big])[0].token_ids
        except RequestOutOfMemory as exc:
            print(json.dumps({"error": str(exc), "sheds": len(engine.oom_sheds),
                              "in_use": engine.oom_sheds[-1].bytes_in_use, "cap": cap,
                              "small": engine.generate([small])[0].token_ids}))
            return
        print(json.dumps({"error": None, "sheds": len(engine.oom_sheds), "tokens": tokens}))
        return
    turns = _two_turns(engine)
    sheds = [{"phase": s.phase.value, "before": s.sequences_before, "after": s.max_sequences_after,
              "bytes": s.bytes_attempted, "failed": s.failed} for s in engine.oom_sheds]
    print(json.dumps({"cap": cap, "sheds": sheds, "counter": REGISTRY.get_sample_value("earl_rollout_oom_shed_total"),
                      "turns": [[[g.token_ids, g.logprobs, g.policy_version, g.token_versions] for g in t] for t in turns]}))


def _run_child(mode: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, __file__, mode], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return out


@_LINUX
def test_a_real_allocation_failure_is_shed_and_every_turn_completes_unchanged() -> None:
    out = _run_child("turns")
    assert out["sheds"], f"no allocation failed under a {HEADROOM_MIB} MiB headroom: the test no longer sheds"
    assert all(s["failed"] == 0 and s["phase"] == "prefill" for s in out["sheds"]), out["sheds"]
    assert out["sheds"][0]["before"] == EPISODES and out["sheds"][0]["bytes"] > 0
    assert out["counter"] == len(out["sheds"])

    want = _two_turns(TorchEngine(_model(), max_batch_size=64, kv_budget_tokens=1 << 20, max_prefill_tokens=0,
                                  prefill_chunk_tokens=0))
    for got_turn, want_turn in zip(out["turns"], want, strict=True):
        for (tokens, logprobs, version, versions), ref in zip(got_turn, want_turn, strict=True):
            assert tokens == ref.token_ids
            assert logprobs == pytest.approx(ref.logprobs, abs=1e-4)
            assert (version, versions) == (0, None)


@_LINUX
def test_a_request_that_cannot_run_alone_fails_alone_and_the_engine_goes_on() -> None:
    out = _run_child("alone")
    assert "ran out of memory in a prefill step with no other sequence running" in out["error"]
    assert out["sheds"] == 1 and len(out["small"]) == NEW
    assert 0 < out["in_use"] < out["cap"]  # the evidence the heartbeat carries: the resident size when it failed


@_LINUX
def test_the_same_prompt_in_chunks_fits_the_cap_it_failed_under_whole() -> None:
    out = _run_child("alone_chunked")
    assert out["error"] is None and out["sheds"] == 0
    want = TorchEngine(_model(), prefill_chunk_tokens=0).generate([GenerateRequest(_tokens(2048, 0), NEW,
                                                                                   temperature=0.0)])
    assert out["tokens"] == want[0].token_ids


def test_a_decode_step_that_fails_keeps_the_sampled_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode side, where a real cap cannot aim: the allocator's error raised at the fast decoder's
    one-token forward of a 4-row batch (the failure injected at the allocation site, not the engine)."""
    model = _model()
    reqs = [GenerateRequest(_tokens(32, i), 12, temperature=0.0) for i in range(4)]
    want = TorchEngine(model).generate(reqs)
    forward, calls = FastDecoder.forward, {"decode": 0}

    def failing(self: FastDecoder, ids: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if ids.shape == (4, 1):
            calls["decode"] += 1
            if calls["decode"] == 5:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes.")
        return forward(self, ids, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(FastDecoder, "forward", failing)
    engine = TorchEngine(model)
    got = engine.generate(reqs)
    (shed,) = engine.oom_sheds
    assert engine.oom_shed_total == 1  # what the rollout worker reports in its heartbeat (oom_sheds)
    assert (shed.phase, shed.sequences_before, shed.max_sequences_after, shed.requeued) == (StepPhase.DECODE, 4, 2, 4)
    assert shed.bytes_attempted == 4096 and engine.capacity.max_concurrent_sequences == 2
    assert shed.bytes_in_use > 0  # the process's resident size when it failed (reported with the bytes asked)
    assert engine.stats.prefill_tokens == 4 * 32 + 4 * (32 + 5)  # re-prefilled with the 5 tokens sampled before
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids and g.logprobs == pytest.approx(w.logprobs, abs=1e-4)


def test_is_allocation_failure_knows_the_three_kinds_and_nothing_else() -> None:
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                       "you tried to allocate 33554432 bytes. Error code 12 (Cannot allocate memory)")
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)")
    assert is_allocation_failure(cpu) and is_allocation_failure(cuda) and is_allocation_failure(MemoryError())
    assert attempted_bytes(cpu) == 33554432 and attempted_bytes(cuda) == 2 * 2**30
    assert attempted_bytes(MemoryError()) is None
    for other in (RuntimeError("shape '[2, 3]' is invalid for input of size 5"), ValueError("out of memory"),
                  RuntimeError("expected scalar type Float but found Half"), KeyError("memory")):
        assert not is_allocation_failure(other)


def test_a_real_cpu_allocator_failure_is_recognised() -> None:
    with pytest.raises(RuntimeError) as failed:
        torch.empty(1 << 62, dtype=torch.uint8)
    assert is_allocation_failure(failed.value)


if __name__ == "__main__":
    _child(sys.argv[1])
