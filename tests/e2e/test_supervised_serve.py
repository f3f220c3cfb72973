"""`cedserve serve` supervises its processes (cedserve/supervise.py), tested as an operator sees it:
the real command, kill -9 of a worker and of the router while a client streams, `cedserve drain`.

- a killed decode worker: the open stream fails with a status at once; the worker is started again,
  registered with the router at its new address, and serves the same greedy answer; its blocks are
  all free; the restart is printed;
- a killed router is started again on the same ports (gRPC and HTTP), in front of the workers'
  current addresses;
- kill -9 of each kind under load (cedserve/bench/serve/chaos.py): detected within a second, serving
  again within 30 s, no block held afterwards, every request ended with a completion or a status;
- `cedserve drain` stops the whole system with exit code 0 and no process left behind;
- past `--max-restarts` the system stops with exit code 1 and says why.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cedserve.bench.serve.chaos import KINDS, ServeProcess, kill_round
from cedserve.bench.serve.held import Target, deadline_flood
from cedserve.client import CedserveError, Client
from cedserve.common.credentials import token_metadata
from cedserve.model.checkpoint_writer import write_random_checkpoint
from cedserve.model.presets import preset
from cedserve.proto import worker_pb2, worker_pb2_grpc
from cedserve.router.lifecycle import list_workers

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT = list(range(5, 45))
BACK_WITHIN_S = 30.0
"""The issue's bound for serving again without manual action after a process dies."""


class Serve(ServeProcess):
    """A `cedserve serve` of the tiny random checkpoint (cedserve/bench/serve/chaos.py finds its
    processes by its log folder, never by name)."""

    def __init__(self, root: Path, checkpoint: Path, *extra: str) -> None:
        super().__init__(root, checkpoint, "--restart-window-s", "600", *extra, start_timeout_s=180.0)

    def wait_all_gone(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert self.processes() == {}

    def wait_serving(self, timeout_s: float) -> tuple[list[int], float]:
        """Greedy tokens of PROMPT once a request succeeds again, and how long that took."""
        start = time.monotonic()
        while True:
            try:
                with Client(self.address, timeout_s=10) as client:
                    return client.generate(PROMPT, max_tokens=6).token_ids, time.monotonic() - start
            except CedserveError:
                if time.monotonic() - start > timeout_s:
                    raise
                time.sleep(0.3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    write_random_checkpoint(preset("tiny"), path, seed=5)
    return path


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[Serve]:
    s = Serve(tmp_path_factory.mktemp("supervised"), checkpoint, "--max-restarts", "3")
    yield s
    s.stop()


def _stream_until_error(address: str, errors: list[BaseException], started: threading.Event) -> None:
    try:
        with Client(address, timeout_s=60) as client:
            for _ in client.stream(PROMPT, max_tokens=1000):
                started.set()
    except CedserveError as exc:
        errors.append(exc)
    finally:
        started.set()


def test_killed_decode_worker_restarts_rejoins_and_serves(serve: Serve) -> None:
    before, _ = serve.wait_serving(60)
    errors: list[BaseException] = []
    started = threading.Event()
    reader = threading.Thread(target=_stream_until_error, args=(serve.address, errors, started))
    reader.start()
    assert started.wait(30)
    os.kill(serve.pid("--worker-id decode0"), signal.SIGKILL)
    killed = time.monotonic()
    reader.join(10)
    assert not reader.is_alive() and errors, "the open stream neither failed nor ended"
    assert time.monotonic() - killed < 5.0
    after, took = serve.wait_serving(BACK_WITHIN_S)
    assert after == before  # the restarted worker serves the same model
    assert "decode0 is serving again" in serve.err.read_text()
    workers = {w["worker_id"]: w for w in list_workers(serve.address, token=serve.token)}
    assert workers["decode0"]["healthy"]
    with grpc.insecure_channel(workers["decode0"]["address"]) as channel:  # a fresh pool: nothing held
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)  # type: ignore[no-untyped-call]
        load = stub.GetLoad(worker_pb2.LoadRequest(), timeout=10, metadata=token_metadata(serve.token))
    assert load.free_blocks == load.total_blocks
    print(f"decode worker killed: serving again after {took:.1f} s")


def test_killed_router_restarts_on_its_port(serve: Serve) -> None:
    before, _ = serve.wait_serving(60)
    os.kill(serve.pid(" router "), signal.SIGKILL)
    after, took = serve.wait_serving(BACK_WITHIN_S)
    assert after == before
    assert "router is serving again" in serve.err.read_text()
    with urllib.request.urlopen(f"http://127.0.0.1:{serve.http_port()}/health", timeout=10) as reply:
        assert reply.status == 200  # the HTTP API came back on its port too
    print(f"router killed: serving again after {took:.1f} s")


def test_abandoned_requests_free_their_blocks(serve: Serve) -> None:
    """800 requests with a 10 ms deadline from 8 threads (their clients gone before they finish):
    every decode block is back, and a normal request served, well before the 30 s lease would have
    freed them (it took 28 s before the cancel paths were fixed; docs/benchmarks/held-cpu.json)."""
    serve.wait_serving(60)
    target = Target(serve.address, serve.token)
    report = deadline_flood(target, 800, max_tokens=6)
    assert report["status"].get("OK", 0) + report["status"].get("DEADLINE_EXCEEDED", 0) == 800, report
    assert report["blocks_back_after_s"] is not None and report["blocks_back_after_s"] < 10.0, report
    assert all(free == total for free, total in target.decode_blocks().values())


def test_kill_of_each_kind_under_load(serve: Serve) -> None:
    """kill -9 of the router, the prefill worker and the decode worker, once each, while 4 clients
    stream: the death is acted on within a second, the system serves again within the issue's 30 s
    without anyone's help, no worker holds a block afterwards, and every request ended with a
    completion or a status (`cedserve bench held --scenarios kill` repeats this 10 times each)."""
    serve.wait_serving(60)
    for kind in KINDS:
        r = kill_round(serve.address, serve.token, serve.log_dir, kind, clients=4, max_tokens=12, lead_s=1.0)
        print(f"kill -9 {kind}: {r}")
        assert r["no_status"] == 0 and r["status"].get("NO_STATUS", 0) == 0, r
        assert r["detected_s"] is not None and r["detected_s"] < 1.0, r
        assert r["serving_again_s"] is not None and r["serving_again_s"] < BACK_WITHIN_S, r
        assert r["restored_s"] is not None, r
        assert r["blocks_back_s"] is not None, r  # nothing leaked: every held block came back
        assert sum(r["inflight"].values()) > 0, r  # the kill did land under load


def test_drain_stops_the_whole_system_cleanly(serve: Serve) -> None:
    serve.wait_serving(60)
    drain = subprocess.run([sys.executable, "-m", "cedserve.cli", "drain", "--address", serve.address,
                            "--timeout-s", "20"], capture_output=True, text=True, timeout=60)
    assert '"drained": true' in drain.stdout, drain.stdout + drain.stderr
    assert serve.proc.wait(30) == 0
    assert "the router has drained" in serve.err.read_text()
    serve.wait_all_gone(10)


def test_past_the_restart_limit_the_system_stops(tmp_path: Path, checkpoint: Path) -> None:
    serve = Serve(tmp_path, checkpoint, "--max-restarts", "0")
    try:
        os.kill(serve.pid("--worker-id prefill0"), signal.SIGKILL)
        assert serve.proc.wait(30) == 1
        assert "prefill0 exited with -9" in serve.err.read_text()
        serve.wait_all_gone(10)
    finally:
        serve.stop()
