"""Summaries of one run: latency percentiles, goodput under SLOs, prefix reuse against the oracle,
KV movement, errors by status; the same per effort class; and the report's invariants."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cedserve.bench.serve.driver import RequestResult, RunOutput
from cedserve.model.effort import effort_class

PERCENTILES = (50, 90, 99)
EFFORT_CLASSES = ("low", "high", "max")
"""The router's admission classes: effort < 60, 60-89, >= 90."""


@dataclass(frozen=True)
class Slo:
    """A request meets the SLO when it completed and every bound set holds."""

    ttft_s: float
    tpot_s: float
    e2e_s: float = 0.0
    """0: no end-to-end bound."""

    def met(self, r: RequestResult) -> bool:
        if not r.ok or r.ttft_s is None or r.e2e_s is None or r.ttft_s > self.ttft_s:
            return False
        tpot = r.tpot_s
        if tpot is not None and tpot > self.tpot_s:
            return False
        return not (self.e2e_s and r.e2e_s > self.e2e_s)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _dist(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    return {"mean": sum(values) / len(values), **{f"p{q}": percentile(values, q) for q in PERCENTILES}}


def summarize(results: Sequence[RequestResult], wall_s: float, slo: Slo, sent: int | None = None) -> dict[str, Any]:
    """One run's (or one effort class's) figures. `sent` defaults to the number of results."""
    ok = [r for r in results if r.ok]
    errors = Counter(r.error for r in results if r.error is not None)
    met = sum(1 for r in results if slo.met(r))
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    oracle = sum(r.oracle_cached_tokens for r in ok)
    moved = [r for r in ok if r.kv_transfer_bytes > 0]
    moved_bytes = sum(r.kv_transfer_bytes for r in moved)
    moved_s = sum(r.kv_transfer_s for r in moved)
    wall = max(wall_s, 1e-9)
    return {
        "sent": len(results) if sent is None else sent,
        "completed": len(ok),
        "errored": len(results) - len(ok),
        "errors_by_status": dict(sorted(errors.items())),
        "ttft_s": _dist([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": _dist([t for r in ok if (t := r.tpot_s) is not None]),
        "e2e_s": _dist([r.e2e_s for r in ok if r.e2e_s is not None]),
        "api_overhead_s": _dist([o for r in ok if (o := r.api_overhead_s) is not None]),
        "slo_met": met,
        "slo_attainment": met / len(results) if results else 0.0,
        "goodput_rps": met / wall,
        "throughput_rps": len(ok) / wall,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / wall,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "oracle_cached_tokens": oracle,
        "hit_rate": cached / prompt if prompt else 0.0,
        "oracle_hit_rate": oracle / prompt if prompt else 0.0,
        "decode_only_fraction": sum(1 for r in ok if r.decode_only) / len(ok) if ok else 0.0,
        "kv_transfer_bytes": moved_bytes,
        "kv_transfer_gbps": moved_bytes / moved_s / 1e9 if moved_s > 0 else None,
        "kv_transfer_s": _dist([r.kv_transfer_s for r in moved]),
        "kv_transfer_share_of_ttft": _dist([r.kv_transfer_s / r.ttft_s for r in moved if r.ttft_s]),
        "kv_transfer_tail_s": _dist([r.kv_transfer_tail_s for r in moved]),
        "kv_transfer_tail_share_of_ttft": _dist([r.kv_transfer_tail_s / r.ttft_s for r in moved if r.ttft_s]),
        "wall_s": wall_s,
    }


def summarize_run(run: RunOutput, slo: Slo) -> dict[str, Any]:
    """The run's summary, its summaries by effort class, and the invariants checked on them."""
    total = summarize(run.results, run.wall_s, slo, sent=run.sent)
    by_class = {c: summarize([r for r in run.results if effort_class(r.effort) == c], run.wall_s, slo)
                for c in EFFORT_CLASSES}
    by_class = {c: s for c, s in by_class.items() if s["sent"]}
    bad = invariant_violations(total, by_class, run.results)
    if run.sent > run.expected:
        bad.append(f"sent {run.sent} requests of a {run.expected}-request trace")
    return {"summary": total, "by_effort": by_class, "expected": run.expected, "unsent": run.expected - run.sent,
            "invariant_violations": bad}


def invariant_violations(total: dict[str, Any], by_class: dict[str, dict[str, Any]],
                         results: Sequence[RequestResult]) -> list[str]:
    """What must hold in every report; an empty list when it does."""
    bad = []
    if total["sent"] != total["completed"] + total["errored"]:
        bad.append(f"sent {total['sent']} != completed {total['completed']} + errored {total['errored']}")
    if sum(total["errors_by_status"].values()) != total["errored"]:
        bad.append("errors by status do not add up to the errored requests")
    if not 0 <= total["cached_tokens"] <= total["oracle_cached_tokens"]:
        bad.append(f"cached tokens {total['cached_tokens']} outside [0, oracle {total['oracle_cached_tokens']}]")
    for key in ("sent", "completed", "errored", "prompt_tokens", "cached_tokens", "oracle_cached_tokens"):
        if sum(s[key] for s in by_class.values()) != total[key]:
            bad.append(f"effort classes' {key} do not add up to the total {total[key]}")
    for r in results:
        if r.ok and not 0 <= r.cached_tokens <= r.prompt_tokens:
            bad.append(f"session {r.session} turn {r.turn}: cached {r.cached_tokens} of {r.prompt_tokens} prompt tokens")
    return bad
