"""Leases: blocks reserved for a request before its Decode call, and the KV transfer into them.

Reserve admits the prompt into the cache manager (leading blocks this rank already caches are shared,
the rest are fresh), registers a kv_transfer reservation for the fresh ones with the named sender, and
answers with both. A lease that asks for the bounded decode state (`ship_state`) also holds scratch
blocks for it, reserved after the KV blocks in the same transfer; they are freed once the state is read
(or with the lease). The transfer's `on_finish` runs on the transfer thread: it only queues the result,
which `poll` applies on the engine thread. A lease ends in exactly one of three ways: its Decode call
takes it over (`take`), it is cancelled, or its deadline passes unattached. Blocks return to the pool
only once the transfer no longer touches them (after `on_finish`), as the transfer contract requires.

Two clocks bound an unattached lease. Its own deadline is short (`decode.lease_ms`, 4 s) and moves
forward each time its router renews it (`renew`, from the `Renew` call the router sends every
quarter lease while it waits on the lease): a live router keeps a slow request's blocks, a dead
router's come back within one lease. The KV transfer into it has a longer, fixed deadline
(`decode.transfer_timeout_ms`, counted from the Reserve and sent to the sender with the
reservation): it bounds a transfer stuck while its router still renews, and it is never what frees
a lost router's blocks (an expired lease aborts its transfer).
"""

from __future__ import annotations

import logging
import queue
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from cedserve.common.errors import ErrorKind
from cedserve.decode_workers.messages import Failed, ReserveCommand, Reserved
from cedserve.decode_workers.metrics import DecodeMetrics
from cedserve.decode_workers.sequence import Lease
from cedserve.kv_transfer.errors import FailureCause, KVTransferError
from cedserve.kv_transfer.protocol import KVReceiver, TransferEndpoint
from cedserve.kv_transfer.state import TransferResult, TransferState
from cedserve.kv_transfer.wire import reservation_to_pb
from cedserve.model.cache.errors import CacheExhaustedError
from cedserve.model.cache.manager import KVCacheManager, state_owner

log = logging.getLogger(__name__)

RETRY_AFTER_MS = 200


class LeaseError(Exception):
    """A Reserve that cannot be granted, of a domain `ErrorKind` (the service maps it to the wire)."""

    def __init__(self, kind: ErrorKind, message: str, field: str = "", retry_after_ms: int = 0) -> None:
        super().__init__(message)
        self.kind, self.field, self.retry_after_ms = kind, field, retry_after_ms

    def failed(self, request_id: str, lease_id: str = "") -> Failed:
        return Failed(request_id, self.kind, str(self), self.field, self.retry_after_ms, lease_id)


def new_lease_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class StateRoomPolicy:
    """How this rank receives shipped bounded state."""

    default: bool
    """Leases ask for it unless the Reserve call says otherwise (`decode.ship_state`)."""
    num_blocks: int
    """Scratch blocks one state needs at most (`state_format.max_state_bytes` / block bytes)."""
    taps: bool
    """Ask for the DSpark taps (this rank drafts)."""


class LeaseBook:
    """Every lease of one rank. Engine thread only, except `_on_finish` (any thread)."""

    def __init__(self, cache: KVCacheManager, endpoint: TransferEndpoint | None, metrics: DecodeMetrics,
                 headroom_blocks: int, clock: Callable[[], float] = time.monotonic,
                 state_room: StateRoomPolicy | None = None, transfer_timeout_s: float = 30.0) -> None:
        self.cache = cache
        self.state_room = state_room or StateRoomPolicy(False, 0, False)
        self.endpoint = endpoint
        self.receiver: KVReceiver | None = endpoint.receiver() if endpoint is not None else None
        self.metrics = metrics
        self.headroom_blocks = headroom_blocks
        self.transfer_timeout_s = transfer_timeout_s
        self.clock = clock
        self.leases: dict[str, Lease] = {}
        self.by_request: dict[str, str] = {}
        self._results: queue.SimpleQueue[TransferResult] = queue.SimpleQueue()
        self.on_result: Callable[[], None] = _nothing
        """Called on the transfer thread after a result is queued: the engine loop's wake-up
        (`CommandInbox.wake`), so an idle loop applies it now rather than after `idle_wait_s`."""

    # ------------------------------------------------------------------ grant

    def reserve(self, cmd: ReserveCommand, agent_name: str, control_address: str) -> Reserved:
        """Admit the prompt and register its transfer; `LeaseError` leaves nothing behind."""
        self._validate(cmd)
        lease = self._admit(cmd)
        try:
            self._hold_state_room(cmd, lease)
            reservation = self._open_transfer(cmd, lease)
        except LeaseError:
            self.free_state(lease)
            self.cache.free(cmd.request_id)
            raise
        self.leases[lease.lease_id] = lease
        self.by_request[cmd.request_id] = lease.lease_id
        self.metrics.leases.inc()
        deadline_ms = int((time.time() + cmd.lease_ms / 1000) * 1000)
        return Reserved(cmd.request_id, lease.lease_id, agent_name, control_address, tuple(lease.block_ids),
                        lease.num_cached_blocks, deadline_ms, reservation, len(lease.state_block_ids),
                        lease.state_taps)

    def _validate(self, cmd: ReserveCommand) -> None:
        if not cmd.request_id:
            raise LeaseError(ErrorKind.INVALID_ARGUMENT, "request_id is empty", "request_id")
        earlier = self.lease_of(cmd.request_id)
        if earlier is not None and earlier.cancelled:
            # The router retries a failed attempt under the same request id; the cancelled lease of the
            # attempt before lets its blocks go once its transfer has (`poll`): no room yet, not a misuse.
            raise LeaseError(ErrorKind.RESOURCE_EXHAUSTED, f"request {cmd.request_id!r}: its earlier lease "
                             f"{earlier.lease_id} is still being released here", retry_after_ms=RETRY_AFTER_MS)
        if cmd.request_id in self.by_request or cmd.request_id in self.cache:
            raise LeaseError(ErrorKind.INVALID_ARGUMENT, f"request {cmd.request_id!r} already holds a lease "
                             "or runs here", "request_id")
        if cmd.prompt_tokens <= 0:
            raise LeaseError(ErrorKind.INVALID_ARGUMENT, "prompt_tokens must be positive", "prompt_tokens")
        if cmd.token_ids and len(cmd.token_ids) != cmd.prompt_tokens:
            raise LeaseError(ErrorKind.INVALID_ARGUMENT, f"{len(cmd.token_ids)} token ids for "
                             f"prompt_tokens={cmd.prompt_tokens}", "token_ids")
        if cmd.sender_agent and self.receiver is None:
            raise LeaseError(ErrorKind.UNAVAILABLE, "this worker has no KV transfer agent", "sender_agent")

    def _admit(self, cmd: ReserveCommand) -> Lease:
        # Without the prompt, admit placeholders under a salt nobody else uses: nothing can hit, and the
        # lease is never offered to the prefix cache (`cacheable`).
        cacheable = bool(cmd.token_ids)
        tokens = list(cmd.token_ids) if cacheable else [0] * cmd.prompt_tokens
        salt = cmd.cache_salt if cacheable else f"uncached/{cmd.lease_id}"
        try:
            adm = self.cache.admit(cmd.request_id, tokens, salt)
        except CacheExhaustedError as exc:
            raise LeaseError(ErrorKind.RESOURCE_EXHAUSTED, str(exc), retry_after_ms=RETRY_AFTER_MS) from None
        if self.available_blocks() < self.headroom_blocks:
            self.cache.free(cmd.request_id)
            raise LeaseError(ErrorKind.RESOURCE_EXHAUSTED, f"request {cmd.request_id!r}: granting it would "
                             f"leave fewer than {self.headroom_blocks} blocks for running requests",
                             retry_after_ms=RETRY_AFTER_MS)
        self.cache.finish_onload(cmd.request_id)
        cached = adm.num_cached_tokens // self.cache.block_size
        return Lease(cmd.lease_id, cmd.request_id, list(adm.block_ids), cached,
                     self.clock() + cmd.lease_ms / 1000, cacheable, cmd.prompt_tokens)

    def _hold_state_room(self, cmd: ReserveCommand, lease: Lease) -> None:
        """Scratch blocks for the shipped bounded state, when this lease asks for it."""
        policy = self.state_room
        wanted = policy.default if cmd.ship_state is None else cmd.ship_state
        if not wanted or not cmd.sender_agent or policy.num_blocks == 0:
            return
        try:
            lease.state_block_ids = self.cache.allocate_scratch(state_owner(cmd.request_id), policy.num_blocks)
        except CacheExhaustedError as exc:
            raise LeaseError(ErrorKind.RESOURCE_EXHAUSTED, str(exc), retry_after_ms=RETRY_AFTER_MS) from None
        lease.state_taps = policy.taps

    def free_state(self, lease: Lease) -> None:
        """Return the lease's state scratch blocks (idempotent)."""
        if lease.state_block_ids:
            self.cache.free(state_owner(lease.request_id))
            lease.state_block_ids = []

    def _open_transfer(self, cmd: ReserveCommand, lease: Lease) -> bytes:
        if not cmd.sender_agent or self.receiver is None or self.endpoint is None:
            return b""
        self._connect(cmd)
        try:
            blocks = [*lease.block_ids[lease.num_cached_blocks:], *lease.state_block_ids]
            reservation = self.receiver.reserve(lease.lease_id, blocks, sender=cmd.sender_agent,
                                                lease_s=max(cmd.lease_ms / 1000, self.transfer_timeout_s),
                                                on_finish=self._finished)
        except ValueError as exc:
            raise LeaseError(ErrorKind.UNAVAILABLE, f"cannot receive from {cmd.sender_agent!r}: {exc}",
                             "sender_agent") from None
        except KVTransferError as exc:
            if exc.cause is not FailureCause.PEER_DISCONNECTED:
                raise
            # declared dead between `_connect` and here: the next Reserve reconnects
            raise LeaseError(ErrorKind.UNAVAILABLE, f"cannot receive from {cmd.sender_agent!r}: {exc}",
                             "sender_agent", retry_after_ms=RETRY_AFTER_MS) from None
        lease.transfer_open = True
        return bytes(reservation_to_pb(reservation).SerializeToString())

    def _connect(self, cmd: ReserveCommand) -> None:
        """Handshake with the sender unless it is a live peer (once per connection: a peer declared dead
        is reconnected here; the agent keeps a connection that a second handshake finds alive)."""
        assert self.endpoint is not None
        peers = getattr(self.endpoint, "peers", None)
        if callable(peers) and peers().get(cmd.sender_agent):
            return
        if not cmd.sender_control_address:
            if callable(peers):
                raise LeaseError(ErrorKind.INVALID_ARGUMENT, f"sender {cmd.sender_agent!r} is not connected "
                                 "and no sender_control_address was given", "sender_control_address")
            return
        try:
            self.endpoint.handshake(cmd.sender_control_address)
        except (ConnectionError, ValueError) as exc:
            raise LeaseError(ErrorKind.UNAVAILABLE, f"handshake with {cmd.sender_agent!r} at "
                             f"{cmd.sender_control_address}: {exc}", "sender_control_address") from None

    # ------------------------------------------------------------------ lifecycle

    def get(self, lease_id: str) -> Lease | None:
        return self.leases.get(lease_id)

    def lease_of(self, request_id: str) -> Lease | None:
        lease_id = self.by_request.get(request_id)
        return None if lease_id is None else self.leases.get(lease_id)

    def renew(self, lease_id: str, lease_ms: int) -> bool:
        """Its router still waits on the lease: an unattached one expires `lease_ms` from now (never
        sooner than it would have). False when the lease is gone here (expired, cancelled, ended);
        a taken lease stays taken (True)."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.cancelled:
            return False
        lease.deadline_s = max(lease.deadline_s, self.clock() + lease_ms / 1000)
        return True

    def take(self, lease: Lease) -> None:
        """The Decode call owns the lease now: it no longer expires (its blocks stay with the request)."""
        lease.deadline_s = float("inf")

    def cancel(self, lease: Lease, detail: str) -> bool:
        """End the lease: abort its transfer (blocks freed when it has let go) or free now.
        Returns True when the blocks were freed now."""
        lease.cancelled = True
        if lease.transfer_open and self.receiver is not None:
            self.receiver.abort(lease.lease_id, FailureCause.CANCELLED, detail)
            return False
        self._forget(lease)
        return True

    def _finished(self, result: TransferResult) -> None:
        self._results.put(result)
        self.on_result()

    def poll(self) -> list[tuple[Lease, TransferResult]]:
        """Apply finished transfers; returns them (DONE or not) for the engine to act on."""
        done: list[tuple[Lease, TransferResult]] = []
        while True:
            try:
                result = self._results.get_nowait()
            except queue.Empty:
                return done
            lease = self.leases.get(result.request_id)
            if lease is None:
                continue
            lease.transfer_open = False
            if result.state is TransferState.DONE and not lease.cancelled:
                lease.transfer_done = True
            elif lease.cancelled:
                self._forget(lease)
            else:
                # Free the blocks now; the lease stays as a tombstone so its Decode call learns why.
                cause = result.error.cause.value if result.error is not None else result.state.value
                self.metrics.transfer_failures.labels(cause).inc()
                lease.transfer_error = str(result.error) if result.error is not None else result.state.value
                self.free_state(lease)
                if lease.request_id in self.cache:
                    self.cache.free(lease.request_id)
            done.append((lease, result))

    def expired(self) -> list[Lease]:
        """Unattached leases past their deadline."""
        now = self.clock()
        return [lease for lease in self.leases.values() if lease.deadline_s < now and not lease.cancelled]

    def release(self, lease: Lease) -> None:
        """The request is gone: forget the lease (its blocks are the request's to free)."""
        self.leases.pop(lease.lease_id, None)
        self.by_request.pop(lease.request_id, None)

    def _forget(self, lease: Lease) -> None:
        self.release(lease)
        self.free_state(lease)
        if lease.request_id in self.cache:
            self.cache.free(lease.request_id)

    def available_blocks(self) -> int:
        return int(self.cache.pool.num_free + self.cache.prefix.num_evictable())

    @property
    def num_open(self) -> int:
        return len(self.leases)


def _nothing() -> None:
    pass
