"""Streaming and `n` on the OpenAI endpoint, with the real built-in engine over real HTTP and the real
`openai` client: a streamed reply arrives token by token while its turn is still being generated, its
deltas add up to the non-streamed reply of the same seed, an episode's record stays exact when its
turns are streamed; n choices come back for one prompt computed once, and n > 1 is refused in an
episode. The incremental detokeniser is checked on characters split across tokens."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from earl_stream.errors import EngineError
from earl_stream.model import load_model
from earl_stream.model.chat import ChatFormat
from earl_stream.openai_api import OpenAIEndpoint
from earl_stream.openai_api.http import bind_socket
from earl_stream.openai_api.messages import reply_message
from earl_stream.openai_api.streaming import ReplyText
from earl_stream.workers.engines.base import FinishReason, GenerateRequest, GenerateResult
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.torch_engine import TorchEngine

openai = pytest.importorskip("openai", reason="the openai client package is not installed (pip install openai)")

SECRET = "streaming-test-secret"
GATE_S = 5.0


class Gated(TorchEngine):
    """The real engine, held before sampling the token numbered `hold_at` (engine-wide count) until
    the test opens `gate`: a turn cannot end before the client has seen what was streamed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.hold_at: int | None = None

    def step(self) -> None:
        if self.hold_at is not None and self.stats.generated_tokens >= self.hold_at and not self.gate.is_set():
            self.gate.wait(GATE_S)
        super().step()


class Recording:
    """Every request and result the engine served (for the accounting checks); `fail` fails a batch
    after the engine generated it."""

    admits_while_running = False  # every request goes through `generate`, where it is recorded

    def __init__(self, engine: Gated) -> None:
        self.engine = engine
        self.calls: list[list[tuple[GenerateRequest, GenerateResult]]] = []
        self.fail = False

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        results = self.engine.generate(requests)
        if self.fail:
            raise EngineError("the test failed this batch")
        self.calls.append(list(zip(requests, results)))
        return results

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


Body = Callable[[OpenAIEndpoint, Recording, Any], Awaitable[None]]


def _serve(model_dir: Path, body: Body) -> None:
    torch.manual_seed(0)
    model, tokenizer = load_model(model_dir)
    engine = Recording(Gated(model.eval(), seed=0))

    async def go() -> None:
        batcher = AsyncBatcher(engine)
        endpoint = OpenAIEndpoint(batcher, tokenizer, ChatFormat(tokenizer), model="policy", secret=SECRET.encode(),
                                  max_context=4096, default_max_tokens=12)
        url = await endpoint.start(bind_socket("127.0.0.1:0"), "127.0.0.1")
        client = openai.AsyncOpenAI(base_url=url, api_key=SECRET, max_retries=0)
        try:
            await body(endpoint, engine, client)
        finally:
            engine.engine.gate.set()
            await client.close()
            await endpoint.close()
            await batcher.aclose()

    asyncio.run(go())


async def _streamed(engine: Recording, calls: int, stream: Any,
                    text_of: Callable[[Any], str | None]) -> tuple[list[str], Any]:
    """The content deltas of a stream whose engine is held before its last token (`_hold_before_last`,
    which returned `calls`); the first delta is checked to come before the turn ended. Returns the
    deltas and the last chunk with choices."""
    deltas: list[str] = []
    last = None
    async for chunk in stream:
        if not chunk.choices:
            continue
        last = chunk
        if piece := text_of(chunk.choices[0]):
            if not deltas:
                assert len(engine.calls) == calls, "the first delta came after the turn ended"
                engine.engine.gate.set()
            deltas.append(piece)
    return deltas, last


def _hold_before_last(engine: Recording, max_tokens: int) -> int:
    """Hold the engine before the last token of the next request; returns the turns recorded so far."""
    inner = engine.engine
    inner.gate.clear()
    inner.hold_at = inner.stats.generated_tokens + max_tokens - 1
    return len(engine.calls)


def test_streamed_turns_arrive_token_by_token_and_keep_the_episode_exact(tiny_model_dir: Path) -> None:
    async def body(endpoint: OpenAIEndpoint, engine: Recording, client: Any) -> None:
        messages: list[Any] = [{"role": "user", "content": "count with me"}]
        for turn in range(3):
            calls = _hold_before_last(engine, 16)
            stream = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=16, seed=11 + turn, stream=True,
                stream_options={"include_usage": True}, extra_headers={"X-Episode-Id": "ep-s"})
            deltas, last = await _streamed(engine, calls, stream, lambda c: c.delta.content)
            [(req, res)] = engine.calls[-1]
            assert res.finish_reason == FinishReason.LENGTH and len(res.token_ids) == 16, "the turn ended early"
            assert len(deltas) > 1 and last.choices[0].finish_reason == "length"
            assert "".join(deltas) == endpoint.chat.reply_text(res.token_ids)
            messages += [{"role": "assistant", "content": "".join(deltas)}, {"role": "user", "content": f"{turn}?"}]
        episode = endpoint.take_episode("ep-s")
        assert episode is not None and episode.turns == 3 and episode.mismatches == 0
        trace, end = episode.trace, endpoint.chat.end_token_id
        for [(req, res)] in engine.calls:
            p, n = len(req.prompt_ids), len(res.token_ids)
            assert trace.ids[:p] == list(req.prompt_ids) and req.cache_key == "ep-s"
            assert trace.ids[p:p + n] == res.token_ids and trace.mask[p:p + n] == [1] * n
            assert trace.logprobs[p:p + n] == res.logprobs and trace.ids[p + n] == end  # the closing of a cut turn
        assert sum(trace.mask) == 3 * 16

        engine.engine.hold_at = None  # the same seed without streaming: the same text
        again = await client.chat.completions.create(model="policy", messages=messages[:1], max_tokens=16, seed=11)
        assert again.choices[0].message.content == endpoint.chat.reply_text(engine.calls[0][0][1].token_ids)

    _serve(tiny_model_dir, body)


def test_streamed_completion_and_a_turn_failing_mid_stream(tiny_model_dir: Path) -> None:
    async def body(endpoint: OpenAIEndpoint, engine: Recording, client: Any) -> None:
        calls = _hold_before_last(engine, 20)
        stream = await client.completions.create(model="policy", prompt="abc", max_tokens=20, temperature=1.0,
                                                 seed=5, stream=True)
        deltas, last = await _streamed(engine, calls, stream, lambda c: c.text)
        engine.engine.hold_at = None
        plain = await client.completions.create(model="policy", prompt="abc", max_tokens=20, temperature=1.0, seed=5)
        assert len(deltas) > 1 and "".join(deltas) == plain.choices[0].text
        assert last.choices[0].finish_reason == plain.choices[0].finish_reason

        with pytest.raises(openai.BadRequestError, match="maximum context length"):  # refused before any event
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=10_000, stream=True)
        _hold_before_last(engine, 12)
        engine.fail = True  # the engine fails the turn after its tokens were streamed
        stream = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}],
                                                      max_tokens=12, stream=True, user="ep-f")
        seen = []
        with pytest.raises(openai.APIError, match="could not finish"):
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    seen.append(chunk.choices[0].delta.content)
                    engine.engine.gate.set()
        assert seen and endpoint.take_episode("ep-f") is None  # a failed turn leaves nothing

    _serve(tiny_model_dir, body)


def test_n_choices_share_one_prompt_and_are_refused_in_an_episode(tiny_model_dir: Path) -> None:
    async def body(endpoint: OpenAIEndpoint, engine: Recording, client: Any) -> None:
        messages = [{"role": "user", "content": "pick a number"}]
        one = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8, seed=3)
        shared = engine.engine.stats.shared_prefix_tokens
        two = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8, seed=3, n=2)
        assert [c.index for c in two.choices] == [0, 1]
        assert two.choices[0].message.content == one.choices[0].message.content  # choice i is seeded seed + i
        [(r0, a), (r1, b)] = engine.calls[-1]  # one engine batch: the prompt was computed once
        assert r0.prompt_ids == r1.prompt_ids and (r0.seed, r1.seed) == (3, 4)
        assert engine.engine.stats.shared_prefix_tokens - shared == len(r0.prompt_ids)
        assert two.usage.completion_tokens == len(a.token_ids) + len(b.token_ids)
        assert two.usage.prompt_tokens == len(r0.prompt_ids)
        texts = await client.completions.create(model="policy", prompt="12", max_tokens=6, n=3, logprobs=0)
        assert [c.index for c in texts.choices] == [0, 1, 2] and all(c.logprobs for c in texts.choices)

        calls = len(engine.calls)
        refused: list[dict[str, Any]] = [dict(n=2, extra_headers={"X-Episode-Id": "ep-n"}), dict(n=2, user="ep-n"),
                   dict(n=2, stream=True), dict(n=17), dict(n=0)]
        for kwargs in refused:
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="policy", messages=messages, max_tokens=4, **kwargs)
            assert err.value.body["param"] == "n", kwargs
        with pytest.raises(openai.BadRequestError, match="episode"):
            await client.completions.create(model="policy", prompt="12", max_tokens=4, n=2, user="ep-n")
        assert len(engine.calls) == calls and endpoint.take_episode("ep-n") is None

    _serve(tiny_model_dir, body)


def test_reply_text_sends_only_what_the_reply_keeps(tiny_model_dir: Path) -> None:
    """Token by token, the deltas add up to the reply the turn ends with: characters whose bytes span
    tokens come out whole, nothing past a stop string, no tool-call text."""
    _, tok = load_model(tiny_model_dir)
    stop_ids = ChatFormat(tok).stop_token_ids
    tools = [{"name": "calculator", "description": "", "parameters": {"type": "object"}}]

    def stream(text: str, stops: list[str], with_tools: bool, final: str) -> list[str]:
        reply = ReplyText(tok, stop_ids, stops, with_tools)
        deltas = [d for t in tok.encode(text, add_special_tokens=False) if (d := reply.add([t]))]
        assert "".join(deltas) + reply.rest(final) == final, (text, stops)
        return deltas

    plain = "héllo 世界 🙂 naïve"
    deltas = stream(plain, [], False, plain)
    assert len(deltas) > 3 and not any("\ufffd" in d for d in deltas)
    assert deltas == stream(plain, ["<zzz>"], False, plain)
    assert "".join(stream(plain, ["界 🙂"], False, "héllo 世")) == "héllo 世"  # nothing of the stop string
    call = 'ok then <tool>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool>'
    content = reply_message(call, tools)["content"]
    assert content == "ok then" and "".join(stream(call, [], True, content)) == content
    assert stream("  spaced <tool>", [], True, "spaced") == []  # a leading space: only the end can tell
    assert "".join(stream("a <tool", [], True, "a <tool")) == "a"  # an unfinished call: held to the end
    assert "".join(stream("a < b", [], True, "a < b")) == "a < b"
