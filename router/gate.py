"""The public gRPC port's one server interceptor: API keys, drain, undecodable requests.

Each call passes, in this order (each step as the three interceptors before session h-relay3 did it):

1. API keys (router/auth.py): with keys configured, a call to a method outside `auth.OPEN_PREFIXES`
   that presents no matching key ends with UNAUTHENTICATED;
2. drain (router/lifecycle.py): a new `Generate` while the router drains ends with UNAVAILABLE;
   the open ones are counted (`RouterDrain.enter` / `leave`) until their stream ends;
3. undecodable bytes (router/decoding.py): a unary-request method's request that does not parse
   ends with INVALID_ARGUMENT naming the message type, not gRPC's opaque UNKNOWN.

Why one interceptor: gRPC runs each interceptor's `intercept_service` per call, and each of the
three built new handlers per call, so a `Generate` response passed two async generators of theirs
on its way out. Here every method's handlers (the allowed one and the refusal) are built once, on
its first call, and a `Generate` response passes one generator.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from cedserve.router.auth import OPEN_PREFIXES, UNAUTHENTICATED_MESSAGE, key_matches, presented_key
from cedserve.router.decoding import Undecodable, undecodable_message
from cedserve.router.lifecycle import DRAINING_MESSAGE, GENERATE_METHOD, RouterDrain

_Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


@dataclass(frozen=True)
class _MethodHandlers:
    allowed: grpc.RpcMethodHandler
    """The servicer's handler behind the drain and decode checks."""
    refused: grpc.RpcMethodHandler
    """Ends every call with UNAUTHENTICATED (a call without a matching key)."""


class PublicInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """The checks above, for a server whose handlers are all added before it starts (a method's
    handlers are kept from its first call on)."""

    def __init__(self, keys: Sequence[str], drain: RouterDrain) -> None:
        self._keys = tuple(keys)
        self._drain = drain
        self._methods: dict[str, _MethodHandlers] = {}

    async def intercept_service(self, continuation: _Continuation,
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        handlers = self._methods.get(method)
        if handlers is None:
            handler = await continuation(handler_call_details)
            if handler is None:  # no such method: gRPC answers UNIMPLEMENTED
                return None
            handlers = self._methods[method] = _wrap(method, handler, self._drain)
        if not self._keys or method.startswith(OPEN_PREFIXES):
            return handlers.allowed
        if key_matches(presented_key(handler_call_details.invocation_metadata or ()), self._keys):
            return handlers.allowed
        return handlers.refused


def _wrap(method: str, handler: grpc.RpcMethodHandler, drain: RouterDrain) -> _MethodHandlers:
    """The allowed and refused handlers of one method (request-streaming ones, which no public
    method is, keep their own deserializer and behaviour)."""
    if handler.request_streaming or handler.request_deserializer is None:
        return _MethodHandlers(handler, _refusal(handler, handler.request_deserializer))
    name = method.rsplit("/", 1)[-1]
    deserialize = handler.request_deserializer

    def safe(data: bytes) -> Any:
        try:
            return deserialize(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as exc:
            return Undecodable(str(exc) or type(exc).__name__)

    if not handler.response_streaming:
        allowed = grpc.unary_unary_rpc_method_handler(_checked_unary(name, handler.unary_unary),
                                                      request_deserializer=safe,
                                                      response_serializer=handler.response_serializer)
    elif method == GENERATE_METHOD:
        allowed = grpc.unary_stream_rpc_method_handler(_drained_stream(name, handler.unary_stream, drain),
                                                       request_deserializer=safe,
                                                       response_serializer=handler.response_serializer)
    else:
        allowed = grpc.unary_stream_rpc_method_handler(_checked_stream(name, handler.unary_stream),
                                                       request_deserializer=safe,
                                                       response_serializer=handler.response_serializer)
    return _MethodHandlers(allowed, _refusal(handler, safe))


def _checked_unary(name: str, behaviour: Any) -> Any:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, undecodable_message(name, request.reason))
        return await behaviour(request, context)

    return unary


def _checked_stream(name: str, behaviour: Any) -> Any:
    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, undecodable_message(name, request.reason))
        async for item in behaviour(request, context):
            yield item

    return stream


def _drained_stream(name: str, behaviour: Any, drain: RouterDrain) -> Any:
    """`Generate`: refused while draining (before its bytes are judged, as before), counted while open."""
    async def generate(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if drain.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
        drain.enter()
        try:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, undecodable_message(name, request.reason))
            async for item in behaviour(request, context):
                yield item
        finally:
            drain.leave()

    return generate


def _refusal(handler: grpc.RpcMethodHandler, deserializer: Any) -> grpc.RpcMethodHandler:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        yield  # pragma: no cover - makes this an async generator

    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=deserializer,
                                                    response_serializer=handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=deserializer,
                                               response_serializer=handler.response_serializer)
