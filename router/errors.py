"""Typed request errors and their gRPC statuses with machine-readable details.

INVALID_ARGUMENT carries a google.rpc.BadRequest naming the field; RESOURCE_EXHAUSTED and
UNAVAILABLE carry a google.rpc.RetryInfo. Clients in any language read them from the standard
`grpc-status-details-bin` trailer.
"""

from __future__ import annotations

import grpc
from google.protobuf import duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

ADMISSION = "admission"
"""`RequestError.reason`: the request's effort class is full (admission control)."""
NO_CAPACITY = "no_capacity"
"""`RequestError.reason`: no decode worker could ever hold the request (placement)."""
CAPACITY_WAIT = "capacity_wait"
"""`RequestError.reason`: no decode worker had room for the request within its class's
`capacity_wait_s` (router/capacity.py)."""
TOKENIZE_QUEUE = "tokenize_queue"
"""`RequestError.reason`: too many large prompts wait for the tokenize pool (router/tokenize_pool.py)."""
UNPLACEABLE = frozenset({NO_CAPACITY, CAPACITY_WAIT})
"""Reasons that say no worker can take the request (HTTP 503), where the others say a limit of the
router's was reached (HTTP 429)."""


class RequestError(Exception):
    """A request the router refuses or cannot finish; `code` is the gRPC status to return, `reason`
    (one of the constants above, or "") tells apart causes that share a code, for APIs whose statuses
    do (HTTP: 429 for a full class, 503 when no worker can take the request: `UNPLACEABLE`) and for
    `cedserve_router_refusals_total`."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str = "", retry_after_s: float = 0.0,
                 request_id: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.code = code
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s
        self.request_id = request_id

    def to_status(self) -> grpc.Status:
        detail = status_pb2.Status(code=_CODES[self.code], message=self.message)
        if self.field:
            bad = error_details_pb2.BadRequest(field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=self.field, description=self.message)])
            detail.details.add().Pack(bad)
        if self.retry_after_s > 0:
            delay = duration_pb2.Duration()
            delay.FromMilliseconds(int(self.retry_after_s * 1000))
            detail.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
        return rpc_status.to_status(detail)


def invalid(field: str, message: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}", field=field)


def field_of(status: grpc.Status | None) -> str:
    """The first field violation named in a status's details ('' when none)."""
    if status is None:
        return ""
    for trailer_key, value in status.trailing_metadata:
        if trailer_key == "grpc-status-details-bin" and isinstance(value, bytes):
            rich = status_pb2.Status.FromString(value)
            for any_detail in rich.details:
                bad = error_details_pb2.BadRequest()
                if any_detail.Unpack(bad) and bad.field_violations:
                    return str(bad.field_violations[0].field)
    return ""


_CODES: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: code_pb2.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: code_pb2.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED: code_pb2.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE: code_pb2.UNAVAILABLE,
    grpc.StatusCode.CANCELLED: code_pb2.CANCELLED,
    grpc.StatusCode.NOT_FOUND: code_pb2.NOT_FOUND,
    grpc.StatusCode.UNAUTHENTICATED: code_pb2.UNAUTHENTICATED,
    grpc.StatusCode.INTERNAL: code_pb2.INTERNAL,
}
