"""Router figures of two trees side by side: a baseline checkout and this one, in one run.

Runs each tree's own `benchmarks/router.py` (its router, its fake workers, its placement code) in
alternating rounds, baseline then this tree, so the shared machine's load falls on both alike, and
writes one JSON with every round and the median over rounds of each figure.

    git worktree add --detach ../base <commit>      # with its own venv: `pip install --no-deps -e .`
    python benchmarks/router_compare.py --baseline ../base --rounds 5 -- --requests 100 \\
        --out docs/benchmarks/router-cpu-compare.json

Arguments after `--` go to both trees' `benchmarks/router.py` (its `--out` is set per round).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parents[1]


def _commit(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def _run(tree: Path, python: Path, args: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "router.json"
        subprocess.run([str(python), "benchmarks/router.py", *args, "--out", str(out)], cwd=tree, check=True,
                       stdout=subprocess.DEVNULL)
        report: dict[str, Any] = json.loads(out.read_text())
    return report


def _numbers(report: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Every numeric leaf of a report, as `section.key` -> value."""
    flat: dict[str, float] = {}
    for key, value in report.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_numbers(value, f"{name}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


def _medians(reports: list[dict[str, Any]]) -> dict[str, float]:
    flats = [_numbers({k: r[k] for k in r if k not in ("date", "machine", "command")}) for r in reports]
    return {k: statistics.median(f[k] for f in flats if k in f) for k in flats[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, required=True, help="a checkout of the baseline commit")
    parser.add_argument("--baseline-python", type=Path, default=None,
                        help="the interpreter that imports the baseline's code (default: BASELINE/.venv/bin/python)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then arguments for benchmarks/router.py")
    opts = parser.parse_args()
    args = opts.args[1:] if opts.args[:1] == ["--"] else opts.args
    base = opts.baseline.resolve()
    trees = {"old": (base, opts.baseline_python or base / ".venv/bin/python"), "new": (_HERE, Path(sys.executable))}
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(opts.rounds):
        row = {name: _run(tree, python, args) for name, (tree, python) in trees.items()}
        rounds.append(row)
        summary = {name: row[name].get("overhead", {}).get("overhead_p50_ms") for name in trees}
        print(f"round {r + 1}/{opts.rounds}: overhead p50 ms {summary}", flush=True)
    medians = {name: _medians([row[name] for row in rounds]) for name in trees}
    for key in sorted(medians["new"]):
        if key in medians["old"]:
            print(f"{key:<48}{medians['old'][key]:>12.3f}{medians['new'][key]:>12.3f}")
    report = {"benchmark": "router-compare", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.node()} {platform.machine()} CPU, Python {platform.python_version()}",
              "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
              "old_commit": _commit(base), "new_commit": _commit(_HERE),
              "note": "old: the baseline tree's benchmarks/router.py, new: this tree's; rounds alternate old, new",
              "median_over_rounds": medians, "rounds": rounds}
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {opts.out}")


if __name__ == "__main__":
    main()
