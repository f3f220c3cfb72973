"""Per-sequence decode state, held explicitly so a serving engine can batch, ship and rebuild it.

What one sequence owns (bytes per entry for the released shapes, D = head_dim = 512):

* `position`: tokens consumed so far (the next token's absolute position).
* `swa[layer]`: the last `sliding_window - 1` window-KV records of every layer, oldest first,
  `uint8 [n, D + D/32]` (528 B; `pack_swa`). They cover positions `position - n .. position - 1`.
* `global_kv[layer]` at KV-source layers only: compressed main KV `uint8 [T, D/2 + D/16]`
  (288 B; `pack_main_kv`), index keys `uint8 [T, d/2 + d/32]` (68 B for d = 128;
  `pack_index_key`), and the compressor's pending partial group (float32, < m tokens).
* `engram_tail`: Engram-compressed ids of the last `engram_max_ngram_size - 1` tokens.

Reuse and Reindex layers store nothing: they read the KV source's records.

Updates never change a row a snapshot can see, so a `StateSnapshot` that holds the old references
is an exact copy that costs no bytes. Windows and partial groups are replaced (`torch.cat`,
slicing). Global KV grows in place: `GlobalKV.main` / `index_keys` are prefix views of a buffer with
spare rows (amortized doubling), and an append writes only past the view's end, so appending costs
the new rows, not the whole history. The one rule that keeps snapshots exact: after `restore`,
snapshots taken later than the restored one are stale (their rows past its end get overwritten).
Every caller restores to the snapshot taken before a speculative chunk and drops the later ones.

`paged` is the sequence's place in a `cedserve.model.paged_attention.PagedArena` (the paged copy of
the records that the decode kernels read), None until a paged decode pass first meets the state.

`kv_format` (`KVFormat.RECORDS` by default) may be `KVFormat.BF16`: the same rows hold bf16 values
instead of records, to measure what the records cost; such a state is never stored in blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from cedserve.model.compressor import PendingGroup
from cedserve.model.config import AttentionMode, ModelConfig
from cedserve.model.kv_format import (
    KVFormat,
    decode_index_key,
    decode_main,
    decode_window,
    encode_index_key,
    encode_main,
    encode_window,
    index_key_row_bytes,
    main_row_bytes,
    window_row_bytes,
)


@dataclass
class GlobalKV:
    """Compressed KV of one KV-source layer for one sequence (entry t covers the m tokens from
    position `t * ratio`)."""

    ratio: int
    main: Tensor  # uint8 [T, main_kv_record_bytes(head_dim)]
    index_keys: Tensor  # uint8 [T, index_key_record_bytes(index_head_dim)]
    pending: PendingGroup
    kv_format: KVFormat = KVFormat.RECORDS
    _main_buf: Tensor | None = field(default=None, repr=False, compare=False)
    _keys_buf: Tensor | None = field(default=None, repr=False, compare=False)
    generation: int = field(default=0, repr=False, compare=False)
    """Bumped by `set_records`: a paged copy of older records (`paged_attention`) is stale."""

    @property
    def num_entries(self) -> int:
        return int(self.main.shape[0])

    @property
    def next_group_position(self) -> int:
        """Absolute position of the first token of the next group to be emitted."""
        return self.num_entries * self.ratio

    def append(self, main_values: Tensor, key_values: Tensor, finite: list[Tensor] | None = None) -> None:
        """Quantize and append post-RoPE main KV `[G, D]` and index keys `[G, d]` (`finite`: as
        `kv_format.encode_window`)."""
        self.append_records(encode_main(main_values, self.kv_format, finite),
                            encode_index_key(key_values, self.kv_format, finite))

    def append_records(self, main: Tensor, index_keys: Tensor) -> None:
        """Append already encoded rows (`encode_main`, `encode_index_key` of this format), in place
        past the current views' end when the buffers have room (module docstring)."""
        self._main_buf, self.main = _grow(self._main_buf, self.main, main)
        self._keys_buf, self.index_keys = _grow(self._keys_buf, self.index_keys, index_keys)

    def set_records(self, main: Tensor, index_keys: Tensor) -> None:
        """Replace the records (loaded from blocks, or emptied on offload), dropping the buffers the
        old ones grew in, so their memory goes with them. Records are replaced only through here
        (appends and `SequenceState.restore` aside), so a paged copy knows to copy them again."""
        self.main, self.index_keys = main, index_keys
        self._main_buf = self._keys_buf = None
        self.generation += 1

    def main_values(self) -> Tensor:
        """Dequantized main KV, float32 `[T, D]`."""
        return decode_main(self.main, self.kv_format)

    def key_values(self) -> Tensor:
        """Dequantized index keys, float32 `[T, d]`."""
        return decode_index_key(self.index_keys, self.kv_format)


def _grow(buf: Tensor | None, view: Tensor, rows: Tensor) -> tuple[Tensor | None, Tensor]:
    """(buffer, view) after appending `rows` to `view`: written into `buf` past the view's end when
    the view is a prefix of `buf` and the rows fit, else into a new buffer of about twice the rows."""
    n, extra = int(view.shape[0]), int(rows.shape[0])
    if extra == 0:
        return buf, view
    owned = (buf is not None and buf.device == rows.device and buf.dtype == rows.dtype
             and buf.shape[1:] == rows.shape[1:] and n + extra <= buf.shape[0]
             and (n == 0 or view.data_ptr() == buf.data_ptr()) and view.stride() == buf.stride())
    if not owned:
        capacity = max(n + extra, 2 * n, 16)
        buf = torch.empty(capacity, *rows.shape[1:], dtype=rows.dtype, device=rows.device)
        buf[:n] = view
    assert buf is not None
    buf[n : n + extra] = rows
    return buf, buf[: n + extra]


class PagedPlace(Protocol):
    """What `SequenceState.restore` tells a paged copy of the records (`paged_attention.SequencePages`)."""

    def rewind(self, global_kv: dict[int, GlobalKV]) -> None: ...

    def release(self) -> None: ...


@dataclass(frozen=True)
class StateSnapshot:
    """A sequence's state at one moment, by reference (see the module docstring)."""

    position: int
    swa: dict[int, Tensor]
    global_kv: dict[int, tuple[Tensor, Tensor, PendingGroup]]  # layer -> main, index_keys, pending
    engram_tail: Tensor


@dataclass
class SequenceState:
    """Everything the model remembers about one sequence between calls."""

    position: int
    swa: dict[int, Tensor]
    global_kv: dict[int, GlobalKV]
    engram_tail: Tensor  # int64 [<= engram_max_ngram_size - 1]
    window_keep: int = field(default=0)  # records kept per layer: sliding_window - 1
    kv_format: KVFormat = KVFormat.RECORDS
    paged: PagedPlace | None = field(default=None, repr=False, compare=False)

    @staticmethod
    def new(config: ModelConfig, device: torch.device | None = None,
            kv_format: KVFormat = KVFormat.RECORDS) -> SequenceState:
        swa_bytes = window_row_bytes(kv_format, config.head_dim)
        swa = {
            i: torch.zeros(0, swa_bytes, dtype=torch.uint8, device=device) for i in range(config.num_hidden_layers)
        }
        main_bytes = main_row_bytes(kv_format, config.head_dim)
        key_bytes = index_key_row_bytes(kv_format, config.index_head_dim)
        global_kv = {
            spec.layer_id: GlobalKV(
                ratio=spec.compress_ratio,
                main=torch.zeros(0, main_bytes, dtype=torch.uint8, device=device),
                index_keys=torch.zeros(0, key_bytes, dtype=torch.uint8, device=device),
                pending=PendingGroup.empty(config.head_dim, device),
                kv_format=kv_format,
            )
            for spec in config.layer_plan
            if spec.mode is AttentionMode.FULL
        }
        tail = torch.zeros(0, dtype=torch.long, device=device)
        return SequenceState(0, swa, global_kv, tail, window_keep=config.sliding_window - 1, kv_format=kv_format)

    def encode_window(self, kv: Tensor, finite: list[Tensor] | None = None) -> Tensor:
        """Window rows (records, or bf16 bytes) of window KV `[n, D]`."""
        return encode_window(kv, self.kv_format, finite)

    def decode_window(self, rows: Tensor) -> Tensor:
        """float32 window KV `[n, D]` of stored rows."""
        return decode_window(rows, self.kv_format)

    def keep_window(self, layer_id: int, records: Tensor) -> None:
        """Store the newest `sliding_window - 1` of `records [n, bytes]` as the layer's window."""
        drop = records.shape[0] - self.window_keep
        # A long chunk's records are copied out so the chunk can be freed; a decode or verify chunk's
        # view keeps at most twice the window alive and saves a copy per layer per step.
        self.swa[layer_id] = records[drop:].clone() if drop > self.window_keep else records[max(drop, 0):]

    def snapshot(self) -> StateSnapshot:
        """The state as it is now; `restore` brings it back exactly."""
        kv = {layer: (g.main, g.index_keys, g.pending) for layer, g in self.global_kv.items()}
        return StateSnapshot(self.position, dict(self.swa), kv, self.engram_tail)

    def restore(self, snapshot: StateSnapshot) -> None:
        """Return to `snapshot`, forgetting every token consumed since it was taken."""
        self.position, self.swa, self.engram_tail = snapshot.position, dict(snapshot.swa), snapshot.engram_tail
        for layer, (main, index_keys, pending) in snapshot.global_kv.items():
            source = self.global_kv[layer]
            source.main, source.index_keys, source.pending = main, index_keys, pending
        if self.paged is not None:  # entries past the restored ends will be written again
            self.paged.rewind(self.global_kv)

    def release_paged(self) -> None:
        """Give the paged copy's blocks back now (an offloaded or finished sequence); a later paged
        pass copies the records again."""
        if self.paged is not None:
            self.paged.release()
            self.paged = None

    def global_kv_bytes(self) -> int:
        """Bytes of global KV records held (main KV + index keys), all sources."""
        return sum(g.main.numel() + g.index_keys.numel() for g in self.global_kv.values())
