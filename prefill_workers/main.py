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
from dataclasses import dataclass

import msgspec

from cedserve.kv_transfer.config import KVTransferConfig
from cedserve.model.prefill_runner import PrefillRunnerConfig, prefill_runner_bytes
from cedserve.prefill_workers.config import PrefillWorkerConfig
from cedserve.prefill_workers.engine import PrefillEngine
from cedserve.prefill_workers.link_probe import LinkProber
from cedserve.prefill_workers.metrics import PrefillMetrics
from cedserve.prefill_workers.service import PeerBook, PrefillService, add_prefill_service
from cedserve.prefill_workers.validation import RequestLimits, state_limits
from cedserve.serving.config import ServeConfig
from cedserve.serving.drain import DrainController
from cedserve.serving.gpu_memory import claim_share, register_memory_gauges
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

HAND_BACK_DETAIL = "prefill worker draining: request handed back, retry on another worker"


@dataclass(frozen=True)
class PrefillSettings:
    """Everything a prefill worker process is built from, after flags override the config file."""

    serve: ServeConfig
    prefill: PrefillWorkerConfig
    kv_transfer: KVTransferConfig


@dataclass
class PrefillWorker:
    """The running process's parts, in start order (stopped in reverse)."""

    settings: PrefillSettings
    kv: KVPlane
    engine: PrefillEngine
    server: GrpcServer
    drain: DrainController
    metrics_port: int

    def identity(self) -> tuple[str, str]:
        return self.kv.agent.name, self.kv.agent.control_address

    def ready_fields(self, opts: WorkerOptions) -> str:
        agent = self.kv.agent
        return ready_line("prefill", format_address(opts.public_host, self.server.port), agent=agent.name,
                          control_address=agent.control_address, metrics_port=self.metrics_port,
                          worker_id=self.settings.prefill.worker_id, health_port=self.server.health_port,
                          tls=self.server.tls.enabled)


@dataclass
class EngineDrain:
    """The prefill engine as the drain loop sees it."""

    engine: PrefillEngine

    def stop_accepting(self) -> None:
        self.engine.stop_accepting()

    def in_flight(self) -> int:
        return self.engine.in_flight()

    def hand_back(self) -> None:
        self.engine.hand_back(HAND_BACK_DETAIL)


def load_settings(opts: WorkerOptions) -> PrefillSettings:
    files = read_worker_files(opts)
    prefill = PrefillWorkerConfig.from_mapping(files.role_table)
    prefill = msgspec.structs.replace(prefill, worker_id=worker_id(opts, prefill.worker_id))
    return PrefillSettings(files.serve, prefill, files.kv_transfer)


def build_worker(opts: WorkerOptions) -> PrefillWorker:
    """Load everything and start serving (readiness still NOT_SERVING)."""
    opts.check()
    if opts.group_size != 1:
        raise ValueError("--group-size > 1: prefill groups (tensor parallel encoder) are not built yet")
    settings = load_settings(opts)
    cfg, serve = settings.prefill, settings.serve
    share = claim_share(cfg.device, cfg.gpu_memory_fraction)
    loaded = load_model(model_source(opts, serve), opts.seed, serve, cfg.device)
    config = loaded.model.config
    runner: tuple[tuple[str, int, str], ...] = ()
    if cfg.runner == "on" or (cfg.runner == "auto" and cfg.device.startswith("cuda")):
        runner_config = PrefillRunnerConfig(cfg.prompt_limit(config.max_position_embeddings), cfg.runner_buckets,
                                            cfg.runner_slots)
        runner = (("prefill runner pools", prefill_runner_bytes(config, runner_config),
                   "[prefill] runner_slots, runner_buckets"),)
    check_gpu_share("prefill", share, worker_memory_need("prefill", loaded, serve, settings.kv_transfer,
                                                         cfg.step_token_budget, "step_token_budget", runner))
    kv = build_kv_plane(loaded, serve, settings.kv_transfer, cfg.device, cfg.worker_id, cfg.worker_id)
    metrics = PrefillMetrics(kv.registry)
    register_memory_gauges(kv.registry, share)
    engine = PrefillEngine(loaded.model, kv.cache, kv.agent.sender(), cfg, metrics)
    server, drain = build_server(opts, serve, cfg.drain_timeout_s)
    limits = RequestLimits(config.vocab_size, cfg.prompt_limit(config.max_position_embeddings), serve.cache.block_size,
                           cfg.replay_span, kv.agent.name, kv.layout.block_bytes,
                           *state_limits(config, loaded.model.embed.weight.dtype, cfg.ship_state))
    worker = PrefillWorker(settings, kv, engine, server, drain, -1)
    peers = PeerBook(kv.agent, cfg.handshake_timeout_s)
    token = settings.kv_transfer.auth_token
    prober = LinkProber(engine, kv.agent, peers, serve.internal_tls, token, drain, metrics)
    service = PrefillService(engine, limits, peers, kv.feed, drain, worker.identity, prober, token)
    add_prefill_service(server.grpc, service)
    engine.start()
    server.start()
    worker.metrics_port = start_metrics_server(opts.host, opts.metrics_port, kv.registry)
    return worker


def stop_worker(worker: PrefillWorker) -> None:
    stop_serving(worker.server, worker.kv.feed)
    worker.engine.stop()
    worker.kv.close()


def run(opts: WorkerOptions) -> int:
    """Entry point of `cedserve worker --role prefill`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker = build_worker(opts)
    worker.drain.install_signal_handlers()
    worker.server.health.set_alive(True)
    worker.server.health.set_ready(True)
    print(worker.ready_fields(opts), flush=True)
    serve_until_drained(worker.drain, worker.server.health, worker.engine.alive, EngineDrain(worker.engine))
    stop_worker(worker)
    return 0
