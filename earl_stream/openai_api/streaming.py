"""Streamed replies of the OpenAI endpoint: tokens as the engine samples them, turned into the text
deltas of server-sent events.

It owns the hand-over of one request's tokens from the engine's thread to the event loop
(`TokenFeed`, fed by `GenerateRequest.on_token`), incremental detokenisation (`Detokenizer`: a window
of a few tokens is decoded, and text is held while it ends in an incomplete UTF-8 character), the
part of a reply that is safe to send before the turn ends (`ReplyText`: nothing past a stop string
or a possible tool-call opening, so that the concatenated deltas always equal the reply the turn
ends with), and the chunk layout of streamed chat and text completions. What a turn records in its
episode, and the final reply, are the endpoint's (`server`).

Each event carries the text of the tokens sampled since the last one (tokens that arrive while an
event is being written go out together in the next). The last chunk carries `finish_reason`, and a
reply that calls a tool gets its `tool_calls` delta there, after its content. A turn that fails after
its first event ends the stream with an OpenAI error object (the `openai` client raises it).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from earl_stream.errors import EarlError
from earl_stream.openai_api import http

log = logging.getLogger(__name__)

TOOL_OPENING = "<tool"  # `messages.reply_message` cuts a tool-calling reply's content here


class TokenFeed:
    """One request's tokens, from `push` (any thread: the engine's `on_token`) to `batches` (the loop)."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ids: list[int] = []
        self._changed = asyncio.Event()
        self._closed = False
        self.started = asyncio.Event()  # set by the first token, or by `close`

    def push(self, token_id: int) -> None:
        """Hand a sampled token to the loop (called from the engine's thread; never raises)."""
        try:
            self._loop.call_soon_threadsafe(self._take, token_id)
        except RuntimeError:  # the loop is closed: nobody reads this feed any more
            pass

    def close(self) -> None:
        """No more tokens (the turn ended, well or not); tokens pushed before are still read."""
        self._closed = True
        self._changed.set()
        self.started.set()

    async def batches(self) -> AsyncIterator[list[int]]:
        """The tokens pushed since the last batch, until the feed is closed and read."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            ids, self._ids = self._ids, []
            if ids:
                yield ids
            if self._closed and not self._ids:
                return

    def _take(self, token_id: int) -> None:
        if self._closed:
            return
        self._ids.append(token_id)
        self._changed.set()
        self.started.set()


class Detokenizer:
    """The text of a growing token sequence, decoded incrementally (as `tokenizer.decode` of all of it).

    Each step decodes the tokens since the last text was taken plus the tokens before them (the context
    a tokenizer needs for spaces and merges); text that ends in U+FFFD (a character whose bytes are
    not all generated yet) waits for the next token. Tokens in `skip` (stop tokens) are not text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip: Collection[int] = ()) -> None:
        self._tok, self._skip = tokenizer, frozenset(skip)
        self._ids: list[int] = []
        self._prefix = self._read = 0  # the window's start; where the text taken so far ends
        self.text = ""

    def add(self, token_ids: list[int]) -> None:
        self._ids.extend(t for t in token_ids if t not in self._skip)
        if len(self._ids) == self._read:
            return
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=False)) if ids else ""


def cut_at_stop(text: str, stops: list[str]) -> str:
    """The reply up to the first stop string (its tokens stay in the episode: the model did generate them)."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(cuts)] if cuts else text


def _held_from(text: str, marks: Collection[str]) -> int:
    """Where the earliest suffix of `text` that may grow into one of `marks` starts (len(text) if none)."""
    longest = max((len(m) for m in marks), default=0)
    for start in range(max(0, len(text) - longest + 1), len(text)):
        if any(m.startswith(text[start:]) for m in marks):
            return start
    return len(text)


class ReplyText:
    """What of a reply being generated can be sent already: always a prefix of the reply the turn ends
    with (the text cut at the first `stops` string; with `tools`, a tool call's content is the text
    before its opening, stripped)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip: Collection[int], stops: list[str],
                 tools: bool) -> None:
        self._text = Detokenizer(tokenizer, skip)
        self._stops, self._tools = stops, tools
        self.sent = ""

    def add(self, token_ids: list[int]) -> str:
        """Take newly sampled tokens; returns the text to send now ("" if none is safe yet)."""
        self._text.add(token_ids)
        safe = self._safe(self._text.text)
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def rest(self, final: str) -> str:
        """The end of the reply `final` after what was sent."""
        if final.startswith(self.sent):
            return final[len(self.sent):]
        log.warning("streamed text %r is not a prefix of the reply %r; the rest is not sent", self.sent, final)
        return ""

    def _safe(self, text: str) -> str:
        cut = cut_at_stop(text, self._stops)
        text = cut if len(cut) < len(text) else text[:_held_from(text, self._stops)]
        if not self._tools:
            return text
        if text[:1].isspace():  # kept if the reply is text, stripped if it calls a tool: wait for the end
            return ""
        opening = text.find(TOOL_OPENING)
        text = text[:opening] if opening >= 0 else text[:_held_from(text, [TOOL_OPENING])]
        return text.rstrip()


@dataclass(frozen=True)
class Ending:
    """How a streamed reply ends, known once its turn is over: the whole reply `content` (as the
    non-streamed answer has it), `finish_reason`, usage, and the OpenAI `tool_calls` of a chat reply."""

    content: str
    finish: str
    usage: dict[str, int]
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class StreamHead:
    """The fields every chunk of one stream repeats."""

    id: str
    created: int
    model: str
    include_usage: bool

    def chunk(self, kind: str, choices: list[dict[str, Any]], **more: Any) -> str:
        return json.dumps({"id": self.id, "object": kind, "created": self.created, "model": self.model,
                           "choices": choices, **more})


async def chat_events(head: StreamHead, text: ReplyText, feed: TokenFeed,
                      ending: Callable[[], Awaitable[Ending]]) -> AsyncIterator[str]:
    """The `data:` payloads of a streamed chat completion (`chat.completion.chunk`s, then [DONE])."""
    kind = "chat.completion.chunk"

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return head.chunk(kind, [{"index": 0, "delta": delta, "finish_reason": finish}])

    yield chunk({"role": "assistant", "content": ""})
    async for ids in feed.batches():
        if piece := text.add(ids):
            yield chunk({"content": piece})
    end = await _ended(ending)
    if isinstance(end, str):
        yield end
        return
    if rest := text.rest(end.content):
        yield chunk({"content": rest})
    if end.tool_calls:
        yield chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(end.tool_calls)]})
    yield chunk({}, end.finish)
    if head.include_usage:
        yield head.chunk(kind, [], usage=end.usage)
    yield "[DONE]"


async def text_events(head: StreamHead, text: ReplyText, feed: TokenFeed,
                      ending: Callable[[], Awaitable[Ending]]) -> AsyncIterator[str]:
    """The `data:` payloads of a streamed text completion (`text_completion` chunks, then [DONE])."""

    def chunk(piece: str, finish: str | None = None) -> str:
        return head.chunk("text_completion", [{"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}])

    async for ids in feed.batches():
        if piece := text.add(ids):
            yield chunk(piece)
    end = await _ended(ending)
    if isinstance(end, str):
        yield end
        return
    yield chunk(text.rest(end.content), end.finish)
    if head.include_usage:
        yield head.chunk("text_completion", [], usage=end.usage)
    yield "[DONE]"


async def _ended(ending: Callable[[], Awaitable[Ending]]) -> Ending | str:
    """The turn's ending, or the error event that ends a stream whose turn failed."""
    try:
        return await ending()
    except EarlError as exc:  # the engine failed this turn after its first tokens were sent
        log.warning("a streamed turn failed: %s", exc)
        return json.dumps(http.error_body(f"the engine could not finish this request: {exc}", "server_error"))
    except Exception as exc:  # a bug of ours: an error object for the client, the traceback in our log
        log.exception("a streamed turn failed")
        return json.dumps(http.error_body(f"internal error: {type(exc).__name__}", "server_error"))
