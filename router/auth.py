"""API-key authentication for the public ports: a server interceptor on gRPC call metadata, and the
same check on the HTTP API's headers (router/http_api.py).

Keys arrive as `authorization: Bearer <key>` or `x-api-key: <key>` and are compared in constant
time against every configured key. With no keys configured the port is open (the embedded default
on loopback). Health checks and reflection stay open so probes work without a key, and so do
the loopback-only control services (Drain, WorkerRegistry).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

# Lifecycle (Drain) and WorkerRegistry accept loopback peers only (router/lifecycle.py): the preStop
# hook and the Ray router actor call them without a key.
_OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.", "/cedserve.v1.Lifecycle/", "/cedserve.v1.WorkerRegistry/")


def presented_key(metadata: Sequence[tuple[str, str | bytes]]) -> str | None:
    """The key in gRPC metadata or HTTP headers (lower-case names); None when none is sent."""
    for key, value in metadata:
        text = value.decode() if isinstance(value, bytes) else value
        if key == "x-api-key":
            return text
        if key == "authorization" and text.lower().startswith("bearer "):
            return text[7:].strip()
    return None


def key_matches(presented: str | None, keys: Sequence[str]) -> bool:
    if presented is None:
        return False
    # Compare against every key, without an early exit, so timing does not reveal which matched.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented.encode(), key.encode())
    return matched


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = tuple(keys)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        if not self._keys or method.startswith(_OPEN_PREFIXES):
            return await continuation(handler_call_details)
        if key_matches(presented_key(handler_call_details.invocation_metadata or ()), self._keys):
            return await continuation(handler_call_details)
        return _deny(await continuation(handler_call_details))


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key "
                            "(send `authorization: Bearer <key>` or `x-api-key`)")

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key "
                            "(send `authorization: Bearer <key>` or `x-api-key`)")
        yield  # pragma: no cover - makes this an async generator

    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(
        unary, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
