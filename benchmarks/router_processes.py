"""The processes of `benchmarks/router.py --topology processes`: fake workers, or one router.

    python benchmarks/router_processes.py [--cpu N] fakes [TOKEN_DELAY_S]    # prints {"prefill": [...], ...}
    python benchmarks/router_processes.py index WORKERS ENTRIES BLOCKS       # the index's GC cost, memory
    python benchmarks/router_processes.py placement WORKERS ENTRIES BLOCKS DECISIONS REPORTS  # decision times
    python benchmarks/router_processes.py [--cpu N] router CKPT FAKES_JSON   # prints {"port": N}
    python benchmarks/router_processes.py [--cpu N] relay FAKES_JSON         # the floor; prints {"port": N}

`fakes`, `router` and `relay` run until their stdin closes. `router` imports only `cedserve.router` and `cedserve.model`, so any
checkout's interpreter can run it (the baseline's router against the same fakes). `fakes` are the
router tests' scripted workers (tests/unit/test_router_service.py), in a process of their own as real
workers are, so the router's event loop does only the router's work.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any


async def _until_stdin_closes() -> None:
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def fakes(token_delay_s: float) -> None:
    tests = Path(__file__).resolve().parents[1] / "tests"
    sys.path[:0] = [str(tests / "unit"), str(tests)]
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from test_router_service import FakeDecode, FakePrefill

    from cedserve.proto import worker_pb2_grpc

    out: dict[str, list[list[str]]] = {"prefill": [], "decode": []}
    servers = []
    for servicer in (FakePrefill("p0"), FakePrefill("p1"), FakeDecode("d0"), FakeDecode("d1")):
        servicer.script.token_delay_s = token_delay_s
        server = grpc.aio.server()
        if isinstance(servicer, FakePrefill):
            worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
        else:
            worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        checks = health.HealthServicer(experimental_non_blocking=True)
        checks.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(checks, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        out["prefill" if isinstance(servicer, FakePrefill) else "decode"].append(
            [servicer.worker_id, f"127.0.0.1:{port}"])
    print(json.dumps(out), flush=True)
    await _until_stdin_closes()
    for server in servers:
        await server.stop(0)


async def router(checkpoint: str, workers: dict[str, list[list[str]]]) -> None:
    from cedserve.router import server
    from cedserve.router.config import RouterConfig, WorkerEndpoint

    config = RouterConfig(checkpoint=checkpoint, host="127.0.0.1", port=0,
                          prefill=tuple(WorkerEndpoint(w, a) for w, a in workers["prefill"]),
                          decode=tuple(WorkerEndpoint(w, a) for w, a in workers["decode"]))
    running = await server.start_router(config)
    await running.pool.wait_ready(30)
    if hasattr(server, "freeze_startup_objects"):  # as `cedserve router` does (a baseline tree may not)
        server.freeze_startup_objects()
    print(json.dumps({"port": running.port}), flush=True)
    await _until_stdin_closes()
    await running.stop(0.5)


async def relay(workers: dict[str, list[list[str]]]) -> None:
    """The floor: a bare `grpc.aio` `Generation` server that makes the calls the router makes to the
    first prefill and decode fakes (`Reserve`; `Prefill` into the lease, its first token relayed and
    its `done` read by a task; `Decode`, one response per event; for a one-token request `Prefill`
    alone) and nothing else of the router: no validation, placement, admission, detokenization,
    metrics or interceptors. What gRPC itself costs a router of this shape."""
    import grpc

    from cedserve.proto import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc

    prefill = worker_pb2_grpc.PrefillWorkerStub(grpc.aio.insecure_channel(workers["prefill"][0][1]))
    decode = worker_pb2_grpc.DecodeWorkerStub(grpc.aio.insecure_channel(workers["decode"][0][1]))
    reading: set[asyncio.Task[None]] = set()  # prefill streams read to their end

    async def read_to_end(call: Any) -> None:  # with `read`, as the first token was read (gRPC refuses a mix)
        while await call.read() is not grpc.aio.EOF:
            pass

    class Relay(generation_pb2_grpc.GenerationServicer):  # type: ignore[misc]
        async def Generate(self, request: Any, context: Any) -> Any:
            rid, prompt = request.request_id or "r", list(request.prompt.token_ids.ids)
            target = None
            if request.max_tokens > 1:
                lease = await decode.Reserve(worker_pb2.ReserveRequest(request_id=rid, prompt_tokens=len(prompt),
                                                                       lease_ms=30_000, token_ids=prompt))
                target = worker_pb2.DecodeTarget(worker_id="d0", lease_id=lease.lease_id)
            call = prefill.Prefill(worker_pb2.PrefillRequest(request_id=rid, token_ids=prompt, effort=75, target=target,
                                                             sampling=worker_pb2.SamplingParams(top_p=1.0)))
            first = await call.read()
            rest = asyncio.ensure_future(read_to_end(call))
            reading.add(rest)
            rest.add_done_callback(reading.discard)
            if target is not None:
                events = decode.Decode(worker_pb2.DecodeRequest(
                    request_id=rid, lease_id=target.lease_id, token_ids=prompt, first_token=first.first_token.token_id,
                    effort=75, sampling=worker_pb2.SamplingParams(top_p=1.0, max_tokens=request.max_tokens - 1)))
            yield generation_pb2.GenerateResponse(request_id=rid, chunk=generation_pb2.Chunk(
                token_ids=[first.first_token.token_id]))
            if target is not None:
                async for event in events:
                    if event.WhichOneof("event") == "tokens":
                        yield generation_pb2.GenerateResponse(request_id=rid, chunk=generation_pb2.Chunk(
                            token_ids=event.tokens.token_ids))
            yield generation_pb2.GenerateResponse(request_id=rid, complete=generation_pb2.Complete(
                finish_reason=generation_pb2.FINISH_REASON_LENGTH))

    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(Relay(), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(json.dumps({"port": port}), flush=True)
    await _until_stdin_closes()
    await server.stop(0)


def index(workers: int, entries: int, prompt_blocks: int) -> None:
    """The placement benchmark's index (`benchmarks/router.py`), built through this interpreter's
    `GlobalPrefixIndex`; prints what it costs to hold (a full garbage collection, resident memory) and
    to keep current (events of a few or many hashes, dropping a worker)."""
    import gc
    import random
    import statistics
    import time

    from cedserve.model.cache.events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        BlockTierChanged,
        KVEvent,
        KVEventBatch,
        Tier,
    )
    from cedserve.model.cache.hashing import hash_blocks
    from cedserve.router.index import GlobalPrefixIndex

    def rss_mib() -> float:
        return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024

    rss_before = rss_mib()
    rng = random.Random(0)
    built = GlobalPrefixIndex()
    families = [hash_blocks(list(range(f * 7, f * 7 + 64 * prompt_blocks)), f"tenant{f % 10}", 64) for f in range(8)]
    per_worker = max(1, entries // workers)
    for w in [f"p{i}" for i in range(workers // 2)] + [f"d{i}" for i in range(workers // 2)]:
        fam = families[rng.randrange(len(families))]
        held = fam[: rng.randrange(1, prompt_blocks)]
        filler = [rng.randbytes(32) for _ in range(max(0, per_worker - len(held)))]
        tier = rng.choice([Tier.DEVICE, Tier.HOST, Tier.DISK])
        built.apply(KVEventBatch(w, 0, [AllBlocksCleared(), BlockStored(held, tier), BlockStored(filler, Tier.DEVICE)],
                                 epoch=1))
    gc.collect()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t)
    out = {"index_entries": built.num_entries, "gc_tracked_objects": len(gc.get_objects()),
           "gc_full_collection_ms": 1e3 * statistics.median(times), "rss_growth_mib": rss_mib() - rss_before}
    # What the event feed costs: batches of one event with n new hashes stored, moved to another
    # tier, removed (medians), and dropping a worker of ~1,000 entries.
    names = [f"p{i}" for i in range(workers // 2)] + [f"d{i}" for i in range(workers // 2)]
    seq = dict.fromkeys(names, 0)

    def timed(worker: str, event: KVEvent) -> float:
        seq[worker] += 1
        start = time.perf_counter()
        built.apply(KVEventBatch(worker, seq[worker], [event], epoch=1))
        return time.perf_counter() - start

    for n in (1, 16, 256):
        laps: dict[str, list[float]] = {"store": [], "move": [], "remove": []}
        for _ in range(200 if n < 256 else 50):
            w, hashes = rng.choice(names), [rng.randbytes(32) for _ in range(n)]
            laps["store"].append(timed(w, BlockStored(hashes, Tier.DEVICE)))
            laps["move"].append(timed(w, BlockTierChanged(hashes, Tier.DEVICE, Tier.HOST)))
            laps["remove"].append(timed(w, BlockRemoved(hashes, Tier.HOST)))
        for kind, values in laps.items():
            out[f"event_{n}_hashes_{kind}_us"] = 1e6 * statistics.median(values)
    drops = []
    for w in rng.sample(names, 10):
        start = time.perf_counter()
        built.forget(w)
        drops.append(time.perf_counter() - start)
    out["forget_worker_ms"] = 1e3 * statistics.median(drops)
    print(json.dumps(out), flush=True)


def placement(workers: int, entries: int, prompt_blocks: int, decisions: int, reports: int) -> None:
    """`benchmarks/router.py`'s placement figures (this file's directory's benchmark code) timed on
    this interpreter's `cedserve`: a baseline checkout's venv runs the same benchmark on its code."""
    from router import bench_placement  # benchmarks/router.py, beside this file

    print(json.dumps(bench_placement(workers, entries, prompt_blocks, decisions, reports)), flush=True)


def main() -> None:
    if sys.argv[1:2] == ["--cpu"]:  # pinned before anything starts a thread
        os.sched_setaffinity(0, {int(sys.argv[2])})
        del sys.argv[1:3]
    if sys.argv[1] == "fakes":
        asyncio.run(fakes(float(sys.argv[2]) if len(sys.argv) > 2 else 0.0))
    elif sys.argv[1] == "index":
        index(*map(int, sys.argv[2:5]))
    elif sys.argv[1] == "placement":
        placement(*map(int, sys.argv[2:7]))
    elif sys.argv[1] == "relay":
        asyncio.run(relay(json.loads(sys.argv[2])))
    else:
        asyncio.run(router(sys.argv[2], json.loads(sys.argv[3])))


if __name__ == "__main__":
    main()
