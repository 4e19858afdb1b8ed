"""The agent loop: plays one multi-turn episode of an environment with an engine, token in and
token out, and turns it into a `SampleRecord`.

Earlier turns are never re-tokenised: the context is the concatenation of the chat format's turn
tokens and the engine's own output tokens. The loss mask covers only the engine's tokens. A crashing,
hanging or misbehaving environment fails its own episode (`EpisodeFailed`), never the worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from earl_stream.env import Environment, EnvOptions, Observation, StepResult, env_options, env_reset, env_step
from earl_stream.env.images import observation_text
from earl_stream.env.seeds import train_seed
from earl_stream.errors import EnvError, ModelError
from earl_stream.jitter import ajitter
from earl_stream.model.chat import ChatFormat
from earl_stream.model.vision import VisionChat
from earl_stream.records import SampleImage, SampleRecord
from earl_stream.workers.engines.base import FinishReason, GenerateRequest, PromptImage, RequestRefused
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.routing import episode_routing, merge_routing


class EpisodeFailed(EnvError):
    """The environment of one episode failed; the message says how."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


def _episode_seed(prompt_seed: int, index: int, salt: int) -> int:
    return (prompt_seed * 1_000_003 + index * 7_919 + salt) & 0x7FFFFFFF


def episode_sample_seed(prompt_seed: int, index: int) -> int:
    """The sampling seed of episode `index` of a prompt group: a group's episodes differ, and an
    episode's tokens are a pure function of (prompt seed, index, weights), whichever batch it shares."""
    return _episode_seed(prompt_seed, index, 1)


def episode_env_seed(prompt_seed: int, index: int, per_episode: bool) -> int:
    """The seed episode `index` of a prompt group resets its environment with: the group's, or with
    `per_episode` (`earl_stream.env.seeds_per_episode`) one of its own, a pure function of (prompt seed, index),
    among the training seeds (`earl_stream.env.seeds`: never one that evaluation plays)."""
    return train_seed(_episode_seed(prompt_seed, index, 2)) if per_episode else prompt_seed


@dataclasses.dataclass
class TokenTrace:
    """Token fields of an episode as it grows (lists, turned into arrays once at the end)."""

    ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    routing: np.ndarray | None = None  # MoE: routed experts [positions, L, k] recorded so far (engines.routing)
    images: list[SampleImage] = dataclasses.field(default_factory=list)  # spans in `ids` (vision-language models)

    def add_context(self, tokens: list[int], images: Sequence[SampleImage] = ()) -> None:
        """Context tokens (a prompt, an observation); `images`: theirs, spans counted from the first of `tokens`."""
        self.images += [dataclasses.replace(i, start=i.start + len(self.ids)) for i in images]
        self.ids += tokens
        self.mask += [0] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.versions += [-1] * len(tokens)

    def add_model(self, tokens: list[int], logprobs: list[float], version: int | list[int]) -> None:
        """The model's tokens; `version`: of them all, or of each (a turn that spans a weight swap)."""
        self.ids += tokens
        self.mask += [1] * len(tokens)
        self.logprobs += logprobs
        self.versions += [version] * len(tokens) if isinstance(version, int) else version

    def cut(self, n: int) -> None:
        """Keep the first `n` tokens of every field (fewer where `n` would cut an image: its tokens go whole)."""
        n = min([n, *(i.start for i in self.images if i.start < n < i.start + i.tokens)])
        del self.ids[n:], self.mask[n:], self.logprobs[n:], self.versions[n:]
        self.routing = None if self.routing is None else self.routing[:n]
        self.images = [i for i in self.images if i.start + i.tokens <= n]


def _room(trace: TokenTrace, options: EnvOptions, cap: int) -> int:
    """New tokens the next turn may generate: the environment's per-turn limit, within `cap` (0 = no
    cap) tokens of context counting the end token a cut turn is closed with."""
    return options.max_turn_tokens if cap <= 0 else min(options.max_turn_tokens, cap - len(trace.ids) - 1)


def _too_long(trace: TokenTrace, keep: int, turns: int, why: str) -> dict[str, Any]:
    """End an episode the pools cannot run further, keeping its first `keep` tokens (after the model's
    last turn; with no turn played, its first prompt cut to the bound: nothing to learn from, but its
    group completes). Returns the episode's info: "truncated", and `too_long` saying why."""
    trace.cut(max(1, keep))
    return {"outcome": "truncated", "too_long": f"{'stopped' if turns else 'refused'} after {turns} turns: {why}"}


async def play_episode(
    env: Environment,
    options: EnvOptions | None,
    chat: ChatFormat | VisionChat,
    batcher: AsyncBatcher,
    *,
    env_name: str,
    seed: int,
    prompt_ordinal: int,
    group_id: str,
    sampling: Sampling,
    policy_version: Callable[[], int],
    decode: Callable[[list[int]], object],
    step_timeout_s: float = 30.0,
    sample_seed: int | None = None,
    max_episode_tokens: Callable[[], int] | None = None,
) -> SampleRecord:
    """Play one episode to its end. Raises EpisodeFailed if the environment misbehaves.

    `options=None` reads the environment's options after its reset (see `earl_stream.env.server`).

    With `sample_seed`, turn k samples with the engine's per-request seed `sample_seed + k` (see
    `episode_sample_seed`); without, from the engine's shared generator.

    `max_episode_tokens()`: the longest context the pools can run now (the rollout plan's; 0 = no
    bound). A turn generates at most up to it; an episode that reaches it, or whose request the
    engine refuses (`RequestRefused`), ends as "truncated" with `info["too_long"]` saying why.
    """
    episode_id = uuid.uuid4().hex[:16]
    observation = await _guard(env_reset(env, seed), step_timeout_s, "reset")
    if options is None:  # read after reset: a served environment's options arrive with its first observation
        try:
            options = env_options(env)
        except EnvError as exc:
            raise EpisodeFailed(str(exc)) from None
    trace = TokenTrace()
    trace.add_context(*_first_turn(chat, options.system_prompt, observation))
    prompt_tokens = len(trace.ids)
    reward, turns, info, keep = 0.0, 0, {}, len(trace.ids)  # keep: the trace up to the model's last turn
    while True:
        cap = max_episode_tokens() if max_episode_tokens is not None else 0
        bound = f"the {cap}-token bound of the rollout plan (the longest a trainer plan or the KV budget holds)"
        if (room := _room(trace, options, cap)) < 1:
            info = _too_long(trace, keep if turns else cap, turns, f"its context reached {bound}")
            break
        request = GenerateRequest(prompt_ids=list(trace.ids), max_new_tokens=room,
                                  stop_token_ids=chat.stop_token_ids, temperature=sampling.temperature,
                                  top_p=sampling.top_p, top_k=sampling.top_k, cache_key=episode_id,
                                  seed=None if sample_seed is None else sample_seed + turns,
                                  images=_prompt_images(chat, trace.images))
        await ajitter()  # tests of timing independence only (EARL_STREAM_JITTER_MS)
        try:
            result = await batcher.generate(request)
        except RequestRefused as exc:
            info = _too_long(trace, keep if turns else (cap or len(trace.ids)), turns, str(exc))
            break
        trace.add_model(list(result.token_ids), list(result.logprobs), result.versions(policy_version()))
        trace.routing = merge_routing(trace.routing, result.routed_experts)
        if result.finish_reason == FinishReason.LENGTH:
            trace.add_context([chat.end_token_id])  # close the turn so the next one renders right
        turns += 1
        if result.finish_reason == FinishReason.LENGTH and room < options.max_turn_tokens:
            info = _too_long(trace, len(trace.ids), turns, f"turn {turns} was cut at {bound}")
            break
        reply = decode([t for t in result.token_ids if t not in chat.stop_token_ids])
        assert isinstance(reply, str), "one sequence decodes to one string"
        step: StepResult = await _guard(env_step(env, reply), step_timeout_s, "step")
        reward += float(step.reward)
        info = step.info
        if step.done:
            break
        if options.max_episode_tokens is not None and len(trace.ids) >= options.max_episode_tokens:
            info = {"outcome": "truncated"}
            break
        keep = len(trace.ids)
        trace.add_context(*_next_turn(chat, step.observation, turns))
    batcher.release(episode_id)
    return trace_record(trace, episode_id=episode_id, group_id=group_id, prompt_ordinal=prompt_ordinal, env_name=env_name,
                        turns=turns, prompt_tokens=min(prompt_tokens, len(trace.ids)), reward=reward, info=info)


def trace_record(trace: TokenTrace, *, episode_id: str, group_id: str, prompt_ordinal: int, env_name: str, turns: int,
                 prompt_tokens: int, reward: float, info: dict) -> SampleRecord:
    """The sample of a finished episode whose tokens are `trace`."""
    return SampleRecord(
        sample_id=f"{group_id}-{episode_id}", prompt_ordinal=prompt_ordinal, episode_id=episode_id,
        group_id=group_id, env=env_name, turns=turns, prompt_tokens=prompt_tokens,
        input_ids=np.asarray(trace.ids, dtype=np.int32), loss_mask=np.asarray(trace.mask, dtype=np.uint8),
        behaviour_logprobs=np.asarray(trace.logprobs, dtype=np.float32),
        policy_version=np.asarray(trace.versions, dtype=np.int32), reward=reward,
        info=_small_json(info), routed_experts=episode_routing(trace.routing, len(trace.ids)),
        images=tuple(trace.images),
    )


def _first_turn(chat: ChatFormat | VisionChat, system: str | None,
                observation: str | Observation) -> tuple[list[int], list[SampleImage]]:
    if isinstance(chat, VisionChat):
        return _rendered(lambda: chat.first_turn(system, observation))
    return chat.first_turn(system, _text(observation, "first observation")), []


def _next_turn(chat: ChatFormat | VisionChat, observation: str | Observation,
               turns: int) -> tuple[list[int], list[SampleImage]]:
    if isinstance(chat, VisionChat):
        return _rendered(lambda: chat.next_turn(observation))
    return chat.next_turn(_text(observation, f"observation after turn {turns}")), []


def _rendered(render: Callable[[], tuple[list[int], list[SampleImage]]]) -> tuple[list[int], list[SampleImage]]:
    """A turn with images, rendered by the model's processor; its failure (an image it cannot take) is the
    episode's."""
    try:
        return render()
    except (EnvError, ModelError, ValueError) as exc:
        raise EpisodeFailed(f"the observation's images cannot be shown to the model: {exc}") from None


def _prompt_images(chat: ChatFormat | VisionChat, images: list[SampleImage]) -> tuple[PromptImage, ...]:
    return tuple(chat.prompt_image(i) for i in images) if isinstance(chat, VisionChat) else ()


def _text(observation: str | Observation, what: str) -> str:
    """The text of an observation for this text-only chat; one with images fails the episode, saying why."""
    try:
        return observation_text(observation, what)
    except EnvError as exc:
        raise EpisodeFailed(str(exc)) from None


async def _guard(coro: Awaitable[Any], timeout_s: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(coro, timeout_s)
    except asyncio.TimeoutError:
        raise EpisodeFailed(f"environment {what} took longer than {timeout_s:.0f}s") from None
    except EnvError as exc:
        raise EpisodeFailed(f"environment {what} failed: {exc}") from None
    except Exception as exc:  # an environment is user code: any error fails only its episode
        raise EpisodeFailed(f"environment {what} raised {type(exc).__name__}: {exc}") from None


def _small_json(info: dict) -> dict:
    try:
        text = json.dumps(info)
    except (TypeError, ValueError):
        return {"unserialisable_info": True}
    return info if len(text) <= 4096 else {"info_truncated": True}

