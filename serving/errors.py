"""Request-level errors on the wire: the one place the engines' domain errors meet gRPC.

Engines raise the domain errors of `cedserve.common.errors` (`ServingError` and its subclasses, each
of an `ErrorKind`) and know nothing of the wire. `error_detail(exc, request_id)` maps one (and the
cache's and transfer layer's typed errors) to an `ErrorDetail`, `wire_code(kind)` gives a kind's
`ErrorCode`, `status_code` the gRPC status; `abort(context, detail)` ends a unary call with it,
`fail_stream(context, detail)` sets it as a stream's final status. Both attach the serialized
`ErrorDetail` as trailing metadata `cedserve-error-bin`, which `detail_from_rpc_error(err)` reads back
on the client; `error_from_wire` turns a peer's detail back into a domain error.
"""

from __future__ import annotations

from typing import Any

import grpc

from cedserve.common.errors import ERRORS, ErrorKind, ServingError
from cedserve.kv_transfer.errors import FailureCause, KVTransferError
from cedserve.model.cache.errors import CacheExhaustedError, UnknownRequestError
from cedserve.proto import worker_pb2 as wpb

ERROR_METADATA_KEY = "cedserve-error-bin"
DEFAULT_RETRY_AFTER_MS = 500


_WIRE_CODES: dict[ErrorKind, wpb.ErrorCode] = {
    ErrorKind.INVALID_ARGUMENT: wpb.ERROR_CODE_INVALID_ARGUMENT,
    ErrorKind.RESOURCE_EXHAUSTED: wpb.ERROR_CODE_RESOURCE_EXHAUSTED,
    ErrorKind.DEADLINE_EXCEEDED: wpb.ERROR_CODE_DEADLINE_EXCEEDED,
    ErrorKind.UNAVAILABLE: wpb.ERROR_CODE_UNAVAILABLE,
    ErrorKind.CANCELLED: wpb.ERROR_CODE_CANCELLED,
    ErrorKind.NOT_FOUND: wpb.ERROR_CODE_NOT_FOUND,
    ErrorKind.INTERNAL: wpb.ERROR_CODE_INTERNAL,
    ErrorKind.TRANSFER_FAILED: wpb.ERROR_CODE_TRANSFER_FAILED,
}
"""The wire's `ErrorCode` of each domain `ErrorKind` (`cedserve.common.errors`): the one place they meet."""


def wire_code(kind: ErrorKind) -> wpb.ErrorCode:
    """The `cedserve.v1.ErrorCode` of a domain error kind."""
    return _WIRE_CODES[kind]


def error_from_wire(detail: wpb.ErrorDetail, message: str) -> ServingError:
    """The domain error of a peer's `ErrorDetail` (UNSPECIFIED: INTERNAL), carrying `message`."""
    kind = next((k for k, code in _WIRE_CODES.items() if code == detail.code), ErrorKind.INTERNAL)
    return ERRORS[kind](message, field=detail.field, retry_after_ms=detail.retry_after_ms,
                        request_id=detail.request_id)


_STATUS: dict[wpb.ErrorCode, grpc.StatusCode] = {
    wpb.ERROR_CODE_UNSPECIFIED: grpc.StatusCode.UNKNOWN,
    wpb.ERROR_CODE_INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    wpb.ERROR_CODE_RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    wpb.ERROR_CODE_DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    wpb.ERROR_CODE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    wpb.ERROR_CODE_CANCELLED: grpc.StatusCode.CANCELLED,
    wpb.ERROR_CODE_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    wpb.ERROR_CODE_INTERNAL: grpc.StatusCode.INTERNAL,
    wpb.ERROR_CODE_TRANSFER_FAILED: grpc.StatusCode.UNAVAILABLE,
}

_TRANSFER_KINDS: dict[FailureCause, ErrorKind] = {
    FailureCause.CANCELLED: ErrorKind.CANCELLED,
    FailureCause.DEADLINE: ErrorKind.DEADLINE_EXCEEDED,
    FailureCause.INVALID: ErrorKind.NOT_FOUND,
    FailureCause.SHUTDOWN: ErrorKind.UNAVAILABLE,
}


def error_kind(exc: BaseException) -> ErrorKind:
    """The domain kind of an engine's error (the cache's and the transfer layer's included); anything
    unknown is INTERNAL."""
    if isinstance(exc, ServingError):
        return exc.kind
    if isinstance(exc, CacheExhaustedError):
        return ErrorKind.RESOURCE_EXHAUSTED
    if isinstance(exc, KVTransferError):
        return _TRANSFER_KINDS.get(exc.cause, ErrorKind.TRANSFER_FAILED)
    if isinstance(exc, UnknownRequestError):
        return ErrorKind.NOT_FOUND
    return ErrorKind.INTERNAL


def error_detail(exc: BaseException, request_id: str = "") -> wpb.ErrorDetail:
    """The `ErrorDetail` for an engine's error (`error_kind`); an unknown one keeps its type's name."""
    kind = error_kind(exc)
    own_id = exc.request_id if isinstance(exc, ServingError | CacheExhaustedError | KVTransferError) else ""
    detail = wpb.ErrorDetail(code=wire_code(kind), message=str(exc), request_id=own_id or request_id)
    if isinstance(exc, ServingError):
        detail.field, detail.retry_after_ms = exc.field, exc.retry_after_ms
    elif isinstance(exc, CacheExhaustedError):
        detail.retry_after_ms = DEFAULT_RETRY_AFTER_MS
    elif kind is ErrorKind.INTERNAL:
        detail.message = f"{type(exc).__name__}: {exc}"
    return detail


def status_code(code: wpb.ErrorCode) -> grpc.StatusCode:
    """gRPC status for an `ErrorCode` value."""
    return _STATUS.get(code, grpc.StatusCode.UNKNOWN)


def _status_text(detail: wpb.ErrorDetail) -> str:
    where = f" (field `{detail.field}`)" if detail.field else ""
    return f"{detail.message}{where}"


def fail_stream(context: grpc.ServicerContext, detail: wpb.ErrorDetail) -> None:
    """Make `detail` the final status of a server stream (the handler then returns normally)."""
    context.set_trailing_metadata(((ERROR_METADATA_KEY, detail.SerializeToString()),))
    context.set_code(status_code(detail.code))
    context.set_details(_status_text(detail))


def abort(context: grpc.ServicerContext, detail: wpb.ErrorDetail) -> None:
    """End a unary call with `detail` (raises, as `context.abort` does)."""
    context.set_trailing_metadata(((ERROR_METADATA_KEY, detail.SerializeToString()),))
    context.abort(status_code(detail.code), _status_text(detail))


def detail_from_rpc_error(err: grpc.RpcError) -> wpb.ErrorDetail | None:
    """The `ErrorDetail` a cedserve server attached to a failed call, if any."""
    trailing: Any = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == ERROR_METADATA_KEY and isinstance(value, bytes):
            return wpb.ErrorDetail.FromString(value)
    return None
