"""Drain: the single place that decides "this process is draining".

`DrainController.install_signal_handlers()` (main thread only) makes SIGTERM/SIGINT request a drain
and an exit; `LifecycleServicer` serves `cedserve.v1.Lifecycle.Drain` (loopback peers only), which
drains without exiting. The owner calls `wait_requested()` in its main thread, drains its engine,
calls `finish(drained)` (`Drain` RPCs block until then or their timeout), then `wait_exit()` before
stopping: after a preStop drain the process keeps answering health checks (NOT_SERVING) until
SIGTERM. The client side, `request_drain`, is `cedserve.drain` (kept free of grpc servers and torch
for the preStop hook). The router keeps its own asyncio drain (`router/lifecycle.py`) and shares
`is_loopback_peer`.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType

import grpc

from cedserve.proto import lifecycle_pb2, lifecycle_pb2_grpc
from cedserve.serving.server import GrpcServer, Health

log = logging.getLogger(__name__)


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
