"""`benchmarks/dspark_cycle.py`'s attribution: engine phases marked in a profiler trace, each phase's
host time taken from between the marks (kernels and syncs need a GPU: the benchmark itself)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import dspark_cycle

pytestmark = pytest.mark.unit


class Laps:
    """The engine's phase timer (`DecodeMetrics.phases`): what `MarkedPhases` wraps."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def lap(self, phase: str, since: float) -> float:
        self.seen.append(phase)
        return time.perf_counter()

    def add(self, phase: str, seconds: float) -> None:
        self.seen.append(phase)


def test_each_phases_host_time_is_what_ran_between_its_marks() -> None:
    inner = Laps()
    phases = dspark_cycle.MarkedPhases(inner)
    naps = {"propose": 0.006, "model": 0.012}  # the rest take next to nothing
    steps = 3
    torch.ones(4).add_(1)  # first-call set-up outside the trace
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            with torch.profiler.record_function("lap:start"):
                pass
            t = time.perf_counter()
            for phase in dspark_cycle.PHASES:
                time.sleep(naps.get(phase, 0.0))
                torch.ones(4).add_(1)  # an op inside each phase
                t = phases.lap(phase, t)
        wall_ms = (time.perf_counter() - start) * 1000 / steps
    table = dspark_cycle.phase_table(prof, steps)
    assert inner.seen == list(dspark_cycle.PHASES) * steps  # the engine's own timer still sees every lap
    assert set(table) == set(dspark_cycle.PHASES)
    for phase, row in table.items():
        assert row["host_ms"] >= naps.get(phase, 0.0) * 1000, (phase, row)  # a sleep never ends early
        assert row["kernels"] == 0 and row["gpu_ms"] == 0 and row["syncs"] == 0  # a CPU launches none
    # the phases are disjoint stretches of each step: together no longer than the steps themselves
    assert sum(row["host_ms"] for row in table.values()) <= wall_ms
    for phase, row in table.items():  # each phase's one op is listed as its own, once a step
        assert sorted(c["name"] for c in row["host_top"]) == ["aten::add_", "aten::ones"], (phase, row["host_top"])
        assert all(c["calls"] == 1 for c in row["host_top"])
        assert 0 < row["host_calls_ms"] <= row["host_ms"]
