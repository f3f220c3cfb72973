"""Typed errors of the cache. Each carries what a caller needs to decide what to do next."""

from __future__ import annotations


class CacheError(Exception):
    """Base of every cache error."""


class CacheExhaustedError(CacheError):
    """Not enough blocks (free plus evictable) for a request. Retry later or with a shorter prompt;
    nothing of the failed call is left allocated."""

    def __init__(self, request_id: str, needed: int, available: int, what: str = "blocks") -> None:
        self.request_id = request_id
        self.needed = needed
        self.available = available
        super().__init__(f"request {request_id!r}: needs {needed} {what}, only {available} free or evictable; "
                         "retry when requests finish, or raise the pool size")


class SWAPoolExhaustedError(CacheExhaustedError):
    """Every SWA slot is taken: too many requests in flight for this worker's SWA pool."""

    def __init__(self, request_id: str, num_slots: int) -> None:
        super().__init__(request_id, 1, 0, what="SWA slots")
        self.num_slots = num_slots


class UnknownRequestError(CacheError, KeyError):
    """The request id holds no blocks here (never admitted, or already freed)."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"request {request_id!r} holds no cache state on this worker")


class TierIOError(CacheError):
    """A background tier operation (disk write, read, delete) failed. The block was dropped from
    that tier's index (and a BlockRemoved event published); raised from the next `poll()`."""

    def __init__(self, message: str, errors: list[BaseException]) -> None:
        self.errors = errors
        super().__init__(message)


class BlockFileMissingError(CacheError, FileNotFoundError):
    """An indexed disk-tier file is gone (an earlier read rejected it, or someone removed it)."""


class CorruptBlockFileError(CacheError):
    """A disk-tier file failed validation (torn, truncated, wrong checksum or foreign). It is never
    served; the caller drops it and counts it."""

    def __init__(self, path: str, reason: str, foreign: bool = False) -> None:
        self.path = path
        self.reason = reason
        self.foreign = foreign
        super().__init__(f"{path}: {reason}")
