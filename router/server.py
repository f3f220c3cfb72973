"""Build and run the router process: the public gRPC API (and, with `http_port`, the OpenAI-compatible
HTTP API of router/http_api.py, in the same event loop) in front of the worker pools.

Shutdown: SIGTERM (or a `Drain` call first, the pod's preStop) drains (router/lifecycle.py): new
Generate calls get UNAVAILABLE, health turns NOT_SERVING, open streams finish within the drain
timeout, then the server stops. A second SIGINT stops at once.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cedserve.common.credentials import token_metadata
from cedserve.common.tls import add_port
from cedserve.model.chat_format import ChatFormat
from cedserve.model.config import ModelConfig
from cedserve.model.kv_accounting import KVAccounting
from cedserve.model.tokenizer import TextCodec
from cedserve.proto import generation_pb2, generation_pb2_grpc
from cedserve.router.admission import Admission
from cedserve.router.config import RouterConfig
from cedserve.router.frontend import GenerationCore, GenerationService
from cedserve.router.gate import PublicInterceptor
from cedserve.router.http_api import HttpApi, HttpServer, start_http_server
from cedserve.router.index import GlobalPrefixIndex
from cedserve.router.jit import warm_up
from cedserve.router.lifecycle import RouterDrain, add_control_services
from cedserve.router.metrics import RouterMetrics
from cedserve.router.openai_api import ApiSettings
from cedserve.router.placement import MeasuredLinks
from cedserve.router.policy import make_policy
from cedserve.router.requests import ModelLimits, eos_ids, message_limit
from cedserve.router.tokenize_pool import TokenizePool
from cedserve.router.workers import WorkerPool

log = logging.getLogger(__name__)
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
# Onload rates of the slower cache tiers (placement's onload term) until workers report them.
_TIER_BYTES_PER_S = {"host": 2e10, "disk": 2e9}


@dataclass
class RunningRouter:
    server: grpc.aio.Server
    pool: WorkerPool
    port: int
    metrics: RouterMetrics
    health: health.aio.HealthServicer
    health_only: grpc.aio.Server | None = None
    """Plaintext listener (`RouterConfig.health_port`): health for kubelet probes, loopback-only Drain."""
    drain: RouterDrain | None = None
    discovery: Any = None
    """`KubernetesDiscovery` when `RouterConfig.discovery` is set."""
    links: MeasuredLinks | None = None
    """Per-pair KV link rates learned from completed transfers (placement reads them)."""
    metrics_port: int = -1
    """Where `/metrics` is served (-1: off)."""
    http: HttpServer | None = None
    """The OpenAI-compatible HTTP API (`RouterConfig.http_port`); None: off."""
    tokenize: TokenizePool | None = None
    """The threads large prompts are tokenized on (closed by `stop`)."""
    core: GenerationCore | None = None
    """The request path (its lease keeper and capacity queue, for tests and metrics)."""

    @property
    def http_port(self) -> int:
        """The HTTP API's bound port (-1: off)."""
        return -1 if self.http is None else self.http.port

    async def stop(self, grace_s: float = 5.0) -> None:
        if self.discovery is not None:
            await asyncio.to_thread(self.discovery.stop)
        await self.health.enter_graceful_shutdown()
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(grace_s)
        if self.health_only is not None:
            await self.health_only.stop(0)
        await self.pool.close()
        if self.tokenize is not None:
            self.tokenize.close()


async def _health_listener(config: RouterConfig, servicer: health.aio.HealthServicer, drain: RouterDrain,
                           pool: WorkerPool) -> grpc.aio.Server | None:
    """Plaintext listener for kubelet probes (they cannot speak TLS) and the loopback-only control
    services (the preStop `cedserve drain`); never the Generation API."""
    if config.health_port < 0:
        return None
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    add_control_services(server, drain, pool, config.worker_token)
    address = f"{config.host}:{config.health_port}"
    if server.add_insecure_port(address) == 0:
        raise OSError(f"router health listener could not bind {address}")
    await server.start()
    return server


def public_server_options(config: RouterConfig, limits: ModelLimits) -> list[tuple[str, int]]:
    """The public gRPC server's channel arguments: gRPC refuses a message over `message_limit`
    (RESOURCE_EXHAUSTED) from its 5-byte length prefix, before the router reads or parses it; without
    `grpc.http.tarpit` off it would hold that answer back 100-1000 ms (`RouterConfig.grpc_tarpit`)."""
    return [("grpc.max_receive_message_length", message_limit(limits, config.max_message_bytes)),
            ("grpc.http.tarpit", int(config.grpc_tarpit))]


async def start_router(config: RouterConfig) -> RunningRouter:
    """Start serving; workers are polled in the background (placement uses only healthy ones)."""
    model, codec = _served_model(config)
    block_bytes = KVAccounting.from_config(model).block_bytes(config.block_size)
    limits = ModelLimits(config.model_id, model.vocab_size, model.max_position_embeddings, config.block_size,
                         config.default_max_tokens, ChatFormat.of(codec), eos_ids(model.eos_token_id))
    metadata = token_metadata(config.worker_token)
    await asyncio.to_thread(warm_up)  # the request path's compiled loops, before the first request
    await asyncio.to_thread(lambda: codec.byte_pieces)  # the streaming text's byte table (router/text.py)
    index = GlobalPrefixIndex()
    pool = WorkerPool(config.prefill, config.decode, index, config.load_poll_s, metadata, tls=config.internal_tls)
    metrics = RouterMetrics()
    metrics.queue_prefill_tokens.set_function(pool.queued_prefill_tokens)  # read at each scrape
    metrics.queue_decode_requests.set_function(pool.queued_decode_requests)
    core = GenerationCore(pool, make_policy(config.policy, config.decode_only_max_tokens), codec, limits,
                          Admission(config.limits), metrics, config.max_retries, config.lease_ms,
                          block_bytes, metadata, links=MeasuredLinks(
                              config.default_link_bytes_per_s, config.link_rate_alpha, _TIER_BYTES_PER_S),
                          max_request_bytes=message_limit(limits, config.max_message_bytes))
    options = public_server_options(config, limits)
    health_servicer = health.aio.HealthServicer()
    drain = RouterDrain(health_servicer, ("", SERVICE_NAME), config.drain_timeout_s)
    server = grpc.aio.server(interceptors=[PublicInterceptor(config.api_keys, drain)], options=options)
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationService(core), server)  # type: ignore[no-untyped-call]
    add_control_services(server, drain, pool, config.worker_token)
    pool.on_remove.append(core.links.forget)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    address = f"{config.host}:{config.port}"
    port = add_port(server, address, config.tls, "tls")
    if port == 0:
        raise OSError(f"router could not bind {address}")
    health_only = await _health_listener(config, health_servicer, drain, pool)
    await server.start()
    http_api = await _http_api(config, core, drain)
    pool.start()
    discovery = None
    if config.discovery is not None:
        discovery = _start_discovery(config, pool)
    await drain.set_serving()
    metrics_port = -1
    if config.metrics_port is not None and config.metrics_port >= 0:
        from prometheus_client import start_http_server

        http, _thread = start_http_server(config.metrics_port, addr=config.host, registry=metrics.registry)
        metrics_port = int(http.server_port)
    return RunningRouter(server, pool, port, metrics, health_servicer, health_only, drain, discovery, core.links,
                         metrics_port, http_api, core.tokenize, core)


async def _http_api(config: RouterConfig, core: GenerationCore, drain: RouterDrain) -> HttpServer | None:
    """The OpenAI-compatible API on `config.http_port`, sharing the core, keys, TLS and drain; None when off."""
    if config.http_port < 0:
        return None
    api = HttpApi(core, drain, ApiSettings(config.model_id, config.user_cache_salt), config.api_keys,
                  core.max_request_bytes)
    return await start_http_server(api.app(), config.host, config.http_port, config.tls)


def _served_model(config: RouterConfig) -> tuple[ModelConfig, TextCodec]:
    """The model's config and tokenizer: a checkpoint's, or a preset's with the shipped tokenizer."""
    if config.checkpoint:
        model = ModelConfig.from_hf_json(config.checkpoint)
        return model, TextCodec.from_file(config.checkpoint, model.vocab_size)
    from cedserve.model.presets import preset
    from cedserve.model.tokenizer import fit_config_to_tokenizer, tiny_tokenizer_path

    assert config.preset is not None  # RouterConfig requires one of the two
    tokenizer = tiny_tokenizer_path()
    model = fit_config_to_tokenizer(preset(config.preset), tokenizer)
    return model, TextCodec.from_file(tokenizer, model.vocab_size)


def _start_discovery(config: RouterConfig, pool: WorkerPool) -> Any:
    """Kubernetes discovery, or None (a warning) when no API credentials exist: the static lists
    stay the fallback."""
    from cedserve.router.discovery import DiscoveryError, KubernetesDiscovery

    assert config.discovery is not None
    try:
        return KubernetesDiscovery.attach(pool, config.discovery, asyncio.get_running_loop())
    except DiscoveryError as exc:
        log.warning("Kubernetes discovery is off (%s); serving the static worker list only", exc)
        return None


def freeze_startup_objects() -> None:
    """Move every object alive now (modules, protobuf descriptors, the tokenizer: ~45K tracked
    objects once started) out of the garbage collector's reach. A full collection stops the event
    loop for as long as it takes to traverse what is tracked; after this it traverses only what the
    router allocated since. Called once, by the process that runs the router, after start-up."""
    gc.collect()
    gc.freeze()


async def serve_forever(config: RouterConfig, ready_file: str | None = None, worker_wait_s: float = 30.0,
                        exit_when_drained: bool = False) -> None:
    """Run until SIGTERM/SIGINT (or, with `exit_when_drained`, until a `Drain` call has finished);
    print the ready line once listening."""
    router = await start_router(config)
    try:  # serve as soon as the workers answer, so the first request finds them healthy
        await router.pool.wait_ready(worker_wait_s)
    except TimeoutError as exc:
        log.warning("%s; serving anyway (placement uses the workers that answer)", exc)
    freeze_startup_objects()
    stop = asyncio.Event()
    force = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if sig == signal.SIGINT and stop.is_set():
            force.set()  # a second Ctrl-C: do not wait for open streams
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    ready = {"role": "router", "address": f"{config.host}:{router.port}", "port": router.port,
             "metrics_port": router.metrics_port, "http_port": router.http_port}
    print(f"CEDSERVE_READY {json.dumps(ready)}", flush=True)
    if ready_file:
        Path(ready_file).write_text(json.dumps(ready))
    assert router.drain is not None
    waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(stop.wait())]
    if exit_when_drained:
        waits.append(asyncio.ensure_future(router.drain.wait_finished(None)))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    await drain_and_stop(router, force)


async def drain_and_stop(router: RunningRouter, force: asyncio.Event | None = None) -> None:
    """SIGTERM: drain (unless a Drain call already did), then stop what is left."""
    assert router.drain is not None
    await router.drain.request("SIGTERM")
    finished = asyncio.create_task(router.drain.wait_finished(None))
    waits: list[asyncio.Future[Any]] = [finished]
    if force is not None:
        waits.append(asyncio.ensure_future(force.wait()))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    log.info("router shutting down (%d streams still open)", router.drain.in_flight)
    await router.stop(0.5)
