"""The disk tier persists global KV across restarts and never serves a damaged or foreign file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cedserve.model.cache.config import KVCacheConfig
from cedserve.model.cache.disk_format import HEADER_BYTES, block_path, write_block_file
from cedserve.model.cache.errors import CacheError, TierIOError
from cedserve.model.cache.events import BlockRemoved, KVEventBatch, Tier
from cedserve.model.cache.hashing import hash_blocks
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.cache.manager import KVCacheManager
from cedserve.model.presets import preset

pytestmark = pytest.mark.unit

LAYOUT = BlockLayout.from_config(preset("tiny"), 4)
PROMPT = list(range(17))  # 4 whole blocks + 1 token: all 4 blocks are cacheable
HASHES = hash_blocks(PROMPT, "", 4)


def fill(block_hash: bytes) -> torch.Tensor:
    return torch.from_numpy(np.resize(np.frombuffer(block_hash, dtype=np.uint8), LAYOUT.block_bytes).copy())


def manager(folder: Path, events: list[KVEventBatch] | None = None, **kw: object) -> KVCacheManager:
    config = KVCacheConfig(block_size=4, num_blocks=16, disk_dir=str(folder), disk_write_through=True, **kw)  # type: ignore[arg-type]
    return KVCacheManager(LAYOUT, config, event_sink=None if events is None else events.append)


def compute(cache: KVCacheManager, rid: str, start_block: int = 0) -> None:
    table = cache.block_table(rid)
    for i, h in enumerate(HASHES[start_block:], start_block):
        cache.pool.storage[table[i]] = fill(h)
    cache.commit(rid, len(PROMPT))


def persisted(folder: Path) -> None:
    with manager(folder) as cache:
        cache.admit("r", PROMPT)
        compute(cache, "r")
        cache.free("r")


def test_restart_serves_the_same_bytes(tmp_path: Path) -> None:
    persisted(tmp_path)
    events: list[KVEventBatch] = []
    with manager(tmp_path, events) as cache:
        assert events[0].is_snapshot and set(events[0].events[1].block_hashes) == set(HASHES)  # type: ignore[union-attr]
        assert cache.lookup(PROMPT).tiers == [Tier.DISK] * 4
        admission = cache.admit("r", PROMPT)
        assert admission.onload_pending and admission.num_cached_tokens == 16
        assert cache.finish_onload("r") == 16
        for i, h in enumerate(HASHES):
            assert torch.equal(cache.pool.storage[admission.block_ids[i]], fill(h))
        assert cache.lookup(PROMPT).tiers == [Tier.DEVICE] * 4
        assert cache.metrics.onload_disk_bytes == 4 * LAYOUT.block_bytes


def test_corrupt_file_is_rejected_counted_and_recomputed(tmp_path: Path) -> None:
    persisted(tmp_path)
    path = block_path(tmp_path, HASHES[2])
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 5] ^= 0x01
    path.write_bytes(bytes(data))
    events: list[KVEventBatch] = []
    with manager(tmp_path, events) as cache:
        cache.admit("r", PROMPT)
        assert cache.finish_onload("r") == 8  # blocks 0 and 1; block 2 is recomputed
        assert cache.metrics.disk_rejected_files == 1 and cache.metrics.onload_failed_blocks == 1
        assert not path.exists()
        assert any(e == BlockRemoved([HASHES[2]], Tier.DISK) for b in events for e in b.events)
        assert cache.lookup(PROMPT).tiers == [Tier.DEVICE, Tier.DEVICE]
        compute(cache, "r", start_block=2)  # the engine recomputes from token 8
        assert cache.lookup(PROMPT).tiers == [Tier.DEVICE] * 4
        cache.poll()
    with manager(tmp_path) as cache:  # the recomputed block was written back
        assert cache.lookup(PROMPT).tiers == [Tier.DISK] * 4


def test_truncated_file_is_dropped_at_restart(tmp_path: Path) -> None:
    persisted(tmp_path)
    path = block_path(tmp_path, HASHES[1])
    path.write_bytes(path.read_bytes()[: HEADER_BYTES + 10])
    with manager(tmp_path) as cache:
        assert cache.metrics.disk_rejected_files == 1 and not path.exists()
        assert cache.lookup(PROMPT).tiers == [Tier.DISK]


def test_foreign_and_torn_files_are_never_served(tmp_path: Path) -> None:
    persisted(tmp_path)
    other = BlockLayout.from_config(preset("tiny"), 8)
    foreign = block_path(tmp_path, HASHES[0])
    write_block_file(foreign, other.compat_hash, HASHES[0], np.zeros(other.block_bytes, np.uint8), fsync=False)
    swapped = block_path(tmp_path, HASHES[1])  # holds block 3's header and bytes under block 1's name
    swapped.write_bytes(block_path(tmp_path, HASHES[3]).read_bytes())
    torn = foreign.with_name(foreign.name + ".tmp-1-2")
    torn.write_bytes(b"half a block")
    with manager(tmp_path) as cache:
        assert cache.metrics.disk_foreign_files == 1 and foreign.exists()  # left for its owner
        assert cache.metrics.disk_rejected_files == 2 and not torn.exists() and not swapped.exists()
        assert cache.lookup(PROMPT).tiers == []


def test_failed_write_surfaces_from_poll(tmp_path: Path) -> None:
    fanout = block_path(tmp_path, HASHES[0]).parent
    fanout.parent.mkdir(parents=True, exist_ok=True)
    fanout.write_bytes(b"")  # a file where the folder should be: mkdir fails
    events: list[KVEventBatch] = []
    cache = manager(tmp_path, events)
    cache.admit("r", PROMPT)
    compute(cache, "r")
    assert cache.disk is not None
    cache.disk.drain()
    with pytest.raises(TierIOError) as info:
        cache.poll()
    assert isinstance(info.value.errors[0], OSError)
    assert cache.metrics.disk_io_errors == 1 and HASHES[0] not in cache.disk
    assert any(e == BlockRemoved([HASHES[0]], Tier.DISK) for b in events for e in b.events)
    cache.close()


def test_one_cache_per_folder(tmp_path: Path) -> None:
    with manager(tmp_path), pytest.raises(CacheError, match="in use"):
        manager(tmp_path)
