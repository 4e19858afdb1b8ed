"""verifiers environments (the Environments Hub's format) as agent environments.

`VerifiersEnv(env_id="my-env", env_args={...})` (registry name `verifiers`) loads the environment with
`verifiers.load_environment(env_id, **env_args)`: any installed environment package (from the Hub or
your own), or a module on the path that defines `load_environment`. Its dataset (`split`: "train" or
"eval") is the task list: `task(seed)` is row `seed % len`. `run(client, task)` runs verifiers' own
rollout and rubric (`env.run_rollout`) with the OpenAI client the worker gives it, so every model call
goes through the rollout worker's endpoint and becomes the episode's tokens; the rubric's reward is the
episode's reward. A rollout that verifiers reports as failed (its `error`) fails the episode. Needs
`pip install verifiers` (tested with 0.1.14).
"""

from __future__ import annotations

from typing import Any

from earl_stream.errors import EnvError

__all__ = ["VerifiersEnv"]


class VerifiersEnv:
    """A verifiers environment played as an agent environment (see the module docstring)."""

    def __init__(self, env_id: str, env_args: dict[str, Any] | None = None, split: str = "train",
                 model: str = "policy", sampling_args: dict[str, Any] | None = None, timeout_s: float = 300.0) -> None:
        try:
            import verifiers as vf
            from verifiers.clients import OpenAIChatCompletionsClient
        except ImportError:
            raise EnvError("the verifiers adapter needs the verifiers package: pip install verifiers") from None
        try:
            self._env = vf.load_environment(env_id, **dict(env_args or {}))
        except Exception as exc:  # the environment's own loading code
            raise EnvError(f"verifiers.load_environment({env_id!r}) failed: {type(exc).__name__}: {exc}") from None
        if split not in ("train", "eval"):
            raise EnvError(f"split must be 'train' or 'eval', got {split!r}")
        dataset = self._env.get_dataset() if split == "train" else self._env.get_eval_dataset()
        self._rows = [dict(row) for row in dataset]
        if not self._rows:
            raise EnvError(f"verifiers environment {env_id!r} has an empty {split} dataset")
        self._client_cls = OpenAIChatCompletionsClient
        self.env_id, self.model, self.timeout_s = env_id, model, float(timeout_s)
        self.sampling_args = dict(sampling_args or {})

    def task(self, seed: int) -> dict[str, Any]:
        index = seed % len(self._rows)
        row = self._rows[index]
        task = {"prompt": row["prompt"], "example_id": row.get("example_id", index)}
        for key in ("answer", "info"):
            if row.get(key) is not None:
                task[key] = row[key]
        if isinstance(row.get("task"), dict):  # verifiers routes only JSON-object tasks; a plain name is not one
            task["task"] = row["task"]
        return task

    async def run(self, client: Any, task: dict[str, Any]) -> float:
        output = await self._env.run_rollout(dict(task), self._client_cls(client), self.model, self.sampling_args)
        if output.get("error"):
            raise EnvError(f"verifiers rollout of {self.env_id} failed: {output['error']}")
        return float(output.get("reward") or 0.0)
