"""Helpers for the prefill e2e tests: start a real worker process, and a decode-side receiver (a real
`NixlTransferAgent` over a tiny-layout block pool) in this process or in a killable child process.

`python tests/e2e/prefill_rig.py receiver --control ADDR --sender NAME --lease L --blocks N --token T`
runs the child: it handshakes with the prefill worker, reserves N blocks, prints one line
`RESERVED {json}` (`reservation`: base64 protobuf) and then sleeps until killed.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
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
from cedserve.kv_transfer.protocol import Reservation
from cedserve.kv_transfer.region import KVLayout, KVRegion
from cedserve.kv_transfer.wire import reservation_from_pb, reservation_to_pb
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.config import ModelConfig
from cedserve.proto import kv_transfer_pb2 as kpb
from cedserve.proto import worker_pb2 as wpb
from cedserve.proto import worker_pb2_grpc as wpb_grpc
from cedserve.serving.ready import parse_ready_line

REPO = Path(__file__).resolve().parents[2]
BLOCK = 64
TOKEN = "e2e-prefill-token"
MODEL_ID = "preset:tiny:seed0"
RESERVED = "RESERVED "


def tiny_config() -> ModelConfig:
    from cedserve.model.checkpoint_writer import fit_config_to_tokenizer
    from cedserve.model.presets import preset
    from cedserve.model.tokenizer import tiny_tokenizer_path

    return fit_config_to_tokenizer(preset("tiny"), tiny_tokenizer_path())


def make_receiver(name: str, num_blocks: int, config: ModelConfig,
                  weights_dtype: str = "float32") -> tuple[NixlTransferAgent, torch.Tensor]:
    """A NIXL receiver standing in for a decode worker whose weights are in `weights_dtype`."""
    layout = BlockLayout.from_config(config, BLOCK)
    pool = torch.zeros(num_blocks, layout.block_bytes, dtype=torch.uint8)
    kv_layout = KVLayout.from_config(config, BLOCK, model_id=MODEL_ID, weights_dtype=weights_dtype)
    agent = NixlTransferAgent(KVTransferConfig(auth_token=TOKEN, control_host="127.0.0.1"),
                              KVRegion(pool, layout.block_bytes), kv_layout, name)
    return agent, pool


def decode_target(reservation: Reservation, agent_name: str, control_address: str) -> wpb.DecodeTarget:
    return wpb.DecodeTarget(agent_name=agent_name, control_address=control_address, lease_id=reservation.request_id,
                            reservation=reservation_to_pb(reservation))


class WorkerProcess:
    """`cedserve worker --role prefill --preset tiny` with a config file; waits for its ready line.
    `flags`: more command-line flags (e.g. `--dtype=bfloat16`)."""

    def __init__(self, num_blocks: int = 64, timeout_s: float = 120.0, flags: tuple[str, ...] = (),
                 **prefill: object) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="prefill-e2e-")
        cfg = Path(self.dir.name) / "prefill.toml"
        table = {"worker_id": "prefill-e2e", "chunk_tokens": 64, "step_token_budget": 128, "drain_timeout_s": 5.0,
                 **prefill}
        lines = ['[model]', 'preset = "tiny"', '[cache]', f'block_size = {BLOCK}', f'num_blocks = {num_blocks}',
                 '[prefill]', *(f'{k} = {json.dumps(v)}' for k, v in table.items()),
                 '[kv_transfer]', f'auth_token = "{TOKEN}"']
        cfg.write_text("\n".join(lines) + "\n")
        self.stderr = open(Path(self.dir.name) / "stderr.log", "w+")  # noqa: SIM115 (kept open for the process)
        cmd = [sys.executable, "-m", "cedserve.cli", "worker", "--role=prefill", f"--config={cfg}",
               "--host=127.0.0.1", "--grpc-port=0", "--metrics-port=0", *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.stderr, text=True, cwd=REPO,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.ready = self._wait_ready(timeout_s)
        self.channel = grpc.insecure_channel(self.ready["address"])
        self.stub = wpb_grpc.PrefillWorkerStub(self.channel)

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
        raise RuntimeError(f"worker not ready (rc={self.proc.poll()}):\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        self.stderr.flush()
        self.stderr.seek(0)
        return self.stderr.read()[-n:]

    def load(self) -> wpb.LoadReport:
        report: wpb.LoadReport = self.stub.GetLoad(wpb.LoadRequest(), timeout=5)
        return report

    def close(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.stderr.close()
        self.dir.cleanup()


def start_receiver_child(control: str, sender: str, lease: str, num_blocks: int) -> tuple[subprocess.Popen[str], Reservation]:
    cmd = [sys.executable, str(Path(__file__)), "receiver", "--control", control, "--sender", sender,
           "--lease", lease, "--blocks", str(num_blocks)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    assert proc.stdout is not None
    for line in proc.stdout:  # NIXL logs to stdout too
        if line.startswith(RESERVED):
            data = json.loads(line[len(RESERVED):])
            break
    else:
        raise RuntimeError(f"receiver child exited rc={proc.wait(10)}")
    return proc, reservation_from_pb(kpb.Reservation.FromString(base64.b64decode(data["reservation"])))


def _receiver_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--control", required=True)
    p.add_argument("--sender", required=True)
    p.add_argument("--lease", required=True)
    p.add_argument("--blocks", type=int, required=True)
    a = p.parse_args(argv)
    agent, _pool = make_receiver(f"decode-child-{os.getpid()}", a.blocks, tiny_config())
    agent.handshake(a.control)
    res = agent.receiver().reserve(a.lease, list(range(a.blocks)), sender=a.sender)
    payload = base64.b64encode(reservation_to_pb(res).SerializeToString()).decode()
    print(RESERVED + json.dumps({"agent": agent.name, "control_address": agent.control_address, "reservation": payload}),
          flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    sys.exit(_receiver_main(sys.argv[2:]) if sys.argv[1:2] == ["receiver"] else 2)
