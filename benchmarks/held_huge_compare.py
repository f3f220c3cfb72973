"""Old and new trees, in alternate runs of `cedserve bench held --scenarios huge`, summarized per arm.

Each run is one JSON written by `cedserve bench held --out`, named `r<round>-<tree>-<sender>.json`
(tree: any name, e.g. old / new; sender: client / bytes). Prints one line per arm and, with `--out`,
writes the summaries and the runs (docs/benchmarks/held-cpu-huge.json has this shape).

    for r in 1 2 3; do for tree in old new; do for s in client bytes; do
      (cd TREE_$tree && .venv/bin/cedserve bench held --scenarios huge --huge-sender $s \\
         --log-dir /tmp/held/logs-$r-$tree-$s --out /tmp/held/r$r-$tree-$s.json); done; done; done
    python benchmarks/held_huge_compare.py /tmp/held --out held.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

RUN_NAME = re.compile(r"r(\d+)-(\w+)-(client|bytes)\.json$")
UNDER_S = 0.05
"""Issue 32's bound on each refusal."""


def load_runs(folder: Path) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(folder.glob("r*-*-*.json")):
        name = RUN_NAME.search(path.name)
        if name is None:
            continue
        report = json.loads(path.read_text())
        runs.append(
            {
                "round": int(name.group(1)),
                "tree": name.group(2),
                "sender": name.group(3),
                "date": report["date"],
                "loadavg_at_start": report["machine"]["loadavg_at_start"],
                **report["results"]["huge"],
            }
        )
    return runs


def spread(values: list[float | None]) -> dict[str, float] | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {
        "median": round(statistics.median(present), 6),
        "min": min(present),
        "max": max(present),
        "n": len(present),
    }


def summarize_arm(arm: list[dict[str, Any]]) -> dict[str, Any]:
    refusals = [s for r in arm for s in r["refusal_s"]]
    growth = [round(100 * (r["router_rss_mb_after"] / r["router_rss_mb_before"] - 1), 1) for r in arm]
    out = {
        "runs": len(arm),
        "refusal_s": spread(refusals),
        "refusals_under_50ms": f"{sum(s < UNDER_S for s in refusals)}/{len(refusals)}",
        "status": sorted({s for r in arm for s in r["refusal_status"]}),
        "refusal_sender_cpu_s": spread([s for r in arm for s in r["refusal_sender_cpu_s"]]),
        "refusal_sender_runqueue_s": spread([s for r in arm for s in r["refusal_sender_runqueue_s"]]),
        "ttft_ratios": [round(r["ttft_ratio"], 2) for r in arm],
        "ttft_within_1_5x": f"{sum(r['ttft_ratio'] <= 1.5 for r in arm)}/{len(arm)}",
        "router_rss_growth_pct": growth,
        "router_rss_growth_pct_after_10s": [
            round(100 * (r["router_rss_mb_after_10s"] / r["router_rss_mb_before"] - 1), 1) for r in arm
        ],
        "server_refusal_s": spread([s for r in arm for s in r["server_refusal_s"]]),
        "http_server_refusal_s": spread([s for r in arm for s in r.get("http_server_refusal_s", [])]),
    }
    if all("client_check_s" in r for r in arm):
        out["client_check_s"] = spread([s for r in arm for s in r["client_check_s"]])
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    arms: dict[str, list[dict[str, Any]]] = {}
    for run in sorted(runs, key=lambda r: r["round"]):
        arms.setdefault(f"{run['tree']}/{run['sender']}", []).append(run)
    return {name: summarize_arm(arm) for name, arm in sorted(arms.items())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    runs = load_runs(args.folder)
    summary = summarize(runs)
    for name, arm in summary.items():
        refusal = arm["refusal_s"]
        print(
            f"{name:>12}: refusal p50 {refusal['median'] * 1e3:.1f} ms ({refusal['min'] * 1e3:.1f}-"
            f"{refusal['max'] * 1e3:.1f}), {arm['refusals_under_50ms']} < 50 ms; TTFT x{arm['ttft_ratios']} "
            f"({arm['ttft_within_1_5x']} within 1.5x); router RSS +{arm['router_rss_growth_pct']} %"
        )
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
