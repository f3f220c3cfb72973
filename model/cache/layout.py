"""Byte layout of one paged block: the format contract the kernels and the KV transfers read.

A block holds `block_size` consecutive tokens of one sequence for *all* KV-source (CSA2 Full)
layers together, as one contiguous byte range. Inside it, regions follow the KV-source layers in
increasing layer order; each layer has a main-KV region and then an index-key region:

    block b, byte 0
    | L0 main  [E0, 288] | L0 index [E0, 68] | L1 main [E1, 288] | L1 index [E1, 68] | ... | pad |
                                                                                    block_bytes ->

* `E = block_size // compress_ratio` entries per region. Entry `e` of a layer with ratio `m`
  in block `b` of a sequence is the compressed group of tokens `[b*block_size + e*m, ... + m)`.
* Records are those of `cedserve.kernels.reference`: a main-KV record is `pack_main_kv` (288 B at
  head_dim 512: 256 B of E2M1 pairs, then 32 E4M3 scales), an index-key record `pack_index_key`
  (68 B at index_head_dim 128: 64 B of E2M1 pairs, then 4 UE8M0 scales). Records of a region are
  packed back to back, row stride = record bytes.
* Every region starts at a multiple of `align_bytes` (16) and the block is padded to one, so a
  kernel may use 16-byte vector loads at region starts. At the released geometry with 64-token
  blocks no padding is needed:

  | layer | m | entries | main offset | main bytes | index offset | index bytes |
  |------:|--:|--------:|------------:|-----------:|-------------:|------------:|
  |     2 | 2 |      32 |           0 |      9,216 |        9,216 |       2,176 |
  |     8 | 2 |      32 |      11,392 |      9,216 |       20,608 |       2,176 |
  |    14 | 2 |      32 |      22,784 |      9,216 |       32,000 |       2,176 |
  |    20 | 1 |      64 |      34,176 |     18,432 |       52,608 |       4,352 |

  block_bytes = 56,960 = 64 tokens x 890 B.

A pool is a `uint8 [num_blocks, block_bytes]` tensor, so a region of every block at once is the
strided view `pool[:, off : off + E * rec].unflatten(-1, (E, rec))`, `[num_blocks, E, rec]`.

`compat_hash` (16 bytes) digests the format version and this table; the disk tier stores it in
every file header and the transfer layer may compare it at handshake: equal hashes mean byte-equal
layouts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from cedserve.kernels.reference import index_key_record_bytes, main_kv_record_bytes
from cedserve.model.config import AttentionMode, ModelConfig

LAYOUT_FORMAT_VERSION = 1
"""Bumped whenever the meaning of a block's bytes changes."""
DEFAULT_ALIGN_BYTES = 16


@dataclass(frozen=True)
class Region:
    """One run of records inside a block."""

    layer_id: int
    kind: str
    """`"main"` (main-KV records) or `"index"` (index-key records)."""
    compress_ratio: int
    offset: int
    """Byte offset from the block start (a multiple of the layout's `align_bytes`)."""
    entries: int
    """Records in the region: `block_size // compress_ratio`."""
    record_bytes: int

    @property
    def nbytes(self) -> int:
        return self.entries * self.record_bytes

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class BlockLayout:
    """Where every KV-source layer's records live inside a block (see the module docstring)."""

    block_size: int
    regions: tuple[Region, ...]
    block_bytes: int
    align_bytes: int = DEFAULT_ALIGN_BYTES

    @classmethod
    def from_config(cls, config: ModelConfig, block_size: int, align_bytes: int = DEFAULT_ALIGN_BYTES) -> BlockLayout:
        """The layout of `block_size`-token blocks for `config`'s KV sources.

        `ValueError` (naming `block_size`) unless the block holds whole entries of every source and
        whole candidate blocks of the candidate source.
        """
        if align_bytes <= 0 or align_bytes & (align_bytes - 1):
            raise ValueError(f"cache field `align_bytes`: must be a power of two, got {align_bytes}")
        _check_block_size(config, block_size)
        main_bytes = main_kv_record_bytes(config.head_dim)
        key_bytes = index_key_record_bytes(config.index_head_dim)
        regions: list[Region] = []
        offset = 0
        for spec in config.layer_plan:
            if spec.mode is not AttentionMode.FULL:
                continue
            entries = block_size // spec.compress_ratio
            for kind, record in (("main", main_bytes), ("index", key_bytes)):
                region = Region(spec.layer_id, kind, spec.compress_ratio, offset, entries, record)
                regions.append(region)
                offset = _round_up(region.end, align_bytes)
        return cls(block_size, tuple(regions), offset, align_bytes)

    # ------------------------------------------------------------------ lookup

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """KV-source layers in block order."""
        return tuple(r.layer_id for r in self.regions if r.kind == "main")

    @property
    def payload_bytes(self) -> int:
        """Record bytes of a block, padding excluded."""
        return sum(r.nbytes for r in self.regions)

    @property
    def padding_bytes(self) -> int:
        return self.block_bytes - self.payload_bytes

    def region(self, layer_id: int, kind: str) -> Region:
        """The `kind` ("main" or "index") region of KV-source `layer_id`; `KeyError` if none."""
        for r in self.regions:
            if r.layer_id == layer_id and r.kind == kind:
                return r
        raise KeyError(f"no {kind!r} region for layer {layer_id}; KV-source layers are {list(self.layer_ids)}")

    @cached_property
    def compat_hash(self) -> bytes:
        """16-byte digest of the format version and the region table."""
        rows = ";".join(f"{r.layer_id},{r.kind},{r.compress_ratio},{r.offset},{r.entries},{r.record_bytes}"
                        for r in self.regions)
        text = f"cedserve-block-layout/v{LAYOUT_FORMAT_VERSION};bs={self.block_size};bytes={self.block_bytes};{rows}"
        return hashlib.sha256(text.encode()).digest()[:16]

    # ------------------------------------------------------------------ views

    def view(self, block: Tensor, layer_id: int, kind: str) -> Tensor:
        """`uint8 [entries, record_bytes]` view of one region of `block` (`uint8 [block_bytes]`)."""
        self._check(block, 1)
        r = self.region(layer_id, kind)
        return block[r.offset : r.end].view(r.entries, r.record_bytes)

    def pool_view(self, storage: Tensor, layer_id: int, kind: str) -> Tensor:
        """`uint8 [num_blocks, entries, record_bytes]` strided view of one region of every block."""
        self._check(storage, 2)
        r = self.region(layer_id, kind)
        return storage[:, r.offset : r.end].view(storage.shape[0], r.entries, r.record_bytes)

    def main_kv(self, block: Tensor, layer_id: int) -> Tensor:
        """Main-KV records of `layer_id` in `block`, `uint8 [block_size // m, 288]`."""
        return self.view(block, layer_id, "main")

    def index_keys(self, block: Tensor, layer_id: int) -> Tensor:
        """Index-key records of `layer_id` in `block`, `uint8 [block_size // m, 68]`."""
        return self.view(block, layer_id, "index")

    def _check(self, t: Tensor, dims: int) -> None:
        if t.dtype != torch.uint8 or t.dim() != dims or t.shape[-1] != self.block_bytes:
            want = "[block_bytes]" if dims == 1 else "[num_blocks, block_bytes]"
            raise ValueError(f"expected uint8 {want} with block_bytes={self.block_bytes}, "
                             f"got {t.dtype} {list(t.shape)}")

    def describe(self) -> list[dict[str, int | str]]:
        """The region table as rows (for docs, benchmarks and `cedserve inspect`)."""
        return [{"layer": r.layer_id, "kind": r.kind, "ratio": r.compress_ratio, "entries": r.entries,
                 "record_bytes": r.record_bytes, "offset": r.offset, "bytes": r.nbytes} for r in self.regions]


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def _check_block_size(config: ModelConfig, block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"cache field `block_size`: must be positive, got {block_size}")
    for spec in config.layer_plan:
        if spec.mode is AttentionMode.FULL and block_size % spec.compress_ratio:
            raise ValueError(f"cache field `block_size`: {block_size} is not a multiple of compress ratio "
                             f"{spec.compress_ratio} of KV-source layer {spec.layer_id}")
    cand = config.candidate_source_layer_id
    if config.has_candidate_pool and cand is not None:
        tokens = config.candidate_block_size * config.compress_ratios[cand]
        if block_size % tokens:
            raise ValueError(f"cache field `block_size`: {block_size} is not a multiple of the candidate block "
                             f"({config.candidate_block_size} entries x m={config.compress_ratios[cand]} "
                             f"= {tokens} tokens)")
