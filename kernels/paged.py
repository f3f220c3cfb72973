"""Where a record lives: slot -> byte address inside paged storage, shared by every kernel.

Records (288 B main KV, 68 B index keys, 528 B SWA; `cedserve.kernels.reference`) live in
uint8 storage that the cache owns. A kernel never sees the cache's structures, only a
:class:`PagedRecords`: a flat uint8 tensor plus four integers that turn a slot number into the
byte offset of its record::

    block, entry = divmod(slot, slots_per_block)
    byte(slot)   = offset_bytes + block * block_stride_bytes + entry * slot_stride_bytes

Two shapes of storage are covered by that formula:

* a flat table of slots, `uint8 [num_slots, row_bytes]` with `row_bytes >= record_bytes`
  (`PagedRecords.flat`): one block holding every slot;
* one region of a paged block pool (`model/cache/layout.py`): the pool is
  `uint8 [num_blocks, block_bytes]`, the region starts at `region_offset` inside every block and
  holds `entries` records back to back (`PagedRecords.region`). Slot `s` is entry `s % entries` of
  block `s // entries`, so a sequence's entry `e` is slot `block_table[e // entries] * entries +
  e % entries` (:func:`entries_to_slots`).

Slot -1 means "no record" everywhere (writers skip it, readers return zeros, attention masks it);
kernels also treat slots outside `[0, num_slots)` as -1 instead of touching memory out of bounds,
so a bad slot never corrupts the pool (the torch references raise instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor


@dataclass(frozen=True)
class PagedRecords:
    """Addressing of fixed-size records inside a uint8 storage tensor (see the module docstring)."""

    storage: Tensor
    """uint8, contiguous, any shape: addressed as flat bytes from its first element."""
    record_bytes: int
    """Bytes of one record (288, 68, 528 at the released widths)."""
    slots_per_block: int
    """Records per block."""
    slot_stride_bytes: int
    """Bytes from one record of a block to the next (>= record_bytes)."""
    block_stride_bytes: int
    """Bytes from one block to the next (0 when there is one block)."""
    offset_bytes: int = 0
    """Byte offset of slot 0 from the start of `storage`."""

    def __post_init__(self) -> None:
        s = self.storage
        if s.dtype != torch.uint8:
            raise TypeError(f"PagedRecords.storage must be uint8, got {s.dtype}")
        if not s.is_contiguous():
            raise ValueError("PagedRecords.storage must be contiguous (it is addressed as flat bytes)")
        if self.record_bytes <= 0 or self.slots_per_block <= 0:
            raise ValueError(f"PagedRecords: record_bytes and slots_per_block must be positive, "
                             f"got {self.record_bytes}, {self.slots_per_block}")
        if self.slot_stride_bytes < self.record_bytes:
            raise ValueError(f"PagedRecords: slot_stride_bytes {self.slot_stride_bytes} < record_bytes "
                             f"{self.record_bytes}")
        if self.offset_bytes < 0 or self.block_stride_bytes < 0:
            raise ValueError("PagedRecords: offset_bytes and block_stride_bytes must be >= 0")
        block_span = (self.slots_per_block - 1) * self.slot_stride_bytes + self.record_bytes
        if self.block_stride_bytes and self.block_stride_bytes < block_span:
            raise ValueError(f"PagedRecords: block_stride_bytes {self.block_stride_bytes} is smaller than a "
                             f"block's records ({block_span} B): blocks would overlap")
        if self.offset_bytes + block_span > s.numel():
            raise ValueError(f"PagedRecords: the first block's records end at byte {self.offset_bytes + block_span}, "
                             f"past the storage ({s.numel()} B)")
        if self.num_slots >= 2**31:
            raise ValueError(f"PagedRecords: {self.num_slots} slots; the kernels address slots as int32 (< 2**31)")

    # ------------------------------------------------------------------ constructors

    @classmethod
    def flat(cls, table: Tensor, record_bytes: int) -> PagedRecords:
        """Slots as the rows of `table`, uint8 `[num_slots, row_bytes]` (rows may be wider than a
        record; `table` may be a row-strided view into bigger storage, as long as each row's
        bytes are contiguous)."""
        if table.dtype != torch.uint8 or table.dim() != 2:
            raise ValueError(f"PagedRecords.flat: expected uint8 [num_slots, row_bytes], got {table.dtype} "
                             f"{list(table.shape)}")
        if table.shape[1] < record_bytes or (table.shape[1] > 1 and table.stride(1) != 1):
            raise ValueError(f"PagedRecords.flat: rows must hold {record_bytes} contiguous bytes, got shape "
                             f"{list(table.shape)} strides {table.stride()}")
        rows, row_stride = table.shape[0], table.stride(0)
        base = _base_storage(table, rows, row_stride)
        return cls(base, record_bytes, slots_per_block=rows, slot_stride_bytes=row_stride,
                   block_stride_bytes=0, offset_bytes=0)

    @classmethod
    def region(cls, pool: Tensor, region_offset: int, entries: int, record_bytes: int) -> PagedRecords:
        """One region of every block of a pool `uint8 [num_blocks, block_bytes]`: `entries`
        records back to back from byte `region_offset` of each block."""
        if pool.dtype != torch.uint8 or pool.dim() != 2 or not pool.is_contiguous():
            raise ValueError(f"PagedRecords.region: expected a contiguous uint8 [num_blocks, block_bytes] pool, got "
                             f"{pool.dtype} {list(pool.shape)}")
        if region_offset < 0 or region_offset + entries * record_bytes > pool.shape[1]:
            raise ValueError(f"PagedRecords.region: {entries} records of {record_bytes} B at offset {region_offset} "
                             f"do not fit a {pool.shape[1]} B block")
        return cls(pool, record_bytes, slots_per_block=entries, slot_stride_bytes=record_bytes,
                   block_stride_bytes=pool.shape[1], offset_bytes=region_offset)

    # ------------------------------------------------------------------ derived

    @cached_property  # the fields are frozen; launchers read these on every call
    def num_blocks(self) -> int:
        """Whole blocks that fit the storage."""
        if self.block_stride_bytes == 0:
            return 1
        block_span = (self.slots_per_block - 1) * self.slot_stride_bytes + self.record_bytes
        return max(0, (self.storage.numel() - self.offset_bytes - block_span) // self.block_stride_bytes + 1)

    @property
    def num_slots(self) -> int:
        """Valid slot numbers are `[0, num_slots)`."""
        return self.num_blocks * self.slots_per_block

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @cached_property
    def alignment(self) -> int:
        """Largest power of two (<= 16) dividing every record's byte address."""
        align = 16
        for value in (self.storage.data_ptr(), self.offset_bytes, self.slot_stride_bytes,
                      self.block_stride_bytes, self.record_bytes):
            while align > 1 and value % align:
                align //= 2
        return align

    def byte_offsets(self, slots: Tensor) -> Tensor:
        """int64 byte offsets of `slots` (any shape, any integer dtype); -1 stays -1. `IndexError`
        for other slots outside `[0, num_slots)`."""
        slots = slots.long()
        bad = (slots < -1) | (slots >= self.num_slots)
        if bool(bad.any()):
            raise IndexError(f"slot {int(slots[bad].flatten()[0])} outside [0, {self.num_slots}) (or -1 for none)")
        block, entry = slots.div(self.slots_per_block, rounding_mode="floor"), slots.remainder(self.slots_per_block)
        offsets = self.offset_bytes + block * self.block_stride_bytes + entry * self.slot_stride_bytes
        return torch.where(slots >= 0, offsets, torch.full_like(offsets, -1))

    def gather(self, slots: Tensor) -> Tensor:
        """uint8 `[*slots.shape, record_bytes]` copies of the records at `slots` (zeros at -1)."""
        offsets = self.byte_offsets(slots)
        flat = self.storage.view(-1)
        index = offsets.clamp_min(0).unsqueeze(-1) + torch.arange(self.record_bytes, device=flat.device)
        records = flat[index]
        return records.masked_fill((offsets < 0).unsqueeze(-1), 0)

    def scatter(self, slots: Tensor, records: Tensor) -> None:
        """Write uint8 `records [*slots.shape, record_bytes]` at `slots` (rows at -1 are skipped).
        Duplicate slots are an error of the caller (the last write wins on CPU)."""
        if records.shape != (*slots.shape, self.record_bytes) or records.dtype != torch.uint8:
            raise ValueError(f"scatter: expected uint8 records {[*slots.shape, self.record_bytes]}, got "
                             f"{records.dtype} {list(records.shape)}")
        offsets = self.byte_offsets(slots).flatten()
        keep = offsets >= 0
        index = offsets[keep].unsqueeze(-1) + torch.arange(self.record_bytes, device=offsets.device)
        self.storage.view(-1)[index.flatten()] = records.reshape(-1, self.record_bytes)[keep].flatten()


def _base_storage(table: Tensor, rows: int, row_stride: int) -> Tensor:
    """A contiguous uint8 tensor starting at `table`'s first byte and covering its last row."""
    if rows == 0:
        return table.new_empty(0)
    span = (rows - 1) * row_stride + table.shape[1]
    return table.as_strided((span,), (1,))


def entries_to_slots(entries: Tensor, block_table: Tensor, slots_per_block: int) -> Tensor:
    """Slots of a sequence's compressed entries: `entries [..., K]` (entry numbers of the
    sequence, -1 = none) through `block_table [..., max_blocks]` (the sequence's block ids, rows
    broadcasting against `entries`' leading dims) -> int32 slots (-1 stays -1).

    Entry `e` lives in block `block_table[e // slots_per_block]` at entry `e % slots_per_block`.
    """
    entries = entries.long()
    valid = entries >= 0
    safe = entries.clamp_min(0)
    blocks = torch.gather(block_table.long().expand(*entries.shape[:-1], block_table.shape[-1]), -1,
                          safe.div(slots_per_block, rounding_mode="floor"))
    slots = blocks * slots_per_block + safe.remainder(slots_per_block)
    return torch.where(valid, slots, torch.full_like(slots, -1)).to(torch.int32)
