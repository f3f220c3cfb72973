"""The paged block pool: one contiguous `uint8 [num_blocks, block_bytes]` tensor and its bookkeeping.

The storage is a single tensor so the transfer layer registers the whole pool once and addresses a
block as `storage.data_ptr() + block_id * block_bytes`. Transfer bandwidth grows with descriptor size
(DESIGN section 2: 64 KiB descriptors run at a few percent of NVLink), so allocation keeps a request's
blocks in contiguous runs where it can:

* free space is a sorted array of extents `(start, length)`, coalesced on every free;
* `allocate(n, hint=h)` first continues the run at block `h` (the block after the request's last
  one), then takes the smallest extent that holds the rest (best fit), and only when none does,
  the largest extents first, so the request gets the fewest runs possible.

Block states: *free* (in an extent), *in use* (refcount >= 1) and *idle* (refcount 0 but not free:
a cached prefix block that the prefix cache may revive with `incref` or evict with `free`).

Metadata is a few numpy arrays (6 bytes per block plus the extent arrays), and every operation is
vectorised over the block ids it touches, so a 1M-token prompt (16K blocks) allocates in
microseconds of Python. The counts asked every scheduler tick (idle blocks, and idle blocks the
prefix cache holds: what eviction could free) are kept as counters updated by the operations, not
counted over the pool: at the released model's pool sizes (~1M blocks) a count took ~0.2 ms a call.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from cedserve.model.cache.errors import CacheExhaustedError

BlockIds = Sequence[int] | npt.NDArray[np.integer]
IntArray = npt.NDArray[np.int64]


class BlockPool:
    """Fixed-size blocks in one storage tensor, reference counted, with a free-extent allocator.

    Not thread-safe: one owner (the worker's cache manager) calls it from one thread.
    """

    def __init__(self, num_blocks: int, block_bytes: int, device: torch.device | str = "cpu",
                 pin_memory: bool = False) -> None:
        if num_blocks <= 0 or block_bytes <= 0:
            raise ValueError(f"cache field `num_blocks`/`block_bytes`: must be positive, got {num_blocks}/{block_bytes}")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.storage: Tensor = torch.empty((num_blocks, block_bytes), dtype=torch.uint8, device=device,
                                           pin_memory=pin_memory)
        """`uint8 [num_blocks, block_bytes]`, one allocation: register it once for transfers."""
        self._ref = np.zeros(num_blocks, dtype=np.int32)
        self._free = np.ones(num_blocks, dtype=np.bool_)
        self._ext_start: IntArray = np.zeros(1, dtype=np.int64)
        self._ext_len: IntArray = np.full(1, num_blocks, dtype=np.int64)
        self._num_free = num_blocks
        self._tracked = np.zeros(num_blocks, dtype=np.bool_)
        """Blocks an owner counts among `num_idle_tracked` (the prefix cache's cached blocks, `track`)."""
        self._num_idle = 0
        self._num_idle_tracked = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        """Blocks in free extents (idle cached blocks are not counted)."""
        return self._num_free

    @property
    def num_extents(self) -> int:
        """Free extents: 1 when free space is one run; more means fragmentation."""
        return int(self._ext_start.size)

    def refcount(self, block_ids: BlockIds) -> npt.NDArray[np.int32]:
        return self._ref[as_block_ids(block_ids)].copy()

    def is_free(self, block_ids: BlockIds) -> npt.NDArray[np.bool_]:
        return self._free[as_block_ids(block_ids)].copy()

    @property
    def num_idle(self) -> int:
        """Allocated blocks nobody references (`idle_mask().sum()`, kept as a count)."""
        return self._num_idle

    @property
    def num_idle_tracked(self) -> int:
        """Idle blocks among the tracked ones (`track`): for the prefix cache, the evictable blocks."""
        return self._num_idle_tracked

    def track(self, block_ids: BlockIds, on: bool) -> None:
        """Mark blocks as counted (`on`) or not in `num_idle_tracked`."""
        ids = np.unique(as_block_ids(block_ids))
        if ids.size == 0:
            return
        changed = ids[self._tracked[ids] != on]
        idle = int(np.count_nonzero((self._ref[changed] == 0) & ~self._free[changed]))
        self._num_idle_tracked += idle if on else -idle
        self._tracked[changed] = on

    def idle(self, block_ids: BlockIds) -> npt.NDArray[np.bool_]:
        """Which of `block_ids` are idle (allocated, nobody references them)."""
        ids = as_block_ids(block_ids)
        mask: npt.NDArray[np.bool_] = (self._ref[ids] == 0) & ~self._free[ids]
        return mask

    def idle_mask(self) -> npt.NDArray[np.bool_]:
        """`bool [num_blocks]`: allocated blocks nobody references (candidates for eviction)."""
        mask: npt.NDArray[np.bool_] = (self._ref == 0) & ~self._free
        return mask

    def metadata_bytes(self) -> int:
        """Bytes of bookkeeping arrays (for the overhead figure)."""
        return int(self._ref.nbytes + self._free.nbytes + self._ext_start.nbytes + self._ext_len.nbytes)

    # ------------------------------------------------------------------ allocation

    def allocate(self, n: int, request_id: str, hint: int | None = None) -> list[int]:
        """`n` free blocks with refcount 1, in as few contiguous runs as possible, in run order.

        `hint`: block id where the run should continue (usually the request's last block + 1).
        Raises `CacheExhaustedError` (nothing allocated) when fewer than `n` blocks are free.
        """
        return self.allocate_array(n, request_id, hint).tolist()  # type: ignore[no-any-return]

    def allocate_array(self, n: int, request_id: str, hint: int | None = None) -> IntArray:
        """`allocate`, returning an `int64` array."""
        if n < 0:
            raise ValueError(f"request {request_id!r}: cannot allocate {n} blocks")
        if n > self._num_free:
            raise CacheExhaustedError(request_id, n, self._num_free)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        runs = self._take(n, hint)
        ids = np.concatenate([np.arange(s, s + k, dtype=np.int64) for s, k in runs])
        self._free[ids] = False
        self._ref[ids] = 1
        self._num_free -= n
        return ids

    def _take(self, n: int, hint: int | None) -> list[tuple[int, int]]:
        """Cut `n` blocks out of the free extents; returns the runs `(start, length)`."""
        runs: list[tuple[int, int]] = []
        if hint is not None:
            i = int(np.searchsorted(self._ext_start, hint))
            if i < self._ext_start.size and self._ext_start[i] == hint:
                k = min(n, int(self._ext_len[i]))
                runs.append((hint, k))
                self._shrink(i, k)
                n -= k
        if n == 0:
            return runs
        fits = np.flatnonzero(self._ext_len >= n)
        if fits.size:
            i = int(fits[np.argmin(self._ext_len[fits])])  # best fit; argmin keeps the lowest start on ties
            runs.append((int(self._ext_start[i]), n))
            self._shrink(i, n)
            return runs
        order = np.argsort(-self._ext_len, kind="stable")
        covered = np.cumsum(self._ext_len[order])
        last = int(np.searchsorted(covered, n))  # extents order[:last] whole, then part of order[last]
        whole = order[:last]
        runs.extend((int(s), int(k)) for s, k in zip(self._ext_start[whole], self._ext_len[whole]))
        rest = n - (int(covered[last - 1]) if last else 0)
        tail = int(order[last])
        runs.append((int(self._ext_start[tail]), rest))
        self._ext_start[tail] += rest
        self._ext_len[tail] -= rest
        keep = np.ones(self._ext_start.size, dtype=np.bool_)
        keep[whole] = False
        keep[tail] = self._ext_len[tail] > 0
        self._ext_start, self._ext_len = self._ext_start[keep], self._ext_len[keep]
        return runs

    def _shrink(self, i: int, k: int) -> None:
        """Take `k` blocks from the front of extent `i`."""
        self._ext_start[i] += k
        self._ext_len[i] -= k
        if self._ext_len[i] == 0:
            self._ext_start = np.delete(self._ext_start, i)
            self._ext_len = np.delete(self._ext_len, i)

    # ------------------------------------------------------------------ references

    def incref(self, block_ids: BlockIds) -> None:
        """Add one reference to each block (repeats add more). Blocks must be allocated (in use or idle)."""
        ids = as_block_ids(block_ids)
        if ids.size and self._free[ids].any():
            raise ValueError(f"incref of free blocks {ids[self._free[ids]][:8].tolist()}")
        uniq, counts = np.unique(ids, return_counts=True)
        woken = uniq[self._ref[uniq] == 0]  # idle until now
        self._num_idle -= int(woken.size)
        self._num_idle_tracked -= int(np.count_nonzero(self._tracked[woken]))
        self._ref[uniq] += counts.astype(np.int32)

    def decref(self, block_ids: BlockIds) -> IntArray:
        """Drop one reference from each block; returns the (unique, sorted) blocks now idle.

        Idle blocks stay allocated: the caller either keeps them as cached prefix blocks or `free`s them.
        """
        touched, counts = np.unique(as_block_ids(block_ids), return_counts=True)
        bad = touched[(self._ref[touched] < counts) | self._free[touched]]
        if bad.size:
            raise ValueError(f"decref of unreferenced or free blocks {bad[:8].tolist()}")
        self._ref[touched] -= counts.astype(np.int32)
        idle: IntArray = touched[self._ref[touched] == 0]
        self._num_idle += int(idle.size)
        self._num_idle_tracked += int(np.count_nonzero(self._tracked[idle]))
        return idle

    def free(self, block_ids: BlockIds) -> None:
        """Return idle blocks (refcount 0, allocated) to the free extents."""
        ids = np.unique(as_block_ids(block_ids))
        if ids.size == 0:
            return
        if self._free[ids].any() or (self._ref[ids] != 0).any():
            bad = ids[self._free[ids] | (self._ref[ids] != 0)]
            raise ValueError(f"free of blocks that are free or still referenced: {bad[:8].tolist()}")
        self._free[ids] = True
        self._num_free += int(ids.size)
        self._num_idle -= int(ids.size)  # every one was idle
        self._num_idle_tracked -= int(np.count_nonzero(self._tracked[ids]))
        runs = contiguous_runs(ids)
        starts = np.concatenate([self._ext_start, runs[:, 0]])
        lens = np.concatenate([self._ext_len, runs[:, 1]])
        order = np.argsort(starts, kind="stable")
        starts, lens = starts[order], lens[order]
        opens = np.ones(starts.size, dtype=np.bool_)
        opens[1:] = starts[1:] != starts[:-1] + lens[:-1]  # a new extent unless it continues the last one
        firsts = np.flatnonzero(opens)
        self._ext_start = starts[firsts]
        self._ext_len = np.add.reduceat(lens, firsts)

    # ------------------------------------------------------------------ transfers and checks

    def byte_runs(self, block_ids: BlockIds) -> IntArray:
        """`int64 [runs, 2]` of (byte offset into `storage`, byte length) covering `block_ids` in order,
        adjacent blocks merged: the descriptor list of a transfer."""
        runs = contiguous_runs(as_block_ids(block_ids))
        return runs * self.block_bytes

    def check_invariants(self) -> None:
        """`AssertionError` if the bookkeeping is inconsistent (tests call this after every step)."""
        s, k = self._ext_start, self._ext_len
        assert s.size == k.size and (k > 0).all(), "empty extent"
        assert (s[1:] > s[:-1] + k[:-1]).all(), "extents overlap, touch or are unsorted"
        covered = np.zeros(self.num_blocks, dtype=np.bool_)
        for start, length in zip(s.tolist(), k.tolist()):
            covered[start : start + length] = True
        assert (covered == self._free).all(), "free flags disagree with the extents"
        assert int(k.sum()) == self._num_free, "free count drifted"
        assert (self._ref >= 0).all() and (self._ref[self._free] == 0).all(), "free block referenced"
        idle = self.idle_mask()
        assert int(idle.sum()) == self._num_idle, "idle count drifted"
        assert int(np.count_nonzero(idle & self._tracked)) == self._num_idle_tracked, "idle tracked count drifted"


def gather_rows(storage: Tensor, rows: BlockIds) -> Tensor:
    """Copy of `storage[rows]`, `uint8 [len(rows), row_bytes]`, on the storage's device.

    On CPU this goes through numpy, whose fancy indexing copies whole rows at memcpy speed (torch's
    CPU indexing of uint8 tensors runs element by element, ~10x slower)."""
    ids = as_block_ids(rows)
    if storage.device.type == "cpu":
        return torch.from_numpy(storage.numpy()[ids])
    return storage.index_select(0, torch.from_numpy(ids).to(storage.device))


MAX_RUN_COPIES = 64
"""Device -> host scatters into at most this many contiguous runs copy straight into the destination."""


def scatter_rows(storage: Tensor, rows: BlockIds, values: Tensor) -> None:
    """`storage[rows] = values` (`values` on any device), at memcpy/DMA speed.

    Host -> device copies are issued on the current stream without waiting (`values` in pinned
    memory makes them asynchronous: keep it alive and unmodified until the stream passes them).
    Device -> host copies are done when this returns."""
    ids = as_block_ids(rows)
    if storage.device.type != "cpu":
        storage.index_copy_(0, torch.from_numpy(ids).to(storage.device), values.to(storage.device, non_blocking=True))
    elif values.device.type == "cpu":
        storage.numpy()[ids] = values.numpy()
    elif len(runs := contiguous_runs(ids)) <= MAX_RUN_COPIES:
        done = 0
        for start, n in runs.tolist():  # DMA straight into (pinned) destination rows
            storage[start : start + n].copy_(values[done : done + n])
            done += n
    else:
        storage.numpy()[ids] = values.cpu().numpy()


def contiguous_runs(block_ids: BlockIds) -> IntArray:
    """`int64 [runs, 2]` of (first block, length) for maximal runs of consecutive ids, in the given order."""
    ids = as_block_ids(block_ids)
    if ids.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    firsts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([firsts, [ids.size]]))
    return np.stack([ids[firsts], lengths], axis=1).astype(np.int64)


def as_block_ids(block_ids: BlockIds) -> IntArray:
    return np.asarray(block_ids, dtype=np.int64).reshape(-1)
