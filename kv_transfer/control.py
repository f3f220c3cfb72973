"""The authenticated control plane: a small gRPC service (`cedserve.v1.KVTransferControl`).

Handshake exchanges `AgentInfo` (NIXL's own metadata blob, region addresses, compatibility) both
ways; Heartbeat answers liveness probes; Abort cancels a transfer by request id; Claim lets a sender
check, before its first write, that the receiver holds the reservation for it. Every call carries
`authorization: Bearer <token>`; the server compares it with `hmac.compare_digest` and answers
UNAUTHENTICATED to a missing or wrong one before any handler runs. With `KVTransferConfig.tls` (the
worker's `[internal_tls]`) enabled, the service serves only TLS (mTLS with `require_client_cert`) and
clients dial TLS with the same certificates. Addresses come from config; port 0 binds a free port,
reported as `ControlServer.address`.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from concurrent import futures
from typing import Any, Protocol

import grpc

from cedserve.common.tls import PLAINTEXT, TLSConfig, add_port, open_channel
from cedserve.kv_transfer.errors import CompatibilityError, FailureCause, HandshakeError
from cedserve.kv_transfer.region import Compatibility
from cedserve.kv_transfer.wire import cause_from_pb, cause_to_pb, compat_from_pb
from cedserve.proto import kv_transfer_pb2 as pb
from cedserve.proto import kv_transfer_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

AUTH_METADATA_KEY = "authorization"
_PEER_VERSION_KEY = "cedserve-peer-protocol-version"
_PEER_HASH_KEY = "cedserve-peer-compat-hash"
_PEER_DESC_KEY = "cedserve-peer-compat-description"


def check_compatible(local: Compatibility, peer: Compatibility, peer_name: str) -> None:
    """`CompatibilityError` naming both values unless version and hash agree; for a hash mismatch,
    the description fields that differ come first (e.g. `weights: float32 vs bfloat16` when the two
    workers were started with different `[model] dtype`)."""
    if local.protocol_version != peer.protocol_version:
        raise CompatibilityError("protocol version", f"v{local.protocol_version}", f"v{peer.protocol_version}",
                                 peer_name)
    if local.compat_hash != peer.compat_hash:
        differing = differing_fields(local.description, peer.description)
        what = "compatibility hash" + (f" ({differing})" if differing else "")
        raise CompatibilityError(what, f"{local.compat_hash} [{local.description}]",
                                 f"{peer.compat_hash} [{peer.description}]", peer_name)


def differing_fields(local: str, peer: str) -> str:
    """`key: local vs peer` for each `key=value` field of two compatibility descriptions that differs,
    joined by "; " ("" when none can be named)."""
    def fields(description: str) -> dict[str, str]:
        return dict(part.split("=", 1) for part in description.split() if "=" in part)

    mine, theirs = fields(local), fields(peer)
    keys = [k for k in mine if mine[k] != theirs.get(k)] + [k for k in theirs if k not in mine]
    return "; ".join(f"{k}: {mine.get(k, '-')} vs {theirs.get(k, '-')}" for k in keys)


class ControlHandler(Protocol):
    """What the service needs from the agent behind it."""

    def accept_handshake(self, request: pb.HandshakeRequest) -> pb.AgentInfo:
        """Check compatibility (raise `CompatibilityError`), add the peer (or keep the connection we
        hold with it, see `NixlEngine.add_peer`), return our own info."""
        ...

    def compatibility(self) -> Compatibility: ...

    def active_transfers(self) -> int: ...

    def abort(self, request_id: str, cause: FailureCause = FailureCause.CANCELLED, detail: str = "") -> bool: ...

    def claim(self, request_id: str, sender_agent: str) -> str:
        """"" when this agent holds an open reservation `request_id` for `sender_agent`, else why not."""
        ...


def _deny(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid control-plane token")


class _TokenAuth(grpc.ServerInterceptor):  # type: ignore[misc]  # grpc ships no type stubs
    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()
        self._denied = grpc.unary_unary_rpc_method_handler(_deny)

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        presented = ""
        for key, value in details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                presented = value if isinstance(value, str) else value.decode(errors="replace")
        if hmac.compare_digest(presented.encode(), self._expected):
            return continuation(details)
        return self._denied


class _Servicer(pb_grpc.KVTransferControlServicer):
    def __init__(self, handler: ControlHandler) -> None:
        self._handler = handler

    def Handshake(self, request: pb.HandshakeRequest, context: grpc.ServicerContext) -> pb.HandshakeResponse:
        try:
            info = self._handler.accept_handshake(request)
        except CompatibilityError as exc:
            own = self._handler.compatibility()
            context.set_trailing_metadata(((_PEER_VERSION_KEY, str(own.protocol_version)),
                                           (_PEER_HASH_KEY, own.compat_hash),
                                           (_PEER_DESC_KEY, own.description)))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (ConnectionError, RuntimeError) as exc:  # NIXL could not load the peer
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return pb.HandshakeResponse(responder=info)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        return pb.HeartbeatResponse(agent_name=request.agent_name, seq=request.seq,
                                    active_transfers=self._handler.active_transfers())

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        if not request.request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "field `request_id` is empty")
        cause = cause_from_pb(request.cause) if request.cause else FailureCause.CANCELLED
        detail = request.detail or f"abort requested by {request.agent_name or 'control plane'}"
        return pb.AbortResponse(found=self._handler.abort(request.request_id, cause, detail))

    def Claim(self, request: pb.ClaimRequest, context: grpc.ServicerContext) -> pb.ClaimResponse:
        problem = self._handler.claim(request.request_id, request.sender_agent)
        return pb.ClaimResponse(found=not problem, detail=problem)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class ControlServer:
    """The service bound to `host:port` (port 0: a free one, see `address`)."""

    def __init__(self, handler: ControlHandler, host: str, port: int, token: str, max_workers: int = 4,
                 tls: TLSConfig = PLAINTEXT) -> None:
        if not token:
            raise ValueError("config field `kv_transfer.auth_token`: must be set; the control plane "
                             "grants access to the block pool")
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                              thread_name_prefix="kv-control"),
                                   interceptors=[_TokenAuth(token)])
        # The generated gRPC module is untyped (grpc_tools makes no stubs for it).
        pb_grpc.add_KVTransferControlServicer_to_server(  # type: ignore[no-untyped-call]
            _Servicer(handler), self._server)
        bound = add_port(self._server, format_address(host, port), tls, "internal_tls")
        if bound == 0:
            raise OSError(f"KV transfer control plane could not bind {format_address(host, port)}")
        self.address = format_address(host, bound)
        self._server.start()

    def stop(self, grace_s: float = 0.5) -> None:
        self._server.stop(grace_s).wait()


class ControlClient:
    """Calls to one peer's control service, each with the auth token."""

    def __init__(self, address: str, token: str, tls: TLSConfig = PLAINTEXT) -> None:
        self.address = address
        self._channel = open_channel(address, tls)
        self._stub = pb_grpc.KVTransferControlStub(self._channel)  # type: ignore[no-untyped-call]
        self._metadata = ((AUTH_METADATA_KEY, f"Bearer {token}"),)

    def handshake(self, request: pb.HandshakeRequest, local: Compatibility, timeout_s: float) -> pb.AgentInfo:
        """Send our info (`request.initiator`), get the peer's. Raises `CompatibilityError` (both
        values named, whichever side noticed) or `HandshakeError`."""
        try:
            reply = self._stub.Handshake(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                trailing = dict(exc.trailing_metadata() or ())
                peer = Compatibility(int(trailing.get(_PEER_VERSION_KEY, "0")),
                                     str(trailing.get(_PEER_HASH_KEY, "?")),
                                     str(trailing.get(_PEER_DESC_KEY, "?")))
                check_compatible(local, peer, self.address)
            raise HandshakeError(f"KV transfer handshake with {self.address} failed: "
                                 f"{exc.code().name}: {exc.details()}") from None
        responder: pb.AgentInfo = reply.responder
        check_compatible(local, compat_from_pb(responder.compat), responder.agent_name)
        return responder

    def heartbeat(self, agent_name: str, seq: int, timeout_s: float) -> pb.HeartbeatResponse:
        reply: pb.HeartbeatResponse = self._stub.Heartbeat(
            pb.HeartbeatRequest(agent_name=agent_name, seq=seq), timeout=timeout_s, metadata=self._metadata)
        return reply

    def abort(self, request_id: str, cause: FailureCause, detail: str, agent_name: str,
              timeout_s: float = 2.0) -> bool:
        reply = self._stub.Abort(pb.AbortRequest(request_id=request_id, cause=cause_to_pb(cause),
                                                 detail=detail, agent_name=agent_name),
                                 timeout=timeout_s, metadata=self._metadata)
        return bool(reply.found)

    def claim(self, request_id: str, sender_agent: str, timeout_s: float) -> str:
        """"" when the peer holds the reservation for us, else its reason. `grpc.RpcError` when the
        peer cannot be asked."""
        reply = self._stub.Claim(pb.ClaimRequest(request_id=request_id, sender_agent=sender_agent),
                                 timeout=timeout_s, metadata=self._metadata)
        return "" if reply.found else (reply.detail or "unknown reservation")

    def close(self) -> None:
        self._channel.close()
