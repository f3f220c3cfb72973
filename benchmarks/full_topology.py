"""Full topology: a prefill worker and an expert-parallel decode pool on separate GPUs, against
colocated serving on the same GPUs, under the agentic workload of `cedserve bench serve`.

    python benchmarks/full_topology.py --gpus 3          # prefill on GPU 0, decode EP=2 on GPUs 1-2
    python benchmarks/full_topology.py --gpus 2          # prefill on GPU 0, single-rank decode on GPU 1
    python benchmarks/full_topology.py --device cpu      # the tiny form on CPU (EP=2 over gloo), a check

Arms, each started fresh by the embedded launcher (router, workers as real processes, NIXL between
them, a random real-format checkpoint of `--preset`), one GPU per rank through CUDA_VISIBLE_DEVICES:

    disaggregated  prefill worker on GPU 0; one decode worker of `gpus - 1` expert-parallel ranks
    colocated      one single-rank decode worker per GPU (0 .. gpus-1), each prefilling its own requests

Both run the same trace (multi-turn agent sessions with a growing shared prefix, long prompts,
short outputs, mixed effort) as a closed loop of `--concurrency` sessions, under the router's
default policy. Reported per arm: TTFT / TPOT / end-to-end percentiles, goodput under the stated SLO,
prefix hit rate against the oracle, KV bytes moved, transfer GB/s and the transfer's share of TTFT;
the JSON (written after each arm) and PNG plots go to `--out`. `--max-run-s` bounds each arm's
sending time so the whole run stays within a fixed budget (the rest is reported unsent).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from cedserve.bench.serve.agentic import AgentWorkload, generate_sessions, trace_stats
from cedserve.bench.serve.driver import LoadPoint
from cedserve.bench.serve.main import (
    BenchPlan,
    assign_efforts,
    build_report,
    exit_on_sigterm,
    run_arms,
    violations,
    write_outputs,
)
from cedserve.bench.serve.metrics import Slo
from cedserve.bench.serve.systems import POLICIES, Arm
from cedserve.bench.serve.trace import oracle_cached_tokens
from cedserve.common.machine import describe_machine
from cedserve.launcher import EmbeddedOptions, LaunchError, cache_home

# Workload per device: GPU sizes for mini-40 on H200 (decode is the torch reference path, ~0.3-0.8 s
# per step), CPU sizes for the tiny preset on a few cores.
WORKLOADS = {
    "cuda": AgentWorkload(sessions=16, turns=(2, 4), system_prompt_tokens=1536, user_tokens=(512, 2048),
                          tool_result_tokens=(256, 1024), output_tokens=(16, 32), tool_gap_s=0.5,
                          max_prompt_tokens=8192),
    "cpu": AgentWorkload(sessions=3, turns=(2, 2), system_prompt_tokens=256, user_tokens=(128, 256),
                         tool_result_tokens=(64, 128), output_tokens=(4, 8), tool_gap_s=0.2, max_prompt_tokens=2048),
}


def arms_for(gpus: int, colocated_policies: list[str], disaggregated: bool = True) -> list[Arm]:
    """The disaggregated arm, then one colocated arm per policy: with one worker per GPU the colocated
    arms are where routing policies differ (the disaggregated arm has one worker of each role)."""
    colocated = [Arm("colocated" if policy == "cache_aware" else f"colocated-{policy}", policy, 0, gpus)
                 for policy in colocated_policies]
    disagg = [Arm("disaggregated", "cache_aware", 1, 1, max(1, gpus - 1))] if disaggregated else []
    return [*disagg, *colocated]


def transfer_lines(report: dict[str, Any]) -> list[str]:
    """The figures this script is for, one line per arm."""
    lines = []
    for arm in report["arms"]:
        for run in arm["runs"]:
            s = run["summary"]
            share, gbps = s["kv_transfer_share_of_ttft"]["p50"], s["kv_transfer_gbps"]
            lines.append(f"{arm['arm']['name']:<14} TTFT p50/p99 {s['ttft_s']['p50'] or 0:.3f}/{s['ttft_s']['p99'] or 0:.3f} s, "
                         f"TPOT p50/p99 {s['tpot_s']['p50'] or 0:.3f}/{s['tpot_s']['p99'] or 0:.3f} s, "
                         f"goodput {s['goodput_rps']:.3f} req/s, hit {s['hit_rate']:.1%} of oracle "
                         f"{s['oracle_hit_rate']:.1%}, KV moved {s['kv_transfer_bytes'] / 1e6:.1f} MB"
                         + (f" at {gbps:.3g} GB/s, transfer open for {share:.1%} of TTFT (p50)" if gbps else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--gpus", type=int, default=3, help="GPUs (or CPU 'ranks') used: 3 = EP=2 decode, 2 = single-rank")
    p.add_argument("--preset", help="checkpoint preset (default: mini-40 on cuda, tiny on cpu)")
    p.add_argument("--sessions", type=int, help="agent sessions (default per device)")
    p.add_argument("--concurrency", type=int, default=6, help="sessions in flight (closed loop)")
    p.add_argument("--max-run-s", type=float, default=60.0, help="per arm: send nothing new after this long")
    p.add_argument("--request-timeout-s", type=float, default=90.0, help="a request still running after this fails")
    p.add_argument("--slo-ttft-ms", type=float, default=4000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=1000.0)
    p.add_argument("--out", default="docs/benchmarks/full-topology/full-topology.json")
    p.add_argument("--log-dir", help="process logs (default <cache home>/logs/full-topology)")
    p.add_argument("--colocated-policies", default="cache_aware",
                   help="comma list: one colocated arm per routing policy (cache_aware, least_loaded, round_robin)")
    p.add_argument("--no-disaggregated", action="store_true", help="run only the colocated arms")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.gpus < 2:
        p.error("--gpus must be at least 2 (a prefill GPU and a decode GPU)")
    colocated_policies = [x for x in args.colocated_policies.split(",") if x]
    unknown = sorted(set(colocated_policies) - set(POLICIES))
    if unknown:
        p.error(f"--colocated-policies: unknown {unknown}; choose from {list(POLICIES)}")
    argv_used = sys.argv[1:] if argv is None else argv
    started, machine_info = time.time(), describe_machine(args.device)
    workload = WORKLOADS[args.device]
    if args.sessions:
        workload = replace(workload, sessions=args.sessions)
    records = generate_sessions(workload)
    block = workload.block_size
    plan = BenchPlan(records, assign_efforts(records, workload.effort_mix, workload.seed), block, block,
                     [LoadPoint("closed", args.concurrency)], Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000),
                     {"kind": "agent_sessions", **asdict(workload),
                      "stats": trace_stats(records, oracle_cached_tokens(records, block, block))},
                     warmup=2, request_timeout_s=args.request_timeout_s, progress=not args.no_progress,
                     max_run_s=args.max_run_s)
    preset = args.preset or ("mini-40" if args.device == "cuda" else "tiny")
    base = EmbeddedOptions(preset=preset, device=args.device, gpus=tuple(range(args.gpus)) if args.device == "cuda" else ())
    pool = f"decode EP={args.gpus - 1} on GPUs 1-{args.gpus - 1}" if args.gpus > 2 else "single-rank decode on GPU 1"
    system = {"preset": preset, "device": args.device, "gpus": args.gpus,
              "topology": {"disaggregated": f"prefill on GPU 0, {pool}",
                           "colocated": f"{args.gpus} single-rank decode workers, one per GPU"}}
    log_root = Path(args.log_dir) if args.log_dir else cache_home() / "logs" / "full-topology"
    command = "python benchmarks/full_topology.py " + " ".join(argv_used)
    out = Path(args.out)
    done: list[dict[str, Any]] = []
    try:
        for arm in arms_for(args.gpus, colocated_policies, not args.no_disaggregated):
            with exit_on_sigterm():
                done += run_arms([arm], base, log_root, plan)
            report = build_report(plan, done, command, machine_info, started, system)
            write_outputs(report, out, plots=False, table=False)  # a partial report survives a later failure
    except (ValueError, LaunchError) as exc:
        print(f"full_topology: {exc}", file=sys.stderr)
        return 2
    write_outputs(report, out, plots=True)
    print("\n".join(transfer_lines(report)))
    bad = violations(report)
    for line in bad:
        print(f"INVARIANT VIOLATED: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
