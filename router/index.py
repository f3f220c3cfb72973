"""The router's global prefix index: which worker holds which prefix blocks, in which tier.

Fed by every worker's KV event stream (`cedserve.model.cache.events`). Each worker's batches carry
sequence numbers; a batch that does not follow the last applied one is refused (`apply` returns
False and the worker is marked for resync), and the caller reconnects asking the worker to replay
from the last applied sequence number, or for a snapshot when its replay buffer no longer reaches
back. The index is exact: a worker is credited only for blocks it said it stored and has not said
it removed.

Besides the per-worker mirror (which orders and checks batches), an inverted map `hash -> {worker:
tiers}` answers "how long a prefix of this prompt does every worker hold" in one walk over the
prompt's blocks, touching only workers that hold them: O(matching holders), not O(workers x blocks).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cedserve.model.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockTierChanged,
    KVEvent,
    KVEventBatch,
    KVEventGapError,
    KVIndexMirror,
    Tier,
)

TIER_ORDER: tuple[Tier, ...] = (Tier.DEVICE, Tier.HOST, Tier.DISK)
_BIT = {t: 1 << i for i, t in enumerate(TIER_ORDER)}
# Fastest tier (index into TIER_ORDER) of a non-empty tier bitmask: its lowest set bit.
_FASTEST = [0, 0, 1, 0, 2, 0, 1, 0]


@dataclass(frozen=True)
class PrefixHit:
    """Leading blocks of a prompt a worker holds: `blocks_by_tier[t]` of them are served from tier t
    (each block counted once, in its fastest tier)."""

    worker_id: str
    blocks_by_tier: dict[Tier, int]

    @property
    def total_blocks(self) -> int:
        return sum(self.blocks_by_tier.values())


def _empty(worker_id: str) -> PrefixHit:
    return PrefixHit(worker_id, {t: 0 for t in TIER_ORDER})


class GlobalPrefixIndex:
    """Exact mirror of every worker's cache, with longest-prefix queries."""

    def __init__(self) -> None:
        self._mirror = KVIndexMirror()
        self._holders: dict[bytes, dict[str, int]] = {}  # hash -> worker -> tier bitmask
        self._by_worker: dict[str, set[bytes]] = {}
        self._out_of_step: set[str] = set()

    def apply(self, batch: KVEventBatch) -> bool:
        """Apply a batch; False (and the worker marked for resync) when it does not follow the last one."""
        before = self._mirror.last_seq(batch.worker_id)
        try:
            self._mirror.apply(batch)
        except KVEventGapError:
            self._out_of_step.add(batch.worker_id)
            return False
        self._out_of_step.discard(batch.worker_id)
        if batch.is_snapshot or self._mirror.last_seq(batch.worker_id) != before:
            for event in batch.events:
                self._apply_inverted(batch.worker_id, event)
        return True

    def needs_resync(self) -> set[str]:
        return set(self._out_of_step)

    def last_seq(self, worker_id: str) -> int | None:
        return self._mirror.last_seq(worker_id)

    @property
    def num_entries(self) -> int:
        """(block hash, worker) pairs indexed."""
        return sum(len(w) for w in self._holders.values())

    def forget(self, worker_id: str) -> None:
        """Drop a worker (it left or died): no prefix credit until its next snapshot."""
        self._apply_inverted(worker_id, AllBlocksCleared())
        # The mirror has no removal API; dropping both of its maps makes the worker's next batch a
        # gap, so only a snapshot can bring it back.
        self._mirror._tiers.pop(worker_id, None)
        self._mirror._last.pop(worker_id, None)
        self._out_of_step.discard(worker_id)

    def longest_prefix(self, worker_id: str, block_hashes: Sequence[bytes]) -> PrefixHit:
        """How many leading blocks of `block_hashes` the worker holds, split by fastest tier."""
        return self.prefix_hits(block_hashes).get(worker_id) or _empty(worker_id)

    def prefix_hits(self, block_hashes: Sequence[bytes]) -> dict[str, PrefixHit]:
        """Every worker holding at least the first block, with its longest run by tier."""
        first = self._holders.get(block_hashes[0]) if block_hashes else None
        if not first:
            return {}
        counts = {w: [0, 0, 0] for w in first}
        alive = list(first)
        for h in block_hashes:
            holders = self._holders.get(h)
            if not holders:
                break
            still = []
            for w in alive:
                mask = holders.get(w)
                if mask:
                    counts[w][_FASTEST[mask]] += 1
                    still.append(w)
            if not still:
                break
            alive = still
        return {w: PrefixHit(w, dict(zip(TIER_ORDER, c))) for w, c in counts.items()}

    def best(self, workers: Iterable[str], block_hashes: Sequence[bytes]) -> PrefixHit | None:
        hits = self.prefix_hits(block_hashes)
        return max((hits.get(w) or _empty(w) for w in workers), key=lambda h: h.total_blocks, default=None)

    def _apply_inverted(self, worker_id: str, event: KVEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            for h in list(self._by_worker.get(worker_id, ())):
                self._drop(h, worker_id, None)
        elif isinstance(event, BlockStored):
            for h in event.block_hashes:
                self._add(h, worker_id, event.tier)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self._drop(h, worker_id, event.tier)
        elif isinstance(event, BlockTierChanged):
            for h in event.block_hashes:
                self._drop(h, worker_id, event.src)
                self._add(h, worker_id, event.dst)

    def _add(self, h: bytes, worker_id: str, tier: Tier) -> None:
        workers = self._holders.setdefault(h, {})
        workers[worker_id] = workers.get(worker_id, 0) | _BIT[tier]
        self._by_worker.setdefault(worker_id, set()).add(h)

    def _drop(self, h: bytes, worker_id: str, tier: Tier | None) -> None:
        workers = self._holders.get(h)
        if workers is None or worker_id not in workers:
            return
        if tier is not None:
            workers[worker_id] &= ~_BIT[tier]
        if tier is None or not workers[worker_id]:
            del workers[worker_id]
            self._by_worker.get(worker_id, set()).discard(h)
        if not workers:
            del self._holders[h]
