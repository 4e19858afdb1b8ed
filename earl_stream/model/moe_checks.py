"""Load-time checks of `algo.routing_replay`: what cannot work with the model and the engine.

`earl_stream.config` calls `routing_replay_problems` when routing replay is on and reports its lines
with every other problem in one `ConfigError`: replay needs a mixture-of-experts model of a family
whose routers `model.moe` hooks (read from `config.json` alone, no weights) and an engine that records
the experts it routed each token to. Recording and replaying are `workers.engines.routing`'s and
`workers.routing_replay`'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from earl_stream.model.moe_config import MOE_TYPES, moe_layers

if TYPE_CHECKING:
    from earl_stream.config import RunConfig

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
    config_file = Path(cfg.model.path) / "config.json"
    try:
        d = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        out.append(f"algo.routing_replay={mode}: cannot read {config_file}: {exc}")
        return out
    if not moe_layers(d):
        kind = d.get("model_type")
        out.append(f"algo.routing_replay={mode}: model {cfg.model.path} (model_type={kind!r}) has no routed expert "
                   f"layers of a supported family ({', '.join(sorted(MOE_TYPES))}); set algo.routing_replay=none")
    return out
