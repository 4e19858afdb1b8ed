"""A small HTTP/1.1 server on asyncio streams: just enough for an OpenAI-compatible API.

It owns reading requests (request line, headers, a Content-Length body), writing responses (a JSON
body with keep-alive, or a server-sent-event stream that ends the connection), and turning what it
cannot parse into a 4xx answer instead of a traceback. Routing and the API's meaning are the
endpoint's (`earl_stream.openai_api.server`). It runs on the event loop of the rollout worker, next to
the engine's batcher, so a request reaches the engine without crossing threads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

MAX_LINE = 16 * 1024
MAX_HEADERS = 100
MAX_BODY = 32 * 1024 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 411: "Length Required", 413: "Payload Too Large", 429: "Too Many Requests",
            500: "Internal Server Error", 503: "Service Unavailable"}


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]  # names lower-cased
    body: bytes


@dataclass
class Response:
    """A JSON answer (`body`), or an event stream (`events` yields the `data:` payloads)."""

    status: int = 200
    body: Any = None
    events: AsyncIterator[str] | None = None
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Awaitable[Response]]


class HttpError(Exception):
    """A request the server cannot read; answered with `status` and the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bind_socket(bind: str) -> socket.socket:
    """A listening TCP socket on "HOST:PORT" (port 0 = any free port), made before the loop runs."""
    host, _, port = bind.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(port or 0)))
    sock.listen(256)
    sock.setblocking(False)
    return sock


async def serve(handler: Handler, sock: socket.socket, tls: ssl.SSLContext | None = None) -> asyncio.Server:
    """Serve `handler` on a listening socket (from `bind_socket`) on the running loop; HTTPS with `tls`."""

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _connection(handler, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client went away, or the server is closing with this connection idle in keep-alive
        finally:
            writer.close()

    return await asyncio.start_server(on_connection, sock=sock, limit=MAX_LINE, ssl=tls,
                                      ssl_handshake_timeout=10.0 if tls is not None else None)


async def _connection(handler: Handler, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        try:
            request = await _read_request(reader)
        except HttpError as exc:
            await _write_json(writer, exc.status, error_body(str(exc)), keep_alive=False)
            return
        if request is None:
            return
        try:
            response = await handler(request)
        except Exception as exc:  # a bug of ours: an error object for the client, the traceback in our log
            log.exception("OpenAI endpoint failed on %s %s", request.method, request.path)
            response = Response(500, error_body(f"internal error: {type(exc).__name__}", "server_error"))
        keep_alive = request.headers.get("connection", "").lower() != "close"
        if response.events is not None:
            await _write_events(writer, response)
            return
        await _write_json(writer, response.status, response.body, keep_alive=keep_alive, headers=response.headers)
        if not keep_alive:
            return


async def _read_request(reader: asyncio.StreamReader) -> Request | None:
    try:
        line = await reader.readline()
    except (asyncio.LimitOverrunError, ValueError):
        raise HttpError(400, "request line too long") from None
    if not line:
        return None
    parts = line.decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, "malformed HTTP request line")
    method, target, _ = parts
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADERS + 1):
        try:
            raw = await reader.readline()
        except (asyncio.LimitOverrunError, ValueError):
            raise HttpError(400, "header line too long") from None
        if raw in (b"\r\n", b"\n", b""):
            break
        name, sep, value = raw.decode("latin-1").partition(":")
        if not sep:
            raise HttpError(400, "malformed header line")
        headers[name.strip().lower()] = value.strip()
    else:
        raise HttpError(400, f"more than {MAX_HEADERS} headers")
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise HttpError(411, "chunked request bodies are not supported; send Content-Length")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise HttpError(400, "Content-Length is not a number") from None
    if length < 0 or length > MAX_BODY:
        raise HttpError(413, f"request body of {length} bytes (at most {MAX_BODY})")
    body = await reader.readexactly(length) if length else b""
    return Request(method.upper(), target.split("?", 1)[0], headers, body)


def _head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _write_json(writer: asyncio.StreamWriter, status: int, body: Any, *, keep_alive: bool,
                      headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body, separators=(",", ":")).encode()
    head = {"Content-Type": "application/json", "Content-Length": str(len(data)),
            "Connection": "keep-alive" if keep_alive else "close", **(headers or {})}
    writer.write(_head(status, head) + data)
    await writer.drain()


async def _write_events(writer: asyncio.StreamWriter, response: Response) -> None:
    """Server-sent events; the end of the stream is the end of the connection (no chunked framing)."""
    assert response.events is not None
    writer.write(_head(response.status, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                         "Connection": "close", **response.headers}))
    try:
        async for payload in response.events:
            writer.write(f"data: {payload}\n\n".encode())
            await writer.drain()
    finally:  # a client that left stops the stream now, not when the generator is collected
        close = getattr(response.events, "aclose", None)
        if close is not None:
            await close()
