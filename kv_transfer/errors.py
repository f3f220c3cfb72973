"""Typed errors of the transfer layer. Every one names the request (when there is one) and its cause."""

from __future__ import annotations

from enum import Enum

RequestId = str


class FailureCause(str, Enum):
    """Why a transfer ended without its bytes in place (mirrors `cedserve.v1.FailureCause`)."""

    CANCELLED = "cancelled"
    """The client or the router cancelled the request."""
    DEADLINE = "deadline"
    """The lease or the transfer deadline passed."""
    PEER_DISCONNECTED = "peer_disconnected"
    """NIXL/UCX reported the peer's endpoint gone (a killed process, a closed connection)."""
    PEER_SILENT = "peer_silent"
    """No heartbeat from the peer within `peer_timeout_s` (a hung process, a dead link)."""
    TRANSFER_ERROR = "transfer_error"
    """A NIXL transfer request ended in error."""
    PEER_ABORTED = "peer_aborted"
    """The peer aborted the transfer and said so."""
    INVALID = "invalid"
    """A request named blocks, slots or requests that do not exist."""
    SHUTDOWN = "shutdown"
    """The local agent is closing."""


class KVTransferError(RuntimeError):
    """A transfer failed or was aborted. `request_id` and `cause` say which and why.

    `fallback` is the configured fallback the caller may now take ("recompute"), or None when the
    configuration says to fail; a fallback taken is counted in the metrics, never silent.
    """

    def __init__(self, request_id: RequestId, cause: FailureCause, detail: str = "",
                 *, fallback: str | None = None) -> None:
        self.request_id = request_id
        self.cause = cause
        self.detail = detail
        self.fallback = fallback
        text = f"KV transfer of request {request_id!r} failed: {cause.value}"
        if detail:
            text += f" ({detail})"
        if fallback:
            text += f"; configured fallback: {fallback}"
        super().__init__(text)


class CompatibilityError(ValueError):
    """The peers disagree on protocol version or on the KV layout; both values are in the message."""

    def __init__(self, what: str, local: str, peer: str, peer_name: str) -> None:
        self.what = what
        self.local = local
        self.peer = peer
        self.peer_name = peer_name
        super().__init__(f"KV transfer handshake with {peer_name!r}: {what} mismatch: "
                         f"local {local} vs peer {peer}")


class HandshakeError(ConnectionError):
    """The control-plane handshake could not be completed (unreachable, unauthenticated, refused)."""


class NixlUnavailableError(ImportError):
    """NIXL is not installed: install the `nixl` extra (`pip install 'cedserve[nixl]'`, or nixl-cu13)."""
