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
from prometheus_client.parser import text_string_to_metric_families

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
    samples = [x for family in text_string_to_metric_families(text) if family.name == "cedserve_kv_transfer_tail_seconds"
               for x in family.samples if x.labels.get("role") == "sender"]
    count = sum(x.value for x in samples if x.name.endswith("_count"))
    if count <= 0:
        return None
    total = sum(x.value for x in samples if x.name.endswith("_sum"))
    buckets = sorted((float(x.labels["le"]), x.value) for x in samples if x.name.endswith("_bucket"))
    half = next(bound for bound, n in buckets if n >= count / 2)
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


def _ms(stats: dict[str, Any], key: str) -> float | None:
    value = stats.get(key)
    return None if value is None else 1000.0 * float(value)


def workload_name(run: dict[str, Any], model: str | None = None) -> str:
    """`agent sessions, checkpoint demo` / `single prompts of 32,000 tokens, mini-40 (random weights)`
    and the like; `model` names the model where the report cannot (a bench run against `--address`)."""
    w, system = run.get("workload", {}), run.get("system", {})
    if not model:
        model = (f"checkpoint {Path(str(system['checkpoint'])).name}" if system.get("checkpoint") else
                 f"{system['preset']} (random weights)" if system.get("preset") else
                 f"the system at {system.get('address', '?')}")
    if w.get("kind") == "agent_sessions" and list(w.get("turns", [])) == [1, 1]:
        lo, hi = w.get("user_tokens", [0, 0])
        size = f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"
        return f"single prompts of {size} tokens, {model}"
    return f"{str(w.get('kind', 'trace')).replace('_', ' ')}, {model}"


def serve_cells(run: dict[str, Any], model: str | None = None) -> list[dict[str, Any]]:
    """Issue 29's `serve` cells of one `cedserve bench serve` report: one per arm and load point."""
    out = []
    name = workload_name(run, model)
    for arm in run.get("arms", []):  # none when the bench wrote no report
        meta = arm["arm"]
        for point in arm["runs"]:
            s = point["summary"]
            share = s.get("kv_transfer_share_of_ttft") or {}
            tail = s.get("kv_transfer_tail_share_of_ttft") or {}  # reports before the field: none
            out.append({
                "workload": f"{name}, {point['load']['label']}", "mode": "colocated" if meta.get("colocated") else
                "disaggregated", "policy": meta.get("policy"), "api": point.get("api", "grpc"),
                "completed": s["completed"], "errored": s["errored"],
                "ttft_p50_ms": _ms(s["ttft_s"], "p50"), "ttft_p99_ms": _ms(s["ttft_s"], "p99"),
                "tpot_p50_ms": _ms(s["tpot_s"], "p50"), "tpot_p99_ms": _ms(s["tpot_s"], "p99"),
                "transfer_share_of_ttft": share.get("p50"),
                "transfer_tail_share_of_ttft": tail.get("p50"),
                "kv_transfer_p50_ms": _ms(s.get("kv_transfer_s") or {}, "p50"),
                "kv_transfer_bytes": s.get("kv_transfer_bytes"), "output_tokens_per_s": s.get("output_tokens_per_s"),
                "goodput_rps": s.get("goodput_rps"),
            })
    return out


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
        "serve": serve_cells(report, model="demo checkpoint"),
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
