"""A plan change does not change the math: on a fixed batch, loss and gradients match across plans.

Two gloo processes run the real `train_step` (partition, pull through the Puller interface, GRPO
loss, all-reduce) on the same claim under data parallel (dp=2) and Ulysses sequence parallel (sp=2),
each with recomputation on/off and different micro-batch token budgets, switching plans live with
`parallel.apply_plan` between steps on the same model objects. The reference is one process with
the whole batch in one micro-batch. SGD with lr=1 and no clipping makes each step's parameter
change equal to minus the gradient, which is what is compared.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

LENGTHS = [23, 64, 41, 57, 30, 48]  # two prompt groups of three, rows of uneven length
LOSS_RTOL = 1e-5
GRAD_ATOL_REL = 2e-5  # max |grad diff| / max |grad|


class LocalPuller:
    """The store's Puller interface over rows held in this process (the producers' network edge)."""

    def __init__(self, rows: Mapping[str, np.ndarray]) -> None:
        self.rows = rows

    def pull(self, address: str, pieces: Sequence[tuple[str, int, int]], **_: Any) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        last = None
        for key, start, end in pieces:  # merge_runs: ranges of one key back to back
            part = self.rows[key][start:end]
            if key == last:
                out[-1] = np.concatenate([out[-1], part])
            else:
                out.append(part.copy())
            last = key
        return out

    def pull_many(self, requests: Mapping[str, Sequence[tuple[str, int, int]]], **_: Any) -> dict[str, Any]:
        return {addr: self.pull(addr, pieces) for addr, pieces in requests.items()}


def _claim(model: torch.nn.Module) -> tuple[list[Any], LocalPuller]:
    from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta, sample_key

    gen = torch.Generator().manual_seed(1)
    rows: dict[str, np.ndarray] = {}
    metas = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(5, model.config.vocab_size, (n,), generator=gen)
        prompt = 6 + i
        mask = np.zeros(n, np.uint8)
        mask[prompt:] = 1
        with torch.no_grad():  # behaviour log-probs near the policy's own: ratios stay inside the clip range
            logits = model(input_ids=ids[None]).logits[0]
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
        blp = np.concatenate([[0.0], lp.numpy() + 0.05 * np.sin(np.arange(1, n))]).astype(np.float32) * mask
        sid = f"s{i}"
        rows[sample_key(sid, "input_ids")] = ids.numpy().astype(np.int32)
        rows[sample_key(sid, "loss_mask")] = mask
        rows[sample_key(sid, "behaviour_logprobs")] = blp
        metas.append(SampleMeta(schema_version=SCHEMA_VERSION, sample_id=sid, prompt_ordinal=i // 3, episode_id=sid,
                                group_id=f"g{i // 3}", env="test", turns=1, prompt_tokens=prompt,
                                response_tokens=n - prompt, total_tokens=n, reward=float(i % 3 == 0) + 0.1 * i,
                                advantage=None, policy_version_min=0, policy_version_max=0, producer_id="p",
                                producer_address="local", checksum=0, created_at=0.0, info_json="{}"))
    return metas, LocalPuller(rows)


# (name, dp, sp, recompute, micro-batch tokens per rank)
PLANS = [("dp2", 2, 1, False, 4096), ("dp2_recompute_mb64", 2, 1, True, 64), ("sp2", 1, 2, False, 4096),
         ("sp2_recompute_mb40", 1, 2, True, 40), ("dp2_mb1", 2, 1, False, 1), ("sp2_mb1", 1, 2, False, 1)]
# the model's own attention: sdpa (the default) under every plan; eager (materialised causal mask) under two
ATTENTION = {"sdpa": [p[0] for p in PLANS], "eager": ["dp2_recompute_mb64", "sp2"]}


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    from earl_stream.config import TrainerConfig
    from earl_stream.modeling import load_model
    from earl_stream.store.layout import Layout
    from earl_stream.workers.parallel import RankPlan, SequenceParallelGroups, apply_plan
    from earl_stream.workers.train_step import train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        groups = SequenceParallelGroups(world, rank)
        model, _ = load_model(model_dir)
        model.train()
        init = {k: v.clone() for k, v in model.state_dict().items()}
        metas, puller = _claim(model)
        cfg = TrainerConfig(grad_clip=0.0, entropy_coef=0.01, clip_eps=0.2)
        results: dict[str, Any] = {}

        def run(plan: RankPlan, layout: Layout) -> tuple[float, dict[str, torch.Tensor]]:
            model.load_state_dict(init)
            apply_plan(model, plan, groups=groups, rank=rank)
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            res = train_step(model, opt, metas, layout, puller, TrainerConfig(**{**cfg.__dict__,
                             "micro_batch_tokens": plan.micro_batch_tokens}), rank=rank)
            return res.loss, {k: (v - init[k]).clone() for k, v in model.state_dict().items()}

        for attn, names in ATTENTION.items():
            model.config._attn_implementation = attn
            if rank == 0:  # the reference: one process, the whole batch in one micro-batch (no collectives)
                results[attn, "reference"] = run(RankPlan(micro_batch_tokens=1 << 20), Layout())
            dist.barrier()
            for name, dp, sp, recompute, mbt in (p for p in PLANS if p[0] in names):
                layout = Layout.from_rank(rank, dp=dp, cp=sp)
                results[attn, name] = run(RankPlan(sp=sp, micro_batch_tokens=mbt, recompute=recompute), layout)
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_loss_and_gradients_match_across_plans(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = str(tmp_path / "results")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    mp.start_processes(_worker, args=(2, _free_port(), str(tiny_model_dir), out), nprocs=2, join=True,
                       start_method="spawn")
    r0, r1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    for attn, names in ATTENTION.items():
        ref_loss, ref_delta = r0[attn, "reference"]
        scale = max(float(d.abs().max()) for d in ref_delta.values())
        assert scale > 1e-4, "the reference step must move the weights for the comparison to mean anything"
        for name in names:
            for results in (r0, r1):
                loss, delta = results[attn, name]
                assert loss == pytest.approx(ref_loss, rel=LOSS_RTOL), (attn, name)
                worst = max(float((delta[k] - ref_delta[k]).abs().max()) for k in ref_delta)
                assert worst <= GRAD_ATOL_REL * scale, f"{attn} {name}: max grad diff {worst:.3g} vs {scale:.3g}"
