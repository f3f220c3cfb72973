"""The router's fast paths against straightforward references on random workloads.

`GlobalPrefixIndex.prefix_runs` (interned holder sets, identity walk) against a per-worker walk over
each worker's own holdings (the KV mirror, not the inverted map); `LoadTable.place` (arrays updated
on load reports, argmin per decode column) against `placement.place` over freshly built loads.
Values are drawn from small pools so that exact ties, full decode workers and measured links occur.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cedserve.model.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockTierChanged,
    KVEvent,
    KVEventBatch,
    KVIndexMirror,
    Tier,
)
from cedserve.model.cache.hashing import hash_blocks
from cedserve.router.index import TIER_ORDER, GlobalPrefixIndex
from cedserve.router.load_table import LoadTable
from cedserve.router.placement import (
    DecodeLoad,
    LinkModel,
    LinkRates,
    MeasuredLinks,
    NoCapacityError,
    NoWorkerError,
    Placement,
    PrefillLoad,
    RequestShape,
    place,
)

# ------------------------------------------------------------------ prefix index


def _chains(rng: random.Random) -> list[list[bytes]]:
    """Prompt chains sharing prefixes: a few roots, each continued by a few branches."""
    roots = [hash_blocks(list(range(r * 5, r * 5 + 4 * 12)), "s", 4) for r in range(3)]
    chains = list(roots)
    for root in roots:
        for b in range(2):
            cut = rng.randrange(1, len(root))
            chains.append(root[:cut] + hash_blocks([900 + b] * 4 * 8, "", 4, parent=root[cut - 1]))
    return chains


def _random_events(rng: random.Random, chains: list[list[bytes]]) -> list[KVEvent]:
    events: list[KVEvent] = []
    for _ in range(rng.randrange(1, 6)):
        chain = rng.choice(chains)
        lo = rng.randrange(len(chain))
        hashes = chain[lo: rng.randrange(lo + 1, len(chain) + 1)]
        kind = rng.random()
        if kind < 0.55:
            events.append(BlockStored(hashes, rng.choice(TIER_ORDER)))
        elif kind < 0.8:
            events.append(BlockRemoved(hashes, rng.choice(TIER_ORDER)))
        elif kind < 0.97:
            src, dst = rng.sample(TIER_ORDER, 2)
            events.append(BlockTierChanged(hashes, src, dst))
        else:
            events.append(AllBlocksCleared())
    return events


def _oracle(mirror: KVIndexMirror, workers: list[str], hashes: list[bytes]) -> dict[str, list[int]]:
    """Per worker, from its own holdings (a per-worker mirror fed the same batches): walk the chain
    until the first block it lacks."""
    out = {}
    for w in workers:
        held = mirror.holdings(w)
        counts = [0, 0, 0]
        for h in hashes:
            tiers = held.get(h)
            if not tiers:
                break
            counts[min(TIER_ORDER.index(t) for t in tiers)] += 1
        if sum(counts):
            out[w] = counts
    return out


@pytest.mark.parametrize("seed", range(8))
def test_prefix_runs_match_a_per_worker_walk(seed: int) -> None:
    rng = random.Random(seed)
    chains = _chains(rng)
    workers = [f"w{i}" for i in range(6)]
    index, mirror = GlobalPrefixIndex(), KVIndexMirror()
    seq, epoch = dict.fromkeys(workers, 0), dict.fromkeys(workers, 1)
    for w in workers:
        assert index.apply(KVEventBatch(w, 0, [AllBlocksCleared()], epoch=1))
        mirror.apply(KVEventBatch(w, 0, [AllBlocksCleared()], epoch=1))
    for step in range(120):
        w = rng.choice(workers)
        if rng.random() < 0.03:
            index.forget(w)  # it comes back with a snapshot of a new epoch
            seq[w], epoch[w] = 0, epoch[w] + 1
            events = [AllBlocksCleared(), *_random_events(rng, chains)]
        else:
            seq[w] += 1
            events = _random_events(rng, chains)
        assert index.apply(KVEventBatch(w, seq[w], events, epoch=epoch[w]))
        mirror.apply(KVEventBatch(w, seq[w], events, epoch=epoch[w]))
        if step % 10 == 9:
            for chain in chains:
                query = chain[: rng.randrange(1, len(chain) + 1)]
                expected = _oracle(mirror, workers, query)
                assert index.prefix_runs(query) == expected
                reference = index.prefix_hits_reference(query)
                assert {w: [h.blocks_by_tier[t] for t in TIER_ORDER] for w, h in reference.items()
                        if h.total_blocks} == expected
    assert index.num_entries == sum(len(mirror.holdings(w)) for w in workers)


@pytest.mark.parametrize("seed", range(4))
def test_prefix_runs_over_long_chains_and_repeated_walks(seed: int) -> None:
    """Chains of hundreds of blocks (the walk's lookups come in several doubling chunks) held in
    staggered lengths and tiers by many workers (one holder-set change per block or so), walked
    again after each update: a memoised change between two holder sets must stay right while
    other hashes move to new sets."""
    rng = random.Random(100 + seed)
    chain = hash_blocks(list(range(4 * 300)), "long", 4)
    other = hash_blocks(list(range(7, 7 + 4 * 200)), "long", 4)
    workers = [f"w{i}" for i in range(12)]
    index, mirror = GlobalPrefixIndex(), KVIndexMirror()
    seq = dict.fromkeys(workers, 0)
    for w in workers:
        batch = KVEventBatch(w, 0, [AllBlocksCleared(), BlockStored(chain[: rng.randrange(1, len(chain))],
                                                                    rng.choice(TIER_ORDER))], epoch=1)
        index.apply(batch)
        mirror.apply(batch)
    for _ in range(40):
        for query in (chain, chain[: rng.randrange(1, len(chain))], other):
            assert index.prefix_runs(query) == _oracle(mirror, workers, query)
            assert index.prefix_runs(query) == _oracle(mirror, workers, query)  # memoised changes
        w = rng.choice(workers)
        seq[w] += 1
        source = rng.choice((chain, other))
        lo = rng.randrange(len(source))
        hashes = source[lo: rng.randrange(lo + 1, len(source) + 1)]
        event = rng.choice([BlockStored(hashes, rng.choice(TIER_ORDER)), BlockRemoved(hashes, rng.choice(TIER_ORDER)),
                            BlockTierChanged(hashes, *rng.sample(TIER_ORDER, 2))])
        batch = KVEventBatch(w, seq[w], [event], epoch=1)
        assert index.apply(batch)
        mirror.apply(batch)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["store", "remove", "move", "clear", "forget"]),
                          st.integers(0, 29), st.integers(1, 30), st.sampled_from(TIER_ORDER),
                          st.sampled_from(TIER_ORDER)), max_size=40))
def test_prefix_runs_under_any_event_sequence(ops: list[tuple[int, str, int, int, Tier, Tier]]) -> None:
    """Runs that change tier part-way (the walk's slow branch), start past block 0, are cut by a
    removal, or belong to a worker forgotten and back: the walk, the reference walk and a per-worker
    walk agree after every event."""
    chain = hash_blocks(list(range(4 * 30)), "h", 4)
    index, mirror = GlobalPrefixIndex(), KVIndexMirror()
    workers = [f"w{i}" for i in range(4)]
    seq = dict.fromkeys(workers, 0)
    epoch = dict.fromkeys(workers, 1)
    for w in workers:
        for sink in (index, mirror):
            sink.apply(KVEventBatch(w, 0, [AllBlocksCleared()], epoch=1))
    for who, kind, lo, length, tier, other in ops:
        w, hashes = workers[who], chain[lo: lo + length]
        if kind == "forget":
            index.forget(w)
            seq[w], epoch[w] = 0, epoch[w] + 1
            events: list[KVEvent] = [AllBlocksCleared()]
        else:
            seq[w] += 1
            dst = other if other != tier else TIER_ORDER[(TIER_ORDER.index(tier) + 1) % len(TIER_ORDER)]
            events = [{"store": BlockStored(hashes, tier), "remove": BlockRemoved(hashes, tier),
                       "move": BlockTierChanged(hashes, tier, dst), "clear": AllBlocksCleared()}[kind]]
        batch = KVEventBatch(w, seq[w], events, epoch=epoch[w])
        assert index.apply(batch)
        mirror.apply(batch)
        for query in (chain, chain[lo:]):
            expected = _oracle(mirror, workers, query)
            assert dict(index.prefix_runs(query)) == expected
            assert {w: [h.blocks_by_tier[t] for t in TIER_ORDER] for w, h in index.prefix_hits_reference(query).items()
                    if h.total_blocks} == expected
        assert index.num_entries == sum(len(mirror.holdings(w)) for w in workers)


def test_prefix_runs_that_change_tier_part_way() -> None:
    chain = hash_blocks(list(range(4 * 12)), "", 4)
    index = GlobalPrefixIndex()
    index.apply(KVEventBatch("a", 0, [AllBlocksCleared(), BlockStored(chain[:5], Tier.DEVICE),
                                      BlockStored(chain[5:9], Tier.HOST), BlockStored(chain[9:], Tier.DISK)], epoch=1))
    index.apply(KVEventBatch("b", 0, [AllBlocksCleared(), BlockStored(chain[:7], Tier.HOST)], epoch=1))
    assert dict(index.prefix_runs(chain)) == {"a": [5, 4, 3], "b": [0, 7, 0]}
    index.apply(KVEventBatch("b", 1, [BlockStored(chain[2:4], Tier.DEVICE)], epoch=1))  # now in both: device counts
    assert dict(index.prefix_runs(chain)) == {"a": [5, 4, 3], "b": [2, 5, 0]}


def test_prefix_runs_of_nothing_and_of_a_miss() -> None:
    index = GlobalPrefixIndex()
    chain = hash_blocks(list(range(40)), "", 4)
    index.apply(KVEventBatch("a", 0, [AllBlocksCleared(), BlockStored(chain[2:], Tier.DEVICE)], epoch=1))
    assert index.prefix_runs([]) == {} and index.prefix_runs(chain) == {}
    assert index.prefix_runs(chain[2:5]) == {"a": [3, 0, 0]}


# ------------------------------------------------------------------ placement


def _links(rng: random.Random, prefill: list[str], decode: list[str]) -> LinkModel:
    tiers = {"host": rng.choice([2e10, 5e10]), "disk": rng.choice([1e9, 2e9])}
    pairs = [(p, d) for p in prefill for d in decode]
    measured = rng.sample(pairs, rng.randrange(0, min(len(pairs), 12) + 1))
    if rng.random() < 0.5:
        return LinkRates({pair: rng.choice([1e8, 1e9, 5e10]) for pair in measured}, tiers,
                         default_transfer_bytes_per_s=rng.choice([1e9, 5e10]))
    links = MeasuredLinks(rng.choice([1e9, 5e10]), 0.3, tiers)
    for p, d in measured:
        links.observe(p, d, rng.choice([10**8, 10**9, 5 * 10**10]), 1.0)
    if measured and rng.random() < 0.3:
        links.forget(rng.choice(measured)[1])
    return links


def _reference(req: RequestShape, prefill: dict[str, PrefillLoad], decode: dict[str, DecodeLoad],
               runs: dict[str, list[int]], excluded: set[str], links: LinkModel, limit: int) -> Placement:
    """What the router did before the table: build each worker's load with its prefix credit, `place`."""
    pl = [PrefillLoad(w, p.queued_tokens, p.prefill_tokens_per_s, cached_blocks=runs.get(w, [0, 0, 0])[0],
                      offloaded_blocks={"host": runs.get(w, [0, 0, 0])[1], "disk": runs.get(w, [0, 0, 0])[2]})
          for w, p in prefill.items() if w not in excluded]
    dl = [DecodeLoad(w, d.running_requests, d.free_blocks, d.step_s, d.prefill_tokens_per_s, d.queued_tokens,
                     cached_blocks=sum(runs.get(w, [0, 0, 0]))) for w, d in decode.items() if w not in excluded]
    return place(req, pl, dl, links, limit)


def _outcome(fn: Callable[..., Placement], *args: object) -> Placement | type[LookupError]:
    try:
        return fn(*args)
    except (NoCapacityError, NoWorkerError) as exc:
        return type(exc)


@pytest.mark.parametrize("seed", range(30))
def test_load_table_places_like_the_formula(seed: int) -> None:
    rng = random.Random(seed)
    table = LoadTable()
    prefill: dict[str, PrefillLoad] = {}
    decode: dict[str, DecodeLoad] = {}
    names = [f"{c}{i}" for c in "pq" for i in range(rng.randrange(1, 9))]  # ids not in slot order
    decode_names = [f"d{i}" for i in range(rng.randrange(1, 9))]
    compared = 0
    for _ in range(40):
        # load reports: new, repeated, and departures (a dropped id may come back in another slot)
        for w in rng.sample(names, rng.randrange(0, len(names) + 1)):
            if rng.random() < 0.15:
                prefill.pop(w, None)
                table.drop(w)
            else:
                prefill[w] = PrefillLoad(w, rng.choice([0, 1_000, 20_000]), rng.choice([1e4, 2e4]))
                table.set_prefill(prefill[w])
        for w in rng.sample(decode_names, rng.randrange(0, len(decode_names) + 1)):
            if rng.random() < 0.15:
                decode.pop(w, None)
                table.drop(w)
            else:
                steps = rng.choice([[0.02, 0.02, 0.021], [0.05, 0.05], [0.01, 0.012, 0.015, 0.02]])
                decode[w] = DecodeLoad(w, rng.choice([0, 1, 4, 9]), rng.choice([5, 40, 2_000]), steps,
                                       rng.choice([5e3, 1e4]), rng.choice([0, 500]))
                table.set_decode(decode[w])
        req = RequestShape(rng.choice([100, 640, 2_000, 6_400]), rng.choice([1, 50, 100]), 64, 56_960)
        runs = {w: [rng.randrange(0, 6), rng.randrange(0, 3), rng.randrange(0, 3)]
                for w in rng.sample([*prefill, *decode, "gone"], rng.randrange(0, len(prefill) + len(decode) + 1))}
        excluded = set(rng.sample([*prefill, *decode], rng.randrange(0, 3))) if rng.random() < 0.3 else set()
        links = _links(rng, list(prefill), list(decode))
        limit = rng.choice([0, 256, 10_000])
        expected = _outcome(_reference, req, prefill, decode, runs, excluded, links, limit)
        # both paths, whatever the pool's size: the compiled loops and the small pools' Python
        for path in (table.place, table.place_compiled, table.place_small):
            got = _outcome(path, req, runs, links, limit, frozenset(excluded))
            if isinstance(expected, Placement):
                assert isinstance(got, Placement)
                assert (got.prefill_id, got.decode_id, got.cost_s) == (expected.prefill_id, expected.decode_id,
                                                                       expected.cost_s)
                assert got.parts == expected.parts
                compared += 1
            else:
                assert got is expected
    assert compared > 0


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_small_pool_placement_chooses_as_the_compiled_loops(data: st.DataObject) -> None:
    """`LoadTable.place_small` against `place_compiled` on small pools of generated loads, prefix
    credit and link rates, values drawn from few choices so that ties are common."""
    table = LoadTable()
    num_p, num_d = data.draw(st.integers(0, 5)), data.draw(st.integers(1, 5))
    for i in range(num_p):
        table.set_prefill(PrefillLoad(f"p{(i * 3) % 7}", data.draw(st.sampled_from([0, 1_000, 20_000])),
                                      data.draw(st.sampled_from([1e4, 2e4]))))
    for j in range(num_d):
        table.set_decode(DecodeLoad(f"d{(j * 5) % 9}", data.draw(st.sampled_from([0, 1, 4])),
                                    data.draw(st.sampled_from([5, 40, 2_000])),
                                    data.draw(st.sampled_from([[0.02, 0.02], [0.01, 0.012, 0.015]])),
                                    data.draw(st.sampled_from([5e3, 1e4])), data.draw(st.sampled_from([0, 500]))))
    workers = [*table._p.index, *table._d.index]
    run = st.lists(st.integers(0, 6), min_size=3, max_size=3)
    runs = data.draw(st.dictionaries(st.sampled_from([*workers, "gone"]), run, max_size=len(workers) + 1))
    excluded = frozenset(data.draw(st.lists(st.sampled_from(workers), max_size=2))) if workers else frozenset()
    seed = data.draw(st.integers(0, 2**16))
    links = _links(random.Random(seed), list(table._p.index), list(table._d.index))
    req = RequestShape(data.draw(st.sampled_from([64, 100, 640, 6_400])), data.draw(st.sampled_from([1, 50])),
                       64, 56_960)
    limit = data.draw(st.sampled_from([0, 256, 10_000]))
    compiled = _outcome(table.place_compiled, req, runs, links, limit, excluded)
    small = _outcome(table.place_small, req, runs, links, limit, excluded)
    if isinstance(compiled, Placement):
        assert isinstance(small, Placement)
        assert (small.prefill_id, small.decode_id, small.cost_s, small.parts) == (
            compiled.prefill_id, compiled.decode_id, compiled.cost_s, compiled.parts)
    else:
        assert small is compiled


def test_load_table_ties_go_to_the_smallest_ids() -> None:
    table = LoadTable()
    for w in ("p3", "p1", "p2"):
        table.set_prefill(PrefillLoad(w, 0, 1e4))
    for w in ("d2", "d0", "d1"):
        table.set_decode(DecodeLoad(w, 1, 1_000, [0.02, 0.02], 5e3))
    req = RequestShape(640, 50, 64, 56_960)
    links = LinkRates({}, {"host": 1e10, "disk": 1e9})
    out = table.place(req, {}, links, 0)
    assert (out.prefill_id, out.decode_id) == ("p1", "d0")
    table.drop("p1")
    table.set_decode(DecodeLoad("d0", 1, 5, [0.02, 0.02], 5e3))  # full now
    assert (table.place(req, {}, links, 0).prefill_id, table.place(req, {}, links, 0).decode_id) == ("p2", "d1")
    # With room for decode-only at equal cost it wins the tie (no prefill id sorts first); here it is cheaper.
    assert table.place(req, {"d1": [10, 0, 0]}, links, 10_000).prefill_id is None
    with pytest.raises(NoCapacityError):
        table.place(RequestShape(640_000, 50, 64, 56_960), {}, links, 0)


@pytest.mark.parametrize("name", ["cache_aware", "least_loaded", "round_robin"])
def test_policies_choose_from_the_table_as_from_objects(name: str) -> None:
    from cedserve.router.policy import make_policy

    rng = random.Random(7)
    table, prefill, decode = LoadTable(), [], []
    for i in range(6):
        prefill.append(PrefillLoad(f"p{i}", rng.randrange(0, 30_000), 1e4))
        table.set_prefill(prefill[-1])
        decode.append(DecodeLoad(f"d{i}", rng.randrange(0, 9), 1_000, [0.02, 0.021, 0.023], 5e3))
        table.set_decode(decode[-1])
    req = RequestShape(640, 50, 64, 56_960)
    links = LinkRates({}, {"host": 1e10, "disk": 1e9})
    runs = {"p4": [8, 0, 0], "d2": [3, 1, 0]}
    from_table, from_objects = make_policy(name, 256), make_policy(name, 256)
    credited_p = [PrefillLoad(p.worker_id, p.queued_tokens, p.prefill_tokens_per_s, cached_blocks=runs.get(
        p.worker_id, [0, 0, 0])[0], offloaded_blocks={"host": runs.get(p.worker_id, [0, 0, 0])[1], "disk": 0})
        for p in prefill if p.worker_id != "p1"]
    credited_d = [DecodeLoad(d.worker_id, d.running_requests, d.free_blocks, d.step_s, d.prefill_tokens_per_s,
                             cached_blocks=sum(runs.get(d.worker_id, []))) for d in decode if d.worker_id != "p1"]
    for _ in range(4):
        got = from_table.choose_from(req, table, runs, links, {"p1"})
        expected = from_objects.choose(req, credited_p, credited_d, links)
        assert (got.prefill_id, got.decode_id) == (expected.prefill_id, expected.decode_id)
        assert got.prefill_id != "p1"


@pytest.mark.parametrize("seed", range(10))
def test_load_table_places_from_the_index_like_the_formula(seed: int) -> None:
    """`LoadTable.place` reading the index's `PrefixRuns` arrays, with the holders' slots kept per
    holder list, while workers join, leave and change roles between requests (their slots move: what
    it kept must not go stale) and store more of the chain (the holder lists change)."""
    rng = random.Random(seed)
    chain = hash_blocks(list(range(64 * 20)), "", 64)
    names = [f"w{i}" for i in range(10)]
    index, table = GlobalPrefixIndex(), LoadTable()
    prefill: dict[str, PrefillLoad] = {}
    decode: dict[str, DecodeLoad] = {}
    for w in names:
        index.apply(KVEventBatch(w, 0, [AllBlocksCleared(), BlockStored(chain[: rng.randrange(1, 21)],
                                                                       rng.choice(TIER_ORDER))], epoch=1))
    links = LinkRates({}, {"host": 2e10, "disk": 2e9})
    seq = dict.fromkeys(names, 0)
    compared = 0
    for _ in range(40):
        for w in rng.sample(names, rng.randrange(0, 4)):
            prefill.pop(w, None)
            decode.pop(w, None)
            kind = rng.random()
            if kind < 0.2:
                table.drop(w)
            elif kind < 0.6:
                prefill[w] = PrefillLoad(w, rng.choice([0, 5_000]), rng.choice([1e4, 2e4]))
                table.set_prefill(prefill[w])
            else:
                decode[w] = DecodeLoad(w, rng.choice([0, 3]), rng.choice([30, 2_000]), [0.02, 0.021], 5e3)
                table.set_decode(decode[w])
        if rng.random() < 0.3:
            w = rng.choice(names)
            seq[w] += 1
            assert index.apply(KVEventBatch(w, seq[w], [BlockStored(chain[: rng.randrange(1, 21)],
                                                                    rng.choice(TIER_ORDER))], epoch=1))
        query = chain[: rng.randrange(1, 21)]
        runs = index.prefix_runs(query)
        req = RequestShape(64 * len(query), 50, 64, 56_960)
        expected = _outcome(_reference, req, prefill, decode, dict(runs), set(), links, 256)
        for path in (table.place, table.place_compiled, table.place_small):
            got = _outcome(path, req, runs, links, 256, frozenset())
            if isinstance(expected, Placement):
                assert isinstance(got, Placement)
                assert (got.prefill_id, got.decode_id, got.cost_s, got.parts) == (
                    expected.prefill_id, expected.decode_id, expected.cost_s, expected.parts)
                compared += 1
            else:
                assert got is expected
    assert compared > 0
