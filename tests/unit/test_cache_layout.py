"""The block layout is the byte contract the kernels and transfers read."""

from __future__ import annotations

import pytest
import torch

from cedserve.kernels.reference import pack_index_key, pack_main_kv, unpack_index_key, unpack_main_kv
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.presets import preset

pytestmark = pytest.mark.unit


def test_released_geometry_table() -> None:
    layout = BlockLayout.from_config(preset("v4.1-flash"), 64)
    assert layout.block_bytes == 56_960 == 64 * 890
    assert layout.padding_bytes == 0
    assert layout.layer_ids == (2, 8, 14, 20)
    rows = [(r.layer_id, r.kind, r.entries, r.offset, r.nbytes) for r in layout.regions]
    assert rows == [
        (2, "main", 32, 0, 9216), (2, "index", 32, 9216, 2176),
        (8, "main", 32, 11392, 9216), (8, "index", 32, 20608, 2176),
        (14, "main", 32, 22784, 9216), (14, "index", 32, 32000, 2176),
        (20, "main", 64, 34176, 18432), (20, "index", 64, 52608, 4352),
    ]


@pytest.mark.parametrize("name, block_size", [("tiny", 2), ("tiny", 6), ("mini-40", 64), ("v4.1-flash", 128)])
def test_regions_are_aligned_disjoint_and_inside(name: str, block_size: int) -> None:
    layout = BlockLayout.from_config(preset(name), block_size)
    end = 0
    for r in layout.regions:
        assert r.offset % layout.align_bytes == 0 and r.offset >= end
        assert r.entries == block_size // r.compress_ratio
        end = r.end
    assert end <= layout.block_bytes and layout.block_bytes % layout.align_bytes == 0


def test_block_size_must_fit_ratios_and_candidate_block() -> None:
    with pytest.raises(ValueError, match="compress ratio 2"):
        BlockLayout.from_config(preset("v4.1-flash"), 33)
    with pytest.raises(ValueError, match="candidate block"):
        BlockLayout.from_config(preset("v4.1-flash"), 4)  # candidate block = 8 entries of m=1
    with pytest.raises(ValueError, match="positive"):
        BlockLayout.from_config(preset("tiny"), 0)


def test_views_alias_the_pool_and_round_trip_records() -> None:
    config = preset("tiny")
    layout = BlockLayout.from_config(config, 4)
    pool = torch.zeros(3, layout.block_bytes, dtype=torch.uint8)
    x = torch.randn(4, config.head_dim)
    k = torch.randn(4, config.index_head_dim)
    layout.main_kv(pool[1], 6).copy_(pack_main_kv(x))
    layout.index_keys(pool[1], 6).copy_(pack_index_key(k))
    strided = layout.pool_view(pool, 6, "main")
    assert strided.shape == (3, 4, 36)
    assert strided.data_ptr() == pool.data_ptr() + layout.region(6, "main").offset
    assert torch.equal(unpack_main_kv(strided[1]), unpack_main_kv(pack_main_kv(x)))
    assert torch.equal(unpack_index_key(layout.pool_view(pool, 6, "index")[1]), unpack_index_key(pack_index_key(k)))
    assert layout.main_kv(pool[1], 2).shape == (2, 36)  # m = 2: two entries for four tokens
    assert int(pool[0].sum()) == 0 and int(pool[2].sum()) == 0  # nothing spilled into neighbours
    with pytest.raises(KeyError, match="KV-source layers"):
        layout.main_kv(pool[0], 3)
    with pytest.raises(ValueError, match="block_bytes"):
        layout.main_kv(pool[0, :10], 2)


def test_compat_hash_tracks_the_table() -> None:
    a = BlockLayout.from_config(preset("v4.1-flash"), 64)
    assert a.compat_hash == BlockLayout.from_config(preset("v4.1-flash"), 64).compat_hash
    assert len(a.compat_hash) == 16
    assert a.compat_hash != BlockLayout.from_config(preset("v4.1-flash"), 128).compat_hash
    assert a.compat_hash != BlockLayout.from_config(preset("tiny"), 64).compat_hash
