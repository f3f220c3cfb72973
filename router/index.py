"""The router's global prefix index: which worker holds which prefix blocks, in which tier.

Fed by every worker's KV event stream (`cedserve.model.cache.events`). Each worker's batches carry
sequence numbers; a gap raises `KVEventGapError`, and the caller resynchronises by asking the
worker to replay from the last applied sequence number, or for a snapshot when the replay buffer no
longer holds it (`needs_resync` tells which workers are out of step). The index is exact: a worker
is credited only for blocks it said it stored and has not said it removed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cedserve.model.cache.events import KVEventBatch, KVEventGapError, KVIndexMirror, Tier

TIER_ORDER: tuple[Tier, ...] = (Tier.DEVICE, Tier.HOST, Tier.DISK)


@dataclass(frozen=True)
class PrefixHit:
    """Leading blocks of a prompt a worker holds: `blocks_by_tier[t]` blocks are served from tier t
    (each block counted once, in its fastest tier)."""

    worker_id: str
    blocks_by_tier: dict[Tier, int]

    @property
    def total_blocks(self) -> int:
        return sum(self.blocks_by_tier.values())


class GlobalPrefixIndex:
    """Exact mirror of every worker's cache, with longest-prefix queries."""

    def __init__(self) -> None:
        self._mirror = KVIndexMirror()
        self._out_of_step: set[str] = set()

    def apply(self, batch: KVEventBatch) -> bool:
        """Apply a batch; False (and the worker marked for resync) when it does not follow the last one."""
        try:
            self._mirror.apply(batch)
        except KVEventGapError:
            self._out_of_step.add(batch.worker_id)
            return False
        self._out_of_step.discard(batch.worker_id)
        return True

    def needs_resync(self) -> set[str]:
        return set(self._out_of_step)

    def last_seq(self, worker_id: str) -> int | None:
        return self._mirror.last_seq(worker_id)

    def forget(self, worker_id: str) -> None:
        """Drop a worker (it left or died): it gets no prefix credit until its next snapshot."""
        _forget(self._mirror, worker_id)
        self._out_of_step.discard(worker_id)

    def longest_prefix(self, worker_id: str, block_hashes: Sequence[bytes]) -> PrefixHit:
        """How many leading blocks of `block_hashes` the worker holds, split by fastest tier."""
        holdings = self._mirror.holdings(worker_id)
        counts = {t: 0 for t in TIER_ORDER}
        for h in block_hashes:
            tiers = holdings.get(h)
            if not tiers:
                break
            counts[next(t for t in TIER_ORDER if t in tiers)] += 1
        return PrefixHit(worker_id, counts)

    def best(self, workers: Iterable[str], block_hashes: Sequence[bytes]) -> PrefixHit | None:
        hits = [self.longest_prefix(w, block_hashes) for w in workers]
        return max(hits, key=lambda h: h.total_blocks, default=None)


def _forget(mirror: KVIndexMirror, worker_id: str) -> None:
    # The mirror has no removal API of its own; dropping both maps makes the next batch of this
    # worker a gap, so only a snapshot can bring it back.
    mirror._tiers.pop(worker_id, None)
    mirror._last.pop(worker_id, None)
