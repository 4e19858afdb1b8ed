"""Load-time checks of `algo.routing_replay` and of expert-parallel layouts: what cannot work with the
model and the engine.

`expert_parallel_problems`: the ep degrees `selector.plans` names need a mixture-of-experts model
whose expert count each divides (a dense model, or 6 experts under ep4, is refused at load, not in
a rank); how ep runs is `workers.expert_parallel`'s.

`earl_stream.config.validate` calls `routing_replay_problems` when routing replay is on and reports its lines
with every other problem in one `ConfigError`: replay needs a mixture-of-experts model of a family
whose routers `model.moe` hooks (read from `config.json` alone, no weights) and an engine that records
the experts it routed each token to. Recording and replaying are `workers.engines.routing`'s and
`workers.routing_replay`'s.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from earl_stream.errors import ModelError
from earl_stream.model.moe_config import MOE_TYPES, moe_layers, num_experts

if TYPE_CHECKING:
    from earl_stream.config.run import RunConfig

# engines that record routed experts per token (workers.engines.routing)
ROUTING_ENGINES = ("torch",)


def routing_replay_problems(cfg: RunConfig) -> list[str]:
    """One line per reason `algo.routing_replay` cannot run with this model and engine ([] when it can)."""
    mode = cfg.algo.routing_replay
    out: list[str] = []
    if cfg.rollout.engine not in ROUTING_ENGINES:
        out.append(f"algo.routing_replay={mode}: rollout.engine={cfg.rollout.engine} does not record the experts it "
                   f"routes each token to (engines that do: {', '.join(ROUTING_ENGINES)}); set algo.routing_replay=none")
    if not cfg.model.path:
        out.append(f"algo.routing_replay={mode}: the embedded default model is dense (no experts to replay); "
                   "set model.path to a mixture-of-experts model or algo.routing_replay=none")
        return out
    try:
        d = _model_config(cfg)
    except (OSError, ValueError, ModelError) as exc:
        out.append(f"algo.routing_replay={mode}: cannot read the config of model.path={cfg.model.path}: {exc}")
        return out
    if not moe_layers(d):
        kind = d.get("model_type")
        out.append(f"algo.routing_replay={mode}: model {cfg.model.path} (model_type={kind!r}) has no routed expert "
                   f"layers of a supported family ({', '.join(sorted(MOE_TYPES))}); set algo.routing_replay=none")
    return out


def expert_parallel_problems(cfg: RunConfig, degrees: list[int]) -> list[str]:
    """One line per ep degree of `selector.plans` the model cannot take ([] when every one can)."""
    names = ", ".join(f"ep{n}" for n in degrees)
    if not cfg.model.path:
        return [f"selector.plans names {names}: the embedded default model is dense (no experts to shard); set "
                "model.path to a mixture-of-experts model or drop the ep layouts"]
    try:
        d = _model_config(cfg)
    except (OSError, ValueError, ModelError) as exc:
        return [f"selector.plans names {names}: cannot read the config of model.path={cfg.model.path}: {exc}"]
    if not moe_layers(d):
        return [f"selector.plans names {names}: model {cfg.model.path} (model_type={d.get('model_type')!r}) is dense "
                "(no routed experts to shard); drop the ep layouts"]
    experts = num_experts(d)
    return [f"selector.plans: ep{n} does not divide the {experts} experts per layer of {cfg.model.path}"
            for n in degrees if experts % n]


def _model_config(cfg: RunConfig) -> dict[str, Any]:
    """config.json of the run's model: a local folder's, or a Hub model's from this host's checked copy."""
    from earl_stream.model.hub import local_model_dir

    folder = local_model_dir(cfg.model)
    assert folder is not None, "the embedded model is handled by the callers"
    return dict(json.loads((folder / "config.json").read_text()))
