"""The packed staging buffer: fixed slots in one registered tensor, gather on the sender and scatter
on the receiver, so a chunk of scattered blocks crosses the link as one large descriptor.

Slot s holds bytes `[s * slot_bytes, (s + 1) * slot_bytes)` as rows of `block_bytes`; a packed chunk
of n blocks occupies n consecutive rows from some first row (block i of the chunk at row first + i,
request order): the sender's own slot from row 0, the receiver's slot wherever the sender placed it
(several chunks of one request share a receiver slot, `ChunkDone.staging_offset`).
Packing on the device costs an HBM gather (TB/s) against a link at tens to hundreds of GB/s. The
copies run on the pool's own CUDA stream, so a gather or scatter never queues behind the worker's
compute on its default stream, and each ends in one wait on that stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np
import torch


class StagingPool:
    """Slot allocator over a staging tensor. Not thread-safe: the owning agent holds its lock."""

    def __init__(self, tensor: torch.Tensor, slot_bytes: int) -> None:
        if tensor.dtype != torch.uint8 or not tensor.is_contiguous() or tensor.numel() % slot_bytes:
            raise ValueError("staging tensor must be contiguous uint8 of a whole number of slots")
        self.tensor = tensor
        self.slot_bytes = slot_bytes
        self.num_slots = tensor.numel() // slot_bytes
        self._free = list(range(self.num_slots - 1, -1, -1))
        self.stream: torch.cuda.Stream | None = None
        """Where gathers and scatters of this pool run (device memory), apart from the worker's compute."""
        self._ids_host: torch.Tensor | None = None  # pinned int64, the block ids of the copy in progress
        self._ids_device: torch.Tensor | None = None
        if tensor.device.type == "cuda":
            torch.cuda.synchronize(tensor.device)  # the tensor's zeroing, on the default stream, is done
            self.stream = torch.cuda.Stream(tensor.device)  # type: ignore[no-untyped-call]

    @classmethod
    def allocate(cls, num_slots: int, slot_bytes: int, device: torch.device) -> StagingPool:
        return cls(torch.zeros(num_slots * slot_bytes, dtype=torch.uint8, device=device), slot_bytes)

    def slot_blocks(self, block_bytes: int) -> int:
        """Blocks of `block_bytes` one slot holds."""
        return self.slot_bytes // block_bytes

    @property
    def base_address(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int | None:
        """A free slot, or None when all are in use."""
        return self._free.pop() if self._free else None

    def acquire_up_to(self, n: int) -> list[int]:
        return [self._free.pop() for _ in range(min(n, len(self._free)))]

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"staging slot {slot} is not held")
        self._free.append(slot)

    def slot_address(self, slot: int) -> int:
        return self.base_address + slot * self.slot_bytes

    def gather(self, blocks: torch.Tensor, ids: np.ndarray, out: torch.Tensor) -> None:
        """`out[i] = blocks[ids[i]]` (`gather_blocks` on this pool's stream and index buffers); returns
        when `out` holds the bytes."""
        self._copy(take_rows, gather_blocks, blocks, ids, out)

    def scatter(self, blocks: torch.Tensor, ids: np.ndarray, src: torch.Tensor) -> None:
        """`blocks[ids[i]] = src[i]` (`scatter_blocks` likewise); returns when `blocks` hold them."""
        self._copy(put_rows, scatter_blocks, blocks, ids, src)

    def _copy(self, on_device: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
              on_host: Callable[[torch.Tensor, np.ndarray, torch.Tensor], None],
              blocks: torch.Tensor, ids: np.ndarray, rows: torch.Tensor) -> None:
        if self.stream is None:
            on_host(blocks, ids, rows)
            return
        with torch.cuda.stream(self.stream):
            on_device(blocks, self._device_ids(ids), rows)
        self.stream.synchronize()

    def _device_ids(self, ids: np.ndarray) -> torch.Tensor:
        """`ids` on the device, copied on the current stream (the pool's) from the pinned buffer. The
        buffer is free again once that stream's last copy ended, which every gather and scatter waits
        for before it returns; the owning agent's lock keeps two copies from overlapping."""
        n = int(ids.size)
        if self._ids_host is None or self._ids_device is None or self._ids_host.numel() < n:
            size = 1 << max(10, (n - 1).bit_length())
            self._ids_host = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self._ids_device = torch.empty(size, dtype=torch.int64, device=self.tensor.device)
        self._ids_host.numpy()[:n] = ids
        device_ids = self._ids_device[:n]
        device_ids.copy_(self._ids_host[:n], non_blocking=True)
        return device_ids

    def slot_rows(self, slot: int, num_blocks: int, block_bytes: int, first_row: int = 0) -> torch.Tensor:
        """`[num_blocks, block_bytes]` view of `slot` from row `first_row`."""
        if (first_row + num_blocks) * block_bytes > self.slot_bytes:
            raise ValueError(f"rows [{first_row}, {first_row + num_blocks}) of {block_bytes} B exceed a "
                             f"{self.slot_bytes} B slot")
        start = slot * self.slot_bytes + first_row * block_bytes
        return self.tensor[start: start + num_blocks * block_bytes].view(num_blocks, block_bytes)


def take_rows(src: torch.Tensor, ids: np.ndarray | torch.Tensor, out: torch.Tensor) -> None:
    """`out[i] = src[ids[i]]` for 2-D uint8 tensors. On the host through numpy (`torch.index_select`
    on uint8 rows runs element by element: ~100x slower than a row memcpy); on the device with the
    rows viewed as the widest integers they divide into (8 bytes a thread instead of 1). On the device
    `ids` may already be a device tensor (`StagingPool`'s buffers)."""
    if src.device.type == "cpu":
        np.take(src.numpy(), np.asarray(ids), axis=0, out=out.numpy())
    else:
        wide_src, wide_out = _wide(src), _wide(out)
        if wide_src.dtype != wide_out.dtype:
            wide_src, wide_out = src, out
        torch.index_select(wide_src, 0, _on_device(ids, src.device), out=wide_out)


def put_rows(dst: torch.Tensor, ids: np.ndarray | torch.Tensor, src: torch.Tensor) -> None:
    """`dst[ids[i]] = src[i]` for 2-D uint8 tensors (numpy on the host, as `take_rows`)."""
    if dst.device.type == "cpu":
        dst.numpy()[np.asarray(ids)] = src.numpy()
    else:
        wide_dst, wide_src = _wide(dst), _wide(src)
        if wide_dst.dtype != wide_src.dtype:
            wide_dst, wide_src = dst, src
        wide_dst.index_copy_(0, _on_device(ids, dst.device), wide_src)


def _on_device(ids: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    return ids if isinstance(ids, torch.Tensor) else torch.from_numpy(ids).to(device)


def _wide(rows: torch.Tensor) -> torch.Tensor:
    """A `[n, row_bytes]` uint8 tensor viewed as `[n, row_bytes / k]` of the widest k-byte integer
    that divides its rows and its address (itself when none does)."""
    row_bytes = rows.shape[1]
    for dtype, k in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row_bytes % k == 0 and rows.data_ptr() % k == 0 and rows.stride(1) == 1 and rows.stride(0) == row_bytes:
            return rows.view(dtype)
    return rows


def gather_blocks(blocks: torch.Tensor, ids: np.ndarray, out: torch.Tensor,
                  stream: torch.cuda.Stream | None = None) -> None:
    """`out[i] = blocks[ids[i]]`; `blocks` `[num_blocks, block_bytes]`, `out` `[len(ids), block_bytes]`.
    On the device, on `stream` (the staging pool's; None: the current one), and waits for it, since
    NIXL reads `out` as soon as the transfer is posted. The caller has the blocks' final bytes (a
    prefill synchronises before `write_blocks`)."""
    with _on(stream):
        take_rows(blocks, ids, out)
    _wait(out, stream)


def scatter_blocks(blocks: torch.Tensor, ids: np.ndarray, src: torch.Tensor,
                   stream: torch.cuda.Stream | None = None) -> None:
    """`blocks[ids[i]] = src[i]`, on `stream` as `gather_blocks`; waits, so the staging rows may be
    handed back (and the transfer declared DONE) at once."""
    with _on(stream):
        put_rows(blocks, ids, src)
    _wait(blocks, stream)


def _on(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _wait(t: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
    if t.device.type == "cuda":
        (stream if stream is not None else torch.cuda.current_stream(t.device)).synchronize()
