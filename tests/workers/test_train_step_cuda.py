"""The trainer's step on a CUDA device: the same loss as on CPU (fp32), and bf16 autocast close to it.

Needs a CUDA GPU (marker `gpu`); skipped where torch sees none. Runs the real `train_step` with the
placement a trainer rank gets from `trainer.device=cuda`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _step(model_dir: Path, device: str, dtype: str) -> tuple[float, float]:
    from test_parallel_equivalence import CountingPuller, _claim

    from earl_stream.config import TrainerConfig
    from earl_stream.devices import resolve_device
    from earl_stream.model import load_model
    from earl_stream.workers.mesh import RankPlan, TrainerMesh
    from earl_stream.workers.sharding import apply_plan
    from earl_stream.workers.train_step import train_step

    model, _ = load_model(model_dir)
    metas, rows = _claim(model)
    dev = resolve_device(device)
    model.to(dev).train()  # type: ignore[arg-type]
    placement = TrainerMesh(1, 0, dev).placement(RankPlan(dtype=dtype))
    apply_plan(model, placement)
    res = train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), metas, placement.layout,
                     CountingPuller(rows), TrainerConfig(), placement=placement)
    assert all(p.device.type == dev.type and p.dtype == torch.float32 for p in model.parameters())
    return res.loss, res.grad_norm


def test_cuda_step_matches_cpu(tiny_model_dir: Path) -> None:
    cpu = _step(tiny_model_dir, "cpu", "fp32")
    cuda = _step(tiny_model_dir, "cuda", "fp32")
    bf16 = _step(tiny_model_dir, "cuda", "bf16")
    assert cuda[0] == pytest.approx(cpu[0], rel=1e-4) and cuda[1] == pytest.approx(cpu[1], rel=1e-3)
    assert bf16[0] == pytest.approx(cpu[0], rel=3e-2)
