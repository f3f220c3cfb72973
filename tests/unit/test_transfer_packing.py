"""Packed WRITE through staging slots with the real NIXL engine (two agents in this process, UCX
between them): the chunks of one request share the receiver's slots at offsets, so a request no
larger than its slots needs no `SlotFree` round trip, and the bytes land where they belong.

The placement (`NixlEngine._place_packed`, `_slot_freed`) is checked step by step on a real engine's
sender bookkeeping; the transfers check the receiver honours the offsets (a receiver scattering from
a slot's start would put the wrong bytes in every chunk but the first of a slot).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import torch

from cedserve.kv_transfer.agent import NixlTransferAgent
from cedserve.kv_transfer.config import KVTransferConfig
from cedserve.kv_transfer.nixl_backend import nixl_available
from cedserve.kv_transfer.protocol import Reservation, TransferMode
from cedserve.kv_transfer.region import KVLayout, KVRegion
from cedserve.kv_transfer.state import Role, TransferRecord
from cedserve.kv_transfer.transfers import SendTransfer

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")

BLOCK_BYTES = 1024
NUM_BLOCKS = 128
SLOT_BLOCKS = 16
LAYOUT = KVLayout.raw(BLOCK_BYTES)


def _config() -> KVTransferConfig:
    return KVTransferConfig(auth_token="packing-token", peer_timeout_s=3.0, heartbeat_interval_s=0.2,
                            pack_below_bytes=1 << 30, staging_slots=4, staging_slot_bytes=SLOT_BLOCKS * BLOCK_BYTES,
                            staging_slots_per_request=2)


Agents = tuple[NixlTransferAgent, NixlTransferAgent, KVRegion, KVRegion]


@pytest.fixture(scope="module")
def agents() -> Iterator[Agents]:
    data = torch.arange(NUM_BLOCKS * BLOCK_BYTES, dtype=torch.int64)
    src = KVRegion((data * 7 + data // BLOCK_BYTES * 13).remainder(251).to(torch.uint8), BLOCK_BYTES)
    dst = KVRegion(torch.zeros(NUM_BLOCKS * BLOCK_BYTES, dtype=torch.uint8), BLOCK_BYTES)
    sender = NixlTransferAgent(_config(), src, LAYOUT, "prefill-pack")
    receiver = NixlTransferAgent(_config(), dst, LAYOUT, "decode-pack")
    sender.handshake(receiver.control_address)
    yield sender, receiver, src, dst
    sender.close()
    receiver.close()


def _send_transfer(credits: tuple[int, ...]) -> SendTransfer:
    record = TransferRecord("r", Role.SENDER, "decode-pack", (), 1e9, None)
    reservation = Reservation("r", "decode-pack", "prefill-pack", tuple(range(40)), TransferMode.WRITE,
                              credits, 30.0, "")
    return SendTransfer(record=record, mode=TransferMode.WRITE, initiator=True, dst_ids=np.arange(40),
                        reservation=reservation, credits=deque(credits))


def test_chunks_fill_a_slot_before_opening_the_next(agents: Agents) -> None:
    engine = agents[0].engine
    t = _send_transfer((5, 6))
    assert engine._packed_room(t) == SLOT_BLOCKS
    assert engine._place_packed(t, 4) == (5, 0)
    assert engine._place_packed(t, 9) == (5, 4)
    assert engine._packed_room(t) == 3  # what is left of slot 5: the next chunk is cut to it
    assert engine._place_packed(t, 3) == (5, 13)
    assert engine._place_packed(t, 10) == (6, 0)  # slot 5 full: the second credit
    assert engine._place_packed(t, 7) is None  # 6 rows left, no credit: wait for a SlotFree
    for _ in range(3):
        engine._slot_freed(t, 5)  # all of slot 5 scattered: a credit again
    assert list(t.credits) == [5]
    assert engine._place_packed(t, 7) == (5, 0)
    engine._slot_freed(t, 6)
    assert t.open_slot == 5 and list(t.credits) == [6]  # slot 6, full and scattered, is free
    engine._slot_freed(t, 5)
    assert t.open_fill == 0 and engine._packed_room(t) == SLOT_BLOCKS  # the open slot refills from row 0
    engine._slot_freed(t, 9)  # a slot never written into: ignored
    assert list(t.credits) == [6] and t.slot_chunks == {}


@pytest.mark.parametrize("pieces", [[30], [3, 5, 7, 1, 9, 5], [13, 13, 4]], ids=["one-call", "ragged", "thirds"])
def test_a_request_streamed_in_pieces_lands_through_two_slots(agents: Agents, pieces: list[int]) -> None:
    """30 scattered blocks into two granted 16-block slots, however the producer cuts them: each
    packed chunk is placed after the previous one in the slot, and every block lands where it belongs."""
    sender, receiver, src, dst = agents
    rng = np.random.default_rng(sum(pieces) * len(pieces))
    n = sum(pieces)
    dst_ids = rng.choice(NUM_BLOCKS, n, replace=False)
    src_ids = rng.choice(NUM_BLOCKS, n, replace=False)
    rid = f"packed-{'-'.join(map(str, pieces))}"
    reservation = receiver.receiver().reserve(rid, dst_ids, sender="prefill-pack", mode=TransferMode.WRITE,
                                              lease_s=20.0, on_finish=None)
    assert len(reservation.staging_slots) == 2
    send = sender.sender()
    send.open(reservation, timeout_s=20.0, on_finish=None)
    at = 0
    for size in pieces:
        send.write_blocks(rid, src_ids[at: at + size], last=at + size == n)
        at += size
    sent = send.wait(rid, 20.0)
    got = receiver.receiver().wait(rid, 20.0)
    assert sent.num_bytes == got.num_bytes == n * BLOCK_BYTES
    assert 2 <= sent.num_descriptors <= len(pieces) + 2  # one per packed request: merged, or cut at a slot's end
    assert torch.equal(dst.blocks()[torch.from_numpy(dst_ids)], src.blocks()[torch.from_numpy(src_ids)])
    assert receiver.staging is not None and sender.staging is not None
    assert receiver.staging.free_slots == 4 and sender.staging.free_slots == 4


def test_the_last_write_blocks_posts_from_the_callers_thread() -> None:
    """With `caller_posts_last` the request is in NIXL's hands when `write_blocks(last=True)` returns:
    the progress loop here sleeps seconds between steps and was not woken since `open`, so only the
    caller can have posted it; the loop then polls it to the end."""
    cfg = KVTransferConfig(auth_token="caller-token", caller_posts_last=True, heartbeat_interval_s=10.0,
                           peer_timeout_s=30.0)
    slow = msgspec.structs.replace(cfg, target_poll_s=5.0, idle_poll_s=5.0)  # the sender's loop
    data = torch.arange(NUM_BLOCKS * BLOCK_BYTES, dtype=torch.int64).remainder(251).to(torch.uint8)
    src = KVRegion(data, BLOCK_BYTES)
    dst = KVRegion(torch.zeros(NUM_BLOCKS * BLOCK_BYTES, dtype=torch.uint8), BLOCK_BYTES)
    sender = NixlTransferAgent(slow, src, LAYOUT, "prefill-caller")
    receiver = NixlTransferAgent(cfg, dst, LAYOUT, "decode-caller")
    try:
        sender.handshake(receiver.control_address)
        ids = np.arange(10, 30)
        reservation = receiver.receiver().reserve("caller", ids, sender="prefill-caller", lease_s=20.0)
        sender.sender().open(reservation, timeout_s=20.0)
        time.sleep(0.3)  # the steps `open` and the handshake woke are over: the loop sleeps 5 s now
        sender.sender().write_blocks("caller", ids, last=True)
        posted = sender.engine._record(Role.SENDER, "caller").last_post_s
        assert posted is not None  # posted before write_blocks returned
        result = sender.sender().wait("caller", 10.0)
        assert result.num_bytes == 20 * BLOCK_BYTES
        # the tail's stamps, in order: post began, post returned, a poll saw it done, the sender's DONE
        assert result.last_post_s is not None and result.last_posted_s is not None and result.nixl_done_s is not None
        assert result.last_post_s <= result.last_posted_s <= result.nixl_done_s <= result.finished_s
        assert result.status_polls >= 1  # the poll that saw it done is counted
        receiver.receiver().wait("caller", 10.0)
        assert torch.equal(dst.blocks()[10:30], src.blocks()[10:30])
    finally:
        sender.close()
        receiver.close()
