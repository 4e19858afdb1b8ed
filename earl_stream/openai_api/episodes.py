"""Per-episode token accounting of the OpenAI endpoint: the exact tokens an agent's episode consists of.

An episode (named by the request's `X-Episode-Id` header or `user` field) holds one `TokenTrace`: the
prompt tokens it was given and the tokens the engine generated, with their log-probs and policy
versions. The chat template is applied to each message once: a later request that re-sends the
conversation is matched, message by message, against the conversation already held (the held
messages plus the reply we returned); only the messages it adds are rendered and tokenised, and are
appended after the tokens held. What was generated is never re-tokenised.

A request that does not extend what is held (the agent edited, summarised or dropped history, or
branched from an earlier turn) is *non-append*. What becomes of it is the endpoint's setting
(`rollout.non_append`, see `server`): refused before anything is generated, or accepted as the start of
a new *segment*: the segment held so far is closed as it is, and the new one starts from the request's
full rendering. Every segment becomes a sample of its own (`segments()`), so that every token of a
sample was really in the model's context when the tokens after it were generated, and none of the
model's tokens is dropped. A failed request changes nothing: `plan_*` computes, `commit` applies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from earl_stream.openai_api.messages import ChatRenderer, Message
from earl_stream.workers.agent_loop import TokenTrace

Encode = Callable[[str], list[int]]


@dataclasses.dataclass(frozen=True)
class TurnPlan:
    """What one request adds: `prompt_ids` go to the engine; on success `new_context` is appended
    as prompt tokens (after a reset of the trace when `fresh`)."""

    prompt_ids: list[int]
    new_context: list[int]
    fresh: bool
    mismatch: bool


@dataclasses.dataclass(frozen=True)
class Segment:
    """A stretch of an episode whose requests each extended the one before: its tokens (prompt, then the
    model's turns and the context between them), the tokens before its first generated one, and its turns."""

    trace: TokenTrace
    prompt_tokens: int
    turns: int


@dataclasses.dataclass
class Episode:
    key: str
    trace: TokenTrace = dataclasses.field(default_factory=TokenTrace)  # the current segment's
    held_chat: list[Message] | None = None  # the conversation the trace covers, ending with our reply
    held_tools: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    held_text: str | None = None  # completions: prompt + generated text the trace covers
    prompt_tokens: int = 0  # tokens before the first generated token of the current segment
    turns: int = 0  # of the whole episode
    segment_turns: int = 0  # of the current segment
    mismatches: int = 0  # non-append requests accepted: segments closed
    closed: list[Segment] = dataclasses.field(default_factory=list)  # the segments before the current one
    last_used: float = dataclasses.field(default_factory=time.monotonic)
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)

    def plan_chat(self, messages: list[Message], tools: list[dict[str, Any]], renderer: ChatRenderer,
                  encode: Encode, end_marker: str) -> TurnPlan:
        held = self.held_chat
        if held is not None and len(messages) > len(held) and messages[:len(held)] == held and tools == self.held_tools:
            full = renderer.render(messages, tools, add_generation_prompt=True)
            closed = renderer.render(held, tools, add_generation_prompt=False)
            end = closed.rfind(end_marker)
            cut = closed[:end + len(end_marker)] if end >= 0 else None
            if cut is not None and full.startswith(cut):
                new = encode(full[len(cut):])
                return TurnPlan(self.trace.ids + new, new, fresh=False, mismatch=False)
        new = encode(renderer.render(messages, tools, add_generation_prompt=True))
        return TurnPlan(new, new, fresh=True, mismatch=self.has_tokens)

    def plan_text(self, prompt: str | list[int], encode: Encode) -> TurnPlan:
        if isinstance(prompt, list):  # token ids: matched as they are
            held_ids = self.trace.ids
            if self.has_tokens and prompt[:len(held_ids)] == held_ids:
                new = prompt[len(held_ids):]
                return TurnPlan(list(prompt), new, fresh=False, mismatch=False)
            return TurnPlan(list(prompt), list(prompt), fresh=True, mismatch=self.has_tokens)
        if self.held_text is not None and prompt.startswith(self.held_text):
            new = encode(prompt[len(self.held_text):])
            return TurnPlan(self.trace.ids + new, new, fresh=False, mismatch=False)
        new = encode(prompt)
        return TurnPlan(new, new, fresh=True, mismatch=self.has_tokens)

    @property
    def has_tokens(self) -> bool:
        return bool(self.trace.ids)

    def commit(self, plan: TurnPlan, token_ids: list[int], logprobs: list[float], version: int | list[int],
               closing: list[int]) -> None:
        """Apply a successful turn: the plan's context, the generated tokens, then `closing` context
        tokens (the end-of-turn token after a reply cut by max_tokens)."""
        if plan.fresh:
            if self.has_tokens:  # non-append: the segment held is closed as it is, none of its tokens dropped
                self.closed.append(Segment(self.trace, self.prompt_tokens, self.segment_turns))
            self.trace, self.segment_turns = TokenTrace(), 0
            self.prompt_tokens = len(plan.new_context)
        self.mismatches += plan.mismatch
        self.trace.add_context(plan.new_context)
        self.trace.add_model(token_ids, logprobs, version)
        if closing:
            self.trace.add_context(closing)
        self.turns += 1
        self.segment_turns += 1
        self.last_used = time.monotonic()

    def segments(self) -> list[Segment]:
        """Every segment of the episode, the current one last (one unless a non-append request split it)."""
        return [*self.closed, Segment(self.trace, self.prompt_tokens, self.segment_turns)] if self.has_tokens \
            else list(self.closed)


class EpisodeBook:
    """The episodes an endpoint holds, least recently used first, at most `max_episodes` of them.

    An episode leaves by `pop` (an agent environment collects it) or is evicted when the book is full;
    `on_drop(key)` then lets the engine forget the episode's KV cache.
    """

    def __init__(self, max_episodes: int, on_drop: Callable[[str], None]) -> None:
        self._episodes: OrderedDict[str, Episode] = OrderedDict()
        self._max = max_episodes
        self._on_drop = on_drop
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._episodes)

    def get(self, key: str) -> Episode:
        """The episode `key`, created empty if new."""
        episode = self._episodes.get(key)
        if episode is None:
            episode = self._episodes[key] = Episode(key)
            while len(self._episodes) > self._max:
                old, _ = self._episodes.popitem(last=False)
                self.evicted += 1
                self._on_drop(old)
        self._episodes.move_to_end(key)
        return episode

    def pop(self, key: str) -> Episode | None:
        """Take the episode out (None if it never made a request); its KV cache is forgotten."""
        episode = self._episodes.pop(key, None)
        self._on_drop(key)
        return episode
