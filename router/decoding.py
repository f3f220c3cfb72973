"""Request bytes that are not the method's message: INVALID_ARGUMENT, not an opaque UNKNOWN.

gRPC deserializes a request before the servicer runs, and a deserializer that raises ends the call
with UNKNOWN and the exception's class in the message. `DecodeErrorInterceptor` wraps each unary-
request method's deserializer so that undecodable bytes become an `Undecodable` marker, and its
behaviour so that the marker ends the call with INVALID_ARGUMENT naming the message type.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class Undecodable:
    reason: str


def _message(method: str, reason: str) -> str:
    return f"request: the bytes are not a valid {method} request message ({reason})"


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = (handler_call_details.method or "").rsplit("/", 1)[-1]
        deserialize = handler.request_deserializer

        def safe(data: bytes) -> Any:
            try:
                return deserialize(data)
            except (DecodeError, UnicodeDecodeError, ValueError) as exc:
                return Undecodable(str(exc) or type(exc).__name__)

        if handler.response_streaming:
            behaviour = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(method, request.reason))
                async for item in behaviour(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(stream, request_deserializer=safe,
                                                        response_serializer=handler.response_serializer)
        unary_behaviour = handler.unary_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(method, request.reason))
            return await unary_behaviour(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=safe,
                                                   response_serializer=handler.response_serializer)
