"""Router configuration: one typed, frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from cedserve.router.admission import ClassLimits


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
class RouterConfig:
    checkpoint: str
    """Checkpoint folder: its config.json and tokenizer.json define the served model."""
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
    """Largest request accepted (gRPC refuses bigger ones with RESOURCE_EXHAUSTED)."""
    metrics_port: int | None = None
    """Prometheus endpoint; None: off."""
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    """With a CA, clients must present certificates (mTLS)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"router field `port`: must be in [0, 65535], got {self.port}")
        if self.max_retries < 0:
            raise ValueError(f"router field `max_retries`: must be >= 0, got {self.max_retries}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("router fields `tls_cert` and `tls_key` must be given together")
        ids = [w.worker_id for w in (*self.prefill, *self.decode)]
        if len(ids) != len(set(ids)):
            raise ValueError(f"router field `workers`: duplicate worker ids in {ids}")
