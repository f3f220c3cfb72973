"""The transfer state machine, shared by the NIXL engine and the loopback fake.

    RESERVED ──> TRANSFERRING ──> DONE
        │              │
        └──────────────┴──> FAILED | ABORTED

A transfer is RESERVED once the receiver holds blocks for it (on the sender, once it opened the
reservation), TRANSFERRING from its first chunk, and ends in exactly one terminal state. FAILED
means something broke (dead or silent peer, deadline, transfer error); ABORTED means someone asked
(a cancelled client, the peer's abort). Reaching a terminal state and *releasing the blocks* are two
steps: a side whose memory the peer may still touch waits until the peer has quiesced (or is known
dead) before it calls `on_finish`; `TransferRecord.finished` marks that second step, and `wait()`
returns only after it, so a caller who sees an error may free or reuse the blocks at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from cedserve.kv_transfer.errors import FailureCause, KVTransferError, RequestId


class TransferState(str, Enum):
    """Where one request's KV transfer stands."""

    RESERVED = "reserved"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({TransferState.DONE, TransferState.FAILED, TransferState.ABORTED})

ALLOWED_TRANSITIONS: dict[TransferState, frozenset[TransferState]] = {
    TransferState.RESERVED: frozenset({TransferState.TRANSFERRING, TransferState.DONE,
                                       TransferState.FAILED, TransferState.ABORTED}),
    TransferState.TRANSFERRING: frozenset({TransferState.DONE, TransferState.FAILED,
                                           TransferState.ABORTED}),
    TransferState.DONE: frozenset(),
    TransferState.FAILED: frozenset(),
    TransferState.ABORTED: frozenset(),
}


class Role(str, Enum):
    SENDER = "sender"
    RECEIVER = "receiver"


class IllegalTransition(RuntimeError):
    """An internal bug: the engine tried a transition the state machine forbids."""


@dataclass(frozen=True)
class TransferResult:
    """How one transfer ended, as one side saw it. Times are this process's monotonic clock."""

    request_id: RequestId
    role: Role
    peer: str
    state: TransferState
    block_ids: tuple[int, ...]
    """This side's blocks, which the transfer no longer uses once the result exists."""
    num_bytes: int
    """Bytes moved (for the sender: posted and completed; for the receiver: landed)."""
    num_descriptors: int
    """NIXL descriptors this side posted for the request (0 on the passive side)."""
    num_chunks: int
    started_s: float
    first_byte_s: float | None
    finished_s: float
    error: KVTransferError | None = None
    closed_s: float | None = None
    """When the sender's producer handed over its last blocks (`write_blocks(last=True)`); None on
    the receiver and for a transfer that never closed."""
    last_post_s: float | None = None
    """When this side began posting its last NIXL request (the initiator); None when it posted none.
    With `closed_s` and `finished_s` it splits a sender's tail into queueing, and posting to done."""
    staging_s: float = 0.0
    """Wall seconds this side spent in staging copies for the request, each with its wait: the
    sender's gathers of packed chunks, the receiver's scatters (0 when nothing was packed)."""
    last_posted_s: float | None = None
    """When the post of this side's last NIXL request returned (after `last_post_s`): the post call's
    own cost is the difference."""
    nixl_done_s: float | None = None
    """When a poll of this side first saw its last NIXL request complete; `finished_s` follows after
    the handle's release, the peer's doorbell and the transfer's bookkeeping."""
    status_polls: int = 0
    """NIXL status polls this side made of its requests while they ran: with `last_posted_s` and
    `nixl_done_s`, how often the progress loop looked (a slow loop step shows as few polls)."""

    @property
    def duration_s(self) -> float:
        """From the first chunk (or the reservation, when none came) to the end."""
        start = self.first_byte_s if self.first_byte_s is not None else self.started_s
        return max(self.finished_s - start, 0.0)

    @property
    def tail_s(self) -> float | None:
        """From the producer's last handoff to the end: the part of the transfer nothing overlapped
        (a prefill streams chunks while it computes, so `duration_s` is mostly hidden behind it)."""
        return None if self.closed_s is None else max(self.finished_s - self.closed_s, 0.0)

    @property
    def gbps(self) -> float:
        """Decimal GB/s over `duration_s` (0 when nothing moved)."""
        return self.num_bytes / self.duration_s / 1e9 if self.duration_s > 0 else 0.0

    def raise_for_state(self) -> TransferResult:
        """Return self when DONE; raise the transfer's `KVTransferError` otherwise."""
        if self.state is TransferState.DONE:
            return self
        if self.error is not None:
            raise self.error
        raise KVTransferError(self.request_id, FailureCause.INVALID, f"transfer ended {self.state.value}")


FinishCallback = Callable[[TransferResult], None]
"""Runs once per transfer with its result: on the progress thread, or on the thread of the
`write_blocks(last=True)` that saw the transfer end itself (`KVTransferConfig.caller_waits_s`). It
must not block."""


class TransferRecord:
    """One side's view of one request: state, lease, counters, and the finish handshake.

    Not thread-safe by itself: the owning engine mutates it under its own lock.
    """

    def __init__(self, request_id: RequestId, role: Role, peer: str, block_ids: tuple[int, ...],
                 deadline_s: float, on_finish: FinishCallback | None, now_s: float | None = None) -> None:
        self.request_id = request_id
        self.role = role
        self.peer = peer
        self.block_ids = block_ids
        self.deadline_s = deadline_s
        """Monotonic time after which the transfer fails with DEADLINE."""
        self.on_finish = on_finish
        self.state = TransferState.RESERVED
        self.error: KVTransferError | None = None
        self.started_s = time.monotonic() if now_s is None else now_s
        self.first_byte_s: float | None = None
        self.closed_s: float | None = None
        """See `TransferResult.closed_s`."""
        self.last_post_s: float | None = None
        """See `TransferResult.last_post_s`."""
        self.staging_s = 0.0
        """See `TransferResult.staging_s`."""
        self.last_posted_s: float | None = None
        """See `TransferResult.last_posted_s`."""
        self.nixl_done_s: float | None = None
        """See `TransferResult.nixl_done_s`."""
        self.status_polls = 0
        """See `TransferResult.status_polls`."""
        self.num_bytes = 0
        self.num_descriptors = 0
        self.num_chunks = 0
        self.finished = threading.Event()
        self.result: TransferResult | None = None

    def advance(self, new: TransferState) -> None:
        if new not in ALLOWED_TRANSITIONS[self.state]:
            raise IllegalTransition(f"request {self.request_id!r}: {self.state.value} -> {new.value}")
        self.state = new

    def start_transferring(self, now_s: float) -> None:
        if self.state is TransferState.RESERVED:
            self.advance(TransferState.TRANSFERRING)
            self.first_byte_s = now_s

    def fail(self, state: TransferState, error: KVTransferError) -> bool:
        """Move to FAILED or ABORTED with `error`; False if already terminal (first cause wins)."""
        if self.state.terminal:
            return False
        self.advance(state)
        self.error = error
        return True

    def finish(self, now_s: float) -> TransferResult:
        """Build the result and mark the record finished. The caller then runs `on_finish`."""
        assert self.state.terminal, self.state
        self.result = TransferResult(
            request_id=self.request_id, role=self.role, peer=self.peer, state=self.state,
            block_ids=self.block_ids, num_bytes=self.num_bytes, num_descriptors=self.num_descriptors,
            num_chunks=self.num_chunks, started_s=self.started_s, first_byte_s=self.first_byte_s,
            finished_s=now_s, error=self.error, closed_s=self.closed_s, last_post_s=self.last_post_s,
            staging_s=self.staging_s, last_posted_s=self.last_posted_s, nixl_done_s=self.nixl_done_s,
            status_polls=self.status_polls)
        return self.result
