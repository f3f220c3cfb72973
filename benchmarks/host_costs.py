"""The host-side helpers a decode step or an admission waits for, timed in two source trees side by
side: what the GPU idles through while the host decides.

Each cell is one helper at one size, timed in a fresh process of each tree (`--tree NAME=PATH`: a
tree laid out as it installs, `bash ../shared/tools/installed_layout.sh DIR REV`, run with
`PYTHONPATH=PATH python -P`), the trees alternating over `--rounds`; a cell reports each tree's
median microseconds per call over its rounds.

* `cost_line`: the pass-cost line after a full window (512 passes): one `record_pass` and one
  prediction, what every decode step pays (`StepProfile.seconds`).
* `verify_lengths b1 / b32`: `choose_verify_lengths` over a batch's K = 5 confidences with the
  engine's rate curve (twice a drafting step).
* `cost_check b1 / b32`: `DSparkProposer._passes_pay` (the check's prediction and length choice) on
  the tiny test model's proposer, every sequence with a history.
* `calibrate b32`: a step's 32 verifications recorded into the survival calibration, as the engine
  records them (`record_many`, or a `record` each where a tree has no `record_many`).
* `num_evictable 1M`: the evictable count of a 1M-block pool, half cached and idle (every scheduler
  tick and load report).
* `pick_victims 100K / 1M`: 64 eviction victims from a pool whose blocks are all cached and idle
  (every admission under a full cache).

    bash ../shared/tools/installed_layout.sh /tmp/hc-before 3ec8f68
    bash ../shared/tools/installed_layout.sh /tmp/hc-after HEAD
    python benchmarks/host_costs.py --tree before=/tmp/hc-before --tree after=/tmp/hc-after \\
        --out docs/benchmarks/host-costs-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

CELLS = ("cost_line", "verify_lengths b1", "verify_lengths b32", "cost_check b1", "cost_check b32", "calibrate b32",
         "num_evictable 1M", "pick_victims 100K", "pick_victims 1M")

# Runs inside each tree's process: prints {cell: microseconds per call}. Only public names that both
# trees have, each used the way that tree's engine uses it.
_PROBE = r'''
import json, sys, time
import numpy as np
import torch
sys.path.insert(0, sys.argv[1] + "/tests/unit")
from cedserve.decode_workers.profile import StepProfile
from cedserve.decode_workers.speculative import choose_verify_lengths
from cedserve.model.cache.block_pool import BlockPool
from cedserve.model.cache.prefix import PrefixCache

def per_call(fn, calls):
    for _ in range(max(2, calls // 10)):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6

out = {}
profile = StepProfile(0.05, 0.001)
for i in range(512):
    profile.record_pass(1 + i % 40, 0.002 + 1e-5 * (1 + i % 40))
    profile.record_draft(1 + i % 32, 0.001)
def cost_line():
    profile.record_pass(7, 0.0021)
    profile.seconds(8)
out["cost_line"] = per_call(cost_line, 2000)
many = hasattr(profile, "steps_per_s_many")
rate = (lambda n: profile.steps_per_s_many(n + 3)) if many else (lambda n: profile.steps_per_s(n + 3))
for b in (1, 32):
    conf = torch.rand(b, 5, generator=torch.Generator().manual_seed(b))
    out[f"verify_lengths b{b}"] = per_call(lambda: choose_verify_lengths(conf, rate), 300)

from decode_support import tiny
from test_drafting import _sequence
from cedserve.decode_workers.drafting import DSparkProposer
model, drafter = tiny()
proposer = DSparkProposer(drafter, model, num_tokens=5)
for b in (1, 32):
    seqs = [_sequence(model, f"r{i}", 8, 0.0, seed=i) for i in range(b)]
    history = [torch.rand(5, generator=torch.Generator().manual_seed(i)) for i in range(b)]
    ready = list(range(b))
    out[f"cost_check b{b}"] = per_call(lambda: proposer._passes_pay(seqs, ready, history, profile), 200)

survival = profile.survival
verified = np.cumprod(np.random.default_rng(0).random((32, 5)), axis=1)
lengths, accepted = np.full(32, 5), np.full(32, 2)
if hasattr(survival, "record_many"):
    calibrate = lambda: survival.record_many(verified, lengths, accepted)
else:
    calibrate = lambda: [survival.record(row.tolist(), 2) for row in verified]
out["calibrate b32"] = per_call(calibrate, 300)

def cached_pool(n, idle_fraction):
    pool = BlockPool(n, 1, "cpu")
    cache = PrefixCache(pool, 64)
    ids = np.asarray(pool.allocate(n, "r"))
    cache.insert(ids, [int(i).to_bytes(32, "little") for i in ids])
    released = ids[: int(n * idle_fraction)]
    pool.decref(released)
    cache.touch_released(released)
    return cache
half = cached_pool(1_000_000, 0.5)
out["num_evictable 1M"] = per_call(half.num_evictable, 200)
for n, name in ((100_000, "100K"), (1_000_000, "1M")):
    cache = cached_pool(n, 1.0)
    out[f"pick_victims {name}"] = per_call(lambda: cache.pick_victims(64), 20)
print(json.dumps(out))
'''


def run_tree(path: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(path)}
    done = subprocess.run([sys.executable, "-P", "-c", _PROBE, str(path)], env=env, capture_output=True, text=True,
                          check=False, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"host_costs: the probe failed in {path}:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tree", action="append", required=True, help="NAME=PATH (an installed-layout tree)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.tree)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            rounds[name].append(run_tree(Path(trees[name])))
            print(f"# round {r + 1}: {name} done", flush=True)
    cells: list[dict[str, Any]] = []
    names = list(trees)
    print(f"{'cell':<20}" + "".join(f"{n + ' us':>16}" for n in names)
          + (f"{names[0] + '/' + names[-1]:>16}" if len(names) > 1 else ""))
    for cell in CELLS:
        row: dict[str, Any] = {"cell": cell}
        for name in names:
            row[f"{name}_us"] = statistics.median(r[cell] for r in rounds[name])
            row[f"{name}_rounds_us"] = [round(r[cell], 2) for r in rounds[name]]
        if len(names) > 1:
            row["ratio_first_to_last"] = row[f"{names[0]}_us"] / row[f"{names[-1]}_us"]
        cells.append(row)
        print(f"{cell:<20}" + "".join(f"{row[f'{n}_us']:16.1f}" for n in names)
              + (f"{row['ratio_first_to_last']:16.1f}" if len(names) > 1 else ""))
    if args.out:
        from cedserve.common.machine import describe_machine
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": describe_machine("cpu"),
            "command": " ".join(sys.argv), "trees": trees, "rounds": args.rounds, "cells": cells}, indent=1) + "\n")
        print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
