"""A real decode worker process (`cedserve worker --role decode --preset tiny`) fed by a real prefill
worker process over NIXL (UCX on loopback), this test playing the router: Reserve -> Prefill (with the
returned reservation) -> Decode.

- greedy tokens equal the single-process reference model's (a differing step must be a numerical tie,
  shown by another computation of the same model picking that token); the next turn of the
  conversation reuses the decode worker's own cached blocks, so the prefill side sends only the rest;
- a request whose lease asks for the bounded state (`ReserveRequest.ship_state`) gets it from the
  prefill worker over NIXL and decodes to the replay path's tokens and the reference's; a state region
  holding another format version fails the Decode call naming it, with every block freed;
- a client that cancels its Decode call, and a prefill side killed mid-transfer, leave every block free;
- health, load, metrics and KV events are served; a drain refuses new leases; SIGTERM exits cleanly;
- with `decode.overlap` (steps launched before the last one's tokens are read) two streams decode to the
  reference's tokens and a cancel mid-stream frees every block.
"""

from __future__ import annotations

import signal
import sys
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
import torch
from decode_rig import REPO, DecodeProcess, SenderChild
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prefill_rig import WorkerProcess

from cedserve.drain import request_drain
from cedserve.kv_transfer.nixl_backend import nixl_available
from cedserve.model.cache.events import decode_batch
from cedserve.proto import worker_pb2 as wpb
from cedserve.serving.errors import detail_from_rpc_error
from cedserve.serving.worker_model import load_worker_model

sys.path.insert(0, str(REPO / "tests" / "unit"))
from decode_support import greedy_ties, prompt

pytestmark = [pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed"), pytest.mark.slow]
ROUTED: dict[str, object] = {"effort": 75, "sampling": wpb.SamplingParams(top_p=1.0)}
"""Effort and sampling as the router resolves them (the internal plane has no "unset")."""


class Cluster:
    def __init__(self, **decode: object) -> None:
        torch.set_num_threads(1)  # the reference checks run the tiny model here: intra-op threads only contend
        self.model = load_worker_model(None, "tiny", seed=0).model  # both workers' weights, bit for bit
        self.decode = DecodeProcess(num_blocks=64, **decode)
        self.prefill = WorkerProcess(num_blocks=64)

    def reserve(self, rid: str, tokens: list[int], sender: dict[str, str] | None = None,
                ship_state: bool | None = None) -> wpb.ReserveReply:
        sender = sender or self.prefill.ready
        request = wpb.ReserveRequest(
            request_id=rid, prompt_tokens=len(tokens), token_ids=tokens, lease_ms=20_000,
            sender_agent=sender["agent"], sender_control_address=sender["control_address"])
        if ship_state is not None:
            request.ship_state = ship_state
        reply: wpb.ReserveReply = self.decode.stub.Reserve(request, timeout=30)
        return reply

    def prefill_into(self, rid: str, tokens: list[int], lease: wpb.ReserveReply) -> tuple[int, wpb.PrefillDone]:
        target = wpb.DecodeTarget(worker_id="decode-e2e", agent_name=lease.agent_name,
                                  control_address=lease.control_address, lease_id=lease.lease_id,
                                  num_cached_blocks=lease.num_cached_blocks,
                                  reservation=lease.reservation)
        if lease.HasField("state_room"):  # what the router does
            target.state_room.CopyFrom(lease.state_room)
        events = list(self.prefill.stub.Prefill(wpb.PrefillRequest(request_id=rid, token_ids=tokens, target=target, **ROUTED),
                                                timeout=60))
        assert [e.WhichOneof("event") for e in events] == ["first_token", "done"], events
        return events[0].first_token.token_id, events[1].done

    def decode_call(self, rid: str, lease: wpb.ReserveReply, tokens: list[int], first: int,
                    max_tokens: int) -> grpc.Future:
        return self.decode.stub.Decode(wpb.DecodeRequest(
            request_id=rid, lease_id=lease.lease_id, token_ids=tokens, first_token=first, effort=75,
            sampling=wpb.SamplingParams(top_p=1.0, max_tokens=max_tokens)), timeout=120)

    def generate(self, rid: str, tokens: list[int], max_tokens: int,
                 ship_state: bool = False) -> tuple[list[int], wpb.DecodeComplete, int]:
        lease = self.reserve(rid, tokens, ship_state=ship_state)
        shipped = ship_state is not False  # unset: the worker's `decode.ship_state`, on by default
        assert lease.HasField("state_room") is shipped
        first, done = self.prefill_into(rid, tokens, lease)
        assert (done.handoff.state_bytes > 0) is shipped
        out, complete = [first], None
        for event in self.decode_call(rid, lease, tokens, first, max_tokens):
            kind = event.WhichOneof("event")
            assert kind != "error", event
            if kind == "tokens":
                out.extend(event.tokens.token_ids)
            else:
                complete = event.complete
        assert complete is not None
        return out, complete, lease.num_cached_blocks

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    yield c
    c.close()


def test_prefilled_request_decodes_to_the_reference_tokens(cluster: Cluster) -> None:
    tokens = prompt(150, 1)
    out, complete, cached = cluster.generate("a", tokens, 12)
    assert cached == 0 and complete.finish_reason == "length" and complete.output_tokens == 12
    assert complete.draft_tokens > 0  # DSpark drafted (the preset's random drafter is almost never right)
    assert len(greedy_ties(cluster.model, tokens, out)) <= 1

    # The next turn: this worker cached the first prompt's whole blocks (and its answer's): the
    # prefill side sends only the blocks after them.
    follow_up = tokens + out + prompt(40, 2)
    out2, _, cached2 = cluster.generate("b", follow_up, 6)
    assert cached2 == 2
    assert len(greedy_ties(cluster.model, follow_up, out2)) <= 1
    load = cluster.decode.wait_all_free()
    assert load.held_blocks == 0 and load.cached_blocks > 0 and load.decode_tokens_per_s > 0


def test_shipped_state_decodes_like_the_replay_path_and_the_reference(cluster: Cluster) -> None:
    tokens = prompt(150, 1)  # the first test's prompt: its first token is no numerical tie
    replayed, _, _ = cluster.generate("r", tokens, 8, ship_state=False)
    shipped, complete, _ = cluster.generate("s", tokens, 8, ship_state=True)
    assert shipped == replayed and complete.output_tokens == 8
    assert complete.draft_tokens > 0  # drafted from the shipped DSpark taps
    assert len(greedy_ties(cluster.model, tokens, shipped)) <= 1
    load = cluster.decode.wait_all_free()
    assert load.held_blocks == 0


def test_state_region_of_another_version_is_rejected_and_frees_every_block(cluster: Cluster) -> None:
    tokens = prompt(100, 8)
    child = SenderChild(num_blocks=64)
    try:
        lease = cluster.reserve("v", tokens, sender=child.info, ship_state=True)
        room = lease.state_room.num_blocks
        assert room > 0 and len(lease.reservation.block_ids) == len(lease.block_ids) + room
        child.send_partial(lease.reservation, state=(room, 99))
        events = []
        with pytest.raises(grpc.RpcError) as err:
            events.extend(cluster.decode_call("v", lease, tokens, 7, 10))
        detail = detail_from_rpc_error(err.value)
        assert detail is not None and detail.code == wpb.ERROR_CODE_TRANSFER_FAILED
        assert "state format version 99" in detail.message and "'v'" in detail.message
    finally:
        child.kill()
    load = cluster.decode.wait_all_free()
    assert load.held_blocks == 0 and load.free_blocks == load.total_blocks


def test_client_cancel_frees_every_block(cluster: Cluster) -> None:
    cancel_mid_stream(cluster, "c")


def cancel_mid_stream(cluster: Cluster, rid: str) -> None:
    """A Decode call cancelled by its client after its first tokens: every block comes back."""
    tokens = prompt(100, 3)
    lease = cluster.reserve(rid, tokens)
    first, _ = cluster.prefill_into(rid, tokens, lease)
    call = cluster.decode_call(rid, lease, tokens, first, 500)
    assert next(call).WhichOneof("event") == "tokens"
    call.cancel()
    load = cluster.decode.wait_all_free()
    assert load.held_blocks == 0 and load.running_requests == 0


def test_prefill_side_killed_mid_transfer_frees_every_block(cluster: Cluster) -> None:
    tokens = prompt(200, 4)  # 4 blocks: the child sends 3 and never closes the transfer
    child = SenderChild(num_blocks=8)
    try:
        lease = cluster.reserve("k", tokens, sender=child.info)
        child.send_partial(lease.reservation)
        call = cluster.decode_call("k", lease, tokens, 7, 10)
        time.sleep(0.3)
        child.kill()
        events = []
        with pytest.raises(grpc.RpcError) as err:
            events.extend(call)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        detail = detail_from_rpc_error(err.value)
        assert detail is not None and detail.code == wpb.ERROR_CODE_TRANSFER_FAILED
        assert [e.WhichOneof("event") for e in events] == ["error"]
    finally:
        child.kill()
    load = cluster.decode.wait_all_free()
    assert load.held_blocks == 0 and load.free_blocks == load.total_blocks


def test_bad_calls_get_precise_statuses(cluster: Cluster) -> None:
    with pytest.raises(grpc.RpcError) as err:
        cluster.reserve("bad", prompt(10, 5), sender={"agent": "nobody", "control_address": ""})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert detail_from_rpc_error(err.value).field == "sender_control_address"  # type: ignore[union-attr]
    with pytest.raises(grpc.RpcError) as err:
        cluster.reserve("big", prompt(64 * 65, 5))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as err:
        list(cluster.decode.stub.Decode(wpb.DecodeRequest(request_id="ghost", lease_id="none", token_ids=[1]),
                                        timeout=10))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert cluster.decode.wait_all_free().held_blocks == 0


def test_health_metrics_events_drain_and_exit(cluster: Cluster) -> None:
    decode = cluster.decode
    health = health_pb2_grpc.HealthStub(decode.channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == serving
    assert health.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5).status == serving
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{decode.ready['metrics_port']}/metrics", timeout=5).read()
    assert b"cedserve_decode_output_tokens_total" in metrics
    first = next(iter(decode.stub.StreamKVEvents(wpb.KVEventsRequest(since_seq=0), timeout=5)))
    assert first.snapshot and decode_batch(first.events_msgpack).worker_id == "decode-e2e"

    reply = request_drain(decode.ready["address"], 10.0)
    assert reply is not None and reply.drained
    assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status != serving
    with pytest.raises(grpc.RpcError) as err:
        cluster.reserve("late", prompt(10, 6))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    decode.proc.send_signal(signal.SIGTERM)
    assert decode.proc.wait(30) == 0


def test_overlapped_steps_in_a_worker_process() -> None:
    """`decode.overlap` in a real worker (the runner's steps run eagerly on a CPU: `runner = "on"`,
    no drafter): two requests streaming at once decode to the reference's tokens, each step launched
    before the last one's tokens were read; a client that cancels mid-stream leaves every block free."""
    import threading

    c = Cluster(runner="on", overlap=True, dspark=False)
    try:
        prompts = {"o1": prompt(150, 1), "o2": prompt(90, 4)}
        got: dict[str, list[int]] = {}
        threads = [threading.Thread(target=lambda rid=rid, tokens=tokens: got.__setitem__(rid, c.generate(rid, tokens, 14)[0]))
                   for rid, tokens in prompts.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert set(got) == set(prompts)
        for rid, tokens in prompts.items():
            assert len(got[rid]) == 15 and len(greedy_ties(c.model, tokens, got[rid])) <= 1
        cancel_mid_stream(c, "oc")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{c.decode.ready['metrics_port']}/metrics",
                                         timeout=10).read().decode()
        rows = [line for line in metrics.splitlines() if line.startswith("cedserve_decode_overlapped_steps_total")]
        assert rows and float(rows[0].split()[-1]) >= 10  # most steps were launched ahead
    finally:
        c.close()
