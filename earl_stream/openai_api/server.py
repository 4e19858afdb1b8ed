"""The OpenAI-compatible endpoint of a rollout worker: `POST /v1/chat/completions`, `POST
/v1/completions` (plain JSON or server-sent events), `GET /v1/models`.

Requests are served by the worker's engine through its batcher, so they share batches with the
worker's own episodes and run with the current policy. It owns the API's shape (parameters, answers,
OpenAI error objects with the right HTTP status; never a traceback), the bearer-token check against
the cluster secret, and which episode a request belongs to (`X-Episode-Id` header, else the `user`
field). Token accounting per episode is `episodes`'s; reading HTTP is `http`'s.

Streaming: the engine batches whole turns, so a streamed reply's events are sent when its turn has
been generated (one `delta` per token), not token by token as they are sampled.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import Counter
from transformers import PreTrainedTokenizerBase

from earl_stream.chat import ChatFormat
from earl_stream.errors import EngineError
from earl_stream.openai_api import http
from earl_stream.openai_api.episodes import Episode, EpisodeBook, TurnPlan
from earl_stream.openai_api.messages import BadRequest, ChatRenderer, Message, api_message, check_tools, normalize, reply_message
from earl_stream.workers.engines.base import FinishReason, GenerateRequest, GenerateResult
from earl_stream.workers.engines.batcher import AsyncBatcher

log = logging.getLogger(__name__)

EPISODE_HEADER = "x-episode-id"
MAX_EPISODES = 4096
GATHER_QUIET_S = 0.010  # a batch waits while endpoint requests keep arriving at most this far apart...
GATHER_MAX_S = 0.25  # ...for at most this long after one arrived

REQUESTS = Counter("earl_openai_requests_total", "Requests to the OpenAI endpoint", ["worker", "route", "status"])
PREFIX_MISMATCH = Counter("earl_openai_prefix_mismatch_total", "Requests whose messages did not extend the tokens "
                          "held for their episode (a new segment was started)", ["worker"])
GENERATED = Counter("earl_openai_generated_tokens_total", "Tokens generated for OpenAI endpoint requests", ["worker"])


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise BadRequest(f"{key} must be a number in [{lo}, {hi}], got {value!r}", param=key)
    return float(value)


def _int(body: dict[str, Any], key: str, lo: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise BadRequest(f"{key} must be an integer >= {lo}, got {value!r}", param=key)
    return value


class OpenAIEndpoint:
    """Serves the OpenAI API with `batcher`'s engine; holds the token traces of the episodes it serves."""

    def __init__(self, batcher: AsyncBatcher, tokenizer: PreTrainedTokenizerBase, chat: ChatFormat, *, model: str,
                 secret: bytes | None, max_context: int, default_max_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, policy_version: Callable[[], int] = lambda: 0,
                 worker: str = "") -> None:
        self.batcher, self.chat, self.model = batcher, chat, model
        self._tok = tokenizer
        self.renderer = ChatRenderer(tokenizer)
        self._token = secret.decode() if secret else None
        self.max_context, self.default_max_tokens = max_context, default_max_tokens
        self._defaults = (temperature, top_p, top_k)
        self._policy_version = policy_version
        self.worker = worker
        marker = tokenizer.convert_ids_to_tokens(chat.end_token_id)
        self.end_marker = marker if isinstance(marker, str) else ""
        self.episodes = EpisodeBook(MAX_EPISODES, batcher.release)
        # HTTP requests of concurrent agents arrive one by one: let them gather into one engine batch
        self.gather_quiet_s, self.gather_max_s = GATHER_QUIET_S, GATHER_MAX_S
        self.agents: set[str] = set()  # episodes of agent environments running now (`expect`)
        self._in_engine = 0  # requests handed to the batcher and not answered yet
        self.url = ""  # advertised (status --json's openai_url)
        self.local_url = ""  # what agents in this process use
        self._server: asyncio.Server | None = None

    # ---------------------------------------------------------------- lifecycle

    async def start(self, sock: socket.socket, advertise_host: str) -> str:
        """Serve on a listening socket (`http.bind_socket`); returns the base URL (…/v1)."""
        self._server = await http.serve(self.handle, sock)
        host, port = sock.getsockname()[:2]
        self.url = f"http://{advertise_host}:{port}/v1"
        local = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.local_url = f"http://[{local}]:{port}/v1" if ":" in local else f"http://{local}:{port}/v1"
        log.info("OpenAI-compatible endpoint at %s (model %r)", self.url, self.model)
        return self.url

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def expect(self, key: str) -> None:
        """An agent of this worker starts episode `key`: its requests are waited for when batching."""
        self.agents.add(key)

    def take_episode(self, key: str) -> Episode | None:
        """The episode's accounting, removed from the endpoint (None if it made no successful request)."""
        self.agents.discard(key)
        episode = self.episodes.pop(key)
        return episode if episode is not None and episode.has_tokens else None

    # ---------------------------------------------------------------- routing

    async def handle(self, req: http.Request) -> http.Response:
        route = req.path.rstrip("/")
        response = await self._route(req, route)
        REQUESTS.labels(self.worker, route if route in ("/v1/models", "/v1/chat/completions", "/v1/completions")
                        else "other", str(response.status)).inc()
        return response

    async def _route(self, req: http.Request, route: str) -> http.Response:
        methods = {"/v1/models": "GET", "/v1/chat/completions": "POST", "/v1/completions": "POST"}
        if route not in methods and not route.startswith("/v1/models/"):
            return _error(404, f"unknown path {req.path}; this endpoint serves {sorted(methods)}", code="unknown_url")
        if not self._authorized(req):
            return _error(401, "missing or wrong API key: pass the cluster secret as the bearer token",
                          code="invalid_api_key")
        if route.startswith("/v1/models"):
            if req.method != "GET":
                return _error(405, f"{req.method} is not allowed on {route}")
            return self._models(route)
        if req.method != methods[route]:
            return _error(405, f"{req.method} is not allowed on {route}; use {methods[route]}")
        try:
            body = json.loads(req.body or b"null")
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(400, f"the request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        try:
            if route == "/v1/chat/completions":
                return await self._chat(req, body)
            return await self._completion(req, body)
        except BadRequest as exc:
            return _error(exc.status, str(exc), code=exc.code, param=exc.param)
        except EngineError as exc:
            log.warning("engine refused an OpenAI request: %s", exc)
            return _error(503, f"the engine could not serve this request: {exc}", kind="server_error")

    def _authorized(self, req: http.Request) -> bool:
        if self._token is None:
            return True
        scheme, _, token = req.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._token.encode())

    def _models(self, route: str) -> http.Response:
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "earl_stream",
                "max_model_len": self.max_context}
        if route == "/v1/models":
            return http.Response(200, {"object": "list", "data": [card]})
        if route.removeprefix("/v1/models/") != self.model:
            return _error(404, f"model {route.removeprefix('/v1/models/')!r} does not exist; this endpoint serves "
                          f"{self.model!r}", code="model_not_found")
        return http.Response(200, card)

    # ---------------------------------------------------------------- requests

    def _check_common(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if not isinstance(model, str):
            raise BadRequest("model is required (a string)", param="model")
        if model != self.model:
            raise BadRequest(f"the model {model!r} does not exist; this endpoint serves {self.model!r}",
                             status=404, code="model_not_found", param="model")
        if body.get("n", 1) != 1:
            raise BadRequest("n must be 1: each request extends one episode", param="n")

    def _episode(self, req: http.Request, body: dict[str, Any]) -> Episode:
        key = req.headers.get(EPISODE_HEADER) or body.get("user")
        if not isinstance(key, str) or not key:
            return Episode("")  # not held: nothing of it can become a sample
        return self.episodes.get(key)

    async def _generate(self, plan: TurnPlan, body: dict[str, Any], episode: Episode) -> GenerateResult:
        asked = _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1)
        room = self.max_context - len(plan.prompt_ids)
        if room < 1 or (asked is not None and asked > room):
            raise BadRequest(f"this model's maximum context length is {self.max_context} tokens; the prompt has "
                             f"{len(plan.prompt_ids)} and {asked or 1} more were requested", code="context_length_exceeded",
                             param="max_tokens")
        temperature, top_p, top_k = self._defaults
        request = GenerateRequest(
            prompt_ids=plan.prompt_ids, max_new_tokens=asked or min(self.default_max_tokens, room),
            stop_token_ids=self.chat.stop_token_ids, temperature=_number(body, "temperature", temperature, 0, 2),
            top_p=_number(body, "top_p", top_p, 1e-6, 1), top_k=top_k, seed=_int(body, "seed", 0),
            cache_key=episode.key or None)
        _stops(body)
        gather = self.gather_quiet_s if self.agents else 0.0  # only the agents this worker runs are expected
        self._in_engine += 1
        try:
            return await self.batcher.generate(request, gather_quiet_s=gather, gather_max_s=self.gather_max_s,
                                               all_here=lambda: self._in_engine >= len(self.agents))
        finally:
            self._in_engine -= 1

    def _version(self, result: GenerateResult) -> int:
        return result.policy_version if result.policy_version is not None else self._policy_version()

    async def _chat(self, req: http.Request, body: dict[str, Any]) -> http.Response:
        self._check_common(body)
        messages = normalize(body.get("messages"))
        tools = [] if body.get("tool_choice") == "none" else check_tools(body.get("tools"))
        episode = self._episode(req, body)
        async with episode.lock:
            plan = episode.plan_chat(messages, tools, self.renderer, self._encode, self.end_marker)
            result = await self._generate(plan, body, episode)
            text = _cut_at_stop(self.chat.reply_text(list(result.token_ids)), _stops(body))
            reply = reply_message(text, tools)
            closing = [self.chat.end_token_id] if result.finish_reason == FinishReason.LENGTH else []
            self._commit(episode, plan, result, closing)
            episode.held_chat, episode.held_tools, episode.held_text = [*messages, reply], tools, None
        finish = "tool_calls" if "tool_calls" in reply else _finish(result)
        usage = _usage(plan, result)
        if body.get("stream"):
            return http.Response(200, events=self._chat_events(body, reply, result, finish, usage))
        choice = {"index": 0, "message": api_message(reply), "finish_reason": finish,
                  "logprobs": {"content": self._logprobs(result)} if body.get("logprobs") else None}
        return http.Response(200, {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                                   "created": int(time.time()), "model": self.model, "choices": [choice], "usage": usage})

    async def _completion(self, req: http.Request, body: dict[str, Any]) -> http.Response:
        self._check_common(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        token_prompt = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not (token_prompt and prompt):
            raise BadRequest("prompt must be a non-empty string or a non-empty list of token ids", param="prompt")
        if body.get("echo"):
            raise BadRequest("echo is not supported", param="echo")
        if token_prompt and not all(0 <= int(t) < len(self._tok) for t in prompt):
            raise BadRequest(f"prompt token ids must be in [0, {len(self._tok)})", param="prompt")
        episode = self._episode(req, body)
        async with episode.lock:
            plan = episode.plan_text(prompt, self._encode)
            result = await self._generate(plan, body, episode)
            text = _cut_at_stop(self.chat.reply_text(list(result.token_ids)), _stops(body))
            self._commit(episode, plan, result, [])
            episode.held_chat, episode.held_text = None, (prompt + text if isinstance(prompt, str) else None)
        usage = _usage(plan, result)
        logprobs = None
        if body.get("logprobs") is not None:
            content = self._logprobs(result)
            logprobs = {"tokens": [c["token"] for c in content], "token_logprobs": [c["logprob"] for c in content],
                        "top_logprobs": None, "text_offset": []}
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.get("stream"):
            return http.Response(200, events=self._text_events(cid, created, text, _finish(result), body, usage))
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": _finish(result)}
        return http.Response(200, {"id": cid, "object": "text_completion", "created": created, "model": self.model,
                                   "choices": [choice], "usage": usage})

    def _commit(self, episode: Episode, plan: TurnPlan, result: GenerateResult, closing: list[int]) -> None:
        if not episode.key:
            return
        if plan.mismatch:
            PREFIX_MISMATCH.labels(self.worker).inc()
            log.info("episode %s: the request does not extend the tokens held; new segment", episode.key)
        episode.commit(plan, list(result.token_ids), list(result.logprobs), self._version(result), closing)
        GENERATED.labels(self.worker).inc(len(result.token_ids))

    def _encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def _logprobs(self, result: GenerateResult) -> list[dict[str, Any]]:
        out = []
        for token_id, lp in zip(result.token_ids, result.logprobs):
            token = str(self._tok.decode([token_id], skip_special_tokens=False))
            out.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []})
        return out

    # ---------------------------------------------------------------- streams

    async def _chat_events(self, body: dict[str, Any], reply: Message, result: GenerateResult, finish: str,
                           usage: dict[str, int]) -> AsyncIterator[str]:
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> str:
            return json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model,
                               "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})

        yield chunk({"role": "assistant", "content": ""})
        if "tool_calls" in reply:
            if reply["content"]:
                yield chunk({"content": reply["content"]})
            calls = api_message(reply)["tool_calls"]
            yield chunk({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
        else:
            for piece in self._pieces(result, reply["content"]):
                yield chunk({"content": piece})
        yield chunk({}, finish)
        if (body.get("stream_options") or {}).get("include_usage"):
            yield json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model,
                              "choices": [], "usage": usage})
        yield "[DONE]"

    async def _text_events(self, cid: str, created: int, text: str, finish: str, body: dict[str, Any],
                           usage: dict[str, int]) -> AsyncIterator[str]:
        def chunk(piece: str, finish_reason: str | None) -> str:
            return json.dumps({"id": cid, "object": "text_completion", "created": created, "model": self.model,
                               "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": finish_reason}]})

        pieces = [text[i:i + 16] for i in range(0, len(text), 16)] or [""]
        for i, piece in enumerate(pieces):
            yield chunk(piece, finish if i == len(pieces) - 1 else None)
        if (body.get("stream_options") or {}).get("include_usage"):
            yield json.dumps({"id": cid, "object": "text_completion", "created": created, "model": self.model,
                              "choices": [], "usage": usage})
        yield "[DONE]"

    def _pieces(self, result: GenerateResult, text: str) -> list[str]:
        """The reply text cut where its tokens end (one piece per token, as a live stream would send)."""
        pieces, done = [], ""
        ids = [t for t in result.token_ids if t not in self.chat.stop_token_ids]
        for i in range(1, len(ids) + 1):
            upto = str(self._tok.decode(ids[:i], skip_special_tokens=False))
            if upto.startswith(done) and len(upto) > len(done) and text.startswith(upto):
                pieces.append(upto[len(done):])
                done = upto
        if done != text:
            pieces.append(text[len(done):])
        return pieces


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop must be a string or a list of up to 4 non-empty strings", param="stop")
    return stops


def _cut_at_stop(text: str, stops: list[str]) -> str:
    """The reply up to the first stop string (its tokens stay in the episode: the model did generate them)."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(cuts)] if cuts else text


def _finish(result: GenerateResult) -> str:
    return "length" if result.finish_reason == FinishReason.LENGTH else "stop"


def _usage(plan: TurnPlan, result: GenerateResult) -> dict[str, int]:
    n = len(result.token_ids)
    return {"prompt_tokens": len(plan.prompt_ids), "completion_tokens": n, "total_tokens": len(plan.prompt_ids) + n}


def _error(status: int, message: str, *, kind: str | None = None, code: str | None = None,
           param: str | None = None) -> http.Response:
    default = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    return http.Response(status, http.error_body(message, kind or default, code, param))
