"""One arm of bench/real_scale.py's comparison: the workload (the recall task whose context grows phase by phase),
one `earl-stream up` of a strategy under a per-rank memory cap with its ranks' memory and CPU sampled, the token-cap
probes a user tunes a static plan with, the held-out evaluation, and the summary of one run from the trainer's log and
the supervisor's status. The campaign (which runs, in which order, how often, and the comparison over them) is
bench/real_scale.py's.
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
from live_up import LiveUp  # noqa: E402  (bench/, beside this script)

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
