"""Helpers for the decode e2e tests: start a real decode worker process, and a killable prefill-side
sender (a real `NixlTransferAgent` in a child process).

`python tests/e2e/decode_rig.py sender --blocks N` runs the child: it prints `AGENT {json}` (its agent
name and control address), reads one line `OPEN <base64 Reservation> [STATE_BLOCKS VERSION]` from
stdin, opens the reservation, WRITEs all but the last reserved block (never closing the transfer),
prints `SENT`, and sleeps until killed. With `STATE_BLOCKS VERSION` it instead fills the last
STATE_BLOCKS blocks with a shipped-state header of format VERSION and closes the transfer.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from cedserve.kv_transfer.agent import NixlTransferAgent
from cedserve.kv_transfer.config import KVTransferConfig
from cedserve.kv_transfer.region import KVLayout, KVRegion
from cedserve.kv_transfer.wire import reservation_from_pb
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.paged_kv import store_bytes
from cedserve.proto import kv_transfer_pb2 as kpb
from cedserve.proto import worker_pb2 as wpb
from cedserve.proto import worker_pb2_grpc as wpb_grpc
from cedserve.serving.ready import parse_ready_line
from cedserve.serving.worker_model import load_worker_model

REPO = Path(__file__).resolve().parents[2]
BLOCK = 64
TOKEN = "e2e-prefill-token"  # the prefill rig's token: both workers must share it
MODEL_ID = "preset:tiny:seed0"


class DecodeProcess:
    """`cedserve worker --role decode --preset tiny` with a config file; waits for its ready line."""

    def __init__(self, num_blocks: int = 64, timeout_s: float = 120.0, **decode: object) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="decode-e2e-")
        cfg = Path(self.dir.name) / "decode.toml"
        table = {"worker_id": "decode-e2e", "drain_timeout_s": 5.0, **decode}
        lines = ['[model]', 'preset = "tiny"', '[cache]', f'block_size = {BLOCK}', f'num_blocks = {num_blocks}',
                 '[decode]', *(f'{k} = {json.dumps(v)}' for k, v in table.items()),
                 '[kv_transfer]', f'auth_token = "{TOKEN}"']
        cfg.write_text("\n".join(lines) + "\n")
        self.stderr = open(Path(self.dir.name) / "stderr.log", "w+")  # noqa: SIM115 (kept open for the process)
        cmd = [sys.executable, "-m", "cedserve.cli", "worker", "--role=decode", f"--config={cfg}",
               "--host=127.0.0.1", "--grpc-port=0", "--metrics-port=0"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.stderr, text=True, cwd=REPO,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.ready = self._wait_ready(timeout_s)
        self.channel = grpc.insecure_channel(self.ready["address"])
        self.stub = wpb_grpc.DecodeWorkerStub(self.channel)

    def _wait_ready(self, timeout_s: float) -> dict[str, Any]:
        end = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        while time.monotonic() < end:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
            ready = parse_ready_line(line.strip())
            if ready is not None:
                return ready
        raise RuntimeError(f"decode worker not ready (rc={self.proc.poll()}):\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        self.stderr.flush()
        self.stderr.seek(0)
        return self.stderr.read()[-n:]

    def load(self) -> wpb.LoadReport:
        report: wpb.LoadReport = self.stub.GetLoad(wpb.LoadRequest(), timeout=5)
        return report

    def wait_all_free(self, timeout_s: float = 10.0) -> wpb.LoadReport:
        end = time.monotonic() + timeout_s
        while True:
            load = self.load()
            idle = load.held_blocks == 0 and load.running_requests == 0 and load.queued_requests == 0
            if (idle and load.free_blocks == load.total_blocks) or time.monotonic() > end:
                return load
            time.sleep(0.05)

    def close(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.stderr.close()
        self.dir.cleanup()


class SenderChild:
    """The killable prefill side (see the module docstring)."""

    def __init__(self, num_blocks: int) -> None:
        cmd = [sys.executable, str(Path(__file__)), "sender", "--blocks", str(num_blocks)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, cwd=REPO)
        self.info = json.loads(self._line("AGENT "))

    def _line(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # NIXL logs to stdout too
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        raise RuntimeError(f"sender child exited rc={self.proc.wait(10)}")

    def send_partial(self, reservation: kpb.Reservation, state: tuple[int, int] | None = None) -> None:
        """All but the last block, never closing; with `state` = (state blocks, format version), every
        block instead, a state header of that version in the state blocks, and the transfer closed."""
        assert self.proc.stdin is not None
        extra = "" if state is None else f" {state[0]} {state[1]}"
        self.proc.stdin.write("OPEN " + base64.b64encode(reservation.SerializeToString()).decode() + extra + "\n")
        self.proc.stdin.flush()
        self._line("SENT")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def _sender_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks", type=int, required=True)
    a = p.parse_args(argv)
    config = load_worker_model(None, "tiny", seed=0).model.config
    layout = BlockLayout.from_config(config, BLOCK)
    pool = torch.zeros(a.blocks, layout.block_bytes, dtype=torch.uint8)
    agent = NixlTransferAgent(KVTransferConfig(auth_token=TOKEN, control_host="127.0.0.1"),
                              KVRegion(pool, layout.block_bytes),
                              KVLayout.from_config(config, BLOCK, model_id=MODEL_ID), f"prefill-child-{os.getpid()}")
    print("AGENT " + json.dumps({"agent": agent.name, "control_address": agent.control_address}), flush=True)
    words = sys.stdin.readline().split()
    reservation = reservation_from_pb(kpb.Reservation.FromString(base64.b64decode(words[1])))
    agent.sender().open(reservation)
    if len(words) == 4:  # a whole transfer whose state region holds a header of another format version
        state_blocks, version = int(words[2]), int(words[3])
        header = struct.pack("<8sHHIQQ16sI12x", b"CEDSTATE", version, 64, 0, 64, 0, bytes(16), 0)
        first_state = reservation.num_blocks - state_blocks
        store_bytes(pool, list(range(first_state, reservation.num_blocks)), header)
        agent.sender().write_blocks(reservation.request_id, list(range(reservation.num_blocks)), last=True)
    else:
        agent.sender().write_blocks(reservation.request_id, list(range(reservation.num_blocks - 1)))
    time.sleep(0.5)
    print("SENT", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    sys.exit(_sender_main(sys.argv[2:]) if sys.argv[1:2] == ["sender"] else 2)
