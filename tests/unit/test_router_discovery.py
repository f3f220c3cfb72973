"""Runtime worker membership of the router. Kubernetes discovery: the real `kubernetes` client against an in-process list/watch API server
(tests/unit/kube_api_fake.py), feeding a real WorkerPool and GlobalPrefixIndex.

Workers are small in-process gRPC servers answering GetLoad and StreamKVEvents (a snapshot of the
blocks they hold), so the pool's polls and event streams run for real: a discovered worker becomes
healthy and credited in the index; one that disappears leaves placement and the index at once.
The WorkerRegistry RPC (Ray's re-registration) moves and removes workers on a running router.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from kube_api_fake import FakeKubeAPI, Pod, endpoint_slice

from cedserve.model.cache.events import AllBlocksCleared, BlockStored, KVEventBatch, Tier, encode_batch
from cedserve.model.presets import preset
from cedserve.model.tokenizer import tiny_tokenizer_path
from cedserve.proto import registry_pb2, registry_pb2_grpc, worker_pb2, worker_pb2_grpc
from cedserve.router.config import DiscoveryConfig, RouterConfig, WorkerEndpoint
from cedserve.router.discovery import KubernetesDiscovery, api_for, merge_endpoints
from cedserve.router.index import GlobalPrefixIndex
from cedserve.router.server import start_router
from cedserve.router.workers import WorkerPool

pytest.importorskip("kubernetes", reason="discovery needs the kubernetes client (cedserve[k8s])")
NS = "serving"
HASHES = [bytes([i]) * 32 for i in range(4)]


class DecodeWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """The two calls the pool makes on its own: load polls and the KV event stream."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id

    async def GetLoad(self, request: Any, context: Any) -> worker_pb2.LoadReport:
        return worker_pb2.LoadReport(worker_id=self.worker_id, role="decode", free_blocks=10, total_blocks=10)

    async def StreamKVEvents(self, request: Any, context: Any) -> AsyncIterator[worker_pb2.KVEventBatch]:
        batch = KVEventBatch(self.worker_id, 1, [AllBlocksCleared(), BlockStored(HASHES, Tier.DEVICE)], epoch=1)
        yield worker_pb2.KVEventBatch(worker_id=self.worker_id, seq=1, events_msgpack=encode_batch(batch),
                                      snapshot=True)
        await asyncio.sleep(3600)


async def _serve(worker_id: str, host: str) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeWorker(worker_id), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    return server, port


async def _until(what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Waits for `check`; the bound is generous because a loaded 2-core CI host once needed more than 10 s."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.02)


def test_slices_to_endpoints() -> None:
    slices = [endpoint_slice(NS, "d-b", "decode-headless", [Pod("decode-1", "10.0.0.2"),
                                                             Pod("decode-0", "10.0.0.1")], 50061),
              endpoint_slice(NS, "d-a", "decode-headless", [Pod("decode-2", "10.0.0.3", serving=False),
                                                             Pod("decode-3", "10.0.0.4", terminating=True),
                                                             Pod("decode-1", "10.0.0.9")], 50061),
              endpoint_slice(NS, "d-c", "decode-headless", [Pod("decode-4", "10.0.0.5")], 50061, port_name="nixl")]
    v6 = endpoint_slice(NS, "d-6", "decode-headless", [Pod("decode-5", "fd00::5")], 50061)
    v6["addressType"] = "IPv6"
    v6["endpoints"][0]["conditions"] = {"ready": True}  # a server without `serving`: `ready` decides
    got = merge_endpoints([*slices, v6], "decode-headless", "grpc")
    # Not serving and terminating pods are left out, a slice without the `grpc` port gives nothing,
    # a pod listed twice (a slice split) counts once: from the first slice by name.
    assert got == [WorkerEndpoint("decode-0", "10.0.0.1:50061"), WorkerEndpoint("decode-1", "10.0.0.9:50061"),
                   WorkerEndpoint("decode-5", "[fd00::5]:50061")]


@pytest.mark.parametrize("gone_as_status", [False, True], ids=["gone-event", "gone-http-status"])
def test_workers_appear_disappear_and_come_back(gone_as_status: bool) -> None:
    from kubernetes import client

    api = FakeKubeAPI(gone_as_status=gone_as_status)
    try:
        asyncio.run(_scenario(api, api_for(client.Configuration(host=api.url))))
    finally:
        api.close()


async def _scenario(api: FakeKubeAPI, k8s: Any) -> None:
    index = GlobalPrefixIndex()
    static = WorkerEndpoint("static-decode", "127.0.0.1:1")  # the static list stays whatever discovery says
    pool = WorkerPool((), (static,), index, poll_s=0.05, retire_grace_s=0.5)
    pool.start()
    servers = []
    config = DiscoveryConfig(NS, {"decode": "ced-decode-headless", "prefill": "ced-prefill-headless"},
                             watch_timeout_s=1, retry_s=0.1)
    discovery = KubernetesDiscovery.attach(pool, config, asyncio.get_running_loop(), api=k8s)
    try:
        server, port = await _serve("ced-decode-0", "127.0.0.1")
        servers.append(server)
        # Another service's slice and another namespace's slice must be ignored.
        api.put(endpoint_slice(NS, "other", "other-svc", [Pod("x-0", "127.0.0.1")], port))
        api.put(endpoint_slice("elsewhere", "d1", "ced-decode-headless", [Pod("y-0", "127.0.0.1")], port))
        api.put(endpoint_slice(NS, "d1", "ced-decode-headless", [Pod("ced-decode-0", "127.0.0.1")], port))

        # Appears: polled, healthy, its KV snapshot credits it in the index.
        await _until("decode-0 healthy", lambda: [h.worker_id for h in pool.healthy("decode")] == ["ced-decode-0"])
        await _until("decode-0 indexed", lambda: index.longest_prefix("ced-decode-0", HASHES).total_blocks == 4)
        assert set(pool.workers) == {"static-decode", "ced-decode-0"}
        first = pool.workers["ced-decode-0"]
        assert first.source == "kubernetes" and static.worker_id in pool.workers

        # Disappears (readiness lost while draining): out of placement and the index at once,
        # its poll and event tasks stopped.
        api.put(endpoint_slice(NS, "d1", "ced-decode-headless",
                               [Pod("ced-decode-0", "127.0.0.1", serving=False)], port))
        await _until("decode-0 removed", lambda: "ced-decode-0" not in pool.workers)
        assert index.num_entries == 0 and pool.healthy("decode") == []
        await _until("old tasks stopped", lambda: all(t.done() for t in first.tasks))

        # Comes back as a new pod at a new address (the old one is gone), while the API server
        # compacts its history: the watch gets 410 Gone and the client lists again.
        await server.stop(0)
        server, port = await _serve("ced-decode-0", "127.0.0.2")
        servers.append(server)
        lists_before = api.count(watch=False)
        api.compact()
        api.drop_watches()
        api.put(endpoint_slice(NS, "d1", "ced-decode-headless", [Pod("ced-decode-0", "127.0.0.2")], port))
        await _until("decode-0 back", lambda: [h.endpoint.address for h in pool.healthy("decode")]
                     == [f"127.0.0.2:{port}"])
        await _until("decode-0 indexed again", lambda: index.longest_prefix("ced-decode-0", HASHES).total_blocks == 4)
        assert api.count(watch=False) > lists_before  # relisted after 410
        assert pool.workers["ced-decode-0"] is not first

        # A second pod in a second slice; then the first slice is deleted.
        server2, port2 = await _serve("ced-decode-1", "127.0.0.1")
        servers.append(server2)
        api.put(endpoint_slice(NS, "d2", "ced-decode-headless", [Pod("ced-decode-1", "127.0.0.1")], port2))
        await _until("two workers", lambda: len(pool.healthy("decode")) == 2)
        api.delete(NS, "d1")
        await _until("d1 gone", lambda: [h.worker_id for h in pool.healthy("decode")] == ["ced-decode-1"])
        assert index.longest_prefix("ced-decode-0", HASHES).total_blocks == 0
        assert set(pool.workers) == {"static-decode", "ced-decode-1"}
    finally:
        discovery.stop()
        await pool.close()
        for s in servers:
            await s.stop(0)


def test_api_errors_keep_the_last_known_workers() -> None:
    from kubernetes import client

    async def scenario() -> None:
        api = FakeKubeAPI()
        pool = WorkerPool((), (), GlobalPrefixIndex(), poll_s=0.05)
        pool.start()
        config = DiscoveryConfig(NS, {"decode": "svc"}, watch_timeout_s=1, retry_s=0.1)
        discovery = KubernetesDiscovery.attach(pool, config, asyncio.get_running_loop(),
                                               api=api_for(client.Configuration(host=api.url)))
        try:
            api.put(endpoint_slice(NS, "s", "svc", [Pod("w-0", "127.0.0.1")], 9))
            await _until("w-0 added", lambda: "w-0" in pool.workers)
            api.close()  # the API server goes away: discovery retries, the pool keeps its workers
            await asyncio.sleep(0.5)
            assert set(pool.workers) == {"w-0"}
        finally:
            discovery.stop()
            await pool.close()

    asyncio.run(scenario())


def test_registry_moves_and_removes_workers_on_a_running_router(tmp_path: Path) -> None:
    """`WorkerRegistry` (what the Ray launcher calls after an actor restart) on a real router."""
    from cedserve.router.lifecycle import list_workers, register_workers

    (tmp_path / "config.json").write_text(json.dumps(preset("tiny").to_hf_dict()))
    shutil.copyfile(tiny_tokenizer_path(), tmp_path / "tokenizer.json")

    async def scenario() -> None:
        old, old_port = await _serve("d0", "127.0.0.1")
        new, new_port = await _serve("d0", "127.0.0.1")
        router = await start_router(RouterConfig(checkpoint=str(tmp_path), decode=(
            WorkerEndpoint("d0", f"127.0.0.1:{old_port}"),), load_poll_s=0.05))
        address = f"127.0.0.1:{router.port}"
        try:
            await _until("d0 indexed", lambda: router.pool.index.longest_prefix("d0", HASHES).total_blocks == 4)
            first = router.pool.workers["d0"]
            changed = await asyncio.to_thread(register_workers, address, [("d0", "decode", f"127.0.0.1:{new_port}")])
            assert changed == ["d0"]
            # Moved: a new handle at the new address, the old one's tasks stopped, credit rebuilt from
            # the new process's snapshot.
            await _until("old tasks stopped", lambda: all(t.done() for t in first.tasks))
            await _until("d0 healthy again", lambda: [h.endpoint.address for h in router.pool.healthy("decode")]
                         == [f"127.0.0.1:{new_port}"])
            state = await asyncio.to_thread(list_workers, address)
            assert [(w["worker_id"], w["source"]) for w in state] == [("d0", "registry")]
            again = await asyncio.to_thread(register_workers, address, [("d0", "decode", f"127.0.0.1:{new_port}")])
            assert again == []  # idempotent
            with pytest.raises(grpc.RpcError) as info:
                await asyncio.to_thread(register_workers, address, [("d1", "decoder", "127.0.0.1:5")])
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "workers[0]" in str(info.value.details())
            with grpc.insecure_channel(address) as ch:
                stub = registry_pb2_grpc.WorkerRegistryStub(ch)  # type: ignore[no-untyped-call]
                reply = await asyncio.to_thread(stub.Deregister, registry_pb2.DeregisterRequest(worker_ids=["d0", "x"]))
            assert list(reply.removed) == ["d0"] and router.pool.index.num_entries == 0
        finally:
            await router.stop(0.1)
            await old.stop(0)
            await new.stop(0)

    asyncio.run(scenario())


def test_registry_needs_the_internal_token(tmp_path: Path) -> None:
    """With an internal token the registry refuses callers without it (UNAUTHENTICATED), so a local
    process cannot register an address of its own and be sent the token; with it, it registers."""
    from cedserve.router.lifecycle import list_workers, register_workers

    (tmp_path / "config.json").write_text(json.dumps(preset("tiny").to_hf_dict()))
    shutil.copyfile(tiny_tokenizer_path(), tmp_path / "tokenizer.json")

    async def scenario() -> None:
        worker, port = await _serve("d0", "127.0.0.1")
        router = await start_router(RouterConfig(checkpoint=str(tmp_path), load_poll_s=0.05, worker_token="t0k3n"))
        address = f"127.0.0.1:{router.port}"
        try:
            for token in ("", "wrong"):
                with pytest.raises(grpc.RpcError) as info:
                    await asyncio.to_thread(register_workers, address, [("d0", "decode", f"127.0.0.1:{port}")],
                                            token=token)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError):
                    await asyncio.to_thread(list_workers, address, token=token)
            assert router.pool.workers == {}
            changed = await asyncio.to_thread(register_workers, address, [("d0", "decode", f"127.0.0.1:{port}")],
                                              token="t0k3n")
            assert changed == ["d0"]
            assert [w["worker_id"] for w in await asyncio.to_thread(list_workers, address, token="t0k3n")] == ["d0"]
        finally:
            await router.stop(0.1)
            await worker.stop(0)

    asyncio.run(scenario())
