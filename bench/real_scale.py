"""SmolLM2-135M trained by GRPO on episodes whose context grows 8.6x, a trainer pool of 2 ranks under a real
per-rank memory cap: the adaptive selector side by side with every static plan a user would configure (each
with its token cap tuned until it fits) and the trainer's per-micro-batch dynamic sequence parallelism.

    python bench/real_scale.py --json bench/results/real_scale.json                   # smollm2 setting (~2.9 h)
    python bench/real_scale.py --resume --json bench/results/real_scale.json          # continue a killed campaign
    python bench/real_scale.py --setting heads8 --json bench/results/real_scale_heads8.json   # (~5.9 h)
    python bench/real_scale.py --quick --json /tmp/real_scale_quick.json [--only adaptive,static:fsdp2+rc]

The workload (configs/smollm2_real_scale.yaml, envs/long_recall.py with `facts_last`): a document of filler words,
then two facts and the question for one of them, one reply of up to 8 tokens, reward 1 for the right value. The
facts sit next to the question, so SmolLM2-135M-Instruct earns reward at every length: before training, greedy, 24
items per length, 0.46 +- 0.10 (standard error) at ~118 tokens, 0.46 +- 0.10 at ~200, 0.38 +- 0.10 at ~420 and 0.67
+- 0.10 at ~1,015 (measured with the earlier sizes: 48 words x2.7); sampled at the rollout's temperature 0.7,
0.21 +- 0.06 of 48 episodes at ~118 (at 1.0, 0.13: a phase would often see no reward). A step trains 8 sequences
(2 prompt groups x GRPO groups of 4); the document grows x3.3 per level over 4 levels (20 filler words at the
first), 3 steps each (`level_groups`): 92, 138, 290 and 791 tokens per episode in SmolLM2's chat template (8.6x),
so 9 of the 12 steps are at the short and middle lengths and the last 3 are the tail at the longest. At 8 x 791
tokens a step, under the 4.5 GiB cap, micro-batch size, recomputation and sharding are meant to change the step time
(a replica with AdamW holds 2.2 GiB, the fp32 logits ~0.6 GiB per 1,024 micro-batch tokens; the token-cap probes
measure where each plan stops fitting; in --quick at 4.4 GiB, dp2 was OOM-killed in its longest phase). Held-out
success (greedy, --heldout-problems items spread over the 4 lengths, evaluation seeds no run trains on) of the base
model (`heldout_before`) and of the adaptive run's last checkpoint (`heldout_after`), each with its standard error;
rewards per phase from the trainer's step log (`reward_per_phase`).

Two model settings (--setting):
- smollm2: the real weights (`make real-model`), learning; its 9 attention heads allow dp/FSDP and
  recomputation only. Arms: adaptive, static dp2, dp2+rc, fsdp2, fsdp2+rc.
- heads8: SmolLM2's size (hidden 576, 30 layers, its vocabulary and tokenizer) with 8 attention and 4 KV heads,
  random weights, built once under ~/.cache/earl_stream/models/ and loaded from there (systems only: rewards
  are ~0). Arms: adaptive, dynamic_sp, static dp2, fsdp2, tp2, sp2, each with and without recomputation.

Every arm is one `earl-stream up` on the same seeds, environment, steps and cap:
- adaptive: the selector on (it re-plans dp/FSDP2/tp/sp, recomputation and the micro-batch budget as the context
  percentiles cross its thresholds), told the cap less --reserve-gib, starting from a cost model calibrated on
  these CPUs (--cost-model; for heads8 on its own model by bench/cost_calibration.py, as a user calibrates once
  on new hardware; each adaptive run records the file it started from);
- static:<plan>: one layout for the whole run, no memory model (the selector is told 1 TiB), and verl-style
  dynamic batching: micro-batches filled up to a token cap (bench/real_scale_site sets the selector's largest
  micro-batch). The cap is what a user tunes until the plan fits: before the plan's first run the benchmark
  probes it (--probe-steps steps with every episode at the longest length), from the whole step on one rank down
  to the longest episode, halving, and keeps the largest that survives (`token_caps`, with every probe). A plan
  whose first run is OOM-killed (in a shorter phase, whose micro-batches hold more rows, or at the smallest of
  --max-probes caps that all failed) runs again at half that cap while it is no shorter than the longest
  episode, as its user would (each crashed run is kept among the probes, `full_run`). A plan
  that survives no cap runs at the smallest and meets its crash; one the pool or the model cannot run "does not
  start", with its reason;
- dynamic_sp (heads8): verl's dynamic context parallelism as the trainer runs it (`trainer.dynamic_sp_tokens`):
  the sharding fixed at fsdp2 with fsdp2's token cap, and a row longer than midway between the last two phases'
  lengths trained by both ranks at Ulysses sp=2 in a micro-batch of its own (`dynamic_sp_real`: true).
Each trainer rank is capped before it imports torch (bench/real_scale_site: a memory cgroup of its own, or
setrlimit with --cap-mode rlimit) at --cap-gib. Past the cap the kernel kills the rank (or torch raises): a crash.
A run that ends early without one (e.g. `up` gave up) is `stopped`, with its reason, never a crash.

Recorded per run from the trainer's log and the supervisor's status: crashes (and the allocation error), refused
or truncated samples, trained tokens per training second per context phase (and per rank-CPU-second, from /proc),
the plans adopted, each re-layout's measured peak and each rank's peak.

Repeats (--repeats, default 3): a first pass runs every arm once; static plans that crashed in it are not
repeated; then the others run again, interleaved (adaptive, dynamic_sp, static:a, ..., adaptive, ...), so load
drifts hit every arm alike. From all repeats (bench/real_scale_summary.py): repeats, end_to_end_seconds (first
step's start to last step's end: re-plans, switches and idle waits included), vs_best_static_end_to_end (the best
crash-free static plan's mean over adaptive's, with ci95), static_oracle (each phase trained by the static plan
fastest in it, switches free: the most any plan choice could gain over the best static plan), tuning_seconds and
vs_best_static_with_tuning (what the probes that found each static cap took, and the comparison with the best
static plan's added: the main comparison gives the static plans their caps for free), per_phase (plans and tokens/s with ci95),
phase_vs_fastest_static and same_plan_phases (a phase where both sides ran the same plan is never a speedup or a
loss), vs_fastest_static_min_differing, reward_per_phase, dynamic_sp_real, heldout_before, heldout_after,
token_caps, and repeat_runs (the repeats after the first).

Budget. The sizes are the smallest the comparison allows: 8 sequences a step, 3 steps a phase, 4 phases growing
8.6x; a run then trains ~31,500 tokens, ~10.5 minutes here at ~60 trained tokens/s (2 cores) with start-up. The
smollm2 setting (5 arms x 3 repeats, 8 probes) is ~2.9 h and heads8 (10 arms x 3, 18 probes) ~5.9 h less the
crashed static plans' repeats: together over the 3 hours the comparison should take on this machine, because
SmolLM2 at ~60 tokens/s on 2 cores cannot train 45 runs of this size in 3 hours; each setting runs as its own
campaign, --resume continues one that was killed (across sessions of a machine that is lent for less time than a
campaign takes), and the printed estimate (--rate: the tokens/s to plan with) says what a run will take.
--quick (3 phases of one step, ~94 -> ~220 tokens, a 4.4 GiB cap, one repeat, at most 2 probes per plan, 15
held-out items) checks the whole pipeline in ~35 minutes of the smollm2 setting on an idle machine (the estimate
printed says 34); under a load of 10-20 on the 2 cores it trained ~8-14 tokens/s and took over an hour.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from live_up import LiveUp, stop_on_sigterm  # noqa: E402  (bench/, beside this script)
from real_scale_summary import summarize_repeats, tuning  # noqa: E402

from bench.provenance import write_result  # noqa: E402

CONFIG = ROOT / "configs" / "smollm2_real_scale.yaml"
SITE = ROOT / "bench" / "real_scale_site"
MODELS = Path.home() / ".cache" / "earl_stream" / "models"
SMOLLM2_DIR = MODELS / "smollm2-135m-instruct"
HEADS8_DIR = MODELS / "smollm2-shape-8h4kv-random"
GIB = 1 << 30
BASE_TOKENS = 70  # an episode's tokens besides the filler (system prompt, chat template, facts, question, reply)
RUN_OVERHEAD_S = 100.0  # one `up` on this machine before its first step and after its last (estimate only)
NO_MEMORY_MODEL = 1 << 40  # the selector budget of the static and dynamic-SP runs: no plan is refused for memory
_STEP = re.compile(r"^(\S+ \S+) .*step (\d+): loss \S+ grad-norm \S+ reward (\S+) \((\d+) samples, (\d+) tokens\) "
                   r"in ([\d.]+)s")
_RELAY = re.compile(r"^(\S+ \S+) .*step (\d+): re-la(ying|id) the model from (\S+) to (\S+)")
_ADOPT = re.compile(r"^(\S+ \S+) .*step (\d+): adopted trainer plan v(\d+): (\S+) .*micro-batch (\d+) tokens, "
                    r"recompute (\w+)")
_ALLOC = re.compile(r"can't allocate memory|MemoryError|out of memory|Killed|SIGKILL", re.I)


def strategies(nproc: int, setting: str) -> list[str]:
    """The arms of a model setting: SmolLM2's 9 heads allow dp/FSDP (and recomputation) only; the 8-head shape
    adds tp and sp and the per-micro-batch dynamic sequence-parallel policy."""
    layouts = (f"dp{nproc}", f"fsdp{nproc}") if setting == "smollm2" else \
        (f"dp{nproc}", f"fsdp{nproc}", f"tp{nproc}", f"sp{nproc}")
    static = [f"static:{p}{rc}" for p in layouts for rc in ("", "+rc")]
    return ["adaptive", *(["dynamic_sp"] if setting == "heads8" else []), *static]


def build_heads8_model(out: Path = HEADS8_DIR) -> Path:
    """SmolLM2-135M's size (hidden 576, 30 layers, its vocabulary and tokenizer) with 8 attention heads and 4 KV
    heads, random weights (seed 0): a shape that tp2 and sp2 can split. Built once, then loaded from `out`."""
    if (out / "config.json").exists():
        return out
    import torch
    from real_scale_single import SMOLLM2_135M
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(0)
    config = LlamaConfig(**{**SMOLLM2_135M, "num_attention_heads": 8, "num_key_value_heads": 4},
                         max_position_embeddings=8192)
    LlamaForCausalLM(config).save_pretrained(tmp)
    for f in SMOLLM2_DIR.iterdir():  # the tokenizer and chat template of the real model
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    return out


def level_words(args: argparse.Namespace) -> list[int]:
    """Filler words per episode at each context phase (level)."""
    return [round(args.filler_words * args.filler_factor ** k) for k in range(args.levels)]


def env_params(args: argparse.Namespace, longest_only: bool = False) -> dict[str, Any]:
    """The recall task with its facts next to the question; a phase of --steps-per-phase steps per level
    (`level_groups`: prompt groups per level). `longest_only`: every episode at the last level (a token-cap probe)."""
    words = level_words(args)
    base = {"turns": 1, "max_turns": 1, "facts_per_turn": 2, "facts_last": True, "max_filler_words": words[-1]}
    if longest_only:
        return {**base, "filler_words": words[-1], "filler_factor": 1.0}
    return {**base, "filler_words": args.filler_words, "filler_factor": args.filler_factor,
            "level_groups": [args.steps_per_phase * args.groups_per_step] * args.levels}


def phase_lengths(args: argparse.Namespace) -> list[int]:
    """Expected tokens per episode at each curriculum level (what a step's samples are binned by)."""
    return [BASE_TOKENS + w for w in level_words(args)]


def setup(kind: str, args: argparse.Namespace, token_cap: int = 0, probe: bool = False) -> tuple[list[str], dict[str, str]]:
    """`up` overrides and the bench hooks' environment of one strategy. `token_cap`: the largest micro-batch
    (verl-style dynamic batching) of a static plan or of the dynamic-SP arm's fixed plan; `probe`: every episode
    at the longest phase's length (the token-cap search)."""
    cap = int(args.cap_gib * GIB)
    params = json.dumps(env_params(args, longest_only=probe)).replace('"', "")
    over = [f"seed={args.seed}", f"trainer.nproc={args.nproc}", f"envs.0.params={params}", f"model.path={args.model_dir}",
            f"trainer.groups_per_step={args.groups_per_step}", f"trainer.group_size={args.group_size}",
            f"selector.trainer_memory_bytes={cap}", f"selector.reserve_bytes={int(args.reserve_gib * GIB)}",
            f"selector.initial_seq_len={args.initial_len}", f"selector.min_episodes={args.group_size}", *args.set]
    if args.cost_model:
        over.append(f"selector.cost_model_path={Path(args.cost_model).resolve()}")
    env = {"EARL_BENCH_RANK_CAP_BYTES": str(cap), "EARL_BENCH_CAP_MODE": args.cap_mode,
           "EARL_BENCH_CAP_TAG": kind.replace(":", "_").replace("+", "_"), "MALLOC_MMAP_THRESHOLD_": "65536"}
    if token_cap:
        env["EARL_BENCH_MAX_MICRO_BATCH_TOKENS"] = str(token_cap)
    unbounded = [f"selector.trainer_memory_bytes={NO_MEMORY_MODEL}", "selector.reserve_bytes=0"]
    if kind.startswith("static:"):  # later overrides win: no memory model, one plan
        over += [*unbounded, f"selector.plans={kind.split(':', 1)[1]}", "selector.upper_factor=1000", "selector.lower_factor=0.001"]
    elif kind == "dynamic_sp":  # the trainer's own per-micro-batch sp degree under one fixed FSDP plan
        over += [*unbounded, f"selector.plans=fsdp{args.nproc}", f"trainer.dynamic_sp_tokens={dynamic_sp_tokens(args)}",
                 "selector.upper_factor=1000", "selector.lower_factor=0.001"]
    return over, env


def dynamic_sp_tokens(args: argparse.Namespace) -> int:
    """The dynamic-SP arm's threshold: rows longer than midway between the last two phases' lengths (the
    longest phase's rows) run at sp=nproc, the rest at sp=1."""
    lengths = phase_lengths(args)
    return (lengths[-2] + lengths[-1]) // 2 if len(lengths) > 1 else lengths[0] // 2


class RssSampler(threading.Thread):
    """Resident memory (VmRSS) and peak (VmHWM) of the trainer ranks, and the CPU seconds each has used
    (all its threads, /proc/PID/stat), every `period` seconds."""

    def __init__(self, period: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.period, self.pids, self.samples, self.hwm = period, set[int](), dict[int, list](), dict[int, int]()
        self.cpu: dict[int, list[tuple[float, float]]] = {}
        self.done = threading.Event()

    def run(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self.done.wait(self.period):
            now = time.time()
            for pid in list(self.pids):
                try:
                    text = Path(f"/proc/{pid}/status").read_text()
                    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                fields = {ln.split(":")[0]: ln.split()[1] for ln in text.splitlines() if ln.startswith(("VmRSS", "VmHWM"))}
                if "VmRSS" in fields:
                    self.samples.setdefault(pid, []).append((now, int(fields["VmRSS"]) * 1024))
                    self.hwm[pid] = max(self.hwm.get(pid, 0), int(fields.get("VmHWM", 0)) * 1024)
                self.cpu.setdefault(pid, []).append((now, (int(stat[11]) + int(stat[12])) / tick))  # utime + stime

    def peak(self, pid: int, start: float, end: float) -> int:
        return max((b for t, b in self.samples.get(pid, []) if start <= t <= end), default=0)

    def cpu_seconds(self, pid: int, start: float, end: float) -> float | None:
        """CPU seconds `pid` used in [start, end] (the nearest samples at or before each end; the first sample
        when the rank was seen only after `start`)."""
        series = self.cpu.get(pid, [])
        before = [c for t, c in series if t <= start] or [c for _, c in series[:1]]
        upto = [c for t, c in series if t <= end]
        return upto[-1] - before[-1] if before and upto else None

    def rank_cpu_seconds(self, start: float, end: float) -> float | None:
        """The mean over the trainer ranks of the CPU seconds each used in [start, end]."""
        used = [c for pid in self.cpu if (c := self.cpu_seconds(pid, start, end)) is not None]
        return sum(used) / len(used) if used else None


def _cgroup(kind: str, pid: int) -> Path:
    tag = kind.replace(":", "_").replace("+", "_")
    v1 = Path(f"/sys/fs/cgroup/memory/earl_rs_{tag}_{pid}")
    return v1 if v1.exists() else Path(f"/sys/fs/cgroup/earl_rs_{tag}_{pid}")


def _cgroup_info(group: Path) -> dict[str, int]:
    out = {}
    for key, names in (("limit", ("memory.limit_in_bytes", "memory.max")),
                       ("peak", ("memory.max_usage_in_bytes", "memory.peak"))):
        for n in names:
            try:
                out[key] = int((group / n).read_text())
                break
            except (OSError, ValueError):
                pass
    for n in ("memory.oom_control", "memory.events"):
        try:
            for line in (group / n).read_text().splitlines():
                if line.startswith("oom_kill "):
                    out["oom_kills"] = int(line.split()[1])
        except OSError:
            pass
    return out


def _remove_cgroups(kind: str) -> None:
    tag = kind.replace(":", "_").replace("+", "_")
    for root in (Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")):
        for group in root.glob(f"earl_rs_{tag}_*"):
            try:
                group.rmdir()  # empty once its rank exited
            except OSError:
                pass


def run(kind: str, args: argparse.Namespace, out_dir: Path, token_cap: int = 0, probe: bool = False,
        evaluate: bool = False) -> dict[str, Any]:
    """One `up` of strategy `kind` (a probe: --probe-steps steps at the longest length); `evaluate`: the held-out
    success of its last checkpoint (`heldout`) before the checkpoints are removed."""
    over, env = setup(kind, args, token_cap, probe)
    steps = args.probe_steps if probe else args.steps
    run_dir = out_dir / f"real_scale_{kind.replace(':', '_').replace('+', '_')}{'_probe' if probe else ''}_run"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs" / "trainer.log").unlink(missing_ok=True)
    saved = {k: os.environ.get(k) for k in [*env, "PYTHONPATH"]}
    os.environ.update(env, PYTHONPATH=f"{SITE}:{ROOT}")  # LiveUp's child (and its children) inherit them
    try:
        up = LiveUp(run_dir, "--config", str(CONFIG), "--steps", str(steps), *over, log=run_dir / "up.log")
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    sampler = RssSampler()
    sampler.start()
    start, ended, timed_out, last, groups = time.monotonic(), "", False, None, {}
    try:
        while True:
            if up.proc.poll() is not None:
                if up.proc.returncode != 0:
                    ended = f"up exited with {up.proc.returncode}"
                break
            if time.monotonic() - start > args.run_minutes * 60:
                timed_out = True
                break
            s = up.status(timeout_s=5)
            if s is not None:
                last = s
                trainers = [w for w in s["workers"] if w["role"] == "trainer"]
                for w in trainers:
                    if w["pid"]:
                        sampler.pids.add(w["pid"])
                        groups.setdefault(w["pid"], _cgroup(kind, w["pid"]))
                if s.get("policy_version", 0) >= steps:
                    continue  # done: the ranks leave before `up` does
                dead = [w["id"] for w in trainers if not w["alive"]]
                kills = sum(_cgroup_info(g).get("oom_kills", 0) for g in groups.values())
                if dead or kills:
                    ended = f"trainer rank(s) {', '.join(dead) or '?'} died ({kills} OOM kill(s) in their cgroups)"
                    break
            time.sleep(2)
    finally:
        cg = {pid: _cgroup_info(g) for pid, g in groups.items()}
        up.stop()
        sampler.done.set()
        _remove_cgroups(kind)
    result = summarize(kind, args, run_dir, last, ended, timed_out, time.monotonic() - start, sampler, cg, steps)
    result["token_cap"] = token_cap or None
    if kind == "adaptive":  # the calibration its selector started from (a campaign resumed with another shows it)
        result["cost_model"] = _shown_path(args.cost_model) if args.cost_model else None
    if evaluate and not result["crashed"] and not result["stopped"] and result["started"]:
        result["heldout"] = heldout(run_dir, args)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # ~1.6 GB of weights and AdamW state per run
    return result


def _shown_path(path: str) -> str:
    """`path` relative to the repository when it is inside it."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def heldout(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Greedy success (and its standard error) of `model` (a model or run directory: its last checkpoint) on
    --heldout-problems evaluation items of the task, spread over every phase's length (`earl-stream eval`)."""
    out = Path(args.runs_dir or Path(args.json).parent).resolve() / f"heldout_{model.name}.json"  # beside the runs
    out.parent.mkdir(parents=True, exist_ok=True)  # the held-out score of the base model comes before any run
    params = json.dumps(env_params(args))
    cmd = [sys.executable, "-m", "earl_stream", "eval", "--model", str(model), "--env", "long_recall", "--config",
           str(CONFIG), "--params", params, "--problems", str(args.heldout_problems), "--temperature", "0",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0 or not out.exists():
        return {"error": (proc.stderr or proc.stdout)[-400:]}
    r = json.loads(out.read_text())
    return {"success": r["success"], "stderr": r["stderr"], "problems": r["problems"], "outcomes": r["outcomes"],
            "seconds": r["seconds"]}


def find_token_cap(kind: str, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """The largest micro-batch token cap at which static plan `kind` trains --probe-steps steps of the longest
    phase under the rank's cap, as a user tunes verl's `ppo_max_token_len_per_gpu`: candidates from the whole
    step on one rank (its share of every sequence) down to the longest sequence, halving, the first that
    survives wins. None where none does (the plan crashes at any cap) or the plan does not start."""
    longest = phase_lengths(args)[-1] + 32  # the longest episode and some of its spread
    data_ranks = args.nproc if kind.split(":", 1)[1].startswith(("dp", "fsdp")) else 1  # tp and sp ranks see every row
    share = args.groups_per_step * args.group_size * longest // data_ranks
    top = 1 << math.ceil(math.log2(share))
    candidates = ([c for c in (top >> k for k in range(8)) if c >= longest] or [top])[:args.max_probes]
    probes = []
    for c in candidates:
        r = run(kind, args, out_dir, token_cap=c, probe=True)
        probes.append({"tokens": c, "started": r["started"], "survived": r["started"] and not r["crashed"]
                       and not r["stopped"], "crashed": r["crashed"], "reason": r["crash_reason"] or r["start_error"][-200:],
                       "wall_seconds": r["wall_seconds"]})
        print(f"   probe {kind} micro-batch {c} tokens: {probes[-1]}", flush=True)
        if probes[-1]["survived"] or not r["started"]:
            break
    found = next((p["tokens"] for p in probes if p["survived"]), None)
    return {"tokens": found, "probes": probes, "longest_episode_tokens": longest}


def retune(kind: str, repeat: int, r: dict[str, Any], cap: int, longest: int) -> bool:
    """Whether a static plan's first run, OOM-killed at token cap `cap`, runs again at half of it (not below the
    longest episode), as the user who tunes the cap until the run fits would. The probes fill micro-batches with
    the longest phase's episodes, and a shorter phase packs more rows into the same cap (7 x 290 tokens against
    2 x 800 under 2,048); and --max-probes may stop the halving before the cap that fits."""
    if not kind.startswith("static:") or repeat or not r["crashed"] or not cap:
        return False
    return cap // 2 >= longest


def estimate_seconds(args: argparse.Namespace, kinds: list[str], rate: float) -> dict[str, float]:
    """What the benchmark should take on this machine: every run's tokens at `rate` trained tokens/s plus a
    start-up per run; the token-cap probes (two per static plan, a guess) at the longest length."""
    lengths = phase_lengths(args)
    per_step = args.groups_per_step * args.group_size
    run_s = RUN_OVERHEAD_S + sum(per_step * args.steps_per_phase * n for n in lengths) / rate
    probe_s = RUN_OVERHEAD_S + args.probe_steps * per_step * lengths[-1] / rate
    statics = sum(k.startswith("static:") for k in kinds)
    probes = 2 * (statics + ("dynamic_sp" in kinds))
    total = len(kinds) * args.repeats * run_s + probes * probe_s
    return {"per_run_s": round(run_s), "per_probe_s": round(probe_s), "probes": probes,
            "runs": len(kinds) * args.repeats, "total_s": round(total)}


def _ts(stamp: str) -> float:
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def parse_trainer_log(path: Path) -> dict[str, Any]:
    text = path.read_text(errors="replace") if path.exists() else ""
    steps: dict[int, dict[str, Any]] = {}
    relays: dict[int, dict[str, Any]] = {}
    adopted: list[dict[str, Any]] = []
    for line in text.splitlines():
        if m := _STEP.match(line):
            steps.setdefault(int(m[2]), {"step": int(m[2]), "t": _ts(m[1]), "samples": int(m[4]), "tokens": int(m[5]),
                                         "seconds": float(m[6]), "reward": float(m[3])})
        elif m := _RELAY.match(line):
            r = relays.setdefault(int(m[2]), {"step": int(m[2]), "from": m[4], "to": m[5]})
            r["start" if m[3] == "ying" else "end"] = _ts(m[1])
        elif (m := _ADOPT.match(line)) and not any(a["version"] == int(m[3]) for a in adopted):
            adopted.append({"step": int(m[2]), "version": int(m[3]), "plan": m[4] + ("+rc" if m[6] == "True" else ""),
                            "micro_batch_tokens": int(m[5])})
    errors = [ln.strip()[-300:] for ln in text.splitlines() if _ALLOC.search(ln)][:5]
    return {"steps": [steps[k] for k in sorted(steps)], "relays": [relays[k] for k in sorted(relays)],
            "adopted": adopted, "alloc_errors": errors}


def start_reason(run_dir: Path) -> str:
    """Why a run never trained: the supervisor's "no plan fits" (a forced plan the model cannot take among
    them), else the end of `up`'s output."""
    logs = [run_dir / "logs" / "supervisor.log", run_dir / "up.log"]
    text = "\n".join(p.read_text(errors="replace") for p in logs if p.exists())
    for marker in ("no trainer plan fits", "Error"):
        lines = [ln for ln in text.splitlines() if marker in ln]
        if lines:
            return lines[-1].strip()[-600:]
    return text[-400:].strip()


def end_of_run(started: bool, steps: int, wanted: int, ended: str, timed_out: bool, oom_kills: int,
               alloc_errors: list[str]) -> tuple[bool, str]:
    """(crashed, why the run ended early). A crash is a real allocation failure: an OOM kill in a rank's cgroup
    or an allocation error in the trainer's log. A run that trained every step did not end early (its ranks
    leave before `up` does); one that never started did not crash; any other early end is a stop, not a crash."""
    if not started or steps >= wanted:
        return False, ""
    crashed = bool(oom_kills or alloc_errors)
    why = ended or ("the run's time limit (--run-minutes)" if timed_out else "")
    if crashed and "OOM kill" not in why:
        why = f"{why}: {oom_kills} OOM kill(s) in the ranks' cgroups" if oom_kills else f"{why}: {alloc_errors[0]}"
    return crashed, why


def summarize(kind: str, args: argparse.Namespace, run_dir: Path, status: dict[str, Any] | None, ended: str,
              timed_out: bool, wall: float, sampler: RssSampler, cgroups: dict[int, dict[str, int]],
              steps: int) -> dict[str, Any]:
    log = parse_trainer_log(run_dir / "logs" / "trainer.log")
    started = bool(log["adopted"]) or bool(log["steps"])
    start_error = "" if started else start_reason(run_dir)
    kills = sum(c.get("oom_kills", 0) for c in cgroups.values())
    crashed, why = end_of_run(started, len(log["steps"]), steps, ended, timed_out, kills, log["alloc_errors"])
    lengths = phase_lengths(args)
    phases: list[dict[str, Any]] = [{"phase": k, "expected_tokens": n, "steps": 0, "tokens": 0, "seconds": 0.0,
                                     "cpu_seconds": 0.0, "episode_tokens": []} for k, n in enumerate(lengths)]
    for st in log["steps"]:
        per = st["tokens"] / max(1, st["samples"])
        st["phase"] = min(range(len(lengths)), key=lambda i: abs(math.log(per / lengths[i])))
        st["cpu_seconds"] = sampler.rank_cpu_seconds(st["t"] - st["seconds"], st["t"])
        phases[st["phase"]]["episode_tokens"].append(round(per))
    # A run's first step also allocates the optimizer state and first touches every page: it is left out of
    # its phase's rates when that phase has another step (`warmup_step`), for every strategy alike.
    for i, st in enumerate(log["steps"]):
        st["warmup"] = i == 0 and [o["phase"] for o in log["steps"]].count(st["phase"]) > 1
        if st["warmup"]:
            continue
        ph = phases[st["phase"]]
        ph["steps"] += 1
        ph["tokens"] += st["tokens"]
        ph["seconds"] += st["seconds"]
        ph["cpu_seconds"] += st["cpu_seconds"] or 0.0
    for ph in phases:
        ph["tokens_per_s"] = round(ph["tokens"] / ph["seconds"], 2) if ph["seconds"] else None
        # per rank-CPU-second: what the other users of a shared machine take from a run's wall time is left out
        ph["tokens_per_cpu_s"] = round(ph["tokens"] / ph["cpu_seconds"], 2) if ph["cpu_seconds"] else None
        ph["cpu_seconds"] = round(ph["cpu_seconds"], 2)
        ph["p99_episode_tokens"] = max(ph.pop("episode_tokens"), default=None)
    switches = []
    for r in log["relays"]:
        if "start" in r and "end" in r:
            peaks = {str(pid): sampler.peak(pid, r["start"] - 0.2, r["end"] + 0.2) for pid in sampler.samples}
            switches.append({**r, "seconds": round(r["end"] - r["start"], 2), "peak_rss_bytes": peaks})
    counters = status or {}
    outcomes = counters.get("outcomes_last") or {}
    plan = (counters.get("plans") or {}).get("trainer") or {}
    crash_phase = None  # the phase a crashed (or stopped) run did not finish
    if why:
        crash_phase = min(log["steps"][-1]["phase"] + 1, len(lengths) - 1) if log["steps"] else 0
    return {
        "kind": kind, "started": started, "start_error": start_error, "crashed": crashed,
        "stopped": bool(why) and not crashed, "crash_reason": why, "alloc_errors": log["alloc_errors"],
        "crash_phase": crash_phase,
        "timed_out": timed_out, "wall_seconds": round(wall, 1), "steps": len(log["steps"]),
        "trained_tokens": sum(s["tokens"] for s in log["steps"]),
        "train_seconds": round(sum(s["seconds"] for s in log["steps"]), 2),
        "warmup_step": next(({k: s[k] for k in ("step", "phase", "tokens", "seconds")} for s in log["steps"]
                             if s["warmup"]), None),
        # refused as too long for any plan (status `samples_too_long`, where the supervisor counts it) + cut by the
        # environment (none here: the recall episodes have no context limit)
        "truncated": int(counters.get("samples_too_long", 0) or 0),
        "samples_too_long": counters.get("samples_too_long"), "truncated_fraction_last": outcomes.get("truncated", 0.0),
        "phases": phases, "plans_used": [a["plan"] + f"/{a['micro_batch_tokens']}" for a in log["adopted"]],
        "adopted": log["adopted"], "switches": switches,
        "peak_rss_bytes": {str(pid): b for pid, b in sampler.hwm.items()},
        "cgroups": {str(pid): v for pid, v in cgroups.items()},
        "last_plan": plan, "refused": (counters.get("plans") or {}).get("refused"),
        "infeasible": (counters.get("plans") or {}).get("infeasible"),
        "step_log": log["steps"],
    }


def aggregate(runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The result's keys from the runs: adaptive against the best static plan and the dynamic policy (missing
    strategies give None)."""
    adaptive, dynamic = runs.get("adaptive"), runs.get("dynamic_sp")
    static = {k.split(":", 1)[1]: r for k, r in runs.items() if k.startswith("static:")}
    levels = args.levels

    def survived(r: dict[str, Any], k: int) -> bool:  # trained phase k and did not crash (or stop) in it
        return r["started"] and r["phases"][k]["steps"] > 0 and r["crash_phase"] != k

    def versus(key: str) -> list[dict[str, Any]]:  # adaptive over the best surviving static plan, per phase
        out = []
        for k in range(levels):
            best = max(((n, r["phases"][k].get(key)) for n, r in static.items() if survived(r, k)
                        and r["phases"][k].get(key)), key=lambda x: x[1], default=(None, None))
            mine = adaptive["phases"][k].get(key) if adaptive else None
            out.append({"phase": k, f"adaptive_{key}": mine, "best_static": best[0], f"best_static_{key}": best[1],
                        "ratio": round(mine / best[1], 3) if mine and best[1] else None})
        return out

    per_phase, per_phase_cpu = versus("tokens_per_s"), versus("tokens_per_cpu_s")
    ratios = [p["ratio"] for p in per_phase if p["ratio"] is not None]
    ratios_cpu = [p["ratio"] for p in per_phase_cpu if p["ratio"] is not None]

    def rate(r: dict[str, Any] | None) -> float | None:
        return r["trained_tokens"] / r["train_seconds"] if r and r["train_seconds"] else None

    growth = None
    if adaptive:
        p99 = [p["p99_episode_tokens"] for p in adaptive["phases"] if p["p99_episode_tokens"]]
        growth = round(p99[-1] / p99[0], 2) if len(p99) >= 2 else None
    return {
        "adaptive_crashed": adaptive["crashed"] if adaptive else None,
        "adaptive_truncated": adaptive["truncated"] if adaptive else None,
        "static": {n: {"started": r["started"], "start_error": r["start_error"], "crashed": r["crashed"],
                       "stopped": r.get("stopped", False), "crash_phase": r["crash_phase"], "end_reason": r["crash_reason"],
                       "truncated": r["truncated"],
                       "tokens_per_s": [p["tokens_per_s"] for p in r["phases"]],
                       "tokens_per_cpu_s": [p.get("tokens_per_cpu_s") for p in r["phases"]], "plans_used": r["plans_used"],
                       "trained_tokens": r["trained_tokens"]} for n, r in static.items()},
        "vs_best_static_min": min(ratios) if ratios else None,
        "vs_best_static_per_phase": per_phase,
        # the same per rank-CPU-second (the runs follow each other on a shared machine whose load varies)
        "vs_best_static_min_cpu": min(ratios_cpu) if ratios_cpu else None,
        "vs_best_static_per_phase_cpu": per_phase_cpu,
        # trained tokens over the run (same steps and time budget; a crash ends a run)
        "vs_dynamic_sp": round(adaptive["trained_tokens"] / dynamic["trained_tokens"], 3)
        if adaptive and dynamic and dynamic["trained_tokens"] else None,
        # and per second of training while both ran (the phases the dynamic policy survived weigh in)
        "vs_dynamic_sp_tokens_per_s": round(rate(adaptive) / rate(dynamic), 3) if rate(adaptive) and rate(dynamic)
        else None,
        "dynamic_sp": {k: dynamic[k] for k in ("crashed", "stopped", "crash_phase", "crash_reason", "truncated",
                                               "plans_used", "trained_tokens")}
        | {"tokens_per_s": [p["tokens_per_s"] for p in dynamic["phases"]]} if dynamic else None,
        "plans_used": adaptive["plans_used"] if adaptive else None,
        "switch_peak_bytes": [max(s["peak_rss_bytes"].values(), default=0) for s in adaptive["switches"]]
        if adaptive else None,
        "context_growth": growth,
        "static_crashed_any": any(r["crashed"] for r in static.values()),
    }


def table(result: dict[str, Any], runs: dict[str, dict[str, Any]]) -> str:
    rows = [f"{'strategy':18s} {'start':5s} {'crash':5s} {'phase':5s} {'steps':>5s} "
            + " ".join(f"{'tok/s p' + str(k):>10s}" for k in range(len(next(iter(runs.values()))['phases'])))
            + "  plans"]
    for name, r in runs.items():
        tps = " ".join(f"{p['tokens_per_s'] or 0:10.1f}" for p in r["phases"])
        rows.append(f"{name:18s} {str(r['started'])[0]:5s} {str(r['crashed'])[0]:5s} "
                    f"{'' if r['crash_phase'] is None else r['crash_phase']!s:5s} {r['steps']:5d} {tps}  "
                    f"{' -> '.join(r['plans_used']) or r['start_error'][-80:]}")
    keys = ("adaptive_crashed", "adaptive_truncated", "vs_best_static_min", "vs_best_static_min_cpu", "vs_dynamic_sp",
            "plans_used", "switch_peak_bytes", "context_growth", "static_crashed_any", "repeats", "end_to_end_seconds",
            "vs_best_static_end_to_end", "static_oracle", "vs_best_static_with_tuning", "same_plan_phases",
            "vs_fastest_static_min_differing", "reward_per_phase", "dynamic_sp_real", "heldout_before", "heldout_after", "token_caps")
    return "\n".join(rows + [f"{k}: {result[k]}" for k in keys])


def next_run(kinds: list[str], runs: dict[str, Any], later: dict[str, list[Any]], repeats: int) -> tuple[str, int] | None:
    """The campaign's next (strategy, repeat index), None when it is complete: a first pass over every strategy,
    then the repeats interleaved (A B C A B C ...) over the strategies that may repeat; a static plan that crashed,
    stopped or did not start in the first pass is not repeated. `runs`: each strategy's first repeat; `later`:
    its repeats after the first (what a --resume found recorded counts as done)."""
    for kind in kinds:
        if kind not in runs:
            return kind, 0
    again = [k for k in kinds if not k.startswith("static:") or
             (runs[k]["started"] and not runs[k]["crashed"] and not runs[k]["stopped"])]
    for repeat in range(1, repeats):
        for kind in again:
            if len(later.get(kind, [])) < repeat:
                return kind, repeat
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", choices=("smollm2", "heads8"), default="smollm2",
                    help="smollm2: the real SmolLM2-135M-Instruct weights (learning; dp/FSDP/recomputation arms); "
                         "heads8: its size with 8 attention and 4 KV heads, random weights (systems only; adds tp, sp "
                         "and the dynamic sequence-parallel arm)")
    ap.add_argument("--json", default="", help="results file, also the runs' parent dir (default: "
                    "bench/results/real_scale.json, or real_scale_heads8.json)")
    ap.add_argument("--quick", action="store_true",
                    help="the same experiment, smaller: 3 phases of one step, ~94 -> ~220 tokens per episode, one "
                         "repeat, at most 2 probes per plan (~35 minutes for the smollm2 setting on an idle machine)")
    ap.add_argument("--only", default="", help="comma-separated strategies to run (adaptive, dynamic_sp, "
                    "static:dp2, static:fsdp2+rc, ...); their results replace those in an existing --json")
    ap.add_argument("--runs-dir", default="", help="where each strategy's run directory goes (default: beside --json)")
    ap.add_argument("--nproc", type=int, default=2, help="trainer ranks")
    ap.add_argument("--cap-gib", type=float, default=4.5, help="memory cap of each trainer rank, all of its memory")
    ap.add_argument("--reserve-gib", type=float, default=0.7,
                    help="of the cap, what the selector keeps for what the memory model does not count: the runtime "
                         "(~0.5 GiB: Python, torch, gloo) and the allocator's slack")
    ap.add_argument("--cap-mode", choices=("cgroup", "rlimit"), default="cgroup",
                    help="cgroup: a memory cgroup per rank (root, resident memory, OOM kill); rlimit: RLIMIT_DATA")
    ap.add_argument("--filler-words", type=int, default=20, help="filler words per episode at level 0")
    ap.add_argument("--filler-factor", type=float, default=3.3, help="filler growth per level")
    ap.add_argument("--levels", type=int, default=4, help="context phases (curriculum levels)")
    ap.add_argument("--steps-per-phase", type=int, default=3, help="training steps per context phase")
    ap.add_argument("--groups-per-step", type=int, default=2, help="prompt groups per step")
    ap.add_argument("--group-size", type=int, default=4, help="episodes per prompt group (GRPO)")
    ap.add_argument("--probe-steps", type=int, default=2,
                    help="steps of a token-cap probe at the longest length (2: the second step's peak holds AdamW's "
                         "state, which the first allocates only after its backward pass; a one-step probe passed "
                         "dp2 at a cap where its run was then OOM-killed)")
    ap.add_argument("--max-probes", type=int, default=3, help="token caps tried per plan, largest first")
    ap.add_argument("--token-caps", default="", help="JSON {plan: tokens} that skips the probes of those plans")
    ap.add_argument("--heldout-problems", type=int, default=48, help="held-out items (spread over the phases)")
    ap.add_argument("--rate", type=float, default=60.0, help="trained tokens/s this machine gives (the estimate)")
    ap.add_argument("--initial-len", type=int, default=128, help="design length of the first plan (every strategy)")
    ap.add_argument("--cost-model", default=None,
                    help="the selector's starting cost model (selector.cost_model_path) for every run; by default the "
                         "calibration measured on these CPUs: for heads8 its own (bench/cost_calibration.py on the "
                         "8-head model, bench/results/cost_model_heads8.json), for smollm2 bench/selector.py's; '' = "
                         "the library's GPU-like defaults")
    ap.add_argument("--run-minutes", type=float, default=40.0, help="wall-clock limit of one strategy's run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="one more `up` override for every run (repeatable)")
    ap.add_argument("--rebuild", action="store_true", help="recompute the summary keys of --json from its runs")
    ap.add_argument("--resume", action="store_true",
                    help="continue the campaign recorded in --json: the strategies and repeats it holds are not run "
                         "again (its probes' token caps and held-out scores are kept); the rest follow in the usual "
                         "order (the first pass, then the interleaved repeats)")
    ap.add_argument("--repeats", type=int, default=0,
                    help="runs per strategy (default 3; --quick: 1). A first pass runs every strategy once; static plans "
                         "that crashed or stopped in it are not repeated; the other repeats interleave the rest "
                         "(adaptive, dynamic_sp, static:a, adaptive, ...) so load drifts hit every arm alike")
    args = ap.parse_args(argv)
    if args.quick:
        args.cap_gib, args.filler_words, args.filler_factor, args.levels = 4.4, 24, 2.5, 3
        args.steps_per_phase, args.heldout_problems, args.max_probes = 1, 15, 2
        args.run_minutes = min(args.run_minutes, 15.0)
    args.steps = args.levels * args.steps_per_phase
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.json = args.json or f"bench/results/real_scale{'_heads8' if args.setting == 'heads8' else ''}.json"
    if args.cost_model is None:
        args.cost_model = str(ROOT / "bench" / "results" / ("cost_model_heads8.json" if args.setting == "heads8"
                                                           else "selector.json"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()  # `kill` of the benchmark stops the run it is in
    args.model_dir = str(SMOLLM2_DIR if args.setting == "smollm2" else build_heads8_model())
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs_dir = Path(args.runs_dir) if args.runs_dir else out.parent
    previous = json.loads(out.read_text()) if out.exists() and (args.only or args.rebuild or args.resume) else {}
    runs: dict[str, dict[str, Any]] = dict(previous.get("runs", {}))  # each strategy's first repeat
    later: dict[str, list[dict[str, Any]]] = dict(previous.get("repeat_runs", {}))  # its repeats after the first
    caps: dict[str, Any] = dict(previous.get("token_caps", {}))
    caps.update({k: {"tokens": v, "probes": [], "given": True} for k, v in json.loads(args.token_caps or "{}").items()})
    extra: dict[str, Any] = {"heldout_before": previous.get("heldout_before"), "estimate": previous.get("estimate")}
    kinds = args.only.split(",") if args.only else strategies(args.nproc, args.setting)

    replaced: dict[str, tuple[Any, list[Any]]] = {}  # --only without --resume: kept until their re-run replaces them

    def result_now() -> dict[str, Any]:
        first = {**{k: r for k, (r, _) in replaced.items() if r is not None and k not in runs}, **runs}
        more = {**{k: rs for k, (_, rs) in replaced.items() if k not in runs}, **later}
        every = {kind: [r, *more.get(kind, [])] for kind, r in first.items()}
        after = (first.get("adaptive") or {}).get("heldout")
        dyn = first.get("dynamic_sp")
        repeated = summarize_repeats(every, args.levels, dynamic_sp_real=bool(dyn and dyn["started"]))
        return {**aggregate(first, args), **repeated, **tuning(caps, repeated["vs_best_static_end_to_end"]),
                "heldout_before": extra["heldout_before"], "heldout_after": after, "token_caps": caps,
                "phase_episode_tokens": phase_lengths(args), "estimate": extra.get("estimate"),
                "settings": {k: v for k, v in vars(args).items() if k != "json"}, "runs": first, "repeat_runs": more}

    if args.rebuild:  # a summary of the runs recorded: when and where they were measured stays the file's
        rebuilt = result_now()
        rebuilt["settings"] = previous.get("settings") or rebuilt["settings"]
        write_result(out, rebuilt, indent=1, measured=previous.get("provenance"))
        print(table(rebuilt, runs))
        return 0
    extra["estimate"] = estimate_seconds(args, kinds, args.rate)
    print(f"estimate ({args.setting}, {args.rate:g} trained tokens/s): {extra['estimate']}", flush=True)
    if args.setting == "smollm2" and extra["heldout_before"] is None:
        extra["heldout_before"] = heldout(SMOLLM2_DIR, args)
        print(f"   held-out before training: {extra['heldout_before']}", flush=True)

    def measure(kind: str, repeat: int) -> dict[str, Any]:
        print(f"== {kind} (repeat {repeat + 1} of {args.repeats})", flush=True)
        plan = kind.split(":", 1)[1] if kind.startswith("static:") else f"fsdp{args.nproc}" if kind == "dynamic_sp" else ""
        if plan and plan not in caps:  # the token cap a user tunes until the plan fits the longest phase
            caps[plan] = find_token_cap(f"static:{plan}", args, runs_dir)
        cap = (caps.get(plan) or {}).get("tokens") or 0
        if plan and not cap:  # no cap fits: the plan runs at its smallest probed cap and meets its crash (or fails to start)
            cap = min(p["tokens"] for p in caps[plan]["probes"]) if caps[plan]["probes"] else 0
        r = run(kind, args, runs_dir, token_cap=cap, evaluate=kind == "adaptive" and repeat == 0
                and args.setting == "smollm2")
        retuned = False
        while retune(kind, repeat, r, cap, (caps.get(plan) or {}).get("longest_episode_tokens", 0)):
            caps[plan]["probes"].append({"tokens": cap, "full_run": True, "started": True, "survived": False,
                                         "crashed": True, "reason": r["crash_reason"], "wall_seconds": r["wall_seconds"]})
            cap, retuned = cap // 2, True
            print(f"   {kind} was OOM-killed in phase {r['crash_phase']}: again at a {cap}-token cap", flush=True)
            r = run(kind, args, runs_dir, token_cap=cap)
        if retuned:
            caps[plan]["tokens"] = None if r["crashed"] else cap
        print(f"   started {r['started']} crashed {r['crashed']} ({r['crash_reason']}) steps {r['steps']} "
              f"tokens {r['trained_tokens']} plans {r['plans_used']} {r['start_error'][-200:]}", flush=True)
        return r

    if not args.resume:  # run these again; what the file holds of them stays in it until a re-run replaces it
        for kind in kinds:
            replaced[kind] = (runs.pop(kind, None), later.pop(kind, None) or [])
    while (due := next_run(kinds, runs, later, args.repeats)) is not None:
        kind, repeat = due
        r = measure(kind, repeat)
        if repeat == 0:
            runs[kind], later[kind] = r, []
        else:
            later[kind].append(r)
        write_result(out, result_now(), indent=1)  # after every run: a killed benchmark keeps what it measured
    print(table(result_now(), runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
