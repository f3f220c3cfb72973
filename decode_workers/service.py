"""The `cedserve.v1.DecodeWorker` gRPC service of a decode group's leader.

Calls become engine commands (`messages.py`) queued for the loop (`loop.py`); the loop's reports come
back through `OutputRouter`, which hands each output to the call waiting for it. The leader places a
new lease on the rank with the most free blocks (attention is data-parallel: a request lives on one
rank for its whole life) and remembers which rank holds it.

How the router drives a request (docs/decode.md): `Reserve` (blocks leased, the kv_transfer
reservation returned for the prefill worker) -> the prefill worker WRITEs the KV -> `Decode` with the
lease id and the first token (server stream of `tokens`, then `complete` or `error`). `Cancel`, a
cancelled `Decode` call, an expired lease or a failed transfer frees everything the request held.
Until its `Decode` call streams, the router keeps the lease alive with `Renew` (leases.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import grpc

from cedserve.common.errors import ErrorKind
from cedserve.decode_workers.leases import new_lease_id
from cedserve.decode_workers.loop import CommandInbox
from cedserve.decode_workers.messages import (
    AttachCommand,
    CancelCommand,
    Failed,
    Finished,
    Output,
    ProbeCheckCommand,
    ProbeChecked,
    RankLoad,
    RenewCommand,
    ReserveCommand,
    Reserved,
    Sampling,
    TickReport,
    Tokens,
)
from cedserve.decode_workers.metrics import PhaseClock
from cedserve.kv_transfer.link_probe import check_token
from cedserve.model.cache.events import KVEventBatch
from cedserve.model.effort import check_level
from cedserve.model.state_format import STATE_FORMAT_VERSION
from cedserve.proto import kv_transfer_pb2, worker_pb2_grpc
from cedserve.proto import worker_pb2 as wpb
from cedserve.serving.drain import DrainController
from cedserve.serving.errors import abort, fail_stream, wire_code
from cedserve.serving.kv_events import KVEventFeed
from cedserve.serving.load import SeqCounter

log = logging.getLogger(__name__)

RESERVE_TIMEOUT_S = 30.0
STREAM_POLL_S = 0.2
EARLY_CANCEL_TTL_S = 60.0
"""How long a Cancel for a request this worker does not know yet is remembered: under load the
router's Cancel (its client gone) can run before the same request's Reserve, which must then not
lease blocks that nothing would ever take or cancel."""
MAX_EARLY_CANCELS = 65_536

Routed = tuple[float, Output]
"""An output in a Decode stream's queue, with the `perf_counter` time the loop reported it."""


class OutputRouter:
    """Leader side: outputs of every rank to the calls waiting for them. Thread-safe."""

    def __init__(self, num_ranks: int) -> None:
        self._lock = threading.Lock()
        self._reserves: dict[str, tuple[Future[Output], str]] = {}  # request id -> (answer, its lease id)
        self._streams: dict[str, queue.SimpleQueue[Routed]] = {}
        self._rank_of: dict[str, int] = {}  # request id -> rank holding it
        self._early_cancels: dict[str, float] = {}  # request id -> when a Cancel came before its Reserve
        self._held: list[Routed] = []  # streams' outputs reported by `hold_report`, not yet released
        self._failed: tuple[ErrorKind, str] | None = None  # the engine stopped: every call fails with it
        self.loads = [RankLoad(rank=r) for r in range(num_ranks)]
        self.last_report_s = time.monotonic()

    def on_report(self, reports: list[TickReport]) -> None:
        with self._lock:
            for report in reports:
                self.loads[report.load.rank] = report.load
                for out in report.outputs:
                    self._route(out)
            self.last_report_s = time.monotonic()

    def hold_report(self, reports: list[TickReport]) -> None:
        """`on_report`, but the outputs for Decode streams wait for `release` (Reserve and CheckProbe
        answers go at once). The engine loop releases them when its next step starts its passes, where
        its thread mostly runs without the GIL: the streams' threads, woken there, no longer stall
        the loop's Python-bound phases (schedule, join) fighting it for the GIL
        (docs/decode.md, Where a token's time goes)."""
        now = time.perf_counter()
        with self._lock:
            for report in reports:
                self.loads[report.load.rank] = report.load
                for out in report.outputs:
                    if not self._answer(out):
                        self._held.append((now, out))
            self.last_report_s = time.monotonic()

    def release(self) -> None:
        """Hand the outputs held since the last `release` to their streams, in the order reported."""
        if not self._held:  # read without the lock: only the loop's thread appends or releases
            return
        with self._lock:
            held, self._held = self._held, []
            for reported_s, out in held:
                self._to_stream(out, reported_s)

    def _route(self, out: Output) -> None:
        if not self._answer(out):
            self._to_stream(out, time.perf_counter())

    def _answer(self, out: Output) -> bool:
        """Answer the call waiting on `out`'s request (Reserve, CheckProbe) with it; True when `out`
        is done with. While a Reserve waits, an output naming another lease of the same request is
        an earlier attempt's (the router retries under the same request id, and its Cancel of the
        failed attempt's lease answers "lease cancelled"): it is dropped, so it neither answers the
        new Reserve nor ends the request's routing."""
        waiting = self._reserves.get(out.request_id)
        if waiting is None:
            return False
        future, lease_id = waiting
        other = getattr(out, "lease_id", "")
        if lease_id and other and other != lease_id:
            log.debug("dropping %s of lease %s: request %s now waits on lease %s", type(out).__name__, other,
                      out.request_id, lease_id)
            return True
        del self._reserves[out.request_id]
        future.set_result(out)
        return True

    def _to_stream(self, out: Output, reported_s: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.put((reported_s, out))
        if isinstance(out, Finished | Failed | ProbeChecked):
            self._rank_of.pop(out.request_id, None)

    def expect_reserve(self, request_id: str, rank: int, lease_id: str = "") -> Future[Output]:
        """The future the next output for `request_id` (of lease `lease_id`, when given) answers."""
        future: Future[Output] = Future()
        with self._lock:
            if self._failed is not None:  # no engine will answer it
                future.set_result(Failed(request_id, *self._failed, lease_id=lease_id))
                return future
            self._reserves[request_id] = (future, lease_id)
            self._rank_of[request_id] = rank
        return future

    def fail_all(self, kind: ErrorKind, message: str) -> None:
        """The engine stopped for good: every waiting Reserve and every open Decode stream ends with a
        `Failed` of `kind` now, and so does every later one (the caller sees a status at once, and the
        router places the request elsewhere), instead of each waiting for outputs that never come."""
        now = time.perf_counter()
        with self._lock:
            self._failed = (kind, message)
            for request_id, (future, lease_id) in self._reserves.items():
                future.set_result(Failed(request_id, kind, message, lease_id=lease_id))
            self._reserves.clear()
            for request_id, stream in self._streams.items():
                stream.put((now, Failed(request_id, kind, message)))

    def note_early_cancel(self, request_id: str) -> None:
        """A Cancel for `request_id` arrived before its Reserve (see `EARLY_CANCEL_TTL_S`)."""
        now = time.monotonic()
        with self._lock:
            self._early_cancels.pop(request_id, None)
            self._early_cancels[request_id] = now  # dicts keep insertion order: the oldest come first
            while True:
                oldest, when = next(iter(self._early_cancels.items()))
                if now - when <= EARLY_CANCEL_TTL_S and len(self._early_cancels) <= MAX_EARLY_CANCELS:
                    break
                del self._early_cancels[oldest]

    def cancelled_early(self, request_id: str) -> bool:
        """Whether a Cancel for `request_id` came before its Reserve (and is still remembered)."""
        with self._lock:
            when = self._early_cancels.pop(request_id, None)
        return when is not None and time.monotonic() - when <= EARLY_CANCEL_TTL_S

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._reserves.pop(request_id, None)
            self._rank_of.pop(request_id, None)

    def open_stream(self, request_id: str) -> queue.SimpleQueue[Routed]:
        stream: queue.SimpleQueue[Routed] = queue.SimpleQueue()
        with self._lock:
            self._streams[request_id] = stream
            if self._failed is not None:
                stream.put((time.perf_counter(), Failed(request_id, *self._failed)))
        return stream

    def close_stream(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)

    def rank_of(self, request_id: str) -> int | None:
        with self._lock:
            return self._rank_of.get(request_id)

    def pick_rank(self) -> int:
        """The rank with the most free blocks, then the fewest requests."""
        with self._lock:
            best = max(self.loads, key=lambda load: (load.free_blocks, -load.running - load.waiting, -load.rank))
            return best.rank

    def in_flight(self) -> int:
        with self._lock:
            return sum(load.in_flight for load in self.loads)


class DecodeService(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker_id: str, inbox: CommandInbox, router: OutputRouter, feed: KVEventFeed,
                 snapshot: Callable[[], KVEventBatch], drain: DrainController, lease_ms: int,
                 token: str = "", phases: PhaseClock | None = None) -> None:
        self.worker_id = worker_id
        self._token = token  # the KV-transfer token: CheckProbe's credential
        self.inbox = inbox
        self.router = router
        self.feed = feed
        self.snapshot = snapshot
        self.drain = drain
        self.lease_ms = lease_ms
        self._phases = phases  # the stream's handoff and gRPC write times (`metrics.LOOP_PHASES`)
        self._seq = SeqCounter()
        self._order = threading.Lock()
        """Held while a Reserve or a Cancel decides and queues its command, so a Cancel either finds
        the request (and its command follows the Reserve's in the inbox) or is remembered before the
        Reserve looks (`OutputRouter.note_early_cancel`): never a lease that both missed."""

    # ------------------------------------------------------------------ Reserve

    def Reserve(self, request: wpb.ReserveRequest, context: grpc.ServicerContext) -> wpb.ReserveReply:
        if self.drain.draining:
            abort(context, wpb.ErrorDetail(code=wpb.ERROR_CODE_UNAVAILABLE, message="draining: no new leases",
                                           request_id=request.request_id))
        rank = self.router.pick_rank()
        cmd = ReserveCommand(rank, request.request_id, new_lease_id(), request.prompt_tokens,
                             tuple(request.token_ids), request.lease_ms or self.lease_ms, request.cache_salt,
                             request.sender_agent, request.sender_control_address,
                             request.ship_state if request.HasField("ship_state") else None)
        with self._order:
            gone = not context.is_active() or self.router.cancelled_early(request.request_id)
            if not gone:
                future = self.router.expect_reserve(request.request_id, rank, cmd.lease_id)
                self.inbox.put(cmd)
        if gone:  # the caller left (its deadline passed while this call queued) or cancelled it already
            context.abort(grpc.StatusCode.CANCELLED, f"request {request.request_id!r} was cancelled before its "
                          "Reserve ran")
        try:
            out = future.result(timeout=RESERVE_TIMEOUT_S)
        except TimeoutError:
            self.router.forget(request.request_id)
            self.inbox.put(CancelCommand(rank, request.request_id, cmd.lease_id, "reserve timed out"))
            abort(context, wpb.ErrorDetail(code=wpb.ERROR_CODE_UNAVAILABLE, request_id=request.request_id,
                                           message="the decode engine did not answer in time"))
        if isinstance(out, Failed):
            self.router.forget(request.request_id)
            abort(context, _detail(out))
        assert isinstance(out, Reserved)
        if not context.is_active():  # the reply would reach no one: nothing would take or cancel the lease
            self.inbox.put(CancelCommand(rank, request.request_id, cmd.lease_id, "caller gone before its lease"))
            context.abort(grpc.StatusCode.CANCELLED, "the caller left before the lease was granted")
        return _reserve_reply(out)

    # ------------------------------------------------------------------ Decode

    def Decode(self, request: wpb.DecodeRequest, context: grpc.ServicerContext) -> Iterator[wpb.DecodeEvent]:
        rid = request.request_id
        rank = self.router.rank_of(rid)
        if rank is None:
            fail_stream(context, wpb.ErrorDetail(code=wpb.ERROR_CODE_NOT_FOUND, field="lease_id", request_id=rid,
                                                 message=f"no lease {request.lease_id!r} for request {rid!r}"))
            return
        try:
            cmd = _attach_command(request, rank)
        except ValueError as exc:
            self.inbox.put(CancelCommand(rank, rid, request.lease_id, "invalid Decode call"))
            fail_stream(context, _invalid(rid, exc))
            return
        stream = self.router.open_stream(rid)
        finished = threading.Event()

        def on_done() -> None:  # the call ended: a client that went away cancels the request
            if not finished.is_set():
                self.inbox.put(CancelCommand(rank, rid, request.lease_id, "client cancelled"))

        context.add_callback(on_done)
        self.inbox.put(cmd)
        try:
            yield from self._events(stream, context, finished)
        finally:
            self.router.close_stream(rid)

    def _events(self, stream: queue.SimpleQueue[Routed], context: grpc.ServicerContext,
                finished: threading.Event) -> Iterator[wpb.DecodeEvent]:
        """The stream's events. Outputs that queued while the last event was written leave together,
        consecutive token chunks merged into one event (`merge_tokens`): a slow reader gets fewer,
        larger messages, never a later token."""
        while context.is_active():
            try:
                first = stream.get(timeout=STREAM_POLL_S)
            except queue.Empty:
                continue
            for out in merge_tokens(self._ready(first, stream)):
                start = time.perf_counter()
                if isinstance(out, Tokens):
                    yield wpb.DecodeEvent(tokens=_chunk(out))
                elif isinstance(out, Finished):
                    finished.set()
                    yield wpb.DecodeEvent(complete=wpb.DecodeComplete(
                        finish_reason=out.finish_reason, output_tokens=out.output_tokens,
                        draft_tokens=out.draft_tokens, accepted_drafts=out.accepted_drafts))
                    return
                elif isinstance(out, Failed):
                    finished.set()
                    detail = _detail(out)
                    yield wpb.DecodeEvent(error=detail)
                    fail_stream(context, detail)
                    return
                if self._phases is not None:  # gRPC resumes the generator once it took the event
                    self._phases.add("grpc_write", time.perf_counter() - start)

    def _ready(self, first: Routed, stream: queue.SimpleQueue[Routed]) -> list[Output]:
        """`first` and whatever else is queued now, each one's handoff timed."""
        routed = [first]
        while True:
            try:
                routed.append(stream.get_nowait())
            except queue.Empty:
                break
        if self._phases is not None:
            now = time.perf_counter()
            for put_s, _ in routed:
                self._phases.add("handoff", now - put_s)
        return [out for _, out in routed]

    # ------------------------------------------------------------------ the rest

    def Cancel(self, request: wpb.CancelRequest, context: grpc.ServicerContext) -> wpb.CancelReply:
        with self._order:
            rank = self.router.rank_of(request.request_id)
            if rank is None:
                # Remembered for a Reserve still to come only when it names no lease: one naming a lease
                # is for a lease already ended here (a failed attempt's, which the router retries under
                # the same request id), never for one a later Reserve grants.
                if request.request_id and not request.lease_id:
                    self.router.note_early_cancel(request.request_id)
                return wpb.CancelReply(found=False)
            self.inbox.put(CancelCommand(rank, request.request_id, request.lease_id, "cancelled by the router"))
        return wpb.CancelReply(found=True)

    def Renew(self, request: wpb.RenewRequest, context: grpc.ServicerContext) -> wpb.RenewReply:
        """Renew a router's open leases, one command per rank that holds some. The leases this
        worker no longer knows are answered at once; one that lapses while the command waits for the
        engine is not (its Decode call learns it)."""
        by_rank: dict[int, list[str]] = {}
        lost = []
        for ref in request.leases:
            rank = self.router.rank_of(ref.request_id)
            if rank is None:
                lost.append(ref.lease_id)
            else:
                by_rank.setdefault(rank, []).append(ref.lease_id)
        lease_ms = request.lease_ms or self.lease_ms
        for rank, lease_ids in by_rank.items():
            self.inbox.put(RenewCommand(rank, tuple(lease_ids), lease_ms))
        return wpb.RenewReply(lost_lease_ids=lost)

    def GetLoad(self, request: wpb.LoadRequest, context: grpc.ServicerContext) -> wpb.LoadReport:
        loads = list(self.router.loads)
        leader = loads[0]
        tokens, busy = sum(x.tokens_emitted for x in loads), sum(x.busy_s for x in loads)
        verifies, accepted = sum(x.verify_passes for x in loads), sum(x.accepted_drafts for x in loads)
        return wpb.LoadReport(
            worker_id=self.worker_id, role="decode", seq=self._seq.next(),
            queued_tokens=sum(x.queued_tokens for x in loads), running_requests=sum(x.running for x in loads),
            free_blocks=sum(x.free_blocks for x in loads), total_blocks=sum(x.total_blocks for x in loads),
            step_s=list(leader.step_s), agent_name=leader.agent_name, control_address=leader.control_address,
            held_blocks=sum(x.held_blocks for x in loads), cached_blocks=sum(x.cached_blocks for x in loads),
            queued_requests=sum(x.waiting for x in loads), decode_tokens_per_s=tokens / busy if busy else 0.0,
            mean_accepted_tokens=1 + accepted / verifies if verifies else 0.0,
            preempted_requests=sum(x.preempted for x in loads))

    def StreamKVEvents(self, request: wpb.KVEventsRequest, context: grpc.ServicerContext
                       ) -> Iterator[wpb.KVEventBatch]:
        yield from self.feed.stream(request.since_seq, self.snapshot, context)

    def CheckProbe(self, request: wpb.CheckProbeRequest, context: grpc.ServicerContext) -> wpb.CheckProbeReply:
        """The link probe's last step (prefill_workers/link_probe.py): once the probe lease's transfer
        ended, hash its blocks, compare, and free the lease. Needs the KV-transfer token."""
        check_token(context, self._token, "CheckProbe")
        rid = request.request_id
        rank = self.router.rank_of(rid)
        if rank is None:
            abort(context, wpb.ErrorDetail(code=wpb.ERROR_CODE_NOT_FOUND, field="request_id", request_id=rid,
                                           message=f"no probe lease for request {rid!r} here"))
        assert rank is not None
        future = self.router.expect_reserve(rid, rank, request.lease_id)  # the next output of this lease answers
        self.inbox.put(ProbeCheckCommand(rank, rid, request.lease_id, request.sha256))
        try:
            out = future.result(timeout=context.time_remaining() or RESERVE_TIMEOUT_S)
        except TimeoutError:
            self.router.forget(rid)
            self.inbox.put(CancelCommand(rank, rid, request.lease_id, "probe check timed out"))
            abort(context, wpb.ErrorDetail(code=wpb.ERROR_CODE_DEADLINE_EXCEEDED, request_id=rid,
                                           message="the probe's transfer did not end in time; lease freed"))
        if isinstance(out, Failed):
            abort(context, _detail(out))
        assert isinstance(out, ProbeChecked)
        return wpb.CheckProbeReply(verified=out.verified, sha256=out.sha256, num_bytes=out.num_bytes,
                                   num_blocks=out.num_blocks)


def _attach_command(request: wpb.DecodeRequest, rank: int) -> AttachCommand:
    """The call as an engine command; `ValueError` naming the field for a malformed call.

    The router resolved effort, budget and sampling (`router/requests.py`); they are taken as given.
    Kept are the checks of what a direct caller of this port could get wrong: an empty prompt, an
    effort outside 1-100, sampling outside its ranges (`SamplingParams`). Token ids against the
    vocabulary and the lease are the engine's (`DecodeEngine._new_sequence`), which knows both.
    """
    if not request.token_ids:
        raise ValueError("field `token_ids`: the prompt is empty")
    check_level(request.effort)
    s = request.sampling
    sampling = Sampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                        seed=s.seed if s.HasField("seed") else None, max_tokens=s.max_tokens,
                        stop_token_ids=tuple(s.stop_token_ids), stop=tuple(s.stop), logprobs=s.logprobs,
                        ignore_eos=s.ignore_eos)
    sampling.params(s.max_tokens)  # the ranges, naming the field
    first = None if request.prefill_locally else int(request.first_token)
    return AttachCommand(rank, request.request_id, request.lease_id, tuple(request.token_ids), first,
                         request.effort, sampling, request.deadline_unix_ms, request.replay_span)


def _reserve_reply(out: Reserved) -> wpb.ReserveReply:
    reply = wpb.ReserveReply(lease_id=out.lease_id, agent_name=out.agent_name, control_address=out.control_address,
                             block_ids=list(out.block_ids), num_cached_blocks=out.num_cached_blocks,
                             lease_deadline_unix_ms=out.lease_deadline_unix_ms)
    if out.reservation:
        reply.reservation.CopyFrom(kv_transfer_pb2.Reservation.FromString(out.reservation))
    if out.state_blocks:
        reply.state_room.CopyFrom(wpb.StateRoom(num_blocks=out.state_blocks, format_version=STATE_FORMAT_VERSION,
                                                dspark_taps=out.state_taps))
    return reply


def merge_tokens(outputs: list[Output]) -> list[Output]:
    """`outputs` (one request's, in order) with each run of consecutive `Tokens` joined into one:
    the tokens, log-probabilities and draft counts concatenated or added, as a reader of the stream
    would add them up."""
    merged: list[Output] = []
    for out in outputs:
        last = merged[-1] if merged else None
        if isinstance(out, Tokens) and isinstance(last, Tokens):
            merged[-1] = Tokens(out.request_id, last.token_ids + out.token_ids, last.logprobs + out.logprobs,
                                last.top_logprobs + out.top_logprobs, last.accepted_drafts + out.accepted_drafts,
                                last.draft_tokens + out.draft_tokens)
        else:
            merged.append(out)
    return merged


def _chunk(out: Tokens) -> wpb.TokenChunk:
    tops = [wpb.TokenTopLogprobs(token_ids=[t for t, _ in row], logprobs=[v for _, v in row])
            for row in out.top_logprobs]
    return wpb.TokenChunk(token_ids=list(out.token_ids), logprobs=list(out.logprobs),
                          accepted_drafts=out.accepted_drafts, top_logprobs=tops, draft_tokens=out.draft_tokens)


def _detail(out: Failed) -> wpb.ErrorDetail:
    return wpb.ErrorDetail(code=wire_code(out.kind), field=out.field, message=out.message, retry_after_ms=out.retry_after_ms,
                           request_id=out.request_id)


def _invalid(request_id: str, exc: ValueError) -> wpb.ErrorDetail:
    text = str(exc)
    field = text.split("`")[1] if text.count("`") >= 2 else ""
    return wpb.ErrorDetail(code=wpb.ERROR_CODE_INVALID_ARGUMENT, field=field, message=text, request_id=request_id)


def add_decode_service(server: grpc.Server, service: DecodeService) -> None:
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(service, server)  # type: ignore[no-untyped-call]
