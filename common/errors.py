"""Domain errors of the serving engines: what went wrong with a request, in the engines' own terms.

Engines (prefill, decode, the decode worker's leases) raise these or report their `ErrorKind`; they
never build wire messages or gRPC statuses. The service layer alone maps them
(`cedserve.serving.error_detail`, `wire_code`, `status_code`) to a `cedserve.v1.ErrorCode` in an
`ErrorDetail` and a gRPC status. This module imports nothing: engines, messages between ranks and
tests can use it without gRPC or the protobuf code.
"""

from __future__ import annotations

from enum import Enum


class ErrorKind(str, Enum):
    """The closed set of request failures the router acts on (retry elsewhere, fail the call...)."""

    INVALID_ARGUMENT = "invalid_argument"
    """A field is wrong: the error's `field` names it."""
    RESOURCE_EXHAUSTED = "resource_exhausted"
    """No blocks, queue full: `retry_after_ms` says when to retry."""
    DEADLINE_EXCEEDED = "deadline_exceeded"
    UNAVAILABLE = "unavailable"
    """Draining, peer gone, handed back: retry on another worker."""
    CANCELLED = "cancelled"
    NOT_FOUND = "not_found"
    """Unknown lease or request id."""
    INTERNAL = "internal"
    TRANSFER_FAILED = "transfer_failed"
    """The KV transfer failed: the message carries the cause."""


class ServingError(Exception):
    """A request-level failure of `kind`. `field` names the offending request field for
    INVALID_ARGUMENT (e.g. "token_ids[3]")."""

    kind: ErrorKind = ErrorKind.INTERNAL

    def __init__(self, message: str, *, field: str = "", retry_after_ms: int = 0, request_id: str = "") -> None:
        self.field = field
        self.retry_after_ms = retry_after_ms
        self.request_id = request_id
        super().__init__(message)


class InvalidArgumentError(ServingError):
    kind = ErrorKind.INVALID_ARGUMENT


class ResourceExhaustedError(ServingError):
    kind = ErrorKind.RESOURCE_EXHAUSTED


class DeadlineExceededError(ServingError):
    kind = ErrorKind.DEADLINE_EXCEEDED


class UnavailableError(ServingError):
    kind = ErrorKind.UNAVAILABLE


class CancelledError(ServingError):
    kind = ErrorKind.CANCELLED


class NotFoundError(ServingError):
    kind = ErrorKind.NOT_FOUND


class TransferFailedError(ServingError):
    kind = ErrorKind.TRANSFER_FAILED


ERRORS: dict[ErrorKind, type[ServingError]] = {
    cls.kind: cls for cls in (ServingError, InvalidArgumentError, ResourceExhaustedError, DeadlineExceededError,
                              UnavailableError, CancelledError, NotFoundError, TransferFailedError)}
"""The error class of each kind (INTERNAL: the base class)."""
