"""`cedserve bench serve` end to end: the embedded default (router, prefill and decode workers as real
processes, real gRPC, real NIXL) driven by a short agent-session workload; the report must be
consistent with itself and with the oracle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cedserve.cli import main as cli_main

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_short_bench_against_the_embedded_default(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    rc = cli_main(["bench", "serve", "--policies", "cache_aware", "--no-colocated", "--sessions", "2",
                   "--turns", "2,2", "--system-prompt-tokens", "256", "--user-tokens", "64,128",
                   "--tool-result-tokens", "64,128", "--output-tokens", "4,4", "--tool-gap-s", "0.05",
                   "--effort-mix", "low:1,max:1", "--concurrency", "2", "--warmup", "1",
                   "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--out", str(out),
                   "--log-dir", str(tmp_path / "logs"), "--no-progress"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert {"date", "command", "machine", "workload", "slo", "arms"} <= set(report)
    (arm,) = report["arms"]
    assert arm["arm"]["policy"] == "cache_aware" and arm["arm"]["num_prefill"] == 1
    (run,) = arm["runs"]
    s = run["summary"]
    assert s["sent"] == run["expected"] == 4
    assert s["sent"] == s["completed"] + s["errored"] and s["errored"] == 0, s["errors_by_status"]
    # Each session's second turn repeats its first: something is reused, never more than the oracle.
    assert 0 < s["cached_tokens"] <= s["oracle_cached_tokens"]
    assert 0 < s["hit_rate"] <= s["oracle_hit_rate"] <= 1
    assert s["kv_transfer_bytes"] > 0  # first turns (> 256 uncached tokens) go through a prefill worker
    for key in ("sent", "completed", "errored", "prompt_tokens", "cached_tokens", "oracle_cached_tokens"):
        assert sum(c[key] for c in run["by_effort"].values()) == s[key], key
    assert run["invariant_violations"] == []
    rows = run["requests"]
    assert len(rows) == 4 and all(0 < r["ttft_s"] <= r["e2e_s"] and r["output_tokens"] >= 1 for r in rows)
    assert s["slo_met"] == 4 and s["goodput_rps"] > 0
    for name in ("latency-cdf", "goodput", "hit-rate"):
        assert (tmp_path / f"report-{name}.png").stat().st_size > 1000
