"""The transfer contract (`cedserve.kv_transfer.protocol`), run against the loopback fake and against
the real NIXL engine (two agents in this process, UCX between them), so the fake cannot drift from
the real thing. Bytes really move in both: the receiver's blocks are compared with the sender's."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from cedserve.kv_transfer.config import KVTransferConfig
from cedserve.kv_transfer.errors import CompatibilityError, FailureCause, KVTransferError
from cedserve.kv_transfer.loopback import LoopbackAgent, LoopbackHub
from cedserve.kv_transfer.nixl_backend import nixl_available
from cedserve.kv_transfer.protocol import TransferEndpoint, TransferMode
from cedserve.kv_transfer.region import KVLayout, KVRegion, LayoutKind
from cedserve.kv_transfer.state import TransferResult, TransferState

BLOCK_BYTES = 4096
NUM_BLOCKS = 96
LAYOUT = KVLayout.raw(BLOCK_BYTES)
TOKEN = "contract-token"


def region(fill: bool) -> KVRegion:
    if fill:
        data = torch.arange(NUM_BLOCKS * BLOCK_BYTES, dtype=torch.int64)
        data = (data * 7 + data // BLOCK_BYTES * 13).remainder(251).to(torch.uint8)
    else:
        data = torch.zeros(NUM_BLOCKS * BLOCK_BYTES, dtype=torch.uint8)
    return KVRegion(data, BLOCK_BYTES)


@dataclass
class Pair:
    kind: str
    sender: TransferEndpoint
    receiver: TransferEndpoint
    src: KVRegion
    dst: KVRegion
    hub: LoopbackHub | None = None
    finished: list[TransferResult] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    counter: int = 0

    def on_finish(self, result: TransferResult) -> None:
        with self.lock:
            self.finished.append(result)

    def rid(self, tag: str) -> str:
        self.counter += 1
        return f"{self.kind}-{tag}-{self.counter}"

    def finishes(self, request_id: str) -> list[TransferResult]:
        with self.lock:
            return [r for r in self.finished if r.request_id == request_id]


def make_pair(kind: str) -> Pair:
    src, dst = region(True), region(False)
    if kind == "loopback":
        hub = LoopbackHub()
        sender: TransferEndpoint = LoopbackAgent(hub, src, LAYOUT, "prefill0")
        receiver: TransferEndpoint = LoopbackAgent(hub, dst, LAYOUT, "decode0")
        sender.handshake("decode0")
        return Pair(kind, sender, receiver, src, dst, hub)
    from cedserve.kv_transfer.agent import NixlTransferAgent

    cfg = KVTransferConfig(auth_token=TOKEN, peer_timeout_s=3.0, heartbeat_interval_s=0.2,
                           doorbell=kind == "nixl-doorbell")
    nixl_sender = NixlTransferAgent(cfg, src, LAYOUT, f"prefill0-{kind}")
    nixl_receiver = NixlTransferAgent(cfg, dst, LAYOUT, f"decode0-{kind}")
    nixl_sender.handshake(nixl_receiver.control_address)
    return Pair(kind, nixl_sender, nixl_receiver, src, dst)


_NIXL = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
BACKENDS = ["loopback", pytest.param("nixl", marks=_NIXL),
            pytest.param("nixl-doorbell", marks=_NIXL)]  # the progress loop on the UDP doorbell (opt-in)


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    p = make_pair(request.param)
    yield p
    p.sender.close()
    p.receiver.close()


def address(p: Pair, agent: TransferEndpoint) -> str:
    """What `handshake` takes to reach `agent`: the fake's name, the real agent's control address."""
    if p.kind == "loopback":
        return agent.name
    from cedserve.kv_transfer.agent import NixlTransferAgent

    assert isinstance(agent, NixlTransferAgent)
    return agent.control_address


def blocks_equal(p: Pair, src: np.ndarray, dst: np.ndarray) -> bool:
    return torch.equal(p.dst.blocks()[torch.from_numpy(dst)], p.src.blocks()[torch.from_numpy(src)])


@pytest.mark.parametrize("mode", [TransferMode.WRITE, TransferMode.READ])
def test_streamed_transfer_lands_every_byte(pair: Pair, mode: TransferMode) -> None:
    rng = np.random.default_rng(1)
    src = rng.permutation(NUM_BLOCKS)[:40]
    dst = np.concatenate([np.arange(50, 70), rng.permutation(40)[:20]])  # a run and scattered ids
    rid = pair.rid(mode.value)
    reservation = pair.receiver.receiver().reserve(rid, dst, sender=pair.sender.name, mode=mode,
                                                   on_finish=pair.on_finish)
    assert pair.receiver.receiver().state(rid) is TransferState.RESERVED
    sender = pair.sender.sender()
    sender.open(reservation, on_finish=pair.on_finish)
    assert sender.state(rid) is TransferState.RESERVED
    sender.write_blocks(rid, src[:15])
    sender.write_blocks(rid, src[15:31])
    sender.write_blocks(rid, src[31:], last=True)
    sent = sender.wait(rid, 10)
    got = pair.receiver.receiver().wait(rid, 10)
    assert sent.state is got.state is TransferState.DONE
    assert got.num_bytes == 40 * BLOCK_BYTES
    assert got.block_ids == tuple(dst.tolist()) and sent.block_ids == tuple(src.tolist())
    assert blocks_equal(pair, src, dst)
    assert [r.state for r in pair.finishes(rid)] == [TransferState.DONE] * 2  # once per side
    initiator = sent if mode is TransferMode.WRITE else got
    assert initiator.num_descriptors >= 1
    # the sender knows when its producer handed over the last blocks: the tail after it is the part
    # of the transfer nothing overlapped; the receiver has no producer
    assert sent.closed_s is not None and sent.tail_s is not None and 0 <= sent.tail_s <= sent.duration_s
    assert got.closed_s is None and got.tail_s is None


def test_empty_request_finishes(pair: Pair) -> None:
    rid = pair.rid("empty")
    reservation = pair.receiver.receiver().reserve(rid, [], sender=pair.sender.name)
    pair.sender.sender().open(reservation)
    pair.sender.sender().write_blocks(rid, [], last=True)
    assert pair.sender.sender().wait(rid, 10).state is TransferState.DONE
    assert pair.receiver.receiver().wait(rid, 10).state is TransferState.DONE


@pytest.mark.parametrize("who", ["receiver", "sender"])
def test_abort_ends_both_sides_with_the_request_id(pair: Pair, who: str) -> None:
    rid = pair.rid(f"abort-{who}")
    reservation = pair.receiver.receiver().reserve(rid, list(range(10)), sender=pair.sender.name,
                                                   on_finish=pair.on_finish)
    sender = pair.sender.sender()
    sender.open(reservation, on_finish=pair.on_finish)
    sender.write_blocks(rid, list(range(5)))
    side = pair.receiver.receiver() if who == "receiver" else sender
    assert side.abort(rid)
    errors = {}
    for name, role in (("sender", sender), ("receiver", pair.receiver.receiver())):
        with pytest.raises(KVTransferError) as exc:
            role.wait(rid, 10)
        errors[name] = exc.value
        assert exc.value.request_id == rid and rid in str(exc.value)
        assert role.state(rid) is TransferState.ABORTED
    other = "sender" if who == "receiver" else "receiver"
    assert errors[who].cause is FailureCause.CANCELLED
    assert errors[other].cause is FailureCause.PEER_ABORTED
    assert sorted(r.role.value for r in pair.finishes(rid)) == ["receiver", "sender"]
    assert not side.abort(rid)  # already over
    with pytest.raises(KVTransferError):
        sender.write_blocks(rid, [5], last=False)


def test_lease_expiry_fails_both_sides(pair: Pair) -> None:
    rid = pair.rid("lease")
    reservation = pair.receiver.receiver().reserve(rid, list(range(4)), sender=pair.sender.name, lease_s=0.3)
    pair.sender.sender().open(reservation, timeout_s=30.0)  # the receiver's lease runs out first
    pair.sender.sender().write_blocks(rid, [0, 1])
    with pytest.raises(KVTransferError) as recv_err:
        pair.receiver.receiver().wait(rid, 10)
    with pytest.raises(KVTransferError) as send_err:
        pair.sender.sender().wait(rid, 10)
    assert recv_err.value.cause is FailureCause.DEADLINE
    assert pair.receiver.receiver().state(rid) is TransferState.FAILED
    assert send_err.value.cause is FailureCause.PEER_ABORTED and "deadline" in str(send_err.value)


def test_sender_into_a_reservation_the_receiver_never_made_fails_fast(pair: Pair) -> None:
    """A reservation unknown to the receiver (its lease lost, or never granted there) ends the sender
    with INVALID at once: the fake refuses the open, the NIXL receiver answers the first chunk with an
    Abort(INVALID) instead of ignoring it (the sender would otherwise wait out its lease)."""
    from cedserve.kv_transfer.protocol import Reservation

    rid = pair.rid("ghost")
    ghost = Reservation(rid, pair.receiver.name, pair.sender.name, (1, 2), TransferMode.WRITE, lease_s=30.0,
                        compat_hash=LAYOUT.compatibility().compat_hash)
    sender = pair.sender.sender()
    start = time.monotonic()
    with pytest.raises(KVTransferError) as err:
        sender.open(ghost, on_finish=pair.on_finish)
        sender.write_blocks(rid, [5, 6], last=True)
        sender.wait(rid, 10)
    assert err.value.cause is FailureCause.INVALID and rid in str(err.value)
    assert time.monotonic() - start < 3.0  # not the 30 s lease
    assert pair.receiver.active_transfers() == 0 and pair.sender.active_transfers() == 0


def test_validation(pair: Pair) -> None:
    receiver, sender = pair.receiver.receiver(), pair.sender.sender()
    rid = pair.rid("valid")
    with pytest.raises(ValueError, match="block ids must be in"):
        receiver.reserve(rid, [NUM_BLOCKS], sender=pair.sender.name)
    with pytest.raises(ValueError, match="not connected"):
        receiver.reserve(rid, [1], sender="nobody")
    reservation = receiver.reserve(rid, [1, 2, 3], sender=pair.sender.name)
    with pytest.raises(KVTransferError):
        receiver.reserve(rid, [4], sender=pair.sender.name)  # id in use
    with pytest.raises(KVTransferError, match="never opened"):
        sender.write_blocks(rid, [1])
    sender.open(reservation)
    with pytest.raises(KVTransferError):
        sender.open(reservation)
    with pytest.raises(ValueError, match="exceed"):
        sender.write_blocks(rid, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="last=True at 2 of 3"):
        sender.write_blocks(rid, [1, 2], last=True)
    with pytest.raises(KeyError):
        sender.state("never-seen")
    assert sender.abort(rid)
    with pytest.raises(KVTransferError):
        receiver.wait(rid, 10)


def test_a_second_handshake_keeps_open_transfers(pair: Pair) -> None:
    """Handshaking again with a live peer, from either side, is not a restart: a transfer opened
    before it finishes DONE with every byte."""
    receiver, sender = pair.receiver.receiver(), pair.sender.sender()
    rid = pair.rid("rehandshake")
    reservation = receiver.reserve(rid, [20, 21], sender=pair.sender.name, on_finish=pair.on_finish)
    sender.open(reservation, on_finish=pair.on_finish)
    assert pair.sender.handshake(address(pair, pair.receiver)) == pair.receiver.name
    assert pair.receiver.handshake(address(pair, pair.sender)) == pair.sender.name
    sender.write_blocks(rid, [20, 21], last=True)
    assert receiver.wait(rid, 10).state is TransferState.DONE
    assert blocks_equal(pair, np.array([20, 21]), np.array([20, 21]))


def test_handshake_refuses_another_layout_naming_both_hashes(pair: Pair) -> None:
    other = KVLayout.raw(BLOCK_BYTES, LayoutKind.PER_LAYER, 2)
    if pair.kind == "loopback":
        assert pair.hub is not None
        odd: TransferEndpoint = LoopbackAgent(pair.hub, region(False), other, "odd")
        address = "odd"
    else:
        from cedserve.kv_transfer.agent import NixlTransferAgent

        odd = NixlTransferAgent(KVTransferConfig(auth_token=TOKEN), region(False), other, "odd")
        address = odd.control_address
    try:
        with pytest.raises(CompatibilityError) as exc:
            pair.sender.handshake(address)
        assert other.compatibility().compat_hash in str(exc.value)
        assert LAYOUT.compatibility().compat_hash in str(exc.value)
    finally:
        odd.close()


# ---------------------------------------------------------------- loopback-only: its test hooks


@_NIXL
def test_only_an_agent_with_the_doorbell_opens_its_port() -> None:
    from cedserve.kv_transfer.agent import NixlTransferAgent

    plain = NixlTransferAgent(KVTransferConfig(auth_token=TOKEN), region(False), LAYOUT, "plain")
    belled = NixlTransferAgent(KVTransferConfig(auth_token=TOKEN, doorbell=True), region(False), LAYOUT, "belled")
    try:
        assert plain.engine.doorbell_port == 0  # peers never ring it
        assert belled.engine.doorbell_port > 0
    finally:
        plain.close()
        belled.close()


def test_loopback_kill_fails_the_peers_transfers() -> None:
    p = make_pair("loopback")
    assert p.hub is not None
    reservation = p.receiver.receiver().reserve("k", [1, 2], sender="prefill0", on_finish=p.on_finish)
    p.sender.sender().open(reservation, on_finish=p.on_finish)
    p.hub.kill("prefill0")
    with pytest.raises(KVTransferError) as exc:
        p.receiver.receiver().wait("k", 1)
    assert exc.value.cause is FailureCause.PEER_DISCONNECTED
    assert [r.role.value for r in p.finishes("k")] == ["receiver"]
    # as the NIXL engine: a new transfer with a dead peer fails retryably, not as a misuse
    with pytest.raises(KVTransferError) as exc:
        p.receiver.receiver().reserve("k2", [3], sender="prefill0")
    assert exc.value.cause is FailureCause.PEER_DISCONNECTED and exc.value.request_id == "k2"


def test_loopback_lease_uses_the_injected_clock() -> None:
    now = [100.0]
    hub = LoopbackHub(clock=lambda: now[0])
    a = LoopbackAgent(hub, region(True), LAYOUT, "a")
    b = LoopbackAgent(hub, region(False), LAYOUT, "b")
    a.handshake("b")
    reservation = b.receiver().reserve("r", [0], sender="a", lease_s=5.0)
    a.sender().open(reservation)
    now[0] += 4.9
    assert b.receiver().state("r") is TransferState.RESERVED
    now[0] += 0.2
    assert b.receiver().state("r") is TransferState.FAILED
    assert a.sender().state("r") is TransferState.ABORTED
