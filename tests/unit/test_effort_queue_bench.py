"""`benchmarks/effort_queue.py` end to end on a tiny run: every request is accounted for in every arm,
and with no slack the two arms are the same run (the virtual clock leaves no room for the machine's
load to differ between them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import effort_queue

pytestmark = pytest.mark.unit


def test_no_slack_gives_identical_arms_and_every_request_is_counted(tmp_path: Path) -> None:
    out = tmp_path / "eq.json"
    assert effort_queue.main(["--requests", "6", "--repeats", "1", "--batch", "2", "--max-output-tokens", "6",
                              "--prompt-tokens", "24", "--prefill-lengths", "64,160", "--slack-s", "0",
                              "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    results = report["results"]
    for table in ("decode_e2e_s", "decode_queue_s", "prefill_ttft_s"):
        fifo, due = results[table]["arrival order"], results[table]["earliest due"]
        assert fifo == due
        assert fifo["all"]["n"] == 6 == sum(fifo[c]["n"] for c in ("low", "high", "max") if c in fifo)
    rows = report["requests"]["decode"]["arrival order"]
    assert all(0 <= r["queue_s"] < r["e2e_s"] for r in rows)
    assert all(r["ttft_s"] > 0 for r in report["requests"]["prefill"]["arrival order"])
