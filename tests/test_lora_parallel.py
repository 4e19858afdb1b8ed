"""LoRA under the trainer pool's plans: a step on dp2 and fsdp2 equals the single-process LoRA step, the
frozen base never changes, the ranks publish every adapter block exactly once (and nothing else), and a
live re-shard between dp2 and fsdp2 keeps the adapters and their AdamW state (the base has none).

Same harness as `test_parallel_equivalence` (gloo processes running the real `train_step` on one claim).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from spawned_ranks import spawn_ranks
from test_parallel_equivalence import REL_TOL, CountingPuller, _claim

PLANS = {"dp2": (2, 1), "fsdp2": (1, 2)}
SWITCHES = [("dp2", "fsdp2"), ("fsdp2", "dp2")]


def _lora(model_dir: str) -> Any:
    from earl_stream.model import load_model
    from earl_stream.model.lora import LoraSpec, apply_lora

    model, _ = load_model(model_dir)
    apply_lora(model, LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj", "up_proj",
                                                                   "down_proj")))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B random too (peft starts it at zero, which leaves A without a gradient)
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.train()


def _worker(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from earl_stream.config import AlgoConfig, TrainerConfig
    from earl_stream.model.lora import adapter_state
    from earl_stream.workers.mesh import Placement, RankPlan, TrainerMesh
    from earl_stream.workers.sharding import apply_plan, relayout, shard_model, shard_pieces
    from earl_stream.workers.train_step import train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = TrainerMesh(world, rank, torch.device("cpu"))
        init = {k: v.clone() for k, v in _lora(model_dir).state_dict().items()}
        metas, rows = _claim(_lora(model_dir))
        algo = AlgoConfig(grad_clip=0.0)
        plans = {n: RankPlan(dp=dp, fsdp=fsdp) for n, (dp, fsdp) in PLANS.items()}
        results: dict[Any, Any] = {}

        def trainable(m: Any) -> list[torch.nn.Parameter]:
            return [p for p in m.parameters() if p.requires_grad]

        def step(model: Any, opt: Any, placement: Any) -> float:
            cfg = TrainerConfig(micro_batch_tokens=placement.plan.micro_batch_tokens)
            return train_step(model, opt, metas, placement.layout, CountingPuller(rows), cfg, algo=algo, rank=rank,
                              placement=placement).loss

        def full(model: Any) -> dict[str, torch.Tensor]:
            return {k: v.detach().clone() for k, v in
                    get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()}

        def fresh(plan: RankPlan) -> tuple[Any, Any]:
            model = _lora(model_dir)
            placement = mesh.placement(plan)
            shard_model(model, placement)
            apply_plan(model, placement)
            return model, placement

        for name, plan in plans.items():
            model, placement = fresh(plan)
            loss = step(model, torch.optim.SGD(trainable(model), lr=1.0), placement)
            state = adapter_state(model)
            pieces = [(p.name, p.offset, p.tensor.clone()) for p in shard_pieces(state, placement)]
            results[name] = (loss, {k: v - init[k] for k, v in full(model).items()}, pieces)
            if name == "fsdp2":  # a sharded LoRA checkpoint: the adapters alone, whole in its adapter/ directory
                from earl_stream.workers import checkpoint as ckpt
                state = ckpt.RunState(step=1, policy_version=1, rng=torch.get_rng_state(), unreleased=[],
                                      world_size=world)
                ckpt.save_checkpoint(f"{out}.ckpt", state, model, torch.optim.AdamW(trainable(model)), None, rank=rank)
        if rank == 0:
            model = _lora(model_dir)
            apply_plan(model, Placement.single())
            loss = train_step(model, torch.optim.SGD(trainable(model), lr=1.0), metas, Placement.single().layout,
                              CountingPuller(rows), TrainerConfig(micro_batch_tokens=1 << 20), algo=algo).loss
            results["reference"] = (loss, {k: v - init[k] for k, v in model.state_dict().items()},
                                    {k: tuple(v.shape) for k, v in adapter_state(model).items()})

        def adam(m: Any) -> torch.optim.Optimizer:
            return torch.optim.AdamW(trainable(m), lr=1e-3)

        for a, b in SWITCHES:
            finals = []
            for second in (a, b):
                model, placement = fresh(plans[a])
                opt = adam(model)
                step(model, opt, placement)
                if second != a:
                    placement = mesh.placement(plans[second])
                    relaid = relayout(model, opt, placement, adam)
                    model, opt = relaid.model, relaid.optimizer
                    assert len(opt.state) == len(trainable(model)), "AdamW state of the adapters alone"
                    apply_plan(model, placement)
                step(model, opt, placement)
                finals.append(full(model))
            results["switch", a, b] = finals
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    out = str(tmp_path_factory.mktemp("lora2") / "results")
    return [{**results, "out": out} for results in spawn_ranks(_worker, 2, str(tiny_model_dir), out)]


def test_lora_step_on_dp2_and_fsdp2_equals_the_single_process_step(two_ranks: list[dict[Any, Any]]) -> None:
    ref_loss, ref_delta, _ = two_ranks[0]["reference"]
    scale = max(float(d.abs().max()) for d in ref_delta.values())
    assert scale > 1e-4
    for name in PLANS:
        for rank, r in enumerate(two_ranks):
            loss, delta, _ = r[name]
            assert loss == pytest.approx(ref_loss, rel=REL_TOL), (name, rank)
            worst = max(float((delta[k] - ref_delta[k]).abs().max()) for k in ref_delta)
            assert worst <= REL_TOL * scale, f"{name} rank {rank}: {worst:.3g} vs {scale:.3g}"
            for k, d in delta.items():
                moved = bool(d.abs().max() > 0)
                assert moved == (".lora_" in k), f"{name}: {k} {'changed' if moved else 'did not change'}"


def test_ranks_publish_each_adapter_block_once_and_nothing_else(two_ranks: list[dict[Any, Any]],
                                                                tiny_model_dir: Path) -> None:
    from earl_stream.model.lora import wire_name

    shapes = two_ranks[0]["reference"][2]
    init = _lora(str(tiny_model_dir)).state_dict()
    for name in PLANS:
        seen: dict[str, torch.Tensor] = {k: torch.zeros(s, dtype=torch.int32) for k, s in shapes.items()}
        got: dict[str, torch.Tensor] = {k: torch.zeros(s) for k, s in shapes.items()}
        for r in two_ranks:
            for key, offset, tensor in r[name][2]:
                block = tuple(slice(o, o + n) for o, n in zip(offset, tensor.shape))
                seen[key][block] += 1
                got[key][block] = tensor
        assert all(bool((c == 1).all()) for c in seen.values()), name
        for k, d in two_ranks[0][name][1].items():  # the trained adapters, B scaled by alpha / r = 2
            if ".lora_" in k:
                want = (init[k] + d) * (2.0 if ".lora_B." in k else 1.0)
                assert torch.allclose(got[wire_name(k)], want, atol=1e-6), (name, k)


def test_live_reshard_keeps_the_adapters_and_their_adam_state(two_ranks: list[dict[Any, Any]]) -> None:
    for key in (k for k in two_ranks[0] if isinstance(k, tuple) and k[0] == "switch"):
        for r in two_ranks:
            stay, switched = r[key]
            scale = max(float(v.abs().max()) for k, v in stay.items() if ".lora_" in k)
            worst = max(float((stay[k] - switched[k]).abs().max()) for k in stay)
            assert worst <= REL_TOL * scale, f"{key}: re-shard changed the weights by {worst:.3g}"


def test_a_sharded_lora_checkpoint_holds_the_whole_adapters_only(two_ranks: list[dict[Any, Any]],
                                                                  tiny_model_dir: Path) -> None:
    from safetensors.torch import load_file

    from earl_stream.model.lora import wire_name
    from earl_stream.workers.checkpoint import load_model_weights

    path = Path(two_ranks[0]["out"] + ".ckpt") / "checkpoints" / "step_000001"
    init = _lora(str(tiny_model_dir)).state_dict()
    delta = two_ranks[0]["fsdp2"][1]
    saved = load_file(str(path / "adapter" / "adapter_model.safetensors"))
    adapters = {k: init[k] + d for k, d in delta.items() if ".lora_" in k}
    assert set(saved) == {"base_model.model." + wire_name(k) for k in adapters}
    for k, want in adapters.items():
        assert torch.allclose(saved["base_model.model." + wire_name(k)], want, atol=1e-6), k
    plain = _lora(str(tiny_model_dir))
    load_model_weights(path, plain)  # DCP: the adapters come back, the base is the model's own
    for k, want in adapters.items():
        assert torch.allclose(plain.state_dict()[k], want, atol=1e-6), k
