"""The run's whole configuration, `RunConfig`: one field per section, the sections being the types of
`training`, `rollout`, `cluster` and `tracking`. A pure type, like them: how it is loaded is `load`'s, its
cross-section rules `validate`'s. A module that needs only the types imports them from here (or from
the section's module), which pulls in nothing of the checks.
"""

from __future__ import annotations

import dataclasses

from earl_stream.config.cluster import LauncherConfig, SandboxConfig, SecurityConfig, SelectorConfig, StoreConfig, SupervisorConfig
from earl_stream.config.fields import field as _f
from earl_stream.config.rollout import EnvSpec, EvalConfig, RolloutConfig
from earl_stream.config.tracking import LoggingConfig
from earl_stream.config.training import AlgoConfig, ModelConfig, TrainerConfig


@dataclasses.dataclass(frozen=True)
class RunConfig:
    steps: int = _f(0, "training steps; 0 = run until stopped", minimum=0)
    seed: int = _f(0, "seed of prompts, sampling and initialisation")
    run_dir: str = _f("runs/latest", "where checkpoints, logs and summaries go")
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    envs: tuple[EnvSpec, ...] = dataclasses.field(default_factory=lambda: (EnvSpec(),))
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    algo: AlgoConfig = dataclasses.field(default_factory=AlgoConfig)
    store: StoreConfig = dataclasses.field(default_factory=StoreConfig)
    supervisor: SupervisorConfig = dataclasses.field(default_factory=SupervisorConfig)
    selector: SelectorConfig = dataclasses.field(default_factory=SelectorConfig)
    launcher: LauncherConfig = dataclasses.field(default_factory=LauncherConfig)
    security: SecurityConfig = dataclasses.field(default_factory=SecurityConfig)
    sandbox: SandboxConfig = dataclasses.field(default_factory=SandboxConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
