"""`benchmarks/tpot.py`'s arithmetic: the decode worker's metrics as read from its text, the pooled
tokens per verification, and the DSpark pair figure (speedup against 1 + accepted drafts a
verification). The end-to-end run (real `cedserve serve` processes) is the benchmark itself."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from cedserve.launcher import shipped_demo_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import tpot

pytestmark = pytest.mark.unit

METRICS = """# HELP cedserve_decode_step_seconds Seconds per decode step
cedserve_decode_step_seconds_count 12.0
cedserve_decode_step_seconds_sum 0.048
cedserve_decode_output_tokens_total 30.0
cedserve_decode_tokens_per_verify_count 5.0
cedserve_decode_tokens_per_verify_sum 9.0
cedserve_decode_loop_phase_seconds_sum{phase="model"} 0.04
"""


def test_reading_takes_the_counters_from_the_metrics_text(monkeypatch: pytest.MonkeyPatch) -> None:
    class Response:
        def read(self) -> bytes:
            return METRICS.encode()

    monkeypatch.setattr(tpot.urllib.request, "urlopen", lambda url, timeout: Response())
    r = tpot._steps("http://127.0.0.1:1/metrics")
    assert (r.steps, r.step_s, r.tokens, r.verifies, r.verify_tokens) == (12, 0.048, 30, 5, 9.0)
    assert r.phase_s["model"] == 0.04 and math.isnan(r.phase_s["commands"])


def _row(tpot_s: float, verifications: float, verify_tokens: float) -> dict[str, Any]:
    keys = ("ttft_s", "first_gap_s", "steady_itl_s", "outside_per_step_s", "join_step_s", "steady_step_s",
            "steady_steps_per_token", "steady_step_per_token_s", "tpot_over_step", "itl_over_step",
            "step_per_token_all_s", "tpot_over_step_all",
            *(f"phase_{p}_s" for p in (*tpot.PHASES, *tpot.EXTRA)))
    return {"tokens": 64, "draft_tokens": 0, "accepted_drafts": 0, "tpot_s": tpot_s, **dict.fromkeys(keys, 0.001),
            "verifications": verifications, "verify_tokens": verify_tokens}


def test_tokens_per_verify_pools_the_requests_and_the_pair_divides_by_it() -> None:
    on = tpot._summary([_row(0.002, 10, 20), _row(0.003, 30, 40)])  # 60 tokens over 40 verifications
    off = tpot._summary([_row(0.004, 0, 0), _row(0.004, 0, 0)])
    assert on["tokens_per_verify"] == pytest.approx(1.5) and on["verifications"] == 20
    assert math.isnan(off["tokens_per_verify"])
    results = {"case": {"on": {"median": on}, "off": {"median": off}}}
    (row,) = tpot.dspark_pairs(results, [("on", "off")])
    assert row["speedup"] == pytest.approx(4.0 / 2.5)  # medians: 2.5 ms and 4 ms
    assert row["fraction_of_bound"] == pytest.approx(4.0 / 2.5 / 1.5)
    assert tpot.dspark_pairs(results, [("on", "missing")]) == []


def test_heldout_prompts_are_windows_of_the_tokenized_heldout_code() -> None:
    take = tpot.heldout_prompts(shipped_demo_checkpoint())
    a, b = take(random.Random(1), 300), take(random.Random(1), 300)
    assert a == b and len(a) == 300 and all(0 <= t < 4096 for t in a)
    assert take(random.Random(2), 300) != a
    with pytest.raises(ValueError, match="fewer than"):
        take(random.Random(0), 10**9)


def test_paths_read_the_decode_workers_path_gauges(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tpot._paths`: which step paths a decode worker took, from `cedserve_decode_path_on`; a worker
    from before the gauge existed reads as no paths (not as an error)."""
    text = METRICS + "".join(f'cedserve_decode_path_on{{path="{p}"}} {v}\n'
                             for p, v in (("runner", "1.0"), ("runner_graphs", "1.0"), ("drafter_slots", "1.0"),
                                          ("drafter_graphs", "0.0"), ("compiled", "0.0")))
    pages = iter([text, METRICS])

    class Response:
        def __init__(self) -> None:
            self.body = next(pages)

        def read(self) -> bytes:
            return self.body.encode()

    monkeypatch.setattr(tpot.urllib.request, "urlopen", lambda url, timeout: Response())
    assert tpot._paths("http://127.0.0.1:1/metrics") == {
        "runner": True, "runner_graphs": True, "drafter_slots": True, "drafter_graphs": False, "compiled": False}
    assert tpot._paths("http://127.0.0.1:1/metrics") == {}
