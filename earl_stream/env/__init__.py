"""The environment API: what an environment is, how a spec names one, agent environments, tools, servers.

- `api`: the `Environment` and `AgentEnvironment` protocols, `StepResult`, `env_options`, `env_reset`, `env_step`;
- `images`: `Observation` (text and images) and `Image` (checked PNG bytes), what an observation may carry;
- `registry`: `register_env`, `resolve_env`, `make_env` (names, entry points, `module:Class`, `file.py:Class`);
- `agent`: `AgentFunction` and `EnvAsAgent`, episodes played through the OpenAI API;
- `tools`: tool calls inside a text environment (`Tool`, `ToolEnv`, `with_tools`);
- `host`: the instances of one environment by episode, answering open/step/close messages (`EnvHost`), which the
  env server and the rollout worker's sandboxed children (`workers.env_runner`) both serve;
- `server`: an environment served by a process of its own (`EnvServer`, `RemoteEnv`).

The names below are the API's face: `from earl_stream.env import StepResult, make_env`.
"""

from earl_stream.env.api import EnvFactory, Environment, EnvOptions, StepResult, env_options, env_reset, env_step, seeds_per_episode
from earl_stream.env.images import Image, Observation
from earl_stream.env.registry import ENTRY_POINT_GROUP, known_envs, make_env, register_env, resolve_env, unregister_env

__all__ = [
    "ENTRY_POINT_GROUP", "EnvFactory", "EnvOptions", "Environment", "Image", "Observation", "StepResult", "env_options", "env_reset",
    "env_step", "known_envs", "make_env", "register_env", "resolve_env", "seeds_per_episode", "unregister_env",
]
