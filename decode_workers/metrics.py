"""Prometheus metrics of one decode rank, on a registry of its own (never the process-global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


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
        self.step_seconds = Histogram("cedserve_decode_step_seconds", "Seconds per decode step",
                                      buckets=_STEP_BUCKETS, registry=r)
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
        self.runner_moves = Counter("cedserve_decode_runner_moves", "States moved into (in) or out of (out) a "
                                    "model-runner slot", ["direction"], registry=r)
