"""Decode state in preallocated, slot-indexed device pools: what a captured decode step addresses.

A `SequenceState` holds one sequence's state as tensors of its own, which grow and are replaced as
it decodes; a step over such states is a host loop over sequences, and its shapes change every
step. `SlotPools` holds the same state for up to `max_slots` sequences at fixed addresses, so one
step over any set of slots is the same kernels on the same buffers (`cedserve.model.runner`
captures it as a CUDA graph):

* `position [slots + 1]`: tokens consumed (the next token's position).
* `swa [layers, slots + 1, W + R - 1, 528]`: each layer's window as a ring of records, position p
  at ring row `p % (W + R - 1)` (`W = sliding_window`, R = rows a slot may feed in one step: the
  first row's window and the last row's record both fit). `swa_first [layers, slots + 1]`: the
  first position the ring holds (rows before it are stale: a replay or a load starts the window).
* `pending_kv`, `pending_gate [slots + 1, m + R - 1, D]` per KV source with ratio m > 1: the
  compressor's projected tokens, token p at row `p % (m + R - 1)` (float32, as `PendingGroup`).
* `storage [1 + slots x blocks_per_slot, block_bytes]`: global KV records in `BlockLayout` blocks,
  the cache's and the transfers' layout. Slot s owns blocks `1 + s x blocks_per_slot ..`
  (`block_table [slots + 1, blocks_per_slot]`); block 0 and the last slot are the scratch that
  padding rows of a bucket write to, so a padded step never touches a real slot.
* `engram_ids [slots + 1, N - 1 + R]`: a ring of Engram-compressed token ids (position p at row
  `p % (N - 1 + R)`), `engram_first`: the first position whose id is known (n-grams before it read
  the pad id, as after a replay).

Rolling a slot back (rejected drafts) is only a smaller `position`: every ring is long enough that
the rows a step wrote past the kept tokens never overwrote one the next step reads.

`load` copies a `SequenceState` into a slot, `export` gives one back (the engine's other paths, an
offload or a shipped state read it); both are whole-state copies off the step's path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cedserve.kernels.paged import PagedRecords
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.compressor import PendingGroup
from cedserve.model.config import AttentionMode, ModelConfig
from cedserve.model.kv_format import KVFormat, window_row_bytes
from cedserve.model.paged_attention import arena_block_size
from cedserve.model.state import GlobalKV, SequenceState


@dataclass(frozen=True)
class SlotShape:
    """How many sequences and tokens the pools hold."""

    max_slots: int
    max_context: int
    """Tokens a slot can hold (its prompt and every decoded token)."""
    max_rows_per_slot: int = 1
    """Rows one slot may feed in one step (1 + drafts for a DSpark verify, plus carried tokens)."""

    def __post_init__(self) -> None:
        if self.max_rows_per_slot < 1:
            raise ValueError(f"runner field `max_rows_per_slot`: must be >= 1, got {self.max_rows_per_slot}")
        if self.max_slots < 1:
            raise ValueError(f"runner field `max_slots`: must be >= 1, got {self.max_slots}")
        if self.max_context < 1:
            raise ValueError(f"runner field `max_context`: must be >= 1, got {self.max_context}")


def slot_pool_bytes(config: ModelConfig, shape: SlotShape, block_size: int) -> int:
    """Device bytes `SlotPools(config, shape, device, storage, layout)` allocates beside a shared
    block pool of `block_size`-token blocks (the decode worker's case), without allocating them:
    what a worker's start-up memory check counts for its runner."""
    slots, extra = shape.max_slots + 1, shape.max_rows_per_slot - 1
    long_bytes, float_bytes = 8, torch.get_default_dtype().itemsize
    layers = config.num_hidden_layers
    swa = layers * slots * (config.sliding_window + extra) * window_row_bytes(KVFormat.RECORDS, config.head_dim)
    table = slots * -(-shape.max_context // block_size) * 4  # int32 [slots, blocks_per_slot]
    pending = sum(2 * slots * (spec.compress_ratio + extra) * config.head_dim * float_bytes
                  for spec in config.layer_plan if spec.mode is AttentionMode.FULL and spec.compress_ratio > 1)
    engram_keep = max(0, config.engram_max_ngram_size - 1) if config.engram_layer_ids else 0
    engram = slots * (engram_keep + shape.max_rows_per_slot + 1) * long_bytes  # ids ring and first
    return slots * long_bytes + swa + layers * slots * long_bytes + table + pending + engram


class SlotPools:
    """Every slot's decode state at fixed device addresses (module docstring)."""

    def __init__(self, config: ModelConfig, shape: SlotShape, device: torch.device,
                 storage: Tensor | None = None, layout: BlockLayout | None = None) -> None:
        """With `storage` (and its `layout`): the global KV lives in that pool (the decode worker's
        cache blocks), each slot's block table is set by `load` / `set_blocks`, and nothing is
        copied: the step writes each new record into the request's own block."""
        self.config, self.shape, self.device = config, shape, torch.device(device)
        slots = shape.max_slots + 1  # the last one is the padding rows' scratch
        self.scratch_slot = shape.max_slots
        self.window = config.sliding_window
        extra = shape.max_rows_per_slot - 1
        self.ring = self.window + extra
        layers, dim = config.num_hidden_layers, config.head_dim
        self.swa_record_bytes = window_row_bytes(KVFormat.RECORDS, dim)
        self.position = torch.zeros(slots, dtype=torch.long, device=self.device)
        self.swa = torch.zeros(layers, slots, self.ring, self.swa_record_bytes, dtype=torch.uint8,
                               device=self.device)
        self.swa_first = torch.zeros(layers, slots, dtype=torch.long, device=self.device)
        self.shared = storage is not None
        if storage is not None:
            if layout is None or storage.dim() != 2 or storage.shape[1] != layout.block_bytes:
                raise ValueError("slot pools over a shared block pool need its layout and a [blocks, block_bytes] "
                                 "storage")
            if storage.device != self.device:
                raise ValueError(f"the block pool is on {storage.device}, the model on {self.device}")
            self.layout, self.storage = layout, storage
            self.blocks_per_slot = -(-shape.max_context // layout.block_size)
            self.block_table = torch.zeros(slots, self.blocks_per_slot, dtype=torch.int32, device=self.device)
        else:
            self.layout = BlockLayout.from_config(config, arena_block_size(config))
            self.blocks_per_slot = -(-shape.max_context // self.layout.block_size)
            self.storage = torch.zeros(1 + shape.max_slots * self.blocks_per_slot, self.layout.block_bytes,
                                       dtype=torch.uint8, device=self.device)
            owned = 1 + torch.arange(shape.max_slots * self.blocks_per_slot, dtype=torch.int32, device=self.device)
            scratch = torch.zeros(1, self.blocks_per_slot, dtype=torch.int32, device=self.device)
            self.block_table = torch.cat([owned.view(shape.max_slots, self.blocks_per_slot), scratch])
        self.sources = [spec for spec in config.layer_plan if spec.mode is AttentionMode.FULL]
        self.pending_kv: dict[int, Tensor] = {}
        self.pending_gate: dict[int, Tensor] = {}
        self.pending_ring: dict[int, int] = {}
        for spec in self.sources:
            if spec.compress_ratio > 1:
                rows = self.pending_ring[spec.layer_id] = spec.compress_ratio + extra
                self.pending_kv[spec.layer_id] = torch.zeros(slots, rows, dim, device=self.device)
                self.pending_gate[spec.layer_id] = torch.zeros(slots, rows, dim, device=self.device)
        self.engram_keep = max(0, config.engram_max_ngram_size - 1) if config.engram_layer_ids else 0
        self.engram_ring = self.engram_keep + shape.max_rows_per_slot
        self.engram_ids = torch.zeros(slots, self.engram_ring, dtype=torch.long, device=self.device)
        self.engram_first = torch.zeros(slots, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------ addressing

    def records(self, layer_id: int, kind: str) -> PagedRecords:
        """KV source `layer_id`'s `kind` ("main" / "index") records over every block."""
        region = self.layout.region(layer_id, kind)
        return PagedRecords.region(self.storage, region.offset, region.entries, region.record_bytes)

    def window_records(self, layer_id: int) -> PagedRecords:
        """Layer `layer_id`'s rings as one table: slot `s x ring + p % ring` holds position p of slot s."""
        table = self.swa[layer_id].view(-1, self.swa_record_bytes)
        rec = self.swa_record_bytes
        return PagedRecords(table, rec, slots_per_block=self.ring, slot_stride_bytes=rec,
                            block_stride_bytes=self.ring * rec)

    def entries_per_block(self, layer_id: int) -> int:
        return self.layout.region(layer_id, "main").entries

    def max_entries(self, layer_id: int) -> int:
        """Entries of KV source `layer_id` a slot can hold."""
        return self.blocks_per_slot * self.entries_per_block(layer_id)

    @property
    def nbytes(self) -> int:
        tensors = [self.position, self.swa, self.swa_first, self.storage, self.block_table, self.engram_ids,
                   self.engram_first, *self.pending_kv.values(), *self.pending_gate.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ load / export

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.shape.max_slots:
            raise ValueError(f"slot {slot} outside [0, {self.shape.max_slots})")

    def set_blocks(self, slot: int, block_ids: list[int]) -> None:
        """Shared pools: the slot's block table row (the request's blocks, in order)."""
        self.check_slot(slot)
        if not self.shared:
            raise ValueError("set_blocks: these pools own their blocks")
        if len(block_ids) > self.blocks_per_slot:
            raise ValueError(f"{len(block_ids)} blocks exceed a slot's {self.blocks_per_slot}")
        # pinned and not waited for: the copy is ordered after the steps already launched (an
        # overlapped step still reads the old row) and before the next, and the caching host
        # allocator keeps the pinned row until the copy is done. A pageable copy made the host wait
        # for every step in flight: with overlapped steps, each time a request crossed into a new block.
        cuda = self.block_table.is_cuda
        row = torch.zeros(self.blocks_per_slot, dtype=torch.int32, pin_memory=cuda)
        row[: len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        self.block_table[slot].copy_(row, non_blocking=cuda)

    def rewind(self, slot: int, position: int) -> None:
        """Forget the slot's tokens from `position` on (rejected drafts): only the position moves,
        by a fill kernel (an item store, `position[slot] = p`, copies a host scalar in and waits for
        it: a host sync per rewound slot, 32 per verify step at batch 32 on an H100)."""
        self.check_slot(slot)
        self.position.narrow(0, slot, 1).fill_(position)

    def load(self, slot: int, state: SequenceState, block_ids: list[int] | None = None) -> None:
        """Copy `state` into `slot` (whatever the slot held is forgotten). Shared pools take the
        request's `block_ids`, whose blocks must already hold the state's records (they are not
        copied). `ValueError` when the state is not in the record format or holds more tokens than
        a slot."""
        self.check_slot(slot)
        if self.shared != (block_ids is not None):
            raise ValueError("load: give block_ids exactly when the pools share a block pool")
        if state.kv_format is not KVFormat.RECORDS:
            raise ValueError(f"slot pools hold record states, got {state.kv_format}")
        pos = state.position
        if pos >= self.shape.max_context:
            raise ValueError(f"a state at position {pos} does not fit a slot of {self.shape.max_context} tokens "
                             "(raise the runner's max_context)")
        # Fills and one vector copy, not item stores: each `t[i] = value` copies a host scalar in and
        # waits for it (~40 host syncs a join for mini-40's layers before this).
        self.position.narrow(0, slot, 1).fill_(pos)
        if state.swa:
            layers = sorted(state.swa)
            firsts = torch.tensor([pos - int(state.swa[layer].shape[0]) for layer in layers], dtype=torch.long)
            if layers == list(range(len(layers))):
                self.swa_first[: len(layers), slot].copy_(firsts)
            else:
                self.swa_first[torch.tensor(layers, device=self.device), slot] = firsts.to(self.device)
        for layer, records in state.swa.items():
            n = int(records.shape[0])
            if n:
                rows = torch.arange(pos - n, pos, device=self.device) % self.ring
                self.swa[layer, slot, rows] = records.to(self.device)
        if block_ids is not None:
            self.set_blocks(slot, block_ids)
        for spec in self.sources:
            kv = state.global_kv[spec.layer_id]
            if block_ids is None:
                self._load_records(slot, spec.layer_id, kv)
            if spec.compress_ratio > 1:
                pending = kv.pending
                n = int(pending.kv.shape[0])
                if n:
                    rows = torch.arange(kv.next_group_position, kv.next_group_position + n,
                                        device=self.device) % self.pending_ring[spec.layer_id]
                    self.pending_kv[spec.layer_id][slot, rows] = pending.kv.to(self.device)
                    self.pending_gate[spec.layer_id][slot, rows] = pending.gate.to(self.device)
        tail = state.engram_tail[-self.engram_keep:] if self.engram_keep else state.engram_tail[:0]
        n = int(tail.shape[0])
        self.engram_first.narrow(0, slot, 1).fill_(pos - n)
        if n:
            self.engram_ids[slot, torch.arange(pos - n, pos, device=self.device) % self.engram_ring] = \
                tail.to(self.device)

    def _load_records(self, slot: int, layer_id: int, kv: GlobalKV) -> None:
        count = kv.num_entries
        if count == 0:
            return
        per_block = self.entries_per_block(layer_id)
        entries = torch.arange(count, device=self.device)
        blocks = self.block_table[slot].long()[entries // per_block]
        for kind, rows in (("main", kv.main), ("index", kv.index_keys)):
            self.layout.pool_view(self.storage, layer_id, kind)[blocks, entries % per_block] = rows.to(self.device)

    def export(self, slot: int) -> SequenceState:
        """The slot's state as a `SequenceState` (copies), which `load` takes back unchanged."""
        self.check_slot(slot)
        config = self.config
        state = SequenceState.new(config, self.device)
        # one read of the host values export needs: position, each layer's ring start, the Engram start
        pos, *swa_first, engram_first = torch.cat([self.position[slot:slot + 1], self.swa_first[:, slot],
                                                   self.engram_first[slot:slot + 1]]).tolist()
        state.position = pos
        for layer in range(config.num_hidden_layers):
            first = max(swa_first[layer], pos - (self.window - 1), 0)
            rows = torch.arange(first, pos, device=self.device) % self.ring
            state.swa[layer] = self.swa[layer, slot, rows].clone()
        for spec in self.sources:
            layer, ratio = spec.layer_id, spec.compress_ratio
            count = pos // ratio
            per_block = self.entries_per_block(layer)
            entries = torch.arange(count, device=self.device)
            blocks = self.block_table[slot].long()[entries // per_block]
            main = self.layout.pool_view(self.storage, layer, "main")[blocks, entries % per_block].clone()
            keys = self.layout.pool_view(self.storage, layer, "index")[blocks, entries % per_block].clone()
            kv = state.global_kv[layer]
            kv.set_records(main, keys)
            if ratio > 1:
                rows = torch.arange(count * ratio, pos, device=self.device) % self.pending_ring[layer]
                kv.pending = PendingGroup(self.pending_kv[layer][slot, rows].clone(),
                                          self.pending_gate[layer][slot, rows].clone())
        first = max(engram_first, pos - self.engram_keep, 0)
        if pos > first:
            rows = torch.arange(first, pos, device=self.device) % self.engram_ring
            state.engram_tail = self.engram_ids[slot, rows].clone()
        return state
