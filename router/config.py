"""Router configuration: one typed, frozen struct, validated on construction.

Flags build it (`cedserve router`); a config file's `[router]` table sets the `TABLE_FIELDS`, decoded as
every table is (`cedserve.model.config_table.decode_table`: one error form naming `router.<field>`).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from cedserve.common.tls import TLSConfig
from cedserve.model.config_table import config_error, decode_table, fail
from cedserve.router.admission import ClassLimits

POLICIES = ("cache_aware", "least_loaded", "round_robin")
EFFORT_CLASSES = ("low", "high", "max")


class WorkerEndpoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    worker_id: str
    address: str
    """host:port of the worker's internal gRPC service."""

    def __post_init__(self) -> None:
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit():
            fail("router", "workers", f"{self.worker_id!r} address {self.address!r} is not host:port")


class DiscoveryConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Kubernetes discovery of workers (router/discovery.py)."""

    namespace: str
    """Namespace of the pools (the router's own, `$(POD_NAMESPACE)` in the chart)."""
    services: Mapping[str, str] = msgspec.field(default_factory=dict)
    """Headless Service per role (`prefill`, `decode`) whose EndpointSlices list the pool's pods."""
    port_name: str = "grpc"
    """Name of the worker port in the slices (the Service's port name)."""
    watch_timeout_s: int = 60
    """Server-side length of one watch call; the next resumes from the last version seen."""
    retry_s: float = 2.0
    """Wait after an API error before listing again."""

    def __post_init__(self) -> None:
        if not self.namespace:
            fail("router", "discovery.namespace", "must be set (--namespace)")
        if not self.services:
            fail("router", "discovery.services", "name a Service (--prefill-service, --decode-service)")
        for role, service in self.services.items():
            if role not in ("prefill", "decode"):
                fail("router", "discovery.services", f"unknown role {role!r}")
            if not service:
                fail("router", f"discovery.services.{role}", "empty Service name")
        if self.watch_timeout_s <= 0 or self.retry_s <= 0:
            fail("router", "discovery.watch_timeout_s", "it and `discovery.retry_s` must be > 0")


class RouterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    checkpoint: str
    """Checkpoint folder: its config.json and tokenizer.json define the served model ("" with `preset`)."""
    preset: str | None = None
    """Without a checkpoint: a preset (`tiny`, `mini-40`) with the shipped tokenizer, as preset workers use."""
    prefill: tuple[WorkerEndpoint, ...] = ()
    """Prefill workers (static list; Kubernetes discovery adds to it)."""
    decode: tuple[WorkerEndpoint, ...] = ()
    """Decode workers."""
    host: str = "127.0.0.1"
    port: int = 0
    """Public gRPC port (0: pick a free one and report it)."""
    model_id: str = "cedserve"
    api_keys: tuple[str, ...] = ()
    """Accepted API keys; empty: no authentication (loopback use)."""
    worker_token: str = ""
    """Shared secret sent to workers on the internal plane."""
    policy: str = "cache_aware"
    """cache_aware (the documented formula), least_loaded or round_robin."""
    decode_only_max_tokens: int = 256
    """Uncached suffixes up to this many tokens may be prefilled by the decode worker itself."""
    block_size: int = 64
    """Must equal the workers' block size (prefix hashes are per block)."""
    max_retries: int = 2
    """Re-placements per request after a worker failure."""
    load_poll_s: float = 0.5
    """Interval of load polling; a worker that misses 3 polls is taken out of placement."""
    lease_ms: int = 4_000
    """A decode block reservation expires this long after its last renewal: the router renews the
    leases it waits on every quarter of it (router/leases.py), so a dead router's blocks come back
    within it while a slow prefill keeps them."""
    default_max_tokens: int = 0
    """Output budget when a request gives none; 0: the effort level's budget."""
    limits: dict[str, ClassLimits] = msgspec.field(default_factory=dict)
    """Admission limits by effort class (low, high, max)."""
    max_message_bytes: int = 16 << 20
    """Largest request accepted (gRPC refuses bigger ones with RESOURCE_EXHAUSTED, HTTP with 413), and
    never more than what the model's context can use (`router.requests.message_limit`): bigger
    requests are refused from their length prefix, before their bytes are read or parsed."""
    grpc_tarpit: bool = False
    """gRPC's tarpit on the public port: a call that gRPC itself refuses (a message over the limit
    above, malformed HTTP/2 headers) is answered after a random 100-1000 ms, to slow a client that
    sends them in a loop. Off: answered at once (an idle router refuses a 15 MB prompt < 1 ms after
    its length prefix arrives; docs/routing.md, *Errors*). The router refuses its own errors
    (keys, sizes, admission) without delay either way."""
    metrics_port: int | None = None
    """Prometheus endpoint; None: off."""
    http_port: int = -1
    """OpenAI-compatible HTTP API (router/http_api.py) beside the gRPC port, with its TLS and API
    keys; -1: off, 0: pick a free port and report it."""
    user_cache_salt: bool = True
    """The HTTP API's `user` field salts the request's prefix-cache blocks (tenants never share them);
    off: `user` is ignored."""
    tls: TLSConfig = msgspec.field(default_factory=TLSConfig)
    """The public port (`[tls]`): TLS with `cert`/`key`; mTLS with `ca` and `require_client_cert`."""
    internal_tls: TLSConfig = msgspec.field(default_factory=TLSConfig)
    """Channels to workers (`[internal_tls]`): `ca` verifies them, `cert`/`key` is presented under mTLS."""
    health_port: int = -1
    """Plaintext listener for kubelet probes (they cannot speak TLS) and the loopback-only Drain that
    the preStop hook calls; never the Generation API. -1: none."""
    default_link_bytes_per_s: float = 1e9
    """Prefill->decode KV link rate assumed until a pair's transfers are measured (placement)."""
    link_rate_alpha: float = 0.3
    """EWMA weight of each newly measured transfer in a pair's link rate (router/placement.py)."""
    discovery: DiscoveryConfig | None = None
    """Kubernetes discovery of workers, besides the static lists; None: static lists only."""
    drain_timeout_s: float = 30.0
    """SIGTERM without a prior Drain call: how long open streams may run before the router exits."""

    def __post_init__(self) -> None:
        if not self.checkpoint and not self.preset:
            fail("router", "checkpoint", "give a checkpoint folder or a `preset`")
        if self.drain_timeout_s < 0:
            fail("router", "drain_timeout_s", f"must be >= 0, got {self.drain_timeout_s}")
        if not 0 <= self.port <= 65535:
            fail("router", "port", f"must be in [0, 65535], got {self.port}")
        if not -1 <= self.http_port <= 65535:
            fail("router", "http_port", f"must be -1 (off) or in [0, 65535], got {self.http_port}")
        if self.max_retries < 0:
            fail("router", "max_retries", f"must be >= 0, got {self.max_retries}")
        if self.lease_ms <= 0:
            fail("router", "lease_ms", f"must be positive, got {self.lease_ms}")
        if self.tls.enabled and self.tls.cert is None:
            fail("router", "tls.cert", "a TLS public port needs `cert` and `key`")
        if self.default_link_bytes_per_s <= 0:
            fail("router", "default_link_bytes_per_s", f"must be > 0, got {self.default_link_bytes_per_s}")
        if not 0 < self.link_rate_alpha <= 1:
            fail("router", "link_rate_alpha", f"must be in (0, 1], got {self.link_rate_alpha}")
        if self.policy not in POLICIES:
            fail("router", "policy", f"unknown {self.policy!r}; choose {', '.join(POLICIES)}")
        for klass in self.limits:
            if klass not in EFFORT_CLASSES:
                fail("router", f"limits.{klass}", f"not an effort class; one of {list(EFFORT_CLASSES)}")
        ids = [w.worker_id for w in (*self.prefill, *self.decode)]
        if len(ids) != len(set(ids)):
            fail("router", "workers", f"duplicate worker ids in {ids}")


TABLE_FIELDS = ("model_id", "policy", "decode_only_max_tokens", "max_retries", "load_poll_s", "lease_ms",
                "default_max_tokens", "max_message_bytes", "default_link_bytes_per_s", "link_rate_alpha",
                "drain_timeout_s", "limits", "user_cache_salt", "grpc_tarpit")
"""`RouterConfig` fields a config file's `[router]` table may set (the rest come from flags)."""


def router_table(values: Mapping[str, object]) -> dict[str, object]:
    """A config file's `[router]` table as `RouterConfig` keyword arguments; `ValueError` names an
    unknown or mistyped field and its value. `limits` is a table per effort class
    (`[router.limits.max]`) of `max_running`, `max_queued` and `capacity_wait_s`."""
    unknown = sorted(set(values) - set(TABLE_FIELDS))
    if unknown:
        raise config_error("router", unknown[0], f"unknown field (known: {', '.join(TABLE_FIELDS)})")
    config = decode_table(RouterConfig, {"checkpoint": "-", **values}, "router")
    return {name: getattr(config, name) for name in values}
