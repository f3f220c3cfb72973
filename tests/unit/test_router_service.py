"""The router's public service over real gRPC on loopback, against fake workers.

The workers here are boundary fakes (in-process gRPC servers speaking the internal worker
protocol with scripted behaviour: deterministic tokens, injected failures). What is under test is
the router: validation, statuses, the decode-first handshake, retries, migration, cancellation,
deadlines, admission and prefix-aware placement. The real-worker end-to-end tests live in tests/e2e.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from tls_pki import TLSFiles

from cedserve.bench.serve.length_probe import refusal_time
from cedserve.client import AsyncClient, CedserveError, Client, Completion, build_request
from cedserve.common.request_limits import request_limits
from cedserve.common.tls import TLSConfig
from cedserve.model.cache.events import BlockStored, KVEventBatch, Tier, encode_batch
from cedserve.model.cache.hashing import hash_blocks
from cedserve.model.presets import preset
from cedserve.model.tokenizer import TextCodec, tiny_tokenizer_path
from cedserve.proto import worker_pb2, worker_pb2_grpc
from cedserve.router.admission import ClassLimits
from cedserve.router.config import RouterConfig, WorkerEndpoint
from cedserve.router.frontend import GenerationCore
from cedserve.router.requests import ModelLimits, message_limit
from cedserve.router.server import RunningRouter, public_server_options, start_router
from cedserve.router.text import StreamingText

VOCAB = 512


@dataclass
class Script:
    """How a fake worker behaves; tests edit it between requests."""

    fail_prefill: bool = False
    die_after_tokens: int | None = None
    token_delay_s: float = 0.0
    cached_hashes: list[bytes] = field(default_factory=list)
    bytes_sent: int = 0
    """What PrefillDone reports of the KV transfer (bytes, seconds)."""
    transfer_s: float = 0.0
    transfer_tail_s: float = 0.0
    queued_tokens: int = 0
    """What GetLoad reports: a prefill worker's uncomputed tokens, a decode worker's waiting requests."""
    queued_requests: int = 0
    preempted_requests: int = 0
    reserve_delay_s: float = 0.0
    """How long Reserve takes after leasing (a busy worker's reply arrives late)."""
    load_delay_s: float = 0.0
    """How long GetLoad takes (a busy worker's engine answers late)."""
    prefill_delay_s: float = 0.0
    """How long a prefill computes before its first token (a long prompt, a queue)."""
    refuse_reserves: int = 0
    """Reserves refused with RESOURCE_EXHAUSTED before the next one is granted (full since its last report)."""
    done_delay_s: float = 0.0
    """How long a prefill's `done` follows its first token (the KV transfer closing)."""
    fail_after_first: int = 0
    """Prefills whose KV transfer fails after their first token (the call ends UNAVAILABLE after
    `done_delay_s`), before the next one succeeds."""
    fail_transfers: int = 0
    """Decode calls whose KV transfer fails (an error event TRANSFER_FAILED before any token), before
    the next one decodes."""
    fail_renewals: int = 0
    """Renew calls failed with UNAVAILABLE before the next one is answered."""
    forget_leases: bool = False
    """Renew answers every lease lost (and the worker drops them: as after a restart)."""


class FakePrefill(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker_id: str) -> None:
        self.worker_id, self.script = worker_id, Script()
        self.requests: list[worker_pb2.PrefillRequest] = []
        self.cancelled: list[str] = []
        self.abandoned: list[str] = []
        """Requests whose Prefill call the router ended before the worker did."""

    async def Prefill(self, request: Any, context: Any) -> AsyncIterator[worker_pb2.PrefillEvent]:
        self.requests.append(request)
        if self.script.fail_prefill:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected prefill failure")
        await asyncio.sleep(self.script.prefill_delay_s)
        first = sum(request.token_ids) % 200 + 3
        yield worker_pb2.PrefillEvent(first_token=worker_pb2.FirstToken(token_id=first))
        try:
            await asyncio.sleep(self.script.done_delay_s)
        except asyncio.CancelledError:
            self.abandoned.append(request.request_id)
            raise
        if self.script.fail_after_first > 0:
            self.script.fail_after_first -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected KV transfer failure")
        yield worker_pb2.PrefillEvent(done=worker_pb2.PrefillDone(prompt_tokens=len(request.token_ids),
                                                                  bytes_sent=self.script.bytes_sent,
                                                                  transfer_s=self.script.transfer_s,
                                                                  transfer_tail_s=self.script.transfer_tail_s))

    async def Cancel(self, request: Any, context: Any) -> worker_pb2.CancelReply:
        self.cancelled.append(request.request_id)
        return worker_pb2.CancelReply(found=True)

    async def GetLoad(self, request: Any, context: Any) -> worker_pb2.LoadReport:
        return worker_pb2.LoadReport(worker_id=self.worker_id, role="prefill", prefill_tokens_per_s=1e4,
                                     free_blocks=100, total_blocks=100, queued_tokens=self.script.queued_tokens)

    async def StreamKVEvents(self, request: Any, context: Any) -> AsyncIterator[worker_pb2.KVEventBatch]:
        batch = KVEventBatch(self.worker_id, 0, [BlockStored(list(self.script.cached_hashes), Tier.DEVICE)], epoch=1)
        from cedserve.model.cache.events import AllBlocksCleared

        batch = KVEventBatch(self.worker_id, 0, [AllBlocksCleared(), *batch.events], epoch=1)
        yield worker_pb2.KVEventBatch(worker_id=self.worker_id, seq=0, events_msgpack=encode_batch(batch),
                                      snapshot=True)
        await asyncio.sleep(3600)


class FakeDecode(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker_id: str) -> None:
        self.worker_id, self.script = worker_id, Script()
        self.leases: dict[str, int] = {}
        self.lease_deadlines: dict[str, float] = {}
        """Monotonic deadline of each unattached lease (a Decode call for a lapsed one fails)."""
        self.renewed: list[str] = []
        self.cancelled: list[str] = []
        self.decodes: list[worker_pb2.DecodeRequest] = []
        self.reserves = 0
        self.total_blocks = 1000

    async def Reserve(self, request: Any, context: Any) -> worker_pb2.ReserveReply:
        self.reserves += 1
        if self.script.refuse_reserves > 0:
            self.script.refuse_reserves -= 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many requests queued")
        blocks = -(-request.prompt_tokens // 64)
        if sum(self.leases.values()) + blocks > self.total_blocks:  # as a real worker: no room, no lease
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "not enough free blocks")
        lease = f"{self.worker_id}-{request.request_id}-{len(self.leases)}"
        self.leases[lease] = blocks
        self.lease_deadlines[lease] = time.monotonic() + request.lease_ms / 1000
        await asyncio.sleep(self.script.reserve_delay_s)  # leased, but the reply is late
        return worker_pb2.ReserveReply(lease_id=lease, agent_name=f"agent-{self.worker_id}",
                                       block_ids=list(range(blocks)))

    async def Renew(self, request: Any, context: Any) -> worker_pb2.RenewReply:
        if self.script.fail_renewals > 0:
            self.script.fail_renewals -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected renewal failure")
        if self.script.forget_leases:
            self.lease_deadlines.clear()
        lost = []
        for ref in request.leases:
            self.renewed.append(ref.lease_id)
            if ref.lease_id in self.lease_deadlines:
                self.lease_deadlines[ref.lease_id] = max(self.lease_deadlines[ref.lease_id],
                                                         time.monotonic() + request.lease_ms / 1000)
            else:
                lost.append(ref.lease_id)
        return worker_pb2.RenewReply(lost_lease_ids=lost)

    async def Decode(self, request: Any, context: Any) -> AsyncIterator[worker_pb2.DecodeEvent]:
        self.decodes.append(request)
        if self.lease_deadlines.pop(request.lease_id, 0.0) < time.monotonic():
            self.leases.pop(request.lease_id, None)
            await context.abort(grpc.StatusCode.NOT_FOUND, f"lease {request.lease_id} expired before its Decode call")
        self.lease_deadlines[request.lease_id] = float("inf")  # taken: renewals find it, it no longer expires
        if self.script.fail_transfers > 0:
            self.script.fail_transfers -= 1
            self.leases.pop(request.lease_id, None)
            yield worker_pb2.DecodeEvent(error=worker_pb2.ErrorDetail(
                code=worker_pb2.ERROR_CODE_TRANSFER_FAILED, request_id=request.request_id, message="injected"))
            return
        token = request.first_token
        sent = 0
        try:
            for _ in range(request.sampling.max_tokens):  # what it emits (after a first token from prefill)
                token = (token * 7 + 11) % 200 + 3
                if self.script.die_after_tokens is not None and sent >= self.script.die_after_tokens:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "injected decode worker death")
                await asyncio.sleep(self.script.token_delay_s)
                yield worker_pb2.DecodeEvent(tokens=worker_pb2.TokenChunk(token_ids=[token]))
                sent += 1
            yield worker_pb2.DecodeEvent(complete=worker_pb2.DecodeComplete(finish_reason="length",
                                                                            output_tokens=sent))
        finally:
            self.leases.pop(request.lease_id, None)
            self.lease_deadlines.pop(request.lease_id, None)

    async def Cancel(self, request: Any, context: Any) -> worker_pb2.CancelReply:
        self.cancelled.append(request.request_id)
        found = self.leases.pop(request.lease_id, None) is not None
        return worker_pb2.CancelReply(found=found)

    async def GetLoad(self, request: Any, context: Any) -> worker_pb2.LoadReport:
        await asyncio.sleep(self.script.load_delay_s)
        used = sum(self.leases.values())
        return worker_pb2.LoadReport(worker_id=self.worker_id, role="decode", free_blocks=self.total_blocks - used,
                                     total_blocks=self.total_blocks, step_s=[0.01, 0.01, 0.011],
                                     prefill_tokens_per_s=1e3, queued_requests=self.script.queued_requests,
                                     preempted_requests=self.script.preempted_requests)

    async def StreamKVEvents(self, request: Any, context: Any) -> AsyncIterator[worker_pb2.KVEventBatch]:
        await asyncio.sleep(3600)
        yield worker_pb2.KVEventBatch()


class Cluster:
    """Fakes plus a real router, all on one event loop in a background thread."""

    def __init__(self, checkpoint: Path, **router_kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.prefill = [FakePrefill("p0"), FakePrefill("p1")]
        self.decode = [FakeDecode("d0"), FakeDecode("d1")]
        self.servers: list[grpc.aio.Server] = []
        self.healths: dict[str, health.HealthServicer] = {}
        endpoints = self.call(self._start_workers())
        config = RouterConfig(checkpoint=str(checkpoint), prefill=endpoints[:2], decode=endpoints[2:],
                              **{"load_poll_s": 0.05, **router_kwargs})
        self.router: RunningRouter = self.call(start_router(config))
        self.call(self.router.pool.wait_ready(10))
        self.address = f"127.0.0.1:{self.router.port}"

    def call(self, coro: Any) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(30)

    async def _start_workers(self) -> tuple[WorkerEndpoint, ...]:
        out = []
        for servicer in (*self.prefill, *self.decode):
            server = grpc.aio.server()
            if isinstance(servicer, FakePrefill):
                worker_pb2_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
            else:
                worker_pb2_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
            health_pb2_grpc.add_HealthServicer_to_server(self.health(servicer.worker_id), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self.servers.append(server)
            out.append(WorkerEndpoint(servicer.worker_id, f"127.0.0.1:{port}"))
        return tuple(out)

    def health(self, worker_id: str) -> health.HealthServicer:
        """The worker's `grpc.health.v1` service, its "liveness" SERVING (as a running worker's)."""
        servicer = self.healths[worker_id] = health.HealthServicer(experimental_non_blocking=True)
        servicer.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        return servicer

    def close(self) -> None:
        self.call(self.router.stop(0.5))
        for server in self.servers:
            self.call(server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("router_ckpt")
    (folder / "config.json").write_text(json.dumps(preset("tiny").to_hf_dict()))
    shutil.copyfile(tiny_tokenizer_path(), folder / "tokenizer.json")
    return folder


@pytest.fixture()
def cluster(checkpoint: Path) -> Iterator[Cluster]:
    c = Cluster(checkpoint, api_keys=("sekrit",), limits={"high": ClassLimits(max_running=1, max_queued=0)})
    yield c
    c.close()


def _client(cluster: Cluster, key: str | None = "sekrit", timeout_s: float | None = 20) -> Client:
    return Client(cluster.address, api_key=key, timeout_s=timeout_s)


def _expected(prompt_ids: list[int], n: int) -> list[int]:
    token = sum(prompt_ids) % 200 + 3
    out = [token]
    while len(out) < n:
        token = (token * 7 + 11) % 200 + 3
        out.append(token)
    return out


def test_streaming_generate_follows_the_handshake(cluster: Cluster) -> None:
    codec = TextCodec.from_file(tiny_tokenizer_path(), VOCAB)
    with _client(cluster) as client:
        pieces = list(client.stream([5, 6, 7, 8], max_tokens=6, effort="low"))
        done = client.last
    assert done is not None and done.finish_reason == "length"
    assert done.token_ids == _expected([5, 6, 7, 8], 6)
    assert [t for p in pieces for t in p.token_ids] == done.token_ids
    assert done.text == codec.decode(done.token_ids)
    assert done.usage["prompt_tokens"] == 4 and done.usage["completion_tokens"] == 6
    # Decode-first: the prefill request carried the decode worker's lease and blocks.
    pre = [r for p in cluster.prefill for r in p.requests][-1]
    assert pre.target.lease_id and pre.target.agent_name.startswith("agent-")
    assert all(not d.leases for d in cluster.decode)  # every lease ended


def _held_back_at_end(codec: TextCodec, n: int) -> list[int]:
    """A one-token prompt whose `n` fake tokens end on text the streaming detokenizer holds back (an
    incomplete character): found by `StreamingText` itself, so the case does not rest on guessed ids."""
    for first in range(3, 203):
        text = StreamingText(codec, ())
        for t in _expected([first], n):
            text.push([t])
        if text.finish():
            return [first]
    raise AssertionError(f"no {n}-token output of the fake ends on a held-back character")


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_the_last_chunk_carries_the_held_back_text_and_the_lease_ends_first(cluster: Cluster,
                                                                          max_tokens: int) -> None:
    """Where the router's own verdict (here the budget) ends the request, the text held back for an
    incomplete character goes in the last token's chunk, not in a text-only chunk after it; a request
    whose budget is its first token leases nothing on a decode worker (no Decode call either)."""
    codec = TextCodec.from_file(tiny_tokenizer_path(), VOCAB)
    prompt = _held_back_at_end(codec, max_tokens)
    with _client(cluster) as client:
        pieces = list(client.stream(prompt, max_tokens=max_tokens))
        done = client.last
    assert done is not None and done.finish_reason == "length"
    assert done.token_ids == _expected(prompt, max_tokens)
    assert all(p.token_ids for p in pieces)  # no text-only tail chunk
    assert done.text == "".join(p.text for p in pieces) == codec.decode(done.token_ids)
    assert all(not d.leases for d in cluster.decode)
    if max_tokens == 1:
        assert not [r for d in cluster.decode for r in d.decodes if r.request_id == done.request_id]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 2, 512]}, "prompt.token_ids[2]"),
    ({"prompt": "hi", "effort": 0}, "effort"),
    ({"prompt": "hi", "effort": 101}, "effort"),
    ({"prompt": "hi", "model": "gpt-7"}, "model"),
    ({"prompt": "hi", "temperature": -1.0}, "sampling.temperature"),
    ({"prompt": [{"role": "robot", "content": "x"}]}, "prompt.chat.messages"),
])
def test_bad_input_names_the_field(cluster: Cluster, kwargs: dict[str, Any], field: str) -> None:
    prompt = kwargs.pop("prompt")
    with _client(cluster) as client, pytest.raises(CedserveError) as info:
        client.generate(prompt, **kwargs)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.field == field
    assert all(not d.leases for d in cluster.decode) and not any(p.requests for p in cluster.prefill)


def test_authentication_and_oversized_messages(cluster: Cluster) -> None:
    with _client(cluster, key=None) as client, pytest.raises(CedserveError) as info:
        client.generate("hi", max_tokens=2)
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    with _client(cluster, key="wrong") as client, pytest.raises(CedserveError) as info:
        client.generate("hi", max_tokens=2)
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    with _client(cluster) as client, pytest.raises(CedserveError) as info:
        client.generate("x" * (17 << 20), max_tokens=2)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_failed_prefill_is_retried_elsewhere(cluster: Cluster) -> None:
    cluster.prefill[0].script.fail_prefill = True
    cluster.prefill[1].script.fail_prefill = False
    with _client(cluster) as client:
        for _ in range(3):  # whichever worker the policy picks first, the request succeeds
            done = client.generate([9, 9, 9], max_tokens=3)
            assert done.token_ids == _expected([9, 9, 9], 3)
    assert all(not d.leases for d in cluster.decode)
    cluster.prefill[1].script.fail_prefill = True
    # A short prompt still completes: with every prefill worker failing, the decode worker prefills it.
    with _client(cluster) as client:
        assert len(client.generate([9, 9, 9], max_tokens=3).token_ids) == 3
    assert [r.prefill_locally for d in cluster.decode for r in d.decodes][-1]
    # A long one cannot: the last prefill worker is tried again after a pause (it is the only one
    # left), then a clean UNAVAILABLE naming the failed workers.
    with _client(cluster) as client, pytest.raises(CedserveError) as info:
        client.generate([9] * 300, max_tokens=3)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "p0" in info.value.message and "p1" in info.value.message
    assert all(not d.leases for d in cluster.decode)


def test_a_one_token_request_is_a_prefill_alone(cluster: Cluster) -> None:
    """A budget of one token is the prefill's first token: no Reserve before the prefill, no target in
    it (no KV sent), no Decode and no Cancel after it; a prefill worker failing before its first
    token is still retried on the other one."""
    reserves = sum(d.reserves for d in cluster.decode)
    with _client(cluster) as client:
        done = client.generate([9, 8, 7], max_tokens=1)
        assert cluster.router.metrics.registry.get_sample_value(
            "cedserve_router_placements_total", {"policy": "cache_aware", "kind": "prefill_only"}) == 1
        cluster.prefill[0].script.fail_prefill = True
        retried = [client.generate([9, 8, 6], max_tokens=1) for _ in range(2)]  # whichever worker comes first
    assert done.finish_reason == "length" and done.token_ids == _expected([9, 8, 7], 1)
    assert done.usage["completion_tokens"] == 1 and done.usage["kv_transfer_bytes"] == 0
    assert all(r.token_ids == _expected([9, 8, 6], 1) for r in retried)
    ours = {done.request_id, *(r.request_id for r in retried)}
    prefills = [r for p in cluster.prefill for r in p.requests if r.request_id in ours]
    assert prefills and not any(r.HasField("target") for r in prefills)
    assert sum(d.reserves for d in cluster.decode) == reserves
    assert not [r for d in cluster.decode for r in d.decodes if r.request_id in ours]
    assert not [c for d in cluster.decode for c in d.cancelled if c in ours]
    # The unused lease of a request that a first token ends before its budget (a stop token) still
    # goes before the stream ends.
    with _client(cluster) as client:
        stopped = client.generate([9, 8, 7], max_tokens=4, stop_token_ids=done.token_ids)
    assert stopped.finish_reason == "stop" and stopped.token_ids == done.token_ids
    assert stopped.request_id in [c for d in cluster.decode for c in d.cancelled]
    assert all(not d.leases for d in cluster.decode)


def test_a_one_token_request_ends_at_its_token_and_its_prefill_within_a_second(cluster: Cluster) -> None:
    """The answer does not wait for the prefill's `done`; a `done` that does not come within a second
    (`_PREFILL_VERDICT_S`) has the router end the call (the request may carry no deadline)."""
    for p in cluster.prefill:
        p.script.done_delay_s = 3.0
    with Client(cluster.address, api_key="sekrit") as client:  # no deadline: the call has no timeout
        start = time.monotonic()
        done = client.generate([2, 7, 1], max_tokens=1)
        took_s = time.monotonic() - start
    assert took_s < 1.0 and done.token_ids == _expected([2, 7, 1], 1)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(done.request_id in p.abandoned for p in cluster.prefill):
        time.sleep(0.05)
    assert any(done.request_id in p.abandoned for p in cluster.prefill)
    assert time.monotonic() - start < 2.5  # ended by the router, not by the worker's `done` at 3 s


def test_a_one_token_request_cancelled_before_its_token_cancels_its_prefill(cluster: Cluster) -> None:
    for p in cluster.prefill:
        p.script.prefill_delay_s = 0.3
    with _client(cluster, timeout_s=0.1) as client, pytest.raises(CedserveError) as info:
        client.generate([3, 1, 4], max_tokens=1)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(p.cancelled for p in cluster.prefill):
        time.sleep(0.05)
    assert [c for p in cluster.prefill for c in p.cancelled]
    assert all(not d.leases for d in cluster.decode)


def test_decode_worker_death_migrates_the_request(cluster: Cluster) -> None:
    for d in cluster.decode:
        d.script.die_after_tokens = None
    cluster.decode[0].script.die_after_tokens = 2
    cluster.decode[1].script.die_after_tokens = 2
    with _client(cluster) as client:
        done = client.generate([4, 4], max_tokens=5)
    # Streamed tokens are kept; the continuation is prefilled from prompt + output on the other worker.
    assert len(done.token_ids) == 5 and done.token_ids[0] == _expected([4, 4], 1)[0]
    migrated = [r for d in cluster.decode for r in d.decodes if len(r.token_ids) > 2]
    assert migrated and list(migrated[0].token_ids[:2]) == [4, 4]
    assert all(not d.leases for d in cluster.decode)


def test_cancellation_reaches_the_workers(cluster: Cluster) -> None:
    for d in cluster.decode:
        d.script.token_delay_s = 0.05
    with _client(cluster) as client:
        stream = client.stream([1, 2, 3], max_tokens=200)
        next(stream)
        next(stream)
        stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not any(d.cancelled for d in cluster.decode):
        time.sleep(0.05)
    assert any(d.cancelled for d in cluster.decode)
    assert all(not d.leases for d in cluster.decode)


def test_deadline_exceeded(cluster: Cluster) -> None:
    for d in cluster.decode:
        d.script.token_delay_s = 0.2
    with _client(cluster, timeout_s=0.5) as client, pytest.raises(CedserveError) as info:
        client.generate([1, 2, 3], max_tokens=100)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(0.5)
    assert all(not d.leases for d in cluster.decode)


def test_admission_limit_gives_retry_hint(cluster: Cluster) -> None:
    for d in cluster.decode:
        d.script.token_delay_s = 0.1
    with _client(cluster) as slow:
        stream = slow.stream([1, 2, 3], max_tokens=50, effort="high")
        next(stream)
        with _client(cluster) as client, pytest.raises(CedserveError) as info:
            client.generate([1, 2, 3], max_tokens=2, effort="high")
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.retry_after_s > 0
        with _client(cluster) as client:  # another effort class is not affected
            assert len(client.generate([1, 2, 3], max_tokens=2, effort="low").token_ids) == 2
        stream.close()


def test_prefix_credit_steers_placement(checkpoint: Path) -> None:
    tokens = list(range(3, 3 + 64 * 4))
    hashes = hash_blocks(tokens, "", 64)
    c = Cluster(checkpoint)
    try:
        c.prefill[1].script.cached_hashes = hashes  # p1 holds the prompt's four blocks
        c.call(c.router.pool.stop_tasks())

        async def restart() -> None:  # reconnect the event streams so the new snapshot is read
            c.router.pool.start()
            await c.router.pool.wait_ready(10)

        c.call(restart())
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and c.router.pool.index.longest_prefix("p1", hashes).total_blocks < 4:
            time.sleep(0.05)
        with Client(c.address, timeout_s=20) as client:
            client.generate(tokens, max_tokens=2)
        assert c.prefill[1].requests and not c.prefill[0].requests
    finally:
        c.close()


def test_completed_transfers_teach_the_pair_link_rate(cluster: Cluster) -> None:
    links = cluster.router.links
    assert links is not None and links.rate("p0", "d0") == links.default_bytes_per_s  # unmeasured
    for p in cluster.prefill:
        p.script.bytes_sent, p.script.transfer_s = 3_000_000_000, 1.5  # 2 GB/s
    with _client(cluster) as client:
        client.generate(list(range(3, 3 + 300)), max_tokens=2, effort="low")  # past decode-only: a transfer
    pre = next(p for p in cluster.prefill if p.requests)
    pair = (pre.worker_id, pre.requests[-1].target.worker_id)
    assert links.rate(*pair) == pytest.approx(2e9)
    others = [(p, d) for p in ("p0", "p1") for d in ("d0", "d1") if (p, d) != pair]
    assert all(links.rate(p, d) == links.default_bytes_per_s for p, d in others)


def test_stop_strings_end_the_stream(cluster: Cluster) -> None:
    codec = TextCodec.from_file(tiny_tokenizer_path(), VOCAB)
    full = _expected([7, 7], 8)
    text = codec.decode(full)
    stop = text[len(codec.decode(full[:3])):][:2] or text[-1]
    with _client(cluster) as client:
        done = client.generate([7, 7], max_tokens=8, stop=[stop])
    assert done.finish_reason == "stop" and stop not in done.text and text.startswith(done.text)


def test_tls_public_port_and_plaintext_health_listener(checkpoint: Path, tls_files: TLSFiles) -> None:
    import socket

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with socket.socket() as s:  # a free port for the health listener (the router binds it itself)
        s.bind(("127.0.0.1", 0))
        health_port = s.getsockname()[1]
    server_tls = TLSConfig(cert=tls_files.server_cert, key=tls_files.server_key)
    c = Cluster(checkpoint, tls=server_tls, health_port=health_port, http_port=0)
    try:
        with Client(c.address, timeout_s=20, tls=TLSConfig(ca=tls_files.ca)) as client:
            assert len(client.generate([5, 6, 7], max_tokens=3).token_ids) == 3
        _https_api_serves_with_the_same_certificate(c.router.http_port, tls_files)
        with Client(c.address, timeout_s=5) as client, pytest.raises(CedserveError) as info:
            client.generate([5, 6, 7], max_tokens=3)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE  # plaintext to a TLS port
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with Client(f"127.0.0.1:{health_port}", timeout_s=5) as client, pytest.raises(CedserveError) as info:
                client.generate([5, 6, 7], max_tokens=3)
            assert info.value.code == grpc.StatusCode.UNIMPLEMENTED  # the API is never served in plaintext
    finally:
        c.close()


def _https_api_serves_with_the_same_certificate(port: int, tls_files: TLSFiles) -> None:
    """The HTTP API on a TLS router serves HTTPS with the public port's certificate, and nothing in plaintext."""
    import ssl
    import urllib.error
    import urllib.request

    trusted = ssl.create_default_context(cafile=tls_files.ca)
    body = json.dumps({"model": "cedserve", "prompt": [5, 6, 7], "max_tokens": 3}).encode()
    request = urllib.request.Request(f"https://127.0.0.1:{port}/v1/completions", body,
                                     {"content-type": "application/json"})
    answer = json.loads(urllib.request.urlopen(request, timeout=20, context=trusted).read())
    assert answer["usage"]["completion_tokens"] == 3
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)


def test_autoscaler_metrics_sum_the_healthy_workers_queues(cluster: Cluster) -> None:
    """The gauges the Helm chart's HPAs scale on, read as a scrape reads them."""
    cluster.prefill[0].script.queued_tokens, cluster.prefill[1].script.queued_tokens = 3000, 1000
    cluster.decode[0].script.queued_requests, cluster.decode[1].script.preempted_requests = 2, 3
    registry = cluster.router.metrics.registry
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the next load poll brings the new figures
        prefill = registry.get_sample_value("cedserve_router_queue_prefill_tokens")
        decode = registry.get_sample_value("cedserve_router_queue_decode_requests")
        if (prefill, decode) == (4000, 5):
            break
        time.sleep(0.05)
    assert (prefill, decode) == (4000, 5)


def test_a_busy_worker_is_not_a_dead_one(cluster: Cluster) -> None:
    """Load polls that time out (GetLoad takes 1.5 s against the router's 1 s deadline) while the
    worker's liveness check answers: the worker stays in placement and serves; once its liveness
    check fails too, it is taken out after three such polls."""
    d0 = cluster.decode[0]
    cluster.decode[1].script.load_delay_s = d0.script.load_delay_s = 1.5
    try:
        time.sleep(5.0)  # three polls' worth of timeouts
        handles = cluster.router.pool.workers
        assert handles["d0"].late_polls >= 3 and handles["d0"].missed_polls == 0
        assert handles["d0"].healthy and handles["d1"].healthy
        with _client(cluster) as client:
            assert len(client.generate([5, 6, 7], max_tokens=3).token_ids) == 3
        cluster.healths["d0"].set("liveness", health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + 15
        while handles["d0"].healthy and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not handles["d0"].healthy and handles["d1"].healthy
    finally:
        for worker in cluster.decode:
            worker.script.load_delay_s = 0.0


def test_a_dead_worker_is_out_of_placement_at_once(checkpoint: Path) -> None:
    """A worker whose server is gone (kill -9) is taken out when its KV event stream breaks and a
    poll and health check are refused, not after three load polls: here within 3 s where three polls
    at 2 s need 4-6 s. The other decode worker serves meanwhile."""
    cluster = Cluster(checkpoint, load_poll_s=2.0)
    try:
        handles = cluster.router.pool.workers
        assert handles["d0"].healthy
        time.sleep(0.5)  # the KV event streams are open
        killed = time.monotonic()
        cluster.call(cluster.servers[2].stop(0))  # d0's server: its connections drop at once
        while handles["d0"].healthy and time.monotonic() - killed < 10:
            time.sleep(0.02)
        assert not handles["d0"].healthy and time.monotonic() - killed < 3.0
        assert handles["d1"].healthy
        with _client(cluster) as client:
            assert len(client.generate([5, 6, 7], max_tokens=3).token_ids) == 3
    finally:
        cluster.close()


def test_undecodable_request_bytes_are_invalid_argument(cluster: Cluster) -> None:
    """Bytes that are not the method's message end the call with INVALID_ARGUMENT naming the method
    (gRPC's own answer is UNKNOWN with a Python exception class), streaming and unary alike."""
    metadata = (("x-api-key", "sekrit"),)
    with grpc.insecure_channel(cluster.address) as channel:
        for method, call in (("Generate", channel.unary_stream), ("CountTokens", channel.unary_unary)):
            rpc = call(f"/cedserve.v1.Generation/{method}", request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as info:
                result = rpc(b"\xff\xff\xff\xff", metadata=metadata, timeout=10)
                list(result) if method == "Generate" else result
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
            assert f"not a valid {method} request" in info.value.details()


def test_a_client_gone_during_reserve_frees_the_lease_at_once(cluster: Cluster) -> None:
    """The client's deadline passes while the decode worker's Reserve reply is late (the worker has
    leased blocks): the router cancels the request by id on that worker at once, so the blocks do
    not wait for the lease to expire."""
    for worker in cluster.decode:
        worker.script.reserve_delay_s = 3.0
    try:
        with Client(cluster.address, api_key="sekrit", timeout_s=0.5) as client, pytest.raises(CedserveError):
            client.generate([5, 6, 7], max_tokens=3, request_id="gone-early")
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline and not any("gone-early" in w.cancelled for w in cluster.decode):
            time.sleep(0.05)
        assert any("gone-early" in w.cancelled for w in cluster.decode)
    finally:
        for worker in cluster.decode:
            worker.script.reserve_delay_s = 0.0


def test_a_request_bigger_than_the_context_can_use_is_refused_unread(cluster: Cluster) -> None:
    """A 2 MB prompt against the tiny checkpoint's context, sent as it is: gRPC refuses it from its
    length prefix (RESOURCE_EXHAUSTED, `router.requests.message_limit`), before the router reads or
    parses it; the router keeps serving."""
    with Client(cluster.address, api_key="sekrit", timeout_s=20, check_limits=False) as client:
        with pytest.raises(CedserveError) as info:
            client.generate("ab" * 1_000_000, max_tokens=2)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in info.value.message
        assert len(client.generate([5, 6, 7], max_tokens=3).token_ids) == 3


def _answer(client: Client, prompt: Any, **kwargs: Any) -> tuple[str, str, str]:
    """(status, message, field) of a call: "OK" or the error's."""
    try:
        client.generate(prompt, max_tokens=2, **kwargs)
    except CedserveError as exc:
        return exc.code.name, exc.message, exc.field
    return "OK", "", ""


class _CountingStub:
    """The client's stub, counting the `Generate` and `ListModels` calls that go to the router."""

    def __init__(self, stub: Any) -> None:
        self.stub, self.generate_calls, self.list_calls = stub, 0, 0

    def Generate(self, *args: Any, **kwargs: Any) -> Any:
        self.generate_calls += 1
        return self.stub.Generate(*args, **kwargs)

    def ListModels(self, *args: Any, **kwargs: Any) -> Any:
        self.list_calls += 1
        return self.stub.ListModels(*args, **kwargs)


def _text_of_message_bytes(size: int) -> str:
    """A text prompt whose `GenerateRequest` (max_tokens=2) serializes to exactly `size` bytes."""
    n = size
    while len(build_request("x" * n, max_tokens=2).SerializeToString()) > size:
        n -= 1
    assert len(build_request("x" * n, max_tokens=2).SerializeToString()) == size
    return "x" * n


def test_the_client_refuses_what_the_router_would_in_the_routers_words(cluster: Cluster) -> None:
    """Prompts at and around each size the router bounds: the client, its limits read from the router's
    model card, answers each with the router's own status, message and field (the router's answer: the
    same prompt sent unchecked), and sends none of those it refuses."""
    limits = request_limits(4096, 16 << 20)  # the tiny checkpoint's context, the default max_message_bytes
    over_ids = 65_536  # the fewest ids the client checks, all over the 4,096-token context
    cases: list[tuple[Any, dict[str, Any], bool]] = [  # (prompt, kwargs, refused by the client)
        (_text_of_message_bytes(limits.max_request_bytes), {}, True),  # read whole; too long a text
        (_text_of_message_bytes(limits.max_request_bytes + 1), {}, True),  # refused unread
        ("x" * 15_000_000, {}, True),
        ("x" * limits.max_prompt_bytes, {}, False),  # tokenized: the router decides by its tokens
        ("x" * (limits.max_prompt_bytes + 1), {}, True),
        ("é" * 66_000, {}, True),  # 132,000 UTF-8 bytes: unread
        ([{"role": "user", "content": "x" * (limits.max_prompt_bytes + 1)}], {}, True),
        ([5] * over_ids, {}, True),  # 1 byte an id: read, too many ids
        ([300] * over_ids, {}, True),  # 2 bytes an id: unread
        ("x" * 70_000, {"request_id": "r" * 257}, True),  # ids are checked before the prompt
    ]
    with _client(cluster) as client, Client(cluster.address, api_key="sekrit", timeout_s=20,
                                            check_limits=False) as unchecked:
        counting = _CountingStub(client.stub)
        client.stub = counting  # type: ignore[assignment]
        assert client.request_limits() == limits
        for prompt, kwargs, refused_here in cases:
            sent = counting.generate_calls
            router = _answer(unchecked, prompt, **kwargs)
            assert router[0] != "OK"
            assert _answer(client, prompt, **kwargs) == router, (str(prompt)[:40], kwargs)
            assert counting.generate_calls == sent + (not refused_here)
        assert counting.list_calls == 1  # read once, kept


def test_the_client_reads_the_limits_again_once_they_may_have_changed(cluster: Cluster,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The limits are read once and kept `LIMITS_TTL_S`; read again after it, they are the router's
    current ones (here its card changed under the client, as a restarted router's might). A router that
    publishes none (an older one) gets every request as it is, and refuses it itself."""
    core = cluster.router.core
    assert core is not None
    with _client(cluster) as client:
        first = client.request_limits()
        assert first is not None and first.max_request_bytes == core.max_request_bytes
        core.max_request_bytes = 100_000
        assert client.request_limits() == first  # kept
        monkeypatch.setattr("cedserve.client.LIMITS_TTL_S", 0.0)
        size = build_request("x" * 100_000, max_tokens=2).ByteSize()
        assert _answer(client, "x" * 100_000)[1].startswith(
            f"SERVER: Received message larger than max ({size} vs. 100000) bytes:")
        core.max_request_bytes = 0
        assert client.request_limits() is None
        status, message, _ = _answer(client, "x" * 150_000)
        assert status == "RESOURCE_EXHAUSTED" and f"vs. {first.max_request_bytes})" in message  # the router's


def test_three_concurrent_huge_prompts_on_one_async_client_read_the_limits_once(cluster: Cluster) -> None:
    """Three 15 MB prompts at once on one `AsyncClient`: each refused with the router's words, after
    one read of its limits shared by the three."""
    with Client(cluster.address, api_key="sekrit", timeout_s=20, check_limits=False) as unchecked:
        router = _answer(unchecked, "x" * 15_000_000)

    async def three() -> tuple[list[BaseException | Completion], int]:
        client = AsyncClient(cluster.address, api_key="sekrit", timeout_s=20)
        counting = _CountingStub(client.stub)
        client.stub = counting  # type: ignore[assignment]
        try:
            results = await asyncio.gather(*(client.generate("x" * 15_000_000, max_tokens=2) for _ in range(3)),
                                           return_exceptions=True)
        finally:
            await client.close()
        assert counting.generate_calls == 0
        return results, counting.list_calls

    results, reads = asyncio.run(three())
    assert reads == 1
    assert [(r.code.name, r.message, r.field) for r in results if isinstance(r, CedserveError)] == [router] * 3


def test_the_router_refuses_a_message_from_its_length_prefix_alone(cluster: Cluster) -> None:
    """A raw HTTP/2 call that sends only the 5-byte length prefix of a 15 MB message and 16 KB of it,
    then nothing more: the router ends the stream with RESOURCE_EXHAUSTED (8) in its trailers. A
    router that waited for the message whole would never answer (the probe gives up after 10 s)."""
    refusal = refusal_time(cluster.address, declared_bytes=15_000_000, metadata=(("authorization", "Bearer sekrit"),))
    assert refusal is not None and refusal.frame == "trailers" and refusal.status == 8


def test_the_receive_limit_follows_max_message_bytes(checkpoint: Path) -> None:
    """`max_message_bytes` below what the context can use is the limit: a 10 KB message is refused by
    gRPC with RESOURCE_EXHAUSTED naming both sizes (the client adds which setting that is), a 4 KB one
    (2,000 token ids) is served."""
    c = Cluster(checkpoint, max_message_bytes=8192)
    try:
        with Client(c.address, timeout_s=20) as client:
            with pytest.raises(CedserveError) as info:
                client.generate("ab" * 5000, max_tokens=2)
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "vs. 8192)" in info.value.message and "max_message_bytes" in info.value.message
            prompt = [3 + k % 190 for k in range(2000)]
            assert client.generate(prompt, max_tokens=3).token_ids == _expected(prompt, 3)
    finally:
        c.close()


@pytest.mark.parametrize("tarpit", [False, True])
def test_the_public_server_options_carry_the_limit_and_the_tarpit_setting(checkpoint: Path, tarpit: bool) -> None:
    """gRPC's tarpit (a 100-1000 ms hold on the refusals it makes itself) is off unless asked for;
    the receive limit is `max_message_bytes`, capped by what the model's context can use."""
    limits = ModelLimits("m", vocab_size=512, max_context_tokens=4096, block_size=64, default_max_tokens=0)
    small = RouterConfig(checkpoint=str(checkpoint), max_message_bytes=1000, grpc_tarpit=tarpit)
    assert dict(public_server_options(small, limits)) == {"grpc.max_receive_message_length": 1000,
                                                          "grpc.http.tarpit": int(tarpit)}
    default = RouterConfig(checkpoint=str(checkpoint))
    assert dict(public_server_options(default, limits))["grpc.max_receive_message_length"] == message_limit(
        limits, default.max_message_bytes) < default.max_message_bytes
    assert dict(public_server_options(default, limits))["grpc.http.tarpit"] == 0


def test_a_first_token_that_is_one_of_the_models_eos_ids_ends_the_request(tmp_path: Path) -> None:
    """The checkpoint's `eos_token_id` may list several ids: prefill's first token ends the request
    on any of them (the router once knew only the tokenizer's `<|eos|>`)."""
    (tmp_path / "config.json").write_text(json.dumps({**preset("tiny").to_hf_dict(), "eos_token_id": [2, 50]}))
    shutil.copyfile(tiny_tokenizer_path(), tmp_path / "tokenizer.json")
    c = Cluster(tmp_path)
    try:
        with Client(c.address, timeout_s=20) as client:
            done = client.generate([47], max_tokens=8)  # the fake prefill's first token: 47 % 200 + 3 = 50
            assert done.finish_reason == "stop" and done.token_ids == [50]
            other = client.generate([48], max_tokens=3)  # 51: not an end
            assert other.finish_reason == "length" and other.token_ids == _expected([48], 3)
    finally:
        c.close()


def test_a_slow_prefill_keeps_its_lease_alive(checkpoint: Path) -> None:
    """A 300 ms lease and a prefill that takes 1.2 s: the router renews the lease while it waits
    (four periods), the Decode call finds it, and renewals stop once the request ends."""
    cluster = Cluster(checkpoint, lease_ms=300)
    try:
        for p in cluster.prefill:
            p.script.prefill_delay_s = 1.2
        with _client(cluster) as client:
            out = client.generate(list(range(3, 200)), max_tokens=3)
        assert out.token_ids == _expected(list(range(3, 200)), 3)
        renewed = [lease for d in cluster.decode for lease in d.renewed]
        assert len(renewed) >= 8 and len(set(renewed)) == 1  # one lease, renewed every 75 ms
        time.sleep(0.3)
        assert len([lease for d in cluster.decode for lease in d.renewed]) == len(renewed)
        assert core(cluster).leases.num_open() == 0
    finally:
        cluster.close()


def test_without_renewals_the_same_prefill_loses_its_lease(checkpoint: Path) -> None:
    """The check above can fail: a lease nobody renews lapses under the same slow prefill."""
    cluster = Cluster(checkpoint, lease_ms=300, max_retries=0)
    try:
        for p in cluster.prefill:
            p.script.prefill_delay_s = 1.2
        core(cluster).leases.interval_s = 60.0  # a router that never renews
        with _client(cluster) as client, pytest.raises(CedserveError) as info:
            client.generate(list(range(3, 200)), max_tokens=3)
        assert info.value.code == grpc.StatusCode.NOT_FOUND
    finally:
        cluster.close()


def core(cluster: Cluster) -> GenerationCore:
    assert cluster.router.core is not None
    return cluster.router.core


def test_a_full_decode_worker_makes_the_request_wait_not_fail(checkpoint: Path) -> None:
    """Every decode worker refuses its next Reserves (RESOURCE_EXHAUSTED: full since its last load
    report): the request waits for the next report and is placed then, instead of being retried
    elsewhere until no worker is left and refused with UNAVAILABLE."""
    cluster = Cluster(checkpoint)
    try:
        for d in cluster.decode:
            d.script.refuse_reserves = 2
        with _client(cluster) as client:
            out = client.generate(list(range(3, 200)), max_tokens=3)
        assert out.token_ids == _expected(list(range(3, 200)), 3)
        assert sum(d.reserves for d in cluster.decode) >= 3  # two refused, then granted
    finally:
        cluster.close()


def test_a_request_waits_for_blocks_to_free_up(checkpoint: Path) -> None:
    """Placement finds no decode worker with room (one is full of a slow request, the other has no
    blocks): the second request waits in its class's FIFO, is placed once the load report shows the
    first one's blocks back, and completes; one that could never fit is refused at once."""
    cluster = Cluster(checkpoint)
    try:
        cluster.decode[0].total_blocks, cluster.decode[1].total_blocks = 4, 0
        cluster.decode[0].script.token_delay_s = 0.1
        prompt = list(range(3, 200))  # 4 blocks of 64
        with _client(cluster) as first, _client(cluster) as second:
            stream = first.stream(prompt, max_tokens=8, effort="low")
            next(stream)
            time.sleep(0.3)  # the full worker's load report is in
            assert cluster.call(_free_blocks(cluster, "d0")) == 0
            start = time.monotonic()
            waiter: Future[Any] = Future()
            threading.Thread(target=lambda: waiter.set_result(second.generate(prompt, max_tokens=2, effort="low")),
                             daemon=True).start()
            time.sleep(0.2)
            assert core(cluster).capacity.waiting("low") == 1
            assert len(list(stream)) >= 1  # the first request finishes and frees its blocks
            out = waiter.result(10)
            assert out.token_ids == _expected(prompt, 2) and time.monotonic() - start > 0.3
            with pytest.raises(CedserveError) as info:
                second.generate(list(range(3, 400)), max_tokens=2, effort="low")  # 7 blocks: never fits
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.retry_after_s > 0
        assert core(cluster).capacity.waiting("low") == 0
    finally:
        cluster.close()


async def _free_blocks(cluster: Cluster, worker_id: str) -> int:
    load = cluster.router.pool.workers[worker_id].load
    assert load is not None
    return int(load.free_blocks)


def test_a_waiting_request_is_placed_when_the_one_before_it_ends_not_at_the_next_poll(checkpoint: Path) -> None:
    """Load polls 5 s apart, one decode worker with room for one request: the second request is
    refused by the worker (its last report still shows room), waits, and is placed as soon as the
    first ends, the router polling that worker at once, not up to 5 s later at the next period."""
    cluster = Cluster(checkpoint, load_poll_s=5.0)
    try:
        cluster.decode[0].total_blocks, cluster.decode[1].total_blocks = 4, 0
        cluster.decode[0].script.token_delay_s = 0.05
        prompt = list(range(3, 200))  # 4 blocks of 64
        with _client(cluster) as first, _client(cluster) as second:
            stream = first.stream(prompt, max_tokens=10, effort="low")
            next(stream)
            waiter: Future[Any] = Future()
            threading.Thread(target=lambda: waiter.set_result(second.generate(prompt, max_tokens=2, effort="low")),
                             daemon=True).start()
            deadline = time.monotonic() + 5
            while core(cluster).capacity.waiting("low") != 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert core(cluster).capacity.waiting("low") == 1
            list(stream)  # the first request ends: its blocks are free
            ended = time.monotonic()
            out = waiter.result(10)
            assert out.token_ids == _expected(prompt, 2)
            assert time.monotonic() - ended < 1.0  # the next poll was 4.5 s away
        assert core(cluster).capacity.waiting("low") == 0
    finally:
        cluster.close()


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The router's /metrics over HTTP, as a scraper reads it: (sample name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_capacity_waits_refusals_and_lease_renewals_show_in_the_scraped_metrics(checkpoint: Path) -> None:
    """One decode worker with room for one request, a prefill that outlasts two renewal periods:
    every capacity, refusal and renewal metric moves as the requests go, read over HTTP."""
    cluster = Cluster(checkpoint, metrics_port=0, lease_ms=300, max_retries=0,
                      limits={"high": ClassLimits(max_running=1, max_queued=0),
                              "max": ClassLimits(capacity_wait_s=0.2)})
    port = cluster.router.metrics_port
    try:
        cluster.decode[0].total_blocks, cluster.decode[1].total_blocks = 4, 0
        cluster.decode[0].script.token_delay_s = 0.05
        cluster.decode[0].script.fail_renewals = 2
        for p in cluster.prefill:
            p.script.prefill_delay_s = 0.4  # five renewal periods of 75 ms
        prompt = list(range(3, 200))  # 4 blocks of 64: the whole worker
        with _client(cluster) as client, _client(cluster) as other:
            stream = client.stream(prompt, max_tokens=10, effort="high")
            next(stream)  # placed on d0, its lease renewed while it prefilled
            for kwargs, reason in (({"effort": "high"}, "admission"),  # the high class's one slot is taken
                                   ({"effort": "max", "prompt": list(range(3, 400))}, "no_capacity"),  # never fits
                                   ({"effort": "max"}, "capacity_wait")):  # waits 0.2 s for room in vain
                with pytest.raises(CedserveError) as info:
                    other.generate(kwargs.pop("prompt", prompt), max_tokens=2, **kwargs)
                assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert _scrape(port)[("cedserve_router_refusals_total", (("reason", reason),))] == 1
            waiter: Future[Any] = Future()
            threading.Thread(target=lambda: waiter.set_result(other.generate(prompt, max_tokens=2, effort="low")),
                             daemon=True).start()
            deadline = time.monotonic() + 5
            while _scrape(port)[("cedserve_router_capacity_waiting_requests", (("effort_class", "low"),))] != 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            list(stream)
            assert waiter.result(10).token_ids == _expected(prompt, 2)
        seen = _scrape(port)
        deadline = time.monotonic() + 2  # a renewal sent just before the scrape is counted, its answer not yet
        while (seen[("cedserve_router_lease_renew_seconds_count", ())]
               < seen[("cedserve_router_lease_renewals_total", ())] - 2 and time.monotonic() < deadline):
            time.sleep(0.05)
            seen = _scrape(port)
        assert seen[("cedserve_router_capacity_waiting_requests", (("effort_class", "low"),))] == 0
        assert seen[("cedserve_router_capacity_admitted_total", (("effort_class", "low"),))] == 1
        assert seen[("cedserve_router_capacity_wait_seconds_count", (("effort_class", "low"),))] == 1
        assert seen[("cedserve_router_capacity_wait_seconds_count", (("effort_class", "max"),))] == 1
        assert seen[("cedserve_router_capacity_wait_seconds_sum", (("effort_class", "max"),))] >= 0.2
        assert seen[("cedserve_router_lease_renewal_failures_total", (("code", "UNAVAILABLE"),))] == 2
        renewals = seen[("cedserve_router_lease_renewals_total", ())]
        assert renewals >= 6  # two requests' prefills, several periods each
        assert seen[("cedserve_router_lease_renew_seconds_count", ())] == renewals - 2  # the answered ones
        assert seen[("cedserve_router_leases_lost_total", ())] == 0
        cluster.decode[0].script.forget_leases = True  # a restarted worker: the router learns at its renewal
        with _client(cluster) as client, pytest.raises(CedserveError):
            client.generate(prompt, max_tokens=2, effort="low")
        assert _scrape(port)[("cedserve_router_leases_lost_total", ())] >= 1
    finally:
        cluster.close()


def test_the_first_token_is_streamed_before_the_prefill_is_done(cluster: Cluster) -> None:
    """The prefill's `done` (its KV transfer closed) comes 0.8 s after its first token: the client
    has the first token at once and the Decode call is open before `done`; the usage still carries
    what `done` reported."""
    prompt = list(range(3, 200))
    for p in cluster.prefill:
        p.script.done_delay_s, p.script.bytes_sent, p.script.transfer_s = 0.8, 12_345, 0.5
        p.script.transfer_tail_s = 0.125
    with _client(cluster) as client:
        start = time.monotonic()
        stream = client.stream(prompt, max_tokens=3, effort="low")
        assert next(stream).token_ids == _expected(prompt, 1)
        assert time.monotonic() - start < 0.5
        while not [d for w in cluster.decode for d in w.decodes] and time.monotonic() - start < 0.7:
            time.sleep(0.01)
        assert [d for w in cluster.decode for d in w.decodes]  # opened before `done` (0.8 s)
        list(stream)
        done = client.last
    assert done is not None and done.token_ids == _expected(prompt, 3)
    assert done.usage["kv_transfer_bytes"] == 12_345 and done.usage["ttft_s"] < 0.5
    assert (done.usage["kv_transfer_s"], done.usage["kv_transfer_tail_s"]) == (0.5, 0.125)
    assert all(not d.leases for d in cluster.decode)


def test_a_transfer_failing_after_the_first_token_continues_from_it(cluster: Cluster) -> None:
    """The KV transfer fails after the first token was streamed, before the decode worker emitted
    anything: the request is re-placed as a migration is (the prompt plus the token already sent)
    on the other prefill worker, and the Decode call waiting on the failed transfer is cancelled."""
    prompt = list(range(3, 200))
    for p in cluster.prefill:
        p.script.fail_after_first, p.script.done_delay_s = 1, 0.05
    for d in cluster.decode:
        d.script.token_delay_s = 0.5  # no token before the transfer is seen to fail
    with _client(cluster) as client:
        done = client.generate(prompt, max_tokens=3, effort="low")
    first = _expected(prompt, 1)[0]
    assert done.token_ids == [first, *_expected([*prompt, first], 2)]
    failed, retried = [p for p in cluster.prefill if p.requests]
    assert len(failed.requests) + len(retried.requests) == 2 and list(retried.requests[-1].token_ids) == [*prompt, first]
    assert done.request_id in [c for d in cluster.decode for c in d.cancelled]
    assert all(not d.leases for d in cluster.decode)


def test_a_failed_transfer_reported_by_both_workers_blames_the_prefill_worker(cluster: Cluster) -> None:
    """The decode worker reports the transfer failed before the prefill worker does: the retry
    excludes the prefill worker (it goes to the other one) and keeps the decode worker."""
    prompt = list(range(3, 200))
    for p in cluster.prefill:
        p.script.fail_after_first, p.script.done_delay_s = 1, 0.2
    for d in cluster.decode:
        d.script.fail_transfers = 1
    with _client(cluster) as client:
        done = client.generate(prompt, max_tokens=3, effort="low")
    assert len(done.token_ids) == 3
    decoded_on = [w.worker_id for w in cluster.decode for _ in w.decodes]
    assert len(decoded_on) == 2 and decoded_on[0] == decoded_on[1]  # the same decode worker, twice
    assert sorted(len(p.requests) for p in cluster.prefill) == [1, 1]  # each prefill worker once
