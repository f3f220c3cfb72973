"""The transfer state machine, its results and errors; wire messages; staging; config; metrics."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
import torch

from cedserve.kv_transfer.config import KVTransferConfig
from cedserve.kv_transfer.errors import FailureCause, KVTransferError
from cedserve.kv_transfer.metrics import TransferMetrics
from cedserve.kv_transfer.protocol import Reservation, TransferMode
from cedserve.kv_transfer.region import PROTOCOL_VERSION
from cedserve.kv_transfer.staging import StagingPool, gather_blocks, scatter_blocks
from cedserve.kv_transfer.state import (
    ALLOWED_TRANSITIONS,
    IllegalTransition,
    Role,
    TransferRecord,
    TransferState,
)
from cedserve.kv_transfer.wire import decode_notice, encode_notice, reservation_from_pb, reservation_to_pb
from cedserve.proto import kv_transfer_pb2 as pb

S = TransferState


def record(now: float = 10.0) -> TransferRecord:
    return TransferRecord("req-1", Role.RECEIVER, "prefill0", (4, 5, 6), deadline_s=now + 30, on_finish=None,
                          now_s=now)


def test_state_machine_is_an_enum_with_three_terminal_states() -> None:
    assert [s.value for s in S] == ["reserved", "transferring", "done", "failed", "aborted"]
    assert {s for s in S if s.terminal} == {S.DONE, S.FAILED, S.ABORTED}
    for s in S:
        assert (not ALLOWED_TRANSITIONS[s]) == s.terminal


@pytest.mark.parametrize(("path", "ok"), [
    ([S.TRANSFERRING, S.DONE], True),
    ([S.TRANSFERRING, S.FAILED], True),
    ([S.ABORTED], True),
    ([S.DONE], True),                       # an empty request finishes at once
    ([S.DONE, S.FAILED], False),            # terminal is final
    ([S.TRANSFERRING, S.RESERVED], False),  # no going back
    ([S.FAILED, S.ABORTED], False),
])
def test_transitions(path: list[TransferState], ok: bool) -> None:
    r = record()
    if ok:
        for s in path:
            r.advance(s)
        assert r.state is path[-1]
    else:
        with pytest.raises(IllegalTransition, match="req-1"):
            for s in path:
                r.advance(s)


def test_first_failure_wins_and_result_carries_the_request_id() -> None:
    r = record()
    r.start_transferring(11.0)
    assert r.fail(S.FAILED, KVTransferError("req-1", FailureCause.PEER_SILENT, "no heartbeat"))
    assert not r.fail(S.ABORTED, KVTransferError("req-1", FailureCause.CANCELLED))
    r.num_bytes = 2_000_000_000
    result = r.finish(12.0)
    assert result.state is S.FAILED and result.duration_s == pytest.approx(1.0)
    assert result.gbps == pytest.approx(2.0)
    with pytest.raises(KVTransferError) as exc:
        result.raise_for_state()
    assert exc.value.request_id == "req-1" and exc.value.cause is FailureCause.PEER_SILENT
    assert "req-1" in str(exc.value) and "peer_silent" in str(exc.value)


def test_error_names_its_fallback() -> None:
    err = KVTransferError("r", FailureCause.DEADLINE, "lease", fallback="recompute")
    assert "configured fallback: recompute" in str(err)


def test_notice_round_trip_and_rejections() -> None:
    data = encode_notice("r7", chunk_done=pb.ChunkDone(seq=3, first_index=64, num_blocks=32, staging_slot=-1))
    notice = decode_notice(data)
    assert notice.request_id == "r7" and notice.WhichOneof("body") == "chunk_done"
    assert notice.chunk_done.num_blocks == 32 and notice.protocol_version == PROTOCOL_VERSION
    with pytest.raises(ValueError, match="undecodable"):
        decode_notice(b"\x80\x04\x95 pickled bytes are never loaded")
    with pytest.raises(ValueError, match="protocol v99"):
        decode_notice(pb.TransferNotice(protocol_version=99, heartbeat=pb.Heartbeat()).SerializeToString())
    with pytest.raises(ValueError, match="without a body"):
        decode_notice(pb.TransferNotice(protocol_version=PROTOCOL_VERSION).SerializeToString())


def test_reservation_round_trip_and_validation() -> None:
    r = Reservation("r1", "decode0", "prefill0", (9, 3, 4), TransferMode.READ, (1,), 2.5, "abc")
    assert reservation_from_pb(pb.Reservation.FromString(reservation_to_pb(r).SerializeToString())) == r
    with pytest.raises(ValueError, match="`mode`"):
        reservation_from_pb(pb.Reservation(request_id="r1"))


def test_staging_gather_scatter_round_trip() -> None:
    blocks = torch.arange(20 * 8, dtype=torch.int64).remainder(256).to(torch.uint8).view(20, 8)
    pool = StagingPool.allocate(2, 64, torch.device("cpu"))
    slot = pool.acquire()
    assert slot is not None and pool.free_slots == 1
    ids = np.array([7, 2, 19], dtype=np.int64)
    rows = pool.slot_rows(slot, 3, 8)
    gather_blocks(blocks, ids, rows)
    assert torch.equal(rows, blocks[torch.from_numpy(ids)])
    target = torch.zeros_like(blocks)
    scatter_blocks(target, np.array([0, 1, 2]), rows)
    assert torch.equal(target[:3], blocks[torch.from_numpy(ids)])
    pool.release(slot)
    with pytest.raises(ValueError, match="not held"):
        pool.release(slot)
    with pytest.raises(ValueError, match="exceed"):
        pool.slot_rows(0, 9, 8)
    assert pool.slot_blocks(8) == 8
    # a chunk placed from row 5 of slot 1: its rows start 5 blocks in, and may not run past the slot
    assert pool.slot_rows(1, 3, 8, first_row=5).data_ptr() == pool.slot_address(1) + 5 * 8
    with pytest.raises(ValueError, match="exceed"):
        pool.slot_rows(1, 4, 8, first_row=5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_staging_pool_copies_through_its_index_buffers(device: str) -> None:
    """The pool's gather and scatter (its stream and reused index buffers on a device) move the same
    rows as the reference indexing, chunk after chunk, while the buffers grow past their first size
    and are reused for shorter chunks after."""
    rng = np.random.default_rng(3)
    num_blocks, block_bytes = 3000, 24
    blocks = torch.from_numpy(rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8)).to(device)
    pool = StagingPool.allocate(2, 2048 * block_bytes, torch.device(device))
    target = torch.zeros_like(blocks)
    for n in (5, 1500, 2048, 7):  # 1500 outgrows the first 1,024-id buffer
        ids = rng.choice(num_blocks, n, replace=False).astype(np.int64)
        dst = rng.choice(num_blocks, n, replace=False).astype(np.int64)
        rows = pool.slot_rows(1, n, block_bytes)
        pool.gather(blocks, ids, rows)
        assert torch.equal(rows, blocks[torch.from_numpy(ids).to(device)])
        pool.scatter(target, dst, rows)
        assert torch.equal(target[torch.from_numpy(dst).to(device)], blocks[torch.from_numpy(ids).to(device)])


@pytest.mark.parametrize(("field", "value", "message"), [
    ("chunk_blocks", 0, "chunk_blocks"),
    ("control_port", 70000, "control_port"),
    ("peer_timeout_s", 0.1, "peer_timeout_s"),  # fewer than two heartbeats fit
    ("pack_below_bytes", -1, "pack_below_bytes"),
    ("spin_s", -1e-6, "spin_s"),
    ("spin_s", 1.0, "spin_s"),  # a spin that long would starve the worker's other threads of the GIL
    ("spin_switch_interval_s", 0.01, "spin_switch_interval_s"),
])
def test_config_validation_names_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVTransferConfig(**{field: value})  # type: ignore[arg-type]


def test_pack_threshold_by_memory_kind() -> None:
    cfg = KVTransferConfig()
    assert cfg.pack_threshold(device_memory=True) == 1 << 20
    assert cfg.pack_threshold(device_memory=False) == 0
    assert KVTransferConfig(pack_below_bytes=5).pack_threshold(False) == 5
    assert KVTransferConfig(staging_slots=0, pack_below_bytes=5).pack_threshold(True) == 0


def test_fields_left_none_are_chosen_by_memory_kind_and_explicit_ones_stay() -> None:
    device, host = KVTransferConfig().resolved(True), KVTransferConfig().resolved(False)
    assert (device.chunk_blocks, device.staging_slot_bytes, device.poll_interval_s) == (8192, 64 << 20, 2e-5)
    assert (host.chunk_blocks, host.staging_slot_bytes, host.poll_interval_s) == (1024, 16 << 20, 2e-4)
    mine = KVTransferConfig(chunk_blocks=7, poll_interval_s=0.5, staging_slots=0).resolved(True)
    assert (mine.chunk_blocks, mine.poll_interval_s, mine.staging_slots) == (7, 0.5, 0)
    assert mine.target_poll_s == device.target_poll_s
    assert (device.announce_posts, host.announce_posts) == (True, True)
    assert KVTransferConfig(announce_posts=False).resolved(False).announce_posts is False
    # device memory: the caller posts its last chunk and the loop spins briefly while hot; host: neither
    assert (device.caller_posts_last, device.spin_s, host.caller_posts_last, host.spin_s) == (True, 5e-4, False, 0.0)
    assert KVTransferConfig(spin_s=0.0).resolved(True).spin_s == 0.0
    assert (device.spin_switch_interval_s, host.spin_switch_interval_s) == (0.0, 0.0)  # off until measured


def test_a_spin_spell_shortens_the_switch_interval_until_it_ends() -> None:
    """While the progress thread spins (a hot spell of `spin_s`) the process's switch interval is at
    most `spin_switch_interval_s`, so a thread taking the GIL back (a staging copy after its stream
    wait) is not held up to the default 5 ms; the interval comes back when the spell runs out, when
    the side cools, and when the loop exits; two engines spinning at once restore it once, last."""
    import threading

    from cedserve.kv_transfer import engine as transfer_engine
    from cedserve.kv_transfer.engine import NixlEngine

    def spinner(spin_s: float) -> NixlEngine:
        e = NixlEngine.__new__(NixlEngine)  # only the spell's fields: no agent, no NIXL
        e._spin_s, e._spin_until, e._spin_switch_s, e._switch_held = spin_s, 0.0, 5e-5, False
        e._bell = threading.Event()  # type: ignore[assignment]
        return e

    default = sys.getswitchinterval()
    a, b = spinner(10.0), spinner(10.0)
    assert a._spin(hot=True) and sys.getswitchinterval() == pytest.approx(5e-5)
    assert b._spin(hot=True) and transfer_engine._SWITCH.holders == 2
    assert not a._spin(hot=False)  # a cools; b still spins: the interval stays short
    assert sys.getswitchinterval() == pytest.approx(5e-5)
    b._spin_until = time.monotonic() - 1  # b's spell runs out while still hot
    assert not b._spin(hot=True)
    assert sys.getswitchinterval() == default and transfer_engine._SWITCH.holders == 0
    assert not b._spin(hot=True)  # the spent spell does not restart (nor take the interval again)
    assert transfer_engine._SWITCH.holders == 0
    c = spinner(10.0)
    c._spin_switch_s = 0.0  # 0: leave the interval alone
    assert c._spin(hot=True) and sys.getswitchinterval() == default


def test_metrics_count_bytes_failures_and_ttft_share() -> None:
    m = TransferMetrics()
    ok = record()
    ok.start_transferring(10.0)
    ok.num_bytes, ok.num_descriptors = 1_000_000, 7
    ok.advance(S.DONE)
    m.record(ok.finish(10.5), "write")
    bad = TransferRecord("req-2", Role.SENDER, "decode0", (), 100.0, None, 0.0)
    bad.fail(S.FAILED, KVTransferError("req-2", FailureCause.PEER_DISCONNECTED, fallback="recompute"))
    m.record(bad.finish(1.0), "write")
    assert m.value("cedserve_kv_transfer_bytes_total", role="receiver", mode="write") == 1_000_000
    assert m.value("cedserve_kv_transfer_descriptors_total", role="receiver") == 7
    assert m.value("cedserve_kv_transfer_failures_total", role="sender", cause="peer_disconnected") == 1
    assert m.value("cedserve_kv_transfer_fallbacks_total", to="recompute") == 1
    assert m.value("cedserve_kv_transfer_tail_seconds_count", role="receiver") == 0  # no producer, no tail
    sent = TransferRecord("req-3", Role.SENDER, "decode0", (), 100.0, None, 0.0)
    sent.start_transferring(20.0)
    sent.closed_s = 20.4
    sent.advance(S.DONE)
    m.record(sent.finish(20.5), "write")
    assert sent.result is not None and sent.result.tail_s == pytest.approx(0.1)
    assert m.value("cedserve_kv_transfer_tail_seconds_sum", role="sender") == pytest.approx(0.1)
    assert m.observe_ttft("req-1", 2.0) == pytest.approx(0.25)
    assert m.observe_ttft("req-1", 2.0) is None  # counted once


def test_a_receiver_polls_short_only_while_an_announced_request_is_outstanding() -> None:
    from cedserve.kv_transfer.transfers import RecvTransfer

    t = RecvTransfer(record=record(), mode=TransferMode.WRITE, initiator=False, dst_ids=np.arange(3))
    assert not t.has_local_work()  # reserved, nothing on the way: the long poll
    t.record.start_transferring(11.0)
    assert t.has_local_work()  # a sender that never announces: short polls from the first chunk on
    t.announcing = True
    t.posted.add(0)  # ChunkPosted(0)
    assert t.has_local_work()
    t.posted.discard(0)  # its ChunkDone: back to the long poll until the next notice
    assert not t.has_local_work()
    t.record.advance(S.DONE)
    t.posted.add(1)
    assert not t.has_local_work()  # a finished transfer never keeps the loop hot
