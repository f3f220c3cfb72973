"""The router process as the Helm chart runs it: workers found through Kubernetes discovery, and a
graceful drain through `cedserve drain` (the preStop hook) and through SIGTERM.

Real processes: one prefill and one decode worker (real gRPC, real NIXL between them), and
`cedserve router --namespace ... --prefill-service ... --decode-service ...` with no static worker
list. The Kubernetes API is the boundary fake of tests/unit/kube_api_fake.py, which the router's
`kubernetes` client reaches through a kubeconfig (`$KUBECONFIG`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cedserve.client import CedserveError, Client
from cedserve.launcher import LocalLauncher, Part, ensure_preset_checkpoint
from cedserve.proto import registry_pb2, registry_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))
from kube_api_fake import FakeKubeAPI, Pod, endpoint_slice  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
pytest.importorskip("kubernetes", reason="discovery needs the kubernetes client (cedserve[k8s])")
NS = "serving"
SHORT = 48  # output tokens of a stream that SIGTERM must let finish (seconds on a CPU)
OPEN = 2000  # a stream the client ends itself, long after the drain started


class Rig:
    """Two workers, a fake API server listing them, and routers started on demand."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.checkpoint = ensure_preset_checkpoint("tiny", root / "home")
        self.launcher = LocalLauncher(root / "logs")
        token = root / "token"
        token.write_text("e2e-token")
        token.chmod(0o600)
        config = root / "worker.toml"
        config.write_text(f'[kv_transfer]\nauth_token_file = "{token}"\n')
        common = ["--checkpoint", str(self.checkpoint), "--config", str(config), "--host", "127.0.0.1", "--port", "0"]
        parts = [self.launcher.spawn(wid, ["worker", "--role", role, "--worker-id", wid, *common])
                 for role, wid in (("prefill", "ced-prefill-0"), ("decode", "ced-decode-0"))]
        self.workers = {p.name: p.wait_ready(180) for p in parts}
        self.api = FakeKubeAPI()
        for role in ("prefill", "decode"):
            wid = f"ced-{role}-0"
            port = int(self.workers[wid]["address"].rsplit(":", 1)[1])
            self.api.put(endpoint_slice(NS, f"ced-{role}-abc", f"ced-{role}-headless", [Pod(wid, "127.0.0.1")], port))
        self.kubeconfig = root / "kubeconfig"
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.api.url}}],
            "users": [{"name": "router", "user": {"token": "unused"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "router", "namespace": NS}}]}))

    def start_router(self, name: str, *extra: str) -> tuple[Part, str]:
        env = {"KUBECONFIG": str(self.kubeconfig)}
        env_clean = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        part = self.launcher.spawn(name, [
            "router", "--checkpoint", str(self.checkpoint), "--host", "127.0.0.1", "--port", "0",
            "--namespace", NS, "--prefill-service", "ced-prefill-headless",
            "--decode-service", "ced-decode-headless", *extra], env={**env_clean, **env})
        address = str(part.wait_ready(60)["address"])
        _until(lambda: sorted(w.worker_id for w in _workers(address) if w.healthy)
               == ["ced-decode-0", "ced-prefill-0"], 30, "discovered workers healthy")
        return part, address

    def close(self) -> None:
        self.launcher.stop_all()
        self.api.close()


def _until(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out: {what}")
        time.sleep(0.1)


def _workers(address: str) -> list[registry_pb2.WorkerState]:
    with grpc.insecure_channel(address) as ch:
        stub = registry_pb2_grpc.WorkerRegistryStub(ch)  # type: ignore[no-untyped-call]
        return list(stub.ListWorkers(registry_pb2.ListWorkersRequest(), timeout=5).workers)


def _health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(reply.status)


class Stream:
    """A Generate stream read on a thread; `first` is set once a token arrived, `hang_up` makes the
    client end (cancel) it at its next chunk."""

    def __init__(self, address: str, max_tokens: int) -> None:
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.error: BaseException | None = None
        self.first = threading.Event()
        self.hang_up = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(address, max_tokens), daemon=True)
        self.thread.start()

    def _run(self, address: str, max_tokens: int) -> None:
        try:
            with Client(address, timeout_s=300) as client:
                for piece in client.stream(list(range(3, 303)), max_tokens=max_tokens):
                    self.tokens.extend(piece.token_ids)
                    self.first.set()
                    if self.hang_up.is_set():
                        return
                self.finish = client.last.finish_reason if client.last else None
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.first.set()


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    r = Rig(tmp_path_factory.mktemp("router_lifecycle"))
    yield r
    r.close()


def test_discovered_workers_serve_and_follow_the_api(rig: Rig) -> None:
    part, address = rig.start_router("router-discovery")
    with Client(address, timeout_s=60) as client:
        done = client.generate(list(range(3, 303)), max_tokens=4)  # > 256 tokens: prefill worker + NIXL
    assert done.finish_reason == "length" and len(done.token_ids) == 4
    # The decode pod stops serving (its readiness failed): the router takes it out; it comes back.
    port = int(rig.workers["ced-decode-0"]["address"].rsplit(":", 1)[1])
    rig.api.put(endpoint_slice(NS, "ced-decode-abc", "ced-decode-headless",
                               [Pod("ced-decode-0", "127.0.0.1", serving=False)], port))
    _until(lambda: [w.worker_id for w in _workers(address)] == ["ced-prefill-0"], 10, "decode removed")
    with Client(address, timeout_s=30) as client, pytest.raises(CedserveError) as info:
        client.generate("hello", max_tokens=2)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    rig.api.put(endpoint_slice(NS, "ced-decode-abc", "ced-decode-headless", [Pod("ced-decode-0", "127.0.0.1")], port))
    _until(lambda: any(w.worker_id == "ced-decode-0" and w.healthy for w in _workers(address)), 10, "decode back")
    with Client(address, timeout_s=60) as client:
        assert len(client.generate("hello", max_tokens=3).token_ids) == 3
    part.proc.send_signal(signal.SIGTERM)
    assert part.proc.wait(15) == 0


def test_prestop_drain_keeps_open_streams_then_sigterm_exits(rig: Rig) -> None:
    part, address = rig.start_router("router-drain")
    stream = Stream(address, OPEN)
    assert stream.first.wait(60) and stream.error is None
    # What the pod's preStop hook runs.
    drain = subprocess.Popen([sys.executable, "-m", "cedserve.cli", "drain", "--address", address, "--timeout-s", "60"],
                             stdout=subprocess.PIPE, text=True)
    _until(lambda: _health(address, "") == health_pb2.HealthCheckResponse.NOT_SERVING, 60, "NOT_SERVING")
    assert _health(address, "liveness") == health_pb2.HealthCheckResponse.SERVING
    with Client(address, timeout_s=10) as client, pytest.raises(CedserveError) as info:
        client.generate("new work", max_tokens=2)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.message
    with Client(address, timeout_s=10) as client:  # cheap calls still answer
        assert client.count_tokens("hello") > 0
    # The open stream keeps flowing while the drain waits for it ...
    seen = len(stream.tokens)
    _until(lambda: len(stream.tokens) >= seen + 3, 60, "the open stream keeps streaming")
    assert drain.poll() is None
    # ... and the drain finishes as soon as it ends (here the client hangs up).
    stream.hang_up.set()
    out, _ = drain.communicate(timeout=60)
    assert json.loads(out) == {"reached": True, "drained": True, "in_flight": 0}
    assert stream.error is None
    # After preStop the process stays up (answering NOT_SERVING) until SIGTERM, then exits at once.
    assert part.proc.poll() is None
    t = time.monotonic()
    part.proc.send_signal(signal.SIGTERM)
    assert part.proc.wait(10) == 0 and time.monotonic() - t < 5


def test_sigterm_alone_drains_with_the_configured_grace(rig: Rig) -> None:
    part, address = rig.start_router("router-sigterm", "--drain-timeout-s", "120")
    stream = Stream(address, SHORT)
    assert stream.first.wait(60) and stream.error is None
    part.proc.send_signal(signal.SIGTERM)
    _until(lambda: _health(address, "") == health_pb2.HealthCheckResponse.NOT_SERVING, 10, "NOT_SERVING")
    with Client(address, timeout_s=10) as client, pytest.raises(CedserveError) as info:
        client.generate("new work", max_tokens=2)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert part.proc.wait(120) == 0
    stream.thread.join(10)
    assert stream.error is None and stream.finish == "length" and len(stream.tokens) == SHORT
