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

    def read(self, slots: list[int]) -> Tensor:
        """`uint8 [len(slots), block_bytes]` copy of the slots."""
        return self.storage[torch.as_tensor(slots, dtype=torch.long)]

    def put(self, block_hashes: list[bytes], blocks: Tensor) -> tuple[list[bytes], Payload]:
        """Store `blocks` (`uint8 [k, block_bytes]`, any device) under new hashes, evicting the least
        recently used blocks if needed. Returns the evicted hashes and a copy of their bytes
        `uint8 [evicted, block_bytes]` (for the next tier down)."""
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
            evicted_bytes = self.storage[torch.from_numpy(victims)].numpy().copy()
            for h in evicted:
                del self._slot_of[h]
            self._used[victims] = False
            free = np.sort(np.concatenate([free, victims]))
        slots = free[:k]
        self.storage[torch.from_numpy(slots)] = blocks.to("cpu")
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
        return hashes, self.storage[torch.from_numpy(slots)].numpy().copy()


@dataclass
class _DiskEntry:
    pending: Payload | None = None
    """Bytes queued for writing (served from memory until the file is complete)."""
    write: Future[int] | None = field(default=None, repr=False)


class DiskTier:
    """Persistent LRU cache of blocks, one file each, under `root`.

    Mutated from the owner's thread only; file I/O runs on `io`. `poll()` collects finished writes
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
        self._writing: dict[bytes, _DiskEntry] = {}
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

    def write(self, block_hash: bytes, payload: Payload) -> list[bytes]:
        """Queue `payload` (`uint8 [block_bytes]`, owned by the tier from now on) for writing.
        Returns the hashes evicted to stay within capacity. A hash already held is only touched."""
        if block_hash in self._index:
            self._index.move_to_end(block_hash)
            return []
        if payload.shape != (self.block_bytes,):
            raise ValueError(f"payload of shape {payload.shape}, expected ({self.block_bytes},)")
        entry = _DiskEntry(pending=payload)
        path = block_path(self.root, block_hash)
        entry.write = self._io.submit(partial(write_block_file, path, self.layout_hash, block_hash, payload, self.fsync))
        self._index[block_hash] = entry
        self._writing[block_hash] = entry
        return self._enforce_capacity()

    def _enforce_capacity(self) -> list[bytes]:
        evicted: list[bytes] = []
        while self.capacity_blocks and len(self._index) > self.capacity_blocks:
            block_hash, _ = self._index.popitem(last=False)
            self._writing.pop(block_hash, None)
            self._deletes.append(self._io.submit(partial(_unlink, block_path(self.root, block_hash))))
            evicted.append(block_hash)
        self._metrics.evicted_disk_blocks += len(evicted)
        return evicted

    def poll(self) -> list[tuple[bytes, BaseException]]:
        """Retire finished writes and deletes; failed writes leave the index and are returned."""
        failed: list[tuple[bytes, BaseException]] = []
        for block_hash, entry in list(self._writing.items()):
            assert entry.write is not None
            if not entry.write.done():
                continue
            del self._writing[block_hash]
            exc = entry.write.exception()
            if exc is None:
                self._metrics.offload_disk_bytes += entry.write.result()
                entry.pending, entry.write = None, None
            else:
                self._metrics.disk_io_errors += 1
                self._index.pop(block_hash, None)
                failed.append((block_hash, exc))
        still: list[Future[None]] = []
        for future in self._deletes:
            if not future.done():
                still.append(future)
            elif (exc := future.exception()) is not None:
                self._metrics.disk_io_errors += 1
                failed.append((b"", exc))
        self._deletes = still
        return failed

    # ------------------------------------------------------------------ reads

    def read(self, block_hash: bytes) -> Future[Payload]:
        """Future of the verified bytes of `block_hash` (`KeyError` if not held). The future raises
        `CorruptBlockFileError` for a bad file (already deleted by then): call `drop`."""
        entry = self._index[block_hash]
        self._index.move_to_end(block_hash)
        if entry.pending is not None:
            done: Future[Payload] = Future()
            done.set_result(entry.pending)
            return done
        path = block_path(self.root, block_hash)
        return self._io.submit(partial(_read_or_delete, path, self.layout_hash, block_hash, self.block_bytes))

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
        self._writing.pop(block_hash, None)
        return self._index.pop(block_hash, None) is not None

    # ------------------------------------------------------------------ lifecycle

    def drain(self) -> list[tuple[bytes, BaseException]]:
        """Wait for queued writes and deletes, then `poll`."""
        for entry in list(self._writing.values()):
            assert entry.write is not None
            entry.write.exception()  # waits
        for future in self._deletes:
            future.exception()
        return self.poll()

    def close(self) -> None:
        """Release the folder lock (call after `drain` and after the I/O worker stopped)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _read_or_delete(path: Path, layout_hash: bytes, block_hash: bytes, block_bytes: int) -> Payload:
    try:
        return read_block_file(path, layout_hash, block_hash, block_bytes)
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
