"""Prometheus metrics of one prefill worker, in a registry of its own (served by `cedserve.serving.server.start_metrics_server`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_PHASE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                  2.5, 10, 60)

PREFILL_PHASES = (
    # a request's way through the engine thread, in order (`engine.PrefillEngine`); arrival to
    # admission is `cedserve_prefill_queue_seconds`
    "admit",  # blocks (prefix-cache hits), the transfer opened, the cached prefix's state rebuilt
    "compute",  # one chunk: the encoder pass, its records into the blocks, whole blocks committed
    "ship",  # blocks handed to the transfer layer (a device sync first on CUDA), per hand-over
    "first_token",  # the decoder replay over the last boundary states, and sampling
    "ship_state",  # the bounded decode state encoded into scratch blocks, after the first token left
                   # (its hand-over is a `ship`)
    # the gRPC service
    "handoff",  # the first token queued by the engine to the stream's thread taking it
)
"""The `phase` label values of `cedserve_prefill_phase_seconds`."""


class PrefillMetrics:
    """Counters by outcome and token kind, latency histograms, and the gauges the autoscaler reads."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("cedserve_prefill_requests", "Prefill requests ended, by outcome (ok or the "
                                "error code name)", ["outcome"], registry=r)
        self.tokens = Counter("cedserve_prefill_tokens", "Prompt tokens by kind: prompt, cached (from the "
                              "prefix cache), computed (encoder), replayed (prefix and decoder replay)",
                              ["kind"], registry=r)
        self.first_token_seconds = Histogram("cedserve_prefill_first_token_seconds", "Arrival to first token",
                                             buckets=_LATENCY_BUCKETS, registry=r)
        self.request_seconds = Histogram("cedserve_prefill_request_seconds", "Arrival to transfer closed",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("cedserve_prefill_queue_seconds", "Arrival to admission (blocks given), by "
                                       "effort class (low < 60, high 60-89, max >= 90)", ["effort_class"],
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.phase_seconds = Histogram("cedserve_prefill_phase_seconds", "Engine and service time of the "
                                       "requests by phase (`PREFILL_PHASES`)", ["phase"], buckets=_PHASE_BUCKETS,
                                       registry=r)
        self.phases = {phase: self.phase_seconds.labels(phase) for phase in PREFILL_PHASES}
        """Each phase's series, looked up once (`labels` takes a lock and builds a key)."""
        self.step_seconds = Histogram("cedserve_prefill_step_seconds", "One engine step (all its chunks)",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.queued_tokens = Gauge("cedserve_prefill_queued_tokens", "Uncomputed prompt tokens accepted",
                                   registry=r)
        self.running_requests = Gauge("cedserve_prefill_running_requests", "Requests in flight", registry=r)
        self.free_blocks = Gauge("cedserve_prefill_free_blocks", "Blocks free or evictable", registry=r)
        self.held_blocks = Gauge("cedserve_prefill_held_blocks", "Blocks referenced by prompts in flight",
                                 registry=r)
        self.tokens_per_s = Gauge("cedserve_prefill_tokens_per_second", "Measured prefill rate over the load "
                                  "window (tokens per busy second)", registry=r)
        self.draining = Gauge("cedserve_prefill_draining", "1 while draining", registry=r)
        self.paged_blocks = Gauge("cedserve_prefill_paged_attention_blocks",
                                  "Blocks of the paged attention's record copy held by prompts in flight "
                                  "(0 on the dense path)", registry=r)
        self.paged_copied = Gauge("cedserve_prefill_paged_attention_copied_entries",
                                  "Compressed entries copied into the paged attention's blocks so far", registry=r)
        self.link_probes = Counter("cedserve_prefill_link_probes", "Link probes (ProbeLink) ended, by outcome: "
                                   "ok, mismatch (bytes differed) or the error code name", ["outcome"], registry=r)
        self.link_probe_gbps = Gauge("cedserve_prefill_link_probe_gbps", "GB/s of the last link probe to a decode "
                                     "agent", ["decode_agent"], registry=r)
