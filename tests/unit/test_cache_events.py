"""KV events: wire format, sequence numbers, replay and an exact mirror."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest

from cedserve.model.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    BlockTierChanged,
    KVEventBatch,
    KVEventGapError,
    KVEventPublisher,
    KVIndexMirror,
    Tier,
    decode_batch,
    encode_batch,
)

pytestmark = pytest.mark.unit

H = [bytes([i]) * 32 for i in range(4)]


def test_round_trip_every_event_kind() -> None:
    batch = KVEventBatch("w0", 7, [AllBlocksCleared(), BlockStored(H[:2], Tier.DEVICE, H[3]),
                                   BlockTierChanged([H[0]], Tier.DEVICE, Tier.HOST), BlockRemoved([H[1]], Tier.DISK)],
                         epoch=5, timestamp_s=1.5)
    assert decode_batch(encode_batch(batch)) == batch


def test_foreign_bytes_are_rejected() -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_batch(b"\x93garbage")
    future = msgspec.msgpack.encode({"worker_id": "w", "seq": 0, "events": [], "version": 99})
    with pytest.raises(msgspec.DecodeError, match="version"):
        decode_batch(future)


def test_sequence_numbers_replay_and_snapshot() -> None:
    sent: list[KVEventBatch] = []
    pub = KVEventPublisher("w0", epoch=1, replay_batches=2, sink=sent.append)
    assert pub.flush() is None  # nothing queued, nothing sent
    for h in H[:3]:
        pub.add(BlockStored([h], Tier.DEVICE))
        pub.flush()
    assert [b.seq for b in sent] == [0, 1, 2]
    assert [b.seq for b in pub.replay(0) or []] == [1, 2]
    assert pub.replay(2) == []
    assert pub.replay(-1) is None  # batch 0 left the buffer: take a snapshot
    snap = pub.snapshot([(Tier.DEVICE, H[:3]), (Tier.DISK, [])])
    assert snap.is_snapshot and snap.seq == 3 and snap.events[1] == BlockStored(H[:3], Tier.DEVICE)


def test_mirror_detects_gaps_and_resyncs() -> None:
    mirror = KVIndexMirror()
    pub = KVEventPublisher("w0", epoch=1)
    first = pub.snapshot([])
    mirror.apply(first)
    pub.add(BlockStored(H[:2], Tier.DEVICE))
    b1 = pub.flush()
    pub.add(BlockTierChanged([H[1]], Tier.DEVICE, Tier.HOST))
    b2 = pub.flush()
    assert b1 is not None and b2 is not None
    with pytest.raises(KVEventGapError) as info:
        mirror.apply(b2)
    assert (info.value.expected, info.value.got) == (1, 2)
    for batch in pub.replay(first.seq) or []:
        mirror.apply(batch)
    mirror.apply(b1)  # a duplicate is ignored
    assert mirror.holdings("w0") == {H[0]: frozenset({Tier.DEVICE}), H[1]: frozenset({Tier.HOST})}
    assert mirror.cached_prefix("w0", [H[0], H[1], H[2]]) == [frozenset({Tier.DEVICE}), frozenset({Tier.HOST})]
    # a restarted worker (new epoch) is only accepted through its snapshot
    restarted = KVEventPublisher("w0", epoch=2)
    restarted.add(BlockStored([H[3]], Tier.DISK))
    with pytest.raises(KVEventGapError):
        mirror.apply(restarted.flush())  # type: ignore[arg-type]
    mirror.apply(restarted.snapshot([(Tier.DISK, [H[2]])]))
    assert mirror.holdings("w0") == {H[2]: frozenset({Tier.DISK})}
    assert mirror.last_seq("w0") == 1


def test_router_side_modules_import_without_torch() -> None:
    code = ("import sys\nsys.modules['torch'] = None\n"
            "import cedserve.model.cache.events, cedserve.model.cache.hashing\nprint('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "ok"
