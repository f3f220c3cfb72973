"""Shared server scaffolding: error mapping, drain, KV event fan-out, rates, ready lines, health."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cedserve.common.errors import (
    ERRORS,
    CancelledError,
    DeadlineExceededError,
    ErrorKind,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    ServingError,
    TransferFailedError,
    UnavailableError,
)
from cedserve.drain import request_drain
from cedserve.kv_transfer.errors import FailureCause, KVTransferError
from cedserve.model.cache.errors import CacheExhaustedError
from cedserve.model.cache.events import BlockStored, KVEventBatch, KVEventPublisher, Tier, decode_batch
from cedserve.proto import worker_pb2 as wpb
from cedserve.serving.drain import DrainController, add_lifecycle, is_loopback_peer
from cedserve.serving.errors import error_detail, status_code, wire_code
from cedserve.serving.kv_events import KVEventFeed
from cedserve.serving.load import RateMeter
from cedserve.serving.ready import parse_ready_line, ready_line
from cedserve.serving.server import GrpcServer


@pytest.mark.parametrize(("error", "code", "status"), [
    (InvalidArgumentError, wpb.ERROR_CODE_INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhaustedError, wpb.ERROR_CODE_RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeadlineExceededError, wpb.ERROR_CODE_DEADLINE_EXCEEDED, grpc.StatusCode.DEADLINE_EXCEEDED),
    (UnavailableError, wpb.ERROR_CODE_UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
    (CancelledError, wpb.ERROR_CODE_CANCELLED, grpc.StatusCode.CANCELLED),
    (NotFoundError, wpb.ERROR_CODE_NOT_FOUND, grpc.StatusCode.NOT_FOUND),
    (TransferFailedError, wpb.ERROR_CODE_TRANSFER_FAILED, grpc.StatusCode.UNAVAILABLE),
    (ServingError, wpb.ERROR_CODE_INTERNAL, grpc.StatusCode.INTERNAL),
])
def test_every_domain_error_maps_to_its_wire_code_and_status(error: type[ServingError], code: int,
                                                              status: grpc.StatusCode) -> None:
    """The engines' errors (cedserve.common.errors) know no wire; the service layer's one table maps each kind."""
    d = error_detail(error("what went wrong", field="f", retry_after_ms=7, request_id="r9"))
    assert (d.code, d.message, d.field, d.retry_after_ms, d.request_id) == (code, "what went wrong", "f", 7, "r9")
    assert wire_code(error.kind) == code and status_code(d.code) == status
    assert ERRORS[error.kind] is error


def test_every_error_kind_has_a_wire_code() -> None:
    assert sorted(wire_code(kind) for kind in ErrorKind) == sorted(set(wpb.ErrorCode.values()) - {0})
    # the decode engine's Failed reports a kind; its label is the wire name's lower case
    assert all(wpb.ErrorCode.Name(wire_code(k)).removeprefix("ERROR_CODE_").lower() == k.value for k in ErrorKind)


def test_error_mapping() -> None:
    d = error_detail(InvalidArgumentError("bad", field="token_ids[3]"), "r1")
    assert (d.code, d.field, d.request_id) == (wpb.ERROR_CODE_INVALID_ARGUMENT, "token_ids[3]", "r1")
    assert status_code(d.code) == grpc.StatusCode.INVALID_ARGUMENT
    d = error_detail(CacheExhaustedError("r1", 10, 2))
    assert d.code == wpb.ERROR_CODE_RESOURCE_EXHAUSTED and d.retry_after_ms > 0
    assert error_detail(KVTransferError("x", FailureCause.INVALID)).code == wpb.ERROR_CODE_NOT_FOUND
    assert error_detail(KVTransferError("x", FailureCause.PEER_DISCONNECTED)).code == wpb.ERROR_CODE_TRANSFER_FAILED
    assert error_detail(KVTransferError("x", FailureCause.DEADLINE)).code == wpb.ERROR_CODE_DEADLINE_EXCEEDED
    assert error_detail(RuntimeError("boom")).code == wpb.ERROR_CODE_INTERNAL


@pytest.mark.parametrize(("peer", "ok"), [("ipv4:127.0.0.1:5", True), ("ipv6:[::1]:5", True), ("unix:/x", True),
                                          ("ipv4:10.0.0.1:5", False), ("ipv6:[fe80::1]:5", False)])
def test_loopback_peers(peer: str, ok: bool) -> None:
    assert is_loopback_peer(peer) is ok


def test_rate_meter_measures_busy_time_in_window() -> None:
    now = [100.0]
    meter = RateMeter(window_s=10, clock=lambda: now[0])
    meter.record(1000, 0.5)
    now[0] += 1
    meter.record(1000, 0.5)
    assert meter.rate() == pytest.approx(2000.0)
    now[0] += 20
    assert meter.rate() == 0.0


def test_ready_line_round_trip() -> None:
    line = ready_line("prefill", "127.0.0.1:5", agent="a")
    assert parse_ready_line(line) == {"role": "prefill", "address": "127.0.0.1:5", "agent": "a"}
    assert parse_ready_line("hello") is None


class _Ctx:
    def __init__(self) -> None:
        self.active = True

    def is_active(self) -> bool:
        return self.active


def test_kv_event_feed_replays_snapshots_and_streams_live() -> None:
    feed = KVEventFeed(keep=4, poll_s=0.01)
    pub = KVEventPublisher("w", epoch=1, sink=feed.publish)
    for i in range(6):
        pub.add(BlockStored([bytes([i])], Tier.DEVICE))
        pub.flush()
    ctx: Any = _Ctx()
    resumed = feed.stream(4, lambda: pub.snapshot([]), ctx)
    assert [b.seq for b in (next(resumed), next(resumed))] == [4, 5]
    snap = feed.stream(1, lambda: pub.snapshot([(Tier.DEVICE, [b"x"])]), ctx)  # seq 1 is gone: snapshot
    first = next(snap)
    assert first.snapshot and decode_batch(first.events_msgpack).is_snapshot
    pub.add(BlockStored([b"live"], Tier.DEVICE))
    pub.flush()
    live = decode_batch(next(snap).events_msgpack)
    assert isinstance(live, KVEventBatch) and live.events[0] == BlockStored([b"live"], Tier.DEVICE)
    ctx.active = False
    assert list(snap) == []


def test_health_and_drain_over_grpc() -> None:
    server = GrpcServer("127.0.0.1", 0)
    drain = DrainController(server.health, default_timeout_s=5)
    add_lifecycle(server, drain)
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            check = lambda name: stub.Check(health_pb2.HealthCheckRequest(service=name)).status  # noqa: E731
            assert check("") == health_pb2.HealthCheckResponse.NOT_SERVING
            server.health.set_ready(True)
            server.health.set_alive(True)
            assert check("") == health_pb2.HealthCheckResponse.SERVING

            def owner() -> None:
                drain.wait_requested()
                time.sleep(0.1)
                drain.finish(True)

            threading.Thread(target=owner, daemon=True).start()
            reply = request_drain(server.address, 5)
            assert reply is not None and reply.drained
            assert check("") == health_pb2.HealthCheckResponse.NOT_SERVING
            assert check("liveness") == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)


_HEAVY = ("torch", "cedserve.serving", "cedserve.model.network", "cedserve.kv_transfer")
_RUN_CLI = """
import json, sys
from cedserve.cli import main
heavy = json.loads(sys.argv[1])
try:
    rc = main(sys.argv[2:])
except SystemExit as exc:
    rc = exc.code
print(json.dumps({"rc": rc, "heavy": [m for m in heavy if m in sys.modules]}))
"""


def _run_cli_fresh(*argv: str) -> dict[str, Any]:
    """`cedserve ARGV` in a fresh interpreter: its exit code, stdout and which `_HEAVY` modules it imported."""
    done = subprocess.run([sys.executable, "-c", _RUN_CLI, json.dumps(_HEAVY), *argv], capture_output=True,
                          text=True, timeout=60, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, "stdout": done.stdout}


def test_cedserve_drain_imports_no_torch() -> None:
    """The preStop hook's `cedserve drain` (and its --help) must not pay torch's import time: it drains
    a real server here over gRPC, from a fresh interpreter that must end without torch loaded."""
    helped = _run_cli_fresh("drain", "--help")
    assert helped["rc"] == 0 and "--address" in helped["stdout"] and helped["heavy"] == []
    server = GrpcServer("127.0.0.1", 0)
    drain = DrainController(server.health, default_timeout_s=5)
    add_lifecycle(server, drain)
    server.start()
    try:
        threading.Thread(target=lambda: (drain.wait_requested(), drain.finish(True)), daemon=True).start()
        drained = _run_cli_fresh("drain", f"--address={server.address}", "--timeout-s=5")
        assert drained["rc"] == 0 and drained["heavy"] == []
        assert json.loads(drained["stdout"].splitlines()[0]) == {"reached": True, "drained": True, "in_flight": 0}
        assert drain.draining
    finally:
        server.stop(0)


def test_worker_command_line_takes_the_chart_flags() -> None:
    from cedserve.cli import build_parser

    args = build_parser().parse_args([
        "worker", "--role=prefill", "--config=/etc/cedserve/prefill.toml", "--checkpoint=/ckpt", "--host=0.0.0.0",
        "--grpc-port=50061", "--nixl-port=5600", "--metrics-port=9091", "--dist-port=29500",
        "--advertise-host=10.0.0.5", "--group-size=1", "--rank=0", "--leader-address=leader"])
    assert (args.role, args.grpc_port, args.nixl_port, args.advertise_host) == ("prefill", 50061, 5600, "10.0.0.5")
    drain = build_parser().parse_args(["drain", "--address=127.0.0.1:50061", "--timeout-s=20"])
    assert drain.timeout_s == 20.0
