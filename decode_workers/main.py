"""`cedserve worker --role decode`: one rank of a decode group, serving until drained.

Start-up (every rank): model and drafter (checkpoint or preset), the group (torch.distributed at
`--leader-address:--dist-port`: gloo on CPU, NCCL plus a gloo control group on GPUs; nothing for
`--group-size 1`), this rank's share of the routed experts, block pool and cache manager, a NIXL
agent registering the whole pool (its name `<worker_id>-r<rank>`), the engine and its loop, a gRPC
server with `grpc.health.v1.Health` and `Lifecycle`. The leader (rank 0) also serves
`cedserve.v1.DecodeWorker` and the metrics endpoint. Readiness turns SERVING once every rank has
joined and loaded its shard; then one line goes to stdout:

    CEDSERVE_READY {"address": "127.0.0.1:50061", "agent": "decode-0-r0", "control_address": "...",
                    "group_size": 1, "metrics_port": 9091, "rank": 0, "role": "decode", "worker_id": "decode-0"}

Drain (SIGTERM, or `Lifecycle.Drain` on the leader): readiness NOT_SERVING, no new leases; running
requests finish until the drain deadline, the rest are handed back with UNAVAILABLE (the router
re-places them); then the leader stops the group and every rank exits.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import msgspec
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from cedserve.config import ServeConfig
from cedserve.decode_workers.config import DecodeConfig
from cedserve.decode_workers.drafting import DSparkProposer
from cedserve.decode_workers.engine import DecodeEngine
from cedserve.decode_workers.expert_parallel import (
    ExpertParallel,
    SingleRank,
    TorchDistributedEP,
    shard_experts,
)
from cedserve.decode_workers.loop import CommandInbox, EngineLoop, GroupChannel, LocalChannel, TorchChannel
from cedserve.decode_workers.messages import CancelCommand
from cedserve.decode_workers.metrics import DecodeMetrics
from cedserve.decode_workers.service import DecodeService, OutputRouter, add_decode_service
from cedserve.kv_transfer.agent import NixlTransferAgent
from cedserve.kv_transfer.config import KVTransferConfig, kv_transfer_config_from_table
from cedserve.kv_transfer.metrics import TransferMetrics
from cedserve.kv_transfer.region import KVLayout, KVRegion
from cedserve.model.cache.events import KVEventBatch
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.cache.manager import KVCacheManager
from cedserve.model.dspark import Drafter
from cedserve.serving import (
    DrainController,
    GrpcServer,
    KVEventFeed,
    LoadedModel,
    WorkerOptions,
    add_lifecycle,
    format_address,
    load_worker_model,
    read_serve_file,
    ready_line,
    start_metrics_server,
)

log = logging.getLogger(__name__)
GROUP_TIMEOUT = timedelta(minutes=30)
LIVENESS_STALL_S = 120.0
"""A loop that has not ticked for this long (a pass can take seconds on CPU) reports NOT_SERVING."""


@dataclass(frozen=True)
class DecodeSettings:
    """Everything a decode rank is built from, after flags override the config file."""

    serve: ServeConfig
    decode: DecodeConfig
    kv_transfer: KVTransferConfig


CONTROL_RPC_THREADS = 32
"""Threads beyond the Decode streams' for the calls that must not wait behind them: health and
liveness checks, GetLoad, Cancel, Reserve."""


def rpc_threads(cfg: DecodeConfig) -> int:
    """The worker's gRPC threads. Each open Decode stream holds one until its request ends, so with
    16 (the old default) 16 running requests left none for the liveness check or a Cancel: under
    load the router took the worker for dead and cancels waited until leases expired. Room for
    twice the batch's streams (the batch and as many waiting for a slot) plus the control calls."""
    return 2 * cfg.max_running_requests + CONTROL_RPC_THREADS


def load_settings(opts: WorkerOptions) -> DecodeSettings:
    serve, extra = read_serve_file(opts.config, ("decode", "kv_transfer"))
    serve = msgspec.structs.replace(serve, internal_tls=opts.internal_tls(serve.internal_tls))
    decode = DecodeConfig.from_mapping(extra.get("decode", {}))
    worker_id = opts.worker_id or extra.get("decode", {}).get("worker_id") or f"decode-{socket.gethostname()}-{os.getpid()}"
    decode = msgspec.structs.replace(decode, worker_id=worker_id)
    kv = kv_transfer_config_from_table(extra.get("kv_transfer", {}), opts.public_host, opts.nixl_port,
                                       serve.internal_tls)
    return DecodeSettings(serve, decode, kv)


def load_drafter(loaded: LoadedModel, checkpoint: str | None, preset_name: str | None, seed: int,
                 device: str) -> Drafter | None:
    """The DSpark drafter of the checkpoint (None when it has none), or the preset's random one."""
    config = loaded.model.config
    if checkpoint:
        from safetensors import safe_open

        from cedserve.model.checkpoint_writer import load_drafter as load

        shards = sorted(Path(checkpoint).glob("*.safetensors"))
        has = any(k.startswith("dspark.") for s in shards for k in safe_open(str(s), "pt").keys())  # type: ignore[no-untyped-call]  # noqa: SIM118
        return load(checkpoint, config).to(device) if has else None
    from cedserve.model.checkpoint_writer import random_model
    from cedserve.model.tokenizer import tiny_tokenizer_path

    assert preset_name is not None
    _, drafter = random_model(config, tiny_tokenizer_path(), seed)
    return drafter.to(device)


def join_group(opts: WorkerOptions, num_experts: int, device: str) -> tuple[ExpertParallel, GroupChannel]:
    """Expert parallelism and the control channel of this rank's group."""
    if opts.group_size == 1:
        return SingleRank(num_experts), LocalChannel()
    if not opts.leader_address:
        raise ValueError("--leader-address is required with --group-size > 1")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{opts.leader_address}:{opts.dist_port}",
                            rank=opts.rank, world_size=opts.group_size, timeout=GROUP_TIMEOUT)
    control = dist.new_group(backend="gloo") if backend == "nccl" else None
    return TorchDistributedEP(num_experts, None, control), TorchChannel(control)


@dataclass
class DecodeWorker:
    """The running rank's parts (stopped in reverse order)."""

    opts: WorkerOptions
    settings: DecodeSettings
    cache: KVCacheManager
    agent: NixlTransferAgent
    engine: DecodeEngine
    loop: EngineLoop
    router: OutputRouter | None
    server: GrpcServer
    drain: DrainController
    feed: KVEventFeed
    metrics_port: int = -1

    def ready(self) -> str:
        cfg = self.settings.decode
        return ready_line("decode", format_address(self.opts.public_host, self.server.port), agent=self.agent.name,
                          control_address=self.agent.control_address, metrics_port=self.metrics_port,
                          worker_id=cfg.worker_id, rank=self.opts.rank, group_size=self.opts.group_size,
                          health_port=self.server.health_port, tls=self.server.tls.enabled)


def build_worker(opts: WorkerOptions) -> DecodeWorker:
    """Load everything, join the group, start serving (readiness still NOT_SERVING)."""
    opts.check()
    settings = load_settings(opts)
    cfg, serve = settings.decode, settings.serve
    checkpoint, preset_name = opts.checkpoint or serve.model.checkpoint, opts.preset or serve.model.preset
    loaded = load_worker_model(checkpoint, preset_name, opts.seed, cfg.device)
    model = loaded.model
    serve.validate_against(model.config)
    drafter = load_drafter(loaded, checkpoint, preset_name, opts.seed, cfg.device) if cfg.dspark else None
    ep, channel = join_group(opts, model.config.n_routed_experts, cfg.device)
    if ep.world_size > 1:
        shard_experts(model, ep.rank, ep.world_size)
    leader = opts.rank == 0
    layout = BlockLayout.from_config(model.config, serve.cache.block_size)
    feed = KVEventFeed()
    cache = KVCacheManager(layout, serve.cache, f"{cfg.worker_id}" if leader else f"{cfg.worker_id}-r{opts.rank}",
                           cfg.device, event_sink=feed.publish if leader else None)
    registry = CollectorRegistry(auto_describe=True)
    agent = NixlTransferAgent(settings.kv_transfer, KVRegion(cache.pool.storage, layout.block_bytes),
                              KVLayout.from_config(model.config, serve.cache.block_size, model_id=loaded.model_id),
                              f"{cfg.worker_id}-r{opts.rank}", metrics=TransferMetrics(registry))
    proposer = DSparkProposer(drafter, model, cfg.draft_tokens) if drafter is not None else None
    engine = DecodeEngine(cfg, model, cache, proposer=proposer, ep=ep, endpoint=agent,
                          metrics=DecodeMetrics(registry), detokenize=_detokenizer(checkpoint, model.config.vocab_size), rank=opts.rank)
    router = OutputRouter(opts.group_size) if leader else None
    inbox = CommandInbox()
    loop = EngineLoop(engine, channel, inbox, router.on_report if router is not None else None)
    server = GrpcServer(opts.host, opts.grpc_port, max_workers=rpc_threads(cfg), tls=serve.internal_tls,
                        health_port=opts.health_port, token=serve.internal_token())
    drain = DrainController(server.health, cfg.drain_timeout_s)
    add_lifecycle(server, drain)
    worker = DecodeWorker(opts, settings, cache, agent, engine, loop, router, server, drain, feed)
    if router is not None:
        service = DecodeService(cfg.worker_id, inbox, router, feed, lambda: _snapshot(worker), drain, cfg.lease_ms,
                                settings.kv_transfer.auth_token)
        add_decode_service(server.grpc, service)
        worker.metrics_port = start_metrics_server(opts.host, opts.metrics_port, registry)
    server.start()
    return worker


def _detokenizer(checkpoint: str | None, vocab_size: int) -> Callable[[list[int]], str] | None:
    """Token ids -> text, for stop strings (None without a tokenizer)."""
    from cedserve.model.tokenizer import TextCodec, tiny_tokenizer_path

    path = Path(checkpoint) / "tokenizer.json" if checkpoint else tiny_tokenizer_path()
    if not path.is_file():
        return None
    return TextCodec.from_file(path, vocab_size).decode


def _snapshot(worker: DecodeWorker) -> KVEventBatch:
    with worker.loop.lock:  # the cache manager is the engine thread's; hold the loop between ticks
        return worker.cache.snapshot_events()


# ------------------------------------------------------------------ serving and draining


def serve_until_drained(worker: DecodeWorker) -> bool:
    """Tick until drained and stopped; True when nothing had to be handed back."""
    thread = worker.loop.start()
    health = worker.server.health
    health.set_alive(True)
    health.set_ready(True)
    print(worker.ready(), flush=True)
    if worker.router is None:  # a follower: the leader decides when the group stops
        return _follow(worker, thread)
    while not worker.drain.wait_requested(1.0):
        _check_alive(worker, thread)
    drained = drain_group(worker)
    while not worker.drain.wait_exit(1.0):
        _check_alive(worker, thread)
    worker.loop.stop_requested = True
    thread.join(timeout=30.0)
    stop_worker(worker)
    return drained


def drain_group(worker: DecodeWorker) -> bool:
    """No new leases; running requests finish until the deadline; the rest are handed back."""
    router = worker.router
    assert router is not None
    worker.loop.draining = True
    while router.in_flight() and time.monotonic() < worker.drain.deadline_s:
        time.sleep(0.05)
    left = router.in_flight()
    if left:
        log.warning("drain deadline: handing back %d requests", left)
        for rank in range(len(router.loads)):
            worker.loop.inbox.put(CancelCommand(rank, "*", reason="draining", hand_back=True))
        end = time.monotonic() + 5.0
        while router.in_flight() and time.monotonic() < end:
            time.sleep(0.05)
    worker.drain.finish(left == 0, router.in_flight())
    return left == 0


def _follow(worker: DecodeWorker, thread: threading.Thread) -> bool:
    while thread.is_alive():
        _check_alive(worker, thread)
        thread.join(timeout=1.0)
        if worker.drain.draining:
            worker.server.health.set_ready(False)
    stop_worker(worker)
    return worker.loop.error is None


def _check_alive(worker: DecodeWorker, thread: threading.Thread) -> None:
    stalled = time.monotonic() - worker.loop.last_tick_s > LIVENESS_STALL_S
    worker.server.health.set_alive(thread.is_alive() and not stalled)


def stop_worker(worker: DecodeWorker) -> None:
    worker.feed.close()
    worker.server.stop(grace_s=1.0)
    worker.agent.close()
    worker.cache.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def run(opts: WorkerOptions) -> int:
    """Entry point of `cedserve worker --role decode`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker = build_worker(opts)
    worker.drain.install_signal_handlers()
    serve_until_drained(worker)
    return 1 if worker.loop.error is not None else 0
