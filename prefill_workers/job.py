"""`PrefillJob`: one request's progress through the engine, and the events it streams back.

Phases: WAITING (queued, no blocks) -> RUNNING (blocks, a sequence state, chunks computing; blocks
streaming to the decode worker) -> CLOSING (first token sent, transfer's last chunk queued) ->
ENDED (done or failed; the blocks are freed once the transfer layer has released them).
Fields are written by the engine thread only; the gRPC handler reads `events`.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from enum import Enum

from cedserve.kv_transfer.state import TransferResult
from cedserve.model.network import BoundaryHidden
from cedserve.model.state import SequenceState
from cedserve.prefill_workers.validation import PrefillSpec
from cedserve.proto import worker_pb2 as wpb


class Phase(str, Enum):
    WAITING = "waiting"
    RUNNING = "running"
    CLOSING = "closing"
    ENDED = "ended"


@dataclass(frozen=True)
class PrefillFailure:
    """A job's end by `error` (a domain error, or any exception): the service layer turns it into
    the wire's `ErrorDetail` (`cedserve.serving.errors.error_detail`); the engine never does."""

    error: BaseException


@dataclass(eq=False)
class PrefillJob:
    spec: PrefillSpec
    events: queue.Queue[wpb.PrefillEvent | PrefillFailure] = field(default_factory=queue.Queue)
    arrived_s: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.WAITING
    admitted: bool = False
    """Holds a block table in the cache manager (freed by the engine's `_release`)."""
    block_ids: list[int] = field(default_factory=list)
    shared_tokens: int = 0
    """Prompt tokens whose records sit in shared prefix-cache blocks: never rewritten."""
    cached_tokens: int = 0
    """Prompt tokens not recomputed (<= shared_tokens: the decoder replay span may need a few more)."""
    computed_tokens: int = 0
    replayed_tokens: int = 0
    state: SequenceState | None = None
    """The sequence's state; while it is in a prefill-runner slot (`runner_slot`) that slot holds
    the newer one, and `state` comes back from it after the last chunk."""
    runner_slot: int | None = None
    """The prefill runner's slot holding this sequence while its chunks run there."""
    eager: bool = False
    """Its chunks run through `encode_chunk` (no runner, or no free slot at its first chunk)."""
    boundary: BoundaryHidden | None = None
    """Boundary states of the last computed tokens, at most the replay span."""
    next_block: int = 0
    """Next prompt block to hand to the transfer (blocks before it are queued or held by decode)."""
    state_blocks: list[int] = field(default_factory=list)
    """Scratch blocks holding the shipped bounded state (freed with the request's blocks)."""
    state_bytes: int = 0
    transfer_open: bool = False
    transfer: TransferResult | None = None
    first_token: wpb.FirstToken | None = None
    first_token_s: float = 0.0
    compute_s: float = 0.0

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def transfer_id(self) -> str | None:
        """The transfer's request id: the reservation's (the lease id), not the prefill request id."""
        return self.spec.target.reservation.request_id if self.spec.target is not None else None

    @property
    def transfer_pending(self) -> bool:
        """The transfer layer may still read this job's blocks."""
        return self.transfer_open and self.transfer is None

    @property
    def uncomputed_tokens(self) -> int:
        if self.phase in (Phase.CLOSING, Phase.ENDED):
            return 0
        return self.spec.prompt_len - self.cached_tokens - self.computed_tokens

    def emit(self, event: wpb.PrefillEvent | PrefillFailure) -> None:
        self.events.put(event)
