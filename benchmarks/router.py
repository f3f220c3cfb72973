"""Router figures: placement decision latency at scale, and router overhead per request on loopback.

1. Placement: 1,000 workers (500 prefill, 500 decode), a global index of >= 1M (block, worker)
   entries fed through real KV event batches, a 64K-token prompt (1,000 block hashes). Each decision
   is what the router does per request, timed on two paths side by side over the same requests:
   - old: the straightforward walk over every holder of every block (`prefix_hits_reference`), a
     `PrefillLoad` / `DecodeLoad` per worker, and `placement.place` over all 250,000 pairs;
   - new: the request path's walk (`prefix_runs`) and `LoadTable.place`, whose
     per-worker arrays the load reports keep current (their cost is timed apart, per report);
   - new, measured links: the same with a measured link rate on every (prefill, decode) pair, the
     worst case of `LoadTable` (every decode column scored exactly, a P x D gather).
   The paths run one after the other over the same requests and loads (so the old path's big
   matrices do not evict the new path's data between its decisions), and must choose the same
   pair; the run stops if they do not (with measured links: checked on the first 20). Decisions per second on one
   core = 1 / mean decision time (the router's event loop is one thread). Every query is a fresh copy
   of the prompt's hashes (new `bytes` objects, as a request's own hashing makes them), not the
   objects the index was fed. With `--baseline-python`, this benchmark runs in a process per tree
   (the baseline's `cedserve` and this one's), `--placement-rounds` rounds taking them in turn.
2. Overhead: the same streamed request through the router and directly against the workers
   (scripted in-process fake workers on loopback gRPC, so only the router's own work differs).

    python benchmarks/router.py --out docs/benchmarks/router-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cedserve.model.cache.events import AllBlocksCleared, BlockStored, KVEventBatch, Tier
from cedserve.model.cache.hashing import hash_blocks
from cedserve.router.index import GlobalPrefixIndex
from cedserve.router.load_table import LoadTable
from cedserve.router.placement import DecodeLoad, LinkRates, MeasuredLinks, PrefillLoad, RequestShape, place


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(times: list[float], cpu_times: list[float]) -> dict[str, float]:
    """Wall-clock percentiles, and the same in the thread's CPU time (what the code costs when other
    processes share the cores: this machine's 2 cores are shared)."""
    mean = statistics.fmean(times)
    return {"p50_ms": 1e3 * _pct(times, 0.5), "p99_ms": 1e3 * _pct(times, 0.99), "mean_ms": 1e3 * mean,
            "decisions_per_s": 1.0 / mean, "cpu_p50_ms": 1e3 * _pct(cpu_times, 0.5),
            "cpu_p99_ms": 1e3 * _pct(cpu_times, 0.99)}


def _lap(times: tuple[list[float], list[float]], wall_start: float, cpu_start: float) -> None:
    times[0].append(time.perf_counter() - wall_start)
    times[1].append(time.thread_time() - cpu_start)


def _fresh(hashes: list[bytes]) -> list[bytes]:
    """Copies of `hashes` as new objects, as a request's own hashing makes them: the index's lookups
    then compare bytes (and hash them, where it uses Python's hash) instead of finding the very objects
    the index was fed, whose hashes are cached and which compare equal by identity."""
    return [bytes(bytearray(h)) for h in hashes]


def bench_placement(num_workers: int, index_entries: int, prompt_blocks: int, decisions: int,
                    reports_per_decision: int) -> dict[str, object]:
    rng = random.Random(0)
    index = GlobalPrefixIndex()
    prefill_ids = [f"p{i}" for i in range(num_workers // 2)]
    decode_ids = [f"d{i}" for i in range(num_workers // 2)]
    # Many distinct prompt families; each worker holds some families' prefixes in some tier.
    families = [hash_blocks(list(range(f * 7, f * 7 + 64 * prompt_blocks)), f"tenant{f % 10}", 64)
                for f in range(8)]
    per_worker = max(1, index_entries // num_workers)
    start = time.perf_counter()
    for w in prefill_ids + decode_ids:
        fam = families[rng.randrange(len(families))]
        held = fam[: rng.randrange(1, prompt_blocks)]
        filler = [rng.randbytes(32) for _ in range(max(0, per_worker - len(held)))]
        tier = rng.choice([Tier.DEVICE, Tier.HOST, Tier.DISK])
        index.apply(KVEventBatch(w, 0, [AllBlocksCleared(), BlockStored(held, tier), BlockStored(filler, Tier.DEVICE)],
                                 epoch=1))
    build_s = time.perf_counter() - start
    try:  # compile the request path's loops, as the router does before it serves (trees with them)
        from cedserve.router.jit import warm_up
    except ImportError:
        pass
    else:
        warm_up()
    req = RequestShape(prompt_blocks * 64, 75, 64, 56_960)
    tiers = {"host": 2e10, "disk": 2e9}
    links = LinkRates({}, tiers, default_transfer_bytes_per_s=5e10)
    measured = MeasuredLinks(5e10, 0.3, tiers)
    for p in prefill_ids:  # every pair measured, at rates around the default
        for d in decode_ids:
            measured.observe(p, d, rng.randrange(10**9, 10**11), 1.0)
    # Loads evolve by load reports: before each decision `reports_per_decision` workers (all of them:
    # fresh loads for every decision, as in the first version of this benchmark) report new values.
    # The old path builds its objects from the current loads per request; the new path receives
    # just those reports, as the router's pool does between requests.
    queued = [rng.randrange(0, 50_000) for _ in prefill_ids]
    running = [rng.randrange(0, 64) for _ in decode_ids]
    initial = (list(queued), list(running))
    reports: list[list[int]] = []  # per decision: the reporting workers (prefill i, decode num_prefill + i)
    loads: list[tuple[list[int], list[int]]] = []
    for _ in range(decisions):
        reporting = rng.sample(range(2 * len(prefill_ids)), min(reports_per_decision, 2 * len(prefill_ids)))
        for w in reporting:
            if w < len(prefill_ids):
                queued[w] = rng.randrange(0, 50_000)
            else:
                running[w - len(prefill_ids)] = rng.randrange(0, 64)
        reports.append(reporting)
        loads.append((list(queued), list(running)))
    old_times: tuple[list[float], list[float]] = ([], [])  # (wall, thread CPU) seconds per decision
    old_choices = []
    for k, (queued, running) in enumerate(loads):
        hashes = _fresh(families[k % len(families)])
        t, c = time.perf_counter(), time.thread_time()
        hits = index.prefix_hits_reference(hashes)
        pl = [PrefillLoad(w, q, 2e4,
                          cached_blocks=hits[w].blocks_by_tier[Tier.DEVICE] if w in hits else 0,
                          offloaded_blocks={"host": hits[w].blocks_by_tier[Tier.HOST] if w in hits else 0,
                                            "disk": hits[w].blocks_by_tier[Tier.DISK] if w in hits else 0})
              for w, q in zip(prefill_ids, queued, strict=True)]
        dl = [DecodeLoad(w, r, 20_000, [0.02, 0.02, 0.021, 0.022], 5e3,
                         cached_blocks=hits[w].total_blocks if w in hits else 0)
              for w, r in zip(decode_ids, running, strict=True)]
        old = place(req, pl, dl, links, decode_only_max_tokens=256)
        _lap(old_times, t, c)
        old_measured = place(req, pl, dl, measured, decode_only_max_tokens=256) if k < 20 else None
        old_choices.append((old, old_measured))

    table = LoadTable()
    new_times: tuple[list[float], list[float]] = ([], [])
    measured_times: tuple[list[float], list[float]] = ([], [])
    walk_times: list[float] = []  # the index walk, part of new_times
    report_times: list[float] = []
    for w, q in zip(prefill_ids, initial[0], strict=True):
        table.set_prefill(PrefillLoad(w, q, 2e4))
    for w, r in zip(decode_ids, initial[1], strict=True):
        table.set_decode(DecodeLoad(w, r, 20_000, [0.02, 0.02, 0.021, 0.022], 5e3))
    for k, (queued, running) in enumerate(loads):
        hashes = _fresh(families[k % len(families)])
        for i in reports[k]:
            t = time.perf_counter()
            if i < len(prefill_ids):
                table.set_prefill(PrefillLoad(prefill_ids[i], queued[i], 2e4))
            else:
                j = i - len(prefill_ids)
                table.set_decode(DecodeLoad(decode_ids[j], running[j], 20_000, [0.02, 0.02, 0.021, 0.022], 5e3))
            report_times.append(time.perf_counter() - t)
        t, c = time.perf_counter(), time.thread_time()
        runs = index.prefix_runs(hashes)
        walk_times.append(time.perf_counter() - t)
        new = table.place(req, runs, links, 256)
        _lap(new_times, t, c)
        hashes = _fresh(hashes)
        t, c = time.perf_counter(), time.thread_time()
        new_measured = table.place(req, index.prefix_runs(hashes), measured, 256)
        _lap(measured_times, t, c)
        old, old_measured = old_choices[k]
        if (new.prefill_id, new.decode_id, new.cost_s) != (old.prefill_id, old.decode_id, old.cost_s):
            raise AssertionError(f"decision {k}: old path chose {old}, new path {new}")
        if old_measured is not None and (old_measured.prefill_id, old_measured.decode_id) != (
                new_measured.prefill_id, new_measured.decode_id):
            raise AssertionError(f"decision {k}, measured links: old chose {old_measured}, new {new_measured}")
    return {"workers": num_workers, "index_entries": index.num_entries, "prompt_blocks": prompt_blocks,
            "decisions": decisions, "reports_per_decision": reports_per_decision, "index_build_s": build_s,
            "old": _summary(*old_times), "new": _summary(*new_times), "new_measured_links": _summary(*measured_times),
            "new_index_walk_p50_ms": 1e3 * _pct(walk_times, 0.5), "new_index_walk_p99_ms": 1e3 * _pct(walk_times, 0.99),
            "load_report_p50_us": 1e6 * _pct(report_times, 0.5), "load_report_p99_us": 1e6 * _pct(report_times, 0.99)}


def bench_placement_side_by_side(pythons: dict[str, str], rounds: int, *sizes: int) -> dict[str, Any]:
    """`bench_placement` in a process per interpreter (`pythons`: name -> the interpreter whose
    `cedserve` runs; this file's benchmark code for all), in `rounds` rounds that take the
    interpreters in turn, so the shared machine's load falls on all alike. Returns per name the
    median over rounds of each figure, and every round."""
    script = str(Path(__file__).resolve().parent / "router_processes.py")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in pythons}
    for r in range(rounds):
        for name, python in pythons.items():
            line = subprocess.run([python, script, "placement", *map(str, sizes)], capture_output=True, text=True,
                                  check=True).stdout
            runs[name].append(json.loads(line))
            row = runs[name][-1]["new"]
            print(f"round {r + 1}/{rounds} {name}: request path p50 {row['p50_ms']:.3f} ms, p99 {row['p99_ms']:.3f} ms",
                  flush=True)
    return {name: {"median_over_rounds": _median_report(reports), "rounds": reports} for name, reports in runs.items()}


def _median_report(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The reports' median, leaf by leaf (their shapes are equal)."""
    first = reports[0]
    out: dict[str, Any] = {}
    for key, value in first.items():
        if isinstance(value, dict):
            out[key] = _median_report([r[key] for r in reports])
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and any(r[key] != value for r in reports):
            out[key] = statistics.median(r[key] for r in reports)
        else:
            out[key] = value
    return out


def _print_placement(placement: dict[str, Any], tree: str = "") -> None:
    print(f"{'path':<28}{'p50 ms':>9}{'p99 ms':>9}{'mean ms':>9}{'decisions/s':>13}{'cpu p50':>9}{'cpu p99':>9}")
    for name in ("old", "new", "new_measured_links"):
        row = placement[name]
        print(f"{tree + name:<28}{row['p50_ms']:>9.3f}{row['p99_ms']:>9.3f}{row['mean_ms']:>9.3f}"
              f"{row['decisions_per_s']:>13,.0f}{row['cpu_p50_ms']:>9.3f}{row['cpu_p99_ms']:>9.3f}")
    print(f"{tree}request path's index walk: p50 {placement['new_index_walk_p50_ms']:.3f} ms, "
          f"p99 {placement['new_index_walk_p99_ms']:.3f} ms; load report into the table: "
          f"p50 {placement['load_report_p50_us']:.1f} us, p99 {placement['load_report_p99_us']:.1f} us")


def bench_overhead(requests: int, max_tokens: int) -> dict[str, float]:
    tests = Path(__file__).resolve().parents[1] / "tests"
    sys.path[:0] = [str(tests / "unit"), str(tests)]  # the fake workers, and the test PKI they import
    import grpc
    from test_router_service import Cluster  # the scripted fake workers of the router tests

    from cedserve.client import Client
    from cedserve.model.presets import preset
    from cedserve.model.tokenizer import tiny_tokenizer_path
    from cedserve.proto import worker_pb2, worker_pb2_grpc

    ckpt = Path("build/bench_router_ckpt")
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps(preset("tiny").to_hf_dict()))
    (ckpt / "tokenizer.json").write_bytes(tiny_tokenizer_path().read_bytes())
    cluster = Cluster(ckpt)
    try:
        routed, direct = [], []
        prompt = list(range(3, 3 + 200))
        d_addr = next(h.endpoint.address for h in cluster.router.pool.workers.values() if h.role == "decode")
        p_addr = next(h.endpoint.address for h in cluster.router.pool.workers.values() if h.role == "prefill")
        with Client(cluster.address, timeout_s=30) as client, grpc.insecure_channel(d_addr) as dch, \
                grpc.insecure_channel(p_addr) as pch:
            dstub, pstub = worker_pb2_grpc.DecodeWorkerStub(dch), worker_pb2_grpc.PrefillWorkerStub(pch)
            for _ in range(requests):
                t = time.perf_counter()
                client.generate(prompt, max_tokens=max_tokens)
                routed.append(time.perf_counter() - t)
                t = time.perf_counter()  # the same calls, made directly
                lease = dstub.Reserve(worker_pb2.ReserveRequest(request_id="x", prompt_tokens=len(prompt), lease_ms=30_000))
                first = next(iter(pstub.Prefill(worker_pb2.PrefillRequest(
                    request_id="x", token_ids=prompt, effort=75, sampling=worker_pb2.SamplingParams(top_p=1.0)))))
                for _ in dstub.Decode(worker_pb2.DecodeRequest(
                        request_id="x", lease_id=lease.lease_id, token_ids=prompt,
                        first_token=first.first_token.token_id, effort=75,
                        sampling=worker_pb2.SamplingParams(top_p=1.0, max_tokens=max_tokens - 1))):
                    pass
                direct.append(time.perf_counter() - t)
    finally:
        cluster.close()
    return {"requests": requests, "max_tokens": max_tokens, "routed_p50_ms": 1e3 * _pct(routed, 0.5), "direct_p50_ms": 1e3 * _pct(direct, 0.5),
            "overhead_p50_ms": 1e3 * (_pct(routed, 0.5) - _pct(direct, 0.5)),
            "routed_p99_ms": 1e3 * _pct(routed, 0.99), "direct_p99_ms": 1e3 * _pct(direct, 0.99)}


class _Process:
    """A `benchmarks/router_processes.py` child: its first stdout line is its JSON answer; it ends
    when its stdin closes."""

    def __init__(self, python: str, args: list[str], cpu: int | None, env: dict[str, str] | None = None) -> None:
        import subprocess

        script = Path(__file__).resolve().parent / "router_processes.py"
        pin = ["--cpu", str(cpu)] if cpu is not None else []
        self.proc = subprocess.Popen([python, str(script), *pin, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{' '.join(args[:1])} process ended before it was ready")
        self.answer: dict[str, Any] = json.loads(line)

    def cpu_s(self) -> float:
        """User + system CPU seconds the process has used."""
        import os

        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


async def _throughput(address: str, prompt: list[int], max_tokens: int, concurrency: int,
                      seconds: float, cpu_s: Callable[[], float]) -> tuple[int, int, float, float]:
    """(completed, failed, seconds, router CPU seconds) of `concurrency` clients each sending requests
    back to back, after a warm-up that is not counted; `cpu_s` reads the router's CPU time."""
    from cedserve.client import AsyncClient, CedserveError

    client = AsyncClient(address, timeout_s=60)
    done = failed = 0
    stop_at = 0.0

    async def one_client() -> None:
        nonlocal done, failed
        while time.perf_counter() < stop_at:
            try:
                await client.generate(prompt, max_tokens=max_tokens)
                done += 1
            except CedserveError:
                failed += 1

    try:
        stop_at = time.perf_counter() + min(1.0, seconds)  # warm-up: channels, caches
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        done = failed = 0
        cpu0, start = cpu_s(), time.perf_counter()
        stop_at = start + seconds
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        return done, failed, time.perf_counter() - start, cpu_s() - cpu0
    finally:
        await client.close()


_THROUGHPUT_ROUNDS = 4
"""The closed-loop load runs in this many rounds per router, the routers taking turns."""


def bench_processes(routers: dict[str, str], requests: int, max_tokens: int, throughput_s: float,
                    concurrency: int, router_cpu: int | None, token_delay_s: float = 0.0,
                    router_env: dict[str, str] | None = None, floor: bool = False) -> dict[str, Any]:
    """Router overhead and throughput with the fake workers in a process of their own and each router
    in another (pinned to `router_cpu`), as in a deployment: the router's event loop does only the
    router's work. `routers`: name -> the interpreter whose `cedserve` is that router's code (a
    baseline checkout's venv runs the old router against the same fakes). Sequential requests
    alternate routed (each router in turn) and direct, request by request; the load's rounds alternate
    the routers too. `router_env`: environment variables of the router processes alone (gRPC's own
    settings, which it reads when the process starts). `floor`: also measure, as one more router named
    "floor", a bare `grpc.aio` relay making the same calls (`router_processes.relay`): gRPC's share.

    Direct, a request makes the calls it needs: `Reserve`, `Prefill` (read to its `done`, as the router
    reads it) and `Decode`; with `max_tokens` 1, `Prefill` alone (no target), since its first token
    is the answer (before session h-relay2 it made the three calls, `Decode` emitting nothing)."""
    import grpc

    from cedserve.client import Client
    from cedserve.model.presets import preset
    from cedserve.model.tokenizer import tiny_tokenizer_path
    from cedserve.proto import worker_pb2, worker_pb2_grpc

    ckpt = Path("build/bench_router_ckpt").resolve()
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps(preset("tiny").to_hf_dict()))
    (ckpt / "tokenizer.json").write_bytes(tiny_tokenizer_path().read_bytes())
    others = sorted(set(os_cpus()) - {router_cpu}) if router_cpu is not None else []
    fakes = _Process(sys.executable, ["fakes", str(token_delay_s)], others[0] if others else None)
    procs: dict[str, _Process] = {}
    try:
        for name, python in routers.items():
            procs[name] = _Process(python, ["router", str(ckpt), json.dumps(fakes.answer)], router_cpu, router_env)
        if floor:
            procs["floor"] = _Process(sys.executable, ["relay", json.dumps(fakes.answer)], router_cpu, router_env)
        prompt = list(range(3, 3 + 200))
        d_addr, p_addr = fakes.answer["decode"][0][1], fakes.answer["prefill"][0][1]
        clients = {name: Client(f"127.0.0.1:{p.answer['port']}", timeout_s=30) for name, p in procs.items()}
        latency: dict[str, list[float]] = {name: [] for name in [*procs, "direct"]}
        with grpc.insecure_channel(d_addr) as dch, grpc.insecure_channel(p_addr) as pch:
            dstub, pstub = worker_pb2_grpc.DecodeWorkerStub(dch), worker_pb2_grpc.PrefillWorkerStub(pch)

            def direct() -> None:  # the router's calls, made directly: Reserve, Prefill, Decode
                if max_tokens == 1:  # the first token is the answer: a prefill with no target
                    list(pstub.Prefill(worker_pb2.PrefillRequest(
                        request_id="x", token_ids=prompt, effort=75, sampling=worker_pb2.SamplingParams(top_p=1.0))))
                    return
                lease = dstub.Reserve(worker_pb2.ReserveRequest(request_id="x", prompt_tokens=len(prompt), lease_ms=30_000))
                prefill = pstub.Prefill(worker_pb2.PrefillRequest(
                    request_id="x", token_ids=prompt, effort=75, sampling=worker_pb2.SamplingParams(top_p=1.0)))
                events = list(prefill)  # to its `done`, as the router reads it
                first = next(e for e in events if e.WhichOneof("event") == "first_token")
                for _ in dstub.Decode(worker_pb2.DecodeRequest(
                        request_id="x", lease_id=lease.lease_id, token_ids=prompt,
                        first_token=first.first_token.token_id, effort=75,
                        sampling=worker_pb2.SamplingParams(top_p=1.0, max_tokens=max_tokens - 1))):
                    pass

            calls = {**{name: (lambda c=c: c.generate(prompt, max_tokens=max_tokens)) for name, c in clients.items()},
                     "direct": direct}
            for _ in range(10):  # warm-up
                for call in calls.values():
                    call()
            router_cpu_s = dict.fromkeys(procs, 0.0)  # each router's CPU over its own requests
            for _ in range(requests):
                for name, call in calls.items():
                    cpu = procs[name].cpu_s() if name in procs else 0.0
                    t = time.perf_counter()
                    call()
                    latency[name].append(time.perf_counter() - t)
                    if name in procs:
                        router_cpu_s[name] += procs[name].cpu_s() - cpu
        for c in clients.values():
            c.close()
        direct_p50 = _pct(latency["direct"], 0.5)
        out: dict[str, Any] = {"requests": requests, "max_tokens": max_tokens, "router_cpu": router_cpu,
                               "token_delay_ms": 1e3 * token_delay_s, "router_env": router_env or {},
                               "direct_p50_ms": 1e3 * direct_p50, "direct_p99_ms": 1e3 * _pct(latency["direct"], 0.99)}
        load: dict[str, list[float]] = {name: [0, 0, 0.0, 0.0] for name in procs}  # completed, failed, seconds, router CPU seconds
        for _ in range(_THROUGHPUT_ROUNDS if throughput_s > 0 else 0):  # routers in turn, round by round
            for name, proc in procs.items():
                done, failed, secs, cpu = asyncio.run(_throughput(
                    f"127.0.0.1:{proc.answer['port']}", prompt, max_tokens, concurrency,
                    throughput_s / _THROUGHPUT_ROUNDS, proc.cpu_s))
                row_load = load[name]
                row_load[0] += done
                row_load[1] += failed
                row_load[2] += secs
                row_load[3] += cpu
        for name in procs:
            row: dict[str, float] = {"routed_p50_ms": 1e3 * _pct(latency[name], 0.5),
                                     "routed_p99_ms": 1e3 * _pct(latency[name], 0.99),
                                     "overhead_p50_ms": 1e3 * (_pct(latency[name], 0.5) - direct_p50),
                                     "router_cpu_ms_per_sequential_request": 1e3 * router_cpu_s[name] / requests}
            done, failed, secs, cpu = load[name]
            if secs:
                row.update({"throughput_requests_per_s": done / secs, "throughput_failed": int(failed),
                            "throughput_concurrency": concurrency, "throughput_s": secs,
                            "router_cpu_utilisation": cpu / secs, "router_cpu_ms_per_request": 1e3 * cpu / max(done, 1)})
            out[name] = row
        return out
    finally:
        for proc in procs.values():
            proc.close()
        fakes.close()


def os_cpus() -> set[int]:
    import os

    return set(os.sched_getaffinity(0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--index-entries", type=int, default=1_000_000)
    parser.add_argument("--prompt-blocks", type=int, default=1000)
    parser.add_argument("--decisions", type=int, default=200)
    parser.add_argument("--reports-per-decision", type=int, default=None,
                        help="load reports between two decisions (default: every worker, fresh loads each time)")
    parser.add_argument("--requests", type=int, default=100, help="overhead mode's requests (0: skip it)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per overhead-mode request")
    parser.add_argument("--topology", choices=("inprocess", "processes"), default="inprocess",
                        help="overhead mode: fake workers on the router's own event loop (inprocess), or fake "
                             "workers and each router in processes of their own (processes)")
    parser.add_argument("--baseline-python", default=None,
                        help="a baseline checkout's venv interpreter: the placement figures (--placement-rounds), the "
                             "index's cost (--index-gc) and, processes topology, the router of its cedserve are "
                             "measured side by side with this tree's")
    parser.add_argument("--router-cpu", type=int, default=None,
                        help="processes topology: pin each router process to this CPU (one core)")
    parser.add_argument("--throughput-s", type=float, default=0.0,
                        help="processes topology: seconds of closed-loop load per router (0: skip)")
    parser.add_argument("--concurrency", type=int, default=32, help="clients of the throughput load")
    parser.add_argument("--token-delay-ms", type=float, default=0.0,
                        help="processes topology: the fake decode workers' time per token (0: as fast as they can)")
    parser.add_argument("--router-env", action="append", default=[], metavar="NAME=VALUE",
                        help="processes topology: an environment variable of the router processes alone (repeat "
                             "for more), e.g. GRPC_EXPERIMENTS=-event_engine_client")
    parser.add_argument("--floor", action="store_true",
                        help="processes topology: also measure a bare grpc.aio relay making the router's calls "
                             "(gRPC's own cost, the floor of any router on this stack)")
    parser.add_argument("--index-gc", action="store_true",
                        help="also build the placement index in a process per router interpreter and report a full "
                             "garbage collection's time and the memory it holds")
    parser.add_argument("--placement-rounds", type=int, default=3,
                        help="with --baseline-python: rounds of the placement figures, each tree's code in a process "
                             "of its own, the trees in turn (0: this tree's alone, in this process)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/router-cpu.json"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    reports = args.workers if args.reports_per_decision is None else args.reports_per_decision
    sizes = (args.workers, args.index_entries, args.prompt_blocks, args.decisions, reports)
    side_by_side: dict[str, Any] = {}
    if args.baseline_python and args.placement_rounds:
        side_by_side = bench_placement_side_by_side({"old": args.baseline_python, "new": sys.executable},
                                                    args.placement_rounds, *sizes)
        placement = side_by_side["new"]["median_over_rounds"]
    else:
        placement = bench_placement(*sizes)
    print(f"placement: {placement['workers']} workers, {placement['index_entries']:,} index entries, "
          f"{placement['prompt_blocks']}-block prompt, {placement['decisions']} decisions, "
          f"{placement['reports_per_decision']} load reports between decisions (same choice on both paths)"
          + (f"; medians over {args.placement_rounds} rounds per tree" if side_by_side else ""))
    if side_by_side:
        _print_placement(side_by_side["old"]["median_over_rounds"], "baseline tree: ")
    _print_placement(placement, "this tree: " if side_by_side else "")
    if args.topology == "processes" and args.requests:
        routers = {"new": sys.executable, **({"old": args.baseline_python} if args.baseline_python else {})}
        processes = bench_processes(routers, args.requests, args.max_tokens, args.throughput_s, args.concurrency,
                                    args.router_cpu, args.token_delay_ms / 1e3,
                                    dict(kv.split("=", 1) for kv in args.router_env), args.floor)
        print(f"processes: direct p50 {processes['direct_p50_ms']:.2f} ms")
        for name in [*routers, *(["floor"] if args.floor else [])]:
            row = processes[name]
            print(f"  {name}: routed p50 {row['routed_p50_ms']:.2f} ms (+{row['overhead_p50_ms']:.2f} ms per "
                  f"{args.max_tokens}-token request, router CPU {row['router_cpu_ms_per_sequential_request']:.2f} ms "
                  "per request)" + (
                      f", {row['throughput_requests_per_s']:.0f} requests/s at {args.concurrency} concurrent, "
                      f"router CPU {row['router_cpu_utilisation']:.2f} cores, "
                      f"{row['router_cpu_ms_per_request']:.2f} ms per request" if args.throughput_s else ""))
    else:
        processes = {}
    index_gc: dict[str, Any] = {}
    if args.index_gc:
        script = str(Path(__file__).resolve().parent / "router_processes.py")
        for name, python in {"new": sys.executable, **({"old": args.baseline_python} if args.baseline_python
                                                       else {})}.items():
            line = subprocess.run([python, script, "index", str(args.workers), str(args.index_entries),
                                   str(args.prompt_blocks)], capture_output=True, text=True, check=True).stdout
            index_gc[name] = json.loads(line)
            print(f"index ({name}): a full garbage collection {index_gc[name]['gc_full_collection_ms']:.1f} ms, "
                  f"{index_gc[name]['gc_tracked_objects']:,} tracked objects, "
                  f"resident memory +{index_gc[name]['rss_growth_mib']:.0f} MiB")
    overhead = bench_overhead(args.requests, args.max_tokens) if args.requests and args.topology == "inprocess" else {}
    if overhead:
        print(f"overhead: routed p50 {overhead['routed_p50_ms']:.2f} ms vs direct {overhead['direct_p50_ms']:.2f} ms "
              f"(+{overhead['overhead_p50_ms']:.2f} ms per {args.max_tokens}-token request)")
    report = {"benchmark": "router", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.node()} {platform.machine()} CPU, Python {platform.python_version()}",
              "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
              "load_average_1_5_15_min": {"start": load_before, "end": os.getloadavg()},
              "placement": placement,
              **({"placement_side_by_side": side_by_side} if side_by_side else {}), "overhead": overhead, **({"processes": processes} if processes else {}),
              **({"index_gc": index_gc} if index_gc else {})}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
