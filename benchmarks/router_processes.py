"""The processes of `benchmarks/router.py --topology processes`: fake workers, or one router.

    python benchmarks/router_processes.py [--cpu N] fakes                    # prints {"prefill": [...], ...}
    python benchmarks/router_processes.py [--cpu N] router CKPT FAKES_JSON   # prints {"port": N}

Each runs until its stdin closes. `router` imports only `cedserve.router` and `cedserve.model`, so any
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


async def _until_stdin_closes() -> None:
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def fakes() -> None:
    tests = Path(__file__).resolve().parents[1] / "tests"
    sys.path[:0] = [str(tests / "unit"), str(tests)]
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from test_router_service import FakeDecode, FakePrefill

    from cedserve.proto import worker_pb2_grpc

    out: dict[str, list[list[str]]] = {"prefill": [], "decode": []}
    servers = []
    for servicer in (FakePrefill("p0"), FakePrefill("p1"), FakeDecode("d0"), FakeDecode("d1")):
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
    from cedserve.router.config import RouterConfig, WorkerEndpoint
    from cedserve.router.server import start_router

    config = RouterConfig(checkpoint=checkpoint, host="127.0.0.1", port=0,
                          prefill=tuple(WorkerEndpoint(w, a) for w, a in workers["prefill"]),
                          decode=tuple(WorkerEndpoint(w, a) for w, a in workers["decode"]))
    running = await start_router(config)
    await running.pool.wait_ready(30)
    print(json.dumps({"port": running.port}), flush=True)
    await _until_stdin_closes()
    await running.stop(0.5)


def main() -> None:
    if sys.argv[1:2] == ["--cpu"]:  # pinned before anything starts a thread
        os.sched_setaffinity(0, {int(sys.argv[2])})
        del sys.argv[1:3]
    if sys.argv[1] == "fakes":
        asyncio.run(fakes())
    else:
        asyncio.run(router(sys.argv[2], json.loads(sys.argv[3])))


if __name__ == "__main__":
    main()
