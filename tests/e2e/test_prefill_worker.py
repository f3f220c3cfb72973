"""A real prefill worker process (`cedserve worker --role prefill --preset tiny`) on loopback: gRPC in,
real NIXL (UCX) out to a decode-side agent in this process or in a killable child process.

- the KV it ships, loaded and replayed through the model's reference path, decodes to the monolithic
  model's tokens; a repeated prefix reports its cached tokens and computes only the rest;
- bad input gets a precise status (with the `ErrorDetail` in trailing metadata) and no blocks; a
  lease the decode agent never reserved fails at once with NOT_FOUND (the sender claims it first), and
  room for the bounded state too small for it is refused before any work;
- a decode target killed mid-transfer ends the request TRANSFER_FAILED with every block free;
- health, metrics and KV events are served; a drain turns readiness off and refuses new work;
  SIGTERM exits promptly.
"""

from __future__ import annotations

import signal
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prefill_rig import BLOCK, WorkerProcess, decode_target, make_receiver, start_receiver_child

from cedserve.drain import request_drain
from cedserve.kv_transfer.nixl_backend import nixl_available
from cedserve.kv_transfer.protocol import Reservation, TransferMode
from cedserve.model.cache.events import decode_batch
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.paged_kv import load_state
from cedserve.model.state_format import STATE_FORMAT_VERSION
from cedserve.proto import worker_pb2 as wpb
from cedserve.serving.errors import detail_from_rpc_error
from cedserve.serving.worker_model import LoadedModel, load_worker_model

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
ROUTED: dict[str, object] = {"effort": 75, "sampling": wpb.SamplingParams(top_p=1.0)}
"""Effort and sampling as the router resolves them (the internal plane has no "unset")."""
POOL = 64


class Setup:
    def __init__(self) -> None:
        torch.set_num_threads(1)  # the reference checks run the tiny model here: intra-op threads only contend
        self.loaded: LoadedModel = load_worker_model(None, "tiny", seed=0)  # the worker's weights, bit for bit
        self.worker = WorkerProcess(num_blocks=POOL)
        self.agent, self.pool = make_receiver("decode-e2e", 64, self.loaded.model.config)
        self.agent.handshake(self.worker.ready["control_address"])
        self.next_block = 0

    def target(self, lease: str, prompt_len: int, state_blocks: int = 0) -> wpb.DecodeTarget:
        n = -(-prompt_len // BLOCK)
        blocks = list(range(self.next_block, self.next_block + n))
        self.next_block = (self.next_block + n) % 32
        state = list(range(40, 40 + state_blocks))
        res = self.agent.receiver().reserve(lease, blocks + state, sender=self.worker.ready["agent"], lease_s=20)
        return decode_target(res, self.agent.name, self.agent.control_address)

    def close(self) -> None:
        self.worker.close()
        self.agent.close()


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    s = Setup()
    yield s
    s.close()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill(s: Setup, rid: str, tokens: list[int], target: wpb.DecodeTarget | None) -> list[wpb.PrefillEvent]:
    req = wpb.PrefillRequest(request_id=rid, token_ids=tokens, target=target, **ROUTED)
    return list(s.worker.stub.Prefill(req, timeout=60))


def reference_tokens(s: Setup, tokens: list[int], n: int) -> list[int]:
    model = s.loaded.model
    state = model.new_state()
    out = [int(model.prefill(tokens, state)[-1].argmax())]
    while len(out) < n:
        out.append(int(model.decode_step([out[-1]], [state])[-1].argmax()))
    return out


def decoded_from_blocks(s: Setup, lease: str, tokens: list[int], n: int) -> list[int]:
    blocks = list(s.agent.receiver().wait(lease, 10).block_ids)
    model = s.loaded.model
    state = model.new_state()
    load_state(BlockLayout.from_config(model.config, BLOCK), s.pool, blocks, len(tokens), state)
    state.position = len(tokens)
    out = [int(model.replay(tokens[-128:], state)[-1].argmax())]
    while len(out) < n:
        out.append(int(model.decode_step([out[-1]], [state])[-1].argmax()))
    return out


def wait_all_free(s: Setup, timeout_s: float = 5.0) -> wpb.LoadReport:
    end = time.monotonic() + timeout_s
    while True:
        load = s.worker.load()
        if (load.held_blocks == 0 and load.free_blocks == load.total_blocks == POOL and load.running_requests == 0) \
                or time.monotonic() > end:
            return load
        time.sleep(0.05)


def test_shipped_kv_decodes_like_the_monolithic_model_and_prefixes_are_reused(setup: Setup) -> None:
    tokens = prompt(200, seed=1)
    events = prefill(setup, "a", tokens, setup.target("lease-a", 200))
    assert [e.WhichOneof("event") for e in events] == ["first_token", "done"]
    expected = reference_tokens(setup, tokens, 5)
    assert events[0].first_token.token_id == expected[0]
    assert decoded_from_blocks(setup, "lease-a", tokens, 5) == expected
    done = events[1].done
    assert done.bytes_sent == 4 * BlockLayout.from_config(setup.loaded.model.config, BLOCK).block_bytes
    assert 0 < done.transfer_tail_s <= done.transfer_s  # real NIXL: the last chunk's tail took some time
    assert done.handoff.lease_id == "lease-a" and done.handoff.num_tokens == 200

    second = tokens[:128] + prompt(136, seed=2)
    events = prefill(setup, "b", second, setup.target("lease-b", len(second)))
    done = events[-1].done
    assert (done.cached_tokens, done.computed_tokens) == (128, 136)
    expected = reference_tokens(setup, second, 3)
    assert events[0].first_token.token_id == expected[0]
    assert decoded_from_blocks(setup, "lease-b", second, 3) == expected
    load = wait_all_free(setup)
    assert load.held_blocks == 0 and load.cached_blocks >= 4 and load.prefill_tokens_per_s > 0


@pytest.mark.parametrize(("tokens", "code", "field"), [
    ([], grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
    ([1, 2, 99999], grpc.StatusCode.INVALID_ARGUMENT, "token_ids[2]"),
    ([1] * 5000, grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
])
def test_bad_input_gets_a_precise_status(setup: Setup, tokens: list[int], code: grpc.StatusCode, field: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        prefill(setup, "bad", tokens, None)
    assert info.value.code() == code
    detail = detail_from_rpc_error(info.value)
    assert detail is not None and detail.field == field and detail.request_id == "bad"
    assert wait_all_free(setup).held_blocks == 0


def test_lease_unknown_to_the_receiver_is_not_found_at_once(setup: Setup) -> None:
    ghost = Reservation("lease-ghost", setup.agent.name, setup.worker.ready["agent"], (0, 1), TransferMode.WRITE,
                        lease_s=30.0, compat_hash=setup.agent.compatibility().compat_hash)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        prefill(setup, "ghost", prompt(100, seed=9), decode_target(ghost, setup.agent.name, ""))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()
    assert time.monotonic() - start < 5  # not the 30 s lease
    detail = detail_from_rpc_error(info.value)
    assert detail is not None and "lease-ghost" in detail.message and "no reservation" in detail.message
    assert wait_all_free(setup).held_blocks == 0


def test_state_room_too_small_is_refused_before_any_work(setup: Setup) -> None:
    target = setup.target("lease-room", 100, state_blocks=1)
    target.state_room.CopyFrom(wpb.StateRoom(num_blocks=1, format_version=STATE_FORMAT_VERSION, dspark_taps=True))
    with pytest.raises(grpc.RpcError) as info:
        prefill(setup, "room", prompt(100, seed=10), target)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert detail_from_rpc_error(info.value).field == "target.state_room.num_blocks"  # type: ignore[union-attr]
    setup.agent.receiver().abort("lease-room")
    assert wait_all_free(setup).held_blocks == 0


def test_lease_that_does_not_match_the_reservation(setup: Setup) -> None:
    target = setup.target("lease-m", 100)
    target.lease_id = "someone-else"
    with pytest.raises(grpc.RpcError) as info:
        prefill(setup, "m", prompt(100, seed=3), target)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert detail_from_rpc_error(info.value).field == "target.reservation.request_id"  # type: ignore[union-attr]
    setup.agent.receiver().abort("lease-m")
    assert wait_all_free(setup).held_blocks == 0


@pytest.mark.slow
def test_killed_decode_target_frees_every_block(setup: Setup) -> None:
    tokens = prompt(1500, seed=4)
    child, reservation = start_receiver_child(setup.worker.ready["control_address"], setup.worker.ready["agent"],
                                              "lease-k", -(-len(tokens) // BLOCK))
    try:
        target = decode_target(reservation, reservation.receiver, "")
        call = setup.worker.stub.Prefill(wpb.PrefillRequest(request_id="k", token_ids=tokens, target=target, **ROUTED),
                                         timeout=60)
        deadline = time.monotonic() + 20
        while setup.worker.load().held_blocks == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # admitted and streaming
        time.sleep(0.3)
        child.kill()
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
        assert detail_from_rpc_error(info.value).code == wpb.ERROR_CODE_TRANSFER_FAILED  # type: ignore[union-attr]
        assert time.monotonic() - start < 5
        load = wait_all_free(setup)
        assert load.held_blocks == 0 and load.free_blocks == POOL, load
        time.sleep(1.0)
        assert setup.worker.proc.poll() is None, setup.worker.log_tail()
    finally:
        child.kill()
        child.wait(10)


def test_health_metrics_events_drain_and_sigterm(setup: Setup) -> None:
    w = setup.worker
    assert w.proc.poll() is None, w.log_tail()
    health = health_pb2_grpc.HealthStub(w.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
    body = urllib.request.urlopen(f"http://127.0.0.1:{w.ready['metrics_port']}/metrics", timeout=5).read().decode()
    assert "cedserve_prefill_tokens_total" in body and "cedserve_kv_transfer_bytes_total" in body
    batch = next(iter(w.stub.StreamKVEvents(wpb.KVEventsRequest(since_seq=0), timeout=5)))
    assert batch.snapshot and decode_batch(batch.events_msgpack).worker_id == "prefill-e2e"

    reply = request_drain(w.ready["address"], timeout_s=5)
    assert reply is not None and reply.drained
    assert health.Check(health_pb2.HealthCheckRequest(service="")).status == \
        health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as info:
        prefill(setup, "late", [1, 2, 3], None)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    w.proc.send_signal(signal.SIGTERM)
    assert w.proc.wait(15) == 0
