"""`cedserve serve` as a user starts it: one command, a --config file whose tables reach the processes,
the device chosen and said, Ctrl-C stopping everything."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from system_rig import wait_ready_line

from cedserve.client import Client
from cedserve.common.credentials import token_metadata
from cedserve.launcher import TOKEN_FILE_NAME
from cedserve.proto import worker_pb2, worker_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CONFIG = """\
[model]
preset = "tiny"
[cache]
num_blocks = 96
[decode]
max_output_tokens = 5
[prefill]
effort_queue_slack_s = 0.5
[router]
default_max_tokens = 3
[router.limits.max]
max_running = 4
max_queued = 8
"""


def test_serve_config_reaches_the_workers_and_ctrl_c_stops_all(tmp_path: Path) -> None:
    config, logs = tmp_path / "serve.toml", tmp_path / "logs"
    config.write_text(CONFIG)
    out = tmp_path / "serve.out"
    with out.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "cedserve.cli", "serve", "--config", str(config), "--port", "0", "--http-port", "0",
                                 "--device", "auto", "--log-dir", str(logs)], stdout=sink, stderr=subprocess.STDOUT)
    try:
        system = wait_ready_line(out, 300.0)
        text = out.read_text()
        assert "workers on cpu (auto: no GPU)" in text, text
        with Client(str(system["address"]), timeout_s=120) as client:
            done = client.generate(list(range(10, 50)), max_tokens=30, effort="max")
        # [decode] max_output_tokens reached the decode worker: it cuts every request to 5 tokens
        assert done.finish_reason == "length" and len(done.token_ids) == 5, done
        with Client(str(system["address"]), timeout_s=120) as client:  # [router] default_max_tokens
            assert len(client.generate(list(range(10, 50)), effort="max").token_ids) == 3
        # [cache] num_blocks reached it too
        decode = wait_ready_line(logs / "decode0.log", 10.0)
        token = (logs / "run" / TOKEN_FILE_NAME).read_text().strip()
        with grpc.insecure_channel(str(decode["address"])) as channel:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)  # type: ignore[no-untyped-call]
            load = stub.GetLoad(worker_pb2.LoadRequest(), timeout=10, metadata=token_metadata(token))
        assert load.total_blocks == 96
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, out.read_text()[-2000:]


def test_bad_config_fails_before_any_process_starts(tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text('[model]\npreset = "tiny"\n[decode]\nmax_runing_requests = 4\n')
    run = subprocess.run([sys.executable, "-m", "cedserve.cli", "serve", "--config", str(config), "--port", "0", "--http-port", "0",
                          "--log-dir", str(tmp_path / "logs")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "decode.max_runing_requests" in run.stderr, run.stderr
    assert not (tmp_path / "logs").exists()
