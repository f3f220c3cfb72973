"""`cedserve serve --ray` on a local Ray cluster: router, prefill and decode as actors (placement
groups of CPU bundles), a generate over gRPC, a killed decode actor restarted by Ray at a new
address, re-registered with the router, and generate working again. Real processes, real gRPC,
real NIXL between the workers.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from cedserve.client import Client
from cedserve.launcher import EmbeddedOptions, ensure_preset_checkpoint

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'cedserve[ray]')")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]
PROMPT = list(range(3, 303))  # over the decode-only threshold: prefill worker + NIXL transfer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_actors_serve_restart_and_reregister(tmp_path: Path) -> None:
    from cedserve.ray_launcher import RayOptions, RaySystem

    checkpoint = ensure_preset_checkpoint("tiny", tmp_path / "home")
    ray.init(num_cpus=3, include_dashboard=False, logging_level="error", object_store_memory=100 << 20)
    system = RaySystem(EmbeddedOptions(checkpoint=checkpoint, port=_free_port(), log_dir=tmp_path / "logs"),
                       RayOptions(device="cpu", cpus_per_worker=1, router_cpus=0.5, max_restarts=2,
                                  ready_timeout_s=180, run_dir=str(tmp_path / "run")))
    try:
        address = system.start()["address"]
        # Two placement groups (the prefill pool, one decode group), one CPU bundle per worker.
        assert [pg.bundle_specs for pg in system.placement_groups] == [[{"CPU": 1.0}], [{"CPU": 1.0}]]
        with Client(address, timeout_s=120) as client:
            first = client.generate(PROMPT, max_tokens=4)
        assert first.finish_reason == "length" and len(first.token_ids) == 4

        decode = system.workers["decode0"]
        old_address, old_pid = decode.address, decode.pid
        ray.kill(decode.actor, no_restart=False)  # Ray restarts it; its process dies with it
        deadline = time.monotonic() + 180
        events: list[str] = []
        while not any(e.startswith("registered decode0") for e in events):
            assert time.monotonic() < deadline, f"decode0 was not re-registered; events: {events}"
            events += system.supervise()
            time.sleep(0.5)
        assert decode.address != old_address and not _alive(old_pid)
        pool = {w["worker_id"]: w for w in system.router_workers()}
        assert pool["decode0"]["address"] == decode.address and pool["decode0"]["source"] == "registry"
        deadline = time.monotonic() + 30
        while not {w["worker_id"] for w in system.router_workers() if w["healthy"]} >= {"prefill0", "decode0"}:
            assert time.monotonic() < deadline, system.router_workers()
            time.sleep(0.2)
        with Client(address, timeout_s=120) as client:
            again = client.generate(PROMPT, max_tokens=4)
        assert again.token_ids == first.token_ids  # same greedy answer from the restarted worker
    finally:
        system.stop(grace_s=10)
        ray.shutdown()
