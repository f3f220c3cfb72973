"""Chained salted block hashes and the device prefix cache."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from cedserve.model.cache import prefix as prefix_module
from cedserve.model.cache.block_pool import BlockPool
from cedserve.model.cache.hashing import hash_blocks, root_hash
from cedserve.model.cache.prefix import PrefixCache

pytestmark = pytest.mark.unit

TOKENS = list(range(100, 140))  # 5 blocks of 8


def test_definition_is_the_documented_chain() -> None:
    root = hashlib.sha256(b"cedserve/prefix/v1\x00tenant").digest()
    first = hashlib.sha256(root + struct.pack("<8I", *TOKENS[:8])).digest()
    second = hashlib.sha256(first + struct.pack("<8I", *TOKENS[8:16])).digest()
    assert root_hash("tenant") == root
    assert hash_blocks(TOKENS, "tenant", 8)[:2] == [first, second]


def test_same_tokens_and_salt_hit() -> None:
    assert hash_blocks(TOKENS, "a", 8) == hash_blocks(np.asarray(TOKENS, dtype=np.int32), "a", 8)
    assert hash_blocks(tuple(TOKENS), "a", 8) == hash_blocks(TOKENS, "a", 8)  # lists and tuples: packed apart
    assert hash_blocks([0, 2**32 - 1] * 4, "a", 8) == hash_blocks(np.asarray([0, 2**32 - 1] * 4), "a", 8)
    assert len(hash_blocks([*TOKENS, 1, 2, 3], "a", 8)) == 5  # the partial block is not hashed


def test_other_salt_misses_everywhere() -> None:
    a, b = hash_blocks(TOKENS, "a", 8), hash_blocks(TOKENS, "b", 8)
    assert not set(a) & set(b)
    assert not set(a) & set(hash_blocks(TOKENS, "", 8))


def test_one_changed_token_misses_from_its_block_on() -> None:
    changed = list(TOKENS)
    changed[20] += 1  # block 2
    a, b = hash_blocks(TOKENS, "", 8), hash_blocks(changed, "", 8)
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:]))


def test_continuing_a_chain_equals_hashing_all() -> None:
    whole = hash_blocks(TOKENS, "s", 8)
    assert hash_blocks(TOKENS[16:], "ignored", 8, parent=whole[1]) == whole[2:]


def test_bad_token_ids_are_rejected() -> None:
    for bad in ([-1] * 8, (2**32,) * 8):
        with pytest.raises(ValueError, match="2\\*\\*32"):
            hash_blocks(bad, "", 8)
    with pytest.raises(ValueError, match="integers"):
        hash_blocks([1.5] * 8, "", 8)
    with pytest.raises(ValueError, match="integers"):
        hash_blocks(np.zeros(8, dtype=np.float32), "", 8)


def test_lookup_returns_the_longest_cached_run() -> None:
    pool = BlockPool(8, 16)
    cache = PrefixCache(pool, 8)
    hashes = cache.block_hashes(TOKENS, "s")
    blocks = pool.allocate(5, "r")
    inserted = cache.insert(blocks[:3] + blocks[4:], hashes[:3] + hashes[4:])
    assert inserted.all()
    assert cache.lookup(hashes) == blocks[:3]  # block 3 missing: the run stops there
    assert cache.lookup(cache.block_hashes(TOKENS, "other")) == []
    # a second request that computed the same block does not replace the cached one
    other = pool.allocate(1, "r2")
    assert not cache.insert(other, [hashes[0]]).any()
    assert cache.get(hashes[0]) == blocks[0]


def test_eviction_takes_idle_blocks_tail_first() -> None:
    pool = BlockPool(8, 16)
    cache = PrefixCache(pool, 8)
    hashes = cache.block_hashes(TOKENS, "")
    first = pool.allocate(3, "a")
    cache.insert(first, hashes[:3])
    pool.decref(first)
    cache.touch_released(first)
    assert cache.num_evictable() == 3
    assert cache.pick_victims(2).tolist() == [first[2], first[1]]
    pool.incref([first[2]])  # revived by a hit: no longer a candidate
    assert cache.pick_victims(8).tolist() == [first[1], first[0]]
    assert cache.remove([first[1]]) == [hashes[1]]
    assert hashes[1] not in cache and len(cache) == 2


@pytest.mark.parametrize("seed", range(4))
def test_victims_from_the_release_queue_equal_sorting_every_idle_block(seed: int,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a random run of allocations, inserts, releases, revivals and evictions, `pick_victims`
    (read from the release queue) names exactly what sorting every idle cached block by stamp names,
    through the queue's re-layouts (a small queue) and without falling back to the sort."""
    monkeypatch.setattr(prefix_module, "QUEUE_MIN", 8)
    rng = np.random.default_rng(seed)
    pool = BlockPool(48, 4)
    cache = PrefixCache(pool, 8)
    reference = cache._scan_victims
    fallbacks: list[int] = []
    monkeypatch.setattr(cache, "_scan_victims", lambda n: fallbacks.append(n) or reference(n))
    held: dict[str, list[int]] = {}
    serial = 0
    for step in range(800):
        op = rng.integers(5)
        if op == 0 and pool.num_free:  # a request computes blocks, and they are cached
            blocks = pool.allocate(int(rng.integers(1, min(pool.num_free, 5) + 1)), f"r{serial}")
            cache.insert(blocks, [f"{serial}-{i}".encode().ljust(32, b"-")[:32] for i in range(len(blocks))])
            held[f"r{serial}"] = blocks
            serial += 1
        elif op == 1 and held:  # a request leaves: its blocks go idle, stamped tail first
            blocks = held.pop(list(held)[int(rng.integers(len(held)))])
            idle = pool.decref(blocks)
            table = np.asarray(blocks)
            cache.touch_released(table[np.isin(table, idle)])
        elif op == 2:  # a prefix hit revives idle cached blocks
            idle = np.flatnonzero(pool.idle_mask())
            if idle.size:
                revived = idle[rng.random(idle.size) < 0.3].tolist()
                if revived:
                    pool.incref(revived)
                    held[f"r{serial}"] = revived
                    serial += 1
        elif op == 3:  # eviction
            n = int(rng.integers(1, 6))
            victims = cache.pick_victims(n)
            assert victims.tolist() == reference(n).tolist(), step
            cache.remove(victims)
            pool.free(victims)
        else:
            n = int(rng.integers(1, 50))
            assert cache.pick_victims(n).tolist() == reference(n).tolist(), step
        assert cache.num_evictable() == int((pool.idle_mask() & cache.cached_mask(np.arange(48))).sum())
        pool.check_invariants()
    assert fallbacks == [] and cache._queue.shape[1] < 200  # the queue answered; stale entries were dropped
