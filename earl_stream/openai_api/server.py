"""The OpenAI-compatible endpoint of a rollout worker: `POST /v1/chat/completions`, `POST
/v1/completions` (plain JSON or server-sent events), `GET /v1/models`.

Requests are served by the worker's engine through its batcher, so they share batches with the
worker's own episodes and run with the current policy. It owns the API's shape (parameters, answers,
OpenAI error objects with the right HTTP status; never a traceback) and which episode a request belongs
to (`X-Episode-Id` header, else the `user` field; an agent key's own episode: `auth`, which checks bearer
tokens), and what a request that does not extend its episode's tokens gets (`non_append`, the setting
`rollout.non_append`): `split` serves it as the start of a new segment of the episode (a sample of its
own); `refuse` answers 400 (`code: non_append_history`) before anything is generated, and the episode
stays as it was (an agent may re-send its history as it was; one that fails on the error fails its
episode, whose group is played again). Token accounting per episode is `episodes`'s; reading HTTP is `http`'s; streamed replies are
`streaming`'s.

Streaming (`stream: true`) is token by token: the request's tokens come from the engine as they are
sampled (`GenerateRequest.on_token`, called at each decode step of the built-in engine), and each
event carries the text of the tokens sampled since the last one; the concatenated deltas equal the
non-streamed reply for the same seed. The response starts with the turn's first token (a request
refused before that gets its error status). On the vLLM and SGLang backends, whose blocking
`generate` has no per-token output, a streamed reply arrives in one piece when its turn ends.

`n` (1 to MAX_CHOICES) samples n continuations of the prompt together (the built-in engine computes
the shared prompt once), choice i seeded `seed + i`. n > 1 is refused (400, `unsupported_value`) for
a request that belongs to an episode, and when streamed: see `OpenAIEndpoint._choices`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import socket
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from prometheus_client import Counter
from transformers import PreTrainedTokenizerBase

from earl_stream.errors import EngineError
from earl_stream.model.chat import ChatFormat
from earl_stream.openai_api import http
from earl_stream.openai_api.auth import Denied, EndpointAuth
from earl_stream.openai_api.episodes import Episode, EpisodeBook, TurnPlan
from earl_stream.openai_api.messages import BadRequest, ChatRenderer, Message, api_message, check_tools, normalize, reply_message
from earl_stream.openai_api.params import integer, number
from earl_stream.openai_api.params import stops as stops_of
from earl_stream.openai_api.streaming import Ending, ReplyText, StreamHead, TokenFeed, chat_events, cut_at_stop, text_events
from earl_stream.security.tls import client_ca_pem, server_context, tls_enabled
from earl_stream.workers.engines.base import FinishReason, GenerateRequest, GenerateResult, RequestRefused
from earl_stream.workers.engines.batcher import AsyncBatcher

log = logging.getLogger(__name__)

EPISODE_HEADER = "x-episode-id"
MAX_EPISODES = 4096
GATHER_QUIET_S = 0.010  # a batch waits while endpoint requests keep arriving at most this far apart...
GATHER_MAX_S = 0.25  # ...for at most this long after one arrived
MAX_CHOICES = 16  # the most choices (n) one request may ask for
MAX_SEED = 2**63 - 1 - MAX_CHOICES  # seeds of choices (seed + i) stay within torch's generator seeds

REQUESTS = Counter("earl_openai_requests_total", "Requests to the OpenAI endpoint", ["worker", "route", "status"])
PREFIX_MISMATCH = Counter("earl_openai_prefix_mismatch_total", "Requests whose messages did not extend the tokens "
                          "held for their episode, accepted as a new segment (rollout.non_append=split)", ["worker"])
NON_APPEND_REFUSED = Counter("earl_openai_non_append_refused_total", "Requests whose messages did not extend the "
                             "tokens held for their episode, refused (rollout.non_append=refuse)", ["worker"])
NON_APPEND_MODES = ("refuse", "split")  # rollout.non_append
GENERATED = Counter("earl_openai_generated_tokens_total", "Tokens generated for OpenAI endpoint requests", ["worker"])


@dataclasses.dataclass(frozen=True)
class Turn:
    """One request's turn: its plan, each choice's result, and each choice's reply text (cut at the
    first stop string)."""

    plan: TurnPlan
    results: list[GenerateResult]
    texts: list[str]


Events = Callable[[StreamHead, ReplyText, TokenFeed, Callable[[], Awaitable[Ending]]], AsyncIterator[str]]


class OpenAIEndpoint:
    """Serves the OpenAI API with `batcher`'s engine; holds the token traces of the episodes it serves."""

    def __init__(self, batcher: AsyncBatcher, tokenizer: PreTrainedTokenizerBase, chat: ChatFormat, *, model: str,
                 secret: bytes | None, max_context: int, default_max_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, policy_version: Callable[[], int] = lambda: 0,
                 worker: str = "", non_append: str = "split") -> None:
        if non_append not in NON_APPEND_MODES:
            raise ValueError(f"non_append must be one of {NON_APPEND_MODES}, got {non_append!r}")
        self.non_append = non_append
        self.batcher, self.chat, self.model = batcher, chat, model
        self._tok = tokenizer
        self.renderer = ChatRenderer(tokenizer)
        self.auth = EndpointAuth(secret)  # the cluster secret, or an episode's agent key
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
        self.ca_pem = ""  # under TLS: the CA certificate (PEM) the agents trust
        self._server: asyncio.Server | None = None
        self._unix_servers: list[asyncio.Server] = []

    # ---------------------------------------------------------------- lifecycle

    async def start(self, sock: socket.socket, advertise_host: str, tls: ssl.SSLContext | None = None,
                    ca_pem: str = "") -> str:
        """Serve on a listening socket (`http.bind_socket`); returns the base URL (…/v1). HTTPS with `tls`
        (whose certificate `ca_pem` signed), else where the run turns TLS on (earl_stream/security/tls.py)."""
        if tls is None and tls_enabled():
            tls, ca_pem = server_context([advertise_host]), client_ca_pem()
        self.ca_pem = ca_pem if tls is not None else ""
        self._server = await http.serve(self.handle, sock, tls)
        host, port = sock.getsockname()[:2]
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://{advertise_host}:{port}/v1"
        local = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        self.local_url = f"{scheme}://[{local}]:{port}/v1" if ":" in local else f"{scheme}://{local}:{port}/v1"
        log.info("OpenAI-compatible endpoint at %s (model %r)", self.url, self.model)
        return self.url

    async def serve_unix(self, path: str) -> str:
        """Also serve on a Unix socket at `path` (plain HTTP: the socket's file is the boundary), for agent programs
        in sandboxes without a network (`earl_stream.sandbox`); returns the base URL to give their clients."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        os.chmod(path, 0o666)  # (a sandbox's uid 65534 connects; its folder is private to the worker and that sandbox)
        sock.listen(256)
        sock.setblocking(False)
        self._unix_servers.append(await http.serve(self.handle, sock))
        return "http://localhost/v1"

    async def close(self) -> None:
        for server in [self._server, *self._unix_servers]:
            if server is not None:
                server.close()
                await server.wait_closed()

    def expect(self, key: str) -> None:
        """An agent of this worker starts episode `key`: its requests are waited for when batching, and its
        agent key (`agent_key`) holds until `take_episode`."""
        self.agents.add(key)

    def agent_key(self, key: str, ttl_s: float) -> str:
        """The API key of episode `key`'s agent program (auth.py): valid for that episode's requests only."""
        return self.auth.agent_key(key, ttl_s)

    def take_episode(self, key: str) -> Episode | None:
        """The episode's accounting, removed from the endpoint (None if it made no successful request)."""
        self.agents.discard(key)
        self.auth.ended(key)
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
        try:
            grant = self.auth.grant(req.headers.get("authorization", ""))
        except Denied as exc:
            return _error(exc.status, str(exc), code=exc.code)
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
            key = EndpointAuth.episode_of(grant, self._episode_key(req, body))
            if key and req.headers.get(EPISODE_HEADER) != key:  # an agent key's request that named no episode
                req = dataclasses.replace(req, headers={**req.headers, EPISODE_HEADER: key})
            if route == "/v1/chat/completions":
                return await self._chat(req, body)
            return await self._completion(req, body)
        except BadRequest as exc:
            return _error(exc.status, str(exc), code=exc.code, param=exc.param)
        except RequestRefused as exc:  # larger than the engine's KV budget even alone: the request's size, not a failure
            return _error(400, str(exc), code="context_length_exceeded", param="messages")
        except Denied as exc:
            return _error(exc.status, str(exc), code=exc.code)
        except EngineError as exc:
            log.warning("engine refused an OpenAI request: %s", exc)
            return _error(503, f"the engine could not serve this request: {exc}", kind="server_error")

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

    def _episode_key(self, req: http.Request, body: dict[str, Any]) -> str:
        key = req.headers.get(EPISODE_HEADER) or body.get("user")
        return key if isinstance(key, str) else ""

    def _episode(self, key: str) -> Episode:
        return self.episodes.get(key) if key else Episode("")  # "": not held, nothing of it becomes a sample

    def _choices(self, body: dict[str, Any], key: str) -> int:
        """The request's `n`. An episode is one trajectory: its tokens and log-probs are what the policy
        sampled, one turn after the other. Of n choices the agent would continue with one it picked, and
        a picked sample is not a draw from the policy (its log-probs would claim it was): so n > 1 is
        refused in an episode and served only to requests outside episodes, which record nothing."""
        n = body.get("n")
        if n is None:
            return 1
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise BadRequest(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}", param="n")
        if n > 1 and key:
            raise BadRequest(f"n must be 1 in an episode (this request belongs to episode {key!r}): an episode records "
                             "one trajectory; send n > 1 without an episode id (X-Episode-Id header or user field)",
                             code="unsupported_value", param="n")
        if n > 1 and body.get("stream"):
            raise BadRequest("n > 1 cannot be streamed; stream one choice per request, or ask without stream",
                             code="unsupported_value", param="n")
        return n

    def _request(self, plan: TurnPlan, body: dict[str, Any], episode: Episode,
                 on_token: Callable[[int], None] | None) -> GenerateRequest:
        asked = integer(body, "max_completion_tokens", 1) or integer(body, "max_tokens", 1)
        room = self.max_context - len(plan.prompt_ids)
        if room < 1 or (asked is not None and asked > room):
            raise BadRequest(f"this model's maximum context length is {self.max_context} tokens; the prompt has "
                             f"{len(plan.prompt_ids)} and {asked or 1} more were requested", code="context_length_exceeded",
                             param="max_tokens")
        temperature, top_p, top_k = self._defaults
        return GenerateRequest(
            prompt_ids=plan.prompt_ids, max_new_tokens=asked or min(self.default_max_tokens, room),
            stop_token_ids=self.chat.stop_token_ids, temperature=number(body, "temperature", temperature, 0, 2),
            top_p=number(body, "top_p", top_p, 1e-6, 1), top_k=top_k, seed=integer(body, "seed", 0, MAX_SEED),
            cache_key=episode.key or None, on_token=on_token)

    async def _generate(self, request: GenerateRequest, n: int) -> list[GenerateResult]:
        """`n` continuations of one prompt, handed to the batcher together (the engine computes the shared
        prompt once). Choice i is seeded `seed + i`, so choice 0 is what n = 1 gives; only choice 0 may
        use the episode's kept cache (a key is in flight once at a time)."""
        requests = [request] + [dataclasses.replace(request, cache_key=None, on_token=None,
                                                    seed=None if request.seed is None else request.seed + i)
                                for i in range(1, n)]
        gather = self.gather_quiet_s if self.agents else 0.0  # only the agents this worker runs are expected

        def one(r: GenerateRequest) -> Awaitable[GenerateResult]:
            return self.batcher.generate(r, gather_quiet_s=gather, gather_max_s=self.gather_max_s,
                                         all_here=lambda: self._in_engine >= len(self.agents))

        self._in_engine += 1
        try:
            return [await one(request)] if n == 1 else list(await asyncio.gather(*map(one, requests)))
        finally:
            self._in_engine -= 1

    async def _turn(self, episode: Episode, plan: Callable[[], TurnPlan], body: dict[str, Any], n: int,
                    commit: Callable[[Turn], None], feed: TokenFeed | None = None) -> Turn:
        """Plan, generate and `commit` one request's turn under its episode's lock (nothing is kept of a
        request that fails); `feed` receives choice 0's tokens as they are sampled."""
        async with episode.lock:
            planned = plan()
            if planned.mismatch and self.non_append == "refuse":
                NON_APPEND_REFUSED.labels(self.worker).inc()
                raise _non_append_refused(episode.key, "messages" if "messages" in body else "prompt")
            results = await self._generate(self._request(planned, body, episode, feed.push if feed else None), n)
            stops = stops_of(body)
            turn = Turn(planned, results, [cut_at_stop(self.chat.reply_text(list(r.token_ids)), stops) for r in results])
            commit(turn)
        GENERATED.labels(self.worker).inc(sum(len(r.token_ids) for r in results))
        return turn

    async def _stream(self, events: Events, body: dict[str, Any], episode: Episode, plan: Callable[[], TurnPlan],
                      commit: Callable[[Turn], None], ending: Callable[[Turn], Ending], text: ReplyText,
                      prefix: str) -> http.Response:
        """Start the turn and answer with its event stream once its first token is sampled (a request the
        turn refuses before that gets its error status instead). The turn goes on, and is committed, if
        the client leaves."""
        feed = TokenFeed()
        task = asyncio.ensure_future(self._turn(episode, plan, body, 1, commit, feed))

        def finished(done: asyncio.Future[Turn]) -> None:
            feed.close()
            if not done.cancelled():
                done.exception()  # retrieved: a client that left never awaits the turn

        task.add_done_callback(finished)
        await feed.started.wait()
        if task.done():
            task.result()  # raises what refused the request

        async def ended() -> Ending:
            return ending(await task)

        head = StreamHead(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), self.model,
                          bool((body.get("stream_options") or {}).get("include_usage")))
        return http.Response(200, events=events(head, text, feed, ended))

    def _version(self, result: GenerateResult) -> list[int]:
        return result.versions(self._policy_version())

    async def _chat(self, req: http.Request, body: dict[str, Any]) -> http.Response:
        self._check_common(body)
        messages = normalize(body.get("messages"))
        tools = [] if body.get("tool_choice") == "none" else check_tools(body.get("tools"))
        stops = stops_of(body)
        key = self._episode_key(req, body)
        n = self._choices(body, key)
        episode = self._episode(key)
        replies: list[Message] = []

        def plan() -> TurnPlan:
            return episode.plan_chat(messages, tools, self.renderer, self._encode, self.end_marker)

        def commit(turn: Turn) -> None:  # choice 0 continues the conversation (n > 1 only outside episodes)
            replies.extend(reply_message(text, tools) for text in turn.texts)
            first = turn.results[0]
            closing = [self.chat.end_token_id] if first.finish_reason == FinishReason.LENGTH else []
            self._commit(episode, turn.plan, first, closing)
            episode.held_chat, episode.held_tools, episode.held_text = [*messages, replies[0]], tools, None

        def ending(turn: Turn) -> Ending:
            calls = api_message(replies[0]).get("tool_calls", [])
            return Ending(replies[0]["content"], _chat_finish(replies[0], turn.results[0]), _usage(turn), calls)

        if body.get("stream"):
            text = ReplyText(self._tok, self.chat.stop_token_ids, stops, tools=bool(tools))
            return await self._stream(chat_events, body, episode, plan, commit, ending, text, "chatcmpl")
        turn = await self._turn(episode, plan, body, n, commit)
        choices = [{"index": i, "message": api_message(reply), "finish_reason": _chat_finish(reply, result),
                    "logprobs": {"content": self._logprobs(result)} if body.get("logprobs") else None}
                   for i, (reply, result) in enumerate(zip(replies, turn.results))]
        return http.Response(200, {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                                   "created": int(time.time()), "model": self.model, "choices": choices,
                                   "usage": _usage(turn)})

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
        stops = stops_of(body)
        key = self._episode_key(req, body)
        n = self._choices(body, key)
        episode = self._episode(key)

        def plan() -> TurnPlan:
            return episode.plan_text(prompt, self._encode)

        def commit(turn: Turn) -> None:
            self._commit(episode, turn.plan, turn.results[0], [])
            episode.held_chat, episode.held_text = None, (prompt + turn.texts[0] if isinstance(prompt, str) else None)

        if body.get("stream"):
            text = ReplyText(self._tok, self.chat.stop_token_ids, stops, tools=False)
            return await self._stream(text_events, body, episode, plan, commit,
                                      lambda t: Ending(t.texts[0], _finish(t.results[0]), _usage(t)), text, "cmpl")
        turn = await self._turn(episode, plan, body, n, commit)
        choices = [{"index": i, "text": text, "finish_reason": _finish(result),
                    "logprobs": self._text_logprobs(result) if body.get("logprobs") is not None else None}
                   for i, (text, result) in enumerate(zip(turn.texts, turn.results))]
        return http.Response(200, {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                                   "created": int(time.time()), "model": self.model, "choices": choices,
                                   "usage": _usage(turn)})

    def _commit(self, episode: Episode, plan: TurnPlan, result: GenerateResult, closing: list[int]) -> None:
        if not episode.key:
            return
        if plan.mismatch:
            PREFIX_MISMATCH.labels(self.worker).inc()
            log.info("episode %s: the request does not extend the tokens held; segment %d starts", episode.key,
                     len(episode.closed) + 1)
        episode.commit(plan, list(result.token_ids), list(result.logprobs), self._version(result), closing)

    def _encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def _logprobs(self, result: GenerateResult) -> list[dict[str, Any]]:
        out = []
        for token_id, lp in zip(result.token_ids, result.logprobs):
            token = str(self._tok.decode([token_id], skip_special_tokens=False))
            out.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []})
        return out

    def _text_logprobs(self, result: GenerateResult) -> dict[str, Any]:
        content = self._logprobs(result)
        return {"tokens": [c["token"] for c in content], "token_logprobs": [c["logprob"] for c in content],
                "top_logprobs": None, "text_offset": []}


def _non_append_refused(key: str, param: str) -> BadRequest:
    return BadRequest(
        f"the {param} of this request do not extend the history of episode {key!r} (the tokens the model was shown "
        "and generated so far): a summarised, truncated or edited history is refused under rollout.non_append=refuse. "
        "Send the history as it was, with new messages after it, or run with rollout.non_append=split to train each "
        "stretch of the episode as a sample of its own", code="non_append_history", param=param)


def _finish(result: GenerateResult) -> str:
    return "length" if result.finish_reason == FinishReason.LENGTH else "stop"


def _chat_finish(reply: Message, result: GenerateResult) -> str:
    return "tool_calls" if "tool_calls" in reply else _finish(result)


def _usage(turn: Turn) -> dict[str, int]:
    """The prompt once, the tokens of every choice."""
    prompt, completion = len(turn.plan.prompt_ids), sum(len(r.token_ids) for r in turn.results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _error(status: int, message: str, *, kind: str | None = None, code: str | None = None,
           param: str | None = None) -> http.Response:
    default = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    return http.Response(status, http.error_body(message, kind or default, code, param))
