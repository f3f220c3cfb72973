"""The transfer engine of two commits side by side in one run: `cedserve bench kv-transfer` with this
checkout's `kv_transfer/` and with an older one, rounds alternating, on the same host and load.

Only the engine differs between the arms: each runs this checkout's bench, harness and protobuf code
through a folder of symlinks (the installed `cedserve.*` layout, as `scripts/gpu.sh` builds) whose
`cedserve/kv_transfer` points at this checkout's `kv_transfer/` or at `--old-kv` (a commit's
`kv_transfer/`, e.g. from `bash scripts/gpu.sh --prepare-before 7bd97ab`: build/kv_before). A `--arm`
adds a variant of the new engine (`NAME:--set k=v ...`). Each round runs every arm once (the order
turns round by round), so a shared machine's load falls on all of them alike.

    python benchmarks/kv_transfer_old_new.py --old-kv build/kv_before --rounds 3 \\
        --arm new-device-defaults:"--set announce_posts=true" -- --sizes 4K,32K --batch 1 --modes write \\
        --fan-in 1 --reps 5 --only cross_layer

Prints per cell and arm the median over rounds of GB/s, the ratio to one raw NIXL descriptor,
p50 from the first `write_blocks`, the fixed cost and descriptors per request; writes JSON (`--json`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cedserve.common.machine import describe_machine, loadavg

ROOT = Path(__file__).resolve().parent.parent
_PACKAGES = ("common", "model", "kernels", "serving", "prefill_workers", "decode_workers", "router", "proto",
             "training")
_KEYS = ("gbps", "raw_gbps", "ratio_to_raw", "p50_from_write_ms", "fixed_ms", "descriptors_per_request")


def make_tree(folder: Path, kv_transfer: Path) -> Path:
    """A folder whose `cedserve` package is this checkout with `kv_transfer` mapped to `kv_transfer`."""
    pkg = folder / "cedserve"
    pkg.mkdir(parents=True)
    for entry in (ROOT / "cedserve").iterdir():
        (pkg / entry.name).symlink_to(entry)
    for name in _PACKAGES:
        if (ROOT / name).is_dir():
            (pkg / name).symlink_to(ROOT / name)
    (pkg / "kv_transfer").symlink_to(kv_transfer.resolve())
    return folder


def run_arm(tree: Path, bench_args: list[str], extra: list[str], out: Path, timeout_s: float) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-P", "-m", "cedserve.bench.kv_transfer.loadtest", *bench_args, *extra, "--json", str(out)]
    # the tree first: its `cedserve` shadows any other on the path (scripts/gpu.sh's own tree, wheels after)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=timeout_s)
    if not out.exists():
        raise RuntimeError(f"{shlex.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    cells: list[dict[str, Any]] = json.loads(out.read_text())["cells"]
    return cells


def cell_key(c: dict[str, Any]) -> str:
    return f"{c['layout']}-{c['alloc']}-{c['pack']}-{c['mode']}-{c['tokens'] // 1024}K-b{c['batch']}-f{c['fan_in']}"


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds of the headline figures (and of each phase, where the arm reports them)."""
    out: dict[str, Any] = {k: round(statistics.median(r[k] for r in rounds), 4) for k in _KEYS}
    out["verified"] = all(r["verified"] is not False for r in rounds)
    out["failures"] = sum(len(r["failures"]) for r in rounds)
    phases = [r.get("phases_p50_ms") for r in rounds if r.get("phases_p50_ms")]
    if phases:
        out["phases_p50_ms"] = {k: round(statistics.median(p[k] for p in phases), 4) for k in phases[0]}
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old-kv", required=True, help="the older commit's kv_transfer/ folder")
    p.add_argument("--old-name", default="old", help="the old arm's name in the output")
    p.add_argument("--arm", action="append", default=[], metavar="NAME:ARGS",
                   help="a variant of the new engine: NAME:'--set key=value ...' (repeatable)")
    p.add_argument("--old-arm", action="append", default=[], metavar="NAME:ARGS",
                   help="a variant of the old engine, as --arm")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=900.0, help="per bench call")
    p.add_argument("--json", default="", help="write results here")
    args = p.parse_args(own)
    work = Path(tempfile.mkdtemp(prefix="kv-old-new-"))
    trees = {"new": make_tree(work / "new", ROOT / "kv_transfer"), "old": make_tree(work / "old", Path(args.old_kv))}
    arms: list[tuple[str, str, list[str]]] = [("new", "new", []), (args.old_name, "old", [])]
    for spec, tree in [(a, "new") for a in args.arm] + [(a, "old") for a in args.old_arm]:
        name, _, extra = spec.partition(":")
        arms.append((name, tree, shlex.split(extra)))
    started = time.time()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    failed: list[str] = []
    for rnd in range(args.rounds):
        order = arms[rnd % len(arms):] + arms[: rnd % len(arms)]
        for name, tree, extra in order:
            try:
                cells = run_arm(trees[tree], bench_args, extra, work / f"{name}-{rnd}.json", args.timeout_s)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:  # a loaded host: the arm misses a round
                print(f"# round {rnd + 1}/{args.rounds} {name}: FAILED, left out: {str(exc)[-400:]}",
                      file=sys.stderr, flush=True)
                failed.append(f"round {rnd + 1} {name}: {str(exc)[-400:]}")
                continue
            for c in cells:
                results.setdefault(cell_key(c), {}).setdefault(name, []).append(c)
            print(f"# round {rnd + 1}/{args.rounds} {name}: " + ", ".join(
                f"{cell_key(c)} ratio {c['ratio_to_raw']:.2f} fixed {c['fixed_ms']:.2f} ms" for c in cells),
                file=sys.stderr, flush=True)
    summary = {key: {name: summarise(rounds) for name, rounds in by_arm.items()} for key, by_arm in results.items()}
    head = f"{'cell':<40} {'arm':<22} {'GB/s':>7} {'raw1':>7} {'ratio':>5} {'p50w ms':>8} {'fixed':>6} {'desc':>6}"
    print(head)
    print("-" * len(head))
    for key, by_arm in summary.items():
        for name, s in by_arm.items():
            print(f"{key:<40} {name:<22} {s['gbps']:>7.2f} {s['raw_gbps']:>7.2f} {s['ratio_to_raw']:>5.2f} "
                  f"{s['p50_from_write_ms']:>8.3f} {s['fixed_ms']:>6.2f} {s['descriptors_per_request']:>6.0f}"
                  + ("" if s["verified"] and not s["failures"] else " FAIL"))
    doc = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "command": "python benchmarks/kv_transfer_old_new.py " + shlex.join(argv),
           "machine": describe_machine(next((a for a in bench_args if a in ("cuda",)), "cpu")),
           "elapsed_s": round(time.time() - started, 1), "loadavg_at_end": loadavg(),
           "arms": {name: {"engine": tree, "extra_args": extra} for name, tree, extra in arms},
           "notes": "Medians over rounds (arms alternate within each round) of each cell's figures as "
                    "`cedserve bench kv-transfer` defines them (its JSON `notes`); `rounds` holds every round.",
           "failed_calls": failed, "summary": summary, "rounds": results}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"# wrote {args.json}", file=sys.stderr)
    return 1 if any(s["failures"] or not s["verified"] for by in summary.values() for s in by.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
