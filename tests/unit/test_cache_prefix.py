"""Chained salted block hashes and the device prefix cache."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

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
