"""Transfer metrics: bytes, GB/s, per-request time and its share of time-to-first-token, failures by
cause, fallbacks taken. Prometheus collectors live in a registry the caller passes (a new private one
by default, so two agents in one process never collide and nothing is global)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from cedserve.kv_transfer.errors import RequestId
from cedserve.kv_transfer.state import TransferResult, TransferState

_GBPS_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TAIL_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 5)
_SECONDS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)
_SHARE_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0)


class TransferMetrics:
    """One agent's transfer metrics. `record` is called once per finished transfer side."""

    def __init__(self, registry: CollectorRegistry | None = None, remember: int = 4096) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.bytes_total = Counter("cedserve_kv_transfer_bytes", "KV bytes moved", ["role", "mode"], registry=r)
        self.descriptors_total = Counter("cedserve_kv_transfer_descriptors", "NIXL descriptors posted",
                                         ["role"], registry=r)
        self.requests_total = Counter("cedserve_kv_transfer_requests", "Transfers ended, by state",
                                      ["role", "state"], registry=r)
        self.failures_total = Counter("cedserve_kv_transfer_failures", "Failed or aborted transfers by cause",
                                      ["role", "cause"], registry=r)
        self.fallbacks_total = Counter("cedserve_kv_transfer_fallbacks", "Configured fallbacks taken",
                                       ["to"], registry=r)
        self.notices_total = Counter("cedserve_kv_transfer_notices", "Data-path notifications received, by kind",
                                     ["kind"], registry=r)
        self.duration_seconds = Histogram("cedserve_kv_transfer_seconds", "Per-request transfer time",
                                          ["role"], buckets=_SECONDS_BUCKETS, registry=r)
        self.tail_seconds = Histogram("cedserve_kv_transfer_tail_seconds",
                                      "Per-request transfer time after the sender's last handoff (not "
                                      "overlapped with the prefill)", ["role"], buckets=_TAIL_BUCKETS,
                                      registry=r)
        self.staging_seconds = Histogram("cedserve_kv_transfer_staging_seconds",
                                         "Staging copies of packed chunks, each with its wait: the "
                                         "sender's gather, the receiver's scatter", ["op"],
                                         buckets=_TAIL_BUCKETS, registry=r)
        self.gbps = Histogram("cedserve_kv_transfer_gbps", "Per-request transfer rate (GB/s)", ["role"],
                              buckets=_GBPS_BUCKETS, registry=r)
        self.ttft_share = Histogram("cedserve_kv_transfer_ttft_share",
                                    "Transfer time as a fraction of time-to-first-token",
                                    buckets=_SHARE_BUCKETS, registry=r)
        self._lock = threading.Lock()
        self._durations: OrderedDict[RequestId, float] = OrderedDict()
        self._remember = remember
        # (collector, label values) -> its child: `labels()` validates and locks on every call, a few us
        # each, several times per request on the progress thread
        self._children: dict[tuple[Counter | Histogram, tuple[str, ...]], Any] = {}

    def _child(self, metric: Counter | Histogram, *values: str) -> Any:
        child = self._children.get((metric, values))
        if child is None:  # two threads racing here get the same child from `labels`
            child = self._children[(metric, values)] = metric.labels(*values)
        return child

    def count_notice(self, kind: str) -> None:
        """One data-path notification of `kind` (the `TransferNotice` body field) received."""
        self._child(self.notices_total, kind).inc()

    def observe_staging(self, op: str, seconds: float) -> None:
        """One staging copy (`op`: gather or scatter) took `seconds`, its wait included."""
        self._child(self.staging_seconds, op).observe(seconds)

    def record(self, result: TransferResult, mode: str) -> None:
        role = result.role.value
        self._child(self.requests_total, role, result.state.value).inc()
        self._child(self.bytes_total, role, mode).inc(result.num_bytes)
        self._child(self.descriptors_total, role).inc(result.num_descriptors)
        if result.state is TransferState.DONE:
            self._child(self.duration_seconds, role).observe(result.duration_s)
            if result.tail_s is not None:
                self._child(self.tail_seconds, role).observe(result.tail_s)
            self._child(self.gbps, role).observe(result.gbps)
            with self._lock:
                self._durations[result.request_id] = result.duration_s
                while len(self._durations) > self._remember:
                    self._durations.popitem(last=False)
        elif result.error is not None:
            self.failures_total.labels(role, result.error.cause.value).inc()
            if result.error.fallback:
                self.fallbacks_total.labels(result.error.fallback).inc()

    def observe_ttft(self, request_id: RequestId, ttft_s: float) -> float | None:
        """Record the request's time-to-first-token; returns the transfer's share of it (None when
        this agent has no finished transfer for the request)."""
        with self._lock:
            duration = self._durations.pop(request_id, None)
        if duration is None or ttft_s <= 0:
            return None
        share = duration / ttft_s
        self.ttft_share.observe(share)
        return share

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (tests and the benchmark), 0 if never set."""
        got = self.registry.get_sample_value(name, labels)
        return float(got) if got is not None else 0.0
