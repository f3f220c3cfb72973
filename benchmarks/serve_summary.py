"""The figures of one `PART=serve` run of scripts/gpu.sh, as one JSON file.

The recipe starts `cedserve serve --device auto`, streams one answer with `cedserve generate`, drives
it with `cedserve bench serve`, scrapes every worker's metrics and stops it; this reads what that left
in its folder and writes: the device line `cedserve serve` printed, the start-up time, the workers'
memory shares and GPU memory (the workers' own gauges, and nvidia-smi's per process, CUDA context
included), the answer, and per load of the bench TTFT / TPOT p50 and p99 and the KV transfer's share
of TTFT (the shape of issue 29's `serve` cells).

    python benchmarks/serve_summary.py OUT_DIR --startup-ms 52100 --out OUT_DIR/serve-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import tomllib

from cedserve.common.machine import describe_machine

GAUGES = ("cedserve_gpu_memory_share_bytes", "cedserve_gpu_memory_reserved_bytes", "cedserve_gpu_memory_peak_bytes")


def gauges(text: str) -> dict[str, float]:
    """The GPU memory gauges of one Prometheus exposition."""
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in GAUGES:
            out[name.removeprefix("cedserve_gpu_memory_")] = float(value)
    return out


def transfer_tail(text: str) -> dict[str, float] | None:
    """The senders' `cedserve_kv_transfer_tail_seconds` of one exposition: requests, mean and the
    smallest bucket bound holding half of them (the transfer's time after the prefill's last handoff,
    which nothing overlapped; `cedserve_kv_transfer_seconds` spans the streamed prefill)."""
    prefix = 'cedserve_kv_transfer_tail_seconds'
    count = total = 0.0
    buckets: list[tuple[float, float]] = []
    for line in text.splitlines():
        if not line.startswith(prefix) or 'role="sender"' not in line:
            continue
        name, _, value = line.rpartition(" ")
        if name.startswith(prefix + "_count"):
            count = float(value)
        elif name.startswith(prefix + "_sum"):
            total = float(value)
        elif name.startswith(prefix + "_bucket"):
            bound = name.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if bound == "+Inf" else float(bound), float(value)))
    if count <= 0:
        return None
    half = next(bound for bound, n in sorted(buckets) if n >= count / 2)
    return {"requests": count, "mean_ms": 1000 * total / count, "p50_at_most_ms": 1000 * half}


def smi_apps(path: Path) -> list[dict[str, Any]]:
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits` rows."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            rows.append({"pid": int(parts[0]), "used_mib": float(parts[1])})
    return rows


def serve_cells(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One cell per load of a `cedserve bench serve --address` report."""
    cells = []
    for arm in report.get("arms", []):
        for run in arm.get("runs", []):
            s = run["summary"]
            cells.append({
                "workload": f"agentic sessions, demo checkpoint, {run['load']['label']}",
                "mode": "disaggregated",
                "completed": s["completed"], "errored": s["errored"],
                "ttft_p50_ms": s["ttft_s"]["p50"] * 1e3, "ttft_p99_ms": s["ttft_s"]["p99"] * 1e3,
                "tpot_p50_ms": s["tpot_s"]["p50"] * 1e3, "tpot_p99_ms": s["tpot_s"]["p99"] * 1e3,
                "transfer_share_of_ttft": s["kv_transfer_share_of_ttft"]["p50"],
                "kv_transfer_bytes": s["kv_transfer_bytes"], "output_tokens_per_s": s["output_tokens_per_s"],
                "goodput_rps": s["goodput_rps"]})
    return cells


def shares(run_dir: Path) -> dict[str, float | None]:
    """Each role's `gpu_memory_fraction` as `cedserve serve` wrote it into the role's config."""
    out: dict[str, float | None] = {}
    for role in ("prefill", "decode"):
        path = run_dir / f"{role}.toml"
        table = tomllib.loads(path.read_text()).get(role, {}) if path.is_file() else {}
        out[role] = table.get("gpu_memory_fraction")
    return out


def summarize(folder: Path, startup_s: float, generate_rc: int, bench_rc: int) -> dict[str, Any]:
    serve_log = (folder / "serve.log").read_text() if (folder / "serve.log").is_file() else ""
    device = next((line for line in serve_log.splitlines() if line.startswith("workers on ")), "")
    generate = (folder / "generate.log").read_text() if (folder / "generate.log").is_file() else ""
    bench_path = folder / "bench-serve.json"
    report = json.loads(bench_path.read_text()) if bench_path.is_file() else {}
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "OUT=... PART=serve bash scripts/gpu.sh",
        "machine": describe_machine("cuda"),
        "device": device,
        "startup_s": startup_s if startup_s >= 0 else None,
        "gpu_memory_fraction": shares(folder / "logs" / "run"),
        "gpu_memory": {
            "workers": {name: values for name, values in
                        ((m.stem.removeprefix("metrics-"), gauges(m.read_text())) for m in sorted(folder.glob("metrics-*.txt")))
                        if values},
            "nvidia_smi_at_ready": smi_apps(folder / "gpu-apps-ready.csv"),
            "nvidia_smi_after_bench": smi_apps(folder / "gpu-apps.csv"),
        },
        "generate": {"rc": generate_rc, "output": generate[:600], "usage": _usage(generate)},
        "bench_rc": bench_rc,
        "serve": serve_cells(report),
        "kv_transfer_tail": {name: tail for name, tail in
                             ((m.stem.removeprefix("metrics-"), transfer_tail(m.read_text()))
                              for m in sorted(folder.glob("metrics-prefill*.txt"))) if tail},
    }


def _usage(generate_log: str) -> dict[str, Any] | None:
    """The usage line `cedserve generate -v` prints last (finish reason, tokens, TTFT)."""
    for line in reversed(generate_log.splitlines()):
        if line.startswith("{"):
            try:
                usage: dict[str, Any] = json.loads(line)
            except json.JSONDecodeError:
                return None
            return usage
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--startup-ms", type=int, default=-1, help="ms until `cedserve serve` was ready (-1: never)")
    p.add_argument("--generate-rc", type=int, default=-1)
    p.add_argument("--bench-rc", type=int, default=-1)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    summary = summarize(args.folder, args.startup_ms / 1e3 if args.startup_ms >= 0 else -1.0, args.generate_rc, args.bench_rc)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    for cell in summary["serve"]:
        print(f"{cell['workload']}: TTFT p50 {cell['ttft_p50_ms']:.1f} ms p99 {cell['ttft_p99_ms']:.1f}, "
              f"TPOT p50 {cell['tpot_p50_ms']:.1f} ms p99 {cell['tpot_p99_ms']:.1f}, "
              f"transfer {cell['transfer_share_of_ttft']:.1%} of TTFT")
    print(f"startup {summary['startup_s']} s; memory {json.dumps(summary['gpu_memory']['workers'])}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
