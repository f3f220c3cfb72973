"""The cache on a CUDA device: pinned host tier, disk tier and byte-exact round trips (skipped without CUDA)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cedserve.model.cache.config import KVCacheConfig
from cedserve.model.cache.events import Tier
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.cache.manager import KVCacheManager
from cedserve.model.presets import preset

pytestmark = [pytest.mark.unit, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LAYOUT = BlockLayout.from_config(preset("v4.1-flash"), 64)


def test_round_trips_through_host_and_disk_on_cuda(tmp_path: Path) -> None:
    tokens = np.arange(8 * 64 + 1) % 1000
    config = KVCacheConfig(block_size=64, num_blocks=10, host_offload_blocks=4, disk_dir=str(tmp_path))
    cache = KVCacheManager(LAYOUT, config, device="cuda")
    assert cache.pool.storage.is_cuda and cache.host is not None and cache.host.storage.is_pinned()
    admission = cache.admit("a", tokens)
    rows = torch.tensor(admission.block_ids, device="cuda")
    data = torch.randint(0, 256, (len(rows), LAYOUT.block_bytes), dtype=torch.uint8, device="cuda")
    cache.pool.storage[rows] = data
    cache.commit("a", len(tokens))
    cache.free("a")
    assert cache.evict(8) == 8  # 4 to host, 4 through host to disk
    again = cache.admit("b", tokens)
    assert set(again.hit_tiers) == {Tier.HOST, Tier.DISK}
    assert cache.finish_onload("b") == 8 * 64
    got = cache.pool.storage[torch.tensor(again.block_ids[:8], device="cuda")]
    assert torch.equal(got, data[:8])
    cache.free("b")
    cache.close(persist=True)
    cache = KVCacheManager(LAYOUT, config, device="cuda")
    third = cache.admit("c", tokens)
    assert third.hit_tiers == (Tier.DISK,) * 8 and cache.finish_onload("c") == 8 * 64
    assert torch.equal(cache.pool.storage[torch.tensor(third.block_ids[:8], device="cuda")], data[:8])
    cache.close()
