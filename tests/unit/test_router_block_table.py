"""The prefix index's hash table against a dict, on random inserts, updates and deletions.

Keys are drawn from small pools so that the table fills, rebuilds, reuses DELETED slots, and sees keys
that share their first 8 bytes (one tag) or 12 (tag and check: `get` and `get_prefix` may not tell
those apart, `find` must), and keys of other lengths than 32 bytes.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cedserve.router.block_table import EMPTY, BlockTable, as_keys


def _pool(rng: random.Random) -> tuple[list[bytes], bytes]:
    """Keys, and the 12 bytes a dozen of them share."""
    tag, tag_and_check = rng.randbytes(8), rng.randbytes(12)
    return (
        [rng.randbytes(32) for _ in range(300)]
        + [tag + rng.randbytes(24) for _ in range(12)]
        + [tag_and_check + rng.randbytes(20) for _ in range(12)]
        + [b"short", b"", rng.randbytes(40)],
        tag_and_check,
    )


def _check(table: BlockTable, ref: dict[bytes, int], pool: list[bytes], shared: bytes) -> None:
    keys = as_keys(pool)
    slots = table.find(keys)
    assert [s >= 0 for s in slots.tolist()] == [h in ref for h in pool]
    assert table.values_at(slots[slots >= 0]).tolist() == [ref[h] for h in pool if h in ref]
    got = table.get(keys).tolist()
    for h, v in zip(pool, got, strict=True):
        if h[:12] != shared:  # 96 bits tell these apart
            assert v == ref.get(h, EMPTY)
        else:  # a key sharing 12 bytes with a present one may read that one's value
            assert v == ref.get(h, EMPTY) or v in [ref[k] for k in ref if k[:12] == shared]
    # The prefix walk's lookup: `get` cut at the first absent key (all of them when none is absent).
    first_miss = next((k for k, v in enumerate(got) if v == EMPTY), len(got))
    assert table.get_prefix(keys).tolist() == got[:first_miss]
    held = [h for h in ref if h[:12] != shared]
    assert table.get_prefix(as_keys(held)).tolist() == [ref[h] for h in held]
    assert len(table) == len(ref)


@pytest.mark.parametrize("seed", range(6))
def test_table_matches_a_dict(seed: int) -> None:
    rng = random.Random(seed)
    pool, shared = _pool(rng)
    table, ref = BlockTable(num_buckets=rng.choice([1, 2, 16])), {}
    for _ in range(300):
        batch = list(dict.fromkeys(rng.sample(pool, rng.randrange(1, 60))))
        keys = as_keys(batch)
        slots = table.find(keys)
        present = slots >= 0
        values = np.array([rng.randrange(10_000) for _ in batch], dtype=np.int32)
        kind = rng.random()
        if kind < 0.5:
            table.insert(keys[~present], values[~present])
            ref.update(
                (h, v) for h, v, p in zip(batch, values.tolist(), present.tolist(), strict=True) if not p
            )
        elif kind < 0.8:
            table.delete(slots[present])
            for h in (h for h, p in zip(batch, present.tolist(), strict=True) if p):
                del ref[h]
        else:
            table.set_values(slots[present], values[present])
            ref.update((h, v) for h, v, p in zip(batch, values.tolist(), present.tolist(), strict=True) if p)
        _check(table, ref, pool, shared)
    live = table.values
    assert sorted(live[live >= 0].tolist()) == sorted(ref.values())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 40), min_size=1, max_size=12)), max_size=40))
def test_table_under_inserts_and_deletes(ops: list[tuple[bool, list[int]]]) -> None:
    keys_of = [bytes([i]) * 32 if i % 3 else bytes([i]) * 12 + bytes(20) for i in range(41)]
    table, ref = BlockTable(num_buckets=1), {}
    for insert, picks in ops:
        batch = list(dict.fromkeys(keys_of[i] for i in picks))
        keys = as_keys(batch)
        slots = table.find(keys)
        if insert:
            new = slots < 0
            table.insert(keys[new], np.arange(len(batch), dtype=np.int32)[new])
            ref.update((h, i) for i, h in enumerate(batch) if h not in ref)
        else:
            table.delete(slots[slots >= 0])
            for h in batch:
                ref.pop(h, None)
        found = table.find(as_keys(keys_of))
        assert [s >= 0 for s in found.tolist()] == [h in ref for h in keys_of]
        assert table.values_at(found[found >= 0]).tolist() == [ref[h] for h in keys_of if h in ref]


@pytest.mark.parametrize("seed", range(4))
def test_one_key_methods_match_a_dict(seed: int) -> None:
    """`find_one` / `insert_one` / `set_value` / `delete_one` (small events), mixed with the vectorised
    methods on the same table."""
    rng = random.Random(100 + seed)
    pool, shared = _pool(rng)
    table, ref = BlockTable(num_buckets=2), {}
    for _ in range(1500):
        h = rng.choice(pool)
        slot, free = table.find_one(h)
        assert (slot >= 0) == (h in ref) and (slot >= 0 or free >= 0)
        if slot >= 0:
            assert table.value_at(slot) == ref[h]
            if rng.random() < 0.5:
                table.delete_one(slot)
                del ref[h]
            else:
                ref[h] = rng.randrange(10_000)
                table.set_value(slot, ref[h])
        else:
            ref[h] = rng.randrange(10_000)
            table.insert_one(h, ref[h], free)
        if rng.random() < 0.02:
            batch = [k for k in rng.sample(pool, 30) if k not in ref]
            values = np.arange(len(batch), dtype=np.int32)
            table.insert(as_keys(batch), values)
            ref.update(zip(batch, values.tolist(), strict=True))
    _check(table, ref, pool, shared)
