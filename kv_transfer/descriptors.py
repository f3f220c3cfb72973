"""NIXL descriptor lists built vectorised from block ids.

A descriptor is one `(address, length, device_id)` row; NIXL takes an `[n, 3]` uint64 array per
side, row i of the local list moving to row i of the remote list. Nothing here loops in Python over
blocks or layers: ids arrive as int64 arrays and leave as descriptor arrays.

- `paired_runs` splits `(src[i], dst[i])` into maximal runs where both ids step by one, so a run
  of k blocks is one descriptor of `k * block_bytes` on each side (cross-layer layout).
- `per_layer_descs` is the baseline: one descriptor per block per source layer, no merging.
- `should_pack` decides, per chunk, whether the link would see descriptors too small to run well,
  in which case the chunk goes through the staging buffers as one descriptor instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cedserve.kv_transfer.region import KVLayout, LayoutKind


@dataclass(frozen=True)
class RegionAddress:
    """Where one side's block pool is, as the descriptor builder needs it."""

    base_address: int
    num_blocks: int
    device_id: int


@dataclass(frozen=True)
class DescriptorPair:
    """Matching descriptor lists: `local[i]` moves to or from `remote[i]`; both `[n, 3]` uint64."""

    local: np.ndarray
    remote: np.ndarray

    @property
    def count(self) -> int:
        return int(self.local.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.local[:, 1].sum()) if self.count else 0


def as_block_ids(ids: object) -> np.ndarray:
    """Block ids as a 1-D int64 array (from a list, tuple, numpy array or CPU tensor)."""
    arr = np.asarray(ids, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"block ids must be 1-D, got shape {arr.shape}")
    return arr


def paired_runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(src_start, dst_start, length)` of the maximal runs where src and dst both step by +1."""
    if src.shape != dst.shape:
        raise ValueError(f"{src.shape[0]} source blocks vs {dst.shape[0]} destination blocks")
    n = src.shape[0]
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([np.zeros(1, dtype=np.int64), breaks])
    lengths = np.diff(np.concatenate([starts, np.array([n], dtype=np.int64)]))
    return src[starts], dst[starts], lengths


def count_runs(src: np.ndarray, dst: np.ndarray) -> int:
    """Descriptors `coalesced_descs` would build for these pairs."""
    if src.shape[0] < 2:
        return int(src.shape[0])
    # a run continues where both steps are 1: (step - 1) of both sides OR to zero exactly there
    # (slices instead of np.diff and in-place ops: this runs per NIXL request on the progress thread)
    steps = src[1:] - src[:-1]
    steps -= 1
    dst_steps = dst[1:] - dst[:-1]
    dst_steps -= 1
    steps |= dst_steps
    return 1 + int(np.count_nonzero(steps))


def _rows(addresses: np.ndarray, lengths: np.ndarray, device_id: int) -> np.ndarray:
    out = np.empty((addresses.shape[0], 3), dtype=np.uint64)
    out[:, 0] = addresses
    out[:, 1] = lengths
    out[:, 2] = device_id
    return out


def coalesced_descs(local: RegionAddress, remote: RegionAddress, block_bytes: int,
                    src: np.ndarray, dst: np.ndarray) -> DescriptorPair:
    """Cross-layer layout: one descriptor per run of consecutive (src, dst) block pairs."""
    s0, d0, length = paired_runs(src, dst)
    nbytes = length * block_bytes
    return DescriptorPair(_rows(local.base_address + s0 * block_bytes, nbytes, local.device_id),
                          _rows(remote.base_address + d0 * block_bytes, nbytes, remote.device_id))


def per_layer_descs(layout: KVLayout, local: RegionAddress, remote: RegionAddress,
                    src: np.ndarray, dst: np.ndarray) -> DescriptorPair:
    """Per-layer baseline: `len(src) * layers` descriptors, block-major, never merged.

    Pool l of a side starts at `base + num_blocks * prefix[l]`; block b of it at `+ b * size[l]`.
    """
    prefix, sizes = layout.segment_table()  # [L], [L]
    if src.shape != dst.shape:
        raise ValueError(f"{src.shape[0]} source blocks vs {dst.shape[0]} destination blocks")
    local_addr = local.base_address + local.num_blocks * prefix[None, :] + src[:, None] * sizes[None, :]
    remote_addr = remote.base_address + remote.num_blocks * prefix[None, :] + dst[:, None] * sizes[None, :]
    lengths = np.broadcast_to(sizes[None, :], local_addr.shape).reshape(-1)
    return DescriptorPair(_rows(local_addr.reshape(-1), lengths, local.device_id),
                          _rows(remote_addr.reshape(-1), lengths, remote.device_id))


def block_descs(layout: KVLayout, local: RegionAddress, remote: RegionAddress,
                src: np.ndarray, dst: np.ndarray) -> DescriptorPair:
    """Descriptors moving local blocks `src` to remote blocks `dst` in `layout`."""
    if layout.kind is LayoutKind.PER_LAYER:
        return per_layer_descs(layout, local, remote, src, dst)
    return coalesced_descs(local, remote, layout.block_bytes, src, dst)


def single_desc(local_address: int, local_device: int, remote_address: int, remote_device: int,
                nbytes: int) -> DescriptorPair:
    """One descriptor of `nbytes` (a packed staging slot, or the raw-rate reference)."""
    return DescriptorPair(_rows(np.array([local_address], dtype=np.int64), np.array([nbytes]), local_device),
                          _rows(np.array([remote_address], dtype=np.int64), np.array([nbytes]), remote_device))


def should_pack(num_descriptors: int, nbytes: int, threshold_bytes: int) -> bool:
    """Pack when the mean descriptor is below `threshold_bytes` (0 disables) and there is more than one."""
    return threshold_bytes > 0 and num_descriptors > 1 and nbytes < threshold_bytes * num_descriptors


def split_positions(num_blocks: int, max_blocks: int, first_max: int | None = None) -> list[tuple[int, int]]:
    """`[(start, stop)]` cutting `num_blocks` positions into pieces of at most `max_blocks`, the first
    of at most `first_max` (what is left of a staging slot being filled) when given."""
    head = min(num_blocks, max_blocks if first_max is None else max(1, min(first_max, max_blocks)))
    pieces = [(0, head)] if num_blocks else []
    return pieces + [(s, min(s + max_blocks, num_blocks)) for s in range(head, num_blocks, max_blocks)]
