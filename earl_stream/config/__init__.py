"""A run's configuration: one frozen dataclass per subsystem, loaded from YAML plus dotted overrides.

- `fields`: how a field is declared (`field(default, help, choices=, minimum=)`) and raw YAML built into one;
- `training`, `rollout`, `cluster`, `tracking`: the sections, pure types with each field's help; `run`: `RunConfig`;
- `load`: `load_config`, `config_from_dict`, `replace`, overrides, and back to dict / JSON / YAML;
- `validate`: the cross-field rules, which call each subsystem's checks (the types import none of them).

The names below are the config's face: `from earl_stream.config import RunConfig, load_config`.
"""

from earl_stream.config.cluster import (
    LauncherConfig,
    RayLauncherConfig,
    RayRoleConfig,
    SandboxConfig,
    SecurityConfig,
    SelectorConfig,
    SlurmLauncherConfig,
    StoreConfig,
    SupervisorConfig,
)
from earl_stream.config.fields import parse_cpus
from earl_stream.config.load import (
    apply_run_override,
    config_from_dict,
    config_to_dict,
    config_to_json,
    config_to_yaml,
    field_help,
    load_config,
    replace,
)
from earl_stream.config.rollout import GROUP_SEEDS, EnvSpec, EvalConfig, RolloutConfig
from earl_stream.config.run import RunConfig
from earl_stream.config.tracking import LoggingConfig
from earl_stream.config.training import LORA_TARGETS, AlgoConfig, DistillConfig, LoraConfig, ModelConfig, TrainerConfig

__all__ = [
    "GROUP_SEEDS", "LORA_TARGETS", "AlgoConfig", "DistillConfig", "EnvSpec", "EvalConfig", "LauncherConfig", "LoggingConfig",
    "LoraConfig", "ModelConfig", "RayLauncherConfig", "RayRoleConfig", "RolloutConfig", "RunConfig", "SandboxConfig", "SecurityConfig",
    "SelectorConfig",
    "SlurmLauncherConfig", "StoreConfig", "SupervisorConfig", "TrainerConfig", "apply_run_override", "config_from_dict",
    "config_to_dict", "config_to_json", "config_to_yaml", "field_help", "load_config", "parse_cpus", "replace",
]
