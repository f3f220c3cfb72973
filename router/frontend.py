"""The public `Generation` service: validate, place, run the decode-first handshake, stream.

One request, in order (docs/architecture.md):
  prepare (tokenize, validate)  ->  admit (per-effort limits)  ->  place (policy)
  ->  Reserve on the decode worker  ->  Prefill stream on the prefill worker (its first token
  streamed to the client, and the Decode stream opened, as soon as it arrives: the prefill's
  `done`, sent once the KV transfer has closed, is read meanwhile)  ->  Decode stream  ->  Complete.
A request whose budget is one token is the prefill alone: no Reserve, no target, no Decode.
Deadlines propagate as call timeouts and `deadline_unix_ms`; a client cancellation cancels the
worker calls and sends `Cancel` to both workers. A prefill that fails before its first token is
retried on another prefill worker; a decode worker that dies mid-stream, or a KV transfer that fails
after the first token was streamed (the prefill is blamed when both workers report it), is replaced
by re-placing the prompt plus the tokens already streamed (its prefix is in the prefill side's
cache). Retries are bounded by `max_retries`; every failure ends with a precise status and no held
lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import grpc

from cedserve.common.request_limits import request_limits
from cedserve.model.effort import effort_class
from cedserve.model.tokenizer import TextCodec
from cedserve.proto import generation_pb2, generation_pb2_grpc, worker_pb2
from cedserve.router.admission import Admission
from cedserve.router.capacity import CLASSES, CapacityQueue
from cedserve.router.deadline import Deadline
from cedserve.router.errors import NO_CAPACITY, RequestError, invalid
from cedserve.router.leases import LeaseKeeper
from cedserve.router.metrics import REQUEST_PHASES, RouterMetrics
from cedserve.router.placement import (
    MeasuredLinks,
    NoCapacityError,
    NoWorkerError,
    Placement,
    RequestShape,
)
from cedserve.router.policy import RoutingPolicy
from cedserve.router.requests import ModelLimits, PreparedRequest
from cedserve.router.text import StreamingText
from cedserve.router.tokenize_pool import TokenizePool
from cedserve.router.workers import WorkerHandle, WorkerPool

log = logging.getLogger(__name__)

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.ABORTED, grpc.StatusCode.RESOURCE_EXHAUSTED}
_WORKER_CODES = {
    worker_pb2.ERROR_CODE_INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    worker_pb2.ERROR_CODE_RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    worker_pb2.ERROR_CODE_DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    worker_pb2.ERROR_CODE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    worker_pb2.ERROR_CODE_CANCELLED: grpc.StatusCode.CANCELLED,
    worker_pb2.ERROR_CODE_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    worker_pb2.ERROR_CODE_INTERNAL: grpc.StatusCode.INTERNAL,
    worker_pb2.ERROR_CODE_TRANSFER_FAILED: grpc.StatusCode.UNAVAILABLE,
}


class _NoRoom(Exception):
    """No decode worker has room for the request now: it waits for capacity (router/capacity.py)."""


class WorkerFailed(Exception):
    """A worker call failed in a way another worker may not (retry elsewhere)."""

    def __init__(self, worker_id: str, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"worker {worker_id}: {code.name}: {message}")
        self.worker_id, self.code, self.message = worker_id, code, message


@dataclass
class _Progress:
    """What has been streamed so far for one request (survives a decode-worker migration)."""

    output_ids: list[int] = field(default_factory=list)
    text: StreamingText | None = None
    cached_tokens: int = 0
    ttft_s: float = 0.0
    drafts: int = 0
    accepted: int = 0
    finish: generation_pb2.FinishReason = generation_pb2.FINISH_REASON_UNSPECIFIED
    kv_transfer_bytes: int = 0
    kv_transfer_s: float = 0.0
    kv_transfer_tail_s: float = 0.0
    decode_only: bool = False
    call_s: float = 0.0
    """When the worker call that brings the first token was opened (`time.monotonic`)."""
    releasing: asyncio.Future[None] | None = None
    """The unused decode lease's release (the first token ended the request), running while the last
    responses are written; the stream ends once it has."""


_DecodeCall: TypeAlias = "grpc.aio.UnaryStreamCall[worker_pb2.DecodeRequest, worker_pb2.DecodeEvent]"
_PrefillCall: TypeAlias = "grpc.aio.UnaryStreamCall[worker_pb2.PrefillRequest, worker_pb2.PrefillEvent]"
_LAST_EVENTS = frozenset({"complete", "error"})
"""A decode stream's events after which the worker sends nothing but the call's status."""
_SOLE_WORKER_PAUSE_S = 0.25
"""The pause before retrying on a worker that failed but is the only one of its role (doubling
per attempt): longer than a scheduling stall usually lasts, short against a request's life."""
_PREFILL_VERDICT_S = 1.0
"""How long a decode stream that failed before its first event waits for its prefill's end: when
the KV transfer between them failed, both report it, and the prefill worker is the one to blame
(the retry excludes it, not the decode worker)."""


class _ReadAhead:
    """A response stream read by a task of its own, so the next events arrive while the caller is
    busy (writing the last ones to its client); `take` returns everything received since.

    The task stops at the stream's last event (`complete` or `error`, docs/decode.md): its status
    follows on its own, and no read is left pending for `close` to cancel (a cancelled read cancels
    the call, one more operation on each side for a stream that had already ended).

    `upstream`, when given, is work the stream's first event depends on (the prefill that writes the
    decode worker's KV): if it fails before any event arrived, `take` raises its error (the stream
    would only wait for a transfer that is not coming)."""

    def __init__(self, call: _DecodeCall, upstream: asyncio.Future[None] | None = None) -> None:
        self._call = call
        self._events: list[worker_pb2.DecodeEvent] = []
        self._waiter: asyncio.Future[None] | None = None
        """Set while `take` waits: the reader wakes it (no event object to clear and set per event)."""
        self._eof = False
        self._started = False
        self._error: BaseException | None = None
        self._upstream_error: BaseException | None = None
        self._task = asyncio.ensure_future(self._read())
        if upstream is not None:
            upstream.add_done_callback(self._upstream_ended)

    def _upstream_ended(self, upstream: asyncio.Future[None]) -> None:
        error = None if upstream.cancelled() else upstream.exception()
        if error is not None and not self._started:
            self._upstream_error = error
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _read(self) -> None:
        try:
            # `read` rather than `async for`: leaving an `async for` at the last event would leave
            # gRPC's response generator for the loop to finalize (a task of its own)
            read = self._call.read
            while (event := await read()) is not grpc.aio.EOF:
                assert isinstance(event, worker_pb2.DecodeEvent)
                self._started = True
                self._events.append(event)
                self._wake()
                if event.WhichOneof("event") in _LAST_EVENTS:
                    break
        except BaseException as exc:  # handed to the reader (`take`), as `async for` would raise it there
            self._error = exc
        finally:
            self._eof = True
            self._wake()

    async def take(self) -> list[worker_pb2.DecodeEvent] | None:
        """The events received since the last call, waiting for one; None at the end of the stream;
        the stream's error once its events are taken; the upstream's error once it failed first."""
        while self._upstream_error is None and not self._events:
            if self._eof:
                if self._error is not None:
                    raise self._error
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._upstream_error is not None:
            raise self._upstream_error
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        self._task.cancel()


def _retrieve(task: asyncio.Future[None]) -> None:
    """Mark a background task's failure as seen (its caller judges it, or it no longer matters)."""
    if not task.cancelled():
        task.exception()


def _worker_error(worker_id: str, detail: worker_pb2.ErrorDetail) -> Exception:
    code = _WORKER_CODES.get(detail.code, grpc.StatusCode.INTERNAL)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return RequestError(code, detail.message, field=detail.field)
    return WorkerFailed(worker_id, code, detail.message)


class GenerationCore:
    """One request from a prepared prompt to its last response, whatever API carried it.

    The gRPC `Generation` service (`GenerationService` below) and the OpenAI-compatible HTTP API
    (router/http_api.py) both call `prepare` and then `generate`; neither this class nor anything
    it calls touches a transport's call object. Client cancellation arrives as the cancellation
    of the task iterating `generate`, which cancels the worker calls and sends `Cancel` to both
    workers; the deadline arrives as a `Deadline`.
    """

    def __init__(self, pool: WorkerPool, policy: RoutingPolicy, codec: TextCodec, limits: ModelLimits,
                 admission: Admission, metrics: RouterMetrics, max_retries: int, lease_ms: int,
                 block_bytes: int, metadata: tuple[tuple[str, str], ...] = (), *, links: MeasuredLinks,
                 max_request_bytes: int) -> None:
        self.pool, self.policy, self.codec, self.limits = pool, policy, codec, limits
        self.max_request_bytes = max_request_bytes
        """The public APIs' receive limit (`router.requests.message_limit`), published in the model card."""
        self.admission, self.metrics = admission, metrics
        self.max_retries, self.lease_ms, self.block_bytes = max_retries, lease_ms, block_bytes
        self.metadata = metadata
        self.leases = LeaseKeeper(pool, lease_ms, metrics, metadata)
        """Renews the leases this router waits on (a dead router's lapse within one lease)."""
        self.capacity = CapacityQueue(admission.capacity_wait_s())
        """Admitted requests waiting for room on a decode worker; a load report wakes each class's head
        (a request that ends while others wait has its decode worker polled at once, `_attempt`)."""
        pool.on_decode_load.append(self.capacity.wake)
        for klass in CLASSES:  # read at each scrape
            metrics.capacity_waiting.labels(klass).set_function(functools.partial(self.capacity.waiting, klass))
        # Every request's labelled series, looked up once here rather than per request (`labels` takes a
        # lock and builds a key); each so shows from the first scrape, at 0
        self._queue_s = {klass: metrics.queue_s.labels(klass) for klass in CLASSES}
        self._tpot_s = {klass: metrics.tpot_s.labels(klass) for klass in CLASSES}
        self._phase = {phase: metrics.request_phase_s.labels(phase) for phase in REQUEST_PHASES}
        self._placements = {kind: metrics.placements.labels(policy=policy.name, kind=kind)
                            for kind in ("decode_only", "disaggregated", "prefill_only")}
        # Prefill->decode rates learned from each PrefillDone's bytes and seconds (placement reads them).
        self.links = links
        self.tokenize = TokenizePool(codec, limits)
        self._tasks: set[asyncio.Task[None]] = set()
        """Work of finished requests still running (`_background`)."""

    async def prepare(self, request: generation_pb2.GenerateRequest) -> PreparedRequest:
        """Validate and tokenize (`router/requests.py`; a large prompt off the event loop,
        router/tokenize_pool.py); a refusal is counted and raised as `RequestError`."""
        try:
            return await self.tokenize.prepare(request)
        except RequestError as exc:
            self._count_error(exc)
            raise

    async def generate(self, prepared: PreparedRequest,
                       deadline: Deadline) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        """Admit, place and run one request: chunks, then one `complete`.

        Raises `RequestError` (counted in `cedserve_router_errors_total`) whether or not responses
        were already yielded; the caller turns it into its API's error, a status before the first
        response and an in-stream error after it. Every worker lease is ended before it propagates.
        """
        start = time.monotonic()
        try:
            async with self.admission.admit(prepared.effort, prepared.request_id):
                self._queue_s[effort_class(prepared.effort)].observe(time.monotonic() - start)
                # closed explicitly, so an abandoned stream ends its worker calls now, not at collection
                async with contextlib.aclosing(self._run(prepared, deadline, start)) as responses:
                    async for response in responses:
                        yield response
        except RequestError as exc:
            self._count_error(exc)
            raise

    def _count_error(self, exc: RequestError) -> None:
        self.metrics.errors.labels(code=exc.code.name).inc()
        if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.metrics.refusals.labels(reason=exc.reason or "other").inc()

    def model_card(self) -> generation_pb2.ModelCard:
        prompt_limits = request_limits(self.limits.max_context_tokens, self.max_request_bytes)
        return generation_pb2.ModelCard(id=self.limits.model_id, max_context_tokens=self.limits.max_context_tokens,
                                        vocab_size=self.limits.vocab_size,
                                        global_kv_bytes_per_token=self.block_bytes / self.limits.block_size,
                                        max_request_bytes=self.max_request_bytes,
                                        max_prompt_bytes=prompt_limits.max_prompt_bytes)

    # ------------------------------------------------------------------ orchestration

    async def _run(self, req: PreparedRequest, deadline: Deadline,
                   start: float) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        progress = _Progress(text=StreamingText(self.codec, req.stop))
        excluded: set[str] = set()
        failed: list[str] = []
        attempt = 0
        while True:
            try:
                async with contextlib.aclosing(
                        self._attempt(req, deadline, start, progress, frozenset(excluded))) as responses:
                    async for response in responses:
                        yield response
                break
            except WorkerFailed as exc:
                attempt += 1
                failed += [] if exc.worker_id in failed else [exc.worker_id]
                self.metrics.retries.labels(reason=exc.code.name).inc()
                log.warning("request %s: %s (attempt %d of %d)", req.request_id, exc, attempt, self.max_retries + 1)
                if attempt > self.max_retries:
                    raise RequestError(grpc.StatusCode.UNAVAILABLE, f"gave up after {attempt} attempts (failed on {', '.join(failed)}): {exc}",
                                       retry_after_s=1.0, request_id=req.request_id) from exc
                await self._exclude_or_pause(exc.worker_id, excluded, req,
                                             len(req.token_ids) + len(progress.output_ids), attempt, deadline)
        assert progress.text is not None
        tail = progress.text.finish()
        if tail:
            yield generation_pb2.GenerateResponse(request_id=req.request_id, chunk=generation_pb2.Chunk(text=tail))
        usage = generation_pb2.Usage(prompt_tokens=len(req.token_ids), cached_tokens=progress.cached_tokens,
                                     completion_tokens=len(progress.output_ids), draft_tokens=progress.drafts,
                                     accepted_draft_tokens=progress.accepted, ttft_s=progress.ttft_s,
                                     total_s=time.monotonic() - start, kv_transfer_bytes=progress.kv_transfer_bytes,
                                     kv_transfer_s=progress.kv_transfer_s,
                                     kv_transfer_tail_s=progress.kv_transfer_tail_s, decode_only=progress.decode_only)
        klass = effort_class(req.effort)
        if len(progress.output_ids) > 1:
            self._tpot_s[klass].observe(
                (usage.total_s - progress.ttft_s) / (len(progress.output_ids) - 1))
        self.metrics.prompt_tokens.inc(len(req.token_ids))
        self.metrics.cached_tokens.inc(progress.cached_tokens)
        yield generation_pb2.GenerateResponse(request_id=req.request_id, complete=generation_pb2.Complete(
            finish_reason=progress.finish, usage=usage))
        if progress.releasing is not None:  # no lease outlives the stream (shielded: it must finish)
            await asyncio.shield(progress.releasing)

    async def _exclude_or_pause(self, worker_id: str, excluded: set[str], req: PreparedRequest, prompt_len: int,
                                attempt: int, deadline: Deadline) -> None:
        """Before a retry: keep the failed worker out of it, unless that leaves the request nowhere
        to go (it was the only worker of its role, and no decode worker may prefill the prompt
        itself: the embedded default has one prefill worker). Then it is tried again after a pause,
        since its failures are the retryable kind (a stall that cost a KV link, a lease still being
        released), and the health checks take a dead worker out of placement anyway."""
        excluded.add(worker_id)
        handle = self.pool.workers.get(worker_id)
        if handle is None or self.pool.loads.num_workers(handle.role, excluded):
            return
        try:
            self._placement(req, prompt_len, frozenset(excluded))
            return  # placeable without it (a short prompt prefilled by its decode worker)
        except _NoRoom:
            return
        except RequestError as exc:
            if exc.code != grpc.StatusCode.UNAVAILABLE:
                return
        excluded.discard(worker_id)
        pause = _SOLE_WORKER_PAUSE_S * 2 ** (attempt - 1)
        remaining = deadline.remaining_s()
        await asyncio.sleep(pause if remaining is None else max(0.0, min(pause, remaining)))

    async def _place_and_reserve(self, req: PreparedRequest, prompt: tuple[int, ...], excluded: frozenset[str],
                                 deadline: Deadline, first_token_only: bool
                                 ) -> tuple[WorkerHandle, WorkerHandle | None, worker_pb2.ReserveReply | None]:
        """Place the request and lease its blocks, waiting in its class's capacity FIFO while no
        decode worker has room (router/capacity.py); a request behind others waits without trying.
        No lease (None) where `first_token_only` and a prefill worker was placed: its first token is
        the whole answer (`_prefill_only`)."""
        klass = effort_class(req.effort)
        if not self.capacity.waiting(klass):
            try:
                return await self._place_once(req, prompt, excluded, deadline, first_token_only)
            except _NoRoom as exc:
                log.debug("request %s waits for decode capacity: %s", req.request_id, exc)
        async with self.capacity.wait_in_line(klass, req.request_id) as waiter:
            waited = time.monotonic()
            try:
                while True:
                    await waiter.next_turn(deadline, self.admission.retry_after_s(klass))
                    try:
                        placed = await self._place_once(req, prompt, excluded, deadline, first_token_only)
                    except _NoRoom:
                        continue
                    self.metrics.capacity_admitted.labels(klass).inc()
                    return placed
            finally:
                self.metrics.capacity_wait_s.labels(klass).observe(time.monotonic() - waited)

    async def _place_once(self, req: PreparedRequest, prompt: tuple[int, ...], excluded: frozenset[str],
                          deadline: Deadline, first_token_only: bool
                          ) -> tuple[WorkerHandle, WorkerHandle | None, worker_pb2.ReserveReply | None]:
        start = time.monotonic()
        choice = self._placement(req, len(prompt), excluded)
        placed = time.monotonic()
        self._phase["place"].observe(placed - start)
        decode = self.pool.workers[choice.decode_id]
        prefill = None if choice.prefill_id is None else self.pool.workers[choice.prefill_id]
        if first_token_only and prefill is not None:
            self._placements["prefill_only"].inc()
            return decode, prefill, None
        self._placements["decode_only" if prefill is None else "disaggregated"].inc()
        lease = await self._reserve(decode, prefill, req, prompt, deadline)
        self._phase["reserve"].observe(time.monotonic() - placed)
        return decode, prefill, lease

    def _placement(self, req: PreparedRequest, prompt_len: int, excluded: frozenset[str]) -> Placement:
        if not self.pool.loads.num_workers("decode", excluded):
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker", retry_after_s=1.0)
        runs = self.pool.index.prefix_runs(req.block_hashes)
        shape = RequestShape(prompt_len, req.effort, self.limits.block_size, self.block_bytes)
        try:
            choice = self.policy.choose_from(shape, self.pool.loads, runs, self.links, excluded)
        except NoCapacityError as exc:
            largest = max((int(h.load.total_blocks) for h in self.pool.healthy("decode", excluded)
                           if h.load is not None), default=0)
            if shape.num_blocks > largest:  # room will never free up for it: no waiting
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; the largest decode worker has "
                                   f"{largest} blocks in all", retry_after_s=1.0, reason=NO_CAPACITY) from exc
            raise _NoRoom(str(exc)) from exc
        except NoWorkerError as exc:
            tried = f" (excluded after failures: {sorted(excluded)})" if excluded else ""
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"{exc}{tried}", retry_after_s=1.0) from exc
        return choice

    async def _attempt(self, req: PreparedRequest, deadline: Deadline, start: float,
                       progress: _Progress, excluded: frozenset[str]) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        # After a migration the prompt is the original plus what was already streamed.
        prompt = (*req.token_ids, *progress.output_ids)
        remaining_tokens = req.max_tokens - len(progress.output_ids)
        decode, prefill, lease = await self._place_and_reserve(req, prompt, excluded, deadline,
                                                               first_token_only=remaining_tokens == 1)
        if lease is None:
            assert prefill is not None  # `_place_once` leases for every decode-only placement
            async for response in self._prefill_only(prefill, req, prompt, deadline, progress, start):
                yield response
            return
        self.leases.hold(decode.worker_id, req.request_id, lease.lease_id)
        progress.decode_only = prefill is None
        if prefill is None:  # the decode worker reuses the leading blocks it holds
            progress.cached_tokens = max(progress.cached_tokens,
                                         min(lease.num_cached_blocks * self.limits.block_size, len(prompt)))
        call: _DecodeCall | None = None
        prefill_call: _PrefillCall | None = None
        prefill_rest: asyncio.Task[None] | None = None  # the prefill stream after its first token
        try:
            progress.call_s = time.monotonic()
            if prefill is None:
                call = self._start_decode(decode, lease, req, prompt, None, remaining_tokens, deadline)
                async for response in self._relay(call, decode, lease, req, progress, start):
                    yield response
                return
            prefill_call = self._start_prefill(prefill, req, prompt, deadline, self._decode_target(decode, lease))
            first, first_logprob = await self._first_token(prefill_call, prefill, progress)
            prefill_rest = asyncio.ensure_future(self._prefill_done(prefill_call, prefill, decode, progress))
            prefill_rest.add_done_callback(_retrieve)  # its failure is judged where it matters (`_blame`)
            self._note_first(progress, start)
            # the prefill worker reports the first token's own logprob, not its alternatives
            chunk = self._emit(req, progress, [first], [first_logprob], [])
            if progress.finish != generation_pb2.FINISH_REASON_UNSPECIFIED:
                # the unused lease goes once the prefill's transfer into it closed (not aborted under
                # it), while the last responses are written (`_run` waits for it before the end)
                progress.releasing = self._background(self._release_unused(prefill_rest, decode, req, lease))
                yield chunk
                return
            # Opened before the first token is written to the client and before the prefill's `done`:
            # the decode worker takes the call while the KV still arrives and starts once it is in.
            # Its budget is what it emits, after the first.
            call = self._start_decode(decode, lease, req, prompt, first, remaining_tokens - 1, deadline)
            yield chunk
            emitted = len(progress.output_ids)
            try:
                async for response in self._relay(call, decode, lease, req, progress, start, prefill_rest):
                    yield response
            except WorkerFailed as exc:
                if exc.worker_id != decode.worker_id or len(progress.output_ids) > emitted:
                    raise
                culprit = await self._blame(prefill_rest, exc)
                if culprit is exc:
                    raise
                raise culprit from exc
            await self._settle(prefill_rest)
        except (asyncio.CancelledError, GeneratorExit):
            # the client left: its task was cancelled, or its stream closed between two responses
            self._end_calls(call, prefill_call, prefill_rest)
            await self._cancel_everywhere(req.request_id, lease.lease_id, prefill, decode)
            raise
        except Exception:
            # a worker failed, or the request did (its deadline passed during prefill, a worker
            # refused it): the lease and any prefill job go now, not when the lease expires
            self._end_calls(call, prefill_call, prefill_rest)
            await self._cancel_everywhere(req.request_id, lease.lease_id, prefill, decode)
            raise
        finally:
            self.leases.drop(decode.worker_id, lease.lease_id)
            if self.capacity.any_waiting():  # the room this request held is free: let a waiting one see it
                self.pool.poll_now(decode.worker_id)

    async def _prefill_only(self, prefill: WorkerHandle, req: PreparedRequest, prompt: tuple[int, ...],
                            deadline: Deadline, progress: _Progress,
                            start: float) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        """A request whose budget is its first token: the prefill worker's first token is the whole
        answer, so no decode worker takes part. Its prefill has no target (nothing is sent): no
        `Reserve` before it and no `Cancel` of an unused lease after it, two calls and a KV transfer
        fewer than a disaggregated request's. The rest of the prefill stream (its `done`, once the
        prompt's blocks are in the worker's cache) is read by a task of this core's, not waited for."""
        progress.call_s = time.monotonic()
        call = self._start_prefill(prefill, req, prompt, deadline, None)
        try:
            first, first_logprob = await self._first_token(call, prefill, progress)
        except BaseException:  # the client left, the deadline passed or the worker failed: end its job now
            call.cancel()
            await asyncio.shield(self._cancel(prefill, req.request_id, ""))
            raise
        self._background(self._read_to_end(call, prefill))
        self._note_first(progress, start)
        # the prefill worker reports the first token's own logprob, not its alternatives
        yield self._emit(req, progress, [first], [first_logprob], [])

    async def _read_to_end(self, call: _PrefillCall, prefill: WorkerHandle) -> None:
        """Read a prefill stream whose first token was used to its end, so the call ends as the worker
        ends it (a dropped call would be cancelled); its failure no longer matters to the request. Its
        `done` follows the first token at once (nothing is sent): after `_PREFILL_VERDICT_S` the call
        is cancelled (a request without a deadline gives it no timeout)."""
        try:
            async with asyncio.timeout(_PREFILL_VERDICT_S):  # (wait_for may swallow a cancel: workers.py)
                await self._drain_prefill(call, prefill)
        except TimeoutError:
            log.debug("prefill-only request on %s: no end %.1f s after its first token", prefill.worker_id,
                      _PREFILL_VERDICT_S)
        except (WorkerFailed, RequestError) as exc:
            log.debug("prefill-only request on %s ended with %s after its first token", prefill.worker_id, exc)

    async def _drain_prefill(self, call: _PrefillCall, prefill: WorkerHandle) -> None:
        while await self._prefill_event(call, prefill) is not None:
            pass

    def _note_first(self, progress: _Progress, start: float) -> None:
        if not progress.ttft_s:
            now = time.monotonic()
            progress.ttft_s = now - start
            self.metrics.ttft_s.observe(progress.ttft_s)
            if progress.call_s:
                self._phase["first_token"].observe(now - progress.call_s)

    def _emit(self, req: PreparedRequest, progress: _Progress, token_ids: list[int], logprobs: list[float],
              top_logprobs: list[worker_pb2.TokenTopLogprobs]) -> generation_pb2.GenerateResponse:
        """The chunk of `token_ids` that still fits the request (its budget, stop tokens and strings);
        sets `progress.finish` when the request ends inside it."""
        assert progress.text is not None
        output = progress.output_ids
        kept = token_ids[: max(0, req.max_tokens - len(output))]
        for i, t in enumerate(kept):
            if t in req.stop_token_ids or t in self.limits.eos_token_ids:
                kept = kept[: i + 1]
                progress.finish = generation_pb2.FINISH_REASON_STOP
                break
        else:
            if kept and len(output) + len(kept) >= req.max_tokens:
                progress.finish = generation_pb2.FINISH_REASON_LENGTH
        output += kept
        text = progress.text.push(kept)
        if progress.text.stopped:
            progress.finish = generation_pb2.FINISH_REASON_STOP
        elif progress.finish != generation_pb2.FINISH_REASON_UNSPECIFIED:
            text += progress.text.finish()  # no token follows: what was held back goes now, not in a chunk of its own
        # filled in place: a Chunk built apart would be copied into the response
        response = generation_pb2.GenerateResponse(request_id=req.request_id)
        chunk = response.chunk
        chunk.SetInParent()  # a chunk even when empty, as before
        chunk.token_ids.extend(kept)
        chunk.text = text
        if req.logprobs:  # only when asked for: the workers may report them regardless
            chunk.logprobs.extend(logprobs[: len(kept)])
            for row in top_logprobs[: len(kept)]:
                chunk.top_logprobs.add().entries.extend(
                    generation_pb2.TokenLogprob(token_id=t, logprob=v) for t, v in zip(row.token_ids, row.logprobs))
        return response

    async def _reserve(self, decode: WorkerHandle, prefill: WorkerHandle | None, req: PreparedRequest,
                       prompt: tuple[int, ...], deadline: Deadline) -> worker_pb2.ReserveReply:
        """Decode-first: lease blocks on the decode worker for the prefill worker that will WRITE them."""
        assert decode.decode is not None
        timeout, _ = deadline.for_call()
        sender = prefill.load if prefill is not None else None
        try:
            reply: worker_pb2.ReserveReply = await decode.decode.Reserve(worker_pb2.ReserveRequest(
                request_id=req.request_id, prompt_tokens=len(prompt), lease_ms=self.lease_ms, cache_salt=req.cache_salt,
                sender_agent=sender.agent_name if sender else "",
                sender_control_address=sender.control_address if sender else "", token_ids=list(prompt)),
                timeout=timeout, metadata=self.metadata)
        except asyncio.CancelledError:
            # the client left while the worker may already hold a lease the reply never brought back:
            # cancel it by request id now rather than let it hold blocks until it expires
            await asyncio.shield(self._cancel(decode, req.request_id, ""))
            raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # full now (its load report was older): wait
                raise _NoRoom(f"decode worker {decode.worker_id}: {exc.details()}") from exc
            if exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                # as above: a lease may exist; shielded, since the deadline that ended this call cancels
                # the request's task too, which would take the Cancel call down with it
                await asyncio.shield(self._cancel(decode, req.request_id, ""))
            raise self._from_rpc(decode.worker_id, exc) from exc
        return reply

    @staticmethod
    def _decode_target(decode: WorkerHandle, lease: worker_pb2.ReserveReply) -> worker_pb2.DecodeTarget:
        """Where the prefill worker writes the prompt's KV: the decode worker's lease."""
        target = worker_pb2.DecodeTarget(worker_id=decode.worker_id, agent_name=lease.agent_name,
                                         control_address=lease.control_address, lease_id=lease.lease_id,
                                         num_cached_blocks=lease.num_cached_blocks, reservation=lease.reservation)
        if lease.HasField("state_room"):  # the decode worker expects the bounded state: ship it
            target.state_room.CopyFrom(lease.state_room)
        return target

    def _start_prefill(self, prefill: WorkerHandle, req: PreparedRequest, prompt: tuple[int, ...],
                       deadline: Deadline, target: worker_pb2.DecodeTarget | None) -> _PrefillCall:
        """Open the `Prefill` stream, into `target` (a decode worker's lease) or, None, into the prefill
        worker's cache alone (`_first_token` and `_prefill_done` read it)."""
        assert prefill.prefill is not None
        timeout, deadline_ms = deadline.for_call()
        call: _PrefillCall = prefill.prefill.Prefill(worker_pb2.PrefillRequest(
            request_id=req.request_id, token_ids=list(prompt), effort=req.effort, cache_salt=req.cache_salt,
            target=target, deadline_unix_ms=deadline_ms, sampling=self._sampling(req)),
            timeout=timeout, metadata=self.metadata)
        return call

    async def _prefill_event(self, call: _PrefillCall, prefill: WorkerHandle) -> worker_pb2.PrefillEvent | None:
        """The stream's next event, None at its end; its `error` event or failed call raised."""
        try:
            event = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise self._from_rpc(prefill.worker_id, exc) from exc
        if event is grpc.aio.EOF:
            return None
        assert isinstance(event, worker_pb2.PrefillEvent)
        if event.WhichOneof("event") == "error":
            raise _worker_error(prefill.worker_id, event.error)
        return event

    async def _first_token(self, call: _PrefillCall, prefill: WorkerHandle, progress: _Progress) -> tuple[int, float]:
        """Read the prefill stream up to its first token: (token, its logprob)."""
        while (event := await self._prefill_event(call, prefill)) is not None:
            if event.WhichOneof("event") == "first_token":
                progress.cached_tokens = max(progress.cached_tokens, int(event.first_token.cached_tokens))
                return int(event.first_token.token_id), float(event.first_token.logprob)
        raise WorkerFailed(prefill.worker_id, grpc.StatusCode.INTERNAL, "prefill ended without a first token")

    async def _prefill_done(self, call: _PrefillCall, prefill: WorkerHandle, decode: WorkerHandle,
                            progress: _Progress) -> None:
        """Read the rest of the prefill stream, to its `done` (the KV transfer closed): its bytes and
        seconds go to the usage and teach placement the pair's link rate."""
        while (event := await self._prefill_event(call, prefill)) is not None:
            if event.WhichOneof("event") == "done":
                progress.kv_transfer_bytes += int(event.done.bytes_sent)
                progress.kv_transfer_s += float(event.done.transfer_s)
                progress.kv_transfer_tail_s += float(event.done.transfer_tail_s)
                self.links.observe(prefill.worker_id, decode.worker_id, int(event.done.bytes_sent),
                                   float(event.done.transfer_s))
                return

    async def _blame(self, prefill_rest: asyncio.Task[None], decode_failure: WorkerFailed) -> Exception:
        """The failure to retry on when the decode stream failed before its first event: the
        prefill's, when it failed too (the KV transfer between them did; both report it), else the
        decode worker's."""
        await asyncio.wait({prefill_rest}, timeout=_PREFILL_VERDICT_S)
        error = prefill_rest.exception() if prefill_rest.done() and not prefill_rest.cancelled() else None
        return error if isinstance(error, Exception) else decode_failure

    async def _settle(self, prefill_rest: asyncio.Task[None]) -> None:
        """The request is complete: wait briefly for the prefill's `done` (it closes the transfer's
        accounting and comes within a step of the decode worker's start), never failing the request."""
        if not prefill_rest.done():  # it mostly is: `asyncio.wait` would cost a few futures for nothing
            await asyncio.wait({prefill_rest}, timeout=_PREFILL_VERDICT_S)
        if not prefill_rest.done():
            prefill_rest.cancel()
        elif not prefill_rest.cancelled() and prefill_rest.exception() is not None:
            log.debug("prefill of a completed request ended with %s", prefill_rest.exception())

    async def _release_unused(self, prefill_rest: asyncio.Task[None], decode: WorkerHandle, req: PreparedRequest,
                              lease: worker_pb2.ReserveReply) -> None:
        """The first token ended the request: once the prefill's transfer into the decode worker's
        lease closed, cancel the lease (never failing: the lease's expiry is the backstop)."""
        await self._settle(prefill_rest)
        await self._cancel(decode, req.request_id, lease.lease_id)

    def _background(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """`work` as a task this core holds until it ends (the loop holds tasks only weakly)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @staticmethod
    def _end_calls(call: _DecodeCall | None, prefill_call: _PrefillCall | None,
                   prefill_rest: asyncio.Task[None] | None) -> None:
        for c in (call, prefill_call):
            if c is not None:
                c.cancel()
        if prefill_rest is not None:
            prefill_rest.cancel()

    def _start_decode(self, decode: WorkerHandle, lease: worker_pb2.ReserveReply, req: PreparedRequest,
                      prompt: tuple[int, ...], first: int | None, max_tokens: int, deadline: Deadline) -> _DecodeCall:
        """Open the `Decode` stream (gRPC sends it at once; `_relay` reads it). `max_tokens`: what the
        decode worker emits, so it ends its stream itself where the request's budget ends."""
        assert decode.decode is not None
        timeout, deadline_ms = deadline.for_call()
        call: _DecodeCall = decode.decode.Decode(worker_pb2.DecodeRequest(
            request_id=req.request_id, lease_id=lease.lease_id, token_ids=prompt,
            first_token=first if first is not None else 0, effort=req.effort, sampling=self._sampling(req, max_tokens),
            deadline_unix_ms=deadline_ms, prefill_locally=first is None), timeout=timeout, metadata=self.metadata)
        return call

    async def _relay(self, call: _DecodeCall, decode: WorkerHandle, lease: worker_pb2.ReserveReply,
                     req: PreparedRequest, progress: _Progress, start: float,
                     upstream: asyncio.Future[None] | None = None) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The decode stream to the client. A reader task takes the worker's events while the last
        chunk is being written, and the tokens that arrived meanwhile leave as one chunk: a client (or
        a router loop) slower than the worker gets fewer, larger messages, and no token waits for a
        write it could have joined.

        Where the router ends the request at a budget, stop token or end-of-sequence id, the worker
        ends its stream there too (it was given the same budget and ids): its `complete` follows,
        and no `Cancel` is needed. A stop string only the router sees, or a worker that goes on
        regardless, is cancelled."""
        events = _ReadAhead(call, upstream)
        ended_here = False  # the router's verdict ended the request; only the worker's end may follow
        leased = True  # until the stream's first event: the worker took the lease over
        try:
            while (batch := await events.take()) is not None:
                if leased:
                    self.leases.drop(decode.worker_id, lease.lease_id)
                    leased = False
                token_ids: list[int] = []
                logprobs: list[float] = []
                top: list[worker_pb2.TokenTopLogprobs] = []
                complete: worker_pb2.DecodeComplete | None = None
                for event in batch:
                    kind = event.WhichOneof("event")
                    if kind == "tokens":
                        chunk = event.tokens
                        progress.accepted += chunk.accepted_drafts
                        progress.drafts += chunk.draft_tokens
                        token_ids += chunk.token_ids
                        if req.logprobs:  # only when asked for: the workers may report them regardless
                            logprobs += chunk.logprobs
                            top += chunk.top_logprobs
                    elif kind == "complete":
                        complete = event.complete
                        break
                    elif kind == "error":
                        if ended_here:  # the request is complete: only the worker's end failed
                            await self._stop_decode(call, decode, req, lease)
                            return
                        raise _worker_error(decode.worker_id, event.error)
                if token_ids and ended_here:  # the worker went on past the router's end: stop it
                    await self._stop_decode(call, decode, req, lease)
                    return
                if token_ids:
                    if not progress.ttft_s:
                        self._note_first(progress, start)
                    yield self._emit(req, progress, token_ids, logprobs, top)
                    ended_here = progress.finish != generation_pb2.FINISH_REASON_UNSPECIFIED
                if complete is not None:
                    # the chunks carry the drafts step by step; an older worker's only count is here
                    progress.drafts = max(progress.drafts, complete.draft_tokens)
                    if not ended_here:
                        progress.finish = (generation_pb2.FINISH_REASON_LENGTH if complete.finish_reason == "length"
                                           else generation_pb2.FINISH_REASON_STOP)
                    return
                if ended_here and progress.text is not None and progress.text.stopped:
                    await self._stop_decode(call, decode, req, lease)  # a stop string: the worker cannot know
                    return
        except grpc.aio.AioRpcError as exc:
            if ended_here:  # the request is complete: only the worker's end failed
                await self._cancel(decode, req.request_id, lease.lease_id)
                return
            raise self._from_rpc(decode.worker_id, exc) from exc
        finally:
            events.close()
        if not ended_here:
            raise WorkerFailed(decode.worker_id, grpc.StatusCode.UNAVAILABLE, "decode stream ended without completing")

    async def _stop_decode(self, call: _DecodeCall, decode: WorkerHandle, req: PreparedRequest,
                           lease: worker_pb2.ReserveReply) -> None:
        call.cancel()
        await self._cancel(decode, req.request_id, lease.lease_id)

    def _sampling(self, req: PreparedRequest, max_tokens: int | None = None) -> worker_pb2.SamplingParams:
        """The request's sampling as the router resolved it (`requests.prepare`): workers apply it as is."""
        params = worker_pb2.SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                           max_tokens=max_tokens or req.max_tokens,
                                           stop_token_ids=list(req.stop_token_ids), logprobs=req.logprobs)
        if req.seed is not None:
            params.seed = req.seed
        return params

    def _from_rpc(self, worker_id: str, exc: grpc.aio.AioRpcError) -> Exception:
        code = exc.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RequestError(code, "the request's deadline passed before it finished")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return invalid("prompt", exc.details() or "rejected by a worker")
        if code in _RETRYABLE:
            return WorkerFailed(worker_id, code, exc.details() or "")
        return RequestError(code, exc.details() or code.name)

    async def _cancel(self, worker: WorkerHandle, request_id: str, lease_id: str) -> None:
        stub = worker.prefill or worker.decode
        assert stub is not None
        try:
            await stub.Cancel(worker_pb2.CancelRequest(request_id=request_id, lease_id=lease_id), timeout=2.0,
                              metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:  # the worker's lease expiry is the backstop
            log.warning("cancel of request %s on %s failed (%s): what it holds waits for its lease to expire",
                        request_id, worker.worker_id, exc.code().name)

    async def _cancel_everywhere(self, request_id: str, lease_id: str, prefill: WorkerHandle | None,
                                 decode: WorkerHandle) -> None:
        # Shielded: the caller may itself be a cancelled task, and the workers must still hear it.
        tasks = [self._cancel(decode, request_id, lease_id)]
        if prefill is not None:
            tasks.append(self._cancel(prefill, request_id, lease_id))
        await asyncio.shield(asyncio.gather(*tasks))


class GenerationService(generation_pb2_grpc.GenerationServicer):
    """The public gRPC API: a thin adapter from the call's context to `GenerationCore`."""

    def __init__(self, core: GenerationCore) -> None:
        self.core = core

    async def Generate(self, request: generation_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generation_pb2.GenerateResponse]:
        try:
            prepared = await self.core.prepare(request)
        except RequestError as exc:
            await context.abort_with_status(exc.to_status())
            return
        started_stream = False
        try:
            async for response in self.core.generate(prepared, Deadline.after(context.time_remaining())):
                started_stream = True
                yield response
        except RequestError as exc:
            if not started_stream:
                await context.abort_with_status(exc.to_status())  # raises: the call ends with the status
            yield generation_pb2.GenerateResponse(request_id=prepared.request_id, error=generation_pb2.StreamError(
                grpc_code=exc.code.value[0], message=exc.message, field=exc.field,
                retry_after_ms=int(exc.retry_after_s * 1000)))

    async def CountTokens(self, request: generation_pb2.CountTokensRequest,
                          context: grpc.aio.ServicerContext) -> generation_pb2.CountTokensResponse:
        shim = generation_pb2.GenerateRequest(model=request.model, prompt=request.prompt, effort=request.effort)
        try:
            prepared = await self.core.tokenize.prepare(shim)
        except RequestError as exc:
            await context.abort_with_status(exc.to_status())
            raise AssertionError("unreachable") from exc
        return generation_pb2.CountTokensResponse(num_tokens=len(prepared.token_ids), token_ids=prepared.token_ids)

    async def ListModels(self, request: generation_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> generation_pb2.ListModelsResponse:
        return generation_pb2.ListModelsResponse(models=[self.core.model_card()])
