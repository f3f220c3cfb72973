"""Router metrics (Prometheus): latency by effort class, cache credit, placements, errors, retries,
waits for decode capacity, refusals, lease renewals."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60)

REQUEST_PHASES = (
    # one request's way to its first token, in order (`frontend.GenerationCore`); admission is
    # `cedserve_router_queue_seconds`
    "place",  # admitted to a placement chosen (the policy over the load table and the prefix index)
    "reserve",  # the Reserve call on the decode worker (both topologies lease before the first token)
    "first_token",  # the worker call opened to its first token here: the prefill's `first_token`
                    # event (disaggregated) or the decode stream's first tokens (colocated)
)
"""The `phase` label values of `cedserve_router_request_phase_seconds`."""


class RouterMetrics:
    """One registry per router, so several routers (tests) never collide."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft_s = Histogram("cedserve_router_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS,
                                registry=r)
        self.request_phase_s = Histogram(
            "cedserve_router_request_phase_seconds", "A request's time to its first token by phase "
            "(`REQUEST_PHASES`), one observation per attempt", ["phase"], buckets=_PHASE_BUCKETS, registry=r)
        self.tpot_s = Histogram("cedserve_router_tpot_seconds", "Time per output token after the first",
                                ["effort_class"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_s = Histogram("cedserve_router_queue_seconds", "Admission wait", ["effort_class"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_prefill_tokens = Gauge("cedserve_router_queue_prefill_tokens", "Uncomputed prompt tokens "
                                          "the healthy prefill workers hold (the prefill autoscaler's metric)",
                                          registry=r)
        self.queue_decode_requests = Gauge("cedserve_router_queue_decode_requests", "Requests the healthy decode "
                                           "workers hold without a batch slot (the decode autoscaler's metric)",
                                           registry=r)
        self.placements = Counter("cedserve_router_placements_total", "Placement decisions",
                                  ["policy", "kind"], registry=r)
        self.retries = Counter("cedserve_router_retries_total", "Re-placements after a worker failure",
                               ["reason"], registry=r)
        self.errors = Counter("cedserve_router_errors_total", "Requests that ended in an error status",
                              ["code"], registry=r)
        self.prompt_tokens = Counter("cedserve_router_prompt_tokens_total", "Prompt tokens admitted", registry=r)
        self.cached_tokens = Counter("cedserve_router_cached_tokens_total",
                                     "Prompt tokens served from a prefix cache", registry=r)
        self.capacity_waiting = Gauge("cedserve_router_capacity_waiting_requests", "Admitted requests waiting "
                                      "for room on a decode worker now", ["effort_class"], registry=r)
        self.capacity_wait_s = Histogram("cedserve_router_capacity_wait_seconds", "Time a request waited for room "
                                         "on a decode worker, however the wait ended", ["effort_class"],
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.capacity_admitted = Counter("cedserve_router_capacity_admitted_total", "Requests placed after "
                                         "waiting for room on a decode worker", ["effort_class"], registry=r)
        self.refusals = Counter("cedserve_router_refusals_total", "Requests refused with RESOURCE_EXHAUSTED, by "
                                "reason (admission, capacity_wait, no_capacity, tokenize_queue)", ["reason"], registry=r)
        self.lease_renewals = Counter("cedserve_router_lease_renewals_total", "Renew calls sent to decode workers "
                                      "(one per worker per period, naming all its open leases)", registry=r)
        self.lease_renewal_failures = Counter("cedserve_router_lease_renewal_failures_total", "Renew calls that "
                                              "failed, by gRPC code", ["code"], registry=r)
        self.lease_renew_s = Histogram("cedserve_router_lease_renew_seconds", "Renew round-trip time",
                                       buckets=_RPC_BUCKETS, registry=r)
        self.leases_lost = Counter("cedserve_router_leases_lost_total", "Leases the router renewed that their "
                                   "decode worker no longer held (expired or freed)", registry=r)
        self.http_requests = Counter("cedserve_router_http_requests_total", "OpenAI-compatible HTTP API requests "
                                     "by endpoint and HTTP status (499: the client left first)",
                                     ["endpoint", "status"], registry=r)
