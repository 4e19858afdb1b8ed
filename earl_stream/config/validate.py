"""The run config's cross-field rules, checked once at load: what one field cannot do with another, with
the model on disk or with the engine. `load` reports these lines with every field's own problem in one
`ConfigError`.

This is the one place of the config that calls into the rest of the package: the rules of a subsystem
live beside it (`algo.checks`, `model.lora_checks`, `model.moe_checks`, `algo.distill`,
`evaluation.heldout`), each imported here when its section is on, and each imports the config's types
only (`earl_stream.config.run`), never this module.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from earl_stream.config.run import RunConfig


def cross_field_problems(cfg: RunConfig) -> list[str]:
    """What in `cfg` cannot work with the rest of it, the model or the engine (one line each; [] when all is well)."""
    from earl_stream.algo.checks import algo_problems  # it imports the estimator registry (numpy only)
    from earl_stream.model.hub import hub_problems  # Hub id or local folder (no network, no transformers)
    from earl_stream.tracking.registry import backend_problems  # names only: imports no tracker package

    out = algo_problems(cfg) + hub_problems(cfg.model) + backend_problems(cfg.logging.backends)
    if cfg.algo.routing_replay != "none":
        from earl_stream.model.moe_checks import routing_replay_problems  # reads the model's config.json

        out.extend(routing_replay_problems(cfg))
    if cfg.algo.distill.enabled:
        from earl_stream.algo.distill import distill_problems  # reads both tokenizers (transformers)

        out.extend(distill_problems(cfg))
    if cfg.model.lora.enabled:
        from earl_stream.model.lora_checks import lora_problems  # reads the model's config (transformers)

        out.extend(lora_problems(cfg))
    if cfg.rollout.weight_swap not in ("auto", "drain") and cfg.rollout.engine in ("vllm", "sglang"):
        out.append(f"rollout.weight_swap={cfg.rollout.weight_swap} is not available with rollout.engine="
                   f"{cfg.rollout.engine}: that backend returns whole turns, so it can neither stop rows at a decode "
                   "step nor say which tokens the old weights sampled (make_engine says more); use "
                   "rollout.weight_swap=drain, or rollout.engine=torch")
    if cfg.rollout.batch_invariant == "always" and cfg.rollout.engine != "torch":
        out.append(f"rollout.batch_invariant=always is not available with rollout.engine={cfg.rollout.engine}: only the "
                   "built-in engine makes a row's tokens independent of its batch; use rollout.engine=torch, or "
                   "rollout.batch_invariant=never (then a run at trainer.max_staleness=0 depends on how requests batch)")
    out.extend(_eval_problems(cfg))
    out.extend(_sandbox_problems(cfg))
    names = [n for n in cfg.selector.plans.split("|") if n]
    bad = [n for n in names if not _LAYOUT_NAME.fullmatch(n)]
    if bad:
        out.append(f"selector.plans: {bad} are not layout names (e.g. dp2, fsdp2, tp2, sp2, fsdp2_sp2, ep2, fsdp2_ep2, "
                   "each optionally with +rc, '|'-separated)")
    if eps := {int(m) for n in names for m in re.findall(r"(?:^|_)ep(\d+)", n)}:
        from earl_stream.model.moe_checks import expert_parallel_problems  # reads the model's config.json

        out.extend(expert_parallel_problems(cfg, sorted(eps)))
    return out


_AXIS = r"(dp\d+|fsdp\d+|tp\d+|sp\d+|ep\d+)"
_LAYOUT_NAME = re.compile(rf"(dp1|{_AXIS}(_{_AXIS})*)(\+rc)?")


def _sandbox_problems(cfg: RunConfig) -> list[str]:
    """Each environment's sandbox `limits` (names of sandbox.*'s limits, positive) and `network` (host:port)."""
    out: list[str] = []
    known = ("cpu_seconds", "memory_bytes", "processes", "wall_seconds")
    for env in cfg.envs:
        for key, value in env.limits.items():
            if key not in known:
                out.append(f"envs[{env.display_name}].limits: unknown limit {key!r}; choose from {', '.join(known)}")
            elif not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                out.append(f"envs[{env.display_name}].limits.{key}={value!r} must be a number > 0")
        for entry in env.network:
            host, _, port = str(entry).rpartition(":")
            if not host or not port.isdigit():
                out.append(f"envs[{env.display_name}].network: {entry!r} is not host:port")
    return out


def _eval_problems(cfg: RunConfig) -> list[str]:
    """The `eval` section: its environments are configured ones that can give held-out items."""
    if cfg.eval.every <= 0:
        return []
    from earl_stream.evaluation.heldout import HeldOutUnavailable, check_held_out

    out: list[str] = []
    names = {e.display_name: e for e in cfg.envs}
    if cfg.eval.samples > 1 and cfg.eval.temperature <= 0:
        out.append(f"eval.samples={cfg.eval.samples} at eval.temperature=0 plays each item the same greedy way: "
                   "set a temperature above 0 for pass@k with k > 1")
    for name in cfg.eval.envs or list(names):
        if name not in names:
            out.append(f"eval.envs: {name!r} names none of the run's environments {sorted(names)}")
            continue
        try:
            check_held_out(names[name].spec, name)
        except HeldOutUnavailable as exc:
            out.append(f"eval.envs: {exc}")
    return out
