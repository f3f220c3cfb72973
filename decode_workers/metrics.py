"""Prometheus metrics of one decode rank, on a registry of its own (never the process-global one)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_PHASE_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                  0.25, 0.5, 1.0, 2.5)
_QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


LOOP_PHASES = (
    # the engine loop's tick (`loop.py`), on the leader
    "idle_wait",  # waiting for a command or a wake-up with no work (not a cost: the rank is idle)
    "commands",  # taking the queued commands, broadcasting them (a group), applying them
    "poll",  # finished transfers, expired leases and deadlines; whether any rank has work
    "report",  # outputs and load to the leader (msgpack and a gather in a group) and on to the streams
    # `DecodeEngine.step` (its sum is `cedserve_decode_step_seconds`)
    "schedule",  # the scheduler's choice, preemptions
    "join",  # joins' state: global KV from the blocks, a shipped state installed, an onload
    "propose",  # the DSpark drafter's pass and the verification lengths
    "plan",  # rows for the passes: runner slots or `forward_batch` items
    "model",  # the target pass(es): `forward_batch`, the runner's step
    "accept",  # accept or roll back drafts, stop checks, the tokens to stream
    "persist",  # the step's new records into the blocks, whole blocks to the prefix cache
    "observe",  # the drafter's memory from the pass's taps, verification's calibration
    "account",  # step-time profile and per-step gauges
    # the gRPC service (`service.py`), per output of a Decode stream
    "handoff",  # the loop's report to the stream's thread taking it
    "grpc_write",  # one DecodeEvent built and handed to gRPC (the generator's yield until it resumes)
)
"""The `phase` label values of `cedserve_decode_loop_phase_seconds`."""


class PhaseClock:
    """Seconds per phase into `cedserve_decode_loop_phase_seconds`, the label children bound once
    (a phase costs one `perf_counter` and one observation).

    `lap(phase, since)` observes `perf_counter() - since` under `phase` and returns the new time, so
    consecutive phases chain: `t = clock.lap("schedule", t)`.
    """

    def __init__(self, histogram: Histogram) -> None:
        self._observe = {phase: histogram.labels(phase).observe for phase in LOOP_PHASES}

    def lap(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self._observe[phase](now - since)
        return now

    def add(self, phase: str, seconds: float) -> None:
        self._observe[phase](seconds)


DECODE_PATHS = ("runner", "runner_graphs", "drafter_slots", "drafter_graphs", "compiled")
"""The labels of `cedserve_decode_path_on` (`DecodeEngine._publish_paths`)."""


class DecodeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.running = Gauge("cedserve_decode_running_requests", "Requests in the batch", registry=r)
        self.waiting = Gauge("cedserve_decode_waiting_requests",
                             "Requests leased, waiting for KV, or waiting for a batch slot", registry=r)
        self.preempted = Gauge("cedserve_decode_preempted_requests", "Requests preempted, not yet back", registry=r)
        self.free_blocks = Gauge("cedserve_decode_free_blocks", "Blocks free or evictable", registry=r)
        self.held_blocks = Gauge("cedserve_decode_held_blocks", "Blocks referenced by requests", registry=r)
        self.output_tokens = Counter("cedserve_decode_output_tokens", "Tokens emitted", registry=r)
        self.draft_tokens = Counter("cedserve_decode_draft_tokens", "DSpark drafts verified", registry=r)
        self.accepted_drafts = Counter("cedserve_decode_accepted_drafts", "DSpark drafts accepted", registry=r)
        self.draft_decisions = Counter(
            "cedserve_decode_draft_decisions", "Steps by what DSpark's cost check decided: drafted (a draft pass "
            "ran), declined (drafting would not pay), plain_probe (declined to measure a plain step)",
            ["decision"], registry=r)
        self.step_seconds = Histogram("cedserve_decode_step_seconds", "Seconds per decode step",
                                      buckets=_STEP_BUCKETS, registry=r)
        self.loop_phase_seconds = Histogram(
            "cedserve_decode_loop_phase_seconds", "Seconds per engine-loop phase per tick, and per streamed "
            "output for handoff and grpc_write (docs/decode.md, Where a token's time goes)", ["phase"],
            buckets=_PHASE_BUCKETS, registry=r)
        self.phases = PhaseClock(self.loop_phase_seconds)
        self.pass_rows = Histogram("cedserve_decode_pass_rows", "Rows per target pass",
                                   buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384), registry=r)
        self.accepted_length = Histogram("cedserve_decode_tokens_per_verify",
                                         "Tokens emitted per request per verification pass",
                                         buckets=(1, 2, 3, 4, 5, 6, 7, 8, 9), registry=r)
        self.preemptions = Counter("cedserve_decode_preemptions", "Requests preempted", ["policy"], registry=r)
        self.offload_fallbacks = Counter("cedserve_decode_offload_fallbacks",
                                         "Preemptions that recomputed because the host budget was spent",
                                         registry=r)
        self.queue_seconds = Histogram("cedserve_decode_queue_seconds", "KV in place to the first join of the "
                                       "batch, by effort class (low < 60, high 60-89, max >= 90)", ["effort_class"],
                                       buckets=_QUEUE_BUCKETS, registry=r)
        self.join_step_seconds = Histogram("cedserve_decode_join_step_seconds", "Steps in which requests joined, "
                                           "by join kind (prefill: a local prefill, whose step ends with the "
                                           "request's first token)", ["kind"], buckets=_STEP_BUCKETS, registry=r)
        self.transfer_wait_seconds = Histogram("cedserve_decode_transfer_wait_seconds", "A transferred request's "
                                               "Decode call taken to its KV in place (0 when the transfer had "
                                               "ended first)", buckets=_PHASE_BUCKETS, registry=r)
        self.joins = Counter("cedserve_decode_joins", "Requests joining the batch", ["kind"], registry=r)
        self.finished = Counter("cedserve_decode_finished", "Requests finished", ["reason"], registry=r)
        self.leases = Counter("cedserve_decode_leases", "Leases granted", registry=r)
        self.lease_expired = Counter("cedserve_decode_leases_expired", "Leases freed unused at their deadline",
                                     registry=r)
        self.transfer_failures = Counter("cedserve_decode_transfer_failures", "KV transfers that failed",
                                         ["cause"], registry=r)
        self.paged_blocks = Gauge("cedserve_decode_paged_attention_blocks",
                                  "Blocks of the paged decode attention's record copy held by sequences "
                                  "(0 on the dense path)", registry=r)
        self.paged_copied = Gauge("cedserve_decode_paged_attention_copied_entries",
                                  "Compressed entries copied into the paged decode attention's blocks so far",
                                  registry=r)
        self.rejected = Counter("cedserve_decode_rejected", "Commands refused", ["code"], registry=r)
        self.runner_rows = Counter("cedserve_decode_runner_rows", "Rows run through the model runner (the rest "
                                   "through forward_batch: cedserve_decode_pass_rows counts both)", registry=r)
        self.runner_slots = Gauge("cedserve_decode_runner_slots", "Requests holding a model-runner slot", registry=r)
        self.overlapped_steps = Counter("cedserve_decode_overlapped_steps", "Steps launched before the step "
                                        "before's tokens were read (decode.overlap); the rest ran in series",
                                        registry=r)
        self.paths = Gauge("cedserve_decode_path_on", "1 where this decode worker takes the path: runner (the "
                           "model runner's slots), runner_graphs (its steps as CUDA graph replays), drafter_slots "
                           "(the DSpark drafter's pass on slots), drafter_graphs, compiled (Inductor's fused ops)",
                           ["path"], registry=r)
        self.runner_moves = Counter("cedserve_decode_runner_moves", "States moved into (in) or out of (out) a "
                                    "model-runner slot", ["direction"], registry=r)
