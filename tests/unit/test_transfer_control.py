"""The control plane: token auth on every call, handshake compatibility naming both hashes, Abort.

The service runs on 127.0.0.1 port 0 with a recording handler in place of a NIXL agent (the real
agent behind the same service is exercised in tests/e2e/test_transfer_nixl.py)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from cedserve.kv_transfer.control import ControlClient, ControlServer, check_compatible
from cedserve.kv_transfer.errors import CompatibilityError, FailureCause, HandshakeError
from cedserve.kv_transfer.region import Compatibility, KVLayout, LayoutKind
from cedserve.kv_transfer.wire import compat_from_pb, compat_to_pb
from cedserve.proto import kv_transfer_pb2 as pb
from cedserve.proto import kv_transfer_pb2_grpc as pb_grpc

TOKEN = "s3cret-token"
OURS = KVLayout.raw(4096).compatibility()
OTHER = KVLayout.raw(4096, LayoutKind.PER_LAYER, 2).compatibility()


def hello(name: str, compat: Compatibility) -> pb.HandshakeRequest:
    return pb.HandshakeRequest(initiator=pb.AgentInfo(agent_name=name, compat=compat_to_pb(compat)))


class RecordingHandler:
    def __init__(self, compat: Compatibility) -> None:
        self.compat = compat
        self.aborts: list[tuple[str, FailureCause, str]] = []
        self.handshakes: list[str] = []

    def accept_handshake(self, request: pb.HandshakeRequest) -> pb.AgentInfo:
        initiator = request.initiator
        check_compatible(self.compat, compat_from_pb(initiator.compat), initiator.agent_name)
        self.handshakes.append(initiator.agent_name)
        return pb.AgentInfo(agent_name="decode0", compat=compat_to_pb(self.compat))

    def compatibility(self) -> Compatibility:
        return self.compat

    def active_transfers(self) -> int:
        return 3

    def abort(self, request_id: str, cause: FailureCause = FailureCause.CANCELLED, detail: str = "") -> bool:
        self.aborts.append((request_id, cause, detail))
        return request_id == "live"

    def claim(self, request_id: str, sender_agent: str) -> str:
        return "" if (request_id, sender_agent) == ("live", "prefill0") else f"no reservation {request_id!r}"


@pytest.fixture
def served() -> Iterator[tuple[RecordingHandler, ControlServer]]:
    handler = RecordingHandler(OURS)
    server = ControlServer(handler, "127.0.0.1", 0, TOKEN)
    yield handler, server
    server.stop()


def test_port_zero_binds_and_reports_a_port(served: tuple[RecordingHandler, ControlServer]) -> None:
    _, server = served
    host, port = server.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)])
def test_missing_or_bad_token_is_unauthenticated(served: tuple[RecordingHandler, ControlServer],
                                                 metadata: tuple[tuple[str, str], ...]) -> None:
    handler, server = served
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.KVTransferControlStub(channel)
        for call, request in ((stub.Heartbeat, pb.HeartbeatRequest(agent_name="x")),
                              (stub.Abort, pb.AbortRequest(request_id="live")),
                              (stub.Claim, pb.ClaimRequest(request_id="live", sender_agent="prefill0")),
                              (stub.Handshake, pb.HandshakeRequest())):
            with pytest.raises(grpc.RpcError) as exc:
                call(request, metadata=metadata, timeout=5)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert handler.aborts == [] and handler.handshakes == []


def test_good_token_heartbeat_and_abort(served: tuple[RecordingHandler, ControlServer]) -> None:
    handler, server = served
    client = ControlClient(server.address, TOKEN)
    try:
        assert client.heartbeat("prefill0", 7, timeout_s=5).active_transfers == 3
        assert client.abort("live", FailureCause.CANCELLED, "client went away", "router", timeout_s=5)
        assert not client.abort("gone", FailureCause.CANCELLED, "", "router", timeout_s=5)
    finally:
        client.close()
    assert handler.aborts[0] == ("live", FailureCause.CANCELLED, "client went away")


def test_claim_answers_whether_the_reservation_is_held_for_the_sender(
        served: tuple[RecordingHandler, ControlServer]) -> None:
    _, server = served
    client = ControlClient(server.address, TOKEN)
    try:
        assert client.claim("live", "prefill0", timeout_s=5) == ""
        assert client.claim("ghost", "prefill0", timeout_s=5) == "no reservation 'ghost'"
        assert client.claim("live", "prefill9", timeout_s=5) != ""
    finally:
        client.close()


def test_handshake_accepts_a_compatible_peer(served: tuple[RecordingHandler, ControlServer]) -> None:
    handler, server = served
    client = ControlClient(server.address, TOKEN)
    try:
        info = client.handshake(hello("prefill0", OURS), OURS, 5)
    finally:
        client.close()
    assert info.agent_name == "decode0" and handler.handshakes == ["prefill0"]


def test_handshake_mismatch_names_both_hashes(served: tuple[RecordingHandler, ControlServer]) -> None:
    handler, server = served
    client = ControlClient(server.address, TOKEN)
    try:
        with pytest.raises(CompatibilityError) as exc:
            client.handshake(hello("prefill0", OTHER), OTHER, 5)
    finally:
        client.close()
    text = str(exc.value)
    assert OURS.compat_hash in text and OTHER.compat_hash in text
    assert "layout=per_layer" in text and "layout=cross_layer" in text
    assert handler.handshakes == []


def test_protocol_version_mismatch_is_named() -> None:
    old = Compatibility(OURS.protocol_version + 1, OURS.compat_hash, OURS.description)
    v = OURS.protocol_version
    with pytest.raises(CompatibilityError, match=rf"protocol version mismatch: local v{v} vs peer v{v + 1}"):
        check_compatible(OURS, old, "prefill0")


def test_unreachable_peer_is_a_handshake_error() -> None:
    client = ControlClient("127.0.0.1:1", TOKEN)
    try:
        with pytest.raises(HandshakeError, match="UNAVAILABLE"):
            client.handshake(hello("x", OURS), OURS, 2)
    finally:
        client.close()


def test_server_refuses_to_start_without_a_token() -> None:
    with pytest.raises(ValueError, match="auth_token"):
        ControlServer(RecordingHandler(OURS), "127.0.0.1", 0, "")
