"""Server scaffolding shared by every cedserve process (prefill worker, decode worker, router).

Nothing here knows a worker's internals; a worker plugs in through small callbacks. Contract:

* `GrpcServer(host, port, max_workers, tls, health_port)`: a `grpc.Server` with `grpc.health.v1.Health`
  registered (services `""` and `"liveness"`, both `NOT_SERVING` until `health.set_ready(True)`), bound
  at construction (port 0: a free one; `address` and `port` are the bound ones), TLS-only when `tls`
  is enabled (`cedserve.tls`), plus an optional plaintext health-only listener for kubelet probes.
  With a `token` (the worker plane's shared secret, `ServeConfig.internal_token_file`) every call on
  the port except health and the loopback-only Drain must carry it (`TokenInterceptor`).
  Add servicers through `server.grpc`, then `start()`. `stop(grace_s)` waits for the stop to finish.
* `Health`: `set_ready(bool)` drives `""` (readiness/startup), `set_alive(bool)` drives `"liveness"`.
* `start_metrics_server(host, port, registry)`: Prometheus `/metrics` over HTTP for one registry
  (never the process-global one); returns the bound port (0: a free one).
* `DrainController`: the single place that decides "we are draining". `install_signal_handlers()`
  (main thread only) makes SIGTERM/SIGINT request a drain and an exit; `LifecycleServicer` serves
  `cedserve.v1.Lifecycle.Drain` (loopback peers only), which drains without exiting. The owner calls
  `wait_requested()` in its main thread, drains its engine, calls `finish(drained)` (`Drain` RPCs
  block until then or their timeout), then `wait_exit()` before stopping: after a preStop drain the
  process keeps answering health checks (NOT_SERVING) until SIGTERM. The client side, `request_drain`,
  is `cedserve.drain` (kept free of torch for the preStop hook).
* `KVEventFeed`: a thread-safe fan-out of `KVEventBatch`es. Pass `feed.publish` as the cache
  manager's `event_sink`; serve `StreamKVEvents` with `feed.stream(since_seq, snapshot, context)`.
* `RateMeter`: measured tokens/s over a sliding window (load reports); `SeqCounter` numbers reports.
* Errors: engines raise the domain errors of `cedserve.errors` (`ServingError` and its subclasses,
  each of an `ErrorKind`) and know nothing of the wire; this section is the one place that maps them:
  `error_detail(exc, request_id)` maps one (and the cache's and transfer layer's typed errors) to an
  `ErrorDetail`, `wire_code(kind)` gives a kind's `ErrorCode`, `status_code` the gRPC status; `abort(context, detail)` ends a unary call with it, `fail_stream(context,
  detail)` sets it as a stream's final status. Both attach the serialized `ErrorDetail` as trailing
  metadata `cedserve-error-bin`, which `detail_from_rpc_error(err)` reads back on the client.
* `load_worker_model(checkpoint, preset, seed)`: the model a worker serves and the `model_id` both
  sides put in the KV compatibility hash (same checkpoint bytes or same preset+seed -> same id).
  `read_serve_file(path, sections)`: the `ServeConfig` of a worker's `--config` file plus the raw
  tables of the role's own sections (e.g. `[prefill]`, `[kv_transfer]`), which ServeConfig does not own.
* `ready_line(role, **fields)`: the machine-readable line launchers wait for:
  `CEDSERVE_READY {"role": ..., "address": ..., ...}` (one line of JSON after the marker).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, start_http_server

from cedserve.config import TOKEN_METADATA_KEY, ServeConfig

# The engines' domain errors, re-exported: the service layer maps them (below).
from cedserve.errors import (
    ERRORS,
)
from cedserve.errors import (
    CancelledError as CancelledError,
)
from cedserve.errors import (
    DeadlineExceededError as DeadlineExceededError,
)
from cedserve.errors import (
    ErrorKind as ErrorKind,
)
from cedserve.errors import (
    InvalidArgumentError as InvalidArgumentError,
)
from cedserve.errors import (
    NotFoundError as NotFoundError,
)
from cedserve.errors import (
    ResourceExhaustedError as ResourceExhaustedError,
)
from cedserve.errors import (
    ServingError as ServingError,
)
from cedserve.errors import (
    TransferFailedError as TransferFailedError,
)
from cedserve.errors import (
    UnavailableError as UnavailableError,
)
from cedserve.kv_transfer.errors import FailureCause, KVTransferError
from cedserve.model.cache.errors import CacheExhaustedError, UnknownRequestError
from cedserve.model.cache.events import KVEventBatch, encode_batch
from cedserve.model.network import CEDModel
from cedserve.proto import lifecycle_pb2, lifecycle_pb2_grpc
from cedserve.proto import worker_pb2 as wpb
from cedserve.tls import PLAINTEXT, TLSConfig, add_port

log = logging.getLogger(__name__)

READY_MARKER = "CEDSERVE_READY"
ERROR_METADATA_KEY = "cedserve-error-bin"
LIVENESS_SERVICE = "liveness"
DEFAULT_RETRY_AFTER_MS = 500

# ------------------------------------------------------------------ errors


_WIRE_CODES: dict[ErrorKind, wpb.ErrorCode] = {
    ErrorKind.INVALID_ARGUMENT: wpb.ERROR_CODE_INVALID_ARGUMENT,
    ErrorKind.RESOURCE_EXHAUSTED: wpb.ERROR_CODE_RESOURCE_EXHAUSTED,
    ErrorKind.DEADLINE_EXCEEDED: wpb.ERROR_CODE_DEADLINE_EXCEEDED,
    ErrorKind.UNAVAILABLE: wpb.ERROR_CODE_UNAVAILABLE,
    ErrorKind.CANCELLED: wpb.ERROR_CODE_CANCELLED,
    ErrorKind.NOT_FOUND: wpb.ERROR_CODE_NOT_FOUND,
    ErrorKind.INTERNAL: wpb.ERROR_CODE_INTERNAL,
    ErrorKind.TRANSFER_FAILED: wpb.ERROR_CODE_TRANSFER_FAILED,
}
"""The wire's `ErrorCode` of each domain `ErrorKind` (`cedserve.errors`): the one place they meet."""


def wire_code(kind: ErrorKind) -> wpb.ErrorCode:
    """The `cedserve.v1.ErrorCode` of a domain error kind."""
    return _WIRE_CODES[kind]


def error_from_wire(detail: wpb.ErrorDetail, message: str) -> ServingError:
    """The domain error of a peer's `ErrorDetail` (UNSPECIFIED: INTERNAL), carrying `message`."""
    kind = next((k for k, code in _WIRE_CODES.items() if code == detail.code), ErrorKind.INTERNAL)
    return ERRORS[kind](message, field=detail.field, retry_after_ms=detail.retry_after_ms,
                        request_id=detail.request_id)


_STATUS: dict[wpb.ErrorCode, grpc.StatusCode] = {
    wpb.ERROR_CODE_UNSPECIFIED: grpc.StatusCode.UNKNOWN,
    wpb.ERROR_CODE_INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    wpb.ERROR_CODE_RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    wpb.ERROR_CODE_DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    wpb.ERROR_CODE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    wpb.ERROR_CODE_CANCELLED: grpc.StatusCode.CANCELLED,
    wpb.ERROR_CODE_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    wpb.ERROR_CODE_INTERNAL: grpc.StatusCode.INTERNAL,
    wpb.ERROR_CODE_TRANSFER_FAILED: grpc.StatusCode.UNAVAILABLE,
}

_TRANSFER_KINDS: dict[FailureCause, ErrorKind] = {
    FailureCause.CANCELLED: ErrorKind.CANCELLED,
    FailureCause.DEADLINE: ErrorKind.DEADLINE_EXCEEDED,
    FailureCause.INVALID: ErrorKind.NOT_FOUND,
    FailureCause.SHUTDOWN: ErrorKind.UNAVAILABLE,
}


def error_kind(exc: BaseException) -> ErrorKind:
    """The domain kind of an engine's error (the cache's and the transfer layer's included); anything
    unknown is INTERNAL."""
    if isinstance(exc, ServingError):
        return exc.kind
    if isinstance(exc, CacheExhaustedError):
        return ErrorKind.RESOURCE_EXHAUSTED
    if isinstance(exc, KVTransferError):
        return _TRANSFER_KINDS.get(exc.cause, ErrorKind.TRANSFER_FAILED)
    if isinstance(exc, UnknownRequestError):
        return ErrorKind.NOT_FOUND
    return ErrorKind.INTERNAL


def error_detail(exc: BaseException, request_id: str = "") -> wpb.ErrorDetail:
    """The `ErrorDetail` for an engine's error (`error_kind`); an unknown one keeps its type's name."""
    kind = error_kind(exc)
    own_id = exc.request_id if isinstance(exc, ServingError | CacheExhaustedError | KVTransferError) else ""
    detail = wpb.ErrorDetail(code=wire_code(kind), message=str(exc), request_id=own_id or request_id)
    if isinstance(exc, ServingError):
        detail.field, detail.retry_after_ms = exc.field, exc.retry_after_ms
    elif isinstance(exc, CacheExhaustedError):
        detail.retry_after_ms = DEFAULT_RETRY_AFTER_MS
    elif kind is ErrorKind.INTERNAL:
        detail.message = f"{type(exc).__name__}: {exc}"
    return detail


def status_code(code: wpb.ErrorCode) -> grpc.StatusCode:
    """gRPC status for an `ErrorCode` value."""
    return _STATUS.get(code, grpc.StatusCode.UNKNOWN)


def _status_text(detail: wpb.ErrorDetail) -> str:
    where = f" (field `{detail.field}`)" if detail.field else ""
    return f"{detail.message}{where}"


def fail_stream(context: grpc.ServicerContext, detail: wpb.ErrorDetail) -> None:
    """Make `detail` the final status of a server stream (the handler then returns normally)."""
    context.set_trailing_metadata(((ERROR_METADATA_KEY, detail.SerializeToString()),))
    context.set_code(status_code(detail.code))
    context.set_details(_status_text(detail))


def abort(context: grpc.ServicerContext, detail: wpb.ErrorDetail) -> None:
    """End a unary call with `detail` (raises, as `context.abort` does)."""
    context.set_trailing_metadata(((ERROR_METADATA_KEY, detail.SerializeToString()),))
    context.abort(status_code(detail.code), _status_text(detail))


def detail_from_rpc_error(err: grpc.RpcError) -> wpb.ErrorDetail | None:
    """The `ErrorDetail` a cedserve server attached to a failed call, if any."""
    trailing: Any = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == ERROR_METADATA_KEY and isinstance(value, bytes):
            return wpb.ErrorDetail.FromString(value)
    return None


# ------------------------------------------------------------------ gRPC server + health


class Health:
    """The two health services: `""` (startup, readiness) and `"liveness"`."""

    def __init__(self) -> None:
        self.servicer = health.HealthServicer(experimental_non_blocking=True)
        self.set_ready(False)
        self.set_alive(False)

    def set_ready(self, ready: bool) -> None:
        self.servicer.set("", _serving(ready))

    def set_alive(self, alive: bool) -> None:
        self.servicer.set(LIVENESS_SERVICE, _serving(alive))


def _serving(flag: bool) -> Any:
    return health_pb2.HealthCheckResponse.SERVING if flag else health_pb2.HealthCheckResponse.NOT_SERVING


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


# Health answers kubelet probes, which carry no metadata; Lifecycle.Drain accepts loopback peers only
# (the preStop hook's `cedserve drain`), the same exemptions the router's API-key check makes.
_TOKEN_EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/cedserve.v1.Lifecycle/")


class TokenInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Refuses UNAUTHENTICATED every call whose `x-cedserve-token` metadata is not `token` (compared
    in constant time), except the exempt services above. The handler is looked up first so an unknown
    method still answers UNIMPLEMENTED and a refused stream is refused as a stream."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("TokenInterceptor: empty token (leave the interceptor out to run without one)")
        self._token = token.encode()

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
                          handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(_TOKEN_EXEMPT_PREFIXES):
            return handler
        given = _metadata_value(handler_call_details.invocation_metadata or (), TOKEN_METADATA_KEY)
        if hmac.compare_digest(given.encode(), self._token):
            return handler
        return _refuse(handler, f"{method} needs the worker-plane token in `{TOKEN_METADATA_KEY}` metadata"
                       + (" (the one given does not match)" if given else " (none given)"))


def _metadata_value(metadata: Any, key: str) -> str:
    for k, v in metadata:
        if k == key:
            return v.decode(errors="replace") if isinstance(v, bytes) else str(v)
    return ""


def _refuse(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that ends the call UNAUTHENTICATED without reading requests."""
    def deny(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    codec = {"request_deserializer": handler.request_deserializer,
             "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **codec)
    return grpc.unary_unary_rpc_method_handler(deny, **codec)


class GrpcServer:
    """A bound (not yet started) gRPC server with the health services registered.

    With `tls` enabled the port serves only TLS (mTLS with `tls.require_client_cert`). Kubelet gRPC
    probes speak plaintext only, so `health_port` >= 0 adds a plaintext listener that serves only
    `grpc.health.v1.Health` and the loopback-only `Lifecycle.Drain` (the preStop hook), never the
    worker's own service (port 0: a free one, see `health_port`). A non-empty `token` guards the
    main port with `TokenInterceptor`; the health listener serves nothing it would guard."""

    def __init__(self, host: str, port: int, max_workers: int = 16, tls: TLSConfig = PLAINTEXT,
                 health_port: int = -1, token: str = "") -> None:
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                                interceptors=[TokenInterceptor(token)] if token else None)
        self.health = Health()
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, self.grpc)
        bound = add_port(self.grpc, format_address(host, port), tls, "internal_tls")
        if bound == 0:
            raise OSError(f"gRPC server could not bind {format_address(host, port)}")
        self.host = host
        self.port = bound
        self.tls = tls
        self._health_only: grpc.Server | None = None
        self.health_port = -1
        if health_port >= 0:
            self._health_only = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="health"))
            health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, self._health_only)
            self.health_port = self._health_only.add_insecure_port(format_address(host, health_port))
            if self.health_port == 0:
                raise OSError(f"health listener could not bind {format_address(host, health_port)}")

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def listeners(self) -> list[grpc.Server]:
        return [self.grpc] if self._health_only is None else [self.grpc, self._health_only]

    def start(self) -> None:
        self.grpc.start()
        if self._health_only is not None:
            self._health_only.start()

    def stop(self, grace_s: float = 1.0) -> None:
        self.health.servicer.enter_graceful_shutdown()
        self.grpc.stop(grace_s).wait()
        if self._health_only is not None:
            self._health_only.stop(0).wait()


def start_metrics_server(host: str, port: int, registry: CollectorRegistry) -> int:
    """Serve `registry` at `http://host:port/metrics` from a daemon thread; returns the bound port.
    A negative port disables the endpoint (returns -1)."""
    if port < 0:
        return -1
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)


def ready_line(role: str, address: str, **fields: object) -> str:
    """`CEDSERVE_READY {json}`: printed (and flushed) once a process serves."""
    return f"{READY_MARKER} " + json.dumps({"role": role, "address": address, **fields}, sort_keys=True)


def parse_ready_line(line: str) -> dict[str, Any] | None:
    """The JSON of a ready line, or None for any other line."""
    if not line.startswith(READY_MARKER + " "):
        return None
    value: dict[str, Any] = json.loads(line[len(READY_MARKER) + 1:])
    return value


# ------------------------------------------------------------------ drain


class DrainController:
    """Drain state of one process. Thread-safe.

    `request(reason)` flips to draining (idempotent); `wait_requested()` blocks the owner until then;
    the owner drains and calls `finish(drained, in_flight)`; `wait_finished(timeout_s)` lets RPCs wait.
    """

    def __init__(self, health: Health | None = None, default_timeout_s: float = 30.0) -> None:
        self.default_timeout_s = default_timeout_s
        self._health = health
        self._requested = threading.Event()
        self._finished = threading.Event()
        self._exit = threading.Event()
        self._deadline_s = 0.0
        self._drained = False
        self._in_flight = 0
        self._lock = threading.Lock()

    @property
    def draining(self) -> bool:
        return self._requested.is_set()

    @property
    def deadline_s(self) -> float:
        """`time.monotonic()` by which the drain should end (valid once requested)."""
        return self._deadline_s

    def request(self, reason: str, timeout_s: float | None = None) -> None:
        """Start draining: readiness turns NOT_SERVING at once. A second request can only shorten
        the deadline."""
        with self._lock:
            deadline = time.monotonic() + (timeout_s if timeout_s else self.default_timeout_s)
            if self._requested.is_set():
                self._deadline_s = min(self._deadline_s, deadline)
                return
            self._deadline_s = deadline
            log.info("drain requested (%s); deadline in %.1f s", reason, deadline - time.monotonic())
            if self._health is not None:
                self._health.set_ready(False)
            self._requested.set()

    def wait_requested(self, timeout_s: float | None = None) -> bool:
        return self._requested.wait(timeout_s)

    def finish(self, drained: bool, in_flight: int = 0) -> None:
        with self._lock:
            self._drained, self._in_flight = drained, in_flight
        self._finished.set()

    def wait_finished(self, timeout_s: float | None) -> tuple[bool, int]:
        """(drained, requests left in flight); (False, -1) when the timeout passed first."""
        if not self._finished.wait(timeout_s):
            return False, -1
        with self._lock:
            return self._drained, self._in_flight

    def request_exit(self, reason: str) -> None:
        """Drain (if not already) and then exit: what SIGTERM means."""
        self.request(reason)
        self._exit.set()

    def wait_exit(self, timeout_s: float | None = None) -> bool:
        """After a drain requested over RPC (preStop), the process keeps answering health checks
        (NOT_SERVING) until SIGTERM arrives."""
        return self._exit.wait(timeout_s)

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT request a drain and then an exit (a second SIGINT exits at once). Main
        thread only."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.draining:
            raise KeyboardInterrupt
        # Handlers run between bytecodes of the main thread: only set flags here.
        threading.Thread(target=self.request_exit, args=(signal.Signals(signum).name,), daemon=True).start()


def is_loopback_peer(peer: str) -> bool:
    """`context.peer()` strings: "ipv4:127.0.0.1:5", "ipv6:[::1]:5", "unix:..."."""
    if peer.startswith("unix:"):
        return True
    if peer.startswith("ipv4:"):
        return peer[5:].startswith("127.")
    if peer.startswith("ipv6:"):
        host = peer[5:].rsplit(":", 1)[0].strip("[]")
        return host in ("::1", "::ffff:127.0.0.1") or host.startswith("::ffff:127.")
    return False


class LifecycleServicer(lifecycle_pb2_grpc.LifecycleServicer):
    """`cedserve.v1.Lifecycle`: Drain, accepted from loopback peers only."""

    def __init__(self, drain: DrainController) -> None:
        self._drain = drain

    def Drain(self, request: lifecycle_pb2.DrainRequest, context: grpc.ServicerContext) -> lifecycle_pb2.DrainReply:
        if not is_loopback_peer(context.peer()):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "Drain is accepted only from a loopback peer")
        timeout_s = request.timeout_s or self._drain.default_timeout_s
        self._drain.request("Drain RPC", timeout_s)
        remaining = context.time_remaining()
        wait_s = timeout_s if remaining is None else min(timeout_s, max(0.0, remaining - 0.1))
        drained, in_flight = self._drain.wait_finished(wait_s)
        return lifecycle_pb2.DrainReply(drained=drained, in_flight=max(in_flight, 0))


def add_lifecycle(server: GrpcServer, drain: DrainController) -> None:
    """`Lifecycle` on the server's port and on its plaintext health listener, if any."""
    for listener in server.listeners():
        lifecycle_pb2_grpc.add_LifecycleServicer_to_server(  # type: ignore[no-untyped-call]
            LifecycleServicer(drain), listener)


# ------------------------------------------------------------------ KV events


class KVEventFeed:
    """Fan-out of a worker's KV event batches to any number of `StreamKVEvents` calls.

    `publish` is the cache manager's `event_sink` (called on the engine thread); each stream reads
    from its own queue, so a slow router never blocks the engine. Keeps the last `keep` batches for
    resumption by `since_seq`.
    """

    def __init__(self, keep: int = 1024, poll_s: float = 0.5) -> None:
        self._cond = threading.Condition()
        self._kept: collections.deque[KVEventBatch] = collections.deque(maxlen=keep)
        self._queues: list[collections.deque[KVEventBatch]] = []
        self._closed = False
        self._poll_s = poll_s

    def publish(self, batch: KVEventBatch) -> None:
        with self._cond:
            self._kept.append(batch)
            for q in self._queues:
                q.append(batch)
            self._cond.notify_all()

    def close(self) -> None:
        """End every stream (process shutdown)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def stream(self, since_seq: int, snapshot: Callable[[], KVEventBatch],
               context: grpc.ServicerContext) -> Iterator[wpb.KVEventBatch]:
        """Batches with `seq >= since_seq` (0, or batches no longer kept: a `snapshot()` instead), then
        live ones until the call ends. `snapshot` must be safe to call from this thread."""
        queue: collections.deque[KVEventBatch] = collections.deque()
        with self._cond:
            self._queues.append(queue)
            backlog = self._backlog(since_seq)
        try:
            if backlog is None:
                snap = snapshot()
                backlog = [snap]
                _drop_upto(queue, snap.seq)
            yield from (_to_pb(b) for b in backlog)
            while context.is_active():
                batch = self._next(queue)
                if batch is None and self._closed:
                    return
                if batch is not None:
                    yield _to_pb(batch)
        finally:
            with self._cond:
                self._queues.remove(queue)

    def _backlog(self, since_seq: int) -> list[KVEventBatch] | None:
        if since_seq == 0 or not self._kept or self._kept[0].seq > since_seq:
            return None
        return [b for b in self._kept if b.seq >= since_seq]

    def _next(self, queue: collections.deque[KVEventBatch]) -> KVEventBatch | None:
        with self._cond:
            if not queue and not self._closed:
                self._cond.wait(self._poll_s)
            return queue.popleft() if queue else None


def _drop_upto(queue: collections.deque[KVEventBatch], seq: int) -> None:
    while queue and queue[0].seq <= seq:
        queue.popleft()


def _to_pb(batch: KVEventBatch) -> wpb.KVEventBatch:
    return wpb.KVEventBatch(worker_id=batch.worker_id, seq=batch.seq, events_msgpack=encode_batch(batch),
                            snapshot=batch.is_snapshot)


# ------------------------------------------------------------------ load bookkeeping


class RateMeter:
    """Tokens (or steps) per second measured over the last `window_s` seconds. Thread-safe."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._samples: collections.deque[tuple[float, float, int]] = collections.deque()  # (start, end, n)
        self._lock = threading.Lock()

    def record(self, amount: int, busy_s: float) -> None:
        """`amount` units done in the last `busy_s` seconds of work."""
        now = self._clock()
        with self._lock:
            self._samples.append((now - busy_s, now, amount))
            self._trim(now)

    def rate(self) -> float:
        """Units per second of busy time in the window (0.0 with no samples): a capacity, not a load."""
        with self._lock:
            self._trim(self._clock())
            busy = sum(end - start for start, end, _ in self._samples)
            done = sum(n for _, _, n in self._samples)
        return done / busy if busy > 0 else 0.0

    def _trim(self, now: float) -> None:
        while self._samples and self._samples[0][1] < now - self.window_s:
            self._samples.popleft()


class SeqCounter:
    """Monotonic sequence numbers for load reports (thread-safe)."""

    def __init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            self._next += 1
            return self._next


@dataclass(frozen=True)
class Endpoints:
    """Where a started process listens (what the ready line reports)."""

    grpc_address: str
    metrics_port: int


# ------------------------------------------------------------------ model and config files


@dataclass(frozen=True)
class LoadedModel:
    model: CEDModel
    model_id: str
    """Names the weights: goes into the KV transfer compatibility hash (`KVLayout.from_config`)."""
    source: str


def checkpoint_identity(folder: str | Path) -> str:
    """sha256 (16 hex) over config.json and every shard's size and safetensors header (names, shapes,
    offsets, writer metadata): two copies of one checkpoint agree without hashing gigabytes."""
    folder = Path(folder)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for shard in sorted(folder.glob("*.safetensors")):
        with shard.open("rb") as f:
            head = f.read(8)
            header = f.read(int.from_bytes(head, "little")) if len(head) == 8 else b""
        digest.update(shard.name.encode() + str(shard.stat().st_size).encode() + header)
    return digest.hexdigest()[:16]


def load_worker_model(checkpoint: str | None, preset_name: str | None, seed: int = 0,
                      device: str = "cpu") -> LoadedModel:
    """A checkpoint folder (`load_model`), else a preset with random weights from `seed`."""
    if checkpoint:
        from cedserve.model.checkpoint import load_model

        return LoadedModel(load_model(checkpoint, device=device), checkpoint_identity(checkpoint), checkpoint)
    if not preset_name:
        raise ValueError("config field `model`: set `checkpoint` or `preset`")
    from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model
    from cedserve.model.presets import preset
    from cedserve.model.tokenizer import tiny_tokenizer_path

    tokenizer = tiny_tokenizer_path()
    model, _drafter = random_model(fit_config_to_tokenizer(preset(preset_name), tokenizer), tokenizer, seed)
    return LoadedModel(model.to(device), f"preset:{preset_name}:seed{seed}", f"preset {preset_name}")


def read_serve_file(path: str | Path | None, sections: tuple[str, ...]) -> tuple[ServeConfig, dict[str, Any]]:
    """`ServeConfig` from a `.toml`/`.json` file (defaults when `path` is None) and the raw tables of
    `sections`, removed before ServeConfig (which forbids unknown fields) decodes the rest."""
    if path is None:
        return ServeConfig(), {}
    return ServeConfig.load_with_sections(path, sections)


# ------------------------------------------------------------------ worker command line


@dataclass(frozen=True)
class WorkerOptions:
    """`cedserve worker` flags (docs/deploy.md); a flag overrides the same setting of `--config`."""

    role: str
    config: str | None = None
    checkpoint: str | None = None
    preset: str | None = None
    """Random weights of a named preset (`tiny`, `mini-40`) when no checkpoint is given."""
    seed: int = 0
    """Seed of the preset's random weights (both sides of a transfer must use the same)."""
    host: str = "127.0.0.1"
    grpc_port: int = 0
    nixl_port: int = 0
    metrics_port: int = -1
    """-1: no metrics endpoint; 0: a free port (reported in the ready line)."""
    dist_port: int = 29500
    advertise_host: str | None = None
    group_size: int = 1
    rank: int = 0
    leader_address: str | None = None
    worker_id: str | None = None
    health_port: int = -1
    """Plaintext listener for kubelet probes (they cannot speak TLS) and the loopback-only Drain;
    -1: none."""
    tls_cert: str | None = None
    """`--tls-*` flags: override the config file's `[internal_tls]` fields (None: not given)."""
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_require_client_cert: bool | None = None
    tls_server_name: str | None = None

    def internal_tls(self, from_file: TLSConfig) -> TLSConfig:
        """The worker's `[internal_tls]` with the flags applied."""
        return from_file.override(cert=self.tls_cert, key=self.tls_key, ca=self.tls_ca,
                                  require_client_cert=self.tls_require_client_cert, server_name=self.tls_server_name)

    @property
    def public_host(self) -> str:
        """The host peers and the router use for this process."""
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    def check(self) -> None:
        if self.group_size < 1 or not 0 <= self.rank < self.group_size:
            raise ValueError(f"--rank {self.rank} is not in [0, --group-size {self.group_size})")
