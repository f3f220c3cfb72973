"""`cedserve worker --role prefill`: build a prefill worker process from its options and serve until drained.

Start-up: model (checkpoint or preset), block pool and cache manager, NIXL agent registering the
whole pool, engine thread, gRPC server (PrefillWorker, Lifecycle, Health), metrics endpoint; then
readiness turns SERVING and one line goes to stdout:

    CEDSERVE_READY {"address": "127.0.0.1:50061", "agent": "...", "control_address": "...",
                    "metrics_port": 9091, "role": "prefill", "worker_id": "..."}

Shutdown: SIGTERM/SIGINT or `Lifecycle.Drain` start a drain (readiness NOT_SERVING, no new
requests); in-flight requests finish until the drain deadline, the rest are handed back with
UNAVAILABLE (their transfers aborted, so the decode workers free their blocks); then everything stops.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass

import msgspec
from prometheus_client import CollectorRegistry

from cedserve.config import ServeConfig
from cedserve.kv_transfer.agent import NixlTransferAgent
from cedserve.kv_transfer.config import KVTransferConfig, kv_transfer_config_from_table
from cedserve.kv_transfer.metrics import TransferMetrics
from cedserve.kv_transfer.region import KVLayout, KVRegion
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.cache.manager import KVCacheManager
from cedserve.prefill_workers.config import PrefillWorkerConfig
from cedserve.prefill_workers.engine import PrefillEngine
from cedserve.prefill_workers.link_probe import LinkProber
from cedserve.prefill_workers.metrics import PrefillMetrics
from cedserve.prefill_workers.service import PeerBook, PrefillService, add_prefill_service
from cedserve.prefill_workers.validation import RequestLimits, state_limits
from cedserve.serving import (
    DrainController,
    GrpcServer,
    KVEventFeed,
    WorkerOptions,
    add_lifecycle,
    format_address,
    load_worker_model,
    read_serve_file,
    ready_line,
    start_metrics_server,
)

log = logging.getLogger(__name__)
HAND_BACK_WAIT_S = 3.0


@dataclass(frozen=True)
class PrefillSettings:
    """Everything a prefill worker process is built from, after flags override the config file."""

    serve: ServeConfig
    prefill: PrefillWorkerConfig
    kv_transfer: KVTransferConfig


def load_settings(opts: WorkerOptions) -> PrefillSettings:
    serve, extra = read_serve_file(opts.config, ("prefill", "kv_transfer"))
    serve = msgspec.structs.replace(serve, internal_tls=opts.internal_tls(serve.internal_tls))
    prefill = PrefillWorkerConfig.from_mapping(extra.get("prefill", {}))
    worker_id = opts.worker_id or prefill.worker_id or f"prefill-{socket.gethostname()}-{os.getpid()}"
    prefill = msgspec.structs.replace(prefill, worker_id=worker_id)
    kv = kv_transfer_config_from_table(extra.get("kv_transfer", {}), opts.public_host, opts.nixl_port,
                                       serve.internal_tls)
    return PrefillSettings(serve, prefill, kv)


@dataclass
class PrefillWorker:
    """The running process's parts, in start order (stopped in reverse)."""

    settings: PrefillSettings
    cache: KVCacheManager
    agent: NixlTransferAgent
    engine: PrefillEngine
    server: GrpcServer
    drain: DrainController
    feed: KVEventFeed
    metrics_port: int

    def identity(self) -> tuple[str, str]:
        return self.agent.name, self.agent.control_address

    def ready_fields(self, opts: WorkerOptions) -> str:
        return ready_line("prefill", format_address(opts.public_host, self.server.port), agent=self.agent.name,
                          control_address=self.agent.control_address, metrics_port=self.metrics_port,
                          worker_id=self.settings.prefill.worker_id, health_port=self.server.health_port,
                          tls=self.server.tls.enabled)


def build_worker(opts: WorkerOptions) -> PrefillWorker:
    """Load everything and start serving (readiness still NOT_SERVING)."""
    opts.check()
    if opts.group_size != 1:
        raise ValueError("--group-size > 1: prefill groups (tensor parallel encoder) are not built yet")
    settings = load_settings(opts)
    cfg, serve = settings.prefill, settings.serve
    loaded = load_worker_model(opts.checkpoint or serve.model.checkpoint, opts.preset or serve.model.preset,
                               opts.seed, cfg.device)
    config = loaded.model.config
    serve.validate_against(config)
    block_size = serve.cache.block_size
    layout = BlockLayout.from_config(config, block_size)
    feed = KVEventFeed()
    cache = KVCacheManager(layout, serve.cache, cfg.worker_id, cfg.device, event_sink=feed.publish)
    registry = CollectorRegistry(auto_describe=True)
    agent = NixlTransferAgent(settings.kv_transfer, KVRegion(cache.pool.storage, layout.block_bytes),
                              KVLayout.from_config(config, block_size, model_id=loaded.model_id), cfg.worker_id,
                              metrics=TransferMetrics(registry))
    metrics = PrefillMetrics(registry)
    engine = PrefillEngine(loaded.model, cache, agent.sender(), cfg, metrics)
    server = GrpcServer(opts.host, opts.grpc_port, tls=serve.internal_tls, health_port=opts.health_port,
                        token=serve.internal_token())
    drain = DrainController(server.health, cfg.drain_timeout_s)
    limits = RequestLimits(config.vocab_size, cfg.prompt_limit(config.max_position_embeddings), block_size,
                           cfg.replay_span, agent.name, layout.block_bytes,
                           *state_limits(config, loaded.model.embed.weight.dtype, cfg.ship_state))
    worker = PrefillWorker(settings, cache, agent, engine, server, drain, feed, -1)
    peers = PeerBook(agent, cfg.handshake_timeout_s)
    token = settings.kv_transfer.auth_token
    prober = LinkProber(engine, agent, peers, serve.internal_tls, token, drain, metrics)
    service = PrefillService(engine, limits, peers, feed, drain, worker.identity, prober, token)
    add_prefill_service(server.grpc, service)
    add_lifecycle(server, drain)
    engine.start()
    server.start()
    worker.metrics_port = start_metrics_server(opts.host, opts.metrics_port, registry)
    return worker


def serve_until_drained(worker: PrefillWorker) -> bool:
    """Wait for a drain request, drain, stop. True when nothing had to be handed back."""
    health = worker.server.health
    while not worker.drain.wait_requested(1.0):
        health.set_alive(worker.engine.alive())
    drained = drain_engine(worker.engine, worker.drain)
    while not worker.drain.wait_exit(1.0):
        health.set_alive(worker.engine.alive())
    stop_worker(worker)
    return drained


def drain_engine(engine: PrefillEngine, drain: DrainController) -> bool:
    """Stop accepting, wait for in-flight requests until the drain deadline, hand back the rest."""
    engine.stop_accepting()
    while engine.in_flight() and time.monotonic() < drain.deadline_s:
        time.sleep(0.05)
    left = engine.in_flight()
    if left:
        log.warning("drain deadline: handing back %d requests", left)
        engine.hand_back("prefill worker draining: request handed back, retry on another worker")
        end = time.monotonic() + HAND_BACK_WAIT_S
        while engine.in_flight() and time.monotonic() < end:
            time.sleep(0.05)
    drain.finish(left == 0, engine.in_flight())
    return left == 0


def stop_worker(worker: PrefillWorker) -> None:
    worker.feed.close()
    worker.server.stop(grace_s=1.0)
    worker.engine.stop()
    worker.agent.close()
    worker.cache.close()


def run(opts: WorkerOptions) -> int:
    """Entry point of `cedserve worker --role prefill`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker = build_worker(opts)
    worker.drain.install_signal_handlers()
    worker.server.health.set_alive(True)
    worker.server.health.set_ready(True)
    print(worker.ready_fields(opts), flush=True)
    serve_until_drained(worker)
    return 0
