"""Lower cache tiers below the device pool: a host-memory tier and a persistent disk tier.

Both are caches keyed by block hash with LRU replacement; neither knows about requests.

* `HostTier`: `uint8 [num_blocks, block_bytes]` in host memory, pinned when CUDA is available so
  device <-> host copies run at full PCIe/C2C speed. Copies in and out are bulk tensor copies made
  by the caller's thread (a device -> host batch of 16K blocks is ~0.9 GB, ~17 ms at 55 GB/s).
* `DiskTier`: one checksummed file per block (`disk_format`), written and read by one background
  `IOWorker` thread. A block queued for writing is servable at once from the bytes it holds; its
  file appears when the write finishes. At start the folder is scanned and re-indexed (headers only;
  payload checksums are verified at read). A folder belongs to one process at a time (`LOCK` file).

Only global KV blocks live here: SWA state is never persisted (it is rebuilt by replay).
"""

from __future__ import annotations

import fcntl
import os
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from cedserve.model.cache.background import IOWorker
from cedserve.model.cache.block_pool import contiguous_runs, gather_rows, scatter_rows
from cedserve.model.cache.disk_format import (
    SUFFIX,
    TMP_MARK,
    block_path,
    hash_from_path,
    read_block_file,
    read_header,
    write_block_file,
)
from cedserve.model.cache.errors import BlockFileMissingError, CacheError, CorruptBlockFileError
from cedserve.model.cache.hashing import HASH_BYTES
from cedserve.model.cache.metrics import CacheMetrics

Payload = npt.NDArray[np.uint8]


class HostTier:
    """LRU cache of whole blocks in (pinned) host memory."""

    def __init__(self, num_blocks: int, block_bytes: int, pin_memory: bool | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"cache field `host_offload_blocks`: must be positive, got {num_blocks}")
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.storage: Tensor = torch.empty((num_blocks, block_bytes), dtype=torch.uint8, pin_memory=pin)
        """`uint8 [num_blocks, block_bytes]` in host memory."""
        self._slot_of: dict[bytes, int] = {}
        self._hashes = np.zeros((num_blocks, HASH_BYTES), dtype=np.uint8)
        self._used = np.zeros(num_blocks, dtype=np.bool_)
        self._stamp = np.zeros(num_blocks, dtype=np.int64)
        self._clock = 0

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slot_of

    def hashes(self) -> list[bytes]:
        return list(self._slot_of)

    def get(self, block_hash: bytes) -> int | None:
        """The slot holding `block_hash` (marked recently used), or None."""
        slot = self._slot_of.get(block_hash)
        if slot is not None:
            self._stamp[slot] = self._clock
            self._clock += 1
        return slot

    def read(self, slots: list[int], device: torch.device) -> Tensor:
        """`uint8 [len(slots), block_bytes]` copy of the slots on `device`. To a CUDA device the copies
        run per contiguous run of slots straight from pinned memory, asynchronously on the current
        stream: later writes into these slots are issued on the same stream, so they cannot overtake."""
        if device.type == "cpu":
            return gather_rows(self.storage, slots)
        out = torch.empty((len(slots), self.block_bytes), dtype=torch.uint8, device=device)
        done = 0
        for start, n in contiguous_runs(slots).tolist():
            out[done : done + n].copy_(self.storage[start : start + n], non_blocking=True)
            done += n
        return out

    def put(self, block_hashes: list[bytes], blocks: Tensor, keep_evicted: bool = True) -> tuple[list[bytes], Payload]:
        """Store `blocks` (`uint8 [k, block_bytes]`, any device) under new hashes, evicting the least
        recently used blocks if needed. Returns the evicted hashes and, with `keep_evicted`, a copy of
        their bytes `uint8 [evicted, block_bytes]` (for the next tier down; else an empty array)."""
        k = len(block_hashes)
        if k > self.num_blocks or blocks.shape[0] != k:
            raise ValueError(f"cannot put {k} blocks ({blocks.shape[0]} rows) into a host tier of {self.num_blocks}")
        if any(h in self._slot_of for h in block_hashes):
            raise ValueError("host tier already holds some of these blocks")
        free = np.flatnonzero(~self._used)
        evicted: list[bytes] = []
        evicted_bytes: Payload = np.zeros((0, self.block_bytes), dtype=np.uint8)
        if free.size < k:
            used = np.flatnonzero(self._used)
            need = k - free.size
            victims = used[np.argpartition(self._stamp[used], need - 1)[:need]] if need < used.size else used
            evicted = [self._hashes[s].tobytes() for s in victims.tolist()]
            if keep_evicted:
                evicted_bytes = gather_rows(self.storage, victims).numpy()
            for h in evicted:
                del self._slot_of[h]
            self._used[victims] = False
            free = np.sort(np.concatenate([free, victims]))
        slots = free[:k]
        scatter_rows(self.storage, slots, blocks)
        for slot, h in zip(slots.tolist(), block_hashes):
            self._slot_of[h] = slot
            self._hashes[slot] = np.frombuffer(h, dtype=np.uint8)
        self._used[slots] = True
        self._stamp[slots] = self._clock + np.arange(k)
        self._clock += k
        return evicted, evicted_bytes

    def dump(self) -> tuple[list[bytes], Payload]:
        """Every block's hash and a copy of its bytes (for persisting at shutdown); changes nothing."""
        slots = np.flatnonzero(self._used)
        hashes = [self._hashes[s].tobytes() for s in slots.tolist()]
        return hashes, gather_rows(self.storage, slots).numpy()


@dataclass
class _DiskEntry:
    pending: Payload | None = None
    """Bytes queued for writing (served from memory until the file is complete)."""


@dataclass
class _WriteBatch:
    entries: list[tuple[bytes, _DiskEntry]]
    future: Future[list[BaseException | None]] = field(repr=False)


ReadOutcome = BaseException | None
"""Per block of a batched read: None when its verified bytes are in place, else why not."""


class DiskTier:
    """Persistent LRU cache of blocks, one file each, under `root`.

    Mutated from the owner's thread only; file I/O runs on `io`, one job per batch of blocks (a
    future per block would cost more than reading a 57 KB file). `poll()` collects finished writes
    and returns failed ones (dropped from the index) for the owner to report.
    """

    def __init__(self, root: Path, layout_hash: bytes, block_bytes: int, io: IOWorker, metrics: CacheMetrics,
                 capacity_blocks: int = 0, fsync: bool = False) -> None:
        self.root = root
        self.layout_hash = layout_hash
        self.block_bytes = block_bytes
        self.capacity_blocks = capacity_blocks
        self.fsync = fsync
        self._io = io
        self._metrics = metrics
        self._index: OrderedDict[bytes, _DiskEntry] = OrderedDict()  # oldest first
        self._writes: list[_WriteBatch] = []
        self._deletes: list[Future[None]] = []
        root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_folder(root)
        self._scan()

    # ------------------------------------------------------------------ index

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def hashes(self) -> list[bytes]:
        return list(self._index)

    def _scan(self) -> None:
        """Index intact files (oldest modified first), delete torn and corrupt ones, count foreign ones."""
        found: list[tuple[float, bytes]] = []
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for path in folder.iterdir():
                if TMP_MARK in path.name:
                    path.unlink(missing_ok=True)  # a write that never finished
                    self._metrics.disk_rejected_files += 1
                    continue
                block_hash = hash_from_path(path)
                if block_hash is None:
                    continue
                try:
                    read_header(path, self.layout_hash, self.block_bytes)
                    found.append((path.stat().st_mtime, block_hash))
                except CorruptBlockFileError as exc:
                    self._count_bad(path, exc)
        for _, block_hash in sorted(found):
            self._index[block_hash] = _DiskEntry()

    def _count_bad(self, path: Path, exc: CorruptBlockFileError) -> None:
        if exc.foreign:
            self._metrics.disk_foreign_files += 1
        else:
            path.unlink(missing_ok=True)
            self._metrics.disk_rejected_files += 1

    # ------------------------------------------------------------------ writes

    def write_many(self, items: list[tuple[bytes, Payload]]) -> list[bytes]:
        """Queue blocks (`uint8 [block_bytes]` each, owned by the tier from now on) for writing, as one
        job. Returns the hashes evicted to stay within capacity. Hashes already held are only touched."""
        batch: list[tuple[bytes, _DiskEntry]] = []
        jobs: list[tuple[Path, bytes, Payload]] = []
        for block_hash, payload in items:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
                continue
            if payload.shape != (self.block_bytes,):
                raise ValueError(f"payload of shape {payload.shape}, expected ({self.block_bytes},)")
            entry = _DiskEntry(pending=payload)
            self._index[block_hash] = entry
            batch.append((block_hash, entry))
            jobs.append((block_path(self.root, block_hash), block_hash, payload))
        if jobs:
            future = self._io.submit(partial(_write_all, jobs, self.layout_hash, self.fsync))
            self._writes.append(_WriteBatch(batch, future))
        return self._enforce_capacity()

    def _enforce_capacity(self) -> list[bytes]:
        evicted: list[bytes] = []
        while self.capacity_blocks and len(self._index) > self.capacity_blocks:
            block_hash, _ = self._index.popitem(last=False)
            self._deletes.append(self._io.submit(partial(_unlink, block_path(self.root, block_hash))))
            evicted.append(block_hash)
        self._metrics.evicted_disk_blocks += len(evicted)
        return evicted

    def poll(self) -> list[tuple[bytes, BaseException]]:
        """Retire finished writes and deletes; failed writes leave the index and are returned
        (a failed delete is returned with an empty hash)."""
        failed: list[tuple[bytes, BaseException]] = []
        still: list[_WriteBatch] = []
        for batch in self._writes:
            if not batch.future.done():
                still.append(batch)
                continue
            crashed = batch.future.exception()
            outcomes = [crashed] * len(batch.entries) if crashed is not None else batch.future.result()
            for (block_hash, entry), exc in zip(batch.entries, outcomes):
                current = self._index.get(block_hash) is entry  # not evicted or rewritten since
                if exc is None:
                    self._metrics.offload_disk_bytes += self.block_bytes
                    entry.pending = None
                    continue
                self._metrics.disk_io_errors += 1
                if current:
                    del self._index[block_hash]
                    failed.append((block_hash, exc))
        self._writes = still
        pending_deletes: list[Future[None]] = []
        for future in self._deletes:
            if not future.done():
                pending_deletes.append(future)
            elif (exc := future.exception()) is not None:
                self._metrics.disk_io_errors += 1
                failed.append((b"", exc))
        self._deletes = pending_deletes
        return failed

    # ------------------------------------------------------------------ reads

    def read_many(self, block_hashes: list[bytes], out: Payload) -> Future[list[ReadOutcome]]:
        """Read blocks into the rows of `out` (`uint8 [len(block_hashes), block_bytes]`, untouched by
        the caller until the future is done) as one job. Per block the future gives None, or the
        exception that keeps it from being served (`CorruptBlockFileError`: the file was deleted;
        `BlockFileMissingError`; `OSError`): pass those to `drop`. Blocks still queued for writing are
        copied from memory. `KeyError` if a hash is not held."""
        if out.shape != (len(block_hashes), self.block_bytes):
            raise ValueError(f"out has shape {out.shape}, expected ({len(block_hashes)}, {self.block_bytes})")
        jobs: list[tuple[Path, bytes, Payload | None]] = []
        for block_hash in block_hashes:
            entry = self._index[block_hash]
            self._index.move_to_end(block_hash)
            jobs.append((block_path(self.root, block_hash), block_hash, entry.pending))
        return self._io.submit(partial(_read_all, jobs, out, self.layout_hash, self.block_bytes))

    def drop(self, block_hash: bytes, exc: BaseException) -> bool:
        """Forget a block whose read failed, counting why; True if it was indexed."""
        if isinstance(exc, BlockFileMissingError):
            pass  # already counted when it was rejected (or removed from outside)
        elif isinstance(exc, CorruptBlockFileError) and not exc.foreign:
            self._metrics.disk_rejected_files += 1
        elif isinstance(exc, CorruptBlockFileError):
            self._metrics.disk_foreign_files += 1
        else:
            self._metrics.disk_io_errors += 1
        return self._index.pop(block_hash, None) is not None

    # ------------------------------------------------------------------ lifecycle

    def drain(self) -> None:
        """Wait for queued writes and deletes (their outcome is collected by the next `poll`)."""
        for batch in self._writes:
            batch.future.exception()  # waits; never raises
        for future in self._deletes:
            future.exception()

    def close(self) -> None:
        """Release the folder lock (call after the I/O worker stopped)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _write_all(jobs: list[tuple[Path, bytes, Payload]], layout_hash: bytes, fsync: bool) -> list[BaseException | None]:
    """Runs on the I/O thread: write each block, recording each one's OS error."""
    outcomes: list[BaseException | None] = []
    for path, block_hash, payload in jobs:
        try:
            write_block_file(path, layout_hash, block_hash, payload, fsync)
            outcomes.append(None)
        except OSError as exc:
            outcomes.append(exc)
    return outcomes


def _read_all(jobs: list[tuple[Path, bytes, Payload | None]], out: Payload, layout_hash: bytes,
              block_bytes: int) -> list[ReadOutcome]:
    """Runs on the I/O thread: read and verify each block into its row of `out`."""
    outcomes: list[ReadOutcome] = []
    for row, (path, block_hash, pending) in zip(out, jobs):
        if pending is not None:
            np.copyto(row, pending)
            outcomes.append(None)
            continue
        try:
            _read_or_delete(path, layout_hash, block_hash, block_bytes, row)
            outcomes.append(None)
        except (CacheError, OSError) as exc:
            outcomes.append(exc)
    return outcomes


def _read_or_delete(path: Path, layout_hash: bytes, block_hash: bytes, block_bytes: int, out: Payload) -> None:
    try:
        read_block_file(path, layout_hash, block_hash, block_bytes, out)
    except FileNotFoundError:
        raise BlockFileMissingError(f"{path}: indexed but missing") from None
    except CorruptBlockFileError as exc:
        if not exc.foreign:
            path.unlink(missing_ok=True)
        raise


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def _lock_folder(root: Path) -> int:
    fd = os.open(root / "LOCK", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CacheError(f"disk tier folder {root} is in use by another cache; give each worker its own "
                         "`disk_dir`") from None
    return fd


__all__ = ["SUFFIX", "DiskTier", "HostTier"]
