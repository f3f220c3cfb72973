"""Attention through the compact-cache kernels, over a paged copy of the records.

The dense paths (`cedserve.model.batch` for the padded group of decode and verify chunks,
`Attention.attend_one` for every other chunk) dequantize every compressed entry of a sequence at
each KV source, score and attend over all of them with bool masks: O(context) work and memory per
token and layer. This path gives the same attention (same picks, same softmax over the union of
window, picks and sink) the way `cedserve.kernels` expect it, for a `PagedPass` of one or more
items: the padded group in one pass, or one chunk (prefill, `encode_chunk`, a replay) on its own:

* a `PagedArena` holds a paged copy of each sequence's global KV records (main KV and index keys)
  in `BlockLayout` blocks, the layout the cache and the transfers use, one device tensor that the
  kernels address by slot. A sequence owns whole blocks (`SequencePages`), allocated as it grows
  and returned when its state is freed. Each pass copies only the entries appended since the last
  one (`sync`); `SequenceState.restore` rewinds the copy so rolled-back entries are written again.
* index sources score the FP4 index keys in place and pick with the two-level top-k
  (`kernels.indexer.index_topk`: the candidate source's pool, Reindex layers inside it);
* every layer attends with one `kernels.sparse_attention` call over each query's picks (main-KV
  slots from its block table) and its window (the window records of the pass in one table), with
  no output rotation (`Attention._output` rotates back, as on the dense path).

`backend`: "kernels" runs the Triton / Gluon kernels (the GPU default; under `TRITON_INTERPRET=1`
the interpreter); "reference" runs the kernels' torch references through the same paged addressing
in the activations' dtype, the CPU oracle that checks this path's bookkeeping against the dense path.

Records stay in `SequenceState` as well (the source of truth for snapshots, shipping and the dense
path), so a sequence's global KV is held twice while it decodes here: 890 B per token per copy.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from cedserve.kernels.indexer import IndexKeys, IndexSelection, index_topk
from cedserve.kernels.paged import PagedRecords, entries_to_slots
from cedserve.kernels.sparse_attention import sparse_attention, sparse_attention_reference
from cedserve.kernels.triton_support import Impl
from cedserve.model.batch import device_ints
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.config import AttentionMode, ModelConfig
from cedserve.model.kv_format import KVFormat
from cedserve.model.state import GlobalKV, SequenceState

if TYPE_CHECKING:
    from cedserve.model.network import CEDModel

log = logging.getLogger(__name__)

Backend = Literal["kernels", "reference"]
BACKENDS: tuple[Backend, ...] = ("kernels", "reference")
MODES = ("auto", "kernels", "reference", "off")
"""A worker's `paged_attention` setting (`enable_paged_attention`)."""
MIN_BLOCK_TOKENS = 64
REFERENCE_ROWS = 256
"""Rows per call of the reference backend's attention (a prefill chunk's gathered keys, bounded)."""
WINDOW_TABLE_BLOCK = 64
"""Rows per block of a pass's window table (its row count is padded to a multiple)."""


def arena_block_size(config: ModelConfig) -> int:
    """Tokens per arena block: the smallest multiple of every KV source's ratio and of the candidate
    block's tokens that is at least `MIN_BLOCK_TOKENS`."""
    unit = 1
    for spec in config.layer_plan:
        if spec.mode is AttentionMode.FULL:
            unit = math.lcm(unit, spec.compress_ratio)
    cand = config.candidate_source_layer_id
    if config.has_candidate_pool and cand is not None:
        unit = math.lcm(unit, config.candidate_block_size * config.compress_ratios[cand])
    return unit * max(1, -(-MIN_BLOCK_TOKENS // unit))


def unsupported(config: ModelConfig) -> str | None:
    """Why the kernels cannot run this model's attention (None when they can)."""
    half, index_half = config.head_dim // 2, config.index_head_dim // 2
    if config.head_dim % 32 or half & (half - 1):
        return f"head_dim {config.head_dim} is not 2 x a power of two and a multiple of 32"
    if index_half & (index_half - 1) or index_half < 16:
        return f"index_head_dim {config.index_head_dim} is not 2 x a power of two >= 32"
    return None


def enable_paged_attention(model: CEDModel, mode: str, field_name: str, cpu_auto: Literal["reference", "off"]) -> str:
    """Set `model`'s attention path for a worker's `paged_attention` config field (`field_name`, named
    in errors); returns the path taken: "kernels", "reference" or "off". "auto": the kernels for every
    chunk on a CUDA device; on a CPU `cpu_auto`, for decode and verify groups only (the torch
    references beat the dense path there from a few thousand tokens of context, but a long chunk's
    per-row key gathers are slower than the dense path's shared keys: 2.0-2.7x on mini-40 at 2K-4K);
    "off" when the model's widths do not suit the kernels. An explicit path the model cannot take is
    an error."""
    if mode not in MODES:
        raise ValueError(f"config field `{field_name}`: must be one of {list(MODES)}, got {mode!r}")
    chunks = True
    if mode == "auto":
        if unsupported(model.config) is not None:
            mode = "off"
        elif model.embed.weight.device.type == "cuda":
            mode = "kernels"
        else:
            mode, chunks = cpu_auto, False
    if mode == "off":
        model.use_paged_attention(None)
        return mode
    try:
        model.use_paged_attention("kernels" if mode == "kernels" else "reference", chunks=chunks)
    except ValueError as exc:
        raise ValueError(f"config field `{field_name}`: {exc}") from exc
    log.info("attention: paged (%s%s)", mode, "" if chunks else ", decode groups only")
    return mode


def layer_topk(config: ModelConfig, layer_id: int, q: Tensor, weights: Tensor, keys: IndexKeys, width: int,
               pool: Tensor | None, impl: Impl, row_offsets: Tensor | None = None, max_rows: int = 1) -> IndexSelection:
    """Index source `layer_id`'s picks by the two-level rules: the candidate source picks over every
    visible entry and publishes its pool (`IndexSelection.candidates`), later sources pick inside
    `pool` (when one exists), others over every visible entry. `q` is cast to bf16 (FP4-quantized
    queries are exact in it). `row_offsets`, `max_rows`: the rows' runs of one request, for the
    scans over every visible entry (`cedserve.kernels.indexer.index_scores`)."""
    q = q.to(torch.bfloat16)
    cand = config.candidate_source_layer_id
    if layer_id == cand and config.has_candidate_pool:
        return index_topk(q, weights, keys, topk=config.index_topk, width=width,
                          candidate_blocks=config.candidate_topk_blocks,
                          candidate_block_size=config.candidate_block_size, impl=impl, row_offsets=row_offsets,
                          max_rows=max_rows)
    if cand is not None and 0 <= cand < layer_id and pool is not None:
        return index_topk(q, weights, keys, topk=config.index_topk, width=width, candidates=pool, impl=impl)
    return index_topk(q, weights, keys, topk=config.index_topk, width=width, impl=impl, row_offsets=row_offsets,
                      max_rows=max_rows)


@dataclass
class SequencePages:
    """One sequence's blocks in the arena and how many entries of each KV source are copied there."""

    blocks: list[int]
    synced: dict[int, int]
    """KV source -> entries copied (entries `[0, synced)` of its records are in the blocks)."""
    sources: dict[int, int] = field(default_factory=dict)
    """KV source -> `GlobalKV.generation` of the records copied (records replaced since: copy again)."""
    _release: Callable[[], object] | None = field(default=None, repr=False)

    def __deepcopy__(self, memo: dict[int, object]) -> None:
        """A copied state owns no blocks (these stay with the original): it pages itself at first use."""
        return None

    def release(self) -> None:
        """Return the blocks to the arena now (else when the state is freed)."""
        if self._release is not None:
            self._release()

    def rewind(self, global_kv: dict[int, GlobalKV]) -> None:
        for layer, kv in global_kv.items():
            self.synced[layer] = min(self.synced.get(layer, 0), kv.num_entries)


class PagedArena:
    """Paged device copy of the decoding sequences' global KV records (module docstring)."""

    def __init__(self, config: ModelConfig, device: torch.device, backend: Backend = "kernels",
                 initial_blocks: int = 64) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"paged decode backend must be one of {list(BACKENDS)}, got {backend!r}")
        reason = unsupported(config)
        if reason is not None:
            raise ValueError(f"paged decode: the kernels cannot run this model: {reason}")
        self.config, self.device, self.backend = config, device, backend
        self.layout = BlockLayout.from_config(config, arena_block_size(config))
        self._initial_blocks = max(1, initial_blocks)
        self.storage = torch.zeros(self._initial_blocks, self.layout.block_bytes, dtype=torch.uint8, device=device)
        self._free = list(range(self.storage.shape[0] - 1, -1, -1))
        self.copied_entries = 0
        """Entries copied into the arena so far (both record kinds of a source count once)."""

    @property
    def num_blocks(self) -> int:
        return int(self.storage.shape[0])

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages(self, state: SequenceState) -> SequencePages:
        """The state's place in the arena, made (with its release on the state's end) at first use."""
        place = state.paged
        if isinstance(place, SequencePages):
            return place
        if place is not None:
            raise ValueError("this state is already paged by another arena")
        if state.kv_format is not KVFormat.RECORDS:
            raise ValueError(f"paged decode needs record states, got {state.kv_format}")
        pages = SequencePages([], {})
        state.paged = pages
        pages._release = weakref.finalize(state, self._release, pages.blocks)
        return pages

    def _release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        blocks.clear()

    def trim(self) -> bool:
        """Shrink the storage back to its first size once no sequence holds a block (it grows by
        doubling for the largest batch x context seen and would otherwise keep that peak)."""
        if self.num_free != self.num_blocks or self.num_blocks <= self._initial_blocks:
            return False
        self.storage = torch.zeros(self._initial_blocks, self.layout.block_bytes, dtype=torch.uint8,
                                   device=self.device)
        self._free = list(range(self._initial_blocks - 1, -1, -1))
        return True

    def reserve(self, state: SequenceState, tokens: int) -> SequencePages:
        """Make the state's blocks cover its first `tokens` tokens (growing the arena if needed)."""
        pages = self.pages(state)
        need = -(-tokens // self.layout.block_size) - len(pages.blocks)
        if need > 0:
            if need > len(self._free):
                self._grow(need - len(self._free))
            pages.blocks.extend(self._free.pop() for _ in range(need))
        return pages

    def _grow(self, missing: int) -> None:
        old = self.num_blocks
        new = max(2 * old, old + missing)
        storage = torch.zeros(new, self.layout.block_bytes, dtype=torch.uint8, device=self.device)
        storage[:old] = self.storage
        self.storage = storage
        self._free[:0] = range(new - 1, old - 1, -1)

    def sync(self, states: list[SequenceState], layer_id: int) -> None:
        """Copy each state's entries of KV source `layer_id` that the arena lacks (blocks reserved)."""
        main_rows, key_rows, block_rows, slots = [], [], [], []
        per_block = self.layout.region(layer_id, "main").entries
        for state in states:
            kv = state.global_kv[layer_id]
            pages = self.pages(state)
            first = pages.synced.get(layer_id, 0) if pages.sources.get(layer_id) == kv.generation else 0
            count = kv.num_entries
            pages.sources[layer_id] = kv.generation
            pages.synced[layer_id] = count
            if first >= count:
                continue
            if -(-count // per_block) > len(pages.blocks):
                raise RuntimeError(f"layer {layer_id}: {count} entries need more blocks than the "
                                   f"{len(pages.blocks)} reserved")
            entries = torch.arange(first, count)
            table = torch.as_tensor(pages.blocks, dtype=torch.long)
            block_rows.append(table[entries // per_block])
            slots.append(entries % per_block)
            main_rows.append(kv.main[first:count])
            key_rows.append(kv.index_keys[first:count])
            self.copied_entries += count - first
        if not main_rows:
            return
        # one copy of both index lists; pinned, so that on a GPU it does not wait for the stream
        # (a non-blocking copy from pageable memory does)
        index = torch.stack([torch.cat(block_rows), torch.cat(slots)])
        if self.device.type == "cuda":
            index = index.pin_memory()
        rows, cols = index.to(self.device, non_blocking=True)
        self.layout.pool_view(self.storage, layer_id, "main")[rows, cols] = torch.cat(main_rows).to(self.device)
        self.layout.pool_view(self.storage, layer_id, "index")[rows, cols] = torch.cat(key_rows).to(self.device)

    def records(self, layer_id: int, kind: str) -> PagedRecords:
        region = self.layout.region(layer_id, kind)
        return PagedRecords.region(self.storage, region.offset, region.entries, region.record_bytes)


@dataclass
class PagedPass:
    """The padded group of one pass on the paged path: per-row tables, then per-layer picks."""

    arena: PagedArena
    states: list[SequenceState]  # one per padded item, item order
    row_item: Tensor  # long [rows]: each group row's item (row of the block table)
    row_positions: list[int]  # host: each group row's position
    item_ends: list[int]  # host: position after each item's last row
    block_table: Tensor  # int32 [items, max_blocks]
    group_rows: Tensor | None  # long [rows]: the group's rows among the pass's N rows (None: all)
    selections: dict[int, Tensor | None] = field(default_factory=dict)
    """Index source -> int32 `[rows, k]` picked entries (-1 = none); None: nothing visible yet."""
    pool: Tensor | None = None
    """int32 `[rows, C]`: the candidate source's pool (-1 = none), once it ran."""
    _synced: set[int] = field(default_factory=set)
    _window_rows: dict[tuple[int, ...], Tensor] = field(default_factory=dict)
    _positions: Tensor | None = None
    _row_tables: Tensor | None = None

    @staticmethod
    def build(arena: PagedArena, states: list[SequenceState], sizes: list[int], starts: list[int],
              offsets: list[int], total_rows: int, device: torch.device) -> PagedPass:
        ends = [start + size for start, size in zip(starts, sizes)]
        for state, end in zip(states, ends):
            arena.reserve(state, end)  # before any view of the storage: growing replaces it
        tables = [arena.pages(state).blocks for state in states]
        width = max((len(t) for t in tables), default=0)
        table_rows = [t + [-1] * (width - len(t)) for t in tables]
        row_item = [b for b, size in enumerate(sizes) for _ in range(size)]
        positions = [start + j for start, size in zip(starts, sizes) for j in range(size)]
        rows = [offset + j for offset, size in zip(offsets, sizes) for j in range(size)]
        flat, item = device_ints([[v for row in table_rows for v in row], row_item], device)
        group_rows = None
        if len(rows) != total_rows:
            (group_rows,) = device_ints([rows], device)
        return PagedPass(arena, states, item, positions, ends, flat.view(len(states), width).int(), group_rows)

    def take(self, rows: Tensor) -> Tensor:
        """The group's rows of a pass-wide `[N, ...]` tensor, in item order."""
        return rows if self.group_rows is None else rows[self.group_rows]

    def row_tables(self) -> Tensor:
        """Each group row's block table `[rows, max_blocks]`, gathered once per pass (every
        compressed layer turns its picks into slots through it)."""
        if self._row_tables is None:
            self._row_tables = self.block_table[self.row_item]
        return self._row_tables

    def positions(self) -> Tensor:
        if self._positions is None:
            (self._positions,) = device_ints([self.row_positions], self.row_item.device)
        return self._positions

    def sync(self, layer_id: int) -> None:
        """Copy KV source `layer_id`'s new entries into the arena, once per pass after its append."""
        self.arena.sync(self.states, layer_id)
        self._synced.add(layer_id)

    def ensure_synced(self, layer_id: int) -> None:
        if layer_id not in self._synced:
            self.sync(layer_id)

    # ------------------------------------------------------------------ index

    def select(self, layer_id: int, kv_layer: int, ratio: int, q: Tensor, weights: Tensor) -> None:
        """Pick layer `layer_id`'s top-k over KV source `kv_layer`'s index keys (two-level rules)."""
        config = self.arena.config
        self.ensure_synced(kv_layer)
        visible_host = [(p + 1) // ratio for p in self.row_positions]
        width = max(visible_host, default=0)
        if width == 0:
            self.selections[layer_id] = None
            return
        (visible,) = device_ints([visible_host], q.device)
        keys = IndexKeys(self.arena.records(kv_layer, "index"), self.block_table, self.row_item, visible)
        impl: Impl = "auto" if self.arena.backend == "kernels" else "torch"
        selection = layer_topk(config, layer_id, q, weights, keys, width, self.pool, impl)
        if selection.candidates is not None:
            self.pool = selection.candidates
        self.selections[layer_id] = selection.entries

    # ------------------------------------------------------------------ attention

    def window_slots(self, records: list[Tensor], window: int) -> tuple[PagedRecords, Tensor]:
        """The window records of the pass (`records[b]`: item b's stored records, then its chunk's)
        as one table, and each row's slots in it `[rows, window]` (-1 where out of its window)."""
        lengths = tuple(int(r.shape[0]) for r in records)
        # addressed as blocks of WINDOW_TABLE_BLOCK rows (slot = row): the kernels specialise on
        # slots per block, and a flat table's would be its row count, a new variant (a compile) for
        # most batch shapes; a fixed power of two is one variant, and its shift path
        rows = sum(lengths)
        pad = -rows % WINDOW_TABLE_BLOCK if rows else WINDOW_TABLE_BLOCK
        table = torch.cat([*records, records[0].new_zeros(pad, records[0].shape[1])] if pad else records)
        record_bytes = int(table.shape[1])
        if lengths not in self._window_rows:
            offsets = [sum(lengths[:b]) for b in range(len(lengths))]
            firsts = [end - n for end, n in zip(self.item_ends, lengths)]
            device = table.device
            off, first, length = (t[self.row_item] for t in device_ints([offsets, firsts, list(lengths)], device))
            key_pos = self.positions().unsqueeze(-1) - window + 1 + torch.arange(window, device=device)
            inside = (key_pos >= first.unsqueeze(-1)) & (key_pos < (first + length).unsqueeze(-1))
            slots = torch.where(inside, off.unsqueeze(-1) + key_pos - first.unsqueeze(-1), -1).to(torch.int32)
            self._window_rows[lengths] = slots
        swa = PagedRecords(table, record_bytes, slots_per_block=WINDOW_TABLE_BLOCK, slot_stride_bytes=record_bytes,
                           block_stride_bytes=WINDOW_TABLE_BLOCK * record_bytes)
        return swa, self._window_rows[lengths]

    def attention_keys(self, records: list[Tensor], window: int, kv_layer: int | None, index_layer: int | None
                       ) -> tuple[PagedRecords | None, Tensor | None, PagedRecords, Tensor]:
        """What a layer's rows attend to: (main-KV records, their slots `[rows, k]` from the picks,
        window records, their slots `[rows, window]`); no main KV before any pick exists."""
        swa, window_slots = self.window_slots(records, window)
        main, topk_slots = None, None
        picked = self.selections.get(index_layer) if index_layer is not None else None
        if kv_layer is not None and picked is not None:
            self.ensure_synced(kv_layer)
            main = self.arena.records(kv_layer, "main")
            topk_slots = entries_to_slots(picked, self.row_tables(), main.slots_per_block)
        return main, topk_slots, swa, window_slots

    def attend(self, q: Tensor, sink: Tensor, records: list[Tensor], window: int, kv_layer: int | None,
               index_layer: int | None, scale: float) -> Tensor:
        """Attention `[rows, H, D]` (in `q`'s dtype) of the group's queries `q [rows, H, D]`."""
        main, topk_slots, swa, window_slots = self.attention_keys(records, window, kv_layer, index_layer)
        no_rope = torch.zeros(q.shape[0], 0, device=q.device)
        if self.arena.backend == "reference":  # row blocks: its keys are [rows, k + window, D] float32
            parts = []
            for at in range(0, q.shape[0], REFERENCE_ROWS):
                rows = slice(at, at + REFERENCE_ROWS)
                parts.append(sparse_attention_reference(
                    q[rows], sink, main, None if topk_slots is None else topk_slots[rows], swa, window_slots[rows],
                    no_rope[rows], no_rope[rows], scale))
            return torch.cat(parts) if parts else q.new_zeros(q.shape)
        out = sparse_attention(q.to(torch.bfloat16), sink, main, topk_slots, swa, window_slots, no_rope, no_rope,
                               softmax_scale=scale)
        return out.to(q.dtype)
