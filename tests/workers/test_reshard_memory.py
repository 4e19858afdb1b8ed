"""A live re-shard never needs a full replica, under a real per-rank memory cap.

Two gloo ranks hold a ~13M-parameter Qwen2 (a wide MLP: 50 MiB of fp32 weights, twice that of AdamW
state) laid out under one plan, after one AdamW step. Each rank then switches plans twice: first
through the old path (full state dicts of model and optimizer gathered on every rank and a fresh
replica loaded from them, kept here as the reference), uncapped, recording its peak; then through
`sharding.relayout` under `resource.setrlimit(RLIMIT_DATA, VmData + cap)`, where the cap lies above
the predicted shard-to-shard peak (`supervisor.switch_memory`) and below the old path's measured
peak. The new path succeeds, gives the same weights and AdamW state as the old one, and its
measured peak (resident high-water mark above the rank's resident memory before the switch) stays
within the prediction's slack. Ranks run with MALLOC_MMAP_THRESHOLD_=65536 so that freed tensors go
back to the OS and resident memory follows live tensors.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

MIB = 1 << 20
MODEL = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=8192, vocab_size=1024, tie_word_embeddings=False, use_cache=False)
BUCKET = 4 * MIB
SLACK = 24 * MIB  # what the prediction does not count: the runtime's own allocations, gloo's buffers
SWITCHES = [("dp2", "fsdp2"), ("fsdp2", "tp2")]
PLANS = {"dp2": (2, 1, 1), "fsdp2": (1, 2, 1), "tp2": (1, 1, 2)}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS


class _DataPeak:
    """The highest VmData (allocated address space: what RLIMIT_DATA caps and what a GPU allocator
    would hold; resident memory misses allocated pages not yet touched) seen by a thread that reads
    it every 0.2 ms while the block runs."""

    def __enter__(self) -> _DataPeak:
        import threading

        self._stop = threading.Event()
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self.peak = 0
        self._thread.start()  # its stack is in VmData too: the base is read after it exists
        self.base = _status("VmData:")
        return self

    def _watch(self) -> None:
        while not self._stop.wait(2e-4):
            self.peak = max(self.peak, _status("VmData:"))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._interval)

    @property
    def delta(self) -> int:
        return self.peak - self.base


def _full_gather_relayout(model: Any, optimizer: Any, placement: Any, make_optimizer: Any) -> Any:
    """The re-shard this project ran before `workers.reshard`: whole state dicts on every rank and a
    fresh replica, laid out and loaded from them."""
    import copy

    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from transformers.initialization import no_init_weights

    from earl_stream.workers.sharding import shard_model

    full = StateDictOptions(full_state_dict=True)
    model_state = get_model_state_dict(model, options=full)
    optim_state = get_optimizer_state_dict(model, optimizer, options=full)
    with no_init_weights(), torch.device(placement.device):
        new = type(model)(copy.deepcopy(model.config))
    new = shard_model(new.float().train(), placement)
    set_model_state_dict(new, model_state, options=full)
    del model_state
    new_optimizer = make_optimizer(new)
    set_optimizer_state_dict(new, new_optimizer, optim_state, options=full)
    return new, new_optimizer


def _adam(model: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _stepped(mesh: Any, name: str) -> tuple[Any, Any]:
    """The model laid out under plan `name`, after one AdamW step (gradients dropped, as at a step
    boundary)."""
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from earl_stream.workers.host_memory import free_unused_memory
    from earl_stream.workers.mesh import RankPlan
    from earl_stream.workers.sharding import shard_model

    torch.manual_seed(0)
    model = shard_model(Qwen2ForCausalLM(Qwen2Config(**MODEL)).train(), mesh.placement(RankPlan(*PLANS[name])))
    opt = _adam(model)
    ids = torch.arange(16).reshape(1, 16) % MODEL["vocab_size"]
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    if name == "dp2":  # replicas: the same gradients on every rank
        for p in model.parameters():
            dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad(set_to_none=True)
    free_unused_memory()
    return model, opt


def _whole(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    """Whole weights and AdamW moments, by name (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True)
    state = {k: v.clone() for k, v in get_model_state_dict(model, options=full).items()}
    for k, s in get_optimizer_state_dict(model, opt, options=full)["state"].items():
        state.update({f"{k}:{n}": v.clone() for n, v in s.items() if isinstance(v, torch.Tensor) and v.dim()})
    return state


def _train_plan(name: str) -> Any:
    from earl_stream.supervisor.memory_model import TrainPlan

    dp, fsdp, tp = PLANS[name]
    return TrainPlan(micro_batch=1, seq_len=16, dp=dp * fsdp, tp=tp, fsdp=fsdp > 1)


def _switch(mesh: Any, a: str, b: str) -> dict[str, Any]:
    """Plan `a` -> `b` by the old path (uncapped) and by `relayout` under the cap: peaks and results."""
    import resource

    from transformers import Qwen2Config

    from earl_stream.supervisor.model_shape import ModelShape
    from earl_stream.supervisor.switch_memory import predict_switch
    from earl_stream.workers.host_memory import free_unused_memory
    from earl_stream.workers.mesh import RankPlan
    from earl_stream.workers.sharding import relayout

    placement = mesh.placement(RankPlan(*PLANS[b]))
    model, opt = _stepped(mesh, a)
    base = _status("VmRSS:")
    _reset_peak()
    with _DataPeak() as old_data:
        model, opt = _full_gather_relayout(model, opt, placement, _adam)
    old_peak = _status("VmHWM:") - base
    reference = _whole(model, opt)
    del model, opt
    free_unused_memory()
    predicted = predict_switch(ModelShape.from_hf(Qwen2Config(**MODEL)), _train_plan(a), _train_plan(b), BUCKET)
    cap = predicted.peak_bytes - predicted.before_bytes + SLACK
    model, opt = _stepped(mesh, a)
    base = _status("VmRSS:")
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    _reset_peak()
    resource.setrlimit(resource.RLIMIT_DATA, (_status("VmData:") + cap, hard))
    try:
        with _DataPeak() as data:
            relaid = relayout(model, opt, placement, _adam, bucket_bytes=BUCKET)
            del model, opt
        new_peak = _status("VmHWM:") - base
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    moved = _whole(relaid.model, relaid.optimizer)
    return {"old_peak": old_peak, "new_peak": new_peak, "cap": cap, "buckets": relaid.buckets,
            "worst": max(float((moved[k] - v).abs().max()) for k, v in reference.items()),
            "keys": sorted(moved) == sorted(reference), "new_data_peak": data.delta,
            "old_data_peak": old_data.delta, "predicted": predicted.peak_bytes - predicted.before_bytes}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from earl_stream.workers.host_memory import free_unused_memory
    from earl_stream.workers.mesh import TrainerMesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        mesh = TrainerMesh(world, rank, torch.device("cpu"))
        results = {}
        for a, b in SWITCHES:
            results[a, b] = _switch(mesh, a, b)
            free_unused_memory()
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def switches(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    from spawned_ranks import free_port  # the rendezvous port, outside the ephemeral range

    port = free_port()
    out = str(tmp_path_factory.mktemp("reshard") / "r")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # the spawned ranks' glibc unmaps freed tensors
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    try:
        mp.start_processes(_worker, args=(2, port, out), nprocs=2, join=True, start_method="spawn")
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    return [torch.load(f"{out}.{r}") for r in range(2)]


@pytest.mark.parametrize("switch", SWITCHES, ids=["->".join(s) for s in SWITCHES])
def test_switch_under_a_cap_the_full_gather_path_exceeds(switches: list[dict[Any, Any]], switch: tuple[str, str]) -> None:
    for rank, r in enumerate(switches):
        got = r[switch]
        print(switch, rank, {k: (v / MIB if isinstance(v, int) and v > MIB else v) for k, v in got.items()})
        assert got["keys"] and got["worst"] == 0.0, (switch, rank, got["worst"])
        assert got["buckets"] > 1
        assert got["old_peak"] > got["cap"], f"{switch} rank {rank}: the old path fits the cap; the test proves nothing"
        assert got["old_data_peak"] > 2 * got["cap"]
        assert got["new_peak"] <= got["new_data_peak"] <= got["cap"]


@pytest.mark.parametrize("switch", SWITCHES, ids=["->".join(s) for s in SWITCHES])
def test_predicted_switch_peak_matches_the_measured(switches: list[dict[Any, Any]], switch: tuple[str, str]) -> None:
    """Both ranks of these plans hold the same bytes, so the prediction is one number; the measured
    peak compared with it is the lower of the two ranks'. VmData is address space: on a busy machine
    the runtime can hold a few MiB more on one rank for a moment (seen once in CI: +4.5 MiB on a rank
    of fsdp2->tp2; not reproduced in 7 runs beside 2-6 busy loops, where both ranks were within
    0.6 MiB), which only ever adds; a wrong prediction shows on both. Each rank's own peak stays under
    the cap (the test above)."""
    predicted = {r[switch]["predicted"] for r in switches}
    assert len(predicted) == 1, predicted
    measured = min(r[switch]["new_data_peak"] for r in switches)
    (want,) = predicted
    assert abs(measured - want) <= 0.05 * want + 2 * MIB, [r[switch] for r in switches]
