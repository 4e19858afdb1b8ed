"""The parallelism selector under real per-rank memory caps: static plans vs the adaptive selector.

    python bench/selector.py --json bench/results/selector.json [--quick]

A 2-rank gloo trainer pool trains while the episode context grows 8x (four phases whose episodes
reach 256, 512, 1,024 and 2,048 tokens; each step holds one episode at the phase's maximum and seven
uniform in [0.5, 1] x it; GRPO on synthetic episodes, AdamW, a ~18.9M-parameter Qwen2 with a 16k
untied vocabulary and eager attention, one thread per rank). Untied because the DCP state-dict path that
`relayout` used when this benchmark was written failed on a tied embedding's AdamW state (the shard-to-shard
re-shard of workers/reshard.py that replaced it keeps tied heads tied). Each rank is its own process with its own
real memory cap: after start-up (torch imported, gloo joined) it sets `resource.setrlimit(RLIMIT_DATA,
VmData + BUDGET)` and only then builds the model, so weights, gradients and AdamW states count against
the cap as much as activations do. Past the cap an allocation fails (torch: `RuntimeError:
DefaultCPUAllocator: can't allocate memory`; Python: `MemoryError`); the rank reports the crash, the
bench stops the pool and records it.

Why RLIMIT_DATA: cgroup v2 controllers are not available here, and RLIMIT_DATA counts what a process
allocates (heap and anonymous mmaps, where torch's tensors live) but not shared libraries or PROT_NONE
reservations. Ranks run with MALLOC_MMAP_THRESHOLD_=65536 so that every freed tensor is unmapped.

Every run drives the trainer's own code: `workers.mesh.TrainerMesh` placements, `workers.sharding`
(`shard_model`, `relayout`, `apply_plan`) and `workers.train_step.train_step` (partition, pulls through
the Puller interface, vocab-parallel GRPO loss, FSDP2 / DTensor / Ulysses collectives). The adaptive
run re-plans exactly as a live pool: rank 0 holds the supervisor's `Planner` (context statistics of
the claims' metadata, the selector with the memory and cost models), its `TrainerPlan` is broadcast
at each step boundary, and every rank adopts it as `TrainerRank._apply_plan` does (a `relayout` of
model and AdamW state when `RankPlan.model_layout` changes, then `apply_plan`). The selector runs with
its defaults except `selector.allow_sp=false` (so that the long phases exercise tensor parallelism: with
sp allowed the selector picks sp2 + recompute at 2,048 tokens, which the full run of 2026-11-26 also
measured faster than tp2 + recompute, 532 against 424 tokens per rank-CPU-second; dp, FSDP and tp stay
allowed), `headroom=1.0` and `upper_factor=1.0`:
the phases step in powers of two, so the plan for a phase is sized for exactly its longest episode,
the same extreme the static plans face. The memory model is told BUDGET per rank and RESERVE for what
it does not count; the Planner sizes the logits as `train_step`'s vocab-parallel path holds them
(LOGIT_COPIES_EARL_VOCAB_PARALLEL, measured by bench/memory_model.py).

The cost model is calibrated first on the same 2-rank pool (`StepCostModel.fit_steps` on measured steps
of one and two one-row micro-batches of 128 and 512 tokens under dp2, fsdp2, tp2 and sp2, with and
without recomputation: compute, bytes, score passes, per-collective, per-micro-batch and per-step
costs), stored in the JSON.

Compared: static plans (dp2, fsdp2, tp2, sp2, each with and without recomputation, one episode per
micro-batch: the most memory-frugal way to run each) and the adaptive selector. Throughput is tokens
per rank-CPU-second (a step's tokens / the mean over the ranks of the CPU seconds each spent in it,
collectives included; CPU time is far less sensitive than wall time to the other users of this
machine). The oracle of a phase is the fastest static plan that completed it;
`adaptive_vs_oracle_throughput` = the oracle's time for all phases / the adaptive run's, same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.provenance import write_result  # noqa: E402

MODEL = {"hidden_size": 384, "num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 2,
         "intermediate_size": 1024, "vocab_size": 16384, "tie_word_embeddings": False, "max_position_embeddings": 2048}
PHASE_MAX = (256, 512, 1024, 2048)  # longest episode of each phase: 8x growth
GROUPS, GROUP_SIZE = 2, 4  # a step: 2 prompt groups x 4 episodes
PROMPT = 16
WORLD = 2
BUDGET = int(os.environ.get("EARL_BENCH_BUDGET_MIB", "900")) << 20  # per rank above start-up: RLIMIT_DATA cap, memory model budget
# What the memory model does not count (runtime, communication buffers, allocator): the static plans' steps
# of the full run of 2026-11-26 with 96 MiB here (bench/results/selector_reserve96.json at commit cbeffc5, where the adaptive
# run's fsdp2 plan ran out of memory at 1,024 tokens) peaked 57-139 MiB above the model's total, the excess
# growing with the context under FSDP2; 160 MiB covers that.
RESERVE = 160 << 20
ALLOW_SP = False  # with sp allowed the selector prefers sp2 + recompute to tp2 + recompute at 2,048
STATIC = [(layout, rc) for layout in ("dp2", "fsdp2", "tp2", "sp2") for rc in (False, True)]
# (layout, tokens per row, recompute, micro-batches per step): two lengths 4x apart so that compute is told
# from constant costs, and 1 vs 2 micro-batches so that a step's constant (optimizer) is told from a
# micro-batch's (and from the collectives' per-call cost)
def configurations(layouts: list[str], short: int, long: int) -> list[tuple[str, int, bool, int]]:
    """(layout, tokens per row, recompute, micro-batches per step) of every calibration step."""
    return [(layout, s, rc, mbs) for layout in layouts for s, mbs in ((short, 1), (short, 2), (long, 1))
            for rc in (False, True)]


CALIBRATION = configurations(["dp2", "fsdp2", "tp2", "sp2"], 128, 512)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS


class LocalPuller:
    """The store's Puller interface over rows held in this process (the producers' network edge)."""

    def __init__(self, rows: dict[str, Any]) -> None:
        self.rows = rows

    def pull_many(self, requests: dict[str, list[tuple[str, int, int]]], **_: Any) -> dict[str, Any]:
        return {addr: [self.rows[k][s:e].copy() for k, s, e in pieces] for addr, pieces in requests.items()}


def _lengths(step: int, phase: int) -> list[int]:
    """One episode at the phase's maximum, the others uniform in [0.5, 1] x it."""
    import numpy as np

    rng = np.random.default_rng(1000 + step)
    top = PHASE_MAX[phase]
    return [top] + [int(rng.integers(top // 2, top + 1)) for _ in range(GROUPS * GROUP_SIZE - 1)]


def _claim(step: int, lengths: list[int], vocab: int = MODEL["vocab_size"]) -> tuple[list[Any], LocalPuller]:
    """Metadata rows + token rows (random ids below `vocab`, loss on all but the prompt, uniform behaviour
    log-probs)."""
    import numpy as np

    from earl_stream.store.schema import SCHEMA_VERSION, SampleMeta, sample_key

    rng = np.random.default_rng(step)
    rows, metas = {}, []
    for i, n in enumerate(lengths):
        sid, group = f"s{step}-{i}", i // GROUP_SIZE
        mask = np.zeros(n, np.uint8)
        mask[PROMPT:] = 1
        rows[sample_key(sid, "input_ids")] = rng.integers(5, vocab, n).astype(np.int32)
        rows[sample_key(sid, "loss_mask")] = mask
        rows[sample_key(sid, "behaviour_logprobs")] = (mask * -np.log(vocab)).astype(np.float32)
        metas.append(SampleMeta(schema_version=SCHEMA_VERSION, sample_id=sid, prompt_ordinal=step * GROUPS + group,
                                episode_id=sid, group_id=f"g{step}-{group}", env="bench", turns=1,
                                prompt_tokens=PROMPT, response_tokens=n - PROMPT, total_tokens=n,
                                reward=float(rng.random()), advantage=None, policy_version_min=step,
                                policy_version_max=step, producer_id="p", producer_address="local", checksum=0,
                                created_at=0.0, info_json="{}"))
    return metas, LocalPuller(rows)


def _emit(record: dict) -> None:
    os.write(1, (json.dumps(record) + "\n").encode())  # no buffering: the last line survives a crash


class Rank:
    """One trainer rank of the pool: its model and optimizer laid out under the plan in force."""

    def __init__(self, rank: int, port: int) -> None:
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from earl_stream.workers.mesh import TrainerMesh

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=300))
        self.rank, self.mesh = rank, TrainerMesh(WORLD, rank, torch.device("cpu"))
        self.base_vm, self.base_rss = _status("VmData:"), _status("VmRSS:")
        resource.setrlimit(resource.RLIMIT_DATA, (self.base_vm + BUDGET, resource.RLIM_INFINITY))
        torch.manual_seed(0)
        self.model: Any = Qwen2ForCausalLM(Qwen2Config(**MODEL, attn_implementation="eager", use_cache=False))
        self.model.train()
        self.optimizer: Any = None
        self.placement: Any = None

    def make_optimizer(self, model: Any) -> Any:
        import torch

        return torch.optim.AdamW(model.parameters(), lr=1e-4)

    def adopt(self, plan: Any) -> bool:
        """`plan` (a RankPlan) from the next step on, as `TrainerRank._apply_plan` adopts a wire plan.
        Returns whether the model was re-laid."""
        from earl_stream.workers.host_memory import free_unused_memory
        from earl_stream.workers.sharding import apply_plan, relayout, shard_model

        if problems := plan.problems(WORLD, self.model.config):
            raise SystemExit(f"plan {plan.name} refused: {problems}")
        placement = self.mesh.placement(plan)
        relaid = False
        if self.placement is None:
            shard_model(self.model, placement)
            self.optimizer = self.make_optimizer(self.model)
        elif plan.model_layout != self.placement.plan.model_layout:
            new = relayout(self.model, self.optimizer, placement, self.make_optimizer)
            self.model, self.optimizer, relaid = new.model, new.optimizer, True
            del new
            free_unused_memory()  # as TrainerRank._apply_plan does
        apply_plan(self.model, placement)
        self.placement = placement
        return relaid

    def step(self, metas: list[Any], puller: LocalPuller) -> dict[str, Any]:
        from earl_stream.config import TrainerConfig
        from earl_stream.workers.train_step import train_step

        plan = self.placement.plan
        cfg = TrainerConfig(micro_batch_tokens=plan.micro_batch_tokens)  # algo defaults: grad_clip 1.0
        _reset_peak()
        t0, w0 = time.process_time(), time.monotonic()
        train_step(self.model, self.optimizer, metas, self.placement.layout, puller, cfg, rank=self.rank,
                   placement=self.placement)
        return {"cpu_seconds": time.process_time() - t0, "wall_seconds": time.monotonic() - w0,
                "peak_bytes": _status("VmHWM:") - self.base_rss}


def _broadcast_bytes(data: bytes) -> bytes:
    """Rank 0's bytes to every rank (length first, then the bytes), as the trainer pool does."""
    import torch
    import torch.distributed as dist

    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=0)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if dist.get_rank() == 0 else \
        torch.zeros(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=0)
    return buf.numpy().tobytes()


def rank_calibrate(me: Rank) -> None:
    """CPU seconds of steps of one or two one-row micro-batches per rank under each layout (one warm-up
    round first)."""
    from bench.ranks import rank_plan

    for k, (layout, s, rc, mbs) in enumerate(CALIBRATION * 2):
        plan = rank_plan(layout)
        # a micro-batch budget of one row: `mbs` rows per data rank make `mbs` micro-batches
        me.adopt(dataclasses.replace(plan, recompute=rc, micro_batch_tokens=s // plan.sp))
        metas, puller = _claim(20_000 + k, [s] * (plan.data_ranks * mbs))
        rec = me.step(metas, puller)
        if k >= len(CALIBRATION):
            _emit({"event": "calibration", "layout": layout, "seq_len": s, "recompute": rc, "micro_batches": mbs,
                   **rec})


def rank_run(me: Rank, spec: dict) -> None:
    """Static or adaptive training over the phases. One JSON line per step per rank."""
    import msgspec

    from bench.ranks import rank_plan
    from earl_stream.protocol import TrainerPlan
    from earl_stream.workers.mesh import RankPlan

    planner = _planner(spec) if spec["mode"] == "adaptive" and me.rank == 0 else None
    version, step = 0, 0
    if spec["mode"] == "static":
        plan = rank_plan(spec["layout"])
        me.adopt(dataclasses.replace(plan, recompute=spec["recompute"], micro_batch_tokens=PHASE_MAX[0] // plan.sp))
    _emit({"event": "start", "rank": me.rank, "vm_data_bytes": me.base_vm, "limit_bytes": me.base_vm + BUDGET})
    for phase, steps in enumerate(spec["steps_per_phase"]):
        for _ in range(steps):
            metas, puller = _claim(step, _lengths(step, phase))
            reason, relaid, where = "", False, "train_step"
            try:
                if spec["mode"] == "adaptive":  # the supervisor sees the claim's metadata, re-plans, broadcasts
                    wire = b""
                    if planner is not None:
                        planner.add(metas)
                        planner.on_step(step)
                        wire = msgspec.json.encode(planner.trainer_wire)
                    plan = msgspec.json.decode(_broadcast_bytes(wire), type=TrainerPlan)
                    if plan.version != version:
                        version, reason, where = plan.version, plan.reason, "relayout"
                        relaid = me.adopt(RankPlan.from_wire(plan))
                        where = "train_step"
                rec = me.step(metas, puller)
            except Exception as exc:  # noqa: BLE001 - any failure of a rank is this run's crash, reported as such
                _emit({"event": "crash", "rank": me.rank, "step": step, "phase": phase, "where": where,
                       "plan": me.placement.plan.name if me.placement else None,
                       "error": f"{type(exc).__name__}: {exc}"[:300]})
                os._exit(3)
            p = me.placement.plan
            _emit({"event": "step", "rank": me.rank, "step": step, "phase": phase,
                   "tokens": sum(m.total_tokens for m in metas), "max_len": max(m.total_tokens for m in metas),
                   **rec, "plan_version": version, "reason": reason, "relaid": relaid, "plan": p.name,
                   "micro_batch_tokens": p.micro_batch_tokens * p.sp, "recompute": p.recompute})
            step += 1


def _planner(spec: dict) -> Any:
    """The supervisor's Planner for this pool, its window pre-filled with 16 first-phase episodes."""
    from earl_stream.config import ModelConfig, RunConfig, SelectorConfig, TrainerConfig
    from earl_stream.supervisor.cost_model import StepCostModel
    from earl_stream.supervisor.planning import Planner

    model_dir = Path(spec["tmp"]) / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps({**MODEL, "model_type": "qwen2"}))
    cfg = RunConfig(model=ModelConfig(path=str(model_dir)), run_dir=str(Path(spec["tmp"]) / "run"),
                    trainer=TrainerConfig(nproc=WORLD, groups_per_step=GROUPS, group_size=GROUP_SIZE),
                    selector=SelectorConfig(context_window=32, initial_seq_len=PHASE_MAX[0], headroom=1.0,
                                            upper_factor=1.0, trainer_memory_bytes=BUDGET, reserve_bytes=RESERVE,
                                            allow_sp=ALLOW_SP, cost_model_min_steps=0))
    planner = Planner(cfg, cost_model=StepCostModel.from_dict(spec["cost_model"]))
    for k in range(4):  # seeds apart from the run's steps (numpy seeds must be >= 0)
        planner.add(_claim(1_000_000 + k, _lengths(1_000_000 + k, 0))[0])
    return planner


def rank_main(spec: dict, rank: int, port: int) -> None:
    me = Rank(rank, port)
    rank_calibrate(me) if spec["mode"] == "calibrate" else rank_run(me, spec)


# --- the bench (parent process) ---------------------------------------------------------------------


def launch_pool(spec: dict, timeout_s: float = 1500.0) -> tuple[list[dict], str]:
    """Run the WORLD ranks of `spec`; when one exits with an error the others (blocked in a collective)
    are stopped. Returns every JSON line the ranks printed, and the stderr tail of a failed rank."""
    from bench.ranks import free_port

    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **MALLOC_ENV}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port), "--child",
                               json.dumps(spec)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(WORLD)]
    deadline, err = time.monotonic() + timeout_s, ""
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed:
            time.sleep(2.0)  # let the others report what they were doing
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    lines = []
    for r, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
        out, stderr = p.communicate()
        lines += [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        if p.returncode not in (0, None) and not err:
            err = f"rank {r} exit {p.returncode}: {stderr.strip()[-1500:]}"
    return lines, err


def calibrate(tmp: str) -> tuple[dict, list[dict]]:
    from bench.ranks import rank_plan
    from earl_stream.supervisor.cost_model import StepCostModel
    from earl_stream.supervisor.memory_model import LOGIT_COPIES_EARL_GRPO, Attention, ModelShape, Recompute, TrainPlan

    lines, err = launch_pool({"mode": "calibrate", "tmp": tmp})
    cal = [x for x in lines if x.get("event") == "calibration"]
    if err or len(cal) != WORLD * len(CALIBRATION):
        raise SystemExit(f"calibration failed: {err}")
    shape = ModelShape.from_hf({**MODEL, "model_type": "qwen2"})
    measured, samples = [], []
    for layout, s, rc, mbs in CALIBRATION:
        ranks = [x for x in cal if (x["layout"], x["seq_len"], x["recompute"], x["micro_batches"]) == (layout, s, rc, mbs)]
        cpu = sum(x["cpu_seconds"] for x in ranks) / len(ranks)
        p = rank_plan(layout)
        plan = TrainPlan(1, s, dp=p.data_ranks, tp=p.tp, sp=p.sp, fsdp=p.fsdp > 1, attention=Attention.EAGER,
                         recompute=Recompute.FULL if rc else Recompute.NONE, logit_copies=LOGIT_COPIES_EARL_GRPO)
        samples.append((shape, [plan] * mbs, cpu))
        measured.append({"layout": layout, "seq_len": s, "recompute": rc, "micro_batches": mbs, "cpu_seconds": cpu})
    model = StepCostModel.fit_steps(samples)
    for r, (_, plans, _) in zip(measured, samples):
        r["predicted_seconds"] = model.predict_step(shape, plans)
    return model.to_dict(), measured


def run_one(spec: dict) -> dict:
    """One static or adaptive run: its steps (the ranks' records merged), crash and peaks."""
    lines, err = launch_pool(spec)
    crash = next((x for x in lines if x.get("event") == "crash"), None)
    if err and crash is None:
        crash = {"error": err.splitlines()[-1] if err else "", "phase": -1}
    steps = []
    by_step: dict[int, list[dict]] = {}
    for x in lines:
        if x.get("event") == "step":
            by_step.setdefault(x["step"], []).append(x)
    for k in sorted(by_step):
        ranks = by_step[k]
        if len(ranks) < WORLD:
            continue
        r0 = next(x for x in ranks if x["rank"] == 0)
        steps.append({**{k2: v for k2, v in r0.items() if k2 not in ("rank", "event")},
                      "cpu_seconds": sum(x["cpu_seconds"] for x in ranks) / WORLD,
                      "wall_seconds": max(x["wall_seconds"] for x in ranks),
                      "peak_bytes": max(x["peak_bytes"] for x in ranks)})
    start = [x for x in lines if x.get("event") == "start"]
    return {"crashed": crash is not None, "crash": crash, "steps": steps, "steps_per_phase": spec["steps_per_phase"],
            "limit_bytes": max((x["limit_bytes"] for x in start), default=0),
            **{k: spec[k] for k in ("layout", "recompute") if k in spec}}


def summarize(runs: dict[str, dict], phases: int) -> dict:
    per_phase: dict[str, list[float | None]] = {}
    for name, run in runs.items():
        tput = []
        for p in range(phases):
            steps = [r for r in run["steps"] if r["phase"] == p]
            done = len(steps) == run["steps_per_phase"][p]
            tput.append(sum(r["tokens"] for r in steps) / sum(r["cpu_seconds"] for r in steps) if done else None)
        per_phase[name] = tput
    static = [n for n in runs if n != "adaptive"]
    oracle = [max((per_phase[n][p] for n in static if per_phase[n][p] is not None), default=None)
              for p in range(phases)]
    oracle_plan = [max((n for n in static if per_phase[n][p] is not None), key=lambda n: per_phase[n][p] or 0.0,
                       default=None) for p in range(phases)]
    adaptive = runs["adaptive"]
    tokens = [sum(r["tokens"] for r in adaptive["steps"] if r["phase"] == p) for p in range(phases)]
    ratio = None
    if not adaptive["crashed"] and all(o is not None for o in oracle):
        oracle_time = sum(t / o for t, o in zip(tokens, oracle))  # type: ignore[operator]
        ratio = oracle_time / sum(r["cpu_seconds"] for r in adaptive["steps"])
    return {"per_phase_tokens_per_cpu_second": per_phase, "oracle_per_phase": oracle, "oracle_plan_per_phase": oracle_plan,
            "adaptive_vs_oracle_per_phase": [(a / o if a and o else None) for a, o in zip(per_phase["adaptive"], oracle)],
            "adaptive_vs_oracle_throughput": ratio}


def _phase_table(runs: dict[str, dict]) -> list[dict]:
    """Per phase of the adaptive run: its plan(s), tokens/s and peak vs budget."""
    out = []
    for p, top in enumerate(PHASE_MAX):
        steps = [r for r in runs["adaptive"]["steps"] if r["phase"] == p]
        if steps:
            out.append({"phase": p, "max_len": top, "plans": sorted({r["plan"] for r in steps}),
                        "recompute": sorted({r["recompute"] for r in steps}),
                        "micro_batch_tokens": sorted({r["micro_batch_tokens"] for r in steps}),
                        "tokens_per_cpu_second": sum(r["tokens"] for r in steps) / sum(r["cpu_seconds"] for r in steps),
                        "peak_bytes": max(r["peak_bytes"] for r in steps), "budget_bytes": BUDGET})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="bench/results/selector.json", help="where to write the results")
    ap.add_argument("--quick", action="store_true", help="one step per phase")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        rank_main(json.loads(args.child), args.rank, args.port)
        return 0
    start = time.monotonic()
    steps = [1] * len(PHASE_MAX) if args.quick else [2] * len(PHASE_MAX)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"calibrating the cost model on {WORLD} gloo ranks ...", flush=True)
        cost_model, calibration = calibrate(tmp)
        for r in calibration:
            print(f"  {r['layout']:6s} s={r['seq_len']:4d} recompute={int(r['recompute'])} mbs={r['micro_batches']}: "
                  f"{r['cpu_seconds'] * 1e3:7.1f} ms measured, {r['predicted_seconds'] * 1e3:7.1f} ms fitted")
        print(f"  cost model: {cost_model}", flush=True)
        specs = [{"mode": "static", "name": f"{lay}{'_recompute' if rc else ''}", "layout": lay, "recompute": rc}
                 for lay, rc in STATIC] + [{"mode": "adaptive", "name": "adaptive"}]
        for spec in specs:
            spec.update(steps_per_phase=steps, tmp=tmp, cost_model=cost_model)
            run = runs[spec["name"]] = run_one(spec)
            crash = run["crash"]
            where = (f"crashed in phase {crash.get('phase', -1) + 1}/{len(PHASE_MAX)} ({crash['error'][:80]})"
                     if crash else "completed")
            st = run["steps"]
            print(f"  {spec['name']:16s} {where}; {len(st)} steps, "
                  f"{sum(x['tokens'] for x in st) / max(1e-9, sum(x['cpu_seconds'] for x in st)):6.0f} tok/cpu-s, "
                  f"peak {max((x['peak_bytes'] for x in st), default=0) / 2**20:.0f} MiB", flush=True)
    summary = summarize(runs, len(PHASE_MAX))
    adaptive = runs["adaptive"]["steps"]
    adaptive_plans = [{k: x[k] for k in ("step", "plan_version", "plan", "micro_batch_tokens", "recompute", "relaid",
                                         "reason")} for x in adaptive if x["reason"]]
    plans_used = list(dict.fromkeys(x["plan"] for x in adaptive))
    static_names = [s["name"] for s in specs if s["mode"] == "static"]
    result = {"model": MODEL, "world": WORLD, "phase_max_len": PHASE_MAX, "rows_per_step": GROUPS * GROUP_SIZE,
              "steps_per_phase": steps,
              "memory_cap": {"mechanism": "resource.setrlimit(RLIMIT_DATA) in each rank after start-up (torch "
                                          "imported, gloo joined), before the model is built",
                             "budget_bytes_per_rank": BUDGET, "reserve_bytes": RESERVE, "malloc_env": MALLOC_ENV,
                             "peak_bytes": "per step, the max over ranks of peak RSS (VmHWM reset before the step) "
                                           "minus the RSS at start-up"},
              "selector": {"allow_fsdp": True, "allow_tp": True, "allow_sp": ALLOW_SP, "headroom": 1.0,
                           "upper_factor": 1.0},
              "throughput_unit": "tokens per rank-CPU-second (step tokens / mean over the 2 ranks of CPU seconds)",
              "cost_model": cost_model, "calibration": calibration, "static_plans": static_names,
              "static_crashes": sum(runs[n]["crashed"] for n in static_names),
              "static_crashed": [n for n in static_names if runs[n]["crashed"]],
              "adaptive_crashed": runs["adaptive"]["crashed"], "adaptive_plans": adaptive_plans,
              "plans_used": plans_used, "adaptive_phases": _phase_table(runs),
              **summary, "runs": runs, "quick": args.quick, "seconds": round(time.monotonic() - start, 1)}
    print(f"static plans: {len(static_names)}, crashed: {result['static_crashed']}; adaptive crashed: "
          f"{result['adaptive_crashed']}; plans used: {plans_used}")
    for ph in result["adaptive_phases"]:
        print(f"  phase {ph['phase'] + 1} (<= {ph['max_len']} tokens): {'/'.join(ph['plans'])} recompute="
              f"{ph['recompute']} mb={ph['micro_batch_tokens']}: {ph['tokens_per_cpu_second']:.0f} tok/cpu-s, "
              f"peak {ph['peak_bytes'] / 2**20:.0f} of {BUDGET / 2**20:.0f} MiB")
    print("per phase tokens/cpu-s: " + "; ".join(
        f"{n}: " + ", ".join(f"{v:.0f}" if v else "-" for v in vals)
        for n, vals in summary["per_phase_tokens_per_cpu_second"].items()))
    ratio = summary["adaptive_vs_oracle_throughput"]
    print(f"adaptive_vs_oracle_throughput = {ratio if ratio is None else round(ratio, 3)} (target >= 0.9)")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_result(out, result, indent=2)
    print(f"wrote {out} in {result['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
