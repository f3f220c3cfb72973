"""`cedserve bench held`: the load, abuse and loss a system holds (issue 32's figures).

    cedserve bench held                                  # starts the embedded default (demo, CPU), every scenario
    cedserve bench held --scenarios burst --bursts 200   # one scenario
    cedserve bench held --address 127.0.0.1:50051 --token-file run/kv_transfer.token

Scenarios, each against one system, in this order:

- `burst`: N concurrent short requests for each N in `--bursts`. Every request must either complete
  or be refused with RESOURCE_EXHAUSTED and a retry delay; UNAVAILABLE is a failure while workers
  live. Reports the count per status, the share completed and the latency percentiles.
- `deadlines`: `--flood` requests with a 10 ms deadline from 8 threads (abandoned work), then a
  normal request (its time to success) and the decode workers' held blocks (the time until they are
  back to what they were before).
- `huge`: three concurrent prompts of 15 MB beside a normal request: each refusal's latency, the
  normal request's time to first token against the same request on the idle system, and the
  router's resident memory before and after (needs the router's pid: known when this command
  started the system). `--huge-sender client` sends each through a new `AsyncClient`, timed from
  before the call (it connects, reads the router's limits and refuses the prompt itself);
  `--huge-sender bytes` sends each serialized beforehand over a connected channel, timed from its
  first byte (what the router's own refusal costs a client that sends the message).
- `kill`: kill -9 of the router, the prefill worker and the decode worker in turn, `--kill-rounds`
  times each, under `--kill-clients` streams of load (cedserve/bench/serve/chaos.py): detection,
  time to serving again, held blocks back to the baseline, every request ended with a status. Needs
  the system's log folder to find its processes (known when this command started it; else
  `--log-dir` of the running `cedserve serve`).

With no `--address` this command starts `cedserve serve` (supervised, its restart window
`--restart-window-s`) in `--log-dir` and stops it at the end.

Prints a table and writes JSON (`--out`) with the date, machine and command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from cedserve.bench.serve.chaos import KIND_NEEDLE, KINDS, ServeProcess, kill_rounds
from cedserve.client import AsyncClient, CedserveError, Client
from cedserve.common.credentials import token_metadata
from cedserve.common.machine import describe_machine
from cedserve.launcher import TOKEN_FILE_NAME
from cedserve.proto import worker_pb2, worker_pb2_grpc

SCENARIOS = ("burst", "deadlines", "huge", "kill")
HUGE_SENDERS = {"client": "the Python client's call on a new client, timed from before the call",
                "bytes": "the message serialized beforehand, timed from its first byte written"}
SHORT_PROMPT = "def fibonacci(n):\n    "
"""A normal request's prompt; every request asks for `--max-tokens` tokens of it."""


@dataclass
class Outcome:
    """One request's end: its status ("OK" or a gRPC code name), latency and first-token time."""

    status: str
    seconds: float
    ttft_s: float | None = None
    retry_after: bool = False


@dataclass
class Target:
    """The system under test: the router's address, and what reaches inside it when known."""

    address: str
    token: str = ""
    router_pid: int | None = None
    log_dir: Path | None = None
    """The system's `cedserve serve --log-dir` (its processes' command lines name it)."""
    http_address: str = ""
    """The OpenAI-compatible HTTP API's host:port, when known."""
    message_limit: int = 8192 * 16 + (64 << 10)
    """The router's receive limit (router.requests.message_limit; this: the demo model's, when the
    router does not publish it), for the bare-server comparison."""

    def decode_blocks(self) -> dict[str, tuple[int, int]]:
        """(free, total) blocks of each decode worker the router knows (needs the internal token)."""
        from cedserve.router.lifecycle import list_workers

        out = {}
        for w in list_workers(self.address, token=self.token):
            if w["role"] != "decode" or not w["healthy"]:
                continue
            with grpc.insecure_channel(w["address"]) as channel:
                stub = worker_pb2_grpc.DecodeWorkerStub(channel)  # type: ignore[no-untyped-call]
                load = stub.GetLoad(worker_pb2.LoadRequest(), timeout=5, metadata=token_metadata(self.token))
            out[w["worker_id"]] = (int(load.free_blocks), int(load.total_blocks))
        return out

    def router_rss_mb(self) -> float | None:
        if self.router_pid is None:
            return None
        for line in Path(f"/proc/{self.router_pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return None


async def _one(client: AsyncClient, prompt: str, max_tokens: int, timeout_s: float | None = None) -> Outcome:
    start = time.monotonic()
    first: list[float] = []

    def on_piece(_: object) -> None:
        if not first:
            first.append(time.monotonic() - start)

    try:
        async with asyncio.timeout(timeout_s):  # (not wait_for: Python 3.11's may swallow a cancel)
            await client.generate(prompt, on_piece=on_piece, max_tokens=max_tokens)
    except CedserveError as exc:
        return Outcome(exc.code.name, time.monotonic() - start, retry_after=exc.retry_after_s > 0)
    except TimeoutError:
        return Outcome("CLIENT_TIMEOUT", time.monotonic() - start)
    return Outcome("OK", time.monotonic() - start, first[0] if first else None)


async def burst(target: Target, n: int, max_tokens: int, channels: int = 16) -> list[Outcome]:
    """`n` requests at once over `channels` connections."""
    clients = [AsyncClient(target.address, timeout_s=300) for _ in range(channels)]
    try:
        return list(await asyncio.gather(*(_one(clients[i % channels], SHORT_PROMPT, max_tokens) for i in range(n))))
    finally:
        for c in clients:
            await c.close()


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    times = sorted(o.seconds for o in outcomes)
    codes = Counter(o.status for o in outcomes)
    refused = [o for o in outcomes if o.status == "RESOURCE_EXHAUSTED"]
    return {"requests": len(outcomes), "status": dict(codes), "completed_share": codes["OK"] / max(1, len(outcomes)),
            "unavailable": codes["UNAVAILABLE"], "refusals_with_retry_delay": sum(o.retry_after for o in refused),
            "p50_s": _pct(times, 0.5), "p99_s": _pct(times, 0.99)}


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


def deadline_flood(target: Target, n: int, max_tokens: int, threads: int = 8) -> dict[str, Any]:
    """`n` requests with a 10 ms deadline, then how soon the system is whole again."""
    baseline = target.decode_blocks() if target.token else {}
    codes: Counter[str] = Counter()
    lock = threading.Lock()

    def flood(count: int) -> None:
        with Client(target.address, timeout_s=0.01) as client:
            for _ in range(count):
                try:
                    client.generate(SHORT_PROMPT, max_tokens=max_tokens)
                    code = "OK"
                except CedserveError as exc:
                    code = exc.code.name
                with lock:
                    codes[code] += 1

    start = time.monotonic()
    workers = [threading.Thread(target=flood, args=(n // threads + (i < n % threads),)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    flood_s = time.monotonic() - start
    after = time.monotonic()
    normal = _normal_request(target, max_tokens, give_up_s=60)
    out: dict[str, Any] = {"requests": n, "deadline_ms": 10, "status": dict(codes), "flood_s": round(flood_s, 2),
                           "normal_request_ok_after_s": normal, "blocks_before": baseline}
    if target.token:
        out["blocks_back_after_s"] = _blocks_back(target, baseline, after, give_up_s=60)
    return out


def _normal_request(target: Target, max_tokens: int, give_up_s: float) -> float | None:
    """Seconds until a normal request succeeds (None: not within `give_up_s`)."""
    start = time.monotonic()
    while time.monotonic() - start < give_up_s:
        try:
            with Client(target.address, timeout_s=30) as client:
                client.generate(SHORT_PROMPT, max_tokens=max_tokens)
            return round(time.monotonic() - start, 3)
        except CedserveError:
            time.sleep(0.05)
    return None


def _blocks_back(target: Target, baseline: dict[str, tuple[int, int]], since: float, give_up_s: float) -> float | None:
    while time.monotonic() - since < give_up_s:
        if target.decode_blocks() == baseline:
            return round(time.monotonic() - since, 3)
        time.sleep(0.05)
    return None


def _runqueue_wait_s() -> float:
    """Seconds this process's threads have waited for a CPU so far (the second field of each
    thread's /proc schedstat): of a call's wall time, what the machine's other work took."""
    total_ns = 0
    for stat in Path("/proc/self/task").glob("*/schedstat"):
        try:
            total_ns += int(stat.read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total_ns / 1e9


def _touch_and_free(size: int, times: int = 2) -> None:
    """Write to, then free, `size` bytes `times` times: glibc then serves a buffer of that size from
    pages it already holds (the first free raises its mmap threshold; the second buffer comes from its
    heap and stays there), so gRPC's copy of the message into its own buffer does not fault in 15 MB of
    fresh pages. That cost the bytes sender 5-10 ms of CPU, more than the router's part, and varied
    with what building the message had left behind (a build with one copy less left less)."""
    for _ in range(times):
        buffer = bytearray(size)
        buffer[::4096] = b"\x01" * len(range(0, size, 4096))
        del buffer


def _huge_sender(address: str, mb: float, max_tokens: int, ready: Any, go: Any, results: Any, sender: str) -> None:
    """One huge prompt from its own process (spawned): the prompt and client are made before `ready`,
    so building and serialising 15 MB costs the measuring process nothing (the first version sent all
    from one event loop, and the normal request's TTFT then included that loop's 3 x 0.12 s).
    `sender` "client": the Python client's call on a client made before `ready` (not yet connected),
    which connects, reads the router's limits and refuses the prompt itself (a client before it did
    built and serialized the message, then sent it); "bytes": the message serialized before `ready`,
    sent over a connected channel (from its first byte)."""
    big = "x" * int(mb * 1e6)
    if sender == "bytes":
        from cedserve.bench.serve.length_probe import send_serialized
        from cedserve.client import build_request

        message = build_request(big, max_tokens=max_tokens).SerializeToString()
        _touch_and_free(len(message))
        with grpc.insecure_channel(address) as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            ready.set()
            go.wait()
            cpu, queued = time.process_time(), _runqueue_wait_s()
            seconds, status = send_serialized(channel, message)
            cpu, queued = time.process_time() - cpu, _runqueue_wait_s() - queued
        results.put((status, round(seconds, 4), round(cpu, 4), round(queued, 4)))
        return

    async def send() -> tuple[Outcome, float, float]:
        client = AsyncClient(address, timeout_s=120)
        try:
            ready.set()
            while not go.is_set():
                await asyncio.sleep(0.001)
            cpu, queued = time.process_time(), _runqueue_wait_s()
            outcome = await _one(client, big, max_tokens)
            return outcome, time.process_time() - cpu, _runqueue_wait_s() - queued
        finally:
            await client.close()

    outcome, cpu_s, queued_s = asyncio.run(send())
    results.put((outcome.status, round(outcome.seconds, 4), round(cpu_s, 4), round(queued_s, 4)))


async def _ttfts(client: AsyncClient, max_tokens: int, count: int, spacing_s: float) -> list[float]:
    """TTFTs of `count` normal requests started `spacing_s` apart (concurrently when spacing is short)."""
    async def later(k: int) -> Outcome:
        await asyncio.sleep(k * spacing_s)
        return await _one(client, SHORT_PROMPT, max_tokens)

    outcomes = await asyncio.gather(*(later(k) for k in range(count)))
    return [o.ttft_s for o in outcomes if o.ttft_s is not None]


def huge_prompts(target: Target, mb: float, count: int, max_tokens: int, sender: str = "client") -> dict[str, Any]:
    """`count` prompts of `mb` MB at once, each from its own process, beside normal requests from this
    one: the refusals' status and latency, and the normal requests' TTFT against idle (medians of 11
    requests started 50 ms apart: once without the huge prompts, once from the moment they go; the
    same pattern both times, since 11 requests at once load a CPU system on their own). Each refusal's
    wall time comes with what its sender spent on the CPU and waiting for one in that time (the rest
    is waiting on the router and the transport)."""
    import multiprocessing
    import statistics

    rss_before = target.router_rss_mb()
    ctx = multiprocessing.get_context("spawn")
    go, results = ctx.Event(), ctx.Queue()
    readies = [ctx.Event() for _ in range(count)]
    senders = [ctx.Process(target=_huge_sender, args=(target.address, mb, max_tokens, r, go, results, sender),
                           daemon=True)
               for r in readies]
    for proc in senders:
        proc.start()
    try:
        for r in readies:
            if not r.wait(120):
                raise RuntimeError("a huge-prompt sender did not get ready in 120 s")

        async def measure() -> tuple[list[float], list[float]]:
            client = AsyncClient(target.address, timeout_s=120)
            try:
                await _ttfts(client, max_tokens, 2, 0.0)  # warm
                idle = await _ttfts(client, max_tokens, 11, 0.05)  # the same pattern, no huge prompts
                await asyncio.sleep(0.5)
                go.set()
                return idle, await _ttfts(client, max_tokens, 11, 0.05)
            finally:
                await client.close()

        idle, loaded = asyncio.run(measure())
        refusals = [results.get(timeout=120) for _ in senders]
    finally:
        go.set()
        for proc in senders:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    time.sleep(2.0)  # let the router's allocator settle before reading its memory
    rss_after = target.router_rss_mb()
    time.sleep(8.0)  # and again later: is what it kept held or returned?
    rss_later = target.router_rss_mb()
    idle_p50 = statistics.median(idle) if idle else None
    loaded_p50 = statistics.median(loaded) if loaded else None
    return {"prompts": count, "mb": mb, "refusal_status": [r[0] for r in refusals],
            "refusal_s": [r[1] for r in refusals],
            "refusal_sender_cpu_s": [r[2] for r in refusals],
            "refusal_sender_runqueue_s": [r[3] for r in refusals],
            "senders": f"one process each ({sender}: {HUGE_SENDERS[sender]})",
            "idle_ttft_s": idle_p50, "idle_ttfts_s": [round(t, 4) for t in idle],
            "loaded_ttft_s": loaded_p50, "loaded_ttfts_s": [round(t, 4) for t in loaded],
            "loaded_ttft_max_s": max(loaded) if loaded else None,
            "ttft_ratio": (loaded_p50 / idle_p50) if loaded_p50 and idle_p50 else None,
            "router_rss_mb_before": rss_before, "router_rss_mb_after": rss_after,
            "router_rss_mb_after_10s": rss_later,
            **where_refusal_time_goes(target, mb)}


def where_refusal_time_goes(target: Target, mb: float, samples: int = 5) -> dict[str, Any]:
    """The client-observed refusal above, taken apart: the client's own check once it knows the
    router's limits (`client_check_s`: it builds and sends nothing), what building the message costs
    a client that sends it (`client_build_and_serialize_s`), what that client waits once it is built
    (the serialized message sent over a connected channel), the
    router's own refusal from the length prefix alone (gRPC; HTTP when its port is known), and the
    same probe against a gRPC server with no handler code, with gRPC's tarpit (its default) and without
    (what the router's `grpc_tarpit` chooses between)."""
    from cedserve.bench.serve.length_probe import (
        bare_server_refusal_time,
        http_refusal_time,
        refusal_time,
        sent_refusal_time,
    )
    from cedserve.client import build_request

    declared = int(mb * 1e6)
    big = "x" * declared
    start = time.monotonic()
    message = build_request(big, max_tokens=8).SerializeToString()
    size = len(message)
    out: dict[str, Any] = {"client_build_and_serialize_s": round(time.monotonic() - start, 4)}
    with Client(target.address, timeout_s=30) as client:
        limits = client.request_limits()
        out["router_limits"] = None if limits is None else {"max_request_bytes": limits.max_request_bytes,
                                                             "max_prompt_bytes": limits.max_prompt_bytes}
        checked = []
        for _ in range(samples):  # the limits known: the client's own check, nothing sent
            begin = time.monotonic()
            with contextlib.suppress(CedserveError):
                client.generate(big, max_tokens=8)
            checked.append(round(time.monotonic() - begin, 5))
        out["client_check_s"] = checked
    message_limit = limits.max_request_bytes if limits is not None else target.message_limit
    sent = [sent_refusal_time(target.address, message) for _ in range(samples)]
    out["client_refusal_from_first_byte_s"] = [round(seconds, 4) for seconds, _ in sent]
    out["client_refusal_from_first_byte_status"] = [status for _, status in sent]
    probes = [refusal_time(target.address, declared_bytes=size) for _ in range(samples)]
    out["server_refusal_s"] = [None if p is None else round(p.seconds, 4) for p in probes]
    out["server_refusal_status"] = [None if p is None else p.status for p in probes]
    if target.http_address:
        http = [http_refusal_time(target.http_address, declared_bytes=size) for _ in range(samples)]
        out["http_server_refusal_s"] = [None if h is None else round(h[0], 4) for h in http]
        out["http_server_refusal_status"] = [None if h is None else h[1] for h in http]
    out["bare_grpc_server_refusal_s"] = bare_server_refusal_time(message_limit, size, samples)
    out["bare_grpc_server_no_tarpit_refusal_s"] = bare_server_refusal_time(message_limit, size, samples,
                                                                           tarpit=False)
    return out


def run(target: Target, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    results: dict[str, Any] = {}
    if "burst" in args.scenarios:
        results["burst"] = {}
        for n in args.bursts:
            summary = summarize(asyncio.run(burst(target, n, args.max_tokens)))
            results["burst"][str(n)] = summary
            log(f"burst {n:>5}: {summary['completed_share']:.0%} completed, status {summary['status']}, "
                f"p50 {summary['p50_s']:.2f} s, p99 {summary['p99_s']:.2f} s")
    if "deadlines" in args.scenarios:
        flood = deadline_flood(target, args.flood, args.max_tokens)
        results["deadlines"] = flood
        log(f"deadlines {args.flood}: status {flood['status']} in {flood['flood_s']} s; a normal request ok after "
            f"{flood['normal_request_ok_after_s']} s; blocks back after {flood.get('blocks_back_after_s')} s")
    if "huge" in args.scenarios:
        huge = huge_prompts(target, args.huge_mb, 3, args.max_tokens, args.huge_sender)
        results["huge"] = huge
        log(f"huge 3 x {args.huge_mb} MB: {huge['refusal_status']} in {huge['refusal_s']} s; normal TTFT "
            f"{huge['loaded_ttft_s']} s (p50 of 11) vs {huge['idle_ttft_s']} s without them (p50 of the same 11); router RSS {huge['router_rss_mb_before']} "
            f"-> {huge['router_rss_mb_after']} MB; server-side refusal from the length prefix {huge['server_refusal_s']} s "
            f"(HTTP {huge.get('http_server_refusal_s')}; a bare gRPC server {huge['bare_grpc_server_refusal_s']}, "
            f"without its tarpit {huge['bare_grpc_server_no_tarpit_refusal_s']}); "
            f"the client builds the message in {huge['client_build_and_serialize_s']} s; its own check "
            f"(the router's limits known) {huge['client_check_s']} s")
    if "kill" in args.scenarios:
        if target.log_dir is None:
            raise SystemExit("cedserve bench held: the kill scenario needs --log-dir of the running system")
        results["kill"] = kill_rounds(target.address, target.token, target.log_dir, args.kill_kinds,
                                      args.kill_rounds, args.kill_clients, args.kill_max_tokens, log,
                                      args.kill_prompt_tokens, args.kill_pause_for_orphans)
        for kind, summary in results["kill"]["summary"].items():
            log(f"kill {kind:>7} x {summary['kills']}: detected <= {summary['detected_s_max']} s, serving again <= "
                f"{summary['serving_again_s_max']} s, blocks back <= {summary['blocks_back_s_max']} s, "
                f"leaks {summary['leaks']}, in flight {summary['inflight_status']}, no status {summary['no_status']}")
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cedserve bench held", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", help="a running router (default: start the embedded default here)")
    p.add_argument("--token-file", help="the system's internal token (to read the decode workers' blocks)")
    p.add_argument("--router-pid", type=int, help="the router's pid (to read its memory)")
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument("--bursts", type=int, nargs="+", default=[200, 1000])
    p.add_argument("--flood", type=int, default=4000)
    p.add_argument("--huge-mb", type=float, default=15.0)
    p.add_argument("--huge-sender", choices=sorted(HUGE_SENDERS), default="client",
                   help="how each huge prompt is sent: " + "; ".join(f"{k}: {v}" for k, v in HUGE_SENDERS.items()))
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kill-kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--kill-rounds", type=int, default=10, help="kills of each kind")
    p.add_argument("--kill-clients", type=int, default=8, help="streams of load during a kill")
    p.add_argument("--kill-max-tokens", type=int, default=16)
    p.add_argument("--kill-prompt-tokens", type=int, default=0,
                   help="load of fresh random prompts of this many tokens (prefilled by a prefill worker, so a "
                        "router kill finds leases between Reserve and Decode); 0: a short fixed prompt")
    p.add_argument("--kill-pause-for-orphans", action="store_true",
                   help="router kills: send nothing new until the dead router's held blocks are back, so that time "
                        "(orphans_freed_s) is exact however fast the router restarts; serving_again_s then includes it")
    p.add_argument("--serve-config", help="with no --address: a `cedserve serve --config` file for the started system")
    p.add_argument("--checkpoint", help="with no --address: the checkpoint to serve (default: the demo)")
    p.add_argument("--log-dir", help="with no --address: where the started system's logs go; with --address: "
                   "the running `cedserve serve`'s --log-dir (the kill scenario finds its processes by it)")
    p.add_argument("--restart-window-s", type=float, default=60.0,
                   help="with no --address: the supervisor's restart window (restarts back off and are limited "
                        "within it; `cedserve serve`'s default is 600 s, which 10 kills of one part exceed)")
    p.add_argument("--out", help="JSON report")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = print
    report: dict[str, Any] = {"benchmark": "held", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "machine": describe_machine("cpu"), "command": "cedserve bench held " + " ".join(
                                  sys.argv[3:] if argv is None else argv)}
    if args.address:
        log_dir = Path(args.log_dir) if args.log_dir else None
        token_file = Path(args.token_file) if args.token_file else (
            log_dir / "run" / TOKEN_FILE_NAME if log_dir is not None else None)
        token = token_file.read_text().strip() if token_file is not None else ""
        report["results"] = run(Target(args.address, token, args.router_pid, log_dir), args, log)
    else:
        report["results"] = _run_embedded(args, log)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
        log(f"wrote {args.out}")
    return 0


def _run_embedded(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    from cedserve.launcher import cache_home

    root = Path(args.log_dir) if args.log_dir else cache_home() / "logs" / "bench-held"
    extra = ["--config", args.serve_config] if args.serve_config else []
    serve = ServeProcess(root, Path(args.checkpoint) if args.checkpoint else None,
                         "--restart-window-s", str(args.restart_window_s), *extra)
    try:
        target = Target(serve.address, serve.token, serve.pid(KIND_NEEDLE["router"]), serve.log_dir,
                        f"127.0.0.1:{serve.http_port()}")
        log(f"started cedserve serve at {target.address} (logs: {serve.log_dir})")
        return run(target, args, log)
    finally:
        serve.stop()
