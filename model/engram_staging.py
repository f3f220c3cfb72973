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
   runner's positions, as on the device), and gathers the rows from the maps into the pinned
   `rows_host[:n]` (dequantized to the store's dtype, `EngramStore.gather`);
2. `upload`: one asynchronous pinned-host-to-device copy of those n rows into `rows`, the static
   buffer the captured step reads in place of the lookup (`rows[:bucket]`, fixed addresses).

The step still writes each row's compressed id into the device ring, which `SlotPools.export` reads.
Padding rows of a bucket (`rows[n:bucket]`) are not staged: they read zeros or rows an earlier step
staged there (`rows` never holds anything else), finite table values whose outputs the runner
discards (padding rows write only the scratch slot).

Sizes (`staged_row_bytes`): one row is `engram layers x (N - 1) x heads x head_dim` values of the
store's dtype. Released model (2 layers, 2-4-grams x 8 heads, 256 channels): 12,288 values, 48 KiB per row in
float32 (24 KiB in bf16); a step of B rows copies B x that (1.5 MiB at 32 rows, about 28 us at the
55 GB/s pinned-host-to-device rate measured on an H200 host). `rows_host` (pinned) and `rows`
(device) each hold the largest bucket's rows.

The caller owns the ordering: `stage` must not refill `rows_host` while the previous `upload` may
still be reading it (the runner waits on the event it records after each step's copies).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from cedserve.model.config import ModelConfig
from cedserve.model.engram import EngramHasher
from cedserve.model.engram_store import EngramStore


def staged_row_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one step row's Engram rows (what `upload` copies per row)."""
    columns = (config.engram_max_ngram_size - 1) * config.engram_n_heads
    return len(config.engram_layer_ids) * columns * config.engram_head_dim * dtype.itemsize


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
        self.store, self.config, self.device = store, config, torch.device(device)
        self.hasher = hasher.to(torch.device("cpu"))
        self.keep = config.engram_max_ngram_size - 1
        self.ring = self.keep + max_rows_per_slot
        self.history = torch.zeros(max_slots + 1, self.ring, dtype=torch.long)
        self.first = torch.zeros(max_slots + 1, dtype=torch.long)
        columns = (config.engram_max_ngram_size - 1) * config.engram_n_heads
        shape = (width, len(config.engram_layer_ids), columns, config.engram_head_dim)
        pin = self.device.type == "cuda"
        self.rows_host = torch.zeros(shape, dtype=store.dtype, pin_memory=pin)
        self.rows = torch.zeros(shape, dtype=store.dtype, device=self.device)
        """What the step reads: `[width, engram layers, columns, head_dim]`, row i for step row i."""

    @property
    def width(self) -> int:
        return int(self.rows.shape[0])

    @property
    def nbytes(self) -> int:
        """Device bytes (`rows`); the pinned host buffer is as large."""
        return self.rows.numel() * self.rows.element_size()

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
        """Gather the rows of the step's rows into `rows_host[:n]` (module docstring, step 1);
        returns n. `ValueError` for more rows than `width`."""
        count = len(slots)
        if count > self.width:
            raise ValueError(f"Engram staging: {count} rows exceed its {self.width}")
        if count:
            self.store.gather(self.hash_ids(slots, token_ids, positions), out=self.rows_host)
        return count

    def upload(self, count: int) -> None:
        """Copy the `count` staged rows into `rows` (asynchronous from pinned memory on CUDA)."""
        if count:
            self.rows[:count].copy_(self.rows_host[:count], non_blocking=True)
