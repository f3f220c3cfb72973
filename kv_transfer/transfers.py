"""Per-request bookkeeping of the NIXL engine (`agent.py`): peers, chunks, in-flight requests.

Plain data; the agent mutates it under its lock. The *initiator* of a transfer is the side that
posts NIXL requests (the sender in WRITE mode, the receiver in READ mode); the other side is the
*target*, whose memory the initiator touches. A target releases its blocks only once the initiator
has quiesced (its Abort, AbortAck or DONE) or is known dead, or after `abort_drain_s`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from cedserve.kv_transfer.descriptors import DescriptorPair, RegionAddress
from cedserve.kv_transfer.nixl_backend import MemType
from cedserve.kv_transfer.protocol import Reservation, TransferMode
from cedserve.kv_transfer.state import TransferRecord, TransferState
from cedserve.proto import kv_transfer_pb2 as pb


@dataclass
class PeerState:
    """A handshaken peer agent."""

    name: str
    kv: RegionAddress
    kv_mem: MemType
    block_bytes: int
    staging_base: int
    staging_slot_bytes: int
    staging_slots: int
    staging_device: int
    staging_mem: MemType
    control_address: str
    last_seen_s: float
    alive: bool = True
    next_heartbeat_seq: int = 0
    blocks_list: int | None = None
    """Its block pool as a NIXL list prepared once (`NixlBackend.prep_blocks`); None: per-layer layout."""
    doorbell: tuple[str, int] | None = None
    """(host, UDP port) of its progress loop's doorbell (`doorbell.py`); None: an agent without one."""
    incarnation: int = 0
    """The peer process's random id (`AgentInfo.incarnation`); another one under the same name is a
    restart. 0: a peer that sends none (every handshake from it reads as a restart)."""
    link: int = 0
    """Id of this connection, the same on both sides (`HandshakeRequest.link`; crossing handshakes
    agree on the smaller one). A peer that declared it dead names it in its next handshake."""
    lost: str = ""
    """Why it was declared dead (cause: detail), once it was."""

    def staging_address(self, slot: int) -> int:
        return self.staging_base + slot * self.staging_slot_bytes


@dataclass
class Chunk:
    """Positions `[first, first + len(src))` of a request, queued on the sender (its sequence
    number is given when it is posted, after merging)."""

    first: int
    src: np.ndarray
    """Local (sender) block ids, int64."""
    dst: np.ndarray
    """Receiver block ids for the same positions, int64."""
    packed: bool | None
    """Through a staging slot; None: not decided yet (decided per NIXL request, `agent._next_chunk`)."""
    last: bool
    runs: int | None = None
    """Runs consecutive on both sides (`count_runs`), once counted for the packing decision: the post
    reuses it instead of counting the ids again."""


@dataclass
class Inflight:
    """One posted NIXL request (or, on a READ sender, one announced chunk awaiting consumption)."""

    seq: int
    nbytes: int
    descriptors: int
    handle: Any = None
    local_slot: int | None = None
    scatter_ids: np.ndarray | None = None
    """READ receiver, packed: blocks to scatter the local slot into once the READ is done."""


Reply = Literal["abort", "ack"]


@dataclass
class PostJob:
    """A NIXL request prepared under the agent lock and posted outside it (see `agent._step`): either
    descriptor lists (`descs`), or block indices into the two prepared block lists (`blocks`: local
    ids, peer ids), which NIXL merges into one descriptor per run."""

    transfer: Transfer
    seq: int
    op: Literal["WRITE", "READ"]
    descs: DescriptorPair | None
    remote_mem: MemType
    notif: bytes
    nbytes: int
    local_slot: int | None
    scatter_ids: np.ndarray | None
    blocks: tuple[np.ndarray, np.ndarray] | None = None
    blocks_lists: tuple[int, int] = (0, 0)
    """Our prepared block list and the peer's, as they were when the job was made (a peer that
    handshakes again gets a new list; a post naming the released one fails)."""
    descriptors: int | None = 0
    """Descriptors the request moves (after merging runs); None: not counted yet (block indices are
    counted once posted, `LocalMemory.descriptors`, so the count does not delay the post)."""
    posted_s: float = 0.0
    """When its post began (monotonic; set by the posting thread)."""
    returned_s: float = 0.0
    """When its post returned."""


@dataclass
class Transfer:
    record: TransferRecord
    mode: TransferMode
    initiator: bool
    dst_ids: np.ndarray
    """The reservation's (receiver) block ids, in request order."""
    inflight: dict[int, Inflight] = field(default_factory=dict)
    reply: Reply | None = None
    """What the initiator tells the peer once quiesced, after a failure."""
    peer_quiesced: bool = False
    drain_until_s: float | None = None
    finalized: bool = False
    posting: int = 0
    """Requests being handed to NIXL outside the lock right now."""

    @property
    def request_id(self) -> str:
        return self.record.request_id

    def has_local_work(self) -> bool:
        """Whether this side should poll fast: NIXL requests of ours in flight, chunks waiting to be
        posted, or the peer moving bytes that our UCX worker must progress (on transports that
        emulate RDMA with active messages, TCP and shared memory, the target's worker serves them)."""
        return self.posting > 0 or bool(self.inflight)

    @property
    def peer(self) -> str:
        return self.record.peer


@dataclass
class SendTransfer(Transfer):
    reservation: Reservation | None = None
    next_pos: int = 0
    next_seq: int = 0
    queue: deque[Chunk] = field(default_factory=deque)
    credits: deque[int] = field(default_factory=deque)
    """Receiver staging slots this sender may open now (packed WRITE)."""
    open_slot: int = -1
    """The receiver slot packed chunks are appended to (-1: none open); a chunk that does not fit in
    what is left of it opens the next credit."""
    open_fill: int = 0
    """Rows of `open_slot` in use: the next chunk starts there (back to 0 once all are scattered)."""
    slot_chunks: dict[int, int] = field(default_factory=dict)
    """Receiver slot -> packed chunks written into it whose `SlotFree` has not come back."""
    written: list[np.ndarray] = field(default_factory=list)
    """Local block ids of every `write_blocks` call (the result's `block_ids`, joined at the end)."""
    closed: bool = False
    """The chunk with `last` is queued."""

    def has_local_work(self) -> bool:
        return bool(self.queue) or super().has_local_work()

    def join_written(self) -> None:
        """Set the record's `block_ids` from the `write_blocks` calls so far (once: a 2,048-block
        tuple costs tens of us, paid once the last request is posted rather than after it is done)."""
        if self.written:
            self.record.block_ids = tuple(np.concatenate(self.written).tolist())
            self.written.clear()


@dataclass
class RecvTransfer(Transfer):
    granted_slots: tuple[int, ...] = ()
    seen: set[int] = field(default_factory=set)
    blocks_landed: int = 0
    total_chunks: int | None = None
    reads: deque[pb.ChunkReady] = field(default_factory=deque)
    """READ mode: announced chunks not yet read."""
    posted: set[int] = field(default_factory=set)
    """WRITE: chunks the sender announced posted (`ChunkPosted`) whose `ChunkDone` has not arrived."""
    announcing: bool = False
    """The sender announces its posts: poll short only while one is outstanding (`has_local_work`)."""

    def has_local_work(self) -> bool:
        """WRITE: poll short while a posted request's bytes are landing. With a sender that announces
        its posts that is exactly while one is outstanding, so between requests (a host-memory post
        copies synchronously for tens of ms before its notice goes out) the loop sleeps long; without
        announcements, from the first chunk to the end."""
        if self.mode is TransferMode.WRITE and not self.record.state.terminal:
            moving = bool(self.posted) if self.announcing else self.record.state is TransferState.TRANSFERRING
            if moving:
                return True
        return bool(self.reads) or super().has_local_work()

    def complete(self) -> bool:
        return (self.total_chunks is not None and len(self.seen) == self.total_chunks
                and not self.reads and not self.inflight and self.blocks_landed == self.dst_ids.shape[0])
