"""The cache manager: sharing, exhaustion, eviction down the tiers, decode growth, metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from cedserve.model.cache.config import KVCacheConfig
from cedserve.model.cache.errors import CacheExhaustedError, UnknownRequestError
from cedserve.model.cache.events import BlockTierChanged, KVEventBatch, KVIndexMirror, Tier
from cedserve.model.cache.hashing import hash_blocks
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.cache.manager import KVCacheManager
from cedserve.model.cache.metrics import CacheMetricsCollector
from cedserve.model.presets import preset

pytestmark = pytest.mark.unit

LAYOUT = BlockLayout.from_config(preset("tiny"), 4)


def make(num_blocks: int = 12, host: int = 0, events: list[KVEventBatch] | None = None) -> KVCacheManager:
    config = KVCacheConfig(block_size=4, num_blocks=num_blocks, host_offload_blocks=host)
    return KVCacheManager(LAYOUT, config, event_sink=None if events is None else events.append)


def run(cache: KVCacheManager, rid: str, tokens: list[int], salt: str = "") -> list[int]:
    """Admit, 'compute' (fill each block with its index in the prompt), commit; returns the block table."""
    admission = cache.admit(rid, tokens, salt)
    table = admission.block_ids
    for i in range(admission.num_cached_tokens // 4, len(table)):
        cache.pool.storage[table[i]] = i + 1
    cache.commit(rid, len(tokens))
    return table


def test_a_shared_prefix_is_shared_without_copy() -> None:
    cache = make()
    first = run(cache, "a", list(range(16)))
    second = cache.admit("b", list(range(16)))
    assert second.num_cached_tokens == 12  # 3 of 4 blocks: the last token is always computed
    assert second.block_ids[:3] == first[:3] and second.block_ids[3] != first[3]
    assert cache.pool.refcount(first[:3]).tolist() == [2, 2, 2]
    assert cache.metrics.hit_blocks_device == 3
    cache.free("a")
    cache.free("b")
    cache.check_invariants()
    with pytest.raises(UnknownRequestError):
        cache.free("a")


def test_salts_partition_the_cache() -> None:
    cache = make()
    run(cache, "a", list(range(16)), salt="tenant-1")
    assert cache.admit("b", list(range(16)), salt="tenant-2").num_cached_tokens == 0


def test_scratch_blocks_are_never_cached_and_come_back_on_free() -> None:
    """Blocks for non-KV bytes (a shipped decode state): may evict idle cached blocks to make room,
    are never offered to the prefix cache, and `free(owner)` returns them."""
    cache = make(num_blocks=6)
    run(cache, "a", list(range(16)))
    cache.free("a")  # 3 idle cached blocks, 3 free
    scratch = cache.allocate_scratch("a#state", 5)  # 2 of the cached blocks must go
    assert len(set(scratch)) == 5 and cache.prefix.num_evictable() == 1
    assert cache.block_table("a#state") == scratch
    with pytest.raises(ValueError, match="already admitted"):
        cache.allocate_scratch("a#state", 1)
    with pytest.raises(CacheExhaustedError):
        cache.allocate_scratch("b#state", 2)  # one evictable block left, none free
    cache.check_invariants()
    cache.free("a#state")
    assert cache.pool.num_free == 5 and cache.prefix.num_evictable() == 1
    cache.check_invariants()


def test_exhaustion_leaves_nothing_behind() -> None:
    cache = make(num_blocks=6)
    run(cache, "a", list(range(16)))  # holds 4 blocks
    free_before = cache.pool.num_free
    with pytest.raises(CacheExhaustedError) as info:
        cache.admit("b", list(range(100, 120)))  # 5 blocks, 2 free, none evictable
    assert (info.value.request_id, info.value.needed, info.value.available) == ("b", 5, 2)
    assert cache.pool.num_free == free_before and cache.metrics.exhausted_errors == 1
    with pytest.raises(UnknownRequestError):
        cache.block_table("b")
    cache.check_invariants()


def test_eviction_moves_blocks_to_host_and_hits_copy_them_back() -> None:
    events: list[KVEventBatch] = []
    mirror = KVIndexMirror()
    cache = make(num_blocks=8, host=8, events=events)
    for batch in events:
        mirror.apply(batch)
    table = run(cache, "a", list(range(16)))
    cache.free("a")
    expected = [cache.pool.storage[b].clone() for b in table[:3]]
    run(cache, "filler", list(range(100, 132)))  # 8 blocks: every idle block must go
    assert cache.metrics.evicted_device_blocks == 4 and len(cache.host or []) == 4
    cache.free("filler")
    again = cache.admit("c", list(range(16)))
    assert again.hit_tiers == (Tier.HOST,) * 3 and not again.onload_pending
    for block, want in zip(again.block_ids, expected):
        assert torch.equal(cache.pool.storage[block], want)
    assert cache.metrics.onload_host_bytes == 3 * LAYOUT.block_bytes
    moved = [e for b in events for e in b.events if isinstance(e, BlockTierChanged)]
    assert moved and moved[0].src is Tier.DEVICE and moved[0].dst is Tier.HOST
    for batch in events[1:]:
        mirror.apply(batch)
    actual = {h: {t for t, hs in cache.holdings() if h in hs} for _, hs in cache.holdings() for h in hs}
    assert mirror.holdings(cache.events.worker_id) == {h: frozenset(t) for h, t in actual.items()}


def test_decode_grows_contiguously_commits_and_truncates() -> None:
    cache = make()
    cache.admit("a", list(range(6)))  # 2 blocks
    table = cache.block_table("a")
    fresh = cache.append_tokens("a", [6, 7, 8])  # 9 tokens: a third block
    assert fresh == [table[-1] + 1]
    cache.commit("a", 8)
    hashes = hash_blocks(list(range(9)), "", 4)
    assert cache.prefix.lookup(hashes) == cache.block_table("a")[:2]
    with pytest.raises(ValueError, match="committed"):
        cache.truncate("a", 7)
    cache.truncate("a", 8)  # drop a rejected draft token
    assert cache.num_tokens("a") == 8
    with pytest.raises(ValueError, match="computed tokens"):
        cache.commit("a", 9)


def test_reserved_blocks_hold_no_tokens_until_tokens_fill_them() -> None:
    """`reserve_tokens` grows the table for draft rows without adding tokens: a later
    `append_tokens` fills the reserved block before taking a new one, `free` returns it, and a pool
    that cannot supply the blocks raises with nothing taken."""
    cache = make(num_blocks=4)
    cache.admit("a", list(range(6)))  # 2 blocks
    table = cache.block_table("a")
    assert cache.reserve_tokens("a", 8) == []  # 8 tokens fit the 2 blocks
    fresh = cache.reserve_tokens("a", 11)  # a verify's drafts reaching into a third block
    assert fresh == [table[-1] + 1] and cache.block_table("a") == table + fresh and cache.num_tokens("a") == 6
    assert cache.append_tokens("a", [6, 7, 8]) == [] and cache.block_table("a") == table + fresh
    assert cache.num_tokens("a") == 9
    free = cache.pool.num_free
    with pytest.raises(CacheExhaustedError):
        cache.reserve_tokens("a", 4 * 6)  # three more blocks, one free
    assert cache.pool.num_free == free and len(cache.block_table("a")) == 3
    cache.check_invariants()
    cache.free("a")
    assert cache.pool.num_free == 4
    cache.check_invariants()


def test_metrics_export_to_prometheus() -> None:
    cache = make()
    run(cache, "a", list(range(8)))
    registry = CollectorRegistry()
    registry.register(CacheMetricsCollector(cache.metrics, "w0"))
    text = generate_latest(registry).decode()
    assert 'cedserve_cache_allocated_blocks_total{worker="w0"} 2.0' in text
    assert "cedserve_cache_disk_rejected_files_total" in text


def test_lookup_costs_nothing() -> None:
    cache = make()
    run(cache, "a", list(range(16)))
    before = cache.pool.refcount(np.arange(12)).copy()
    assert cache.lookup(list(range(16))).tiers == [Tier.DEVICE] * 3
    assert (cache.pool.refcount(np.arange(12)) == before).all() and cache.metrics.lookups == 1
