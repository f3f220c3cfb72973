"""Build and run the router process: the public gRPC API in front of the worker pools."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cedserve.model.config import ModelConfig
from cedserve.model.kv_accounting import KVAccounting
from cedserve.model.tokenizer import TextCodec
from cedserve.proto import generation_pb2, generation_pb2_grpc
from cedserve.router.admission import Admission
from cedserve.router.auth import ApiKeyInterceptor
from cedserve.router.config import RouterConfig
from cedserve.router.frontend import GenerationService
from cedserve.router.index import GlobalPrefixIndex
from cedserve.router.metrics import RouterMetrics
from cedserve.router.policy import make_policy
from cedserve.router.requests import ModelLimits
from cedserve.router.workers import WorkerPool

log = logging.getLogger(__name__)
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass
class RunningRouter:
    server: grpc.aio.Server
    pool: WorkerPool
    port: int
    metrics: RouterMetrics
    health: health.aio.HealthServicer

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        await self.pool.close()


def _credentials(config: RouterConfig) -> grpc.ServerCredentials | None:
    if config.tls_cert is None or config.tls_key is None:
        return None
    key, cert = Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes()
    ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


async def start_router(config: RouterConfig) -> RunningRouter:
    """Start serving; workers are polled in the background (placement uses only healthy ones)."""
    model = ModelConfig.from_hf_json(config.checkpoint)
    codec = TextCodec.from_file(config.checkpoint, model.vocab_size)
    block_bytes = KVAccounting.from_config(model).block_bytes(config.block_size)
    limits = ModelLimits(config.model_id, model.vocab_size, model.max_position_embeddings, config.block_size,
                         config.default_max_tokens)
    metadata = (("x-cedserve-token", config.worker_token),) if config.worker_token else ()
    index = GlobalPrefixIndex()
    pool = WorkerPool(config.prefill, config.decode, index, config.load_poll_s, metadata)
    metrics = RouterMetrics()
    service = GenerationService(pool, make_policy(config.policy, config.decode_only_max_tokens), codec, limits,
                                Admission(config.limits), metrics, config.max_retries, config.lease_ms,
                                block_bytes, metadata)
    options = [("grpc.max_receive_message_length", config.max_message_bytes)]
    server = grpc.aio.server(interceptors=[ApiKeyInterceptor(config.api_keys)], options=options)
    generation_pb2_grpc.add_GenerationServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    address = f"{config.host}:{config.port}"
    creds = _credentials(config)
    port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"router could not bind {address}")
    await server.start()
    pool.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if config.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(config.metrics_port, addr=config.host, registry=metrics.registry)
    return RunningRouter(server, pool, port, metrics, health_servicer)


async def serve_forever(config: RouterConfig, ready_file: str | None = None, worker_wait_s: float = 30.0) -> None:
    """Run until SIGTERM/SIGINT; print the ready line once listening."""
    router = await start_router(config)
    try:  # serve as soon as the workers answer, so the first request finds them healthy
        await router.pool.wait_ready(worker_wait_s)
    except TimeoutError as exc:
        log.warning("%s; serving anyway (placement uses the workers that answer)", exc)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = {"role": "router", "address": f"{config.host}:{router.port}", "port": router.port}
    print(f"CEDSERVE_READY {json.dumps(ready)}", flush=True)
    if ready_file:
        Path(ready_file).write_text(json.dumps(ready))
    await stop.wait()
    log.info("router shutting down")
    await router.stop()
