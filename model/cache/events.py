"""KV events: what a worker's cache holds, published so a router keeps an exact global index.

Torch-free on purpose: the router imports this module (and `hashing`) and nothing else of the cache.

Each event names blocks by their chained hash (see `hashing`) and a tier:

* `BlockStored(hashes, tier, parent_hash)`: the blocks are now servable from `tier`.
* `BlockRemoved(hashes, tier)`: they are no longer in `tier`.
* `BlockTierChanged(hashes, src, dst)`: moved: removed from `src` and stored in `dst` in one step.
* `AllBlocksCleared()`: forget everything this worker said before (starts every snapshot).

A block may sit in several tiers at once (the host tier keeps its copy when a block is onloaded),
so a consumer tracks a set of tiers per hash. Events are grouped into a `KVEventBatch` carrying
the worker id, the worker's `epoch` (one per process start) and a sequence number that grows by one
per batch. A consumer that sees a gap (or a new epoch) asks the worker to `replay` the batches after
the last one it applied; when those have left the replay buffer it asks for a snapshot, a batch that
starts with `AllBlocksCleared` and lists every block per tier. `KVIndexMirror` is that consumer,
in a few lines: the router's global index builds on it.

Wire format: msgpack through msgspec with tagged unions (`encode_batch` / `decode_batch`), never pickle.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from enum import Enum

import msgspec

EVENTS_FORMAT_VERSION = 1


class Tier(str, Enum):
    """Where a block's bytes are held."""

    DEVICE = "device"  # the block pool: HBM, or plain memory on a CPU host
    HOST = "host"  # the (pinned) host tier
    DISK = "disk"  # the persistent disk tier


class BlockStored(msgspec.Struct, tag="stored", frozen=True):
    """`block_hashes` (consecutive in one chain) are now servable from `tier`."""

    block_hashes: list[bytes]
    tier: Tier
    parent_hash: bytes | None = None
    """Hash of the block before the first one, when known (None: the chain root or not known)."""


class BlockRemoved(msgspec.Struct, tag="removed", frozen=True):
    """`block_hashes` are no longer in `tier`."""

    block_hashes: list[bytes]
    tier: Tier


class BlockTierChanged(msgspec.Struct, tag="tier_changed", frozen=True):
    """`block_hashes` moved from `src` to `dst` (removed there, stored here)."""

    block_hashes: list[bytes]
    src: Tier
    dst: Tier


class AllBlocksCleared(msgspec.Struct, tag="cleared", frozen=True):
    """Forget every block of this worker (first event of a snapshot)."""


KVEvent = BlockStored | BlockRemoved | BlockTierChanged | AllBlocksCleared


class KVEventBatch(msgspec.Struct, frozen=True):
    """One published batch. `seq` is 0, 1, 2, ... per (worker_id, epoch)."""

    worker_id: str
    seq: int
    events: list[KVEvent]
    epoch: int = 0
    """Worker incarnation (its start time in ns): a new epoch restarts `seq` and the index."""
    timestamp_s: float = 0.0
    version: int = EVENTS_FORMAT_VERSION

    @property
    def is_snapshot(self) -> bool:
        return bool(self.events) and isinstance(self.events[0], AllBlocksCleared)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """msgpack bytes of `batch`."""
    return _ENCODER.encode(batch)


def decode_batch(data: bytes) -> KVEventBatch:
    """Inverse of `encode_batch`; `msgspec.DecodeError` (a `ValueError`) on malformed or foreign bytes."""
    batch = _DECODER.decode(data)
    if batch.version != EVENTS_FORMAT_VERSION:
        raise msgspec.DecodeError(f"KV event format version {batch.version}, expected {EVENTS_FORMAT_VERSION}")
    return batch


class KVEventPublisher:
    """Collects a worker's events, stamps batches with sequence numbers, keeps recent ones for replay.

    `sink` (optional) receives every flushed batch (the transport: ZMQ, gRPC stream, a test list).
    """

    def __init__(self, worker_id: str, epoch: int | None = None, replay_batches: int = 1024,
                 sink: Callable[[KVEventBatch], None] | None = None) -> None:
        self.worker_id = worker_id
        self.epoch = time.time_ns() if epoch is None else epoch
        self._pending: list[KVEvent] = []
        self._next_seq = 0
        self._replay: deque[KVEventBatch] = deque(maxlen=replay_batches)
        self._sink = sink

    def add(self, event: KVEvent) -> None:
        """Queue one event (empty hash lists are dropped)."""
        if isinstance(event, AllBlocksCleared) or event.block_hashes:
            self._pending.append(event)

    def flush(self) -> KVEventBatch | None:
        """Publish the queued events as one batch (None when there are none)."""
        if not self._pending:
            return None
        events, self._pending = self._pending, []
        return self._publish(events)

    def snapshot(self, holdings: Iterable[tuple[Tier, list[bytes]]]) -> KVEventBatch:
        """Flush, then publish a snapshot batch: `AllBlocksCleared` and a `BlockStored` per tier."""
        self.flush()
        events: list[KVEvent] = [AllBlocksCleared()]
        events.extend(BlockStored(hashes, tier) for tier, hashes in holdings if hashes)
        return self._publish(events)

    def replay(self, after_seq: int) -> list[KVEventBatch] | None:
        """Batches with `seq > after_seq`, or None when some of them are no longer kept (take a snapshot)."""
        kept = list(self._replay)
        if after_seq + 1 >= self._next_seq:
            return []
        if not kept or kept[0].seq > after_seq + 1:
            return None
        return [b for b in kept if b.seq > after_seq]

    def _publish(self, events: list[KVEvent]) -> KVEventBatch:
        batch = KVEventBatch(self.worker_id, self._next_seq, events, epoch=self.epoch, timestamp_s=time.time())
        self._next_seq += 1
        self._replay.append(batch)
        if self._sink is not None:
            self._sink(batch)
        return batch


class KVEventGapError(Exception):
    """A batch arrived out of order: replay from `expected` or take a snapshot."""

    def __init__(self, worker_id: str, expected: int, got: int) -> None:
        self.worker_id = worker_id
        self.expected = expected
        self.got = got
        super().__init__(f"worker {worker_id!r}: expected KV event batch {expected}, got {got}; "
                         "replay from the expected seq or request a snapshot")


class KVIndexMirror:
    """Exact per-worker view of which block hashes each worker holds, in which tiers."""

    def __init__(self) -> None:
        self._tiers: dict[str, dict[bytes, set[Tier]]] = {}
        self._last: dict[str, tuple[int, int]] = {}  # worker -> (epoch, last applied seq)

    def apply(self, batch: KVEventBatch) -> None:
        """Apply one batch. Snapshots always apply; otherwise `KVEventGapError` unless `seq` is the next
        one of the same epoch. Batches already applied (duplicates) are ignored."""
        last = self._last.get(batch.worker_id)
        if not batch.is_snapshot:
            if last is None or last[0] != batch.epoch:
                raise KVEventGapError(batch.worker_id, 0, batch.seq)
            if batch.seq <= last[1]:
                return
            if batch.seq != last[1] + 1:
                raise KVEventGapError(batch.worker_id, last[1] + 1, batch.seq)
        held = self._tiers.setdefault(batch.worker_id, {})
        for event in batch.events:
            _apply_event(held, event)
        self._last[batch.worker_id] = (batch.epoch, batch.seq)

    def last_seq(self, worker_id: str) -> int | None:
        last = self._last.get(worker_id)
        return None if last is None else last[1]

    def holdings(self, worker_id: str) -> dict[bytes, frozenset[Tier]]:
        """Hash -> tiers holding it, for one worker."""
        return {h: frozenset(t) for h, t in self._tiers.get(worker_id, {}).items()}

    def cached_prefix(self, worker_id: str, block_hashes: list[bytes]) -> list[frozenset[Tier]]:
        """Tiers of the longest run of `block_hashes` the worker holds (one entry per block)."""
        held = self._tiers.get(worker_id, {})
        out: list[frozenset[Tier]] = []
        for h in block_hashes:
            tiers = held.get(h)
            if not tiers:
                break
            out.append(frozenset(tiers))
        return out


def _apply_event(held: dict[bytes, set[Tier]], event: KVEvent) -> None:
    if isinstance(event, AllBlocksCleared):
        held.clear()
        return
    for h in event.block_hashes:
        tiers = held.setdefault(h, set())
        if isinstance(event, BlockStored):
            tiers.add(event.tier)
        elif isinstance(event, BlockRemoved):
            tiers.discard(event.tier)
        else:
            tiers.discard(event.src)
            tiers.add(event.dst)
        if not tiers:
            del held[h]
