"""The device prefix cache: block hash <-> pool block, and LRU eviction of unreferenced blocks.

A block enters the cache when a request has computed all of its tokens (`insert`). Requests that
share a prefix then share its blocks with no copy: the cache manager `incref`s them. When the last
request lets go of a cached block it stays allocated but idle, and becomes an eviction candidate.
Eviction takes idle blocks only, least recently released first; a request's blocks are stamped
back to front on release, so a chain loses its tail before its head and the longest-prefix lookup
keeps hitting as much as possible.

Metadata per pool block: the 32-byte hash, a cached flag and an int64 stamp (numpy arrays), plus one
dict entry hash -> block id per cached block.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from cedserve.model.cache.block_pool import BlockIds, BlockPool, IntArray, as_block_ids
from cedserve.model.cache.hashing import HASH_BYTES, TokenIds, hash_blocks


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
        return inserted

    def touch_released(self, block_ids: BlockIds) -> None:
        """Stamp blocks a request just released, given in its block-table order: the last block gets
        the oldest stamp, so eviction trims chains from the tail."""
        ids = as_block_ids(block_ids)[::-1]
        self._stamp[ids] = self._clock + np.arange(ids.size, dtype=np.int64)
        self._clock += int(ids.size)

    def pick_victims(self, n: int) -> IntArray:
        """Up to `n` idle cached blocks, least recently released first (not removed yet)."""
        idle = np.flatnonzero(self._cached & self.pool.idle_mask())
        if n < idle.size:
            idle = idle[np.argpartition(self._stamp[idle], n)[:n]]
        return idle[np.argsort(self._stamp[idle], kind="stable")].astype(np.int64)

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
