"""Any procedural task of reasoning-gym (https://pypi.org/project/reasoning-gym/) as an environment.

`ReasoningGymEnv(task="basic_arithmetic")` builds the task's dataset with
`reasoning_gym.create_dataset(task, seed=dataset_seed, size=size, **config)` once per process (cached;
a few tasks take seconds to build at large sizes) and `reset(seed)` poses item `seed % size`, so the
same seed always poses the same question (a GRPO group shares its seed) and there are `size`
distinct questions. Everything is generated locally; nothing is downloaded.

The reply's answer is the text inside the last `<answer>...</answer>` (reasoning-gym's own
convention and system prompt), or the whole stripped reply when there is no such tag (lenient, so a
small model that answers bare is still scored); with `answer_tag=None` the whole reply is the answer.
With `answer_from="last_number"` the answer is the last number in that text instead (for numeric tasks
and a model that explains before it answers, e.g. "7 + 5 = 12, so the answer is 12."): still checked
exactly, but a correct number at the end of an explanation counts.
It is scored by the dataset's own `score_answer` (a float in [0, 1]), which is the reward. With
`max_attempts > 1` the episode is multi-turn: an answer scoring below 1 is answered with feedback and
another try, and the episode's reward is the last attempt's score. `info` on the terminal step:
outcome ("correct", "partial", "wrong"), score, task, attempts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any

from earl_stream.env import StepResult
from earl_stream.errors import EnvError

__all__ = ["HELD_OUT_DATASET_SEED", "ReasoningGymEnv"]

logger = logging.getLogger(__name__)

_CACHE_SIZE = 16
_datasets: OrderedDict[tuple[str, str, int, int], Any] = OrderedDict()
_datasets_lock = threading.Lock()

HELD_OUT_DATASET_SEED = 987_654_321  # the dataset seed of held-out items (`ReasoningGymEnv.held_out`)
_BARE_PROMPT = "Answer the question. Reply with the final answer only."
_ANSWER_FROM = ("tag", "last_number")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise EnvError("ReasoningGymEnv needs the reasoning-gym package: pip install reasoning-gym") from exc
    return reasoning_gym


def _dataset(task: str, config: dict[str, Any], dataset_seed: int, size: int) -> Any:
    """The dataset for these settings, built once per process (thread-safe, small LRU)."""
    key = (task, json.dumps(config, sort_keys=True, default=str), dataset_seed, size)
    with _datasets_lock:
        cached = _datasets.get(key)
        if cached is not None:
            _datasets.move_to_end(key)
            return cached
        try:
            dataset = _reasoning_gym().create_dataset(task, seed=dataset_seed, size=size, **config)
        except Exception as exc:  # a bad config is the user's error: say which task and settings
            raise EnvError(
                f"reasoning-gym task {task!r} rejected config {config} (size={size}): {type(exc).__name__}: {exc}"
            ) from exc
        _datasets[key] = dataset
        if len(_datasets) > _CACHE_SIZE:
            _datasets.popitem(last=False)
        return dataset


class ReasoningGymEnv:
    """One reasoning-gym question per episode, scored by the dataset's own `score_answer`."""

    def __init__(self, task: str = "basic_arithmetic", config: dict[str, Any] | str | None = None,
                 size: int = 10_000, dataset_seed: int = 0, max_attempts: int = 1,
                 answer_tag: str | None = "answer", system_prompt: str | None = None,
                 max_turn_tokens: int = 256, answer_from: str = "tag") -> None:
        rg = _reasoning_gym()
        if task not in rg.factory.DATASETS:
            raise EnvError(f"unknown reasoning-gym task {task!r}; known tasks: {', '.join(sorted(rg.factory.DATASETS))}")
        if isinstance(config, str):  # `env attach --param config='{"min_terms": 2}'`
            try:
                config = json.loads(config)
            except ValueError as exc:
                raise EnvError(f"ReasoningGymEnv config must be a JSON object, got {config!r}") from exc
        if config is not None and not isinstance(config, dict):
            raise EnvError(f"ReasoningGymEnv config must be a dict, got {type(config).__name__}")
        self.task = task
        self.config: dict[str, Any] = dict(config or {})
        self.size, self.dataset_seed = int(size), int(dataset_seed)
        self.max_attempts, self.max_turn_tokens = int(max_attempts), int(max_turn_tokens)
        if self.size < 1 or self.max_attempts < 1:
            raise EnvError(f"ReasoningGymEnv needs size >= 1 and max_attempts >= 1, got {size}, {max_attempts}")
        self.answer_tag = answer_tag or None
        if answer_from not in _ANSWER_FROM:
            raise EnvError(f"ReasoningGymEnv answer_from must be one of {', '.join(_ANSWER_FROM)}, got {answer_from!r}")
        self.answer_from = answer_from
        if system_prompt is None:
            system_prompt = rg.utils.SYSTEM_PROMPTS["default"] if self.answer_tag == "answer" else _BARE_PROMPT
        self.system_prompt: str = system_prompt
        self._extract = rg.utils.extract_answer
        self._dataset: Any = None
        self._entry: dict[str, Any] = {}
        self._attempts = 0
        self._done = True

    @classmethod
    def held_out(cls, params: dict[str, Any], problems: int) -> tuple[dict[str, Any], list[int]]:
        """Params and reset seeds of `problems` questions the environment built with `params` never poses
        (`earl_stream.evaluation.heldout`): drawn from the dataset of another seed (HELD_OUT_DATASET_SEED),
        keeping only questions absent from the training dataset, each once. EnvError when the task has too
        few distinct questions."""
        task, config = str(params.get("task", "basic_arithmetic")), params.get("config") or {}
        if isinstance(config, str):
            config = json.loads(config)
        train = _dataset(task, dict(config), int(params.get("dataset_seed", 0)), int(params.get("size", 10_000)))
        seen = {item["question"] for item in train}
        size = problems * 50  # small tasks repeat questions: draw until `problems` unseen ones (items are made lazily)
        held = _dataset(task, dict(config), HELD_OUT_DATASET_SEED, size)
        seeds: list[int] = []
        questions: set[str] = set()
        for i in range(size):
            q = held[i]["question"]
            if q not in seen and q not in questions:
                seeds.append(i)
                questions.add(q)
            if len(seeds) == problems:
                break
        if len(seeds) < problems:
            raise EnvError(f"reasoning-gym task {task!r}: only {len(seeds)} of {problems} held-out questions differ "
                           "from the training set; widen the task (its config) or ask for fewer problems")
        return {**params, "dataset_seed": HELD_OUT_DATASET_SEED, "size": size}, seeds

    async def reset(self, seed: int) -> str:
        """Pose question `seed % size` of the task's dataset."""
        # Building a dataset or an item can take up to ~1 s for some tasks: keep the event loop free.
        self._dataset, self._entry = await asyncio.to_thread(self._load, seed)
        self._attempts = 0
        self._done = False
        return str(self._entry["question"])

    def _load(self, seed: int) -> tuple[Any, dict[str, Any]]:
        dataset = _dataset(self.task, self.config, self.dataset_seed, self.size)
        return dataset, dataset[seed % self.size]

    def answer_of(self, text: str) -> str:
        """The answer part of a reply (see the module docstring)."""
        answer = text.strip()
        if self.answer_tag is not None:
            tagged = self._extract(text, tag_name=self.answer_tag)
            if tagged is not None:
                answer = str(tagged)
        if self.answer_from == "last_number":
            numbers = _NUMBER.findall(answer)
            return numbers[-1] if numbers else ""
        return answer

    async def step(self, action_text: str) -> StepResult:
        """Score the reply's answer; finish, or ask again while attempts remain."""
        if self._done:
            raise EnvError("ReasoningGymEnv.step() called on a finished episode; call reset(seed) first")
        self._attempts += 1
        answer = self.answer_of(action_text)
        try:
            score = float(self._dataset.score_answer(answer=answer, entry=self._entry))
        except Exception:  # the task's scorer choking on a garbled answer means the answer is wrong
            logger.debug("reasoning-gym %s could not score %r", self.task, answer, exc_info=True)
            score = 0.0
        score = min(max(score, 0.0), 1.0)
        if score >= 1.0 or self._attempts >= self.max_attempts:
            self._done = True
            outcome = "correct" if score >= 1.0 else ("partial" if score > 0.0 else "wrong")
            info = {"outcome": outcome, "score": score, "task": self.task, "attempts": self._attempts}
            return StepResult(outcome, score, True, info)
        left = self.max_attempts - self._attempts
        return StepResult(f"That is not correct. Try again ({left} attempt{'s' if left > 1 else ''} left).",
                          0.0, False)
