"""Router configuration: one typed, frozen dataclass, validated on construction."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from cedserve.router.admission import ClassLimits
from cedserve.tls import TLSConfig


@dataclass(frozen=True)
class WorkerEndpoint:
    worker_id: str
    address: str
    """host:port of the worker's internal gRPC service."""

    def __post_init__(self) -> None:
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"router field `workers`: {self.worker_id!r} address {self.address!r} is not host:port")


@dataclass(frozen=True)
class DiscoveryConfig:
    """Kubernetes discovery of workers (router/discovery.py)."""

    namespace: str
    """Namespace of the pools (the router's own, `$(POD_NAMESPACE)` in the chart)."""
    services: Mapping[str, str] = field(default_factory=dict)
    """Headless Service per role (`prefill`, `decode`) whose EndpointSlices list the pool's pods."""
    port_name: str = "grpc"
    """Name of the worker port in the slices (the Service's port name)."""
    watch_timeout_s: int = 60
    """Server-side length of one watch call; the next resumes from the last version seen."""
    retry_s: float = 2.0
    """Wait after an API error before listing again."""

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ValueError("router field `discovery.namespace`: must be set (--namespace)")
        if not self.services:
            raise ValueError("router field `discovery.services`: name a Service (--prefill-service, --decode-service)")
        for role, service in self.services.items():
            if role not in ("prefill", "decode"):
                raise ValueError(f"router field `discovery.services`: unknown role {role!r}")
            if not service:
                raise ValueError(f"router field `discovery.services.{role}`: empty Service name")
        if self.watch_timeout_s <= 0 or self.retry_s <= 0:
            raise ValueError("router fields `discovery.watch_timeout_s` and `discovery.retry_s` must be > 0")


@dataclass(frozen=True)
class RouterConfig:
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
    lease_ms: int = 30_000
    """Decode block reservations expire after this long without a prefill."""
    default_max_tokens: int = 0
    """Output budget when a request gives none; 0: the effort level's budget."""
    limits: dict[str, ClassLimits] = field(default_factory=dict)
    """Admission limits by effort class (low, high, max)."""
    max_message_bytes: int = 16 << 20
    """Largest request accepted (gRPC refuses bigger ones with RESOURCE_EXHAUSTED, HTTP with 413), and
    never more than what the model's context can use (`router.requests.message_limit`): bigger
    requests are refused from their length prefix, before their bytes are read or parsed."""
    metrics_port: int | None = None
    """Prometheus endpoint; None: off."""
    http_port: int = -1
    """OpenAI-compatible HTTP API (router/http_api.py) beside the gRPC port, with its TLS and API
    keys; -1: off, 0: pick a free port and report it."""
    user_cache_salt: bool = True
    """The HTTP API's `user` field salts the request's prefix-cache blocks (tenants never share them);
    off: `user` is ignored."""
    tls: TLSConfig = field(default_factory=TLSConfig)
    """The public port (`[tls]`): TLS with `cert`/`key`; mTLS with `ca` and `require_client_cert`."""
    internal_tls: TLSConfig = field(default_factory=TLSConfig)
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
            raise ValueError("router field `checkpoint`: give a checkpoint folder or a `preset`")
        if self.drain_timeout_s < 0:
            raise ValueError(f"router field `drain_timeout_s`: must be >= 0, got {self.drain_timeout_s}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"router field `port`: must be in [0, 65535], got {self.port}")
        if not -1 <= self.http_port <= 65535:
            raise ValueError(f"router field `http_port`: must be -1 (off) or in [0, 65535], got {self.http_port}")
        if self.max_retries < 0:
            raise ValueError(f"router field `max_retries`: must be >= 0, got {self.max_retries}")
        if self.tls.enabled and self.tls.cert is None:
            raise ValueError("router field `tls.cert`: a TLS public port needs `cert` and `key`")
        if self.default_link_bytes_per_s <= 0:
            raise ValueError(f"router field `default_link_bytes_per_s`: must be > 0, got {self.default_link_bytes_per_s}")
        if not 0 < self.link_rate_alpha <= 1:
            raise ValueError(f"router field `link_rate_alpha`: must be in (0, 1], got {self.link_rate_alpha}")
        ids = [w.worker_id for w in (*self.prefill, *self.decode)]
        if len(ids) != len(set(ids)):
            raise ValueError(f"router field `workers`: duplicate worker ids in {ids}")


TABLE_FIELDS = ("model_id", "policy", "decode_only_max_tokens", "max_retries", "load_poll_s", "lease_ms",
                "default_max_tokens", "max_message_bytes", "default_link_bytes_per_s", "link_rate_alpha",
                "drain_timeout_s", "limits", "user_cache_salt")
"""`RouterConfig` fields a config file's `[router]` table may set (the rest come from flags)."""
EFFORT_CLASSES = ("low", "high", "max")


def router_table(values: Mapping[str, object]) -> dict[str, object]:
    """A config file's `[router]` table as `RouterConfig` keyword arguments; `ValueError` names an
    unknown or mistyped field. `limits` is a table per effort class (`[router.limits.max]`) of
    `max_running` and `max_queued`."""
    unknown = sorted(set(values) - set(TABLE_FIELDS))
    if unknown:
        raise ValueError(f"router field `{unknown[0]}`: unknown field (known: {', '.join(TABLE_FIELDS)})")
    out: dict[str, object] = {}
    defaults = RouterConfig(checkpoint="-")
    for name, value in values.items():
        if name == "limits":
            out[name] = _limits(value)
            continue
        expected = type(getattr(defaults, name))
        if (isinstance(value, bool) and expected is not bool) or not (
                isinstance(value, expected) or (expected is float and isinstance(value, int))):
            raise ValueError(f"router field `{name}`: expected {expected.__name__}, got {value!r}")
        out[name] = float(value) if expected is float else value
    if "policy" in out:
        from cedserve.router.policy import make_policy

        make_policy(str(out["policy"]), 0)  # names the choices
    return out


def _limits(value: object) -> dict[str, ClassLimits]:
    if not isinstance(value, Mapping):
        raise ValueError(f"router field `limits`: expected a table per effort class, got {value!r}")
    out = {}
    for klass, limits in value.items():
        if klass not in EFFORT_CLASSES or not isinstance(limits, Mapping):
            raise ValueError(f"router field `limits.{klass}`: expected a table under one of {list(EFFORT_CLASSES)}")
        bad = sorted(set(limits) - {"max_running", "max_queued"})
        if bad or not all(isinstance(v, int) and not isinstance(v, bool) for v in limits.values()):
            raise ValueError(f"router field `limits.{klass}`: integers `max_running` and `max_queued` only, "
                             f"got {dict(limits)}")
        out[klass] = ClassLimits(**limits)
    return out
