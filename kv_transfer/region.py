"""The registered memory (`KVRegion`), how KV records sit in it (`KVLayout`), and the compatibility
both peers check at handshake.

The transfer layer sees the block pool only as a contiguous uint8 tensor of
`num_blocks x block_bytes` and block ids; it never imports the pool.

Layouts (bytes of one 64-token block at the released geometry: 56,960):

- CROSS_LAYER (ours): block b is one contiguous run of `block_bytes` at `base + b * block_bytes`,
  holding every KV-source layer's records back to back:
  `[layer 2: 32 entries x 356 B][layer 8: 32 x 356][layer 14: 32 x 356][layer 20: 64 x 356]`.
  Neighbouring block ids are neighbouring bytes, so runs of ids coalesce into one descriptor.
- PER_LAYER (the baseline): the same bytes as a conventional paged cache keeps them, one pool per
  source layer: pool l = `[num_blocks, segment_bytes(l)]` starting at `num_blocks * prefix(l)`. A
  block is then one descriptor per layer, and a request N x layers descriptors.

The byte layout of a block is the cache's `BlockLayout` (`cedserve.model.cache.layout`), the one
source of truth: `KVLayout.from_config` derives its segments from it, each spanning one layer's main
and index regions plus the alignment padding after them, so the two agree on `block_bytes` at every
geometry (e.g. `tiny` at 16-token blocks, where regions are padded to 16 bytes).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch

from cedserve.kernels.reference import (
    INDEX_KEY_BLOCK,
    MAIN_KV_BLOCK,
    index_key_record_bytes,
    main_kv_record_bytes,
)
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.config import ModelConfig

PROTOCOL_VERSION = 4
"""Version of the internal protocol between prefill and decode workers (messages in
proto/kv_transfer.proto and proto/worker.proto, and their meaning), checked at the handshake. Bump it
whenever a peer built from the previous version would misread a message.
2: senders `Claim` a reservation on the receiver's control plane before writing into it.
3: `DecodeTarget.block_ids` is gone (the reservation carries the blocks); `ReserveRequest` loses
`block_hashes` and `max_tokens`; effort, `max_tokens` and `top_p` arrive resolved (no 0 = unset).
4: a packed WRITE chunk may start inside its receiver staging slot (`ChunkDone.staging_offset`), so
one slot takes several chunks; a v3 receiver would scatter it from the slot's start."""


@dataclass(frozen=True)
class KVRegion:
    """The memory one agent registers: `tensor` is contiguous uint8 holding `num_blocks` blocks."""

    tensor: torch.Tensor
    """uint8, contiguous; shape `[num_blocks, block_bytes]` or flat `[num_blocks * block_bytes]`."""
    block_bytes: int

    def __post_init__(self) -> None:
        t = self.tensor
        if t.dtype != torch.uint8:
            raise ValueError(f"KVRegion: tensor must be uint8, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError("KVRegion: tensor must be contiguous")
        if self.block_bytes <= 0 or t.numel() % self.block_bytes or t.numel() == 0:
            raise ValueError(f"KVRegion: {t.numel()} bytes is not a positive multiple of "
                             f"block_bytes={self.block_bytes}")

    @property
    def num_blocks(self) -> int:
        return self.tensor.numel() // self.block_bytes

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    @property
    def base_address(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def device_memory(self) -> bool:
        return self.tensor.device.type == "cuda"

    @property
    def device_id(self) -> int:
        """CUDA ordinal, or 0 for host memory (NIXL's convention)."""
        return int(self.tensor.device.index or 0) if self.device_memory else 0

    def blocks(self) -> torch.Tensor:
        """`[num_blocks, block_bytes]` view."""
        return self.tensor.view(self.num_blocks, self.block_bytes)

    def check_block_ids(self, block_ids: np.ndarray, what: str) -> None:
        """`ValueError` naming `what` unless every id is in `[0, num_blocks)` (int64 ids: one pass,
        a negative id reads as a huge unsigned one)."""
        if not block_ids.size:
            return
        if block_ids.dtype == np.int64:
            bad = int(block_ids.view(np.uint64).max()) >= self.num_blocks
        else:
            bad = int(block_ids.min()) < 0 or int(block_ids.max()) >= self.num_blocks
        if bad:
            raise ValueError(f"{what}: block ids must be in [0, {self.num_blocks}), got "
                             f"[{int(block_ids.min())}, {int(block_ids.max())}]")


class LayoutKind(str, Enum):
    CROSS_LAYER = "cross_layer"
    """Every source layer's records of a block in one contiguous run (ours)."""
    PER_LAYER = "per_layer"
    """One pool per source layer, one descriptor per block per layer (the conventional baseline)."""


@dataclass(frozen=True)
class LayoutSegment:
    """One KV-source layer's share of a block."""

    layer_id: int
    compress_ratio: int
    entries_per_block: int
    entry_bytes: int
    padding_bytes: int = 0
    """Alignment padding after the layer's records (`BlockLayout.align_bytes`), part of its share."""

    @property
    def nbytes(self) -> int:
        return self.entries_per_block * self.entry_bytes + self.padding_bytes


@dataclass(frozen=True)
class KVLayout:
    """Where a block's bytes are, and the facts a peer must share to read them."""

    kind: LayoutKind
    block_size: int
    """Tokens per block."""
    segments: tuple[LayoutSegment, ...]
    record_formats: str
    model_fingerprint: str
    weights_dtype: str = "float32"
    """The dtype the writer's model holds its weights in (`[model] dtype`): the records' format does
    not depend on it, but their values do, and the shipped state's DSpark taps are in it."""

    @classmethod
    def from_config(cls, config: ModelConfig, block_size: int, kind: LayoutKind = LayoutKind.CROSS_LAYER,
                    model_id: str = "", weights_dtype: str = "float32") -> KVLayout:
        """The layout of `config`'s global KV at `block_size` tokens per block: the cache's
        `BlockLayout`, one segment per KV-source layer (`ValueError` naming `block_size` if the
        block does not hold whole entries).

        `model_id` names the weights (checkpoint name and revision): two checkpoints with the same
        geometry write different KV, so it belongs in the compatibility hash; so does `weights_dtype`
        (the same checkpoint served in float32 and in bfloat16 computes different KV), named in the
        description so that a mismatch says which side holds which.
        """
        blocks = BlockLayout.from_config(config, block_size)
        starts = [blocks.region(layer, "main").offset for layer in blocks.layer_ids]
        segments = []
        for layer, start, end in zip(blocks.layer_ids, starts, [*starts[1:], blocks.block_bytes]):
            main, index = blocks.region(layer, "main"), blocks.region(layer, "index")
            records = main.entries * (main.record_bytes + index.record_bytes)
            segments.append(LayoutSegment(layer, main.compress_ratio, main.entries,
                                          main.record_bytes + index.record_bytes, end - start - records))
        formats = (f"main_kv=e2m1x{config.head_dim}+e4m3/{MAIN_KV_BLOCK}:"
                   f"{main_kv_record_bytes(config.head_dim)}B,"
                   f"index_key=e2m1x{config.index_head_dim}+ue8m0/{INDEX_KEY_BLOCK}:"
                   f"{index_key_record_bytes(config.index_head_dim)}B")
        arch = json.dumps(config.to_hf_dict(), sort_keys=True, default=str)
        fingerprint = hashlib.sha256(f"{arch}|{model_id}".encode()).hexdigest()[:16]
        return cls(kind, block_size, tuple(segments), formats, fingerprint, weights_dtype)

    @classmethod
    def raw(cls, block_bytes: int, kind: LayoutKind = LayoutKind.CROSS_LAYER, num_layers: int = 1,
            tag: str = "raw") -> KVLayout:
        """A model-free layout of `block_bytes` split evenly over `num_layers` (tests, benchmarks)."""
        if num_layers <= 0 or block_bytes % num_layers:
            raise ValueError(f"block_bytes {block_bytes} does not split into {num_layers} layers")
        segs = tuple(LayoutSegment(i, 1, 1, block_bytes // num_layers) for i in range(num_layers))
        return cls(kind, 1, segs, tag, tag)

    @property
    def block_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def segment_table(self) -> tuple[np.ndarray, np.ndarray]:
        """`(prefix_bytes, segment_bytes)`, int64 arrays `[layers]`: where each layer starts inside a
        logical block, and its size."""
        sizes = np.array([s.nbytes for s in self.segments], dtype=np.int64)
        return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64), sizes

    def segment_views(self, region: KVRegion) -> list[tuple[torch.Tensor, int, int]]:
        """For each place a block's bytes live: `(view [num_blocks, n], start, stop)` where
        `logical_block[start:stop]` lives in row b of the view."""
        self.check_region(region)
        if self.kind is LayoutKind.CROSS_LAYER:
            return [(region.blocks(), 0, self.block_bytes)]
        flat = region.tensor.view(-1)
        nb = region.num_blocks
        out = []
        prefix, sizes = self.segment_table()
        for start, size in zip(prefix.tolist(), sizes.tolist()):
            pool = flat[nb * start: nb * (start + size)].view(nb, size)
            out.append((pool, start, start + size))
        return out

    def check_region(self, region: KVRegion) -> None:
        if region.block_bytes != self.block_bytes:
            raise ValueError(f"region block_bytes {region.block_bytes} != layout block_bytes {self.block_bytes}")

    def compatibility(self) -> Compatibility:
        segs = ";".join(f"L{s.layer_id}/m{s.compress_ratio}:{s.entries_per_block}x{s.entry_bytes}"
                        + (f"+{s.padding_bytes}" if s.padding_bytes else "") for s in self.segments)
        description = (f"protocol=v{PROTOCOL_VERSION} model={self.model_fingerprint} weights={self.weights_dtype} "
                       f"records={self.record_formats} block_size={self.block_size} "
                       f"block_bytes={self.block_bytes} layout={self.kind.value} segments={segs}")
        digest = hashlib.sha256(description.encode()).hexdigest()
        return Compatibility(PROTOCOL_VERSION, digest, description)


@dataclass(frozen=True)
class Compatibility:
    """Checked at every handshake; a mismatch names both sides' values."""

    protocol_version: int
    compat_hash: str
    description: str
