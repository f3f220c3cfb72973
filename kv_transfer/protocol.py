"""The transfer contract: what a sender and a receiver promise, whichever backend implements them.

`NixlTransferAgent` (real, `agent.py`) and `LoopbackAgent` (fake, `loopback.py`) both satisfy
`TransferEndpoint`; mypy checks the fake against these Protocols, and the contract tests in
tests/unit/test_transfer_contract.py run the same scenarios against both.

Decode-first lifecycle of one request:

1. receiver: `reserve(request_id, block_ids, sender=...)` -> `Reservation` (a lease, RESERVED);
   the router carries the reservation (as `cedserve.v1.Reservation`) to the sender.
2. sender: `open(reservation, on_finish=...)` (RESERVED), then `write_blocks(...)` once per finished
   prefill chunk, the last with `last=True` (TRANSFERRING); the bytes move while prefill continues.
3. both: `wait(request_id, timeout_s)` -> `TransferResult` once DONE, or `KVTransferError` naming the
   request and the cause. `on_finish(result)` runs exactly once per side, after which the transfer
   no longer touches the side's blocks: the owner frees them (the sender always; the receiver
   unless the state is DONE, when they now hold the request's KV).
4. `abort(request_id)` on either side (a cancelled client) ends both sides with ABORTED.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import numpy as np

from cedserve.kv_transfer.errors import FailureCause, RequestId
from cedserve.kv_transfer.state import FinishCallback, TransferResult, TransferState

BlockIds = Sequence[int] | np.ndarray


class TransferMode(str, Enum):
    WRITE = "write"
    """The sender WRITEs into the receiver's reserved blocks (decode-first default)."""
    READ = "read"
    """The sender announces ready blocks; the receiver READs them."""


@dataclass(frozen=True)
class Reservation:
    """Blocks a receiver holds for one request; position i receives the request's i-th block."""

    request_id: RequestId
    receiver: str
    """The receiver's agent name."""
    sender: str
    """The only agent allowed to fill it."""
    block_ids: tuple[int, ...]
    mode: TransferMode
    staging_slots: tuple[int, ...] = ()
    """Receiver staging slots granted for packed WRITEs (the sender's credits); may be empty."""
    lease_s: float = 30.0
    compat_hash: str = ""

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class KVSender(Protocol):
    """Prefill side of a transfer. Methods are thread-safe; completion is asynchronous."""

    @property
    def agent_name(self) -> str: ...

    def open(self, reservation: Reservation, *, timeout_s: float | None = None,
             on_finish: FinishCallback | None = None) -> None:
        """Start a transfer into `reservation` (RESERVED). `timeout_s` (default: the reservation's
        lease) bounds it. Raises `ValueError` for a reservation of another model layout or a peer
        never handshaken, `KVTransferError` if the request id is already open, or PEER_DISCONNECTED
        (retryable) when the receiver was declared dead and not handshaken again since."""
        ...

    def write_blocks(self, request_id: RequestId, local_block_ids: BlockIds, *, last: bool = False) -> None:
        """Queue local blocks for the next positions of the reservation and return at once; the bytes
        move in chunks while the caller continues. `last=True` closes the request once every
        reserved position is covered. The blocks must hold their final bytes (on CUDA: the
        producing stream synchronised). Raises `KVTransferError` if the transfer already ended,
        `ValueError` for ids outside the pool or more blocks than reserved."""
        ...

    def wait(self, request_id: RequestId, timeout_s: float) -> TransferResult:
        """Block until the transfer ended and its blocks are released. DONE -> the result; FAILED or
        ABORTED -> `KVTransferError`; still running after `timeout_s` -> `TimeoutError`."""
        ...

    def state(self, request_id: RequestId) -> TransferState:
        """Current state; `KeyError` for a request never opened (or long forgotten)."""
        ...

    def abort(self, request_id: RequestId, cause: FailureCause = FailureCause.CANCELLED,
              detail: str = "") -> bool:
        """End the transfer as ABORTED on both sides; False if it is unknown or already ended."""
        ...


class KVReceiver(Protocol):
    """Decode side of a transfer."""

    @property
    def agent_name(self) -> str: ...

    def reserve(self, request_id: RequestId, block_ids: BlockIds, *, sender: str,
                mode: TransferMode | None = None, lease_s: float | None = None,
                on_finish: FinishCallback | None = None) -> Reservation:
        """Hold `block_ids` (already allocated by the caller) for `sender` (RESERVED) and return the
        reservation to hand to it. The lease ends the transfer with DEADLINE when it runs out.
        Raises `ValueError` for ids outside the pool or a sender never handshaken, `KVTransferError`
        PEER_DISCONNECTED (retryable) for a sender declared dead and not handshaken again since."""
        ...

    def wait(self, request_id: RequestId, timeout_s: float) -> TransferResult:
        """As `KVSender.wait`: DONE means every reserved block holds the sender's bytes."""
        ...

    def state(self, request_id: RequestId) -> TransferState: ...

    def abort(self, request_id: RequestId, cause: FailureCause = FailureCause.CANCELLED,
              detail: str = "") -> bool: ...


class TransferEndpoint(Protocol):
    """One worker's transfer agent: its identity, its two roles, and its lifetime."""

    @property
    def name(self) -> str: ...

    def handshake(self, address: str, timeout_s: float = 5.0) -> str:
        """Connect to the peer at `address` (its control address; for the fake, its name), check
        protocol version and compatibility hash both ways, and return the peer's agent name.
        Raises `CompatibilityError` naming both values, or `HandshakeError`. Idempotent: calls
        racing for one peer share one exchange, and a handshake with a live peer of the same
        incarnation keeps its connection and transfers; a restarted peer (a new incarnation)
        fails the old one's transfers (PEER_DISCONNECTED)."""
        ...

    def sender(self) -> KVSender: ...

    def receiver(self) -> KVReceiver: ...

    def abort(self, request_id: RequestId, cause: FailureCause = FailureCause.CANCELLED,
              detail: str = "") -> bool:
        """Abort a transfer in whichever role holds it (the control plane's Abort lands here)."""
        ...

    def active_transfers(self) -> int: ...

    def close(self) -> None:
        """Abort every transfer (SHUTDOWN), release their blocks, and drop the agent."""
        ...
