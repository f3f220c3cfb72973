"""`cedserve bench serve`: the serving benchmark (docs/bench-serve.md).

    cedserve bench serve                                  # agent sessions, every policy + colocated, tiny on CPU
    cedserve bench serve --rates 0.2,0.4 --out r.json     # an open-loop rate sweep
    cedserve bench serve --trace mooncake_trace.jsonl --concurrency 8 --address 127.0.0.1:50051
    cedserve bench serve --write-trace agent.jsonl        # write the synthetic sessions and stop

Without `--address` every arm (a routing policy on the disaggregated topology, then colocated
serving on the same devices) is started fresh by the embedded launcher, driven through every load
point, and stopped. The report goes to the terminal (a table), to `--out` (JSON) and to PNG plots
beside it. Exit status 1 when a report invariant fails (requests sent != completed + errored,
a hit rate outside [0, oracle], effort classes not adding up to the totals).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import random
import signal
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from cedserve.bench_serve.agentic import (
    AgentWorkload,
    generate_sessions,
    parse_effort_mix,
    parse_range,
    trace_stats,
)
from cedserve.bench_serve.driver import Driver, LoadPoint
from cedserve.bench_serve.metrics import Slo, summarize_run
from cedserve.bench_serve.report import render_table, request_rows, write_plots
from cedserve.bench_serve.systems import POLICIES, Arm, embedded_arm, plan_arms
from cedserve.bench_serve.trace import (
    PrefixOracle,
    TokenSynth,
    TraceRecord,
    check_block_size,
    infer_block_size,
    oracle_cached_tokens,
    read_trace,
    write_trace,
)
from cedserve.client import AsyncClient, CedserveError
from cedserve.launcher import EmbeddedOptions, LaunchError, cache_home
from cedserve.machine import describe_machine, loadavg
from cedserve.proto import generation_pb2

if TYPE_CHECKING:
    from tqdm import tqdm


@dataclass(frozen=True)
class BenchPlan:
    """Everything a run needs besides the system: the trace, the load points, the SLO."""

    records: list[TraceRecord]
    efforts: list[int]
    """Effort of each record (the trace's, else drawn per session from the mix)."""
    trace_block_size: int
    system_block_size: int
    loads: list[LoadPoint]
    slo: Slo
    workload: dict[str, Any]
    """Description for the report."""
    seed: int = 0
    warmup: int = 2
    request_timeout_s: float = 300.0
    api_key: str | None = None
    progress: bool = True
    max_run_s: float = 0.0
    """Per load point: no new request after this many seconds (the rest is reported unsent); 0: none."""


def assign_efforts(records: Sequence[TraceRecord], mix: Sequence[tuple[int, float]], seed: int) -> list[int]:
    """A record's own effort, else one drawn per session (a session keeps its level)."""
    levels, weights = [lvl for lvl, _ in mix], [w for _, w in mix]
    by_session: dict[str, int] = {}
    out = []
    for i, r in enumerate(records):
        if r.effort is not None:
            out.append(r.effort)
            continue
        key = r.session_id if r.session_id is not None else f"#{i}"
        if key not in by_session:
            by_session[key] = random.Random(f"{seed}/{key}").choices(levels, weights)[0]
        out.append(by_session[key])
    return out


def check_fits(records: Sequence[TraceRecord], max_context_tokens: int, vocab_size: int, low_token: int) -> None:
    if vocab_size <= low_token:
        raise ValueError(f"the served vocabulary ({vocab_size}) is too small to synthesise prompts")
    for i, r in enumerate(records):
        if r.input_length + r.output_length > max_context_tokens:
            raise ValueError(f"trace record {i}: {r.input_length} + {r.output_length} tokens exceed the served "
                             f"model's context of {max_context_tokens}")


async def bench_address(address: str, name: str, plan: BenchPlan) -> list[dict[str, Any]]:
    """Every load point of the plan against the system at `address`; one run report per point."""
    client = AsyncClient(address, api_key=plan.api_key, timeout_s=plan.request_timeout_s)
    try:
        try:
            reply = await client.stub.ListModels(generation_pb2.ListModelsRequest(), timeout=30,
                                                 metadata=client.metadata)
        except grpc.aio.AioRpcError as exc:
            raise ValueError(f"cannot reach the system at {address}: {exc.code().name} {exc.details()}") from None
        card = reply.models[0]
        low = 3  # below: the special tokens (bos, eos, pad) of the shipped tokenizers
        check_fits(plan.records, card.max_context_tokens, card.vocab_size, low)
        synth = TokenSynth(plan.trace_block_size, card.vocab_size, plan.seed, low)
        await _warm_up(client, plan, synth)
        runs = []
        for load in plan.loads:
            salt = f"bench-{uuid.uuid4().hex[:12]}"  # a fresh prefix-cache namespace per run
            oracle = PrefixOracle(plan.trace_block_size, plan.system_block_size)
            bar = _progress_bar(len(plan.records), f"{name} {load.label}", plan.progress)
            driver = Driver(client, plan.records, synth, oracle, plan.efforts, salt, bar, plan.max_run_s)
            try:
                out = await driver.run(load, plan.seed)
            finally:
                if bar is not None:
                    bar.close()
            runs.append({"load": {"kind": load.kind, "value": load.value, "label": load.label},
                         **summarize_run(out, plan.slo), "requests": request_rows(out.results)})
        return runs
    finally:
        await client.close()


def _progress_bar(total: int, label: str, enabled: bool) -> tqdm[Any] | None:
    """A tqdm bar on stderr; None when off or where tqdm is missing (hosts running from a source tree)."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=False)


async def _warm_up(client: AsyncClient, plan: BenchPlan, synth: TokenSynth) -> None:
    """A few requests outside the measurement (first passes compile and allocate)."""
    for k in range(plan.warmup):
        record = plan.records[k % len(plan.records)]
        try:
            await client.generate(synth.prompt(record), max_tokens=min(4, record.output_length),
                                  cache_salt=f"warmup-{uuid.uuid4().hex[:8]}")
        except CedserveError as exc:  # the measured runs will count what keeps failing
            print(f"# warm-up request {k} failed: {exc}", file=sys.stderr)


def run_arms(arms: Sequence[Arm], base: EmbeddedOptions, log_root: Path, plan: BenchPlan) -> list[dict[str, Any]]:
    """Start each arm fresh, drive it, stop it."""
    out = []
    for arm in arms:
        print(f"# arm {arm.name}: {arm.num_prefill} prefill, {arm.num_decode} decode "
              f"(x{arm.decode_group_size} ranks), policy {arm.policy} (logs: {log_root / arm.name})",
              file=sys.stderr, flush=True)
        with embedded_arm(arm, base, log_root / arm.name) as address:
            runs = asyncio.run(bench_address(address, arm.name, plan))
        out.append({"arm": arm.describe(), "runs": runs})
    return out


def build_report(plan: BenchPlan, arms: list[dict[str, Any]], command: str, machine_info: dict[str, Any],
                 started: float, system: dict[str, Any]) -> dict[str, Any]:
    """`machine_info`: `describe_machine()` taken when the bench started."""
    return {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "command": command,
            "machine": {**machine_info, "loadavg_at_end": loadavg()}, "elapsed_s": round(time.time() - started, 1),
            "system": system,
            "workload": plan.workload, "slo": asdict(plan.slo), "arms": arms}


def write_outputs(report: dict[str, Any], out: Path, plots: bool, table: bool = True) -> list[Path]:
    """Print the table; write the JSON and the plots beside it."""
    if table:
        print(render_table(report))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    if not table and not plots:
        return [out]
    written = [out, *(write_plots(report, out.with_suffix("")) if plots else [])]
    if plots and len(written) == 1:
        print("# plots skipped: matplotlib is not installed (pip install 'cedserve[bench]')", file=sys.stderr)
    print("# wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return written


def violations(report: dict[str, Any]) -> list[str]:
    return [f"{a['arm']['name']} {r['load']['label']}: {v}" for a in report["arms"] for r in a["runs"]
            for v in r["invariant_violations"]]


# ------------------------------------------------------------------ command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cedserve bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload (synthetic agent sessions unless --trace)")
    w.add_argument("--trace", help="replay a Mooncake-format JSONL trace")
    w.add_argument("--trace-block-size", type=int, default=0, help="tokens per hash id (0: inferred from the trace)")
    w.add_argument("--write-trace", metavar="PATH", help="write the synthetic sessions as a Mooncake trace and stop")
    w.add_argument("--sessions", type=int, default=6)
    w.add_argument("--turns", default="2,3", help="requests per session, MIN,MAX")
    w.add_argument("--system-prompt-tokens", type=int, default=256, help="shared by sessions of one effort level")
    w.add_argument("--user-tokens", default="128,384", help="first turn's own tokens, MIN,MAX")
    w.add_argument("--tool-result-tokens", default="64,192", help="appended per later turn, MIN,MAX")
    w.add_argument("--output-tokens", default="8,16", help="max_tokens per turn, MIN,MAX")
    w.add_argument("--tool-gap-s", type=float, default=0.5, help="mean gap between a turn and the next")
    w.add_argument("--max-prompt-tokens", type=int, default=2048, help="a session ends before passing this")
    w.add_argument("--effort-mix", default="low:0.3,high:0.5,max:0.2", help="LEVEL:WEIGHT,...")
    w.add_argument("--seed", type=int, default=0)
    load = p.add_argument_group("load (default: --concurrency 4; with --trace, its own timestamps)")
    load.add_argument("--rates", default="", help="open loop: Poisson session arrivals per second, a sweep: 0.2,0.4")
    load.add_argument("--concurrency", default="", help="closed loop: sessions in flight, a sweep: 1,4")
    load.add_argument("--time-scale", type=float, default=0.0, help="replay the trace's timestamps stretched this much")
    slo = p.add_argument_group("SLO (goodput counts completed requests meeting every bound)")
    slo.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    slo.add_argument("--slo-tpot-ms", type=float, default=250.0)
    slo.add_argument("--slo-e2e-s", type=float, default=0.0, help="0: no bound")
    s = p.add_argument_group("systems (started here unless --address)")
    s.add_argument("--address", help="drive a running system at HOST:PORT (one arm)")
    s.add_argument("--api-key", help="API key for --address")
    s.add_argument("--policies", default=",".join(POLICIES), help="disaggregated arms, one per routing policy")
    s.add_argument("--colocated", action=argparse.BooleanOptionalAction, default=True,
                   help="also run colocated serving (no prefill worker) on the same devices")
    s.add_argument("--prefill-workers", type=int, default=1)
    s.add_argument("--decode-workers", type=int, default=1)
    s.add_argument("--decode-ep", type=int, default=1, help="expert-parallel ranks per decode worker")
    s.add_argument("--preset", default="tiny", help="random real-format checkpoint of this preset (tiny, mini-40)")
    s.add_argument("--checkpoint", help="a checkpoint folder instead of --preset")
    s.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    s.add_argument("--gpus", default="", help="GPU ids for the ranks in start order (default 0,1,...)")
    s.add_argument("--block-size", type=int, default=64, help="the system's KV block size (oracle rounding)")
    s.add_argument("--log-dir", help="process logs (default <cache home>/logs/bench-serve)")
    o = p.add_argument_group("output")
    o.add_argument("--out", default="bench-serve.json", help="JSON report; plots go beside it")
    o.add_argument("--no-plots", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--warmup", type=int, default=2, help="unmeasured requests per arm")
    o.add_argument("--request-timeout-s", type=float, default=300.0)
    o.add_argument("--max-run-s", type=float, default=0.0,
                   help="per load point: send nothing new after this long (the rest is reported unsent); 0: no limit")
    return p


def _numbers(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{flag}: expected numbers separated by commas, got {text!r}") from None


def load_points(args: argparse.Namespace) -> list[LoadPoint]:
    points = [LoadPoint("poisson", r) for r in _numbers(args.rates, "rates")]
    points += [LoadPoint("closed", c) for c in _numbers(args.concurrency, "concurrency")]
    if args.time_scale or (not points and args.trace):
        points.append(LoadPoint("trace", args.time_scale or 1.0))
    return points or [LoadPoint("closed", 4)]


def agent_workload(args: argparse.Namespace) -> AgentWorkload:
    return AgentWorkload(sessions=args.sessions, turns=parse_range(args.turns, "turns"),
                         system_prompt_tokens=args.system_prompt_tokens,
                         user_tokens=parse_range(args.user_tokens, "user-tokens"),
                         tool_result_tokens=parse_range(args.tool_result_tokens, "tool-result-tokens"),
                         output_tokens=parse_range(args.output_tokens, "output-tokens"), tool_gap_s=args.tool_gap_s,
                         effort_mix=parse_effort_mix(args.effort_mix), max_prompt_tokens=args.max_prompt_tokens,
                         block_size=args.trace_block_size or args.block_size, seed=args.seed)


def make_plan(args: argparse.Namespace) -> BenchPlan:
    if args.trace:
        records = read_trace(args.trace)
        block = args.trace_block_size or infer_block_size(records)
        check_block_size(records, block)
        workload: dict[str, Any] = {"kind": "trace", "trace": args.trace, "trace_block_size": block}
    else:
        agent = agent_workload(args)
        records, block = generate_sessions(agent), agent.block_size
        workload = {"kind": "agent_sessions", **asdict(agent)}
    workload["stats"] = trace_stats(records, oracle_cached_tokens(records, block, args.block_size))
    workload["effort_mix"] = parse_effort_mix(args.effort_mix)
    return BenchPlan(records, assign_efforts(records, parse_effort_mix(args.effort_mix), args.seed), block,
                     args.block_size, load_points(args),
                     Slo(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000, args.slo_e2e_s), workload, args.seed,
                     args.warmup, args.request_timeout_s, args.api_key, not args.no_progress, args.max_run_s)


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """Within: SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the started systems are stopped too."""
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    started, machine_info = time.time(), describe_machine(args.device)
    try:
        if args.write_trace:
            records = generate_sessions(agent_workload(args))
            write_trace(args.write_trace, records)
            print(f"# wrote {len(records)} requests in {len({r.session_id for r in records})} sessions to "
                  f"{args.write_trace}", file=sys.stderr)
            return 0
        plan = make_plan(args)
        if args.address:
            system: dict[str, Any] = {"address": args.address}
            arms = [{"arm": {"name": "external", "address": args.address},
                     "runs": asyncio.run(bench_address(args.address, "external", plan))}]
        else:
            gpus = tuple(int(g) for g in args.gpus.split(",") if g.strip())
            base = EmbeddedOptions(checkpoint=Path(args.checkpoint) if args.checkpoint else None, preset=args.preset,
                                   device=args.device, gpus=gpus)
            plan_list = plan_arms([p for p in args.policies.split(",") if p], args.prefill_workers,
                                  args.decode_workers, args.decode_ep, args.colocated)
            system = {"preset": args.preset, "checkpoint": args.checkpoint, "device": args.device, "gpus": list(gpus)}
            log_root = Path(args.log_dir) if args.log_dir else cache_home() / "logs" / "bench-serve"
            with exit_on_sigterm():
                arms = run_arms(plan_list, base, log_root, plan)
    except (ValueError, LaunchError) as exc:
        print(f"cedserve bench serve: {exc}", file=sys.stderr)
        return 2
    report = build_report(plan, arms, "cedserve bench serve " + " ".join(argv), machine_info, started, system)
    write_outputs(report, Path(args.out), not args.no_plots)
    bad = violations(report)
    for line in bad:
        print(f"INVARIANT VIOLATED: {line}", file=sys.stderr)
    return 1 if bad else 0
