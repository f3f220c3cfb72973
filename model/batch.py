"""What every layer of one `CEDModel.forward_batch` pass shares, computed once per pass.

The rows of all items (chunks of sequences) are concatenated in item order: `N` rows, item `i` at
rows `offsets[i] .. offsets[i] + sizes[i]`. Row-wise work (projections, norms, mHC, the MoE) runs over
all `N` rows. Attention needs each sequence's own keys, so the items split in two:

* the *padded group*: every item of a sequence whose chunks are all short (at most
  `PADDED_ROWS_LIMIT` rows) and not a replay, i.e. decode and verify chunks. Its attention runs
  once per layer for the whole group: queries padded to `[B, S_max, H, D]`, each item's window and
  compressed keys gathered into `[B, K_max, D]` with a -inf bias on the padding, one
  `sink_attention`, and the index scores likewise batched;
* *alone* items (replays, prefills, long carries): the per-chunk path (`Attention.attend_one`).

Host values a layer needs (item starts, window and global-KV lengths) come from Python ints, never
from device tensors, so the per-layer path makes no host sync; the index tensors built from them are
copied to the device once per pass (or once per distinct set of lengths) without blocking.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from cedserve.model.context import ForwardContext
from cedserve.model.kv_format import KVFormat, decode_index_key, decode_main, decode_window
from cedserve.model.state import SequenceState

if TYPE_CHECKING:
    from cedserve.model.paged_attention import PagedPass

PADDED_ROWS_LIMIT = 32
"""Items of at most this many rows (decode, carry and verify chunks) join the padded group."""


def device_ints(rows: Sequence[Sequence[int]], device: torch.device) -> list[Tensor]:
    """int64 tensors of several int lists in one host-to-device copy that does not block the host."""
    flat = torch.tensor([v for row in rows for v in row], dtype=torch.long)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    return list(flat.split_with_sizes([len(row) for row in rows]))


def pad_index(lengths: Sequence[int], width: int, pad: int) -> list[int]:
    """Row `b`, slot `j` -> `sum(lengths[:b]) + j` for `j < lengths[b]`, else `pad` (flattened `[B, width]`)."""
    out, offset = [], 0
    for n in lengths:
        out += [offset + j for j in range(n)] + [pad] * (width - n)
        offset += n
    return out


def gather_padded(values: Tensor, index: Tensor) -> Tensor:
    """`values [n, ...]` gathered at `index [B, W]`, where index `n` reads a zero row -> `[B, W, ...]`."""
    padded = torch.cat([values, values.new_zeros(1, *values.shape[1:])])
    return padded[index]


def _zero_row(rows: Tensor) -> Tensor:
    """One all-zero record like `rows [n, bytes]`'s: it decodes to zeros in every format."""
    return rows.new_zeros(1, rows.shape[-1])


@dataclass
class PaddedKV:
    """One KV source's compressed entries of the padded group's sequences, dequantized."""

    main: Tensor  # float32 [B, T_max, head_dim], zeros past an item's entries
    index_keys: Tensor  # float32 [B, T_max, index_head_dim]
    width: int  # T_max


@dataclass
class BatchPass:
    """One pass: items, row layout, the padded group's index tensors and per-pass caches."""

    ctxs: list[ForwardContext]
    sizes: list[int]
    starts: list[int]  # absolute position of each item's first row (host ints)
    rope: dict[str, tuple[Tensor, Tensor]]  # "main"/"compress" -> cos, sin [N, rope_dim/2], all rows
    engram_rows: Future[Tensor] | None  # [N, engram layers, columns, head_dim], all rows
    kv_format: KVFormat
    padded: list[int]  # items in the padded group, in item order
    alone: list[int]
    row_index: Tensor  # long [B, S_max] into the N rows; N (a zero row) at padding
    unpad_index: Tensor  # long [rows of the group]: each group row's place in the flattened [B * S_max]
    positions: Tensor  # long [B, S_max]: each query's position, -1 at padding
    group_offsets: dict[int, int]  # padded item -> its first row among the group's rows
    offsets: list[int]  # each item's first row among the N rows
    selections: dict[int, Tensor | None] = field(default_factory=dict)
    """Index source -> bool `[B, S_max, T_max]` picks of the padded group (None: none visible)."""
    candidates: Tensor | None = None
    """bool `[B, S_max, T_max]`: the candidate-source layer's pool for the padded group."""
    paged: PagedPass | None = None
    """Set when the model decodes on the paged path (`cedserve.model.paged_attention`): the padded
    group's attention and picks go through the kernels instead of dense masks."""
    _window_index: dict[tuple[int, ...], tuple[Tensor, Tensor]] = field(default_factory=dict)
    _kv: dict[int, PaddedKV] = field(default_factory=dict)

    @staticmethod
    def build(ctxs: list[ForwardContext], sizes: list[int], starts: list[int], replay: list[bool],
              rope: dict[str, tuple[Tensor, Tensor]], engram_rows: Future[Tensor] | None,
              device: torch.device) -> BatchPass:
        formats = {ctx.state.kv_format for ctx in ctxs}
        if len(formats) > 1:
            raise ValueError(f"forward_batch: every state must hold the same KV format, got {sorted(formats)}")
        kv_format = formats.pop() if formats else KVFormat.RECORDS
        alone_states = {id(c.state) for c, n, r in zip(ctxs, sizes, replay) if r or n > PADDED_ROWS_LIMIT}
        padded = [i for i, c in enumerate(ctxs) if id(c.state) not in alone_states]
        alone = [i for i, c in enumerate(ctxs) if id(c.state) in alone_states]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        width = max((sizes[i] for i in padded), default=0)
        total = sum(sizes)
        rows = [offsets[i] + s if s < sizes[i] else total for i in padded for s in range(width)]
        unpad = [b * width + s for b, i in enumerate(padded) for s in range(sizes[i])]
        positions = [starts[i] + s if s < sizes[i] else -1 for i in padded for s in range(width)]
        row_index, unpad_index, pos = device_ints([rows, unpad, positions], device)
        group_offsets = {i: sum(sizes[j] for j in padded[:b]) for b, i in enumerate(padded)}
        return BatchPass(ctxs, sizes, starts, rope, engram_rows, kv_format, padded, alone,
                         row_index.view(len(padded), width), unpad_index, pos.view(len(padded), width), group_offsets, offsets)

    @property
    def num_rows(self) -> int:
        return sum(self.sizes)

    def rows(self, item: int) -> slice:
        """The item's rows among the N rows."""
        return slice(self.offsets[item], self.offsets[item] + self.sizes[item])

    def pad(self, rows: Tensor) -> Tensor:
        """All `N` rows `[N, ...]` -> the padded group's `[B, S_max, ...]` (zeros at padding)."""
        return gather_padded(rows, self.row_index)

    def unpad(self, padded: Tensor) -> Tensor:
        """The padded group's `[B, S_max, ...]` -> its rows `[rows, ...]`, in item order."""
        return padded.flatten(0, 1)[self.unpad_index]

    def window(self, records: list[Tensor], window: int) -> tuple[Tensor, Tensor]:
        """Window keys of the padded group, `records[b]` holding item b's window records (stored ones,
        then the chunk's): float32 keys `[B, K_max, D]` and bias `[B, S_max, K_max]` (0 where key
        position k satisfies q - window < k <= q and the slot holds a record, else -inf)."""
        lengths = [int(r.shape[0]) for r in records]
        index, key_positions = self._window_layout(lengths)
        keys = decode_window(torch.cat([*records, _zero_row(records[0])]), self.kv_format)[index]
        queries = self.positions.unsqueeze(-1)  # [B, S_max, 1]
        visible = (key_positions.unsqueeze(1) <= queries) & (key_positions.unsqueeze(1) > queries - window)
        bias = torch.zeros(visible.shape, device=keys.device).masked_fill_(~visible, float("-inf"))
        return keys, bias

    def _window_layout(self, lengths: list[int]) -> tuple[Tensor, Tensor]:
        key = tuple(lengths)
        if key not in self._window_index:
            width = max(lengths)
            index = pad_index(lengths, width, sum(lengths))
            # a key slot's position; padding gets a position no query can see (above every query)
            first = [self.starts[i] + self.sizes[i] - n for i, n in zip(self.padded, lengths)]
            never = max(self.starts[i] + self.sizes[i] for i in self.padded)
            positions = [f + j if j < n else never for f, n in zip(first, lengths) for j in range(width)]
            idx, pos = device_ints([index, positions], self.row_index.device)
            self._window_index[key] = (idx.view(len(lengths), width), pos.view(len(lengths), width))
        return self._window_index[key]

    def compressed(self, kv_layer: int) -> PaddedKV:
        """The KV source's entries for the padded group (cached until `global_kv_changed`)."""
        if kv_layer not in self._kv:
            sources = [self.ctxs[i].state.global_kv[kv_layer] for i in self.padded]
            lengths = [g.num_entries for g in sources]
            width = max(lengths)
            if width == 0:
                device = self.row_index.device
                empty = torch.zeros(len(sources), 0, 0, device=device)
                self._kv[kv_layer] = PaddedKV(empty, empty, 0)
            else:
                (index,) = device_ints([pad_index(lengths, width, sum(lengths))], self.row_index.device)
                index = index.view(len(lengths), width)
                # a zero record (decodes to zeros in every format) at the end is the padding's row
                main = decode_main(torch.cat([*(g.main for g in sources), _zero_row(sources[0].main)]),
                                   self.kv_format)
                keys = decode_index_key(torch.cat([*(g.index_keys for g in sources),
                                                   _zero_row(sources[0].index_keys)]), self.kv_format)
                self._kv[kv_layer] = PaddedKV(main[index], keys[index], width)
        return self._kv[kv_layer]

    def global_kv_changed(self, kv_layer: int) -> None:
        self._kv.pop(kv_layer, None)


def snapshot_layer(ctx: ForwardContext, layer: int, state: SequenceState) -> None:
    """Record the layer's state in the chunk's boundary snapshot, when the chunk asked for one."""
    if ctx.boundary is None:
        return
    ctx.boundary.swa[layer] = state.swa[layer]
    kv = state.global_kv.get(layer)
    if kv is not None:
        ctx.boundary.global_kv[layer] = (kv.main, kv.index_keys, kv.pending)
