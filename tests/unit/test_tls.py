"""TLS and mTLS on the worker listener (`GrpcServer`) and the KV-transfer control plane, with a
throwaway CA made at test time (tests/conftest.py `tls_files`). Real gRPC on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_transfer_control import OURS, TOKEN, RecordingHandler
from tls_pki import TLSFiles

from cedserve.common.tls import TLSConfig, open_channel
from cedserve.kv_transfer.control import ControlClient, ControlServer
from cedserve.proto import lifecycle_pb2, lifecycle_pb2_grpc
from cedserve.serving.config import ServeConfig
from cedserve.serving.drain import DrainController, add_lifecycle
from cedserve.serving.server import GrpcServer
from cedserve.serving.worker import WorkerOptions


def _server_tls(files: TLSFiles, mtls: bool) -> TLSConfig:
    return TLSConfig(cert=files.server_cert, key=files.server_key, ca=files.ca,
                     require_client_cert=mtls)


def _health(address: str, tls: TLSConfig) -> int:
    with open_channel(address, tls) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return int(reply.status)


@pytest.fixture
def mtls_server(tls_files: TLSFiles) -> Iterator[GrpcServer]:
    server = GrpcServer("127.0.0.1", 0, max_workers=2, tls=_server_tls(tls_files, mtls=True), health_port=0)
    add_lifecycle(server, DrainController(server.health))
    server.health.set_ready(True)
    server.start()
    yield server
    server.stop(0)


def test_config_checks_name_the_field(tls_files: TLSFiles) -> None:
    with pytest.raises(ValueError, match="`cert` and `key`"):
        TLSConfig(cert="a.pem")
    with pytest.raises(ValueError, match="require_client_cert"):
        TLSConfig(require_client_cert=True)
    with pytest.raises(ValueError, match=r"`internal_tls\.key`: cannot read /nonexistent/k\.pem"):
        TLSConfig(cert="/nonexistent/c.pem", key="/nonexistent/k.pem").server_credentials("internal_tls")
    # Flags override single fields of the file's table, and re-validate.
    base = _server_tls(tls_files, mtls=False)
    assert base.override(require_client_cert=True, key=None).require_client_cert
    opts = WorkerOptions(role="prefill", tls_server_name="cedserve-internal")
    assert opts.internal_tls(base).server_name == "cedserve-internal" and opts.internal_tls(base).cert == base.cert


def test_serve_config_reads_both_tables(tmp_path: Path, tls_files: TLSFiles) -> None:
    path = tmp_path / "serve.toml"
    path.write_text(f'[tls]\ncert = "{tls_files.server_cert}"\nkey = "{tls_files.server_key}"\n'
                    f'[internal_tls]\nca = "{tls_files.ca}"\nserver_name = "cedserve-internal"\n')
    serve = ServeConfig.load(path)
    assert serve.tls.cert == tls_files.server_cert and serve.internal_tls.ca == tls_files.ca
    path.write_text('[internal_tls]\nrequire_client_cert = true\n')
    with pytest.raises(ValueError, match="internal_tls"):
        ServeConfig.load(path)


def test_mtls_worker_listener(mtls_server: GrpcServer, tls_files: TLSFiles) -> None:
    ok = TLSConfig(ca=tls_files.ca, cert=tls_files.client_cert, key=tls_files.client_key)
    assert _health(mtls_server.address, ok) == health_pb2.HealthCheckResponse.SERVING
    # Dialed by another name than the certificate's, with the plane's name as the override.
    by_name = TLSConfig(ca=ok.ca, cert=ok.cert, key=ok.key, server_name="cedserve-internal")
    assert _health(f"localhost:{mtls_server.port}", by_name) == health_pb2.HealthCheckResponse.SERVING
    refused = {
        "plaintext": TLSConfig(),
        "unknown CA (system roots)": TLSConfig(cert=ok.cert, key=ok.key),
        "no client certificate": TLSConfig(ca=ok.ca),
    }
    for what, tls in refused.items():
        with pytest.raises(grpc.RpcError) as info:
            _health(mtls_server.address, tls)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, what


def test_health_listener_is_plaintext_and_serves_only_health_and_drain(mtls_server: GrpcServer) -> None:
    address = f"127.0.0.1:{mtls_server.health_port}"
    assert _health(address, TLSConfig()) == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(address) as channel:
        reply = lifecycle_pb2_grpc.LifecycleStub(channel).Drain(lifecycle_pb2.DrainRequest(timeout_s=0.1), timeout=5)
        assert not reply.drained  # nobody finished the drain: the call waited its timeout
        with pytest.raises(grpc.RpcError) as info:  # nothing else is served there
            channel.unary_unary("/cedserve.v1.PrefillWorker/GetLoad")(b"", timeout=5)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert _health(address, TLSConfig()) == health_pb2.HealthCheckResponse.NOT_SERVING  # draining


def test_control_plane_over_mtls(tls_files: TLSFiles) -> None:
    tls = _server_tls(tls_files, mtls=True)
    server = ControlServer(RecordingHandler(OURS), "127.0.0.1", 0, TOKEN, tls=tls)
    try:
        client = ControlClient(server.address, TOKEN, tls)  # a worker dials with its own plane identity
        assert client.heartbeat("prefill0", 7, timeout_s=5).active_transfers == 3
        client.close()
        for what, other in {"plaintext": TLSConfig(), "no client certificate": TLSConfig(ca=tls.ca)}.items():
            bad = ControlClient(server.address, TOKEN, other)
            with pytest.raises(grpc.RpcError) as info:
                bad.heartbeat("prefill0", 1, timeout_s=5)
            bad.close()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, what
    finally:
        server.stop()
