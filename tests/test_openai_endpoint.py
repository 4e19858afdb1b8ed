"""The OpenAI-compatible endpoint with the real built-in engine, served over real HTTP on loopback and
called with the real `openai` client: chat, completions, streaming, tools, exact token accounting
across turns, and bad requests answered with OpenAI error objects."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from earl_stream.model import load_model
from earl_stream.model.chat import ChatFormat
from earl_stream.openai_api import OpenAIEndpoint
from earl_stream.openai_api.episodes import Episode
from earl_stream.openai_api.http import bind_socket
from earl_stream.openai_api.messages import ChatRenderer, normalize, reply_message
from earl_stream.workers.engines.base import FinishReason, GenerateRequest, GenerateResult
from earl_stream.workers.engines.batcher import AsyncBatcher
from earl_stream.workers.engines.torch_engine import TorchEngine

openai = pytest.importorskip("openai", reason="the openai client package is not installed (pip install openai)")

SECRET = b"0123456789abcdef0123456789abcdef"


class Recording:
    """The real engine, with every request and result it served kept for the accounting checks."""

    admits_while_running = False  # every request must go through `generate`, where it is recorded

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.calls: list[tuple[GenerateRequest, GenerateResult]] = []

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        results = self.engine.generate(requests)
        self.calls += list(zip(requests, results))
        return results

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


Body = Callable[[OpenAIEndpoint, Recording, Any, str], Awaitable[None]]


def _serve(model_dir: Path, body: Body, max_context: int = 4096) -> None:
    torch.manual_seed(0)
    model, tokenizer = load_model(model_dir)
    engine = Recording(TorchEngine(model.eval(), seed=0))

    async def go() -> None:
        batcher = AsyncBatcher(engine)  # type: ignore[arg-type]
        endpoint = OpenAIEndpoint(batcher, tokenizer, ChatFormat(tokenizer), model="policy", secret=SECRET,
                                  max_context=max_context, default_max_tokens=12, policy_version=lambda: 3)
        url = await endpoint.start(bind_socket("127.0.0.1:0"), "127.0.0.1")
        client = openai.AsyncOpenAI(base_url=url, api_key=SECRET.decode(), max_retries=0)
        try:
            await body(endpoint, engine, client, url)
        finally:
            await client.close()
            await endpoint.close()
            await batcher.aclose()

    asyncio.run(go())


def test_chat_completions_models_and_streaming(tiny_model_dir: Path) -> None:
    async def body(endpoint: OpenAIEndpoint, engine: Recording, client: Any, url: str) -> None:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["policy"]
        chat = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=8, logprobs=True)
        choice = chat.choices[0]
        assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
        assert chat.usage.completion_tokens == len(engine.calls[-1][1].token_ids) <= 8
        assert [c.logprob for c in choice.logprobs.content] == pytest.approx(engine.calls[-1][1].logprobs)
        text = await client.completions.create(model="policy", prompt="<|user|>\nabc", max_tokens=5, temperature=0)
        assert text.choices[0].finish_reason in ("stop", "length") and text.usage.completion_tokens <= 5
        pieces, finish = [], None
        stream = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "go"}],
                                                      max_tokens=10, temperature=0, stream=True)
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        again = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "go"}],
                                                     max_tokens=10, temperature=0)
        assert "".join(pieces) == again.choices[0].message.content and finish == again.choices[0].finish_reason
        streamed = await client.completions.create(model="policy", prompt="abc", max_tokens=6, temperature=0, stream=True)
        assert "".join([c.choices[0].text async for c in streamed if c.choices]) == (
            await client.completions.create(model="policy", prompt="abc", max_tokens=6, temperature=0)).choices[0].text

    _serve(tiny_model_dir, body)


def test_token_accounting_exact_across_turns(tiny_model_dir: Path) -> None:
    """The episode's tokens are the first prompt, then each turn's generated tokens and the next
    prompt's new tokens: exactly what the engine was handed and returned, never re-tokenised."""
    tools = [{"type": "function", "function": {"name": "calculator", "description": "evaluate",
                                                "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]

    async def body(endpoint: OpenAIEndpoint, engine: Recording, client: Any, url: str) -> None:
        messages: list[Any] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3*(4+5)?"}]
        for turn in range(3):
            out = await client.chat.completions.create(model="policy", messages=messages, tools=tools, max_tokens=6,
                                                       extra_headers={"X-Episode-Id": "ep-1"})
            msg = out.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))  # what agents do: send our message back as is
            messages.append({"role": "user", "content": f"and then {turn}?"})
        episode = endpoint.take_episode("ep-1")
        assert episode is not None and episode.turns == 3 and episode.mismatches == 0
        trace, calls = episode.trace, engine.calls
        assert len(calls) == 3
        for k, (req, res) in enumerate(calls):
            p, n = len(req.prompt_ids), len(res.token_ids)
            assert trace.ids[:p] == list(req.prompt_ids), f"turn {k}: the prompt is not the tokens held"
            assert trace.ids[p:p + n] == res.token_ids and trace.mask[p:p + n] == [1] * n
            assert trace.logprobs[p:p + n] == res.logprobs and trace.versions[p:p + n] == [res.policy_version] * n
            assert req.cache_key == "ep-1"
            if k:  # what came between two turns is context, and only rendered once
                prev_end = len(calls[k - 1][0].prompt_ids) + len(calls[k - 1][1].token_ids)
                assert set(trace.mask[prev_end:p]) <= {0} and p > prev_end
        assert sum(trace.mask) == sum(len(r.token_ids) for _, r in calls)
        assert episode.prompt_tokens == len(calls[0][0].prompt_ids)
    _serve(tiny_model_dir, body)


def test_edited_history_splits_the_episode_into_samples(tiny_model_dir: Path) -> None:
    """rollout.non_append=split: a request that does not extend the episode starts a second segment; each
    segment is a sample whose tokens are exactly what the engine was shown and returned in it."""
    async def body(endpoint: OpenAIEndpoint, engine: Recording, client: Any, url: str) -> None:
        first = [{"role": "user", "content": "one"}]
        out = await client.chat.completions.create(model="policy", messages=first, max_tokens=4, user="ep-2")
        following = [*first, out.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "two"}]
        out = await client.chat.completions.create(model="policy", messages=following, max_tokens=4, user="ep-2")
        summary = [{"role": "user", "content": "summary: one, two"}]  # the old turns replaced by a summary
        out = await client.chat.completions.create(model="policy", messages=summary, max_tokens=4, user="ep-2")
        after = [*summary, out.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "three"}]
        await client.chat.completions.create(model="policy", messages=after, max_tokens=4, user="ep-2")
        episode = endpoint.take_episode("ep-2")
        assert episode is not None and episode.mismatches == 1 and episode.turns == 4
        segments = episode.segments()
        assert [seg.turns for seg in segments] == [2, 2]
        for seg, calls in zip(segments, (engine.calls[:2], engine.calls[2:])):
            (req0, res0), (req1, res1) = calls
            assert seg.prompt_tokens == len(req0.prompt_ids)
            # the second turn's prompt is the first turn's prompt and reply, and what came after them
            assert seg.trace.ids[:len(req1.prompt_ids)] == list(req1.prompt_ids)
            assert list(req1.prompt_ids[:len(req0.prompt_ids) + len(res0.token_ids)]) == list(req0.prompt_ids) + res0.token_ids
            closing = [endpoint.chat.end_token_id] if res1.finish_reason == FinishReason.LENGTH else []
            assert seg.trace.ids == list(req1.prompt_ids) + res1.token_ids + closing
            generated = [t for _, r in calls for t in r.token_ids]
            assert [t for t, m in zip(seg.trace.ids, seg.trace.mask) if m] == generated  # the model's tokens, only
            assert [lp for lp, m in zip(seg.trace.logprobs, seg.trace.mask) if m] == [lp for _, r in calls for lp in r.logprobs]
        shown = endpoint._encode(endpoint.renderer.render(summary, [], add_generation_prompt=True))
        assert list(engine.calls[2][0].prompt_ids) == shown  # the second segment starts from the summary alone

    _serve(tiny_model_dir, body)


def test_edited_history_under_refuse_is_an_openai_error(tiny_model_dir: Path) -> None:
    """rollout.non_append=refuse: 400 naming the setting that would accept it; nothing generated or recorded,
    and the episode goes on when the agent sends its history as it was."""
    async def body(endpoint: OpenAIEndpoint, engine: Recording, client: Any, url: str) -> None:
        endpoint.non_append = "refuse"
        first = [{"role": "user", "content": "one"}]
        out = await client.chat.completions.create(model="policy", messages=first, max_tokens=4, user="ep-3")
        reply = out.choices[0].message.model_dump(exclude_none=True)
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as err:
                await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "ONE"}, reply,
                                                                               {"role": "user", "content": "two"}],
                                                     max_tokens=4, user="ep-3", stream=stream)
            assert err.value.status_code == 400 and err.value.code == "non_append_history"
            assert "rollout.non_append=split" in err.value.message and err.value.param == "messages"
        with pytest.raises(openai.BadRequestError, match="rollout.non_append=split"):
            await client.completions.create(model="policy", prompt="something else", max_tokens=3, user="ep-3")
        assert len(engine.calls) == 1
        await client.chat.completions.create(model="policy", messages=[*first, reply, {"role": "user", "content": "two"}],
                                             max_tokens=4, user="ep-3")
        episode = endpoint.take_episode("ep-3")
        assert episode is not None and episode.mismatches == 0 and episode.turns == 2 and len(episode.segments()) == 1

    _serve(tiny_model_dir, body)


def _raw(url: str, method: str, path: str, body: bytes, token: str | None) -> tuple[int, dict[str, Any]]:
    host, port = url.split("//")[1].split("/")[0].split(":")
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nConnection: close\r\n"
    if token is not None:
        head += f"Authorization: Bearer {token}\r\n"
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head.encode() + b"\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1])


def test_bad_requests_get_openai_errors_and_leave_no_trace(tiny_model_dir: Path) -> None:
    async def body(endpoint: OpenAIEndpoint, engine: Recording, client: Any, url: str) -> None:
        ok = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "user": "ep-3"}
        cases = [
            ("POST", "/v1/chat/completions", {**ok, "model": "gpt-9"}, SECRET.decode(), 404, "model_not_found"),
            ("POST", "/v1/chat/completions", {**ok, "max_tokens": 10_000}, SECRET.decode(), 400, "context_length_exceeded"),
            ("POST", "/v1/chat/completions", b'{"model": "policy", "messages": [', SECRET.decode(), 400, None),
            ("POST", "/v1/chat/completions", ok, None, 401, "invalid_api_key"),
            ("POST", "/v1/chat/completions", ok, "wrong-token", 401, "invalid_api_key"),
            ("POST", "/v1/chat/completions", {**ok, "temperature": "hot"}, SECRET.decode(), 400, None),
            ("POST", "/v1/chat/completions", {**ok, "messages": [{"role": "robot", "content": "x"}]}, SECRET.decode(), 400, None),
            ("POST", "/v1/completions", {"model": "policy", "prompt": [1, 10**9], "user": "ep-3"}, SECRET.decode(), 400, None),
            ("GET", "/v1/chat/completions", b"", SECRET.decode(), 405, None),
            ("GET", "/v1/nothing", b"", SECRET.decode(), 404, "unknown_url"),
        ]
        for method, path, payload, token, status, code in cases:
            raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            got, answer = await asyncio.to_thread(_raw, url, method, path, raw, token)
            assert got == status, (path, payload, answer)
            assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["message"]
            assert "Traceback" not in answer["error"]["message"] and answer["error"]["code"] == code
        assert engine.calls == [] and endpoint.take_episode("ep-3") is None
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=10_000)
        bad = openai.AsyncOpenAI(base_url=url, api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
        await bad.close()

    _serve(tiny_model_dir, body, max_context=64)


def test_a_tool_call_sent_back_in_the_openai_format_extends_the_episode(tiny_model_dir: Path) -> None:
    """A reply that called a tool, re-sent by the agent as OpenAI `tool_calls` with a `tool` answer,
    matches the held conversation: only the tool turn is rendered and tokenised."""
    _, tokenizer = load_model(tiny_model_dir)
    chat, renderer = ChatFormat(tokenizer), ChatRenderer(tokenizer)
    tools = [{"name": "calculator", "description": "evaluate", "parameters": {"type": "object"}}]
    marker = tokenizer.convert_ids_to_tokens(chat.end_token_id)
    first = normalize([{"role": "user", "content": "3*(4+5)?"}])
    episode = Episode("ep")
    plan = episode.plan_chat(first, tools, renderer, lambda t: tokenizer.encode(t, add_special_tokens=False), marker)
    generated = tokenizer.encode('<tool>{"name": "calculator", "arguments": {"expression": "3*(4+5)"}}</tool>',
                                 add_special_tokens=False) + [chat.end_token_id]
    episode.commit(plan, generated, [-0.5] * len(generated), 4, [])
    reply = reply_message(chat.reply_text(generated), tools)
    episode.held_chat, episode.held_tools = [*first, reply], tools
    call = reply["tool_calls"][0]
    resent = normalize([{"role": "user", "content": "3*(4+5)?"},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"id": call["id"], "type": "function",
                             "function": {"name": "calculator", "arguments": call["arguments"]}}]},
                        {"role": "tool", "tool_call_id": call["id"], "content": "27"}])
    nxt = episode.plan_chat(resent, tools, renderer, lambda t: tokenizer.encode(t, add_special_tokens=False), marker)
    assert not nxt.fresh and not nxt.mismatch
    assert nxt.prompt_ids[:len(episode.trace.ids)] == episode.trace.ids
    assert tokenizer.decode(nxt.new_context).startswith("\n<|user|>\ntool result: 27")
    assert nxt.new_context[-2:] == tokenizer.encode("<|assistant|>\n", add_special_tokens=False)


def test_reply_with_a_tool_call_becomes_openai_tool_calls() -> None:
    tools = [{"name": "calculator", "description": "", "parameters": {"type": "object"}}]
    msg = reply_message('ok <tool>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool>', tools)
    [call] = msg["tool_calls"]
    assert call["name"] == "calculator" and json.loads(call["arguments"]) == {"expression": "1+2"}
    assert msg["content"] == "ok"
    assert "tool_calls" not in reply_message('<tool>{"name": "other", "arguments": {}}</tool>', tools)
    assert "tool_calls" not in reply_message("answer: 3", tools)
