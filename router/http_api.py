"""The OpenAI-compatible HTTP API: Starlette on uvicorn, in the router's own event loop.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (each streamed as server-sent events
ending in `data: [DONE]`, or whole), `GET /v1/models`, `GET /health`. A request goes through the
same `GenerationCore` as a gRPC `Generate` call (router/frontend.py): the same admission, placement,
retries, metrics and worker cancellation. What this module adds is HTTP's part:

- auth: the router's API keys, as `Authorization: Bearer <key>` (or `x-api-key`); `/health` is open;
- size: a body over `RouterConfig.max_message_bytes` is refused with 413 before it is read whole;
- deadline: the optional `x-cedserve-timeout-s` header, as a gRPC call's timeout;
- drain: refused with 503 while the router drains; open requests count toward the drain;
- disconnect: a client that goes away, before or during the stream, cancels the request's task, and
  the core cancels both workers' calls and frees every block (the same path as a cancelled gRPC call);
- errors: OpenAI's `{"error": {"message", "type", "param", "code"}}`, 400 naming the parameter, 401,
  404 for another model, 413, 429 with `Retry-After` when admission refuses, 503 when no worker can
  take the request, 504 past the deadline; after a stream has started, an `error` event ends it.

A streamed answer's headers go out with its first token, so a refusal (429, 503) is still a status.
uvicorn's own signal handling is off: the router's SIGTERM drains both APIs (router/server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import ssl
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from cedserve.common.tls import TLSConfig
from cedserve.proto import generation_pb2
from cedserve.router.auth import key_matches, presented_key
from cedserve.router.deadline import Deadline
from cedserve.router.errors import RequestError
from cedserve.router.frontend import GenerationCore
from cedserve.router.lifecycle import RouterDrain
from cedserve.router.openai_api import ApiCall, ApiError, ApiSettings, Kind, Shaper, api_error, bad, parse

log = logging.getLogger(__name__)
TIMEOUT_HEADER = "x-cedserve-timeout-s"
"""Request header: seconds the client waits at most (the request's deadline, as a gRPC timeout)."""
_T = TypeVar("_T")
_JSON = msgspec.json.Encoder()
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def _json(body: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_JSON.encode(body), status, headers, media_type="application/json")


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has gone (the request body must have been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(receive: Receive, work: Awaitable[_T]) -> _T:
    """`work`'s result; if the client goes first, `work` is cancelled and `ClientGone` raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientGone
    return task.result()


def _deadline(request: Request) -> Deadline:
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return Deadline()
    try:
        timeout_s = float(value)
    except ValueError:
        timeout_s = -1.0
    if not 0 < timeout_s < math.inf:
        raise bad(None, f"header {TIMEOUT_HEADER}: expected seconds > 0, got {value!r}")
    return Deadline.after(timeout_s)


class EventStream:
    """An ASGI response that streams one call's answer as server-sent events.

    It owns the rest of the core's response stream: a client that disconnects cancels the task
    reading it (and so the request, on both workers); `on_close` runs once, however it ends.
    """

    def __init__(self, shaper: Shaper, first: generation_pb2.GenerateResponse,
                 responses: AsyncGenerator[generation_pb2.GenerateResponse, None], on_close: Callable[[], None]) -> None:
        self.shaper, self.first, self.responses, self.on_close = shaper, first, responses, on_close
        self._sent_first_chunk = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [*_SSE_HEADERS, (b"x-request-id", self.shaper.call.id.encode())]})
            pump = asyncio.ensure_future(self._pump(send))
            gone = asyncio.ensure_future(_disconnected(receive))
            try:
                await asyncio.wait({pump, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not pump.done():
                    pump.cancel()  # the client left: cancel the request where it waits
                # OSError: a send to a client already gone (the request's stream was closed, so ended)
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await pump
        finally:
            self.on_close()

    async def _pump(self, send: Send) -> None:
        async with contextlib.aclosing(self.responses) as responses:
            try:
                await self._emit(send, self.first)
                async for response in responses:
                    await self._emit(send, response)
            except RequestError as exc:
                await _event(send, api_error(exc, self.shaper.call).body())
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _emit(self, send: Send, response: generation_pb2.GenerateResponse) -> None:
        kind = response.WhichOneof("response")
        if kind == "chunk":
            chunk = response.chunk
            if chunk.text or (chunk.token_ids and self.shaper.call.logprobs is not None) or not self._sent_first_chunk:
                await _event(send, self.shaper.chunk(chunk, first=not self._sent_first_chunk))
                self._sent_first_chunk = True
        elif kind == "complete":
            await _event(send, self.shaper.last(response.complete))
            if self.shaper.call.include_usage:
                await _event(send, self.shaper.usage_chunk(response.complete))


async def _event(send: Send, body: object) -> None:
    await send({"type": "http.response.body", "body": b"data: " + _JSON.encode(body) + b"\n\n", "more_body": True})


async def _collect(responses: AsyncGenerator[generation_pb2.GenerateResponse, None],
                   ) -> tuple[list[generation_pb2.Chunk], generation_pb2.Complete]:
    chunks = []
    async with contextlib.aclosing(responses) as stream:
        async for response in stream:
            if response.HasField("chunk"):
                chunks.append(response.chunk)
            elif response.HasField("complete"):
                return chunks, response.complete
    raise ApiError(500, "the answer ended without completing", code="internal", type="server_error")


async def _first(responses: AsyncGenerator[generation_pb2.GenerateResponse, None]) -> generation_pb2.GenerateResponse:
    return await responses.__anext__()


@dataclass
class HttpApi:
    """The routes, bound to one router's core, drain state and keys."""

    core: GenerationCore
    drain: RouterDrain
    settings: ApiSettings
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 16 << 20

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ])

    async def completions(self, request: Request) -> Response | EventStream:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response | EventStream:
        return await self._generate(request, "chat")

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except ApiError as exc:
            return self._error(exc, "models")
        card = self.core.model_card()
        self._count("models", 200)
        return _json({"object": "list", "data": [{"id": card.id, "object": "model", "created": 0,
                                                   "owned_by": "cedserve", "max_model_len": card.max_context_tokens}]})

    async def health(self, request: Request) -> Response:
        if self.drain.draining:
            return _json({"status": "draining"}, 503)
        return _json({"status": "ok"})

    # ------------------------------------------------------------------ generation

    async def _generate(self, request: Request, kind: Kind) -> Response | EventStream:
        endpoint = "chat_completions" if kind == "chat" else "completions"
        call: ApiCall | None = None
        try:
            self._authorize(request)
            if self.drain.draining:
                raise ApiError(503, "the router is draining: retry on another router", code="draining",
                               type="service_unavailable_error", retry_after_s=1.0)
            deadline = _deadline(request)
            call = parse(await self._body(request), kind, self.settings)
            prepared = await self.core.prepare(call.request)
        except ApiError as exc:
            return self._error(exc, endpoint)
        except RequestError as exc:
            return self._error(api_error(exc, call), endpoint)
        responses = self.core.generate(prepared, deadline)
        shaper = Shaper.of(call, self.core.codec)
        self.drain.enter()
        entered = True
        try:
            if call.stream:
                first = await _unless_gone(request.receive, _first(responses))
                entered = False  # the stream leaves the drain count when it ends
                self._count(endpoint, 200)
                return EventStream(shaper, first, responses, self.drain.leave)
            chunks, complete = await _unless_gone(request.receive, _collect(responses))
            self._count(endpoint, 200)
            return _json(shaper.whole(chunks, complete), headers={"x-request-id": call.id})
        except RequestError as exc:
            return self._error(api_error(exc, call), endpoint)
        except ApiError as exc:
            return self._error(exc, endpoint)
        except ClientGone:
            log.info("request %s: the client disconnected; cancelled", call.id)
            self._count(endpoint, 499)
            return Response(status_code=499)  # nobody reads it
        finally:
            if entered:
                self.drain.leave()

    def _authorize(self, request: Request) -> None:
        if self.api_keys and not key_matches(presented_key(list(request.headers.items())), self.api_keys):
            raise ApiError(401, "missing or invalid API key (send `Authorization: Bearer <key>`)",
                           code="invalid_api_key")

    async def _body(self, request: Request) -> object:
        """The JSON body; 413 past `max_body_bytes` (by its declared length, or while reading it)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large(int(declared))
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > self.max_body_bytes:
                raise self._too_large(size)
            parts.append(part)
        try:
            return msgspec.json.decode(b"".join(parts))
        except msgspec.DecodeError as exc:
            raise bad(None, f"the body is not valid JSON ({exc})", code="invalid_json") from None

    def _too_large(self, size: int) -> ApiError:
        return ApiError(413, f"the request body ({size} bytes or more) exceeds the {self.max_body_bytes}-byte limit",
                        code="request_too_large")

    def _error(self, exc: ApiError, endpoint: str) -> Response:
        self._count(endpoint, exc.status)
        headers = {"retry-after": str(max(1, math.ceil(exc.retry_after_s)))} if exc.retry_after_s > 0 else None
        return _json(exc.body(), exc.status, headers)

    def _count(self, endpoint: str, status: int) -> None:
        self.core.metrics.http_requests.labels(endpoint=endpoint, status=str(status)).inc()


# ---------------------------------------------------------------------------- the server


class _RouterOwnedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the router's drain the API on SIGTERM (router/server.py)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class HttpServer:
    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int
    """The bound port (the one asked for, or the free one picked for 0)."""

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"router HTTP API could not bind {host}:{port}: {exc}") from exc
    sock.set_inheritable(True)
    return sock


def _ssl_options(tls: TLSConfig) -> dict[str, Any]:
    """uvicorn's TLS settings from the public port's `[tls]` (the gRPC port's certificates)."""
    if tls.cert is None:
        return {}
    return {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key, "ssl_ca_certs": tls.ca,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_NONE}


async def start_http_server(app: Starlette, host: str, port: int, tls: TLSConfig,
                            grace_s: float = 1.0) -> HttpServer:
    """Serve `app` on `host:port` (0: any free port) in the running loop; returns once listening."""
    sock = _bind(host, port)
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", server_header=False,
                            timeout_graceful_shutdown=math.ceil(grace_s), **_ssl_options(tls))
    server = _RouterOwnedServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # raises what stopped it
            raise OSError(f"router HTTP API on {host}:{port} stopped while starting")
        await asyncio.sleep(0.01)
    return HttpServer(server, task, int(sock.getsockname()[1]))

