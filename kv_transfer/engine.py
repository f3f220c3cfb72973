"""`NixlEngine`: the transfer engine of one agent: transfers, peers' liveness, the progress loop.

It moves blocks through `LocalMemory` (registration, descriptor lists, posting) and NIXL's
notifications; it knows peers only as the `PeerState`s the handshake (`handshake.py`) loaded, and
speaks no gRPC. `NixlTransferAgent` (`agent.py`) puts it together with the handshake and the control
service; docs/kv_transfer.md has the protocol.

Transfers (decode-first, see `protocol.py`): the receiver reserves blocks; the sender opens the
reservation and streams `write_blocks` chunks. WRITE mode: each chunk is one NIXL WRITE whose
notification (`ChunkDone`) lands after the bytes. READ mode: the sender announces `ChunkReady` and
the receiver READs, notifying `ChunkConsumed`. A chunk whose descriptors would be small is packed
through staging slots (gather, one descriptor, scatter; credits via `SlotFree`).

Progress: one thread drives UCX, notifications, heartbeats, deadlines and chunk posting (`_step`).
A step prepares NIXL requests under the engine lock, posts them without it, and commits them under
it again.

Failure: heartbeats every `heartbeat_interval_s` on the data path; a peer silent for
`peer_timeout_s`, or one UCX reports disconnected, is declared dead: it is disconnected and every
transfer with it fails at once. Deadlines (leases) fail transfers; `abort` cancels them. Both sides
then release their blocks (`on_finish`), the initiator after quiescing its requests, the target
after the initiator's word (see `transfers.py`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import Protocol

import numpy as np

from cedserve.kv_transfer.config import KVTransferConfig
from cedserve.kv_transfer.descriptors import as_block_ids, count_runs, should_pack, split_positions
from cedserve.kv_transfer.doorbell import Doorbell, LocalBell
from cedserve.kv_transfer.errors import FailureCause, KVTransferError, RequestId
from cedserve.kv_transfer.handshake import check_peer_info, load_peer
from cedserve.kv_transfer.metrics import TransferMetrics
from cedserve.kv_transfer.nixl_backend import NixlCallError
from cedserve.kv_transfer.protocol import BlockIds, Reservation, TransferMode
from cedserve.kv_transfer.region import LayoutKind
from cedserve.kv_transfer.registration import LocalMemory
from cedserve.kv_transfer.state import (
    FinishCallback,
    Role,
    TransferRecord,
    TransferResult,
    TransferState,
)
from cedserve.kv_transfer.transfers import (
    Chunk,
    Inflight,
    PeerState,
    PostJob,
    RecvTransfer,
    SendTransfer,
    Transfer,
)
from cedserve.kv_transfer.wire import cause_from_pb, cause_to_pb, decode_notice, encode_notice
from cedserve.proto import kv_transfer_pb2 as pb

log = logging.getLogger(__name__)

_FORGET_AFTER = 4096  # finished results kept for wait()/state() after the fact
_HOT_ROUNDS_AFTER_RING = 4  # short polls after a peer's ring (see `_run`)


class _SwitchInterval:
    """The interpreter's thread switch interval, shortened while any engine of the process spins
    (`KVTransferConfig.spin_switch_interval_s`), restored when the last spell ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._saved = 0.0

    @property
    def holders(self) -> int:
        return self._holders

    def enter(self, interval_s: float) -> None:
        with self._lock:
            if self._holders == 0:
                self._saved = sys.getswitchinterval()
            self._holders += 1
            if interval_s < sys.getswitchinterval():
                sys.setswitchinterval(interval_s)

    def leave(self) -> None:
        with self._lock:
            if self._holders == 0:
                return
            self._holders -= 1
            if self._holders == 0:
                sys.setswitchinterval(self._saved)


_SWITCH = _SwitchInterval()


class ProbeSink(Protocol):
    """Where `Probe` notifications go: a link measurement (the benchmark's `LinkMeter`) installs
    one; a serving agent has none and ignores probes."""

    def arrived(self, probe_id: int, at_s: float) -> None:
        """`Probe(probe_id)` arrived at `at_s` (monotonic). Called under the engine lock."""
        ...

    def awaiting(self) -> bool:
        """True while a probe is awaited: the engine then polls as during a transfer."""
        ...


class NixlEngine:
    """The transfer engine (see the module docstring). Thread-safe; `start` begins its progress loop."""

    def __init__(self, config: KVTransferConfig, memory: LocalMemory, name: str, metrics: TransferMetrics) -> None:
        """`config` as `KVTransferConfig.resolved` filled it in for `memory.region`."""
        self.config = config
        self.memory = memory
        self.region = memory.region
        self.layout = memory.layout
        self.staging = memory.staging
        self.metrics = metrics
        self.probe_sink: ProbeSink | None = None
        self._backend = memory.backend
        self._compat = memory.layout.compatibility()
        self._name = name
        self._lock = threading.RLock()
        # the loop sleeps on it; wakes (and, with `doorbell`, peers' rings) end the sleep
        self._bell: Doorbell | LocalBell = Doorbell(config.control_host) if config.doorbell else LocalBell()
        self._hot_rounds = 0  # polls left at the short interval after a peer's ring
        self._stop = threading.Event()
        self._peers: dict[str, PeerState] = {}
        self._sends: dict[RequestId, SendTransfer] = {}
        self._recvs: dict[RequestId, RecvTransfer] = {}
        self._results: OrderedDict[tuple[Role, RequestId], TransferRecord] = OrderedDict()
        self._callbacks: list[tuple[TransferRecord, FinishCallback | None]] = []
        self._zombies: list[tuple[object, str]] = []
        self._next_heartbeat_s = 0.0
        self._pack_threshold = config.pack_threshold(self.region.device_memory)
        self._hot_poll_s, self._target_poll_s = _filled(config.poll_interval_s), _filled(config.target_poll_s)
        self._chunk_blocks = int(_filled(config.chunk_blocks))
        self._spin_s = _filled(config.spin_s)
        self._spin_until = 0.0  # end of the current hot spell's spinning (0: not in one)
        self._spin_switch_s = _filled(config.spin_switch_interval_s)
        self._caller_waits_s = _filled(config.caller_waits_s)
        self._switch_held = False  # this engine holds `_SWITCH` (a spell is spinning)
        self._slots_per_request = int(_filled(config.staging_slots_per_request))
        self._thread = threading.Thread(target=self._run, name=f"kv-transfer-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def name(self) -> str:
        return self._name

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    def wake(self) -> None:
        """Run a step now (after a change the loop should see at once)."""
        self._bell.wake()

    @property
    def doorbell_port(self) -> int:
        """The UDP port of our doorbell (`doorbell.py`), announced in `AgentInfo`."""
        return self._bell.port

    # ------------------------------------------------------------------ peers

    def active_transfers(self) -> int:
        with self._lock:
            return len(self._sends) + len(self._recvs)

    def peers(self) -> dict[str, bool]:
        """Handshaken peers and whether each is alive."""
        with self._lock:
            return {name: p.alive for name, p in self._peers.items()}

    def add_peer(self, info: pb.AgentInfo, link: int, lost_link: int = 0) -> bool:
        """Load a handshaken peer over connection `link` (`handshake.load_peer`), or keep the one we
        hold; True when it was loaded. By what we hold under its name:

        - nothing, or a peer declared dead (its transfers failed then): load it;
        - a live peer of the same incarnation: the same process handshaking again (concurrent
          callers, or handshakes crossing from both sides): keep the connection and its transfers
          (both sides settle on the smaller link id); unless the peer names this connection as
          the one it lost (`lost_link`): it declared us dead and failed its side of our transfers,
          so ours fail too and it is loaded anew;
        - a live peer of another incarnation (or of none): it restarted; its old transfers fail
          (PEER_DISCONNECTED, naming both incarnations) and it is unloaded first.
        """
        check_peer_info(info, self._name, self.region.block_bytes)
        with self._lock:
            old = self._peers.get(info.agent_name)
            if old is not None and old.alive:
                same = info.incarnation != 0 and info.incarnation == old.incarnation
                if same and (lost_link == 0 or lost_link != old.link):
                    old.link = min(old.link, link) if old.link and link else old.link or link
                    return False
                why = (f"peer declared connection {old.link:x} dead and reconnected" if same else
                       f"peer restarted (incarnation {old.incarnation:x}, now {info.incarnation:x})")
                self._peer_dead(old, FailureCause.PEER_DISCONNECTED, why)
            self._peers[info.agent_name] = load_peer(self.memory, info, link)
            # Its silence clock starts now, before it may have loaded us: greet it at once rather
            # than at the next heartbeat round, so the first contact does not eat the timeout.
            self._next_heartbeat_s = 0.0
        self._bell.wake()
        return True

    def lost_link(self, control_address: str) -> int:
        """The connection to the agent at `control_address` we declared dead (0: none), which the
        next handshake with it names (`add_peer`'s `lost_link`)."""
        with self._lock:
            return next((p.link for p in self._peers.values()
                         if p.control_address == control_address and not p.alive), 0)

    def live_peer(self, name: str, request_id: RequestId = "") -> PeerState:
        """The handshaken peer `name`; `ValueError` when never handshaken, `KVTransferError`
        PEER_DISCONNECTED (retryable: the next handshake reconnects) when declared dead."""
        with self._lock:
            return self._live_peer(name, request_id)

    def _live_peer(self, name: str, request_id: RequestId = "") -> PeerState:
        peer = self._peers.get(name)
        if peer is None:
            raise ValueError(f"KV transfer peer {name!r} is not connected (handshake first)")
        if not peer.alive:
            raise KVTransferError(request_id, FailureCause.PEER_DISCONNECTED,
                                  f"peer {name!r} was declared dead ({peer.lost}); it is reconnected by "
                                  "the next handshake with it")
        return peer

    # ------------------------------------------------------------------ API used by the roles

    def _register(self, t: Transfer, table: dict[RequestId, SendTransfer] | dict[RequestId, RecvTransfer]) -> None:
        if t.request_id in table:
            raise KVTransferError(t.request_id, FailureCause.INVALID, "request id already in use")
        table[t.request_id] = t  # type: ignore[assignment]
        self._results.pop((t.record.role, t.request_id), None)

    def reserve(self, request_id: RequestId, block_ids: BlockIds, sender: str, mode: TransferMode | None,
                lease_s: float | None, on_finish: FinishCallback | None) -> Reservation:
        ids = as_block_ids(block_ids)
        self.region.check_block_ids(ids, f"reserve {request_id!r}")
        mode = mode or TransferMode(self.config.mode)
        lease = self.config.lease_s if lease_s is None else lease_s
        now = time.monotonic()
        with self._lock:
            self._live_peer(sender, request_id)
            slots: tuple[int, ...] = ()
            if (mode is TransferMode.WRITE and self.staging is not None and ids.size
                    and self.layout.kind is LayoutKind.CROSS_LAYER
                    and should_pack(count_runs(ids, ids), ids.size * self.region.block_bytes, self._pack_threshold)):
                # as many slots as the request's bytes fill (packed chunks share slots), up to the cap
                needed = -(-ids.size // max(1, self.staging.slot_blocks(self.region.block_bytes)))
                slots = tuple(self.staging.acquire_up_to(min(self._slots_per_request, needed)))
            block_ids = tuple(ids.tolist())
            record = TransferRecord(request_id, Role.RECEIVER, sender, block_ids, now + lease, on_finish, now)
            t = RecvTransfer(record=record, mode=mode, initiator=mode is TransferMode.READ, dst_ids=ids,
                             granted_slots=slots)
            try:
                self._register(t, self._recvs)
            except KVTransferError:
                for slot in slots:
                    self.memory.release_slot(slot)
                raise
        self._bell.wake()
        return Reservation(request_id=request_id, receiver=self._name, sender=sender,
                           block_ids=block_ids, mode=mode, staging_slots=slots, lease_s=lease,
                           compat_hash=self._compat.compat_hash)

    def check_reservation(self, reservation: Reservation) -> None:
        """`ValueError` unless `reservation` is for us and made by a compatible receiver."""
        if reservation.compat_hash and reservation.compat_hash != self._compat.compat_hash:
            raise ValueError(f"reservation {reservation.request_id!r}: compatibility hash "
                             f"{reservation.compat_hash} != ours {self._compat.compat_hash}")
        if reservation.sender and reservation.sender != self._name:
            raise ValueError(f"reservation {reservation.request_id!r} is for sender {reservation.sender!r}, "
                             f"not {self._name!r}")

    def open(self, reservation: Reservation, timeout_s: float | None, on_finish: FinishCallback | None) -> None:
        """Start sending into `reservation` (checked, and claimed at the receiver, by the caller)."""
        self.check_reservation(reservation)
        dst = as_block_ids(reservation.block_ids)
        now = time.monotonic()
        timeout = reservation.lease_s if timeout_s is None else timeout_s
        with self._lock:
            peer = self._live_peer(reservation.receiver, reservation.request_id)
            if dst.size and int(dst.max()) >= peer.kv.num_blocks:
                raise ValueError(f"reservation {reservation.request_id!r}: receiver block ids beyond its pool")
            if any(not 0 <= s < peer.staging_slots for s in reservation.staging_slots):
                raise ValueError(f"reservation {reservation.request_id!r}: staging slots beyond the receiver's")
            record = TransferRecord(reservation.request_id, Role.SENDER, reservation.receiver, (),
                                    now + timeout, on_finish, now)
            t = SendTransfer(record=record, mode=reservation.mode, initiator=reservation.mode is TransferMode.WRITE,
                             dst_ids=dst, reservation=reservation, credits=deque(reservation.staging_slots))
            self._register(t, self._sends)
        self._bell.wake()

    def claim(self, request_id: RequestId, sender_agent: str) -> str:
        """Control plane (`Claim`): "" when a reservation `request_id` for `sender_agent` is held here
        and has not ended, else why not."""
        with self._lock:
            t = self._recvs.get(request_id)
            ended = self._results.get((Role.RECEIVER, request_id))
            if t is None and ended is not None:
                return f"reservation {request_id!r} already ended here ({ended.state.value})"
            if t is None:
                return f"agent {self._name!r} holds no reservation {request_id!r}"
            if t.peer != sender_agent:
                return f"reservation {request_id!r} is for sender {t.peer!r}, not {sender_agent!r}"
            if t.record.state.terminal:
                return f"reservation {request_id!r} already ended here ({t.record.state.value})"
        return ""

    def write_blocks(self, request_id: RequestId, local_block_ids: BlockIds, last: bool) -> None:
        src = as_block_ids(local_block_ids)
        self.region.check_block_ids(src, f"write_blocks {request_id!r}")
        with self._lock:
            t = self._sends.get(request_id)
            if t is None:
                ended = self._results.get((Role.SENDER, request_id))
                if ended is not None and ended.error is not None:
                    raise ended.error
                raise KVTransferError(request_id, FailureCause.INVALID, "write_blocks on a transfer never opened "
                                      "or already finished")
            if t.record.state.terminal:
                assert t.record.error is not None
                raise t.record.error
            if t.closed:
                raise ValueError(f"write_blocks {request_id!r}: the transfer was already closed with last=True")
            end = t.next_pos + src.size
            if end > t.dst_ids.size:
                raise ValueError(f"write_blocks {request_id!r}: {end} blocks exceed the {t.dst_ids.size} reserved")
            if last and end != t.dst_ids.size:
                raise ValueError(f"write_blocks {request_id!r}: last=True at {end} of {t.dst_ids.size} reserved blocks")
            self._enqueue_chunks(t, src, last)
            now = time.monotonic()
            t.record.start_transferring(now)
            if last:
                t.record.closed_s = now
        if last and self.config.caller_posts_last:
            self._post_from_caller(t)
        self._bell.wake()

    def _post_from_caller(self, t: SendTransfer) -> None:
        """Post what is queued of `t` from this (the producer's) thread, as a step of the progress loop
        would: prepare under the lock, post outside it, commit under it. The progress thread may post
        other chunks of `t` meanwhile; `t.posting` keeps the transfer from settling under either.
        With `caller_holds_lock` the lock stays held from the prepare to the end of the polls
        (`_finish_from_caller`): one Python thread runs meanwhile, since the loop blocks on the lock
        with the GIL released."""
        holds = bool(self.config.caller_holds_lock)
        with self._lock if holds else contextlib.nullcontext():
            jobs: list[PostJob] = []
            with self._lock:
                if not t.finalized:
                    self._pump_send(t, jobs)
            if not jobs:
                return
            posted = self._post_jobs(jobs)
            with self._lock:
                for job, handle, status, error in posted:
                    self._commit(job, handle, status, error)
            if self._caller_waits_s > 0:
                self._finish_from_caller(t, time.monotonic() + self._caller_waits_s, yields=not holds)
        if self._caller_waits_s > 0:
            self._run_callbacks()  # outside the lock, held or not

    def _finish_from_caller(self, t: SendTransfer, deadline: float, yields: bool) -> None:
        """Poll `t`'s requests from this (the producer's) thread, as a step of the progress loop would,
        until the last one completes and `t` settles here, or until `deadline` (then the loop goes on
        polling them). A poll between the post and the loop's next step: the loop's wake-up took
        longer than a whole request's bytes on one GPU (`KVTransferConfig.caller_waits_s`). Returns
        at once while more of `t` waits to be posted (the loop's work). `yields`: give up the core
        between polls (the loop may take a step meanwhile; not while the caller holds the lock)."""
        while True:
            with self._lock:
                if t.finalized or t.queue or t.posting:
                    break
                now = time.monotonic()
                self._advance_send(t, now)
                if t.finalized or now >= deadline:
                    break
            if yields:
                os.sched_yield()  # the GIL and the core, between polls

    def _post_jobs(self, jobs: list[PostJob]) -> list[tuple[PostJob, object, str, NixlCallError | None]]:
        """Hand prepared requests to NIXL (outside the engine lock), stamping when each post began."""
        posted = []
        for job in jobs:
            job.posted_s = time.monotonic()
            posted.append((job, *self.memory.post(job)))
            job.returned_s = time.monotonic()
        return posted

    def _enqueue_chunks(self, t: SendTransfer, src: np.ndarray, last: bool) -> None:
        """Queue one `write_blocks` call as chunks of at most `chunk_blocks`. Whether a chunk is packed
        is decided later, once per NIXL request, on the chunks merged for it (`_next_chunk`): the
        caller's thread does no per-call run counting (it holds the GIL while a prefill queues)."""
        n = src.size
        dst = t.dst_ids[t.next_pos: t.next_pos + n]
        packable: bool | None = False
        if self.staging is not None and self.layout.kind is LayoutKind.CROSS_LAYER and n > 1:
            packable = None if self._slot_blocks(t) >= 2 else False
        if 0 < n <= self._chunk_blocks:  # a prefill's usual call: one chunk
            t.queue.append(Chunk(first=t.next_pos, src=src, dst=dst, packed=packable if n > 1 else False, last=last))
        else:
            pieces = split_positions(n, self._chunk_blocks) or ([(0, 0)] if last else [])
            for i, (a, b) in enumerate(pieces):
                t.queue.append(Chunk(first=t.next_pos + a, src=src[a:b], dst=dst[a:b],
                                     packed=packable if b - a > 1 else False, last=last and i == len(pieces) - 1))
        t.next_pos += n
        t.written.append(src)
        t.closed = last

    def _slot_blocks(self, t: SendTransfer) -> int:
        """Blocks one packed chunk of `t` may hold (0 when it may not pack: no receiver slot)."""
        if self.staging is None:
            return 0
        peer = self._peers[t.peer]
        assert t.reservation is not None
        remote_slots = len(t.reservation.staging_slots) if t.mode is TransferMode.WRITE else peer.staging_slots
        if not remote_slots:
            return 0
        return min(self.staging.slot_bytes, peer.staging_slot_bytes) // self.region.block_bytes

    def _packed_room(self, t: SendTransfer) -> int:
        """Blocks the next packed chunk of `t` may hold: what is left of the receiver slot it is filling
        (WRITE), else a whole slot. Chunks cut to it fill slots exactly, so a request needs no more
        receiver slots than its bytes do, and no `SlotFree` round trip while it has credits."""
        slot_blocks = self._slot_blocks(t)
        if t.mode is TransferMode.WRITE and t.open_slot >= 0 and t.open_fill < slot_blocks:
            return slot_blocks - t.open_fill
        return slot_blocks

    def _place_packed(self, t: SendTransfer, n: int) -> tuple[int, int] | None:
        """Where a packed WRITE chunk of `n` blocks goes at the receiver: (slot, first row), appended to
        the open slot if it fits, else at the start of the next credit; None when it must wait for one."""
        if t.open_slot < 0 or t.open_fill + n > self._slot_blocks(t):
            if not t.credits:
                return None
            if t.open_slot >= 0 and not t.slot_chunks.get(t.open_slot):
                t.credits.append(t.open_slot)  # full, and all of it scattered already
            t.open_slot, t.open_fill = t.credits.popleft(), 0
        place = (t.open_slot, t.open_fill)
        t.open_fill += n
        t.slot_chunks[t.open_slot] = t.slot_chunks.get(t.open_slot, 0) + 1
        return place

    def _slot_freed(self, t: SendTransfer, slot: int) -> None:
        """The receiver scattered a packed chunk of `slot` (`SlotFree`, one per chunk): once all of a slot
        is scattered, the open slot refills from row 0 and any other one becomes a credit again."""
        left = t.slot_chunks.get(slot, 0) - 1
        if left < 0:
            return  # not a slot we wrote into: ignored
        if left:
            t.slot_chunks[slot] = left
            return
        del t.slot_chunks[slot]
        if slot == t.open_slot:
            t.open_fill = 0
        else:
            t.credits.append(slot)

    def _next_chunk(self, t: SendTransfer) -> Chunk:
        """Pop the head chunk, absorbing the chunks of the same kind queued behind it, up to
        `chunk_blocks` (direct) or one staging slot (packed). While the link is the bottleneck,
        prefill pieces pile up and leave as fewer, larger NIXL requests (each costs a flush and a
        notification); an idle link gets each piece at once. Undecided chunks (`packed` None) merge up
        to `chunk_blocks` and are then decided as one: direct, or cut into packed slot-sized chunks."""
        head = t.queue.popleft()
        limit = self._chunk_blocks
        if head.packed:  # packed chunks merge up to what the next staging placement holds
            limit = self._packed_room(t)
        parts = [head]
        size = head.src.size
        while t.queue and t.queue[0].packed == head.packed and size + t.queue[0].src.size <= limit:
            nxt = t.queue.popleft()
            parts.append(nxt)
            size += nxt.src.size
        # queued chunks are consecutive positions: their receiver ids are one slice of the reservation's
        chunk = head if len(parts) == 1 else Chunk(
            first=head.first, src=np.concatenate([p.src for p in parts]),
            dst=t.dst_ids[head.first: head.first + size], packed=head.packed, last=parts[-1].last)
        if chunk.packed is not None:
            return chunk
        slot_blocks = self._slot_blocks(t)
        if slot_blocks < 2:
            chunk.packed = False
            return chunk
        chunk.runs = count_runs(chunk.src, chunk.dst)
        if not should_pack(chunk.runs, chunk.src.size * self.region.block_bytes, self._pack_threshold):
            chunk.packed = False
            return chunk
        pieces = split_positions(chunk.src.size, slot_blocks, first_max=self._packed_room(t))
        for i, (a, b) in reversed(list(enumerate(pieces))[1:]):
            t.queue.appendleft(Chunk(first=chunk.first + a, src=chunk.src[a:b], dst=chunk.dst[a:b],
                                     packed=b - a > 1, last=chunk.last and i == len(pieces) - 1))
        a, b = pieces[0]
        return Chunk(first=chunk.first, src=chunk.src[a:b], dst=chunk.dst[a:b], packed=True,
                     last=chunk.last and len(pieces) == 1)

    def abort(self, request_id: RequestId, cause: FailureCause = FailureCause.CANCELLED, detail: str = "") -> bool:
        """Abort the request in whichever role holds it; True if a live transfer was found."""
        found = False
        with self._lock:
            for t in (self._sends.get(request_id), self._recvs.get(request_id)):
                if t is not None and not t.record.state.terminal:
                    self._fail(t, TransferState.ABORTED, cause, detail or "aborted locally", tell_peer=True)
                    found = True
        self._bell.wake()
        return found

    def wait(self, role: Role, request_id: RequestId, timeout_s: float) -> TransferResult:
        record = self._record(role, request_id)
        if not record.finished.wait(timeout_s):
            raise TimeoutError(f"KV transfer {request_id!r} ({role.value}) still {record.state.value} "
                               f"after {timeout_s} s")
        assert record.result is not None
        return record.result.raise_for_state()

    def state(self, role: Role, request_id: RequestId) -> TransferState:
        return self._record(role, request_id).state

    def _record(self, role: Role, request_id: RequestId) -> TransferRecord:
        with self._lock:
            table: dict[RequestId, SendTransfer] | dict[RequestId, RecvTransfer] = (
                self._sends if role is Role.SENDER else self._recvs)
            t = table.get(request_id)
            if t is not None:
                return t.record
            done = self._results.get((role, request_id))
            if done is None:
                raise KeyError(f"no KV transfer {request_id!r} on the {role.value} side of {self._name!r}")
            return done

    def close(self) -> None:
        """Abort every transfer (SHUTDOWN), wait for them to release, stop the progress loop."""
        if self._stop.is_set():
            return
        with self._lock:
            for t in [*self._sends.values(), *self._recvs.values()]:
                if not t.record.state.terminal:
                    self._fail(t, TransferState.ABORTED, FailureCause.SHUTDOWN, f"agent {self._name} closing",
                               tell_peer=True)
        deadline = time.monotonic() + self.config.abort_drain_s + 0.5
        while self.active_transfers() and time.monotonic() < deadline:
            self._bell.wake()
            time.sleep(0.01)
        self._stop.set()
        self._bell.wake()
        self._thread.join(timeout=5.0)
        self._bell.close()
        with self._lock:
            for t in [*self._sends.values(), *self._recvs.values()]:
                self._drop_inflight(t)
                self._finalize(t)
        self._run_callbacks()

    # ------------------------------------------------------------------ progress loop

    def _run(self) -> None:
        _tight_timer_slack()
        try:
            self._loop()
        finally:
            self._release_switch()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                sleep_s = self._step()
            except Exception as exc:  # a bug here must not hang every transfer silently
                log.exception("KV transfer progress loop of %s failed", self._name)
                self._fail_everything(f"progress loop error: {type(exc).__name__}: {exc}")
                sleep_s = self.config.idle_poll_s
            self._run_callbacks()
            if self._spin(sleep_s <= self._hot_poll_s):
                continue
            if self._hot_rounds:
                self._hot_rounds -= 1
                sleep_s = min(sleep_s, self._hot_poll_s)
            if self._bell.wait(sleep_s):
                # A peer rang: its news is in flight. Poll short for a few rounds in case the ring
                # overtook the notification (UDP can beat a notification still queued in UCX).
                self._hot_rounds = _HOT_ROUNDS_AFTER_RING

    def _spin(self, hot: bool) -> bool:
        """True when the loop should step again at once instead of sleeping: while this side is hot (a
        request of ours in flight, an announced one landing), for up to `spin_s` per hot spell. Each
        round yields the core and the GIL (`sched_yield`), and the spell is bounded, because a
        spinning Python thread keeps the process's other threads from the GIL meanwhile."""
        if not hot or self._spin_s <= 0:
            self._spin_until = 0.0
            self._release_switch()
            return False
        now = time.monotonic()
        if not self._spin_until:
            self._spin_until = now + self._spin_s
            if self._spin_switch_s > 0 and not self._switch_held:
                _SWITCH.enter(self._spin_switch_s)
                self._switch_held = True
        if now >= self._spin_until:
            self._release_switch()
            return False
        os.sched_yield()
        self._bell.wait(0.0)  # consume wakes: this round steps anyway
        return True

    def _release_switch(self) -> None:
        if self._switch_held:
            self._switch_held = False
            _SWITCH.leave()

    def _fail_everything(self, detail: str) -> None:
        with self._lock:
            for t in [*self._sends.values(), *self._recvs.values()]:
                if not t.record.state.terminal:
                    self._fail(t, TransferState.FAILED, FailureCause.TRANSFER_ERROR, detail, tell_peer=True)
                self._drop_inflight(t)
                self._finalize(t)

    def _step(self) -> float:
        """One round of progress; returns how long to sleep before the next: short while this side
        has NIXL requests or chunks waiting (or a reference probe is awaited), longer while it only
        waits for the peer's notifications (UCX moves incoming bytes on its own thread; a spinning
        target would steal the core the sender needs), longest when idle."""
        # Liveness first: after this process was stopped or starved for longer than the peer timeout,
        # its peers have declared it dead and freed their blocks; it must not drain stale heartbeats
        # and then keep writing into them.
        with self._lock:
            self._check_liveness(time.monotonic())
        notices = self._backend.drain_notifs()
        now = time.monotonic()
        jobs: list[PostJob] = []
        with self._lock:
            for peer_name, messages in notices.items():
                for message in messages:
                    self._on_notice(peer_name, message, now)
            for s in list(self._sends.values()):
                self._pump_send(s, jobs)
            for r in list(self._recvs.values()):
                self._pump_recv(r, jobs)
        # Posting copies synchronously on some transports (TCP: tens of ms for a large chunk); the
        # agent lock stays free meanwhile, so prefill threads keep queueing chunks (which then merge).
        posted = self._post_jobs(jobs)
        now = time.monotonic()
        with self._lock:
            for job, handle, status, error in posted:
                self._commit(job, handle, status, error)
            for s in list(self._sends.values()):
                self._advance_send(s, now)
            for r in list(self._recvs.values()):
                self._advance_recv(r, now)
            self._timers(now)
            self._retry_zombies()
            transfers = [*self._sends.values(), *self._recvs.values()]
            if (self.probe_sink is not None and self.probe_sink.awaiting()) or any(t.has_local_work() for t in transfers):
                return self._hot_poll_s
            return self._target_poll_s if transfers else self.config.idle_poll_s

    def _run_callbacks(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        for record, callback in callbacks:
            assert record.result is not None
            if callback is not None:
                try:
                    callback(record.result)
                except Exception:  # the owner's bug; the transfer itself is over either way
                    log.exception("on_finish callback of KV transfer %r raised", record.request_id)
            record.finished.set()

    # ------------------------------------------------------------------ sender side

    def _pump_send(self, t: SendTransfer, jobs: list[PostJob]) -> None:
        while t.queue and not t.record.state.terminal:
            chunk = self._next_chunk(t)
            outcome = self._prepare_chunk(t, chunk, t.next_seq)
            if outcome is False:
                t.queue.appendleft(chunk)  # waits for a staging slot or a credit
                break
            if isinstance(outcome, PostJob):
                jobs.append(outcome)
            t.next_seq += 1

    def _advance_send(self, t: SendTransfer, now: float) -> None:
        self._poll_inflight(t)
        if t.record.state.terminal:
            self._settle(t, now)
        elif t.closed and not t.queue and not t.inflight and not t.posting:
            t.record.advance(TransferState.DONE)
            self._finalize(t)

    def _prepare_chunk(self, t: SendTransfer, c: Chunk, seq: int) -> PostJob | bool:
        """Announce a READ chunk (True), or build the WRITE of one (a `PostJob`); False when it must
        wait for a staging slot or a receiver credit."""
        peer = self._peers[t.peer]
        if not self._peer_fresh(peer):
            return True  # the transfer failed with the peer
        bb = self.region.block_bytes
        n = int(c.src.size)
        total = seq + 1 if c.last else 0
        slot: int | None = None
        remote_slot, remote_row = -1, 0
        if c.packed:
            assert self.staging is not None
            slot = self.staging.acquire()
            if slot is None:
                return False
            if t.mode is TransferMode.WRITE:
                place = self._place_packed(t, n)
                if place is None:
                    self.staging.release(slot)
                    return False
                remote_slot, remote_row = place
            with self._staging_timer(t, "gather"):
                self.staging.gather(self.region.blocks(), c.src, self.staging.slot_rows(slot, n, bb))
        t.record.num_chunks += 1
        if t.mode is TransferMode.READ:
            notice = encode_notice(t.request_id, chunk_ready=pb.ChunkReady(
                seq=seq, first_index=c.first, num_blocks=n, block_ids=[] if c.packed else c.src.tolist(),
                staging_slot=-1 if slot is None else slot, last=c.last, total_chunks=total))
            if self._notify(t.peer, notice):  # on False the peer is dead and the transfer failed
                t.inflight[seq] = Inflight(seq=seq, nbytes=n * bb, descriptors=0, local_slot=slot)
            else:
                self.memory.release_slot(slot)
            return True
        notice = encode_notice(t.request_id, chunk_done=pb.ChunkDone(
            seq=seq, first_index=c.first, num_blocks=n, staging_slot=remote_slot, last=c.last,
            total_chunks=total, staging_offset=remote_row))
        if n == 0:
            self._notify(t.peer, notice)
            return True
        t.posting += 1
        if slot is not None:
            return self.memory.staging_job(t, seq, "WRITE", slot, remote_slot, peer, notice, n * bb, None,
                                           peer_row=remote_row)
        return self.memory.blocks_job(t, seq, "WRITE", c.src, c.dst, peer, notice, runs=c.runs)

    def _commit(self, job: PostJob, handle: object, status: str, error: NixlCallError | None) -> None:
        """Phase three: record a posted request (or its failure) on its transfer."""
        t = job.transfer
        t.posting -= 1
        if error is not None:
            self.memory.release_slot(job.local_slot)
            if not t.finalized:
                self._nixl_failed(t, error)
            return
        if t.finalized:  # its peer died while we posted: nothing will land; drop the request
            self._release_handle(handle, t.peer)
            self.memory.release_slot(job.local_slot)
            return
        descriptors = self.memory.descriptors(job)
        t.inflight[job.seq] = Inflight(seq=job.seq, nbytes=job.nbytes, descriptors=descriptors, handle=handle,
                                       local_slot=job.local_slot, scatter_ids=job.scatter_ids)
        t.record.num_descriptors += descriptors
        if job.posted_s >= (t.record.last_post_s or 0.0):
            t.record.last_post_s, t.record.last_posted_s = job.posted_s, job.returned_s
        if self.config.announce_posts and job.op == "WRITE":
            # Sent (and rung) once the post returned, so a receiver is on its short poll while the
            # bytes land, but not while a host-memory post still copies them synchronously.
            self._notify(t.peer, encode_notice(t.request_id, chunk_posted=pb.ChunkPosted(seq=job.seq)))
        if status == "ERR":
            self._fail(t, TransferState.FAILED, FailureCause.TRANSFER_ERROR,
                       f"{job.op} of chunk {job.seq} failed at post", tell_peer=True)
        elif t.record.state.terminal:
            self._cancel_inflight(t)  # aborted while we posted
        elif isinstance(t, SendTransfer) and t.closed and not t.queue and not t.posting:
            t.join_written()  # all of it posted: the result's ids now, while the bytes move

    # ------------------------------------------------------------------ receiver side

    def _pump_recv(self, t: RecvTransfer, jobs: list[PostJob]) -> None:
        while t.reads and not t.record.state.terminal:
            ready = t.reads.popleft()
            outcome = self._prepare_read(t, ready)
            if outcome is False:
                t.reads.appendleft(ready)  # waits for a local staging slot
                break
            if isinstance(outcome, PostJob):
                jobs.append(outcome)

    def _advance_recv(self, t: RecvTransfer, now: float) -> None:
        self._poll_inflight(t)
        if t.record.state.terminal:
            self._settle(t, now)
        elif t.complete() and not t.posting:
            t.record.advance(TransferState.DONE)
            self._finalize(t)

    def _prepare_read(self, t: RecvTransfer, m: pb.ChunkReady) -> PostJob | bool:
        """Build the READ of one announced chunk; False when it must wait for a staging slot."""
        peer = self._peers[t.peer]
        if not self._peer_fresh(peer):
            return True
        bb = self.region.block_bytes
        dst = t.dst_ids[m.first_index: m.first_index + m.num_blocks]
        consumed = encode_notice(t.request_id, chunk_consumed=pb.ChunkConsumed(seq=m.seq))
        t.record.num_chunks += 1
        if m.num_blocks == 0:
            self._notify(t.peer, consumed)
            return True
        slot: int | None = None
        if m.staging_slot >= 0:
            if self.staging is None:
                self._fail(t, TransferState.FAILED, FailureCause.INVALID, "packed chunk but no staging buffer",
                           tell_peer=True)
                return True
            slot = self.staging.acquire()
            if slot is None:
                t.record.num_chunks -= 1
                return False
            t.posting += 1
            return self.memory.staging_job(t, m.seq, "READ", slot, m.staging_slot, peer, consumed,
                                           m.num_blocks * bb, dst)
        t.posting += 1
        return self.memory.blocks_job(t, m.seq, "READ", dst, np.asarray(m.block_ids, dtype=np.int64), peer, consumed)

    def _on_chunk_done(self, t: RecvTransfer, m: pb.ChunkDone) -> None:
        if t.mode is not TransferMode.WRITE or t.record.state.terminal:
            return
        problem = self._check_chunk(t, m.seq, m.first_index, m.num_blocks)
        if m.staging_slot >= 0 and m.staging_slot not in t.granted_slots:
            problem = f"staging slot {m.staging_slot} was not granted"
        elif m.staging_slot >= 0 and (self.staging is None or m.staging_offset + m.num_blocks
                                      > self.staging.slot_blocks(self.region.block_bytes)):
            problem = f"rows [{m.staging_offset}, {m.staging_offset + m.num_blocks}) beyond staging slot {m.staging_slot}"
        if problem:
            self._fail(t, TransferState.FAILED, FailureCause.INVALID, problem, tell_peer=True)
            return
        if m.staging_slot >= 0:
            assert self.staging is not None
            dst = t.dst_ids[m.first_index: m.first_index + m.num_blocks]
            with self._staging_timer(t, "scatter"):
                self.staging.scatter(self.region.blocks(), dst,
                                     self.staging.slot_rows(m.staging_slot, m.num_blocks, self.region.block_bytes,
                                                            m.staging_offset))
            self._notify(t.peer, encode_notice(t.request_id, slot_free=pb.SlotFree(staging_slot=m.staging_slot)))
        t.record.start_transferring(time.monotonic())
        t.seen.add(m.seq)
        t.posted.discard(m.seq)
        t.blocks_landed += m.num_blocks
        t.record.num_bytes += m.num_blocks * self.region.block_bytes
        t.record.num_chunks += 1
        if m.last:
            t.total_chunks = m.total_chunks

    def _on_chunk_ready(self, t: RecvTransfer, m: pb.ChunkReady) -> None:
        if t.mode is not TransferMode.READ or t.record.state.terminal:
            return
        problem = self._check_chunk(t, m.seq, m.first_index, m.num_blocks)
        peer = self._peers[t.peer]
        if m.staging_slot >= 0 and (m.staging_slot >= peer.staging_slots
                                    or m.num_blocks * self.region.block_bytes > peer.staging_slot_bytes):
            problem = f"staging slot {m.staging_slot} beyond the sender's"
        elif m.staging_slot < 0 and (len(m.block_ids) != m.num_blocks
                                     or any(b >= peer.kv.num_blocks for b in m.block_ids)):
            problem = "block ids missing or beyond the sender's pool"
        if problem:
            self._fail(t, TransferState.FAILED, FailureCause.INVALID, problem, tell_peer=True)
            return
        t.record.start_transferring(time.monotonic())
        t.seen.add(m.seq)
        t.reads.append(m)
        if m.last:
            t.total_chunks = m.total_chunks

    def _check_chunk(self, t: RecvTransfer, seq: int, first: int, n: int) -> str:
        if seq in t.seen:
            return f"chunk {seq} arrived twice"
        if first + n > t.dst_ids.size:
            return f"chunk {seq} covers positions [{first}, {first + n}) beyond {t.dst_ids.size} reserved"
        return ""

    # ------------------------------------------------------------------ in-flight requests

    def _poll_inflight(self, t: Transfer) -> None:
        for seq, inf in list(t.inflight.items()):
            if inf.handle is None:
                continue  # a READ sender's announced chunk: ends on ChunkConsumed
            try:
                status = self._backend.status(inf.handle, t.peer)
            except NixlCallError as exc:
                self._nixl_failed(t, exc)
                status = "ERR"
            t.record.status_polls += 1
            if status == "PROC":
                continue
            t.record.nixl_done_s = max(t.record.nixl_done_s or 0.0, time.monotonic())
            self._ring(t.peer)  # NIXL sent the request's notification when this poll saw it end
            self._release_handle(inf.handle, t.peer)
            del t.inflight[seq]
            if status == "DONE" and not t.record.state.terminal:
                if inf.scatter_ids is not None and inf.local_slot is not None and self.staging is not None:
                    with self._staging_timer(t, "scatter"):
                        self.staging.scatter(self.region.blocks(), inf.scatter_ids,
                                             self.staging.slot_rows(inf.local_slot, inf.scatter_ids.size,
                                                                    self.region.block_bytes))
                t.record.num_bytes += inf.nbytes
                if isinstance(t, RecvTransfer):
                    t.blocks_landed += inf.nbytes // self.region.block_bytes
            elif status == "ERR":
                self._fail(t, TransferState.FAILED, FailureCause.TRANSFER_ERROR,
                           f"NIXL request of chunk {seq} ended in error", tell_peer=True)
            self.memory.release_slot(inf.local_slot)

    @contextlib.contextmanager
    def _staging_timer(self, t: Transfer, op: str) -> Iterator[None]:
        """Time one staging copy (with its wait) into `t`'s record and the staging histogram."""
        start = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - start
            t.record.staging_s += took
            self.metrics.observe_staging(op, took)

    def _release_handle(self, handle: object, peer: str) -> None:
        try:
            self._backend.release(handle, peer)
        except NixlCallError as exc:
            log.warning("%s; retrying later", exc)
            self._zombies.append((handle, peer))

    def _retry_zombies(self) -> None:
        zombies, self._zombies = self._zombies, []
        for handle, peer in zombies:
            self._release_handle(handle, peer)

    def _drop_inflight(self, t: Transfer) -> None:
        """Forget in-flight requests of a transfer whose peer is dead (nothing more will land)."""
        for inf in t.inflight.values():
            if inf.handle is not None:
                self._release_handle(inf.handle, t.peer)
            self.memory.release_slot(inf.local_slot)
        t.inflight.clear()

    # ------------------------------------------------------------------ notifications

    def _notify(self, peer_name: str, message: bytes, *, ring: bool = True) -> bool:
        """Send a notification (and ring the peer's doorbell, so it sees it now rather than at its next
        poll); on a disconnect, declare the peer dead and return False."""
        peer = self._peers.get(peer_name)
        if peer is None or not peer.alive:
            return False
        try:
            self._backend.notify(peer_name, message)
        except NixlCallError as exc:
            self._peer_dead(peer, FailureCause.PEER_DISCONNECTED, str(exc))
            return False
        if ring and peer.doorbell is not None:
            self._bell.ring(peer.doorbell)
        return True

    def _ring(self, peer_name: str) -> None:
        peer = self._peers.get(peer_name)
        if peer is not None and peer.alive and peer.doorbell is not None:
            self._bell.ring(peer.doorbell)

    def _on_notice(self, peer_name: str, message: bytes, now: float) -> None:
        peer = self._peers.get(peer_name)
        if peer is None or not peer.alive:
            return  # from an agent we never handshook, or declared dead: ignore
        peer.last_seen_s = now
        try:
            notice = decode_notice(message)
        except ValueError as exc:
            log.warning("ignoring notification from %s: %s", peer_name, exc)
            return
        kind = notice.WhichOneof("body")
        if kind == "heartbeat":
            return
        self.metrics.count_notice(kind)
        if kind == "probe":
            if self.probe_sink is not None:
                self.probe_sink.arrived(notice.probe.probe_id, now)
            return
        rid = notice.request_id
        send = self._sends.get(rid)
        recv = self._recvs.get(rid)
        send = send if send is not None and send.peer == peer_name else None
        recv = recv if recv is not None and recv.peer == peer_name else None
        if kind == "chunk_posted" and recv is not None:
            seq = notice.chunk_posted.seq
            if (recv.mode is TransferMode.WRITE and not recv.record.state.terminal and seq not in recv.seen
                    and seq <= recv.dst_ids.size):  # a chunk holds a block at least (the empty last one aside)
                recv.record.start_transferring(now)
                recv.announcing = True
                recv.posted.add(seq)  # bytes on the way: poll short until its ChunkDone (has_local_work)
        elif kind == "chunk_done" and recv is not None:
            self._on_chunk_done(recv, notice.chunk_done)
        elif kind == "chunk_ready" and recv is not None:
            self._on_chunk_ready(recv, notice.chunk_ready)
        elif kind == "slot_free" and send is not None:
            self._slot_freed(send, notice.slot_free.staging_slot)
        elif kind == "chunk_consumed" and send is not None:
            inf = send.inflight.pop(notice.chunk_consumed.seq, None)
            if inf is not None:
                send.record.num_bytes += inf.nbytes
                self.memory.release_slot(inf.local_slot)
        elif kind == "abort":
            self._on_peer_abort(peer_name, rid, notice.abort)
        elif kind == "abort_ack":
            for t in (send, recv):
                if t is not None:
                    t.peer_quiesced = True

    def _on_peer_abort(self, peer_name: str, rid: RequestId, m: pb.Abort) -> None:
        detail = f"{peer_name} aborted: {cause_from_pb(m.cause).value}" + (f" ({m.detail})" if m.detail else "")
        matched = False
        for t in (self._sends.get(rid), self._recvs.get(rid)):
            if t is None or t.peer != peer_name:
                continue
            matched = True
            self._fail(t, TransferState.ABORTED, FailureCause.PEER_ABORTED, detail, tell_peer=False)
            if t.initiator:
                t.reply = t.reply or "ack"
            else:
                t.peer_quiesced = True  # an initiator aborts only once quiesced
        if not matched:
            # Already finished here (or never known): nothing of ours is in flight; let the target go.
            self._notify(peer_name, encode_notice(rid, abort_ack=pb.AbortAck()))

    # ------------------------------------------------------------------ failure, settling, finishing

    def _fail(self, t: Transfer, state: TransferState, cause: FailureCause, detail: str, *, tell_peer: bool) -> None:
        fallback = ("recompute" if self.config.on_failure == "recompute" and state is TransferState.FAILED
                    else None)
        error = KVTransferError(t.request_id, cause, detail, fallback=fallback)
        if not t.record.fail(state, error):
            return
        log.info("KV transfer %r (%s, peer %s) %s: %s", t.request_id, t.record.role.value, t.peer,
                 state.value, error)
        if isinstance(t, SendTransfer):
            t.queue.clear()
        if t.initiator:
            t.reply = "abort" if tell_peer else None
            self._cancel_inflight(t)
        else:
            if tell_peer:
                self._notify(t.peer, encode_notice(t.request_id, abort=pb.Abort(cause=cause_to_pb(cause),
                                                                                detail=detail)))
            t.drain_until_s = time.monotonic() + self.config.abort_drain_s
        self._bell.wake()

    def _cancel_inflight(self, t: Transfer) -> None:
        """Ask NIXL to cancel our requests; those it cannot cancel are polled to their end."""
        for inf in list(t.inflight.values()):
            if inf.handle is None:
                continue
            try:
                self._backend.release(inf.handle, t.peer)
            except NixlCallError:
                continue
            self.memory.release_slot(inf.local_slot)
            del t.inflight[inf.seq]

    def _nixl_failed(self, t: Transfer, exc: NixlCallError) -> None:
        peer = self._peers.get(t.peer)
        if exc.disconnected and peer is not None:
            self._peer_dead(peer, FailureCause.PEER_DISCONNECTED, str(exc))
        else:
            self._fail(t, TransferState.FAILED, FailureCause.TRANSFER_ERROR, str(exc), tell_peer=True)

    def _settle(self, t: Transfer, now: float) -> None:
        """A terminal transfer releases its blocks once nothing of it can touch memory any more."""
        if t.finalized:
            return
        peer = self._peers.get(t.peer)
        peer_gone = peer is None or not peer.alive
        if t.posting:
            return  # a request of it is being handed to NIXL right now; decide after the commit
        if t.initiator:
            if t.inflight and not peer_gone:
                return
            if t.reply == "abort" and not peer_gone:
                cause = t.record.error.cause if t.record.error else FailureCause.CANCELLED
                detail = t.record.error.detail if t.record.error else ""
                self._notify(t.peer, encode_notice(t.request_id, abort=pb.Abort(cause=cause_to_pb(cause),
                                                                                detail=detail)))
            elif t.reply == "ack" and not peer_gone:
                self._notify(t.peer, encode_notice(t.request_id, abort_ack=pb.AbortAck()))
            self._drop_inflight(t)
            self._finalize(t)
            return
        if t.peer_quiesced or peer_gone or (t.drain_until_s is not None and now >= t.drain_until_s):
            if not (t.peer_quiesced or peer_gone):
                log.warning("KV transfer %r: no abort acknowledgement from %s within %.2f s; releasing anyway",
                            t.request_id, t.peer, self.config.abort_drain_s)
            self._drop_inflight(t)
            self._finalize(t)

    def _finalize(self, t: Transfer) -> None:
        if t.finalized:
            return
        t.finalized = True
        if isinstance(t, RecvTransfer):
            for slot in t.granted_slots:
                self.memory.release_slot(slot)
            self._recvs.pop(t.request_id, None)
        else:
            self._sends.pop(t.request_id, None)
            if isinstance(t, SendTransfer):
                t.join_written()
        for inf in t.inflight.values():
            self.memory.release_slot(inf.local_slot)
        t.inflight.clear()
        result = t.record.finish(time.monotonic())  # fresh: a step may have posted for a while
        self.metrics.record(result, t.mode.value)
        self._results[(t.record.role, t.request_id)] = t.record
        while len(self._results) > _FORGET_AFTER:
            self._results.popitem(last=False)
        self._callbacks.append((t.record, t.record.on_finish))

    def _peer_dead(self, peer: PeerState, cause: FailureCause, detail: str) -> None:
        if not peer.alive:
            return
        peer.alive = False
        peer.lost = f"{cause.value}: {detail}"
        affected = [t for t in (*self._sends.values(), *self._recvs.values()) if t.peer == peer.name]
        (log.warning if affected else log.info)("KV transfer peer %s declared dead (%s: %s); failing %d transfers",
                                                peer.name, cause.value, detail, len(affected))
        try:
            if peer.blocks_list is not None:
                self._backend.release_blocks(peer.blocks_list)
            self._backend.remove_peer(peer.name)
        except NixlCallError as exc:
            log.warning("%s", exc)
        for t in affected:
            self._fail(t, TransferState.FAILED, cause, f"peer {peer.name}: {detail}", tell_peer=False)
            self._drop_inflight(t)
            self._finalize(t)

    def _check_liveness(self, now: float) -> None:
        for peer in list(self._peers.values()):
            if peer.alive and now - peer.last_seen_s > self.config.peer_timeout_s:
                self._peer_dead(peer, FailureCause.PEER_SILENT,
                                f"no heartbeat for {now - peer.last_seen_s:.2f} s")

    def _peer_fresh(self, peer: PeerState) -> bool:
        """Check liveness right before posting, with a fresh clock reading (see `_step`)."""
        self._check_liveness(time.monotonic())
        return peer.alive

    def _timers(self, now: float) -> None:
        for t in [*self._sends.values(), *self._recvs.values()]:
            if not t.record.state.terminal and now > t.record.deadline_s:
                self._fail(t, TransferState.FAILED, FailureCause.DEADLINE,
                           f"not done within its lease ({t.record.deadline_s - t.record.started_s:.3g} s)",
                           tell_peer=True)
                self._settle(t, now)
        self._check_liveness(now)
        if now >= self._next_heartbeat_s:
            self._next_heartbeat_s = now + self.config.heartbeat_interval_s
            for peer in list(self._peers.values()):
                if peer.alive:
                    peer.next_heartbeat_seq += 1
                    self._notify(peer.name, encode_notice("", heartbeat=pb.Heartbeat(seq=peer.next_heartbeat_seq)),
                                 ring=False)


def _filled(value: float | None) -> float:
    """A field `KVTransferConfig.resolved` has filled in (never None there)."""
    assert value is not None
    return value


def _tight_timer_slack() -> None:
    """Let this thread's short sleeps end on time: Linux pads every timed wait by the thread's timer
    slack (50 us by default), which would stretch a 200 us poll by a quarter. No-op elsewhere."""
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(1000), 0, 0, 0)  # 1 us
    except (OSError, AttributeError):
        pass


_PR_SET_TIMERSLACK = 29

