"""Descriptor lists: vectorised coalescing against a per-block reference, the per-layer baseline,
the pack decision, and the layout facts behind them (56,960 B blocks at the released geometry)."""

from __future__ import annotations

import numpy as np
import pytest

from cedserve.kv_transfer.descriptors import (
    RegionAddress,
    as_block_ids,
    block_descs,
    coalesced_descs,
    count_runs,
    paired_runs,
    per_layer_descs,
    should_pack,
    split_positions,
)
from cedserve.kv_transfer.nixl_backend import nixl_available
from cedserve.kv_transfer.region import KVLayout, LayoutKind
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.presets import preset

LOCAL = RegionAddress(base_address=1 << 20, num_blocks=1000, device_id=0)
REMOTE = RegionAddress(base_address=1 << 32, num_blocks=800, device_id=3)


def reference_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Per-block loop: the obvious (slow) definition of coalescing."""
    runs: list[list[int]] = []
    for s, d in zip(src, dst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(a, b, c) for a, b, c in runs]


@pytest.mark.parametrize("seed", range(6))
def test_paired_runs_match_the_per_block_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    # runs of random length at random places: a fragmented pool
    src = np.concatenate([np.arange(s, s + k) for s, k in zip(rng.integers(0, 900, 60), rng.integers(1, 9, 60))])[:n]
    dst = np.concatenate([np.arange(s, s + k) for s, k in zip(rng.integers(0, 700, 60), rng.integers(1, 9, 60))])[:n]
    n = min(src.size, dst.size)
    src, dst = src[:n], dst[:n]
    s0, d0, length = paired_runs(src, dst)
    assert list(zip(s0.tolist(), d0.tolist(), length.tolist())) == reference_runs(src.tolist(), dst.tolist())
    assert count_runs(src, dst) == len(s0)


@pytest.mark.parametrize(("src", "dst", "runs"), [
    ([], [], 0),
    ([5], [9], 1),
    ([0, 1, 2, 3], [10, 11, 12, 13], 1),          # one run on both sides
    ([0, 1, 2, 3], [10, 11, 20, 21], 2),          # contiguous locally, split remotely
    ([3, 2, 1, 0], [0, 1, 2, 3], 4),              # descending is not a run
    ([0, 1, 5, 6, 7], [4, 5, 6, 7, 8], 2),
])
def test_coalescing_edges(src: list[int], dst: list[int], runs: int) -> None:
    pair = coalesced_descs(LOCAL, REMOTE, 100, as_block_ids(src), as_block_ids(dst))
    assert pair.count == runs
    assert pair.nbytes == 100 * len(src)
    if runs:
        assert pair.local.dtype == np.uint64 and pair.local.shape == (runs, 3)
        assert int(pair.local[0, 0]) == LOCAL.base_address + src[0] * 100
        assert int(pair.remote[0, 0]) == REMOTE.base_address + dst[0] * 100
        assert set(pair.remote[:, 2].tolist()) == {3}
        assert np.array_equal(pair.local[:, 1], pair.remote[:, 1])


def test_coalescing_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="3 source blocks vs 2"):
        paired_runs(as_block_ids([1, 2, 3]), as_block_ids([1, 2]))


def test_released_geometry_block_is_56960_bytes_in_four_segments() -> None:
    layout = KVLayout.from_config(preset("v4.1-flash"), 64)
    assert layout.block_bytes == 56_960
    assert [(s.layer_id, s.compress_ratio, s.nbytes) for s in layout.segments] == [
        (2, 2, 32 * 356), (8, 2, 32 * 356), (14, 2, 32 * 356), (20, 1, 64 * 356)]
    prefix, sizes = layout.segment_table()
    assert prefix.tolist() == [0, 11392, 22784, 34176] and sizes.sum() == 56_960


def test_per_layer_baseline_is_one_descriptor_per_block_per_layer() -> None:
    layout = KVLayout.from_config(preset("v4.1-flash"), 64, LayoutKind.PER_LAYER)
    src = as_block_ids([7, 8, 9])  # contiguous, yet never merged in the baseline
    dst = as_block_ids([0, 1, 2])
    pair = per_layer_descs(layout, LOCAL, REMOTE, src, dst)
    assert pair.count == 3 * 4
    prefix, sizes = layout.segment_table()
    # block 8, layer 14 (segment 2): pool 2 starts at num_blocks * prefix[2]
    row = 1 * 4 + 2
    assert int(pair.local[row, 0]) == LOCAL.base_address + LOCAL.num_blocks * prefix[2] + 8 * sizes[2]
    assert int(pair.remote[row, 0]) == REMOTE.base_address + REMOTE.num_blocks * prefix[2] + 1 * sizes[2]
    assert pair.nbytes == 3 * layout.block_bytes
    cross = block_descs(KVLayout.from_config(preset("v4.1-flash"), 64), LOCAL, REMOTE, src, dst)
    assert cross.count == 1 and cross.nbytes == pair.nbytes


def test_descriptor_building_is_vectorised_at_one_million_tokens() -> None:
    # 16,384 blocks (1M tokens) scattered: building the lists must not loop per block in Python.
    import time

    rng = np.random.default_rng(0)
    src = rng.permutation(20_000)[:16_384]
    dst = rng.permutation(20_000)[:16_384]
    layout = KVLayout.from_config(preset("v4.1-flash"), 64, LayoutKind.PER_LAYER)
    start = time.perf_counter()
    pair = block_descs(layout, LOCAL, REMOTE, src, dst)
    assert pair.count == 16_384 * 4
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize(("descs", "nbytes", "threshold", "pack"), [
    (1, 10, 1 << 20, False),            # one descriptor already
    (2048, 2048 * 56_960, 1 << 20, True),   # 57 KB descriptors on a link that wants MBs
    (4, 4 * (4 << 20), 1 << 20, False),     # 4 MiB descriptors are fine
    (2048, 2048 * 56_960, 0, False),        # packing disabled (host memory default)
])
def test_pack_decision_by_mean_descriptor_size(descs: int, nbytes: int, threshold: int, pack: bool) -> None:
    assert should_pack(descs, nbytes, threshold) is pack


def test_split_positions() -> None:
    assert split_positions(0, 4) == []
    assert split_positions(10, 4) == [(0, 4), (4, 8), (8, 10)]
    # the first piece fills what is left of a staging slot, the rest whole slots
    assert split_positions(10, 4, first_max=1) == [(0, 1), (1, 5), (5, 9), (9, 10)]
    assert split_positions(3, 4, first_max=2) == [(0, 2), (2, 3)]
    assert split_positions(3, 4, first_max=9) == [(0, 3)]  # never beyond a slot
    assert split_positions(0, 4, first_max=2) == []


def test_compatibility_hash_covers_model_block_size_and_layout() -> None:
    flash = preset("v4.1-flash")
    base = KVLayout.from_config(flash, 64).compatibility()
    assert base.compat_hash == KVLayout.from_config(flash, 64).compatibility().compat_hash
    others = [KVLayout.from_config(flash, 128).compatibility(),
              KVLayout.from_config(flash, 64, LayoutKind.PER_LAYER).compatibility(),
              KVLayout.from_config(flash, 64, model_id="other-weights").compatibility(),
              KVLayout.from_config(preset("tiny"), 64).compatibility()]
    assert len({base.compat_hash, *(o.compat_hash for o in others)}) == 5
    assert "block_bytes=56960" in base.description and "layout=cross_layer" in base.description


@pytest.mark.parametrize(("name", "block_size"), [("tiny", 16), ("tiny", 32), ("tiny", 64), ("mini-40", 64),
                                                  ("v4.1-flash", 128)])
def test_transfer_layout_is_the_cache_block_layout(name: str, block_size: int) -> None:
    """One source of truth: the transfer layout's segments tile the cache's blocks exactly, padding
    included (tiny at 16-token blocks pads layer 2's index keys from 424 to 432 bytes)."""
    config = preset(name)
    blocks = BlockLayout.from_config(config, block_size)
    for kind in LayoutKind:
        layout = KVLayout.from_config(config, block_size, kind)
        assert layout.block_bytes == blocks.block_bytes
        prefix, sizes = layout.segment_table()
        assert prefix.tolist() == [blocks.region(layer, "main").offset for layer in blocks.layer_ids]
        assert int(sizes.sum()) == blocks.block_bytes
    if (name, block_size) == ("tiny", 16):
        assert blocks.padding_bytes == 8 and "+8" in KVLayout.from_config(config, 16).compatibility().description


@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
def test_real_records_cross_nixl_at_a_padded_geometry() -> None:
    """tiny at 16-token blocks (a padded layout): both NIXL agents accept the cache's pool as their
    region, and a prompt's records written by `store_records` arrive byte for byte, so the receiver's
    `load_state` sees the sender's global KV."""
    import torch

    from cedserve.kv_transfer.agent import NixlTransferAgent
    from cedserve.kv_transfer.config import KVTransferConfig
    from cedserve.kv_transfer.region import KVRegion
    from cedserve.model.paged_kv import load_state, store_state
    from cedserve.serving.worker_model import load_worker_model

    torch.set_num_threads(1)  # the tiny model's ops are too small for intra-op threads
    model = load_worker_model(None, "tiny", seed=0).model
    blocks = BlockLayout.from_config(model.config, 16)
    state = model.new_state()
    model.prefill(list(range(3, 3 + 70)), state)
    pools = [torch.zeros(12, blocks.block_bytes, dtype=torch.uint8) for _ in range(2)]
    store_state(blocks, pools[0], [0, 1, 2, 3, 4], state)
    layout = KVLayout.from_config(model.config, 16, model_id="tiny-test")
    cfg = KVTransferConfig(auth_token="layout-token", control_host="127.0.0.1")
    sender, receiver = (NixlTransferAgent(cfg, KVRegion(pool, blocks.block_bytes), layout, f"{role}-pad16")
                        for role, pool in zip(("prefill", "decode"), pools))
    try:
        sender.handshake(receiver.control_address)
        reservation = receiver.receiver().reserve("r16", [7, 3, 8, 9, 11], sender=sender.name)
        sender.sender().open(reservation)
        sender.sender().write_blocks("r16", [0, 1, 2, 3, 4], last=True)
        receiver.receiver().wait("r16", 10)
        got = model.new_state()
        load_state(blocks, pools[1], [7, 3, 8, 9, 11], 70, got)
        for layer, kv in state.global_kv.items():
            assert torch.equal(got.global_kv[layer].main, kv.main)
            assert torch.equal(got.global_kv[layer].index_keys, kv.index_keys)
    finally:
        sender.close()
        receiver.close()
