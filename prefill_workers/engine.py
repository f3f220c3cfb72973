"""`PrefillEngine`: the encoder-only prefill loop that writes compact KV into paged blocks and ships them.

One engine thread owns the model, the cache manager and every job's state; other threads talk to it
through a queue of closures (`submit`, `cancel`, transfer completions, `call`). One step:

1. admit waiting requests (earliest due first: arrival plus a slack that grows with the effort,
   `PrefillScheduler.admit_waiting`): allocate blocks with prefix-cache
   hits (`KVCacheManager.admit`), open the transfer into the decode worker's reservation, rebuild
   the encoder's bounded state after a hit (`load_state` + `CEDModel.replay` over
   `prefix_replay_span` tokens) and queue the cached blocks for sending;
2. compute the planned chunks: `encode_chunk` (encoder layers + the decoder KV source's compressor and
   index keys), `store_records` into the request's blocks, `commit` whole blocks to the prefix cache
   (KV events), and `write_blocks` the finished blocks, which move while the next chunk computes;
3. after a prompt's last chunk: queue the last blocks with `last=True` (the closing notification),
   run the decoder over the last `replay_span` boundary states (`replay_decoder`), sample the first
   token and stream it at once; `PrefillDone` (with the `PrefillHandoff`) follows when the transfer
   layer reports DONE. Blocks are freed after the transfer layer's `on_finish`, on every path.
   When the decode target reserved room for the bounded decode state (`TransferTarget.state_room`),
   the last KV blocks go without `last`; once the first token is out, the replay's state (with
   DSpark taps when asked) is encoded (`cedserve.model.state_format`) into scratch blocks, which
   close the transfer instead.

A prefix hit whose uncached suffix is shorter than the replay span recomputes the few cached blocks
the span needs (their records are not rewritten: they live in shared blocks), so the first token
always sees `min(replay_span, prompt_len)` boundary states.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import torch

from cedserve.common.errors import (
    CancelledError,
    DeadlineExceededError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnavailableError,
)
from cedserve.kv_transfer.errors import FailureCause, KVTransferError
from cedserve.kv_transfer.protocol import KVSender
from cedserve.kv_transfer.state import TransferResult, TransferState
from cedserve.model import kernel_warmup
from cedserve.model.cache.errors import CacheExhaustedError, TierIOError
from cedserve.model.cache.manager import KVCacheManager, state_owner
from cedserve.model.effort import effort_class, queue_due_s
from cedserve.model.network import BoundaryHidden, CEDModel, GlobalKVRecords
from cedserve.model.paged_attention import enable_paged_attention, unsupported
from cedserve.model.paged_kv import load_state, store_bytes, store_records
from cedserve.model.prefill_runner import PrefillRunner, PrefillRunnerConfig
from cedserve.model.sampling import make_generator, sample
from cedserve.model.state import SequenceState
from cedserve.model.state_format import STATE_FORMAT_VERSION, BoundedState, encode_state
from cedserve.prefill_workers.config import PrefillWorkerConfig
from cedserve.prefill_workers.job import Phase, PrefillFailure, PrefillJob
from cedserve.prefill_workers.metrics import PrefillMetrics
from cedserve.prefill_workers.scheduler import PrefillScheduler, ScheduledChunk
from cedserve.prefill_workers.validation import PrefillSpec, StateRoom
from cedserve.proto import worker_pb2 as wpb
from cedserve.serving.errors import error_kind
from cedserve.serving.load import RateMeter

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class EngineStats:
    """What load reports and gauges read; replaced as a whole after every step."""

    queued_tokens: int = 0
    running_requests: int = 0
    free_blocks: int = 0
    """Free plus idle cached (evictable) blocks: what a new request can get."""
    held_blocks: int = 0
    cached_blocks: int = 0
    total_blocks: int = 0
    tokens_per_s: float = 0.0


class PrefillEngine:
    """See the module docstring. `sender` is None for a worker that only warms its cache."""

    def __init__(self, model: CEDModel, cache: KVCacheManager, sender: KVSender | None,
                 config: PrefillWorkerConfig, metrics: PrefillMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        config.check_block_size(cache.block_size)
        self.model = model
        self.clock = clock
        """Seconds for arrivals, queue order and latencies (a benchmark may run the engine on its own)."""
        if model.embed.weight.device.type == "cuda":  # before any kernel is picked
            torch.backends.cuda.matmul.allow_tf32 = config.matmul_tf32
        self.paged_attention = enable_paged_attention(model, config.paged_attention, "prefill.paged_attention",
                                                      cpu_auto="off")
        self.cache = cache
        self.sender = sender
        self.config = config
        self.metrics = metrics if metrics is not None else PrefillMetrics()
        self.scheduler = PrefillScheduler(config.chunk_tokens, config.step_token_budget, cache.block_size,
                                          config.max_running_requests)
        self.rate = RateMeter(config.load_window_s)
        self._jobs: dict[str, PrefillJob] = {}
        self._lock = threading.Lock()  # guards _jobs membership and _accepting
        self._accepting = True
        self._inbox: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats = EngineStats(total_blocks=cache.pool.num_blocks)
        self.warmup = self._warm_up()
        self.runner = self._make_runner()
        self._publish_stats()

    def _warm_up(self) -> kernel_warmup.WarmupReport | None:
        """Compile the kernels' variants before serving (`cedserve.model.kernel_warmup`), on CUDA with
        the kernels on and `prefill.kernel_warmup` set."""
        if not self.config.kernel_warmup or not kernel_warmup.wanted(self.model, self.paged_attention):
            return None
        config = self.config
        limit = config.prompt_limit(self.model.config.max_position_embeddings)
        report = kernel_warmup.warm_up_prefill(self.model, limit, config.chunk_tokens, config.replay_span)
        log.info("kernel warm-up: %d cells in %.1f s (contexts %s)", report.cells, report.seconds, report.contexts)
        return report

    def _make_runner(self) -> PrefillRunner | None:
        """The prefill runner when `prefill.runner` asks for it (and, for "auto", on CUDA with a model it
        suits), its graphs captured on CUDA."""
        config, model = self.config, self.model
        cuda = model.embed.weight.device.type == "cuda"
        if config.runner == "off" or (config.runner == "auto" and not cuda):
            return None
        reason = "a memory-mapped Engram store" if model.engram_store is not None else unsupported(model.config)
        if reason is not None:
            if config.runner == "on":
                raise ValueError(f"config field `prefill.runner`: the prefill runner cannot run this model: {reason}")
            log.info("prefill runner off: %s", reason)
            return None
        runner = PrefillRunner(model, PrefillRunnerConfig(
            config.prompt_limit(model.config.max_position_embeddings), config.runner_buckets, config.runner_slots,
            config.runner_cuda_graphs))
        report = runner.capture()
        log.info("prefill runner: %d slots, buckets %s, graphs %s in %.1f s (%d MiB)", config.runner_slots,
                 list(runner.buckets), list(report.buckets), report.seconds, report.graph_pool_bytes >> 20)
        return runner

    # ------------------------------------------------------------------ any thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="prefill-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(lambda: None)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def submit(self, spec: PrefillSpec) -> PrefillJob:
        """Queue a checked request; its events arrive on the returned job's `events`. Raises
        `UnavailableError` (draining), `InvalidArgumentError` (request id in flight) or
        `ResourceExhaustedError` (queue full)."""
        job = PrefillJob(spec, arrived_s=self.clock())
        with self._lock:
            self._check_admissible(spec)
            self._jobs[spec.request_id] = job
        self._inbox.put(lambda: self._on_submit(job))
        return job

    def cancel(self, request_or_lease_id: str, detail: str = "cancelled by the caller") -> bool:
        """Cancel by prefill request id or lease id; False when no such request is in flight."""
        with self._lock:
            job = self._jobs.get(request_or_lease_id) or next(
                (j for j in self._jobs.values() if j.transfer_id == request_or_lease_id), None)
        if job is None:
            return False
        self._inbox.put(lambda: self._fail(job, CancelledError(detail, request_id=job.request_id),
                                           FailureCause.CANCELLED))
        return True

    def call(self, fn: Callable[[], T], timeout_s: float = 10.0) -> T:
        """Run `fn` on the engine thread (e.g. `cache.snapshot_events`) and return its result."""
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except Exception as exc:  # handed to the caller, who re-raises it
                future.set_exception(exc)

        self._inbox.put(run)
        return future.result(timeout_s)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Queue `fn` for the engine thread and return at once (safe from transfer callbacks)."""
        self._inbox.put(fn)

    def stats(self) -> EngineStats:
        return self._stats

    def alive(self) -> bool:
        """The engine thread is running (liveness)."""
        return self._thread is not None and self._thread.is_alive()

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False
        self.metrics.draining.set(1)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._jobs)

    def hand_back(self, detail: str) -> None:
        """Fail every request in flight with UNAVAILABLE (the router retries elsewhere)."""
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            self._inbox.put(self._hand_back_one(job, detail))

    def _hand_back_one(self, job: PrefillJob, detail: str) -> Callable[[], None]:
        error = UnavailableError(detail, retry_after_ms=self.config.retry_after_ms, request_id=job.request_id)
        return lambda: self._fail(job, error, FailureCause.SHUTDOWN)

    def _check_admissible(self, spec: PrefillSpec) -> None:
        rid = spec.request_id
        if not self._accepting:
            raise UnavailableError("worker is draining; retry on another prefill worker",
                                   retry_after_ms=self.config.retry_after_ms, request_id=rid)
        if rid in self._jobs:
            raise InvalidArgumentError(f"request {rid!r} is already in flight here", field="request_id",
                                       request_id=rid)
        queued = sum(j.uncomputed_tokens for j in self._jobs.values())
        if queued + spec.prompt_len > self.config.max_queued_tokens:
            raise ResourceExhaustedError(f"{queued} prompt tokens queued; this prompt of {spec.prompt_len} would "
                                         f"exceed max_queued_tokens {self.config.max_queued_tokens}",
                                         retry_after_ms=self.config.retry_after_ms, request_id=rid)

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.step(self.config.idle_poll_s)
            except Exception:  # a bug in the loop itself: log it and keep serving the other requests
                log.exception("prefill engine step failed")

    def step(self, idle_wait_s: float = 0.0) -> int:
        """One engine step; returns the tokens computed. Waits up to `idle_wait_s` for work when idle."""
        self._process_inbox(idle_wait_s if not self.scheduler.num_running else 0.0)
        self._expire()
        self.scheduler.admit_waiting(self._admit)
        plan = self.scheduler.schedule()
        start = time.perf_counter()
        for chunk in plan:
            self._run_chunk_safely(chunk)
        tokens = sum(c.num_tokens for c in plan)
        if plan:
            elapsed = time.perf_counter() - start
            self.rate.record(tokens, elapsed)
            self.metrics.step_seconds.observe(elapsed)
        else:
            self._poll_cache()
        self._publish_stats()
        return tokens

    def _process_inbox(self, wait_s: float) -> None:
        try:
            self._inbox.get(timeout=wait_s)() if wait_s > 0 else self._inbox.get_nowait()()
        except queue.Empty:
            return
        while True:
            try:
                self._inbox.get_nowait()()
            except queue.Empty:
                return

    def _on_submit(self, job: PrefillJob) -> None:
        if job.phase is Phase.WAITING and job.request_id in self._jobs:
            due = queue_due_s(job.arrived_s, job.spec.effort, self.config.effort_queue_slack_s)
            self.scheduler.add(job.request_id, job.spec.prompt_len, due)

    def _expire(self) -> None:
        now = time.time()
        for job in list(self._jobs.values()):
            deadline = job.spec.deadline_unix_s
            if deadline is not None and now >= deadline and job.phase in (Phase.WAITING, Phase.RUNNING):
                self._fail(job, DeadlineExceededError("deadline passed during prefill", request_id=job.request_id),
                           FailureCause.DEADLINE)

    # ------------------------------------------------------------------ admission

    def _admit(self, request_id: str) -> int | None:
        """Blocks, transfer and restored prefix for a waiting request: its first position to compute."""
        job = self._jobs[request_id]
        start = time.perf_counter()
        try:
            self.cache.admit(request_id, job.spec.token_ids, job.spec.cache_salt)
        except CacheExhaustedError as exc:
            if self.scheduler.num_running or any(j.admitted for j in self._jobs.values()):
                return None  # blocks come back as running requests finish
            self._fail(job, exc, FailureCause.CANCELLED)
            return None
        job.admitted = True
        self.metrics.queue_seconds.labels(effort_class(job.spec.effort)).observe(
            self.clock() - job.arrived_s)
        job.shared_tokens = self.cache.finish_onload(request_id)
        job.block_ids = self.cache.block_table(request_id)
        if not self._open_transfer(job):
            return None
        job.phase = Phase.RUNNING
        first = self._restore_prefix(job)
        self._ship(job, job.shared_tokens // self.cache.block_size, last=False)
        self.metrics.phases["admit"].observe(time.perf_counter() - start)
        return first

    def _open_transfer(self, job: PrefillJob) -> bool:
        target = job.spec.target
        if target is None or self.sender is None:
            if target is not None:
                self._fail(job, InvalidArgumentError("this worker has no transfer agent", field="target",
                                                     request_id=job.request_id), FailureCause.INVALID)
                return False
            return True
        job.next_block = target.num_cached_blocks
        timeout = self.config.transfer_timeout_s or None
        try:
            self.sender.open(target.reservation, timeout_s=timeout, on_finish=lambda r: self._transfer_ended(job, r))
        except KVTransferError as exc:  # INVALID: the receiver holds no such reservation (unknown lease)
            self._fail(job, exc, exc.cause)
            return False
        except ValueError as exc:
            self._fail(job, InvalidArgumentError(str(exc), field="target.reservation", request_id=job.request_id),
                       FailureCause.INVALID)
            return False
        job.transfer_open = True
        return True

    def _restore_prefix(self, job: PrefillJob) -> int:
        """A fresh sequence state, with the cached prefix's global KV loaded and the encoder's bounded
        state rebuilt by replay. Returns the first position to compute."""
        bs, prompt_len = self.cache.block_size, job.spec.prompt_len
        span_in_prefix = max(0, min(job.spec.replay_span, prompt_len) - (prompt_len - job.shared_tokens))
        use = max(0, job.shared_tokens - math.ceil(span_in_prefix / bs) * bs)
        job.state = self.model.new_state()
        job.cached_tokens = use
        if use == 0:
            return 0
        load_state(self.cache.layout, self.cache.pool.storage, job.block_ids, use, job.state)
        job.state.position = use
        replay = min(self.config.prefix_replay_span, use)
        if replay:
            self.model.replay(torch.as_tensor(job.spec.token_ids[use - replay:use]), job.state)
            job.replayed_tokens += replay
        return use

    # ------------------------------------------------------------------ computing

    def _run_chunk_safely(self, chunk: ScheduledChunk) -> None:
        job = self._jobs.get(chunk.request_id)
        if job is None or job.phase is not Phase.RUNNING:
            return
        try:
            self._run_chunk(job, chunk)
        except KVTransferError as exc:  # the transfer ended under us (dead peer, deadline)
            self._fail(job, exc, exc.cause)
        except Exception as exc:  # a bug or a device error: fail this request, keep the others
            log.exception("prefill of request %r failed", job.request_id)
            self._fail(job, exc, FailureCause.CANCELLED)

    def _run_chunk(self, job: PrefillJob, chunk: ScheduledChunk) -> None:
        assert job.state is not None
        start = time.perf_counter()
        tokens = job.spec.token_ids[chunk.start:chunk.end]  # host ids: checked there, copied once
        slot = self._runner_slot(job)
        if slot is not None:
            assert self.runner is not None
            encoded = self.runner.encode(slot, tokens)
        else:
            encoded = self.model.encode_chunk(tokens, job.state)
        records = _unshared(encoded.global_kv, job.shared_tokens, job.state)
        store_records(self.cache.layout, self.cache.pool.storage, job.block_ids, records)
        job.boundary = _tail(job.boundary, encoded.boundary, job.spec.replay_span)
        self.cache.commit(job.request_id, chunk.end)
        job.computed_tokens += chunk.num_tokens
        elapsed = time.perf_counter() - start
        job.compute_s += elapsed
        self.metrics.phases["compute"].observe(elapsed)
        if chunk.last:
            self._finish_compute(job)
        else:
            self._ship(job, chunk.end // self.cache.block_size, last=False)

    def _runner_slot(self, job: PrefillJob) -> int | None:
        """The job's runner slot: taken at its first chunk when one is free (its state loaded into it),
        else the job runs eagerly to its end."""
        if job.runner_slot is not None or job.eager:
            return job.runner_slot
        slot = self.runner.acquire() if self.runner is not None else None
        if self.runner is None or slot is None:
            job.eager = True
            return None
        assert job.state is not None
        self.runner.load(slot, job.state)
        job.runner_slot = slot
        return slot

    def _leave_runner(self, job: PrefillJob, keep_state: bool) -> None:
        """Give the job's runner slot back, with its state first when `keep_state`."""
        slot, job.runner_slot = job.runner_slot, None
        if slot is None or self.runner is None:
            return
        if keep_state:
            job.state = self.runner.export(slot)
        self.runner.release(slot)

    def _finish_compute(self, job: PrefillJob) -> None:
        self.scheduler.finish(job.request_id)
        self._leave_runner(job, keep_state=True)
        room = job.spec.target.state_room if job.spec.target is not None else None
        self._ship(job, math.ceil(job.spec.prompt_len / self.cache.block_size), last=room is None)
        start = time.perf_counter()
        job.first_token, taps = self._first_token(job, room is not None and room.dspark_taps)
        job.phase = Phase.CLOSING
        job.first_token_s = self.clock()
        self.metrics.first_token_seconds.observe(job.first_token_s - job.arrived_s)
        job.emit(wpb.PrefillEvent(first_token=job.first_token))
        # The token leaves before the bounded state is encoded and shipped: the decode worker needs
        # the state only once the router's Decode call (opened at this token) reaches it, and the
        # transfer closes with it either way. A failure from here on fails the transfer after the
        # first token, which the router already handles (it re-places the prompt plus that token).
        if room is not None:
            self._ship_state(job, room, taps)
        job.compute_s += time.perf_counter() - start
        job.state, job.boundary = None, None
        if not job.transfer_open:
            self._complete(job)

    def _first_token(self, job: PrefillJob, with_taps: bool) -> tuple[wpb.FirstToken, torch.Tensor | None]:
        """Decoder replay over the last boundary states, then sampling (the report's bounded replay).
        With `with_taps`, also the span's DSpark taps `[n, n_taps, hc, hidden]`."""
        assert job.state is not None and job.boundary is not None
        start = time.perf_counter()
        span = job.boundary.last(job.spec.replay_span)
        taps = None
        if with_taps:
            out = self.model.replay_decoder_with_taps(span, job.state)
            logits, taps = out.logits[-1], out.taps
        else:
            logits = self.model.replay_decoder(span, job.state)[-1]  # [vocab]
        job.replayed_tokens += int(span.positions.shape[0])
        params = job.spec.sampling
        token = sample(logits, params, make_generator(params, logits.device))
        logprob = float(torch.log_softmax(logits.float(), dim=-1)[token])
        self.metrics.phases["first_token"].observe(time.perf_counter() - start)
        return wpb.FirstToken(token_id=token, logprob=logprob, cached_tokens=job.cached_tokens), taps

    def _ship_state(self, job: PrefillJob, room: StateRoom, taps: torch.Tensor | None) -> None:
        """Encode the sequence's bounded state into scratch blocks and close the transfer with them."""
        assert job.state is not None
        start = time.perf_counter()
        window = self.model.config.sliding_window
        mean_taps = None if taps is None else taps[-window:].mean(dim=2)  # [n, n_taps, hidden]
        data = encode_state(BoundedState.capture(job.state, mean_taps), self.model.config)
        job.state_blocks = self.cache.allocate_scratch(state_owner(job.request_id), room.num_blocks)
        store_bytes(self.cache.pool.storage, job.state_blocks, data)
        job.state_bytes = len(data)
        self.metrics.phases["ship_state"].observe(time.perf_counter() - start)
        self._send(job, job.state_blocks, last=True)

    def _ship(self, job: PrefillJob, upto_block: int, last: bool) -> None:
        """Queue prompt blocks `[next_block, upto_block)` for the decode worker (returns at once)."""
        tid = job.transfer_id
        if tid is None or self.sender is None or not job.transfer_open:
            return
        ids = job.block_ids[job.next_block:upto_block]
        if not ids and not last:
            return
        self._send(job, ids, last)
        job.next_block = max(job.next_block, upto_block)

    def _send(self, job: PrefillJob, block_ids: list[int], last: bool) -> None:
        tid = job.transfer_id
        assert tid is not None and self.sender is not None
        start = time.perf_counter()
        if block_ids and self.cache.pool.storage.is_cuda:
            torch.cuda.synchronize(self.cache.pool.storage.device)  # the blocks must hold their final bytes
        self.sender.write_blocks(tid, block_ids, last=last)
        self.metrics.phases["ship"].observe(time.perf_counter() - start)

    # ------------------------------------------------------------------ endings

    def _transfer_ended(self, job: PrefillJob, result: TransferResult) -> None:
        """`on_finish` from the transfer layer's thread: hand it to the engine thread."""
        self._inbox.put(lambda: self._transfer_ended_here(job, result))

    def _transfer_ended_here(self, job: PrefillJob, result: TransferResult) -> None:
        job.transfer = result
        if job.phase is Phase.ENDED:
            self._release(job)
        elif result.state is not TransferState.DONE:
            error = result.error or KVTransferError(result.request_id, FailureCause.INVALID, result.state.value)
            self._fail(job, error, error.cause)
        elif job.phase is Phase.CLOSING:
            self._complete(job)

    def _complete(self, job: PrefillJob) -> None:
        assert job.first_token is not None
        job.phase = Phase.ENDED
        done = self._done_message(job)
        self.metrics.requests.labels("ok").inc()
        self.metrics.request_seconds.observe(self.clock() - job.arrived_s)
        for kind, n in (("prompt", job.spec.prompt_len), ("cached", job.cached_tokens),
                        ("computed", job.computed_tokens), ("replayed", job.replayed_tokens)):
            self.metrics.tokens.labels(kind).inc(n)
        job.emit(wpb.PrefillEvent(done=done))
        self._release(job)

    def _done_message(self, job: PrefillJob) -> wpb.PrefillDone:
        assert job.first_token is not None
        result, target = job.transfer, job.spec.target
        done = wpb.PrefillDone(prompt_tokens=job.spec.prompt_len, cached_tokens=job.cached_tokens,
                               computed_tokens=job.computed_tokens, prefill_s=job.compute_s,
                               bytes_sent=result.num_bytes if result else 0,
                               transfer_s=result.duration_s if result else 0.0,
                               transfer_tail_s=(result.tail_s or 0.0) if result else 0.0)
        if target is not None:
            done.handoff.CopyFrom(wpb.PrefillHandoff(
                request_id=job.request_id, lease_id=target.lease_id, num_tokens=job.spec.prompt_len,
                first_block_index=target.num_cached_blocks, num_blocks_sent=target.num_kv_blocks,
                replay_span=min(job.spec.replay_span, job.spec.prompt_len), first_token=job.first_token.token_id,
                first_logprob=job.first_token.logprob, state_bytes=job.state_bytes,
                state_format_version=STATE_FORMAT_VERSION if job.state_bytes else 0))
        return done

    def _fail(self, job: PrefillJob, exc: BaseException, cause: FailureCause) -> None:
        """End a request with an error event; abort its transfer; free its blocks once released."""
        if job.phase is Phase.ENDED:
            return
        job.phase = Phase.ENDED
        self._leave_runner(job, keep_state=False)
        job.state, job.boundary = None, None
        self.scheduler.remove(job.request_id)
        self.metrics.requests.labels(error_kind(exc).value).inc()
        job.emit(PrefillFailure(exc))
        tid = job.transfer_id
        if job.transfer_pending and tid is not None and self.sender is not None:
            self.sender.abort(tid, cause, str(exc) or type(exc).__name__)
        self._release(job)

    def _release(self, job: PrefillJob) -> None:
        """Free the job's blocks unless the transfer layer may still read them (then `on_finish` does)."""
        if job.transfer_pending:
            return
        if job.admitted:
            self.cache.free(job.request_id)
            job.admitted = False
        if job.state_blocks:
            self.cache.free(state_owner(job.request_id))
            job.state_blocks = []
        if job.state is not None:
            job.state.release_paged()  # the paged attention's copy of its records, at once
        with self._lock:
            if self._jobs.get(job.request_id) is job:
                del self._jobs[job.request_id]

    # ------------------------------------------------------------------ bookkeeping

    def _poll_cache(self) -> None:
        try:
            self.cache.poll()
        except TierIOError as exc:
            log.warning("cache tier I/O: %s", exc)

    def _publish_stats(self) -> None:
        pool = self.cache.pool
        idle = pool.num_idle
        evictable = self.cache.prefix.num_evictable()
        queued = sum(j.uncomputed_tokens for j in list(self._jobs.values()))
        self._stats = EngineStats(queued, len(self._jobs), pool.num_free + evictable,
                                  pool.num_blocks - pool.num_free - idle, evictable, pool.num_blocks, self.rate.rate())
        m = self.metrics
        m.queued_tokens.set(queued)
        m.running_requests.set(len(self._jobs))
        m.free_blocks.set(self._stats.free_blocks)
        m.held_blocks.set(self._stats.held_blocks)
        m.tokens_per_s.set(self._stats.tokens_per_s)
        arena = self.model.paged_arena
        if arena is not None:
            if not self._jobs:
                arena.trim()  # idle: give back what the longest prompts grew it to
            m.paged_blocks.set(arena.num_blocks - arena.num_free)
            m.paged_copied.set(arena.copied_entries)


def _unshared(records: dict[int, GlobalKVRecords], shared_tokens: int,
              state: SequenceState) -> dict[int, GlobalKVRecords]:
    """Drop records of tokens below `shared_tokens`: they live in shared prefix blocks already."""
    out = {}
    for layer, rec in records.items():
        skip = max(0, shared_tokens // state.global_kv[layer].ratio - rec.first_entry)
        out[layer] = GlobalKVRecords(layer, rec.first_entry + skip, rec.main[skip:], rec.index_keys[skip:])
    return out


def _tail(kept: BoundaryHidden | None, new: BoundaryHidden, span: int) -> BoundaryHidden:
    """The last `span` boundary states of the sequence so far."""
    joined = new if kept is None else BoundaryHidden.concat([kept, new])
    return joined.last(span)
