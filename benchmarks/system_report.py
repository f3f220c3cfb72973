"""Issue 29's report of the whole system on one GPU host, as one JSON file (`docs/benchmarks/system-h200.json`).

It reads what other runs wrote and writes nothing new about them:

- `--transfer FILE`: a `cedserve bench kv-transfer --json` run (scripts/gpu.sh PART=transfer-one).
  Each cell becomes a `kv_transfer` entry: `tokens`, `layout` (`contiguous` block ids, or
  `scattered`: the loadtest's random allocation), `op`, `gbps`, `raw_gbps` (one descriptor, same
  bytes, same run), `ratio_to_raw`, descriptors per request and the fixed cost it measured.
- `--serve FILE` (repeatable): `cedserve bench serve --out` runs (scripts/gpu.sh PART=serve or
  serve-bench). Each arm's load point becomes a `serve` entry: `workload`, `mode` (`colocated` or
  `disaggregated`), TTFT and TPOT p50 / p99, the transfer's share of TTFT and the transfer's p50.
- `--serve-summary FILE` (repeatable): scripts/gpu.sh's serve-<gpu>.json (start-up time, memory).
- Where one file holds a colocated arm and disaggregated ones over the same workload and load,
  `disaggregation` entries give TTFT p50 disaggregated minus colocated, and that minus the
  transfer's own p50: what disaggregation adds beyond moving the bytes.

    python benchmarks/system_report.py --transfer t.json --serve s.json --out docs/benchmarks/system-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from serve_summary import serve_cells  # this folder: python puts a script's own folder on sys.path


def transfer_cells(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The `kv_transfer` entries of one loadtest run."""
    out = []
    for c in run["cells"]:
        out.append({
            "tokens": c["tokens"], "layout": "contiguous" if c["alloc"] == "contiguous" else "scattered",
            "op": c["mode"], "gbps": c["gbps"], "raw_gbps": c["raw_gbps"], "ratio_to_raw": c["ratio_to_raw"],
            "bytes_per_request": c["bytes_per_request"], "descriptors_per_request": c.get("descriptors_per_request"),
            "fixed_ms": c.get("fixed_ms"), "p50_ms": c.get("p50_ms"), "pack": c.get("pack"),
        })
    return out


def disaggregation(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """TTFT added by disaggregation per workload and load, where a colocated arm ran beside."""
    out = []
    colocated = {c["workload"]: c for c in cells if c["mode"] == "colocated"}
    for c in cells:
        base = colocated.get(c["workload"])
        if c["mode"] != "disaggregated" or base is None or c["ttft_p50_ms"] is None or base["ttft_p50_ms"] is None:
            continue
        added = c["ttft_p50_ms"] - base["ttft_p50_ms"]
        out.append({"workload": c["workload"], "policy": c["policy"], "ttft_added_ms": added,
                    "ttft_added_beyond_transfer_ms": added - (c["kv_transfer_p50_ms"] or 0.0)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transfer", type=Path, action="append", default=[])
    p.add_argument("--serve", type=Path, action="append", default=[])
    p.add_argument("--serve-summary", type=Path, action="append", default=[])
    p.add_argument("--machine", default="one NVIDIA H200")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": args.machine,
        "command": "python benchmarks/system_report.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "sources": [str(f) for f in (*args.transfer, *args.serve, *args.serve_summary)],
        "kv_transfer": [], "serve": [], "disaggregation": [], "serve_summaries": []}
    for f in args.transfer:
        report["kv_transfer"] += transfer_cells(json.loads(f.read_text()))
    for f in args.serve:
        cells = serve_cells(json.loads(f.read_text()))
        report["serve"] += cells
        report["disaggregation"] += disaggregation(cells)
    for f in args.serve_summary:
        s = json.loads(f.read_text())
        report["serve_summaries"].append({k: s.get(k) for k in ("date", "device", "startup_s", "gpu_memory_fraction",
                                                                   "gpu_memory", "serve")})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for c in report["kv_transfer"]:
        print(f"kv transfer {c['tokens']:>7} {c['layout']:<10} {c['op']:<5} {c['gbps']:8.1f} GB/s of "
              f"{c['raw_gbps']:8.1f} raw ({c['ratio_to_raw']:.2f})")
    for c in report["serve"]:
        share, tail = c["transfer_share_of_ttft"], c.get("transfer_tail_share_of_ttft")
        print(f"serve {c['workload']:<58} {c['mode']:<13} TTFT p50 {c['ttft_p50_ms'] or 0:8.1f} ms  TPOT p50 "
              f"{c['tpot_p50_ms'] or 0:7.1f} ms  transfer open {'-' if share is None else f'{100 * share:.1f} %'}"
              f", exposed {'-' if tail is None else f'{100 * tail:.1f} %'} of TTFT")
    for d in report["disaggregation"]:
        print(f"disaggregation adds {d['ttft_added_ms']:.1f} ms TTFT p50 ({d['ttft_added_beyond_transfer_ms']:.1f} "
              f"beyond the transfer): {d['workload']}, {d['policy']}")
    print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
