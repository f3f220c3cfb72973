"""The block pool: contiguous allocation, reference counts, typed exhaustion."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cedserve.model.cache.block_pool import BlockPool, contiguous_runs
from cedserve.model.cache.errors import CacheExhaustedError

pytestmark = pytest.mark.unit


def test_storage_is_one_contiguous_tensor() -> None:
    pool = BlockPool(5, 64)
    assert pool.storage.shape == (5, 64) and pool.storage.is_contiguous()
    assert pool.num_free == 5 and pool.num_extents == 1


def test_allocations_are_contiguous_runs_and_continue_at_the_hint() -> None:
    pool = BlockPool(16, 8)
    a = pool.allocate(4, "a")
    b = pool.allocate(4, "b")
    assert a == [0, 1, 2, 3] and b == [4, 5, 6, 7]
    pool.decref(a)
    pool.free(a)
    more_b = pool.allocate(2, "b", hint=8)
    assert more_b == [8, 9]
    # best fit: a 3-block request takes the 4-block hole, not the 6-block tail
    assert pool.allocate(3, "c") == [0, 1, 2]
    pool.check_invariants()


def test_fragmented_pool_uses_largest_extents_first() -> None:
    pool = BlockPool(10, 8)
    ids = pool.allocate(10, "x")
    keep = [1, 4, 5, 9]  # free runs: [0], [2,3], [6,7,8]
    release = [b for b in ids if b not in keep]
    pool.decref(release)
    pool.free(release)
    got = pool.allocate(5, "y")
    assert got == [6, 7, 8, 2, 3]
    assert contiguous_runs(got).tolist() == [[6, 3], [2, 2]]
    pool.check_invariants()


def test_exhaustion_is_typed_and_allocates_nothing() -> None:
    pool = BlockPool(4, 8)
    pool.allocate(3, "a")
    with pytest.raises(CacheExhaustedError) as info:
        pool.allocate(2, "req-7")
    assert (info.value.request_id, info.value.needed, info.value.available) == ("req-7", 2, 1)
    assert "req-7" in str(info.value)
    assert pool.num_free == 1


def test_refcounts_share_and_release() -> None:
    pool = BlockPool(4, 8)
    ids = pool.allocate(2, "a")
    pool.incref(ids)
    assert pool.decref(ids).size == 0  # still held once
    idle = pool.decref(ids)
    assert idle.tolist() == ids and pool.idle_mask()[ids].all()
    pool.incref([ids[0]])  # an idle (cached) block can be revived
    with pytest.raises(ValueError, match="still referenced"):
        pool.free(ids)
    pool.decref([ids[0]])
    pool.free(ids)
    with pytest.raises(ValueError, match="free"):
        pool.free(ids)
    with pytest.raises(ValueError, match="free"):
        pool.incref(ids)
    with pytest.raises(ValueError, match="unreferenced"):
        pool.decref(ids)
    assert pool.num_free == 4 and pool.num_extents == 1
    pool.check_invariants()


def test_byte_runs_merge_adjacent_blocks() -> None:
    pool = BlockPool(8, 100)
    assert pool.byte_runs([2, 3, 4, 7, 0]).tolist() == [[200, 300], [700, 100], [0, 100]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 12), st.integers(0, 40)), max_size=40))
def test_random_allocate_free_never_overlaps(ops: list[tuple[bool, int, int]]) -> None:
    pool = BlockPool(32, 4)
    held: list[list[int]] = []
    for is_alloc, n, pick in ops:
        if is_alloc:
            hint = held[pick % len(held)][-1] + 1 if held and held[pick % len(held)] else None
            try:
                held.append(pool.allocate(n, "r", hint))
            except CacheExhaustedError:
                assert n > pool.num_free
        elif held:
            ids = held.pop(pick % len(held))
            pool.free(pool.decref(ids))
        pool.check_invariants()
        flat = [b for ids in held for b in ids]
        assert len(flat) == len(set(flat)) == 32 - pool.num_free
        assert (pool.refcount(np.asarray(flat, dtype=np.int64)) == 1).all()


@pytest.mark.parametrize("seed", range(4))
def test_idle_counts_follow_every_operation(seed: int) -> None:
    """`num_idle` and `num_idle_tracked` (kept as counters, not counted per call) equal the pool's
    masks after every operation of a random run of allocate, incref, decref, free and track."""
    rng = np.random.default_rng(seed)
    pool = BlockPool(64, 4)
    held: list[int] = []  # one entry per reference
    for _ in range(600):
        op = rng.integers(6)
        idle = np.flatnonzero(pool.idle_mask())
        if op == 0 and pool.num_free:
            held += pool.allocate(int(rng.integers(1, min(pool.num_free, 6) + 1)), "r")
        elif op == 1 and held:  # more references, repeats included, to blocks in use or idle
            ids = [held[i] for i in rng.integers(len(held), size=3)] + idle[:2].tolist()
            pool.incref(ids)
            held += ids
        elif op == 2 and held:
            picks = sorted(set(rng.integers(len(held), size=4).tolist()), reverse=True)
            pool.decref([held.pop(i) for i in picks])
        elif op == 3 and idle.size:
            pool.free(idle[rng.random(idle.size) < 0.5])
        elif op == 4:
            ids = rng.integers(64, size=5)
            pool.track(np.concatenate([ids, ids[:2]]), bool(rng.integers(2)))  # repeats count once
        mask = pool.idle_mask()
        assert pool.num_idle == int(mask.sum())
        assert pool.num_idle_tracked == int((mask & pool._tracked).sum())
        pool.check_invariants()
