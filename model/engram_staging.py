"""Engram rows for the model runner's captured step when an `EngramStore` serves the tables.

With the tables in memory, the slot step hashes each row's n-grams on the device and looks its rows
up in the tables (`SlotStep._engram_rows`). With the tables memory-mapped on the host
(`load_model(..., engram="mmap")`, the released model's ~196B parameters) the step cannot read them:
a CUDA graph addresses fixed device memory, and a host read inside it would be a sync. A row's table
rows depend only on its token id, its position and its slot's last N-1 tokens, all known on the host
before the step runs, so per step, before the replay, `EngramStaging`:

1. `stage`: hashes each row's n-grams on the host (`EngramHasher.hash_rows`, the device step's
   arithmetic) from `history`, a host copy of every slot's Engram ring (`SlotPools.engram_ids`:
   position p at row `p % (N - 1 + R)`, kept in step by `load` and `stage`; a rewind only moves the
   runner's positions, as on the device), and copies the rows as stored (FP8 values and their
   scales, or BF16 / F32 values) from the maps into the pinned byte buffer `host[:n]`;
2. `upload`: one asynchronous pinned-host-to-device copy of those n rows into `buffer`, the static
   device buffer the captured step reads;
3. in the step, `device_rows(bucket)` turns `buffer[:bucket]` into the rows `[bucket, engram layers,
   columns, head_dim]` of the model's dtype with the loader's arithmetic
   (`engram.dequantize_engram_rows`: one float32 product per value, so the same bits as the table
   the loader dequantizes on the host; device ops only, so it is captured with the step).

Staging rows as stored, not dequantized, keeps the host's part to a gather and a copy (for a
64-row step on the development VM, 1.3 ms of CPU against 4.7 ms with the rows dequantized on the
host, benchmarks/engram_staging.py) and the copy small (13.5 KiB per row for the released FP8
tables instead of 48 KiB in float32). One staged row, all Engram layers, is `row_bytes` bytes: per
layer its `columns x head_dim` stored values, then (F8 tables) its `columns x head_dim / 32` scales,
each region 16-byte aligned.

The step still writes each row's compressed id into the device ring, which `SlotPools.export` reads.
Padding rows of a bucket (`buffer[n:bucket]`) are not staged: they hold zeros or rows an earlier step
staged there (`buffer` never holds anything else), finite table values whose outputs the runner
discards (padding rows write only the scratch slot).

The caller owns the ordering: `stage` must not refill `host` while the previous `upload` may still
be reading it (the runner waits on the event it records after each step's copies).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from cedserve.model.config import ModelConfig
from cedserve.model.engram import EngramHasher, dequantize_engram_rows
from cedserve.model.engram_store import EngramStore, MappedTable
from cedserve.model.safetensors_file import RAW_DTYPES

_ALIGN = 16
"""Bytes each region of a staged row starts on (any dtype's view of it is then aligned)."""


@dataclass(frozen=True)
class _Region:
    """One layer's stored values (or their scales) in a staged row: `shape` elements of `dtype`
    from byte `offset`."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, int]  # [columns, head_dim] or [columns, head_dim / 32]

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.dtype.itemsize

    def of(self, buffer: Tensor, count: int) -> Tensor:
        """The region of rows `buffer[:count]` (uint8 `[width, row_bytes]`) as `[count, *shape]`."""
        region = buffer[:count, self.offset : self.offset + self.nbytes].view(self.dtype)
        return region.view(count, *self.shape)


@dataclass(frozen=True)
class _Layout:
    weights: tuple[_Region, ...]  # per Engram layer
    scales: tuple[_Region | None, ...]  # per Engram layer: None unless its table is F8
    row_bytes: int


def _layout(tables: Sequence[MappedTable], columns: int) -> _Layout:
    weights: list[_Region] = []
    scales: list[_Region | None] = []
    offset = 0

    def region(dtype: torch.dtype, width: int) -> _Region:
        nonlocal offset
        placed = _Region(offset, dtype, (columns, width))
        offset += -(-placed.nbytes // _ALIGN) * _ALIGN
        return placed

    for table in tables:
        weights.append(region(RAW_DTYPES[table.weight_dtype][1], int(table.weight.shape[1])))
        scale = table.scale
        scales.append(
            None if scale is None else region(RAW_DTYPES[table.scale_dtype][1], int(scale.shape[1]))
        )
    return _Layout(tuple(weights), tuple(scales), offset)


def staged_row_bytes(store: EngramStore, config: ModelConfig) -> int:
    """Bytes one step row's Engram rows take in the staging buffers (what `upload` copies per row)."""
    return _layout(store.tables, (config.engram_max_ngram_size - 1) * config.engram_n_heads).row_bytes


class EngramStaging:
    """Per-step Engram rows of the model runner's rows, from an `EngramStore` (module docstring)."""

    def __init__(
        self,
        store: EngramStore,
        hasher: EngramHasher,
        config: ModelConfig,
        max_slots: int,
        max_rows_per_slot: int,
        width: int,
        device: torch.device,
    ) -> None:
        """`max_slots + 1` histories (the last: the runner's scratch slot, never staged), rings of
        `N - 1 + max_rows_per_slot` ids as `SlotPools`'; buffers of `width` rows (the largest bucket)."""
        if len(store.tables) != len(config.engram_layer_ids):
            raise ValueError(
                f"the EngramStore maps {len(store.tables)} tables, the config has "
                f"{len(config.engram_layer_ids)} Engram layers"
            )
        self.store, self.dtype, self.device = store, store.dtype, torch.device(device)
        self.hasher = hasher.to(torch.device("cpu"))
        self.keep = config.engram_max_ngram_size - 1
        self.ring = self.keep + max_rows_per_slot
        self.history = torch.zeros(max_slots + 1, self.ring, dtype=torch.long)
        self.first = torch.zeros(max_slots + 1, dtype=torch.long)
        self.columns = (config.engram_max_ngram_size - 1) * config.engram_n_heads
        self.layout = _layout(store.tables, self.columns)
        shape = (width, self.layout.row_bytes)
        self.host = torch.zeros(shape, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        """Staged rows, as stored (module docstring): uint8 `[width, row_bytes]`, pinned on CUDA."""
        self.buffer = torch.zeros(shape, dtype=torch.uint8, device=self.device)
        """What the step reads: `host`'s layout, row i for step row i."""

    @property
    def width(self) -> int:
        return int(self.buffer.shape[0])

    @property
    def row_bytes(self) -> int:
        return self.layout.row_bytes

    @property
    def nbytes(self) -> int:
        """Device bytes (`buffer`); the pinned host buffer is as large."""
        return self.buffer.numel()

    def load(self, slot: int, engram_tail: Tensor, position: int) -> None:
        """A sequence joins `slot` at `position` with the compressed ids of its last tokens
        (`SequenceState.engram_tail`), as `SlotPools.load` fills the device ring."""
        tail = engram_tail[-self.keep :] if self.keep else engram_tail[:0]
        count = int(tail.shape[0])
        self.first[slot] = position - count
        if count:
            self.history[slot, torch.arange(position - count, position) % self.ring] = tail.cpu()

    def hash_ids(self, slots: Sequence[int], token_ids: Sequence[int], positions: Sequence[int]) -> Tensor:
        """Row ids `[n, engram layers, columns]` of step rows `token_ids` at `positions` of `slots`
        (a slot's rows adjacent, at consecutive positions); writes their compressed ids into the
        slots' histories first, so a row reads the rows before it in the same step, as on the device."""
        slot_ids = torch.tensor(list(slots), dtype=torch.long)
        where = torch.tensor(list(positions), dtype=torch.long)
        compressed = self.hasher.compress(torch.tensor(list(token_ids), dtype=torch.long))
        self.history[slot_ids, where % self.ring] = compressed
        before = where.unsqueeze(-1) - self.keep + torch.arange(self.keep)  # [n, N-1]
        history = self.history[slot_ids.unsqueeze(-1), before.remainder(self.ring)]
        known = (where - self.first[slot_ids].clamp_min(0)).clamp(0, self.keep)
        return self.hasher.hash_rows(history, known, compressed)

    def stage(self, slots: Sequence[int], token_ids: Sequence[int], positions: Sequence[int]) -> int:
        """Copy the stored rows of the step's rows into `host[:n]` (module docstring, step 1);
        returns n. `ValueError` for more rows than `width` or an id outside its table."""
        if len(slots) > self.width:
            raise ValueError(f"Engram staging: {len(slots)} rows exceed its {self.width}")
        return self.stage_ids(self.hash_ids(slots, token_ids, positions)) if slots else 0

    def stage_ids(self, hash_ids: Tensor) -> int:
        """Copy the stored rows of `hash_ids [n, engram layers, columns]` into `host[:n]`; returns n."""
        count = int(hash_ids.shape[0])
        if count > self.width:
            raise ValueError(f"Engram staging: {count} rows exceed its {self.width}")
        ids = hash_ids.numpy()
        layout = self.layout
        for i, table in enumerate(self.store.tables):
            raw, scale = table.stored_rows(np.ascontiguousarray(ids[:, i]).reshape(-1))
            layout.weights[i].of(self.host, count).copy_(raw.view(count, self.columns, -1))
            region = layout.scales[i]
            if region is not None and scale is not None:
                region.of(self.host, count).copy_(scale.view(count, self.columns, -1))
        return count

    def upload(self, count: int) -> None:
        """Copy the `count` staged rows into `buffer` (asynchronous from pinned memory on CUDA)."""
        if count:
            self.buffer[:count].copy_(self.host[:count], non_blocking=True)

    def device_rows(self, count: int) -> Tensor:
        """Rows `[count, engram layers, columns, head_dim]` of the store's dtype from `buffer[:count]`,
        on its device, by device ops only (the captured step calls this)."""
        per_layer = []
        for weights, scales in zip(self.layout.weights, self.layout.scales):
            raw = weights.of(self.buffer, count)
            if scales is None:
                per_layer.append(raw.to(self.dtype))
            else:
                per_layer.append(dequantize_engram_rows(raw, scales.of(self.buffer, count), self.dtype))
        return torch.stack(per_layer, dim=1)
