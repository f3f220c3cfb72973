"""Pieces of the link probe that both workers and the bench client share.

The link probe measures the real KV link between two running workers (`ProbeLink` on the prefill
worker, `CheckProbe` on the decode worker, proto/worker.proto; the client is
`cedserve bench kv-transfer --prefill-address --decode-address`, `link_bench.py`). Both RPCs make a
worker allocate blocks and move bytes, so they require the workers' KV-transfer token
(`[kv_transfer] auth_token`, the chart's `<fullname>-kv-transfer` Secret) in `x-cedserve-token`
metadata, compared in constant time; the internal TLS of the listener applies as to every call.

The bytes: `pattern(seed, n)` is a pseudo-random byte string, a fresh seed per probe, so a block
left over from an earlier probe or a zero block never passes; `digest` is SHA-256 over the blocks in
reservation order.
"""

from __future__ import annotations

import hashlib
import hmac

import grpc
import numpy as np

from cedserve.common.credentials import TOKEN_METADATA_KEY

DEFAULT_TIMEOUT_S = 60.0
"""A probe whose request gives no timeout."""


def check_token(context: grpc.ServicerContext, expected: str, what: str) -> None:
    """Abort the call UNAUTHENTICATED unless it carries `expected` (never accepted when empty)."""
    given = next((str(v) for k, v in context.invocation_metadata() if k == TOKEN_METADATA_KEY), "")
    if not expected or not hmac.compare_digest(given.encode(), expected.encode()):
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      f"{what} needs the workers' KV-transfer token in `{TOKEN_METADATA_KEY}` metadata"
                      + (" (the one given does not match)" if given else " (none given)"))


def pattern(seed: int, num_bytes: int) -> np.ndarray:
    """`uint8 [num_bytes]`, pseudo-random from `seed` (PCG64), writable. Only the sender generates it;
    the receiver compares digests, so nothing depends on two machines generating the same bytes."""
    return np.random.Generator(np.random.PCG64(seed)).integers(0, 256, num_bytes, dtype=np.uint8)


def digest(data: np.ndarray) -> str:
    """SHA-256 hex of a flat `uint8` array."""
    return hashlib.sha256(np.ascontiguousarray(data).data).hexdigest()
