"""`cedserve bench serve`: the serving benchmark (docs/bench-serve.md).

    cedserve bench serve                                  # agent sessions, every policy + colocated, tiny on CPU
    cedserve bench serve --rates 0.2,0.4 --out r.json     # an open-loop rate sweep
    cedserve bench serve --trace mooncake_trace.jsonl --concurrency 8 --address 127.0.0.1:50051
    cedserve bench serve --write-trace agent.jsonl        # write the synthetic sessions and stop
    cedserve bench serve --api grpc,http --policies cache_aware --no-colocated   # the HTTP API's cost

Without `--address` every arm (a routing policy on the disaggregated topology, then colocated
serving on the same devices) is started fresh by the embedded launcher, driven through every load
point, and stopped. The report goes to the terminal (a table), to `--out` (JSON) and to PNG plots
beside it. Exit status 1 when a report invariant fails (requests sent != completed + errored,
a hit rate outside [0, oracle], effort classes not adding up to the totals).

`--api http` drives the router's OpenAI-compatible HTTP API instead of gRPC (`--api grpc,http`: each
load point through both, one after the other, against the same system). Every run reports
`api_overhead_s`, the client's time minus the router's own per request, and with both APIs each arm
reports `http_vs_grpc`: the difference of their medians, what the HTTP layer adds per request.
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from cedserve.bench.serve.agentic import (
    AgentWorkload,
    generate_sessions,
    parse_effort_mix,
    parse_range,
    trace_stats,
)
from cedserve.bench.serve.driver import Driver, GenerateClient, LoadPoint
from cedserve.bench.serve.http_client import HttpClient
from cedserve.bench.serve.metrics import Slo, summarize_run
from cedserve.bench.serve.report import render_table, request_rows, write_plots
from cedserve.bench.serve.systems import POLICIES, Arm, embedded_arm, plan_arms
from cedserve.bench.serve.trace import (
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
from cedserve.common.machine import describe_machine, loadavg
from cedserve.launcher import EmbeddedOptions, LaunchError, cache_home, read_serve_config
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
    apis: tuple[str, ...] = ("grpc",)
    """The public APIs to drive each load point through, in order: `grpc`, `http`."""


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


async def bench_address(address: str, name: str, plan: BenchPlan,
                        http_address: str | None = None) -> list[dict[str, Any]]:
    """Every load point of the plan, through each of its APIs, against the system at `address` (its
    HTTP API at `http_address`); one run report per point and API."""
    client = AsyncClient(address, api_key=plan.api_key, timeout_s=plan.request_timeout_s)
    http: HttpClient | None = None
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
        clients: dict[str, GenerateClient] = {"grpc": client}
        if "http" in plan.apis:
            if http_address is None:
                raise ValueError("--api http: give --http-address HOST:PORT of the router's HTTP API")
            http = clients["http"] = HttpClient(http_address, card.id, plan.api_key, plan.request_timeout_s)
        for api in plan.apis:
            await _warm_up(clients[api], plan, synth)
        runs = []
        for load in plan.loads:
            for api in plan.apis:
                runs.append(await _run_point(clients[api], api, load, name, plan, synth))
        return runs
    finally:
        await client.close()
        if http is not None:
            await http.close()


async def _run_point(client: GenerateClient, api: str, load: LoadPoint, name: str, plan: BenchPlan,
                     synth: TokenSynth) -> dict[str, Any]:
    salt = f"bench-{uuid.uuid4().hex[:12]}"  # a fresh prefix-cache namespace per run
    oracle = PrefixOracle(plan.trace_block_size, plan.system_block_size)
    label = load.label if plan.apis == ("grpc",) else f"{load.label} {api}"
    bar = _progress_bar(len(plan.records), f"{name} {label}", plan.progress)
    driver = Driver(client, plan.records, synth, oracle, plan.efforts, salt, bar, plan.max_run_s)
    try:
        out = await driver.run(load, plan.seed)
    finally:
        if bar is not None:
            bar.close()
    return {"load": {"kind": load.kind, "value": load.value, "label": label}, "api": api,
            **summarize_run(out, plan.slo), "requests": request_rows(out.results)}


def http_vs_grpc(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per load point driven through both APIs: the medians of their per-request API overhead (client
    time minus the router's own) and of their end-to-end times, in ms, and the HTTP API's excess."""
    by_point: dict[tuple[str, float], dict[str, dict[str, Any]]] = {}
    for run in runs:
        by_point.setdefault((run["load"]["kind"], run["load"]["value"]), {})[run["api"]] = run["summary"]
    out = {}
    for (kind, value), apis in by_point.items():
        if {"grpc", "http"} <= set(apis):
            figures = {f"{api}_{what}_p50_ms": _ms(apis[api][what]["p50"]) for api in ("grpc", "http")
                       for what in ("api_overhead_s", "e2e_s")}
            for what in ("api_overhead_s", "e2e_s"):
                g, h = figures[f"grpc_{what}_p50_ms"], figures[f"http_{what}_p50_ms"]
                figures[f"http_minus_grpc_{what}_p50_ms"] = None if g is None or h is None else h - g
            out[LoadPoint(kind, value).label] = figures
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _progress_bar(total: int, label: str, enabled: bool) -> tqdm[Any] | None:
    """A tqdm bar on stderr; None when off or where tqdm is missing (hosts running from a source tree)."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=False)


async def _warm_up(client: GenerateClient, plan: BenchPlan, synth: TokenSynth) -> None:
    """A few requests outside the measurement (first passes compile and allocate)."""
    for k in range(plan.warmup):
        record = plan.records[k % len(plan.records)]
        try:
            await client.generate(synth.prompt(record), max_tokens=min(4, record.output_length),
                                  cache_salt=f"warmup-{uuid.uuid4().hex[:8]}")
        except CedserveError as exc:  # the measured runs will count what keeps failing
            print(f"# warm-up request {k} failed: {exc}", file=sys.stderr)


def run_arms(arms: Sequence[Arm], base: EmbeddedOptions, log_root: Path, plan: BenchPlan,
             on_arm: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Start each arm fresh, drive it, stop it; `on_arm(done)` after each (the arms' reports so far)."""
    out: list[dict[str, Any]] = []
    for arm in arms:
        print(f"# arm {arm.name}: {arm.num_prefill} prefill, {arm.num_decode} decode "
              f"(x{arm.decode_group_size} ranks), policy {arm.policy} (logs: {log_root / arm.name})",
              file=sys.stderr, flush=True)
        with embedded_arm(arm, base, log_root / arm.name) as (address, http_address):
            runs = asyncio.run(bench_address(address, arm.name, plan, http_address))
        out.append(_arm_report(arm.describe(), runs))
        if on_arm is not None:
            on_arm(out)
    return out


def _arm_report(arm: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    report = {"arm": arm, "runs": runs}
    comparison = http_vs_grpc(runs)
    if comparison:
        report["http_vs_grpc"] = comparison
    return report


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
    s.add_argument("--api", default="grpc", help="the public API(s) to drive: grpc, http, or grpc,http (each load "
                                                 "point through both, to see what the HTTP layer adds)")
    s.add_argument("--http-address", help="with --address and --api http: the router's HTTP API at HOST:PORT")
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
    s.add_argument("--config", help="a `cedserve serve --config` file (.toml or .json) for every arm's processes: "
                                    "its [prefill] / [decode] / [kv_transfer] / [router] tables reach the workers "
                                    "and the router (e.g. [decode] ship_state, [prefill] chunk_tokens)")
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
                     args.warmup, args.request_timeout_s, args.api_key, not args.no_progress, args.max_run_s,
                     parse_apis(args.api))


def parse_apis(text: str) -> tuple[str, ...]:
    apis = tuple(a.strip() for a in text.split(",") if a.strip())
    if not apis or any(a not in ("grpc", "http") for a in apis) or len(set(apis)) != len(apis):
        raise ValueError(f"--api: grpc, http or both (comma-separated), got {text!r}")
    return apis


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
            if args.http_address:
                system["http_address"] = args.http_address
            arms = [_arm_report({"name": "external", "address": args.address},
                                asyncio.run(bench_address(args.address, "external", plan, args.http_address)))]
        else:
            gpus = tuple(int(g) for g in args.gpus.split(",") if g.strip())
            config = read_serve_config(Path(args.config)) if args.config else {}
            base = EmbeddedOptions(checkpoint=Path(args.checkpoint) if args.checkpoint else None, preset=args.preset,
                                   device=args.device, gpus=gpus, http_port=0 if "http" in plan.apis else -1,
                                   config=config)
            plan_list = plan_arms([p for p in args.policies.split(",") if p], args.prefill_workers,
                                  args.decode_workers, args.decode_ep, args.colocated)
            system = {"preset": args.preset, "checkpoint": args.checkpoint, "device": args.device, "gpus": list(gpus),
                      "config": config}
            log_root = Path(args.log_dir) if args.log_dir else cache_home() / "logs" / "bench-serve"
            def arm_done(done: list[dict[str, Any]]) -> None:
                """Each finished arm's rows at once, and the report so far (`partial`) in `--out`: a
                run cut by a time limit keeps the arms it finished."""
                if len(done) == len(plan_list):
                    return
                partial = build_report(plan, done, "cedserve bench serve " + " ".join(argv), machine_info,
                                       started, system)
                partial["partial"] = True
                print(render_table(partial), flush=True)
                write_outputs(partial, Path(args.out), plots=False, table=False)
                print(f"# arm {done[-1]['arm']['name']} done; the report so far is in {args.out}", file=sys.stderr,
                      flush=True)

            with exit_on_sigterm():
                arms = run_arms(plan_list, base, log_root, plan, arm_done)
    except (ValueError, LaunchError) as exc:
        print(f"cedserve bench serve: {exc}", file=sys.stderr)
        return 2
    report = build_report(plan, arms, "cedserve bench serve " + " ".join(argv), machine_info, started, system)
    write_outputs(report, Path(args.out), not args.no_plots)
    bad = violations(report)
    for line in bad:
        print(f"INVARIANT VIOLATED: {line}", file=sys.stderr)
    return 1 if bad else 0
