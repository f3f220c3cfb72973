"""`LoopbackAgent`: an in-process fake of the transfer layer with the real one's interface.

For unit tests of everything above the transfer layer (schedulers, workers, the router's retry
logic): agents in one process meet in a `LoopbackHub` by name, `write_blocks` copies the bytes at
once (torch copies between the two regions, so block contents really arrive), and both sides go
through the same `TransferState` machine, `on_finish` callbacks, errors and validation as
`NixlTransferAgent`. Time comes from an injectable clock so lease expiry is testable without
sleeping; `LoopbackHub.kill(name)` fails every transfer with that agent as a dead peer would.
mypy checks this class against the `TransferEndpoint`, `KVSender` and `KVReceiver` Protocols, and
tests/unit/test_transfer_contract.py runs the same scenarios against both implementations.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from cedserve.kv_transfer.control import check_compatible
from cedserve.kv_transfer.descriptors import as_block_ids, count_runs
from cedserve.kv_transfer.errors import FailureCause, HandshakeError, KVTransferError, RequestId
from cedserve.kv_transfer.metrics import TransferMetrics
from cedserve.kv_transfer.protocol import BlockIds, Reservation, TransferMode
from cedserve.kv_transfer.region import KVLayout, KVRegion, LayoutKind
from cedserve.kv_transfer.roles import ReceiverRole, SenderRole
from cedserve.kv_transfer.staging import put_rows, take_rows
from cedserve.kv_transfer.state import FinishCallback, Role, TransferRecord, TransferResult, TransferState

if TYPE_CHECKING:
    from cedserve.kv_transfer.protocol import KVReceiver, KVSender, TransferEndpoint

Clock = Callable[[], float]


class LoopbackHub:
    """Where loopback agents find each other. One lock serialises everything in the hub."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.agents: dict[str, LoopbackAgent] = {}

    def kill(self, name: str) -> None:
        """The agent dies: its peers' transfers with it fail (PEER_DISCONNECTED); it stops answering."""
        with self.lock:
            agent = self.agents.pop(name, None)
            if agent is None:
                return
            agent.dead = True
            for other in self.agents.values():
                other._peer_died(name)
            self.changed.notify_all()


class _Pair:
    """One request's two sides in the hub."""

    def __init__(self, reservation: Reservation, receiver: TransferRecord) -> None:
        self.reservation = reservation
        self.receiver = receiver
        self.sender: TransferRecord | None = None
        self.next_pos = 0


class LoopbackAgent:
    """Fake transfer agent (see the module docstring). Thread-safe through the hub's lock."""

    def __init__(self, hub: LoopbackHub, region: KVRegion, layout: KVLayout, name: str,
                 *, lease_s: float = 30.0, mode: TransferMode = TransferMode.WRITE,
                 metrics: TransferMetrics | None = None) -> None:
        layout.check_region(region)
        self.hub = hub
        self.region = region
        self.layout = layout
        self.metrics = metrics if metrics is not None else TransferMetrics()
        self.dead = False
        self._name = name
        self._lease_s = lease_s
        self._mode = mode
        self._peers: set[str] = set()
        self._lost: dict[str, str] = {}  # peers that died: why (reserve/open with them fail retryably)
        self._pairs_out: dict[RequestId, _Pair] = {}  # we send
        self._pairs_in: dict[RequestId, _Pair] = {}  # we receive
        self._done: dict[tuple[Role, RequestId], TransferRecord] = {}
        with hub.lock:
            if name in hub.agents:
                raise ValueError(f"loopback agent {name!r} exists")
            hub.agents[name] = self

    @property
    def name(self) -> str:
        return self._name

    def handshake(self, address: str, timeout_s: float = 5.0) -> str:
        with self.hub.lock:
            peer = self.hub.agents.get(address)
            if peer is None:
                raise HandshakeError(f"KV transfer handshake with {address}: no such loopback agent")
            check_compatible(self.layout.compatibility(), peer.layout.compatibility(), address)
            self._peers.add(address)
            peer._peers.add(self._name)
            self._lost.pop(address, None)
            peer._lost.pop(self._name, None)
            return address

    def sender(self) -> SenderRole:
        return SenderRole(self)

    def receiver(self) -> ReceiverRole:
        return ReceiverRole(self)

    def active_transfers(self) -> int:
        with self.hub.lock:
            self._expire()
            return len(self._pairs_out) + len(self._pairs_in)

    def abort(self, request_id: RequestId, cause: FailureCause = FailureCause.CANCELLED, detail: str = "") -> bool:
        with self.hub.lock:
            found = False
            for table in (self._pairs_out, self._pairs_in):
                pair = table.get(request_id)
                if pair is not None:
                    self._end(pair, TransferState.ABORTED, cause, detail or "aborted locally", local=self._name)
                    found = True
            return found

    def close(self) -> None:
        with self.hub.lock:
            for pair in [*self._pairs_out.values(), *self._pairs_in.values()]:
                self._end(pair, TransferState.ABORTED, FailureCause.SHUTDOWN, f"agent {self._name} closing",
                          local=self._name)
            self.hub.agents.pop(self._name, None)

    # ------------------------------------------------------------------ receiver side

    def reserve(self, request_id: RequestId, block_ids: BlockIds, sender: str, mode: TransferMode | None,
                lease_s: float | None, on_finish: FinishCallback | None) -> Reservation:
        ids = as_block_ids(block_ids)
        self.region.check_block_ids(ids, f"reserve {request_id!r}")
        with self.hub.lock:
            self._expire()
            self._check_peer(sender, request_id)
            if request_id in self._pairs_in:
                raise KVTransferError(request_id, FailureCause.INVALID, "request id already in use")
            lease = self._lease_s if lease_s is None else lease_s
            now = self.hub.clock()
            record = TransferRecord(request_id, Role.RECEIVER, sender, tuple(ids.tolist()), now + lease,
                                    on_finish, now)
            reservation = Reservation(request_id, self._name, sender, tuple(ids.tolist()), mode or self._mode,
                                      (), lease, self.layout.compatibility().compat_hash)
            self._pairs_in[request_id] = _Pair(reservation, record)
            self._done.pop((Role.RECEIVER, request_id), None)
            return reservation

    # ------------------------------------------------------------------ sender side

    def open(self, reservation: Reservation, timeout_s: float | None, on_finish: FinishCallback | None) -> None:
        with self.hub.lock:
            self._expire()
            if reservation.compat_hash != self.layout.compatibility().compat_hash:
                raise ValueError(f"reservation {reservation.request_id!r}: compatibility hash "
                                 f"{reservation.compat_hash} != ours {self.layout.compatibility().compat_hash}")
            if reservation.sender != self._name:
                raise ValueError(f"reservation {reservation.request_id!r} is for sender {reservation.sender!r}")
            self._check_peer(reservation.receiver, reservation.request_id)
            receiver = self.hub.agents[reservation.receiver]
            pair = receiver._pairs_in.get(reservation.request_id)
            if reservation.request_id in self._pairs_out or pair is None or pair.sender is not None:
                raise KVTransferError(reservation.request_id, FailureCause.INVALID,
                                      "request id already open, or not reserved at the receiver")
            now = self.hub.clock()
            timeout = reservation.lease_s if timeout_s is None else timeout_s
            pair.sender = TransferRecord(reservation.request_id, Role.SENDER, reservation.receiver, (),
                                         now + timeout, on_finish, now)
            self._pairs_out[reservation.request_id] = pair
            self._done.pop((Role.SENDER, reservation.request_id), None)

    def write_blocks(self, request_id: RequestId, local_block_ids: BlockIds, last: bool) -> None:
        src = as_block_ids(local_block_ids)
        self.region.check_block_ids(src, f"write_blocks {request_id!r}")
        with self.hub.lock:
            self._expire()
            pair = self._pairs_out.get(request_id)
            if pair is None:
                done = self._done.get((Role.SENDER, request_id))
                if done is not None and done.error is not None:
                    raise done.error
                raise KVTransferError(request_id, FailureCause.INVALID,
                                      "write_blocks on a transfer never opened or already finished")
            assert pair.sender is not None
            total = pair.reservation.num_blocks
            end = pair.next_pos + src.size
            if end > total:
                raise ValueError(f"write_blocks {request_id!r}: {end} blocks exceed the {total} reserved")
            if last and end != total:
                raise ValueError(f"write_blocks {request_id!r}: last=True at {end} of {total} reserved blocks")
            dst = as_block_ids(pair.reservation.block_ids[pair.next_pos:end])
            receiver = self.hub.agents[pair.reservation.receiver]
            self._copy(receiver.region, src, dst)
            now = self.hub.clock()
            for record in (pair.sender, pair.receiver):
                record.start_transferring(now)
                record.num_bytes += src.size * self.region.block_bytes
                record.num_chunks += 1
            descriptors = (src.size * len(self.layout.segments) if self.layout.kind is LayoutKind.PER_LAYER
                           else count_runs(src, dst))
            poster = pair.sender if pair.reservation.mode is TransferMode.WRITE else pair.receiver
            poster.num_descriptors += descriptors
            pair.sender.block_ids = pair.sender.block_ids + tuple(src.tolist())
            pair.next_pos = end
            if last:
                pair.sender.closed_s = now
                for record in (pair.sender, pair.receiver):
                    record.advance(TransferState.DONE)
                self._finish(pair)

    def _copy(self, dst_region: KVRegion, src: np.ndarray, dst: np.ndarray) -> None:
        for (src_view, _, _), (dst_view, _, _) in zip(self.layout.segment_views(self.region),
                                                      self.layout.segment_views(dst_region)):
            rows = torch.empty(src.size, src_view.shape[1], dtype=torch.uint8, device=src_view.device)
            take_rows(src_view, src, rows)
            put_rows(dst_view, dst, rows.to(dst_view.device))

    # ------------------------------------------------------------------ shared

    def wait(self, role: Role, request_id: RequestId, timeout_s: float) -> TransferResult:
        end = time.monotonic() + timeout_s
        with self.hub.lock:
            while True:
                self._expire()
                record = self._lookup(role, request_id)
                if record.finished.is_set():
                    assert record.result is not None
                    return record.result.raise_for_state()
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"KV transfer {request_id!r} ({role.value}) still {record.state.value} "
                                       f"after {timeout_s} s")
                self.hub.changed.wait(min(left, 0.05))

    def state(self, role: Role, request_id: RequestId) -> TransferState:
        with self.hub.lock:
            self._expire()
            return self._lookup(role, request_id).state

    def _lookup(self, role: Role, request_id: RequestId) -> TransferRecord:
        table = self._pairs_out if role is Role.SENDER else self._pairs_in
        pair = table.get(request_id)
        if pair is not None:
            record = pair.sender if role is Role.SENDER else pair.receiver
            assert record is not None
            return record
        done = self._done.get((role, request_id))
        if done is None:
            raise KeyError(f"no KV transfer {request_id!r} on the {role.value} side of {self._name!r}")
        return done

    def _check_peer(self, name: str, request_id: RequestId) -> None:
        """As `NixlEngine.live_peer`: `ValueError` for a peer never handshaken, `KVTransferError`
        PEER_DISCONNECTED for one that died."""
        if self.dead:
            raise KVTransferError(request_id, FailureCause.SHUTDOWN, f"loopback agent {self._name} is dead")
        if name in self._lost:
            raise KVTransferError(request_id, FailureCause.PEER_DISCONNECTED,
                                  f"peer {name!r} was declared dead ({self._lost[name]}); it is reconnected by "
                                  "the next handshake with it")
        if name not in self._peers or name not in self.hub.agents:
            raise ValueError(f"KV transfer peer {name!r} is not connected (handshake first)")

    def _end(self, pair: _Pair, state: TransferState, cause: FailureCause, detail: str, local: str) -> None:
        """End both sides: the side on agent `local` sees `state`/`cause`, the other ABORTED with
        PEER_ABORTED (as the real engine's Abort notification does)."""
        rid = pair.reservation.request_id
        for record in (pair.sender, pair.receiver):
            if record is None:
                continue
            mine = (record.role is Role.SENDER) == (local == pair.reservation.sender)
            side_cause = cause if mine else FailureCause.PEER_ABORTED
            side_state = state if mine else TransferState.ABORTED
            record.fail(side_state, KVTransferError(rid, side_cause, detail if mine else f"{local} aborted: "
                                                    f"{cause.value} ({detail})"))
        self._finish(pair)

    def _finish(self, pair: _Pair) -> None:
        rid = pair.reservation.request_id
        sender_agent = self.hub.agents.get(pair.reservation.sender)
        receiver_agent = self.hub.agents.get(pair.reservation.receiver)
        sides = ((sender_agent, pair.sender, Role.SENDER), (receiver_agent, pair.receiver, Role.RECEIVER))
        for agent, record, role in sides:
            if agent is None or record is None or record.finished.is_set():
                continue
            (agent._pairs_out if role is Role.SENDER else agent._pairs_in).pop(rid, None)
            result = record.finish(self.hub.clock())
            agent._done[(role, rid)] = record
            agent.metrics.record(result, pair.reservation.mode.value)
            if record.on_finish is not None:
                record.on_finish(result)
            record.finished.set()
        self.hub.changed.notify_all()

    def _expire(self) -> None:
        now = self.hub.clock()
        for pair in [*self._pairs_out.values(), *self._pairs_in.values()]:
            for record in (pair.receiver, pair.sender):
                if record is not None and not record.state.terminal and now > record.deadline_s:
                    owner = pair.reservation.sender if record.role is Role.SENDER else pair.reservation.receiver
                    self._end(pair, TransferState.FAILED, FailureCause.DEADLINE, "not done within its lease",
                              local=owner)
                    break

    def _peer_died(self, name: str) -> None:
        if name in self._peers:
            self._lost[name] = "peer_disconnected: loopback agent killed"
        self._peers.discard(name)
        now = self.hub.clock()
        for table, role in ((self._pairs_out, Role.SENDER), (self._pairs_in, Role.RECEIVER)):
            for rid, pair in list(table.items()):
                record = pair.sender if role is Role.SENDER else pair.receiver
                if record is None or record.peer != name:
                    continue
                record.fail(TransferState.FAILED, KVTransferError(rid, FailureCause.PEER_DISCONNECTED,
                                                                  f"peer {name}: loopback agent killed"))
                table.pop(rid, None)
                result = record.finish(now)
                self._done[(role, rid)] = record
                self.metrics.record(result, pair.reservation.mode.value)
                if record.on_finish is not None:
                    record.on_finish(result)
                record.finished.set()


if TYPE_CHECKING:
    def _conforms(agent: LoopbackAgent) -> tuple[TransferEndpoint, KVSender, KVReceiver]:
        """mypy checks the fake against the contract here; never called."""
        return agent, agent.sender(), agent.receiver()
