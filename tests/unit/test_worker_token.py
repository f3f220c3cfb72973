"""The worker plane's token check (`cedserve.serving.TokenInterceptor` via `GrpcServer(token=...)`),
over real gRPC on loopback: a servicer of the real `PrefillWorker` service answers only calls that
carry the token; health and the loopback-only Drain stay open."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cedserve.common.credentials import TOKEN_METADATA_KEY
from cedserve.proto import lifecycle_pb2, lifecycle_pb2_grpc
from cedserve.proto import worker_pb2 as wpb
from cedserve.proto import worker_pb2_grpc as wpb_grpc
from cedserve.serving.config import ServeConfig
from cedserve.serving.drain import DrainController, add_lifecycle
from cedserve.serving.server import GrpcServer, TokenInterceptor

TOKEN = "worker-plane-secret"


class _Prefill(wpb_grpc.PrefillWorkerServicer):
    """Answers the two call shapes the worker services have: unary and server-streaming."""

    def GetLoad(self, request: wpb.LoadRequest, context: grpc.ServicerContext) -> wpb.LoadReport:
        return wpb.LoadReport(total_blocks=7)

    def StreamKVEvents(self, request: wpb.KVEventsRequest, context: grpc.ServicerContext) -> Iterator[wpb.KVEventBatch]:
        yield wpb.KVEventBatch(seq=1)
        yield wpb.KVEventBatch(seq=2)


@pytest.fixture(scope="module")
def stub_and_channel() -> Iterator[tuple[wpb_grpc.PrefillWorkerStub, grpc.Channel]]:
    server = GrpcServer("127.0.0.1", 0, max_workers=4, token=TOKEN)
    wpb_grpc.add_PrefillWorkerServicer_to_server(_Prefill(), server.grpc)  # type: ignore[no-untyped-call]
    drain = DrainController(server.health, default_timeout_s=0.1)
    drain.finish(True)
    add_lifecycle(server, drain)
    server.health.set_ready(True)
    server.start()
    channel = grpc.insecure_channel(server.address)
    yield wpb_grpc.PrefillWorkerStub(channel), channel  # type: ignore[no-untyped-call]
    channel.close()
    server.stop(0)


def _code(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_right_token_is_served(stub_and_channel: tuple[wpb_grpc.PrefillWorkerStub, grpc.Channel]) -> None:
    stub, _ = stub_and_channel
    metadata = ((TOKEN_METADATA_KEY, TOKEN),)
    assert stub.GetLoad(wpb.LoadRequest(), timeout=5, metadata=metadata).total_blocks == 7
    assert [b.seq for b in stub.StreamKVEvents(wpb.KVEventsRequest(), timeout=5, metadata=metadata)] == [1, 2]


@pytest.mark.parametrize("metadata", [(), ((TOKEN_METADATA_KEY, "wrong"),), ((TOKEN_METADATA_KEY, TOKEN + "x"),),
                                      ((TOKEN_METADATA_KEY, ""),), (("authorization", f"Bearer {TOKEN}"),)],
                         ids=["missing", "wrong", "longer", "empty", "other-key"])
def test_wrong_or_missing_token_is_unauthenticated(stub_and_channel: tuple[wpb_grpc.PrefillWorkerStub, grpc.Channel],
                                                   metadata: tuple[tuple[str, str], ...]) -> None:
    stub, _ = stub_and_channel
    with pytest.raises(grpc.RpcError) as unary:
        stub.GetLoad(wpb.LoadRequest(), timeout=5, metadata=metadata)
    assert unary.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "x-cedserve-token" in (unary.value.details() or "")
    with pytest.raises(grpc.RpcError) as stream:
        list(stub.StreamKVEvents(wpb.KVEventsRequest(), timeout=5, metadata=metadata))
    assert stream.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_and_loopback_drain_need_no_token(stub_and_channel: tuple[wpb_grpc.PrefillWorkerStub, grpc.Channel]) -> None:
    _, channel = stub_and_channel
    health = health_pb2_grpc.HealthStub(channel)  # type: ignore[no-untyped-call]
    assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING
    drain = lifecycle_pb2_grpc.LifecycleStub(channel)  # type: ignore[no-untyped-call]
    assert drain.Drain(lifecycle_pb2.DrainRequest(timeout_s=0.1), timeout=5).drained


def test_unknown_method_stays_unimplemented(stub_and_channel: tuple[wpb_grpc.PrefillWorkerStub, grpc.Channel]) -> None:
    _, channel = stub_and_channel
    call = channel.unary_unary("/cedserve.v1.PrefillWorker/NoSuchMethod")
    assert _code(lambda: call(b"", timeout=5)) == grpc.StatusCode.UNIMPLEMENTED


def test_no_token_configured_means_no_check() -> None:
    server = GrpcServer("127.0.0.1", 0, max_workers=2)
    wpb_grpc.add_PrefillWorkerServicer_to_server(_Prefill(), server.grpc)  # type: ignore[no-untyped-call]
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = wpb_grpc.PrefillWorkerStub(channel)  # type: ignore[no-untyped-call]
            assert stub.GetLoad(wpb.LoadRequest(), timeout=5).total_blocks == 7
    finally:
        server.stop(0)
    with pytest.raises(ValueError, match="empty token"):
        TokenInterceptor("")


def test_serve_config_reads_the_token_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    assert ServeConfig(internal_token_file=str(token_file)).internal_token() == TOKEN
    assert ServeConfig().internal_token() == ""
    with pytest.raises(ValueError, match=r"internal_token_file.*cannot read"):
        ServeConfig(internal_token_file=str(tmp_path / "missing")).internal_token()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match=r"internal_token_file.*empty"):
        ServeConfig(internal_token_file=str(tmp_path / "empty")).internal_token()
