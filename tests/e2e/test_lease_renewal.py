"""A slow prefill does not lose its decode lease (issue 32): the embedded system with a 300 ms lease
(router and decode worker) and a prefill worker made slow on purpose (one 64-token chunk per engine
step over a 3,000-token prompt). The prefill takes many lease periods; the router's renewals keep
the reserved blocks, the request completes with the monolithic model's greedy tokens, no lease
expires on the decode worker, and every block comes back."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from system_rig import greedy_reference, wait_idle

from cedserve.client import Client
from cedserve.launcher import EmbeddedOptions, LocalLauncher, start_embedded
from cedserve.model.checkpoint_writer import write_random_checkpoint
from cedserve.model.presets import preset

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LEASE_MS = 300


class SlowPrefillSystem:
    def __init__(self, root: Path) -> None:
        self.checkpoint = root / "ckpt"
        write_random_checkpoint(preset("tiny"), self.checkpoint, seed=21)
        self.launcher = LocalLauncher(root / "logs")
        config = {"router": {"lease_ms": LEASE_MS}, "decode": {"lease_ms": LEASE_MS},
                  "prefill": {"chunk_tokens": 64, "step_token_budget": 64}}
        ready = start_embedded(EmbeddedOptions(checkpoint=self.checkpoint, port=0, log_dir=root / "logs",
                                               config=config), self.launcher)
        self.address = str(ready["address"])
        self.metrics = dict(ready["metrics"])
        self.parts = {p.name: p for p in self.launcher.parts}


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlowPrefillSystem]:
    s = SlowPrefillSystem(tmp_path_factory.mktemp("lease_renewal"))
    yield s
    s.launcher.stop_all()


def _expired_leases(system: SlowPrefillSystem) -> float:
    """`cedserve_decode_leases_expired_total` from the decode worker's metrics endpoint."""
    text = urllib.request.urlopen(system.metrics["decode0"], timeout=10).read().decode()
    match = re.search(r"^cedserve_decode_leases_expired_total (\S+)$", text, re.M)
    assert match, "no lease-expiry counter in the decode worker's metrics"
    return float(match.group(1))


def test_a_prefill_many_leases_long_keeps_its_lease(system: SlowPrefillSystem) -> None:
    prompt = torch.randint(3, 500, (3000,), generator=torch.Generator().manual_seed(5)).tolist()
    with Client(system.address, timeout_s=300) as client:
        out = client.generate(prompt, max_tokens=4)
    assert out.finish_reason == "length"
    assert out.usage["ttft_s"] > 3 * LEASE_MS / 1000, out.usage  # the prefill outlasted three leases
    assert out.token_ids == greedy_reference(system.checkpoint, prompt, 4)
    assert _expired_leases(system) == 0
    loads = wait_idle([system.parts["prefill0"], system.parts["decode0"]])
    assert loads["decode0"].held_blocks == 0 and loads["decode0"].free_blocks == loads["decode0"].total_blocks
