"""`cedserve worker --role decode --local-ranks 2`: one supervisor process running a two-rank decode
group (gloo on this CPU; on a GPU pod NCCL over the pod's GPUs), serving a request through a real
router with the monolithic model's greedy tokens, and stopping every rank on SIGTERM."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import pytest
from system_rig import greedy_reference

from cedserve.client import Client
from cedserve.launcher import TOKEN_FILE_NAME, LocalLauncher, write_worker_config
from cedserve.model.checkpoint_writer import write_random_checkpoint
from cedserve.model.presets import preset
from cedserve.serving.ready import parse_ready_line

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_local_ranks_form_a_group_serve_and_stop_together(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    write_random_checkpoint(preset("tiny"), checkpoint, seed=21)
    launcher = LocalLauncher(tmp_path / "logs")
    configs = write_worker_config(tmp_path / "run")
    try:
        decode = launcher.spawn("decode0", [
            "worker", "--role", "decode", "--worker-id", "decode0", "--checkpoint", str(checkpoint),
            "--config", str(configs["decode"]), "--host", "127.0.0.1", "--port", "0", "--local-ranks", "2",
            "--dist-port", str(_free_port())])
        decode.wait_ready(240.0)
        deadline, ready = time.monotonic() + 120, []
        while len(ready) < 2 and time.monotonic() < deadline:  # both ranks' ready lines, in any order
            lines = (tmp_path / "logs" / "decode0.log").read_text().splitlines()
            ready = [r for r in map(parse_ready_line, lines) if r is not None]
            time.sleep(0.2)
        assert sorted((r["rank"], r["group_size"]) for r in ready) == [(0, 2), (1, 2)], ready
        assert len({r["agent"] for r in ready}) == 2  # each rank its own NIXL agent
        leader = next(r for r in ready if r["rank"] == 0)
        token_file = tmp_path / "run" / TOKEN_FILE_NAME
        router = launcher.start("router", [
            "router", "--checkpoint", str(checkpoint), "--host", "127.0.0.1", "--port", "0",
            "--worker-token-file", str(token_file), "--decode", f"decode0={leader['address']}",
            "--decode-only-max-tokens", "4096"])
        prompts = [list(range(20, 60)), list(range(100, 131))]
        with Client(str(router["address"]), timeout_s=120) as client:
            for prompt in prompts:  # the leader places them on the rank with the most free blocks
                done = client.generate(prompt, max_tokens=6)
                assert done.finish_reason == "length" and done.token_ids == greedy_reference(checkpoint, prompt, 6)
        decode.proc.send_signal(signal.SIGTERM)
        assert decode.proc.wait(timeout=120) == 0
    finally:
        launcher.stop_all()
