"""A trainer step that fails to allocate is abandoned with nothing applied (`workers.oom_step`): before the
optimizer steps, the gradients are dropped, the RNG is back where the step began and the weights and
optimizer state are those of the last completed step; a failure after an optimizer step, or an error that is
not an allocation failure, is raised as before. The real failure: a child process under RLIMIT_AS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from earl_stream.workers.oom_step import AS_HEADROOM_ENV, AllocationFailure, run_guarded

CPU = torch.device("cpu")
MESSAGE = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1073741824 bytes. Error code 12"


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()  # a completed step: the optimizer has state
    opt.zero_grad(set_to_none=True)
    return model, opt


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()] + [
        v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def test_a_failure_before_the_update_leaves_the_last_completed_step() -> None:
    model, opt = _model()
    before, rng = _state(model, opt), torch.get_rng_state()

    def step() -> float:
        torch.rand(3)  # the attempt draws from the RNG
        model(torch.ones(2, 8)).sum().backward()
        raise RuntimeError(MESSAGE)

    out = run_guarded(step, opt, CPU)
    assert isinstance(out, AllocationFailure) and out.attempted_bytes == 1 << 30 and "can't allocate" in out.error
    assert out.failed >= out.started
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model, opt)))
    assert torch.equal(torch.get_rng_state(), rng)
    assert run_guarded(lambda: 7, opt, CPU) == 7 and not opt._optimizer_step_pre_hooks  # the hook is removed


def test_a_failure_after_the_optimizer_stepped_or_another_error_is_raised() -> None:
    model, opt = _model()

    def after_update() -> None:
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        raise MemoryError()

    with pytest.raises(MemoryError):
        run_guarded(after_update, opt, CPU)

    def bug() -> None:
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        run_guarded(bug, opt, CPU)


def test_a_peers_failure_abandons_the_step_the_same_way() -> None:
    """In a pool, the error a rank sees when another rank abandoned the step (its collective fails) becomes
    the same abandoned step when `peer_failure` explains it, with the same clean-up; unexplained, or after
    the optimizer stepped, it is raised as it is (`workers.pool_abort` supplies the hook)."""
    model, opt = _model()
    before, rng = _state(model, opt), torch.get_rng_state()
    peer = AllocationFailure("rank 1: " + MESSAGE, 1 << 30, 0.0, 0.0)

    def collective_fails() -> None:
        torch.rand(3)
        model(torch.ones(2, 8)).sum().backward()
        raise RuntimeError("Connection closed by peer")

    seen: list[BaseException] = []
    out = run_guarded(collective_fails, opt, CPU, peer_failure=lambda exc: seen.append(exc) or peer)
    assert out is peer and "Connection closed" in str(seen[0])
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model, opt)))
    assert torch.equal(torch.get_rng_state(), rng)
    with pytest.raises(RuntimeError, match="Connection closed"):
        run_guarded(collective_fails, opt, CPU, peer_failure=lambda exc: None)

    def stepped_then_fails() -> None:
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError, match="Connection closed"):
        run_guarded(stepped_then_fails, opt, CPU, peer_failure=lambda exc: peer)


CHILD = """
import json, torch
from earl_stream.workers.oom_step import cap_address_space, run_guarded
model = torch.nn.Linear(8, 8)
opt = torch.optim.AdamW(model.parameters())
cap = cap_address_space()
out = run_guarded(lambda: torch.ones(1 << 28).sum(), opt, torch.device("cpu"))  # 1 GiB over a 64 MiB headroom
small = run_guarded(lambda: float(torch.ones(1 << 16).sum()), opt, torch.device("cpu"))
print(json.dumps({"cap": cap, "error": out.error, "attempted": out.attempted_bytes, "small": small}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc to size the cap")
def test_a_real_allocation_failure_under_an_address_space_cap() -> None:
    env = {**os.environ, AS_HEADROOM_ENV: str(64 << 20)}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["cap"] > 0 and "allocate" in got["error"] and got["attempted"] == 1 << 30 and got["small"] == 65536.0


def test_logs_name_a_plan_with_its_recomputation() -> None:
    """The retry and recovery lines name plans as the selector does, so `dp2` and `dp2+rc` are told apart."""
    from earl_stream.workers.mesh import RankPlan

    assert RankPlan(dp=2).label == "dp2" and RankPlan(dp=2, recompute=True).label == "dp2+rc"
    assert RankPlan(fsdp=2, recompute=True).label == "fsdp2+rc"
