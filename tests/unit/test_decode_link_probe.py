"""The decode engine's side of the link probe (`ProbeCheckCommand`, what `CheckProbe` queues): a probe
lease reserved with no prompt receives a seeded pattern through the loopback transfer fake; the check
hashes what arrived, compares, and frees the lease on every path: verified, digest mismatch, check
arriving before the transfer ended, failed transfer, lease expired while the check waited."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from decode_support import BLOCK, Rig, tiny

from cedserve.common.errors import ErrorKind
from cedserve.decode_workers import link_probe as decode_link_probe
from cedserve.decode_workers.messages import Failed, ProbeCheckCommand, ProbeChecked, ReserveCommand, Reserved
from cedserve.kv_transfer.errors import FailureCause
from cedserve.kv_transfer.link_probe import digest, pattern
from cedserve.kv_transfer.wire import reservation_from_pb
from cedserve.model.cache.block_pool import scatter_rows
from cedserve.proto import kv_transfer_pb2

pytestmark = pytest.mark.unit
NUM_BLOCKS = 6


@pytest.fixture
def rig() -> Rig:
    model, _ = tiny()
    return Rig(model, None, num_blocks=32)


def reserve_probe(rig: Rig, rid: str, lease_ms: int = 30_000) -> Reserved:
    cmd = ReserveCommand(0, rid, f"lease-{rid}", NUM_BLOCKS * BLOCK, (), lease_ms, sender_agent="prefill",
                         ship_state=False)
    (out,) = rig.engine.handle(cmd)
    assert isinstance(out, Reserved) and len(out.block_ids) == NUM_BLOCKS and out.num_cached_blocks == 0
    return out


def send_pattern(rig: Rig, reserved: Reserved, seed: int) -> str:
    """Fill prefill blocks with `pattern(seed)` and WRITE them into the lease; the sent digest."""
    data = pattern(seed, NUM_BLOCKS * rig.layout.block_bytes)
    local = rig.prefill_pool.allocate(NUM_BLOCKS, reserved.request_id)
    scatter_rows(rig.prefill_pool.storage, local, torch.from_numpy(data).view(NUM_BLOCKS, -1))
    reservation = reservation_from_pb(kv_transfer_pb2.Reservation.FromString(reserved.reservation))
    sender = rig.prefill_agent.sender()
    sender.open(reservation)
    sender.write_blocks(reservation.request_id, local, last=True)
    sender.wait(reservation.request_id, 5.0)
    rig.prefill_pool.decref(local)
    rig.prefill_pool.free(local)
    return digest(data)


def check(rig: Rig, reserved: Reserved, sha: str) -> list[object]:
    return list(rig.engine.handle(ProbeCheckCommand(0, reserved.request_id, reserved.lease_id, sha)))


def poll_until(rig: Rig, request_id: str, timeout_s: float = 5.0) -> object:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for out in rig.engine.poll():
            if getattr(out, "request_id", None) == request_id:
                return out
        time.sleep(0.005)
    raise AssertionError(f"no output for {request_id}")


def test_check_verifies_the_received_bytes_and_frees_the_lease(rig: Rig) -> None:
    reserved = reserve_probe(rig, "probe-ok")
    sha = digest(pattern(11, NUM_BLOCKS * rig.layout.block_bytes))
    assert check(rig, reserved, sha) == []  # before any byte: the check waits for the transfer
    assert send_pattern(rig, reserved, seed=11) == sha
    out = poll_until(rig, "probe-ok")
    assert isinstance(out, ProbeChecked)
    assert out.verified and out.sha256 == sha and out.num_blocks == NUM_BLOCKS
    assert out.num_bytes == NUM_BLOCKS * rig.layout.block_bytes
    rig.assert_all_free()


def test_a_digest_mismatch_is_reported_and_the_lease_freed(rig: Rig) -> None:
    reserved = reserve_probe(rig, "probe-bad")
    sent = send_pattern(rig, reserved, seed=12)
    lease = rig.engine.leases.get(reserved.lease_id)
    end = time.monotonic() + 5
    while lease is not None and lease.transfer_open and time.monotonic() < end:  # the check comes after DONE
        rig.engine.poll()
    assert check(rig, reserved, digest(pattern(13, NUM_BLOCKS * rig.layout.block_bytes))) == []  # hashing
    assert rig.engine.leases.get(reserved.lease_id) is None  # the blocks were copied out and freed at once
    out = poll_until(rig, "probe-bad")
    assert isinstance(out, ProbeChecked) and not out.verified and out.sha256 == sent
    rig.assert_all_free()


def test_the_hash_runs_off_the_engine_thread(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe never stalls decoding: the engine thread only copies the blocks out; SHA-256 runs on the
    probe-digest worker thread (recorded by wrapping the real `digest`, whose result is still checked)."""
    hashed_on: list[str] = []

    def recording_digest(data: np.ndarray) -> str:
        hashed_on.append(threading.current_thread().name)
        return digest(data)

    monkeypatch.setattr(decode_link_probe, "digest", recording_digest)
    reserved = reserve_probe(rig, "probe-thread")
    sha = send_pattern(rig, reserved, seed=14)
    assert check(rig, reserved, sha) == []
    out = poll_until(rig, "probe-thread")
    assert isinstance(out, ProbeChecked) and out.verified and out.sha256 == sha
    assert len(hashed_on) == 1 and hashed_on[0] != threading.current_thread().name
    assert hashed_on[0].startswith("probe-digest")


def test_a_failed_transfer_fails_the_check_with_every_block_free(rig: Rig) -> None:
    reserved = reserve_probe(rig, "probe-aborted")
    assert check(rig, reserved, "0" * 64) == []
    reservation = reservation_from_pb(kv_transfer_pb2.Reservation.FromString(reserved.reservation))
    sender = rig.prefill_agent.sender()
    sender.open(reservation)
    sender.abort(reservation.request_id, FailureCause.CANCELLED, "sender gave up")
    out = poll_until(rig, "probe-aborted")
    assert isinstance(out, Failed) and out.kind is ErrorKind.TRANSFER_FAILED
    assert "probe-aborted" in out.message
    rig.assert_all_free()


def test_a_lease_expiring_under_a_waiting_check_frees_everything(rig: Rig) -> None:
    reserved = reserve_probe(rig, "probe-expired", lease_ms=50)
    assert check(rig, reserved, "0" * 64) == []
    out = poll_until(rig, "probe-expired")
    assert isinstance(out, Failed) and out.kind is ErrorKind.DEADLINE_EXCEEDED
    for _ in range(100):
        rig.engine.poll()
        if not rig.engine.leases.leases:
            break
        time.sleep(0.01)
    assert not rig.engine._probe_checks
    rig.assert_all_free()


def test_an_unknown_or_taken_lease_is_not_found(rig: Rig) -> None:
    (out,) = rig.engine.handle(ProbeCheckCommand(0, "nobody", "no-lease", "0" * 64))
    assert isinstance(out, Failed) and out.kind is ErrorKind.NOT_FOUND and out.field == "lease_id"
    reserved = reserve_probe(rig, "probe-other")
    (out,) = rig.engine.handle(ProbeCheckCommand(0, "someone-else", reserved.lease_id, "0" * 64))
    assert isinstance(out, Failed) and out.kind is ErrorKind.NOT_FOUND
    rig.engine.handle(ProbeCheckCommand(0, reserved.request_id, reserved.lease_id, "0" * 64))  # parked, no transfer yet
    rig.agent.abort(reserved.lease_id)
    poll_until(rig, "probe-other")
    rig.assert_all_free()
