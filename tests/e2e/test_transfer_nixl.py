"""Real NIXL transfers between worker processes on this host (UCX's own transports), bytes verified.

Three processes: a decode receiver, a prefill sender that never packs, and one that packs scattered
blocks through the staging buffers, at the released block geometry (56,960 B per 64-token block).
The packing sender polls at the device-memory interval (20 us) and announces its WRITE requests
(`announce_posts`, on by default), the direct sender has it off, the others use the host-memory defaults.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from cedserve.bench.kv_transfer.harness import HarnessError, PeerProcess, WorkerSpec
from cedserve.kv_transfer.control import ControlClient
from cedserve.kv_transfer.errors import FailureCause
from cedserve.kv_transfer.nixl_backend import nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")

TOKEN = "e2e-token"
POOL = 1200
PACK = {"pack_below_bytes": 1 << 20, "staging_slots": 8, "staging_slot_bytes": 4 << 20}


class Cluster:
    def __init__(self) -> None:
        base = {"auth_token": TOKEN}
        self.receiver = PeerProcess(WorkerSpec("decode0", POOL, config={**base, **PACK}))
        self.direct = PeerProcess(WorkerSpec("prefill-direct", POOL, config={**base, "announce_posts": False},
                                             seed=1))
        self.packed = PeerProcess(WorkerSpec("prefill-packed", POOL, seed=2, config={
            **base, **PACK, "poll_interval_s": 2e-5, "announce_posts": True}))
        self.seeds = {"prefill-direct": 11, "prefill-packed": 22}
        for sender in (self.direct, self.packed):
            sender.call("handshake", address=self.receiver.info["control_address"])
            sender.call("fill", seed=self.seeds[sender.spec.name])
        self.n = 0

    def rid(self, tag: str) -> str:
        self.n += 1
        return f"{tag}-{self.n}"

    def close(self) -> None:
        for p in (self.direct, self.packed, self.receiver):
            p.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    yield c
    c.close()


def transfer(c: Cluster, sender: PeerProcess, rids: list[str], blocks: int, mode: str, alloc: str,
             **send: object) -> tuple[dict[str, dict[str, object]], dict[str, dict[str, object]], dict[str, list[int]]]:
    requests = [{"request_id": rid, "num_blocks": blocks, "sender": sender.spec.name, "mode": mode}
                for rid in rids]
    reservations = c.receiver.call("reserve", requests=requests, alloc=alloc)["reservations"]
    local = sender.call("send", reservations=reservations, alloc=alloc, **send)["local_ids"]
    sent = sender.call("wait", role="sender", request_ids=rids, timeout_s=30)["results"]
    got = c.receiver.call("wait", role="receiver", request_ids=rids, timeout_s=30)["results"]
    return sent, got, local


def assert_all_free(*peers: PeerProcess) -> None:
    for p in peers:
        free = p.call("free")
        assert free["free_blocks"] == POOL and free["active"] == 0, (p.spec.name, free)


@pytest.mark.parametrize("mode", ["write", "read"])
@pytest.mark.parametrize("alloc", ["contiguous", "random"])
@pytest.mark.parametrize("packing", [False, True], ids=["direct", "packed"])
def test_bytes_arrive_intact(cluster: Cluster, mode: str, alloc: str, packing: bool) -> None:
    sender = cluster.packed if packing else cluster.direct
    rid = cluster.rid(f"{mode}-{alloc}-{'packed' if packing else 'direct'}")
    sent, got, local = transfer(cluster, sender, [rid], 300, mode, alloc, stream_blocks=64)
    assert sent[rid]["state"] == "done", sent[rid]
    assert got[rid]["state"] == "done", got[rid]
    for side in (sent[rid], got[rid]):  # each process's CPU seconds at the request's start and end
        assert 0 <= float(side["cpu_start_s"]) <= float(side["cpu_end_s"])  # type: ignore[arg-type]
    check = cluster.receiver.call("verify", request_id=rid, src_seed=cluster.seeds[sender.spec.name],
                                  src_ids=local[rid])
    assert check == {"ok": True, "mismatched_blocks": 0}
    descriptors = int(sent[rid]["descriptors"]) + int(got[rid]["descriptors"])  # type: ignore[call-overload]
    if alloc == "contiguous":
        assert descriptors <= 5  # runs coalesce: one descriptor per chunk at most
    elif packing:
        assert descriptors <= 8  # 300 scattered blocks in 4 MiB slots (73 blocks): 5 descriptors
    else:
        assert descriptors >= 250  # scattered and unpacked: about one per block
    cluster.receiver.call("release", request_ids=[rid])
    assert_all_free(cluster.receiver, sender)


@pytest.mark.parametrize("packing", [False, True], ids=["direct", "packed"])
def test_each_write_request_is_announced_before_it_lands(cluster: Cluster, packing: bool) -> None:
    """WRITE with `announce_posts` (the packing sender, the default): a ChunkPosted once each NIXL
    request is posted (so the receiver polls short while the bytes land) and a ChunkDone after it,
    one of each per request; without it (the direct sender) no ChunkPosted. Bytes intact either way."""
    sender = cluster.packed if packing else cluster.direct
    before = cluster.receiver.call("notices")
    rid = cluster.rid(f"announced-{'packed' if packing else 'direct'}")
    sent, got, local = transfer(cluster, sender, [rid], 200, "write", "random", stream_blocks=50)
    assert sent[rid]["state"] == got[rid]["state"] == "done", (sent[rid], got[rid])
    check = cluster.receiver.call("verify", request_id=rid, src_seed=cluster.seeds[sender.spec.name],
                                  src_ids=local[rid])
    assert check == {"ok": True, "mismatched_blocks": 0}
    after = cluster.receiver.call("notices")
    posted = after["chunk_posted"] - before["chunk_posted"]
    done = after["chunk_done"] - before["chunk_done"]
    assert done == sent[rid]["chunks"] and done >= 1
    assert posted == (done if packing else 0)
    cluster.receiver.call("release", request_ids=[rid])
    assert_all_free(cluster.receiver, sender)


def test_fan_in_two_senders_one_receiver(cluster: Cluster) -> None:
    ids = {s.spec.name: [cluster.rid("fanin"), cluster.rid("fanin")] for s in (cluster.direct, cluster.packed)}
    requests = [{"request_id": rid, "num_blocks": 150, "sender": name} for name, rids in ids.items() for rid in rids]
    reservations = cluster.receiver.call("reserve", requests=requests, alloc="random")["reservations"]
    pending = [(s, s.send("send", reservations=reservations[i * 2:(i + 1) * 2], alloc="random", stream_blocks=32))
               for i, s in enumerate((cluster.direct, cluster.packed))]
    local = {s.spec.name: s.reply(m)["local_ids"] for s, m in pending}
    everyone = [rid for rids in ids.values() for rid in rids]
    got = cluster.receiver.call("wait", role="receiver", request_ids=everyone, timeout_s=30)["results"]
    assert {r["state"] for r in got.values()} == {"done"}
    for name, rids in ids.items():
        for rid in rids:
            check = cluster.receiver.call("verify", request_id=rid, src_seed=cluster.seeds[name],
                                          src_ids=local[name][rid])
            assert check["ok"], (name, rid, check)
    cluster.receiver.call("release", request_ids=everyone)
    for s in (cluster.direct, cluster.packed):
        s.call("wait", role="sender", request_ids=ids[s.spec.name], timeout_s=30)
    assert_all_free(cluster.receiver, cluster.direct, cluster.packed)


def test_client_cancellation_reaches_the_transfer_and_frees_blocks(cluster: Cluster) -> None:
    rid = cluster.rid("cancel")
    requests = [{"request_id": rid, "num_blocks": 400, "sender": "prefill-direct"}]
    reservations = cluster.receiver.call("reserve", requests=requests)["reservations"]
    cluster.direct.call("send", reservations=reservations, stream_blocks=8, pace_s=0.05)  # ~2.5 s of prefill
    time.sleep(0.3)
    router = ControlClient(cluster.receiver.info["control_address"], TOKEN)  # what the router does
    try:
        start = time.monotonic()
        assert router.abort(rid, FailureCause.CANCELLED, "client cancelled", "router")
    finally:
        router.close()
    got = cluster.receiver.call("wait", role="receiver", request_ids=[rid])["results"][rid]
    sent = cluster.direct.call("wait", role="sender", request_ids=[rid])["results"][rid]
    elapsed = time.monotonic() - start
    assert got["state"] == sent["state"] == "aborted"
    assert got["cause"] == "cancelled" and sent["cause"] == "peer_aborted"
    assert rid in str(sent["error"]) and elapsed < 2.0
    assert_all_free(cluster.receiver, cluster.direct)


def test_lease_deadline_frees_both_sides(cluster: Cluster) -> None:
    rid = cluster.rid("lease")
    requests = [{"request_id": rid, "num_blocks": 200, "sender": "prefill-direct", "lease_s": 0.6}]
    reservations = cluster.receiver.call("reserve", requests=requests)["reservations"]
    cluster.direct.call("send", reservations=reservations, stream_blocks=4, pace_s=0.05, timeout_s=30)
    got = cluster.receiver.call("wait", role="receiver", request_ids=[rid])["results"][rid]
    sent = cluster.direct.call("wait", role="sender", request_ids=[rid])["results"][rid]
    assert got["state"] == "failed" and got["cause"] == "deadline"
    assert sent["state"] == "aborted" and sent["cause"] == "peer_aborted"
    assert_all_free(cluster.receiver, cluster.direct)


def test_link_meter_references(cluster: Cluster) -> None:
    """The load test's references (`LinkMeter`, benchmark side): raw NIXL requests around the engine,
    each WRITE's probe recorded where the bytes land. Last in the module: they overwrite the
    receiver's first blocks."""
    bb = cluster.receiver.info["block_bytes"]
    cluster.receiver.call("expect_probe", probe_ids=[900])
    (posted, done), = cluster.direct.call("raw", peer="decode0", nbytes=4 * bb, op="WRITE", probe_base=900)["times"]
    arrived = cluster.receiver.call("probe", probe_ids=[900])["arrivals"][0]
    assert posted <= done and posted <= arrived  # one host: one monotonic clock

    (posted, done), = cluster.receiver.call("raw", peer="prefill-direct", nbytes=4 * bb, op="READ")["times"]
    assert posted <= done
    times = cluster.direct.call("raw", peer="decode0", nbytes=8 * bb, alloc="random", num_blocks=8,
                                peer_num_blocks=POOL, probe_base=901, reps=2)["times"]
    assert len(times) == 2 and all(p <= d for p, d in times)

    ids = [910, 911, 912, 913]
    cluster.receiver.call("expect_probe", probe_ids=ids)
    out = cluster.direct.call("requests", peer="decode0", nbytes=8 * bb, pieces=4, probe_base=910)
    arrivals = cluster.receiver.call("probe", probe_ids=ids)["arrivals"]
    assert out["posted_s"] <= min(arrivals) and out["in_post_s"] <= out["done_s"] - out["posted_s"]

    with pytest.raises(HarnessError, match="not connected"):
        cluster.direct.call("raw", peer="nobody", nbytes=bb)
    with pytest.raises(HarnessError, match="do not fit"):
        cluster.direct.call("requests", peer="decode0", nbytes=bb + 1, pieces=2, probe_base=920)
    assert_all_free(cluster.receiver, cluster.direct)
