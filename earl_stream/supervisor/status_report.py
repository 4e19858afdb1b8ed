"""What the supervisor reports: the run's status (`status`: what `earl-stream status`, the live view and
`up`'s summary read) and its Prometheus gauges (`export_metrics`), both read from the `Supervisor`'s ledger,
workers, statistics window, planner and evaluations. Nothing here changes the supervisor's state."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from earl_stream import metrics as M
from earl_stream import protocol as P
from earl_stream.env.seeds import SEED_SPLIT
from earl_stream.supervisor.episode_window import outcome_rate, outcome_rate_stderr, window_stats
from earl_stream.supervisor.ledger import PromptState

if TYPE_CHECKING:
    from earl_stream.supervisor.server import Supervisor


def status(sup: Supervisor, now: float) -> dict[str, Any]:
    """What `earl-stream status` shows and `up`'s summary reads: counters, statistics, plans, pools, workers."""
    c = sup.ledger.counters
    stats = window_stats(sup.recent)
    wall = max(time.time() - sup.started, 1e-9)
    held: dict[str, int] = {}
    for g in sup.ledger.groups.values():
        if g.state == PromptState.INFLIGHT:
            held[g.worker_id] = held.get(g.worker_id, 0) + 1
    return {
        "address": sup.address,
        "metrics_address": sup.metrics_address,
        "policy_version": sup.policy_version,
        "finished": sup.finished,
        "revoked_workers": sorted(sup.revoked_workers),  # refused since `keys revoke WORKER_ID`
        "wall_seconds": wall,
        **dataclasses.asdict(c),
        "samples_in_store": sup.ledger.samples_waiting(),
        "samples_claimed": sup.ledger.samples_claimed(),
        "samples_uncheckpointed": sup.ledger.samples_uncheckpointed(),
        # episodes kept as several samples (rollout.non_append=split); segments_split and episodes_produced above
        "samples_per_episode": round(c.samples_produced / c.episodes_produced, 4) if c.episodes_produced else None,
        # after `up --resume`: samples lost with the earlier run's workers (or since) and played again;
        # None without a resume (samples_lost counts the whole run)
        "samples_replayed_since_resume": sup.replayed() if sup.lost_before_resume >= 0 else None,
        "mean_reward_last": stats.mean_reward,
        "win_rate_last": outcome_rate(sup.recent, "win"),
        # clustered by group (a group's games share a prompt, and may share a seed): the window's real uncertainty
        "win_rate_stderr_last": outcome_rate_stderr(sup.recent, "win"),
        "groups_last": len({e.group for e in sup.recent}),
        # every outcome the environments report (win, correct, truncated, ...) over the statistics window
        "outcomes_last": stats.outcomes,
        "draw_rate_last": outcome_rate(sup.recent, "draw"),
        "tokens_per_second": c.tokens_produced / wall,
        "context_length": stats.context_length,
        "plans": sup.planner.status(),
        "pools": {"rollout": _rollout_pool(sup)},
        # each attached environment with its part of the window: episodes_window, mean_reward,
        # mean_context_tokens, outcomes (e.g. one environment's win rate where several are attached)
        "envs": {e["name"]: {**e, **({"episodes_window": w.episodes, "mean_reward": w.mean_reward,
                                      "mean_context_tokens": w.mean_context_tokens, "outcomes": w.outcomes}
                                     if (w := stats.envs.get(e["name"])) else {})}
                 for e in sup.describe_envs()},
        "trainer": sup.trainer_metrics,
        # evaluation during training (eval.every): env -> latest round's version and value (success), pass@k,
        # mean reward, history; {} when off
        "eval": sup.evals.status() if sup.evals.enabled else {},
        # the seed space, split once: training resets environments with seeds in "train", evaluation of an
        # environment without held-out items plays seeds in "eval" ([start, stop) each; env/seeds.py)
        "seed_split": SEED_SPLIT,
        "workers": [{"id": w.worker_id, "role": w.role.value, "alive": w.alive, "pid": w.pid, "host": w.host,
                     "ray_node_id": w.ray_node_id,
                     "rank": w.rank, "last_seen_s": round(now - w.last_seen, 2), "stats": w.stats,
                     "groups_held": held.get(w.worker_id, 0), "draining": w.draining, "drained": w.drained,
                     "shard_address": w.shard_address, "metrics_address": w.metrics_address,
                     "openai_url": w.openai_url}
                    for w in sup.workers.values() if w.role != P.Role.CLIENT],
    }

def _rollout_pool(sup: Supervisor) -> dict[str, Any]:
    """The elastic pool: `desired` (None until `scale` sets it), live `active` and `draining` workers."""
    live = [w for w in sup.workers.values() if w.role == P.Role.ROLLOUT and w.alive]
    return {"desired": sup.rollout_replicas if sup.rollout_replicas >= 0 else None,
            "active": sum(not w.draining for w in live), "draining": sum(w.draining for w in live),
            "drained": sum(w.drained for w in sup.workers.values() if w.role == P.Role.ROLLOUT)}


def export_metrics(sup: Supervisor) -> None:
    """The supervisor's Prometheus gauges from its counters, workers and statistics window."""
    c = sup.ledger.counters
    for kind in ("samples_produced", "samples_consumed", "samples_lost", "samples_stale", "samples_filtered",
                 "samples_recovered", "samples_too_long", "prompts_reissued", "duplicates_detected"):
        M.SUP_SAMPLES.labels(kind).set(getattr(c, kind))
    M.SUP_SAMPLES.labels("in_store").set(sup.ledger.samples_waiting())
    for role in (P.Role.ROLLOUT, P.Role.TRAINER):
        ws = [w for w in sup.workers.values() if w.role == role]
        M.SUP_WORKERS.labels(role.value, "alive").set(sum(w.alive for w in ws))
        M.SUP_WORKERS.labels(role.value, "dead").set(sum(not w.alive and not w.drained for w in ws))
        M.SUP_WORKERS.labels(role.value, "draining").set(sum(w.alive and w.draining for w in ws))
        M.SUP_WORKERS.labels(role.value, "drained").set(sum(w.drained for w in ws))
    sup.evals.export_metrics()
    stats = window_stats(sup.recent)
    if stats.mean_reward is not None:
        M.SUP_REWARD.set(stats.mean_reward)
        for label, tokens in stats.context_length.items():
            M.SUP_CONTEXT.labels(label).set(tokens)
        for env, w in stats.envs.items():
            M.SUP_ENV_REWARD.labels(env).set(w.mean_reward)
