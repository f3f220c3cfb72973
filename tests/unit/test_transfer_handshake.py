"""Handshakes between real NIXL agents in this process (UCX between them, the real control plane):
concurrent and crossing handshakes keep one connection and its transfers; a restarted peer (a new
incarnation) and a peer that declared the connection dead fail the old transfers, clearly; a peer
declared dead fails a new transfer retryably, not as a misuse."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from cedserve.kv_transfer.config import KVTransferConfig
from cedserve.kv_transfer.errors import FailureCause, KVTransferError
from cedserve.kv_transfer.nixl_backend import nixl_available
from cedserve.kv_transfer.region import KVLayout, KVRegion
from cedserve.kv_transfer.state import Role, TransferState
from cedserve.proto import kv_transfer_pb2 as pb

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")]

if nixl_available():
    from cedserve.kv_transfer.agent import NixlTransferAgent

BLOCK_BYTES = 4096
NUM_BLOCKS = 32
LAYOUT = KVLayout.raw(BLOCK_BYTES)
# A long silence timeout: no peer is declared dead here unless a test makes it so.
CONFIG = KVTransferConfig(auth_token="handshake-token", peer_timeout_s=10.0, heartbeat_interval_s=0.1)
CALLERS = 16


def region(seed: int) -> KVRegion:
    data = torch.randint(0, 256, (NUM_BLOCKS * BLOCK_BYTES,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    return KVRegion(data, BLOCK_BYTES)


class Agents:
    """Agents made by a test, closed after it."""

    def __init__(self) -> None:
        self.made: list[NixlTransferAgent] = []

    def __call__(self, name: str, seed: int = 0) -> NixlTransferAgent:
        agent = NixlTransferAgent(CONFIG, region(seed), LAYOUT, name)
        self.made.append(agent)
        return agent


@pytest.fixture()
def agents() -> Iterator[Agents]:
    made = Agents()
    yield made
    for agent in reversed(made.made):
        agent.close()


def count_accepts(agent: NixlTransferAgent, delay_s: float = 0.0) -> list[str]:
    """The initiators whose handshakes `agent` accepts from now on, each held `delay_s` first (so that
    callers racing for one exchange all find it in flight)."""
    seen: list[str] = []
    accept = agent.accept_handshake

    def counted(request: pb.HandshakeRequest) -> pb.AgentInfo:
        seen.append(request.initiator.agent_name)
        time.sleep(delay_s)
        return accept(request)

    agent.accept_handshake = counted  # type: ignore[method-assign]
    return seen


def together(n: int, call: Callable[[], object]) -> list[object]:
    """`call` from `n` threads released at once; each one's result or exception."""
    start = threading.Barrier(n)
    results: list[object] = [None] * n

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = call()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def send(sender: NixlTransferAgent, receiver: NixlTransferAgent, rid: str, ids: list[int]) -> None:
    """Reserve `ids` at the receiver and write the same ids from the sender; both sides DONE and the
    bytes landed."""
    reservation = receiver.receiver().reserve(rid, ids, sender=sender.name)
    sender.sender().open(reservation)
    sender.sender().write_blocks(rid, ids, last=True)
    assert receiver.wait(Role.RECEIVER, rid, 10).state is TransferState.DONE
    assert sender.wait(Role.SENDER, rid, 10).state is TransferState.DONE
    index = torch.tensor(ids)
    assert torch.equal(receiver.region.blocks()[index], sender.region.blocks()[index])


def failure(agent: NixlTransferAgent, role: Role, rid: str) -> KVTransferError:
    with pytest.raises(KVTransferError) as exc:
        agent.wait(role, rid, 10)
    return exc.value


def test_concurrent_handshakes_share_one_exchange(agents: Agents) -> None:
    decode, prefill = agents("decode"), agents("prefill", seed=1)
    accepted = count_accepts(prefill, delay_s=0.3)
    names = together(CALLERS, lambda: decode.handshake(prefill.control_address))
    assert names == ["prefill"] * CALLERS
    assert accepted == ["decode"]  # one connection; the other callers waited for it
    send(prefill, decode, "after", [1, 2, 3])


def test_a_failed_exchange_fails_every_caller_waiting_on_it(agents: Agents) -> None:
    decode = agents("decode")
    silent = "127.0.0.1:1"  # nothing listens there
    results = together(4, lambda: decode.handshake(silent, timeout_s=2.0))
    assert all(isinstance(r, ConnectionError) and silent in str(r) for r in results), results
    assert decode.peers() == {}


def test_a_second_handshake_keeps_the_connection_and_its_transfers(agents: Agents) -> None:
    decode, prefill = agents("decode"), agents("prefill", seed=1)
    decode.handshake(prefill.control_address)
    reservation = decode.receiver().reserve("open", [4, 5], sender="prefill")
    prefill.sender().open(reservation)
    held = decode.engine._peers["prefill"], prefill.engine._peers["decode"]
    decode.handshake(prefill.control_address)  # again, from the same side
    prefill.handshake(decode.control_address)  # and from the other
    prefill.sender().write_blocks("open", [4, 5], last=True)
    assert decode.wait(Role.RECEIVER, "open", 10).state is TransferState.DONE
    assert decode.engine._peers["prefill"] is held[0] and prefill.engine._peers["decode"] is held[1]  # kept
    assert held[0].link == held[1].link


def test_crossing_handshakes_settle_on_one_link(agents: Agents) -> None:
    decode, prefill = agents("decode"), agents("prefill", seed=1)
    count_accepts(decode, delay_s=0.2)
    count_accepts(prefill, delay_s=0.2)
    calls = [lambda: decode.handshake(prefill.control_address), lambda: prefill.handshake(decode.control_address)]
    results = together(2, lambda: calls.pop()())
    assert sorted(map(str, results)) == ["decode", "prefill"]
    assert decode.engine._peers["prefill"].link == prefill.engine._peers["decode"].link != 0
    send(prefill, decode, "one-way", [1, 2])
    send(decode, prefill, "other-way", [3, 4])


def test_a_restarted_peer_fails_the_old_transfers(agents: Agents) -> None:
    decode, first = agents("decode"), agents("prefill", seed=1)
    first.handshake(decode.control_address)
    reservation = decode.receiver().reserve("held", [6, 7], sender="prefill")
    first.sender().open(reservation)
    first.sender().write_blocks("held", [6])  # in flight: one chunk of two landed
    deadline = time.monotonic() + 10
    while decode.state(Role.RECEIVER, "held") is not TransferState.TRANSFERRING and time.monotonic() < deadline:
        time.sleep(0.01)
    assert decode.state(Role.RECEIVER, "held") is TransferState.TRANSFERRING
    # The same name from a new process, before the old one's silence was noticed (the old agent
    # stays in this process but is never heard from by `decode` again: it has gone for `decode`).
    restarted = agents("prefill", seed=2)
    restarted.handshake(decode.control_address)
    error = failure(decode, Role.RECEIVER, "held")
    assert error.cause is FailureCause.PEER_DISCONNECTED and "restarted (incarnation" in error.detail
    assert decode.active_transfers() == 0  # its blocks are the owner's to free again
    send(restarted, decode, "fresh", [6, 7])


def test_a_peer_that_declared_us_dead_fails_our_transfers_when_it_reconnects(agents: Agents) -> None:
    decode, prefill = agents("decode"), agents("prefill", seed=1)
    decode.handshake(prefill.control_address)
    decode.receiver().reserve("orphan", [8], sender="prefill")
    with prefill.engine._lock:  # what its liveness check does after a long enough silence
        prefill.engine._check_liveness(time.monotonic() + CONFIG.peer_timeout_s + 1)
    assert prefill.peers() == {"decode": False} and decode.peers() == {"prefill": True}
    prefill.handshake(decode.control_address)  # names the connection it lost
    error = failure(decode, Role.RECEIVER, "orphan")
    assert error.cause is FailureCause.PEER_DISCONNECTED and "dead and reconnected" in error.detail
    send(prefill, decode, "reconnected", [8, 9])


def test_a_transfer_toward_a_dead_peer_fails_retryably(agents: Agents) -> None:
    decode, prefill = agents("decode"), agents("prefill", seed=1)
    decode.handshake(prefill.control_address)
    reservation = decode.receiver().reserve("late", [10], sender="prefill")
    with prefill.engine._lock:
        prefill.engine._check_liveness(time.monotonic() + CONFIG.peer_timeout_s + 1)
    with pytest.raises(KVTransferError) as exc:
        prefill.sender().open(reservation)
    assert exc.value.cause is FailureCause.PEER_DISCONNECTED and exc.value.request_id == "late"
    assert "declared dead (peer_silent" in exc.value.detail
    with pytest.raises(ValueError, match="not connected"):  # never handshaken: the caller's mistake
        prefill.receiver().reserve("nobody", [1], sender="stranger")
