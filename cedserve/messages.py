"""Typed messages that cross process boundaries on the hot path, encoded with msgpack via msgspec.

Each struct is tagged so a receiver can decode a stream of mixed messages without guessing, and an
unknown or malformed message fails with a `msgspec.ValidationError` naming the field instead of
being half-read. Nothing here is pickled.
"""

from __future__ import annotations

from typing import Literal

import msgspec

WorkerRole = Literal["prefill", "decode", "colocated"]


class LoadReport(msgspec.Struct, frozen=True, tag="load", forbid_unknown_fields=True):
    """A worker's periodic report to the router; rates are measured, not configured."""

    worker_id: str
    role: WorkerRole
    seq: int
    """Per-worker sequence number; a gap tells the router it missed a report."""
    queued_tokens: int
    """Prompt tokens waiting for prefill (prefill) or replay (decode)."""
    running_requests: int
    free_blocks: int
    total_blocks: int
    tokens_per_s: float
    """Measured prefill (prefill) or decode (decode) throughput over the last window."""

    def __post_init__(self) -> None:
        if not 0 <= self.free_blocks <= self.total_blocks:
            raise ValueError(f"load report field `free_blocks`: {self.free_blocks} not in [0, {self.total_blocks}]")
        if self.queued_tokens < 0 or self.running_requests < 0 or self.tokens_per_s < 0:
            raise ValueError("load report fields `queued_tokens`, `running_requests`, `tokens_per_s` must be >= 0")


_encoder = msgspec.msgpack.Encoder()
_load_decoder = msgspec.msgpack.Decoder(LoadReport)


def encode(message: msgspec.Struct) -> bytes:
    """msgpack bytes of a message struct."""
    return _encoder.encode(message)


def decode_load_report(data: bytes) -> LoadReport:
    """Decode and validate a `LoadReport`; raises `msgspec.ValidationError` naming the bad field."""
    return _load_decoder.decode(data)
