"""Request bytes that are not the method's message: INVALID_ARGUMENT, not an opaque UNKNOWN.

gRPC deserializes a request before the servicer runs, and a deserializer that raises ends the call
with UNKNOWN and the exception's class in the message. The public port's interceptor (router/gate.py)
wraps each unary-request method's deserializer so that undecodable bytes become an `Undecodable`
marker, and its behaviour so that the marker ends the call with INVALID_ARGUMENT naming the message
type (`undecodable_message`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Undecodable:
    reason: str


def undecodable_message(method: str, reason: str) -> str:
    return f"request: the bytes are not a valid {method} request message ({reason})"
