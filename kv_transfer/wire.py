"""Conversions between the transfer layer's Python types and `cedserve.v1` protobuf messages.

Bytes from a peer are only ever parsed as protobuf (`TransferNotice.FromString`); a message that
does not parse, or carries another protocol version, is rejected here with `ValueError`.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from cedserve.kv_transfer.errors import FailureCause
from cedserve.kv_transfer.protocol import Reservation, TransferMode
from cedserve.kv_transfer.region import PROTOCOL_VERSION, Compatibility
from cedserve.proto import kv_transfer_pb2 as pb

_CAUSE_TO_PB: dict[FailureCause, pb.FailureCause] = {
    FailureCause.CANCELLED: pb.FAILURE_CAUSE_CANCELLED,
    FailureCause.DEADLINE: pb.FAILURE_CAUSE_DEADLINE,
    FailureCause.PEER_DISCONNECTED: pb.FAILURE_CAUSE_PEER_DISCONNECTED,
    FailureCause.PEER_SILENT: pb.FAILURE_CAUSE_PEER_SILENT,
    FailureCause.TRANSFER_ERROR: pb.FAILURE_CAUSE_TRANSFER_ERROR,
    FailureCause.PEER_ABORTED: pb.FAILURE_CAUSE_PEER_ABORTED,
    FailureCause.INVALID: pb.FAILURE_CAUSE_INVALID,
    FailureCause.SHUTDOWN: pb.FAILURE_CAUSE_SHUTDOWN,
}
_CAUSE_FROM_PB: dict[int, FailureCause] = {v: k for k, v in _CAUSE_TO_PB.items()}
_MODE_TO_PB: dict[TransferMode, pb.TransferMode] = {TransferMode.WRITE: pb.TRANSFER_MODE_WRITE,
                                        TransferMode.READ: pb.TRANSFER_MODE_READ}
_MODE_FROM_PB: dict[int, TransferMode] = {v: k for k, v in _MODE_TO_PB.items()}


def cause_to_pb(cause: FailureCause) -> pb.FailureCause:
    return _CAUSE_TO_PB[cause]


def cause_from_pb(value: int) -> FailureCause:
    """Unknown or unset causes read as INVALID rather than failing the caller."""
    return _CAUSE_FROM_PB.get(int(value), FailureCause.INVALID)


def compat_to_pb(c: Compatibility) -> pb.Compatibility:
    return pb.Compatibility(protocol_version=c.protocol_version, compat_hash=c.compat_hash,
                            description=c.description)


def compat_from_pb(m: pb.Compatibility) -> Compatibility:
    return Compatibility(m.protocol_version, m.compat_hash, m.description)


def reservation_to_pb(r: Reservation) -> pb.Reservation:
    return pb.Reservation(request_id=r.request_id, receiver_agent=r.receiver, sender_agent=r.sender,
                          block_ids=list(r.block_ids), mode=_MODE_TO_PB[r.mode],
                          staging_slots=list(r.staging_slots), lease_s=r.lease_s,
                          compat_hash=r.compat_hash)


def reservation_from_pb(m: pb.Reservation) -> Reservation:
    if m.mode not in _MODE_FROM_PB:
        raise ValueError(f"reservation {m.request_id!r}: field `mode` is unset or unknown ({m.mode})")
    if not m.request_id:
        raise ValueError("reservation: field `request_id` is empty")
    return Reservation(request_id=m.request_id, receiver=m.receiver_agent, sender=m.sender_agent,
                       block_ids=tuple(m.block_ids), mode=_MODE_FROM_PB[m.mode],
                       staging_slots=tuple(m.staging_slots), lease_s=m.lease_s, compat_hash=m.compat_hash)


def encode_notice(request_id: str, **body: object) -> bytes:
    """Serialize a `TransferNotice` with exactly one body field, e.g. `chunk_done=pb.ChunkDone(...)`."""
    return pb.TransferNotice(protocol_version=PROTOCOL_VERSION, request_id=request_id,
                             **body).SerializeToString()  # type: ignore[arg-type]


def decode_notice(data: bytes) -> pb.TransferNotice:
    """Parse a peer's notification; `ValueError` if it is not one of ours."""
    try:
        notice = pb.TransferNotice.FromString(data)
    except DecodeError as exc:
        raise ValueError(f"undecodable transfer notification ({len(data)} bytes): {exc}") from None
    if notice.protocol_version != PROTOCOL_VERSION:
        raise ValueError(f"transfer notification of protocol v{notice.protocol_version}, "
                         f"expected v{PROTOCOL_VERSION}")
    if notice.WhichOneof("body") is None:
        raise ValueError("transfer notification without a body")
    return notice
