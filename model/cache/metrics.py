"""Cache counters: a plain dataclass the cache updates, and a Prometheus collector that reads it.

All counters only grow. Byte counters count payload bytes (whole blocks), not file headers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


@dataclass
class CacheMetrics:
    """Counters of one worker's cache (updated from the cache's owner thread only)."""

    lookups: int = 0
    """Prompts looked up at admission."""
    lookup_blocks: int = 0
    """Whole prompt blocks those lookups could have hit."""
    hit_blocks_device: int = 0
    """Blocks found in the device pool (shared, no copy)."""
    hit_blocks_host: int = 0
    """Blocks found in the host tier and copied in."""
    hit_blocks_disk: int = 0
    """Blocks found in the disk tier (read asynchronously; a rejected file does not count as a hit later)."""
    allocated_blocks: int = 0
    """Blocks handed to requests."""
    exhausted_errors: int = 0
    """`CacheExhaustedError`s raised."""
    evicted_device_blocks: int = 0
    """Unreferenced cached blocks evicted from the device pool (to the host tier, the disk or dropped)."""
    evicted_host_blocks: int = 0
    """Blocks evicted from the host tier (to disk or dropped)."""
    evicted_disk_blocks: int = 0
    """Files deleted to keep the disk tier within capacity."""
    offload_host_bytes: int = 0
    """Bytes copied device -> host."""
    offload_disk_bytes: int = 0
    """Payload bytes written to disk files."""
    onload_host_bytes: int = 0
    """Bytes copied host -> device."""
    onload_disk_bytes: int = 0
    """Payload bytes read from disk files into the device pool."""
    onload_failed_blocks: int = 0
    """Disk hits that could not be served (rejected or unreadable file): the request recomputes them."""
    disk_rejected_files: int = 0
    """Torn, truncated or corrupt disk files found and deleted (at restart or at read)."""
    disk_foreign_files: int = 0
    """Disk files of another layout or format version, ignored (left in place)."""
    disk_io_errors: int = 0
    """Disk writes, reads or deletes that failed with an OS error (raised from `poll`)."""

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class CacheMetricsCollector(Collector):
    """Exposes a `CacheMetrics` as Prometheus counters `cedserve_cache_<field>_total{worker=...}`.

    Register with `prometheus_client.REGISTRY.register(CacheMetricsCollector(metrics, worker_id))`.
    """

    def __init__(self, metrics: CacheMetrics, worker_id: str) -> None:
        self._metrics = metrics
        self._worker_id = worker_id

    def collect(self) -> Iterator[CounterMetricFamily]:
        for field in dataclasses.fields(self._metrics):
            family = CounterMetricFamily(f"cedserve_cache_{field.name}", f"cache counter {field.name} "
                                         "(see cedserve.model.cache.metrics.CacheMetrics)", labels=["worker"])
            family.add_metric([self._worker_id], getattr(self._metrics, field.name))
            yield family
