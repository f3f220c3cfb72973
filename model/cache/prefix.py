"""The device prefix cache: block hash <-> pool block, and LRU eviction of unreferenced blocks.

A block enters the cache when a request has computed all of its tokens (`insert`). Requests that
share a prefix then share its blocks with no copy: the cache manager `incref`s them. When the last
request lets go of a cached block it stays allocated but idle, and becomes an eviction candidate.
Eviction takes idle blocks only, least recently released first; a request's blocks are stamped
back to front on release, so a chain loses its tail before its head and the longest-prefix lookup
keeps hitting as much as possible.

Metadata per pool block: the 32-byte hash, a cached flag and an int64 stamp (numpy arrays), plus one
dict entry hash -> block id per cached block. Releases are also queued in stamp order (block, stamp),
so eviction reads the oldest entries from the queue's head instead of sorting every idle cached
block of the pool (at ~1M blocks that pass took milliseconds per admission under a full cache); an
entry is current while its block is cached, idle and still carries that stamp, and stale ones are
dropped at the head or when the queue outgrows the evictable blocks.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from cedserve.model.cache.block_pool import BlockIds, BlockPool, IntArray, as_block_ids
from cedserve.model.cache.hashing import HASH_BYTES, TokenIds, hash_blocks

QUEUE_MIN = 1024
"""Entries the release queue starts with, and the stale entries it tolerates beyond twice the
evictable blocks before a re-layout keeps only the current ones."""


class PrefixCache:
    """Maps chained block hashes to device blocks of `pool`. Mutates only its own maps; never
    changes refcounts (the manager does that) and never frees blocks (it names victims)."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._block_of: dict[bytes, int] = {}
        self._hashes = np.zeros((pool.num_blocks, HASH_BYTES), dtype=np.uint8)
        self._cached = np.zeros(pool.num_blocks, dtype=np.bool_)
        self._stamp = np.zeros(pool.num_blocks, dtype=np.int64)
        self._clock = 0
        self._queue = np.zeros((2, QUEUE_MIN), dtype=np.int64)  # rows: block ids, their stamps, in stamp order
        self._queue_head = 0  # entries before it were dropped
        self._queue_len = 0

    def block_hashes(self, token_ids: TokenIds, salt: str = "") -> list[bytes]:
        """Chained sha256 hashes of the whole blocks of `token_ids` for tenant `salt` (see `hashing`)."""
        return hash_blocks(token_ids, salt, self.block_size)

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self._block_of)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._block_of

    def get(self, block_hash: bytes) -> int | None:
        """The block holding `block_hash`, or None."""
        return self._block_of.get(block_hash)

    def lookup(self, block_hashes: list[bytes]) -> list[int]:
        """Blocks of the longest cached run from the start of `block_hashes` (no refcount change)."""
        out: list[int] = []
        for h in block_hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def hash_of(self, block_id: int) -> bytes | None:
        return self._hashes[block_id].tobytes() if self._cached[block_id] else None

    def cached_mask(self, block_ids: BlockIds) -> npt.NDArray[np.bool_]:
        return self._cached[as_block_ids(block_ids)].copy()

    def hashes(self) -> list[bytes]:
        """Every cached hash (for snapshots)."""
        return list(self._block_of)

    def num_evictable(self) -> int:
        """Cached blocks that nobody references."""
        # every tick asks (the load report, the scheduler's budget): the pool counts the cached blocks
        # as they go idle and back (`BlockPool.track`), no pass over the pool
        return self.pool.num_idle_tracked

    def metadata_bytes(self) -> int:
        """Bytes of the per-block arrays (the dict is measured separately)."""
        return int(self._hashes.nbytes + self._cached.nbytes + self._stamp.nbytes)

    # ------------------------------------------------------------------ updates

    def insert(self, block_ids: BlockIds, block_hashes: list[bytes]) -> npt.NDArray[np.bool_]:
        """Cache `block_ids[i]` under `block_hashes[i]`. Skips a hash already cached (another request
        computed the same block) and a block already cached; returns the mask of inserted ones."""
        ids = as_block_ids(block_ids)
        if ids.size != len(block_hashes):
            raise ValueError(f"{ids.size} blocks for {len(block_hashes)} hashes")
        inserted = ~self._cached[ids]
        for i in np.flatnonzero(inserted).tolist():
            h = block_hashes[i]
            if h in self._block_of:
                inserted[i] = False
            else:
                self._block_of[h] = int(ids[i])
        new = ids[inserted]
        rows = b"".join(h for h, keep in zip(block_hashes, inserted.tolist()) if keep)
        self._hashes[new] = np.frombuffer(rows, dtype=np.uint8).reshape(-1, HASH_BYTES)
        self._cached[new] = True
        self.pool.track(new, True)
        idle = new[self.pool.idle(new)]
        if idle.size:  # cached while nobody holds it: an eviction candidate from now, as if just released
            self.touch_released(idle[::-1])
        return inserted

    def touch_released(self, block_ids: BlockIds) -> None:
        """Stamp blocks a request just released, given in its block-table order: the last block gets
        the oldest stamp, so eviction trims chains from the tail."""
        ids = as_block_ids(block_ids)[::-1]
        stamps = self._clock + np.arange(ids.size, dtype=np.int64)
        self._stamp[ids] = stamps
        self._clock += int(ids.size)
        self._enqueue(ids, stamps)

    def pick_victims(self, n: int) -> IntArray:
        """Up to `n` idle cached blocks, least recently released first (not removed yet)."""
        if n <= 0:
            return np.zeros(0, dtype=np.int64)
        picked: list[IntArray] = []
        taken, pos, leading = 0, self._queue_head, True
        while taken < n and pos < self._queue_len:
            stop = min(self._queue_len, pos + max(2 * (n - taken), 256))
            current = self._current(pos, stop)
            if leading:  # stale entries at the head go for good
                first = int(np.argmax(current)) if current.any() else stop - pos
                self._queue_head = pos + first
                leading = first == stop - pos
            chosen = self._queue[0, pos:stop][current][: n - taken]
            picked.append(chosen)
            taken += int(chosen.size)
            pos = stop
        if taken < n and self.num_evictable() > taken:  # a candidate the queue does not hold: sort them all
            return self._scan_victims(n)
        return np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)

    def _scan_victims(self, n: int) -> IntArray:
        idle = np.flatnonzero(self._cached & self.pool.idle_mask())
        if n < idle.size:
            idle = idle[np.argpartition(self._stamp[idle], n)[:n]]
        return idle[np.argsort(self._stamp[idle], kind="stable")].astype(np.int64)

    def _current(self, start: int, stop: int) -> npt.NDArray[np.bool_]:
        """Which queue entries `start .. stop - 1` still name an eviction candidate at that stamp."""
        ids, stamps = self._queue[0, start:stop], self._queue[1, start:stop]
        mask: npt.NDArray[np.bool_] = (self._stamp[ids] == stamps) & self._cached[ids] & self.pool.idle(ids)
        return mask

    def _enqueue(self, ids: IntArray, stamps: IntArray) -> None:
        live = self._queue_len - self._queue_head
        if self._queue_len + ids.size > self._queue.shape[1]:
            if live > 2 * self.num_evictable() + QUEUE_MIN:  # mostly stale: keep the current entries only
                keep = self._current(self._queue_head, self._queue_len)
                entries = self._queue[:, self._queue_head : self._queue_len][:, keep]
            else:
                entries = self._queue[:, self._queue_head : self._queue_len]
            width = max(QUEUE_MIN, 2 * (entries.shape[1] + ids.size))
            queue = np.zeros((2, width), dtype=np.int64)
            queue[:, : entries.shape[1]] = entries
            self._queue, self._queue_head, self._queue_len = queue, 0, entries.shape[1]
        self._queue[0, self._queue_len : self._queue_len + ids.size] = ids
        self._queue[1, self._queue_len : self._queue_len + ids.size] = stamps
        self._queue_len += int(ids.size)

    def remove(self, block_ids: BlockIds) -> list[bytes]:
        """Uncache blocks (they stay allocated); returns their hashes in the given order."""
        ids = as_block_ids(block_ids)
        if ids.size and not self._cached[ids].all():
            raise ValueError(f"blocks {ids[~self._cached[ids]][:8].tolist()} are not cached")
        hashes = [self._hashes[b].tobytes() for b in ids.tolist()]
        for h in hashes:
            del self._block_of[h]
        self._cached[ids] = False
        self.pool.track(ids, False)
        return hashes
