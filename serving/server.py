"""The gRPC server every cedserve worker process serves from, with its health services.

* `GrpcServer(host, port, max_workers, tls, health_port, token)`: a `grpc.Server` with
  `grpc.health.v1.Health` registered (services `""` and `"liveness"`, both `NOT_SERVING` until
  `health.set_ready(True)`), bound at construction (port 0: a free one; `address` and `port` are the
  bound ones), TLS-only when `tls` is enabled (`cedserve.common.tls`), plus an optional plaintext
  health-only listener for kubelet probes. With a `token` (the worker plane's shared secret,
  `ServeConfig.internal_token_file`) every call on the port except health and the loopback-only Drain
  must carry it (`TokenInterceptor`). Add servicers through `server.grpc`, then `start()`.
  `stop(grace_s)` waits for the stop to finish.
* `Health`: `set_ready(bool)` drives `""` (readiness/startup), `set_alive(bool)` drives `"liveness"`.
* `start_metrics_server(host, port, registry)`: Prometheus `/metrics` over HTTP for one registry
  (never the process-global one); returns the bound port (0: a free one).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, start_http_server

from cedserve.common.credentials import TOKEN_METADATA_KEY
from cedserve.common.tls import PLAINTEXT, TLSConfig, add_port

LIVENESS_SERVICE = "liveness"


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
