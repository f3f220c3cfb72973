"""Cross-node: sender and receiver in two network namespaces joined by a veth pair (made here with
`ip netns`), UCX pinned to TCP on the veth, the control plane on the veth addresses. Bytes cross a
real TCP connection between two network stacks, as between machines.

Addresses come from the RFC 2544 benchmarking range 198.18.0.0/15 on that veth pair only: UCX's TCP
transport does not list interfaces whose only address is link-local (169.254/16), so a link-local
pair cannot carry UCX. Skipped, with the reason, where namespaces cannot be made (not root, no `ip`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from cedserve.bench.kv_transfer.harness import NetnsPair, PeerProcess, WorkerSpec, netns_unavailable_reason
from cedserve.kv_transfer.nixl_backend import nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")

POOL = 400
TOKEN = "e2e-netns"


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[NetnsPair, PeerProcess, PeerProcess]]:
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(f"cannot make network namespaces here: {reason}")
    with NetnsPair() as ns:
        receiver = PeerProcess(WorkerSpec("decode0", POOL, config={"auth_token": TOKEN, **ns.config(0)}),
                               prefix=ns.prefix(0))
        sender = PeerProcess(WorkerSpec("prefill0", POOL, config={"auth_token": TOKEN, **ns.config(1)}, seed=3),
                             prefix=ns.prefix(1))
        try:
            assert receiver.info["control_address"].startswith(ns.addr[0])
            sender.call("handshake", address=receiver.info["control_address"])
            sender.call("fill", seed=33)
            yield ns, receiver, sender
        finally:
            for p in (sender, receiver):
                p.close(graceful=False)


@pytest.mark.parametrize("mode", ["write", "read"])
def test_transfer_between_namespaces_over_tcp(hosts: tuple[NetnsPair, PeerProcess, PeerProcess], mode: str) -> None:
    _, receiver, sender = hosts
    rid = f"netns-{mode}"
    requests = [{"request_id": rid, "num_blocks": 160, "sender": "prefill0", "mode": mode}]
    reservations = receiver.call("reserve", requests=requests, alloc="random")["reservations"]
    local = sender.call("send", reservations=reservations, alloc="random", stream_blocks=32)["local_ids"]
    sent = sender.call("wait", role="sender", request_ids=[rid], timeout_s=60)["results"][rid]
    got = receiver.call("wait", role="receiver", request_ids=[rid], timeout_s=60)["results"][rid]
    assert sent["state"] == got["state"] == "done", (sent, got)
    assert receiver.call("verify", request_id=rid, src_seed=33, src_ids=local[rid])["ok"]
    receiver.call("release", request_ids=[rid])
    for p in (receiver, sender):
        assert p.call("free")["free_blocks"] == POOL


def test_killed_sender_across_namespaces_is_detected(hosts: tuple[NetnsPair, PeerProcess, PeerProcess]) -> None:
    _, receiver, sender = hosts  # runs last in this module: it kills the sender
    requests = [{"request_id": "netns-kill", "num_blocks": 300, "sender": "prefill0"}]
    reservations = receiver.call("reserve", requests=requests)["reservations"]
    sender.call("send", reservations=reservations, stream_blocks=4, pace_s=0.05)
    time.sleep(0.6)
    start = time.monotonic()
    sender.kill(signal.SIGKILL)
    result = receiver.call("wait", role="receiver", request_ids=["netns-kill"], timeout_s=10)["results"]["netns-kill"]
    assert result["state"] == "failed" and result["cause"] in {"peer_disconnected", "peer_silent"}, result
    assert time.monotonic() - start < 2.0
    assert receiver.call("free")["free_blocks"] == POOL
