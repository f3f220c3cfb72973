"""The global prefix index: exact per tier, resynchronised after gaps, fast longest-prefix queries."""

from __future__ import annotations

from cedserve.model.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockTierChanged,
    KVEventBatch,
    KVEventPublisher,
    Tier,
)
from cedserve.model.cache.hashing import hash_blocks
from cedserve.router.index import GlobalPrefixIndex

HASHES = hash_blocks(list(range(64 * 8)), "", 64)


def _feed(index: GlobalPrefixIndex, pub: KVEventPublisher, *events: object) -> bool:
    for e in events:
        pub.add(e)  # type: ignore[arg-type]
    batch = pub.flush()
    assert batch is not None
    return index.apply(batch)


def test_longest_prefix_by_tier_and_removals() -> None:
    index, pub = GlobalPrefixIndex(), KVEventPublisher("w0", epoch=1)
    assert index.apply(pub.snapshot([]))
    _feed(index, pub, BlockStored(HASHES[:3], Tier.DEVICE), BlockStored(HASHES[3:5], Tier.DISK))
    hit = index.longest_prefix("w0", HASHES)
    assert hit.blocks_by_tier == {Tier.DEVICE: 3, Tier.HOST: 0, Tier.DISK: 2}
    _feed(index, pub, BlockTierChanged(HASHES[1:2], Tier.DEVICE, Tier.HOST))
    assert index.longest_prefix("w0", HASHES).blocks_by_tier == {Tier.DEVICE: 2, Tier.HOST: 1, Tier.DISK: 2}
    _feed(index, pub, BlockRemoved(HASHES[2:3], Tier.DEVICE))
    assert index.longest_prefix("w0", HASHES).total_blocks == 2  # the chain breaks at block 2
    assert index.longest_prefix("w0", HASHES[5:]).total_blocks == 0


def test_gap_is_refused_until_resync() -> None:
    index, pub = GlobalPrefixIndex(), KVEventPublisher("w1", epoch=7)
    assert index.apply(pub.snapshot([]))
    pub.add(BlockStored(HASHES[:2], Tier.DEVICE))
    lost = pub.flush()  # this batch never reaches the router
    assert lost is not None
    assert not _feed(index, pub, BlockStored(HASHES[2:4], Tier.DEVICE))
    assert index.needs_resync() == {"w1"}
    last = index.last_seq("w1")
    assert last is not None
    replay = pub.replay(last)  # the worker replays what the router missed
    assert replay is not None and all(index.apply(b) for b in replay)
    assert index.needs_resync() == set() and index.longest_prefix("w1", HASHES).total_blocks == 4


def test_snapshot_replaces_everything_and_forget_drops_a_worker() -> None:
    index = GlobalPrefixIndex()
    index.apply(KVEventBatch("a", 0, [AllBlocksCleared(), BlockStored(HASHES[:4], Tier.DEVICE)], epoch=1))
    index.apply(KVEventBatch("b", 0, [AllBlocksCleared(), BlockStored(HASHES[:2], Tier.HOST)], epoch=1))
    hits = index.prefix_hits(HASHES)
    assert {w: h.total_blocks for w, h in hits.items()} == {"a": 4, "b": 2}
    index.apply(KVEventBatch("a", 5, [AllBlocksCleared(), BlockStored(HASHES[:1], Tier.DEVICE)], epoch=2))
    assert index.longest_prefix("a", HASHES).total_blocks == 1
    index.forget("b")
    assert "b" not in index.prefix_hits(HASHES) and index.num_entries == 1
    assert not index.apply(KVEventBatch("b", 1, [BlockStored(HASHES[:2], Tier.HOST)], epoch=1))  # needs a snapshot
