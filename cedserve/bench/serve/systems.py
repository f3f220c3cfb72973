"""The systems a bench compares ("arms"), each started fresh by the embedded launcher.

An arm is a topology and a routing policy. Disaggregated arms run `num_prefill` prefill workers and
`num_decode` decode workers (groups of `decode_group_size` expert-parallel ranks); the colocated arm
runs no prefill worker and one single-rank decode worker per rank of the disaggregated arms, on the
same devices, each prefilling its own requests (the router's decode-only placement for every prompt).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from cedserve.launcher import EmbeddedOptions, LocalLauncher, start_embedded

POLICIES = ("cache_aware", "least_loaded", "round_robin")
"""The router's policies; cache_aware is its default."""


@dataclass(frozen=True)
class Arm:
    name: str
    policy: str
    num_prefill: int
    num_decode: int
    decode_group_size: int = 1

    @property
    def colocated(self) -> bool:
        return self.num_prefill == 0

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "colocated": self.colocated}


def plan_arms(policies: Sequence[str], num_prefill: int, num_decode: int, decode_group_size: int,
              colocated: bool) -> list[Arm]:
    """One disaggregated arm per policy, then the colocated arm (default policy) on the same devices."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"--policies: unknown {unknown}; choose from {list(POLICIES)}")
    if num_prefill < 1 and policies:
        raise ValueError("--prefill-workers: disaggregated arms need at least one prefill worker")
    arms = [Arm(p, p, num_prefill, num_decode, decode_group_size) for p in policies]
    if colocated:
        arms.append(Arm("colocated", "cache_aware", 0, num_prefill + num_decode * decode_group_size))
    if not arms:
        raise ValueError("nothing to run: give --policies or --colocated")
    return arms


@contextlib.contextmanager
def embedded_arm(arm: Arm, base: EmbeddedOptions, log_dir: Path) -> Iterator[tuple[str, str | None]]:
    """Start the arm's processes on loopback, yield the router's gRPC address and its HTTP API's
    (None unless `base.http_port` turns it on), stop them all."""
    opts = replace(base, num_prefill=arm.num_prefill, num_decode=arm.num_decode,
                   decode_group_size=arm.decode_group_size, policy=arm.policy, port=0, log_dir=log_dir,
                   http_port=0 if base.http_port >= 0 else -1)
    launcher = LocalLauncher(log_dir)
    try:
        router = start_embedded(opts, launcher)
        http_port = int(router.get("http_port", -1))
        yield str(router["address"]), f"{opts.host}:{http_port}" if http_port > 0 else None
    finally:
        launcher.stop_all()
