"""The restart policy of the external engines after an out-of-memory failure (`oom_restart`, `vllm_oom`):
the next settings, the floors, the limit, the final error, and what counts as evidence of running out of
memory. Pure: no engine is started (the vLLM tier's test_vllm_oom_restart.py starts a real one)."""

from __future__ import annotations

import os

import pytest

from earl_stream.errors import EngineError
from earl_stream.workers.engines.oom_restart import EngineOutOfMemory, EngineSettings, OomPhase, RestartPolicy, exception_text, oom_evidence
from earl_stream.workers.engines.vllm_oom import CPU_KV_ENV, apply_settings, memory_settings

MiB = 1 << 20
KV = EngineSettings(64, 1024.0 * MiB, "max_num_seqs", "kv_cache_memory_bytes")


def test_a_failure_at_start_halves_the_memory_and_keeps_the_sequences() -> None:
    after = RestartPolicy(min_memory=64 * MiB).next(KV, OomPhase.START, 0, "vLLM", "e", "hint")
    assert after == EngineSettings(64, 512.0 * MiB, "max_num_seqs", "kv_cache_memory_bytes")


def test_a_failure_while_generating_lowers_both_knobs_by_the_factor() -> None:
    after = RestartPolicy(min_memory=64 * MiB, factor=0.75).next(KV, OomPhase.GENERATE, 0, "vLLM", "e", "hint")
    assert (after.seqs, after.memory) == (48, 768.0 * MiB)


def test_the_floors_hold_and_an_integer_knob_rounds_down() -> None:
    policy = RestartPolicy(min_memory=700 * MiB + 1, min_seqs=40)
    after = policy.next(KV, OomPhase.GENERATE, 0, "vLLM", "e", "hint")
    assert (after.seqs, after.memory) == (40, 700.0 * MiB + 1)  # neither below its floor
    gib = EngineSettings(8, 3.0, "max_num_seqs", CPU_KV_ENV)
    assert RestartPolicy(min_memory=1).next(gib, OomPhase.START, 0, "vLLM", "e", "h").memory == 1.0  # 1.5 -> 1
    share = EngineSettings(8, 0.9, "max_num_seqs", "gpu_memory_utilization")
    lowered = RestartPolicy(min_memory=0.05, integer_memory=False).next(share, OomPhase.START, 0, "vLLM", "e", "h")
    assert lowered.memory == pytest.approx(0.45)


def test_repeated_failures_walk_down_to_the_floor_then_fail_naming_the_knobs() -> None:
    policy = RestartPolicy(min_memory=300 * MiB, max_restarts=10)
    now, seen = KV, []
    with pytest.raises(EngineOutOfMemory) as failed:
        for restarts in range(10):
            now = policy.next(now, OomPhase.START, restarts, "vLLM", "DefaultCPUAllocator: can't allocate", "knobs")
            seen.append(now.memory)
    assert seen == [512.0 * MiB, 300.0 * MiB]  # 1024 -> 512 -> floor; the next one has nothing left to lower
    message = str(failed.value)
    assert "at its floor (max_num_seqs=1, kv_cache_memory_bytes=314572800)" in message
    assert "max_num_seqs=64, kv_cache_memory_bytes=314572800" in message and message.endswith("knobs")
    assert "DefaultCPUAllocator" in message and isinstance(failed.value, EngineError)


def test_the_restart_limit_ends_it_even_above_the_floor() -> None:
    policy = RestartPolicy(min_memory=1, max_restarts=2)
    assert policy.next(KV, OomPhase.GENERATE, 1, "SGLang", "e", "h").seqs == 32
    with pytest.raises(EngineOutOfMemory, match=r"SGLang ran out of memory \(generate\) with max_num_seqs=64, "
                                                r"kv_cache_memory_bytes=1073741824, after 2 restart\(s\), the limit"):
        policy.next(KV, OomPhase.GENERATE, 2, "SGLang", "e", "h")


@pytest.mark.parametrize("bad", [dict(factor=1.0), dict(factor=0.0), dict(max_restarts=-1), dict(min_seqs=0),
                                 dict(min_memory=0)])
def test_a_policy_that_cannot_lower_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(EngineError):
        RestartPolicy(**{"min_memory": 1.0, **bad})


def test_evidence_is_found_in_a_cause_or_a_child_log_and_nowhere_else() -> None:
    child = ("(Worker pid=1) ERROR [multiproc_executor.py:1063] RuntimeError: [enforce fail at alloc_cpu.cpp:127] "
             "err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 2048917504 bytes.")
    dead = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {'x': 1}")
    assert oom_evidence(exception_text(dead)) is None  # what vLLM's own process sees: no reason
    assert oom_evidence(exception_text(dead), "INFO ready\n" + child) == child.strip()
    try:
        try:
            raise ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization`")
        except ValueError as inner:
            raise EngineError("vLLM could not start") from inner
    except EngineError as exc:
        assert "No available memory" in (oom_evidence(exception_text(exc)) or "")
    assert oom_evidence("ValueError: max_model_len 9000 is larger than the model's 4096") is None


def test_vllm_knobs_are_chosen_and_written_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CPU_KV_ENV, raising=False)
    kwargs = {"max_num_seqs": 8, "kv_cache_memory_bytes": 1 << 30, "gpu_memory_utilization": 0.2}
    settings, policy = memory_settings(kwargs, 10 * MiB, on_cpu=True)
    assert settings.memory_knob == "kv_cache_memory_bytes" and policy.min_memory == 10 * MiB
    after = policy.next(settings, OomPhase.GENERATE, 0, "vLLM", "e", "h")
    apply_settings(after, kwargs)
    assert kwargs == {"max_num_seqs": 4, "kv_cache_memory_bytes": 1 << 29, "gpu_memory_utilization": 0.2}

    settings, policy = memory_settings({"max_num_seqs": 8, "kv_cache_memory_bytes": None}, 10 * MiB, on_cpu=False)
    assert (settings.memory_knob, settings.memory, policy.integer_memory) == ("gpu_memory_utilization", 0.9, False)

    monkeypatch.setenv(CPU_KV_ENV, "4")  # vLLM's legacy CPU variable overrides kv_cache_memory_bytes: lower it
    settings, policy = memory_settings(kwargs, 10 * MiB, on_cpu=True)
    assert (settings.memory_knob, settings.memory, policy.min_memory) == (CPU_KV_ENV, 4.0, 1)
    apply_settings(policy.next(settings, OomPhase.START, 0, "vLLM", "e", "h"), kwargs)
    assert os.environ[CPU_KV_ENV] == "2"


def test_an_engines_restart_record_counts_every_lowering_and_keeps_the_last_records() -> None:
    """`RestartRecord`, what vLLM and SGLang report: a lowering counts at once (a start that failed again
    too), the finished restarts are kept, oldest first, up to `RECORDS`."""
    from earl_stream.workers.engines.oom_restart import EngineSettings, OomPhase, OomRestart, RestartRecord

    class Engine(RestartRecord):
        RECORDS = 2

    engine = Engine()
    engine._init_restart_record()
    assert engine.oom_restarts == () and engine.oom_shed_total == 0
    settings = EngineSettings(8, 1.0, "max_num_seqs", "kv_cache_memory_bytes")
    for k in range(3):
        engine._count_restart()
        engine._record_restart(OomRestart(float(k), OomPhase.GENERATE, settings, settings, 0.1, k, "MemoryError"))
    engine._count_restart()  # lowered, not yet restarted
    assert engine.oom_shed_total == 4
    assert [r.reissued for r in engine.oom_restarts] == [1, 2]
