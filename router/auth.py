"""API-key authentication for the public ports: the check on gRPC call metadata (applied by
router/gate.py's interceptor) and on the HTTP API's headers (router/http_api.py).

Keys arrive as `authorization: Bearer <key>` or `x-api-key: <key>` and are compared in constant
time against every configured key. With no keys configured the port is open (the embedded default
on loopback). Health checks and reflection stay open so probes work without a key, and so do
the loopback-only control services (Drain, WorkerRegistry).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

# Lifecycle (Drain) and WorkerRegistry accept loopback peers only (router/lifecycle.py): the preStop
# hook and the Ray router actor call them without a key.
OPEN_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.", "/cedserve.v1.Lifecycle/", "/cedserve.v1.WorkerRegistry/")


def presented_key(metadata: Sequence[tuple[str, str | bytes]]) -> str | None:
    """The key in gRPC metadata or HTTP headers (lower-case names); None when none is sent."""
    for key, value in metadata:
        text = value.decode() if isinstance(value, bytes) else value
        if key == "x-api-key":
            return text
        if key == "authorization" and text.lower().startswith("bearer "):
            return text[7:].strip()
    return None


UNAUTHENTICATED_MESSAGE = "missing or invalid API key (send `authorization: Bearer <key>` or `x-api-key`)"


def key_matches(presented: str | None, keys: Sequence[str]) -> bool:
    if presented is None:
        return False
    # Compare against every key, without an early exit, so timing does not reveal which matched.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented.encode(), key.encode())
    return matched
