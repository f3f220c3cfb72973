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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import msgspec
import torch.distributed as dist

from cedserve.common.errors import ErrorKind
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
from cedserve.decode_workers.slot_book import runner_unavailable
from cedserve.kv_transfer.config import KVTransferConfig
from cedserve.model.cache.events import KVEventBatch
from cedserve.model.dspark import Drafter
from cedserve.model.engram_staging import staged_row_bytes
from cedserve.model.expert_exchange import fixed_capacity_bytes
from cedserve.model.runner import RunnerConfig
from cedserve.model.slots import SlotShape, slot_pool_bytes
from cedserve.serving.config import ServeConfig
from cedserve.serving.drain import DrainController
from cedserve.serving.gpu_memory import MemoryNeed, claim_share, register_memory_gauges
from cedserve.serving.ready import ready_line
from cedserve.serving.server import GrpcServer, format_address, start_metrics_server
from cedserve.serving.worker import (
    KVPlane,
    WorkerOptions,
    build_kv_plane,
    build_server,
    check_gpu_share,
    load_model,
    model_source,
    read_worker_files,
    serve_until_drained,
    stop_serving,
    worker_id,
    worker_memory_need,
)
from cedserve.serving.worker_model import LoadedModel, torch_dtype

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
    files = read_worker_files(opts)
    serve = files.serve
    decode = DecodeConfig.from_mapping(files.role_table)
    decode = msgspec.structs.replace(decode, worker_id=worker_id(opts, files.role_table.get("worker_id")))
    return DecodeSettings(serve, decode, files.kv_transfer)


def load_drafter(loaded: LoadedModel, checkpoint: str | None, preset_name: str | None, seed: int,
                 device: str) -> Drafter | None:
    """The DSpark drafter of the checkpoint (None when it has none), or the preset's random one; its
    weights in the model's dtype."""
    config, dtype = loaded.model.config, torch_dtype(loaded.weights_dtype)
    if checkpoint:
        from safetensors import safe_open

        from cedserve.model.checkpoint_writer import load_drafter as load

        shards = sorted(Path(checkpoint).glob("*.safetensors"))
        has = any(k.startswith("dspark.") for s in shards for k in safe_open(str(s), "pt").keys())  # type: ignore[no-untyped-call]  # noqa: SIM118
        return load(checkpoint, config, dtype).to(device) if has else None
    from cedserve.model.checkpoint import cast_weights
    from cedserve.model.checkpoint_writer import random_model
    from cedserve.model.tokenizer import tiny_tokenizer_path

    assert preset_name is not None
    _, drafter = random_model(config, tiny_tokenizer_path(), seed)
    return cast_weights(drafter, dtype).to(device)


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


def decode_memory_need(loaded: LoadedModel, settings: DecodeSettings, world_size: int, drafter: Drafter | None,
                       proposer: DSparkProposer | None) -> MemoryNeed:
    """What a decode rank will hold on its GPU: the skeleton's parts, the drafter's weights and,
    with the runner on, its slot pools (as `DecodeEngine._slot_book` sizes them)."""
    cfg, serve, model = settings.decode, settings.serve, loaded.model
    runner: tuple[tuple[str, int, str], ...] = ()
    if runner_unavailable(model, cfg.runner, world_size) is None:
        max_context = min(model.config.max_position_embeddings, serve.cache.num_blocks * serve.cache.block_size)
        max_drafts = proposer.max_tokens if proposer is not None else 0
        shape = SlotShape(cfg.max_running_requests, max_context, 2 * max_drafts + 1)
        runner = (("runner slot pools", slot_pool_bytes(model.config, shape, serve.cache.block_size),
                   "[decode] max_running_requests"),)
        if model.engram_store is not None:  # the step's staged Engram rows, one per row of the largest bucket
            rows = cfg.max_running_requests * shape.max_rows_per_slot
            runner += (("runner Engram rows", rows * staged_row_bytes(model.engram_store, model.config),
                        "[decode] max_running_requests"),)
        if world_size > 1:  # the runner's fixed-capacity all-to-all buffers, for its largest bucket
            c = model.config
            rows = RunnerConfig(max_slots=shape.max_slots, max_context=max_context,
                                max_rows_per_slot=shape.max_rows_per_slot).bucket_sizes[-1]
            exchange = fixed_capacity_bytes(world_size, rows, c.num_experts_per_tok, c.hidden_size,
                                            model.embed.weight.element_size())
            runner += (("runner expert-parallel buffers", exchange, "[decode] max_running_requests"),)
    return worker_memory_need("decode", loaded, serve, settings.kv_transfer, cfg.max_pass_tokens, "max_pass_tokens",
                              runner, modules=(drafter,))


@dataclass
class DecodeWorker:
    """The running rank's parts (stopped in reverse order)."""

    opts: WorkerOptions
    settings: DecodeSettings
    kv: KVPlane
    engine: DecodeEngine
    loop: EngineLoop
    router: OutputRouter | None
    server: GrpcServer
    drain: DrainController
    metrics_port: int = -1

    def ready(self) -> str:
        cfg, agent = self.settings.decode, self.kv.agent
        return ready_line("decode", format_address(self.opts.public_host, self.server.port), agent=agent.name,
                          control_address=agent.control_address, metrics_port=self.metrics_port,
                          worker_id=cfg.worker_id, rank=self.opts.rank, group_size=self.opts.group_size,
                          health_port=self.server.health_port, tls=self.server.tls.enabled)


def build_worker(opts: WorkerOptions) -> DecodeWorker:
    """Load everything, join the group, start serving (readiness still NOT_SERVING)."""
    opts.check()
    settings = load_settings(opts)
    cfg, serve = settings.decode, settings.serve
    source = model_source(opts, serve)
    share = claim_share(cfg.device, cfg.gpu_memory_fraction)
    loaded = load_model(source, opts.seed, serve, cfg.device)
    model = loaded.model
    drafter = load_drafter(loaded, source.checkpoint, source.preset, opts.seed, cfg.device) if cfg.dspark else None
    ep, channel = join_group(opts, model.config.n_routed_experts, cfg.device)
    if ep.world_size > 1:
        shard_experts(model, ep.rank, ep.world_size)
    proposer = DSparkProposer(drafter, model, cfg.draft_tokens) if drafter is not None else None
    check_gpu_share("decode", share, decode_memory_need(loaded, settings, ep.world_size, drafter, proposer))
    leader = opts.rank == 0
    kv = build_kv_plane(loaded, serve, settings.kv_transfer, cfg.device,
                        cfg.worker_id if leader else f"{cfg.worker_id}-r{opts.rank}", f"{cfg.worker_id}-r{opts.rank}",
                        publish_events=leader)
    register_memory_gauges(kv.registry, share)
    engine = DecodeEngine(cfg, model, kv.cache, proposer=proposer, ep=ep, endpoint=kv.agent,
                          metrics=DecodeMetrics(kv.registry), detokenize=_detokenizer(source.checkpoint, model.config.vocab_size),
                          rank=opts.rank)
    router = OutputRouter(opts.group_size) if leader else None
    inbox = CommandInbox()
    loop = EngineLoop(engine, channel, inbox, router.hold_report if router is not None else None,
                      router.release if router is not None else None)
    server, drain = build_server(opts, serve, cfg.drain_timeout_s, max_workers=rpc_threads(cfg))
    worker = DecodeWorker(opts, settings, kv, engine, loop, router, server, drain)
    if router is not None:
        leader_router = router
        # a failed loop answers no call again: fail them all now (the router places them elsewhere)
        loop.on_failure = lambda exc: leader_router.fail_all(ErrorKind.UNAVAILABLE,
                                                              f"the decode engine stopped: {exc!r}")
        service = DecodeService(cfg.worker_id, inbox, router, kv.feed, lambda: _snapshot(worker), drain, cfg.lease_ms,
                                settings.kv_transfer.auth_token, engine.metrics.phases)
        add_decode_service(server.grpc, service)
        worker.metrics_port = start_metrics_server(opts.host, opts.metrics_port, kv.registry)
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
        return worker.kv.cache.snapshot_events()


# ------------------------------------------------------------------ serving and draining


def serve_rank(worker: DecodeWorker) -> bool:
    """Tick until drained and stopped; True when nothing had to be handed back."""
    thread = worker.loop.start()
    health = worker.server.health
    health.set_alive(True)
    health.set_ready(True)
    print(worker.ready(), flush=True)
    if worker.router is None:  # a follower: the leader decides when the group stops
        return _follow(worker, thread)
    drained = serve_until_drained(worker.drain, health, lambda: _alive(worker, thread),
                                  GroupDrain(worker.loop, worker.router), failed=lambda: not thread.is_alive())
    worker.loop.stop_requested = True
    thread.join(timeout=30.0)
    stop_worker(worker)
    return drained


@dataclass
class GroupDrain:
    """The decode group as the drain loop sees it: the leader's loop takes no new leases; handing
    back cancels every request on every rank (the router re-places them)."""

    loop: EngineLoop
    router: OutputRouter

    def stop_accepting(self) -> None:
        self.loop.draining = True

    def in_flight(self) -> int:
        return self.router.in_flight()

    def hand_back(self) -> None:
        for rank in range(len(self.router.loads)):
            self.loop.inbox.put(CancelCommand(rank, "*", reason="draining", hand_back=True))


def _follow(worker: DecodeWorker, thread: threading.Thread) -> bool:
    while thread.is_alive():
        worker.server.health.set_alive(_alive(worker, thread))
        thread.join(timeout=1.0)
        if worker.drain.draining:
            worker.server.health.set_ready(False)
    stop_worker(worker)
    return worker.loop.error is None


def _alive(worker: DecodeWorker, thread: threading.Thread) -> bool:
    stalled = time.monotonic() - worker.loop.last_tick_s > LIVENESS_STALL_S
    return thread.is_alive() and not stalled


def stop_worker(worker: DecodeWorker) -> None:
    stop_serving(worker.server, worker.kv.feed)
    worker.kv.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def run(opts: WorkerOptions) -> int:
    """Entry point of `cedserve worker --role decode`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker = build_worker(opts)
    worker.drain.install_signal_handlers()
    serve_rank(worker)
    return 1 if worker.loop.error is not None else 0
