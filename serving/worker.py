"""The worker process skeleton: what the prefill and the decode worker mains are both built from.

A worker main, in order:

1. `read_worker_files(opts)`: the `--config` file with the `--tls-*` flags applied: the serve config,
   the role's own table (`[prefill]` or `[decode]`, decoded by the role) and the KV-transfer config;
   `worker_id(opts, configured)` names the worker.
2. `claim_share(device, fraction)` (`serving/gpu_memory.py`): on a GPU, the process's memory cap;
   `load_model(opts, serve, device)`: the served model (checkpoint or preset), checked against the
   cache geometry; `check_gpu_share(...)`: what the worker will hold fits its share (a clear error
   naming the fields otherwise), before the block pool is allocated.
3. `build_kv_plane(...)`: the block pool (`ServeConfig.cache`) and its cache manager (publishing KV events to a feed), a
   metrics registry of the process's own, and the NIXL agent registering the whole pool.
4. `build_server(...)`: the gRPC server (health, the worker-plane token, `Lifecycle`) and the drain
   controller; the role adds its engine and service, starts, prints its ready line.
5. `serve_until_drained(...)`: reports liveness until a drain is requested (SIGTERM, or `Drain`
   from the preStop hook), drains (`drain_requests`: no new requests, in-flight ones finish until
   the drain deadline, the rest are handed back and get `HAND_BACK_WAIT_S` to end), then keeps
   answering health checks until told to exit. The main then stops its parts
   (`stop_serving`, its engine, `KVPlane.close`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
import torch
from prometheus_client import CollectorRegistry

from cedserve.common.tls import TLSConfig
from cedserve.kv_transfer.agent import NixlTransferAgent
from cedserve.kv_transfer.config import KVTransferConfig, kv_transfer_config_from_table
from cedserve.kv_transfer.metrics import TransferMetrics
from cedserve.kv_transfer.region import KVLayout, KVRegion
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.cache.manager import KVCacheManager
from cedserve.serving.config import ModelSource, ServeConfig
from cedserve.serving.drain import DrainController, add_lifecycle
from cedserve.serving.gpu_memory import (
    GIB,
    GpuShare,
    MemoryNeed,
    activation_bytes,
    check_fits,
    module_bytes,
    staging_bytes,
)
from cedserve.serving.kv_events import KVEventFeed
from cedserve.serving.server import GrpcServer, Health
from cedserve.serving.worker_model import LoadedModel, load_worker_model

log = logging.getLogger(__name__)

HAND_BACK_WAIT_S = 5.0
"""After the drain deadline, how long the handed-back requests get to end (transfers aborted, streams
closed with UNAVAILABLE) before the drain reports what is left."""
DRAIN_POLL_S = 0.05
HEALTH_POLL_S = 1.0
"""How often liveness is refreshed while serving and after a drain."""


@dataclass(frozen=True)
class WorkerOptions:
    """`cedserve worker` flags (docs/deploy.md); a flag overrides the same setting of `--config`."""

    role: str
    config: str | None = None
    checkpoint: str | None = None
    preset: str | None = None
    """Random weights of a named preset (`tiny`, `mini-40`) when no checkpoint is given."""
    seed: int = 0
    """Seed of the preset's random weights (both sides of a transfer must use the same)."""
    dtype: str | None = None
    """`--dtype`: the weights' dtype, over the config file's `[model] dtype` (None: not given)."""
    host: str = "127.0.0.1"
    grpc_port: int = 0
    nixl_port: int = 0
    metrics_port: int = -1
    """-1: no metrics endpoint; 0: a free port (reported in the ready line)."""
    dist_port: int = 29500
    advertise_host: str | None = None
    group_size: int = 1
    rank: int = 0
    leader_address: str | None = None
    worker_id: str | None = None
    health_port: int = -1
    """Plaintext listener for kubelet probes (they cannot speak TLS) and the loopback-only Drain;
    -1: none."""
    tls_cert: str | None = None
    """`--tls-*` flags: override the config file's `[internal_tls]` fields (None: not given)."""
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_require_client_cert: bool | None = None
    tls_server_name: str | None = None

    def internal_tls(self, from_file: TLSConfig) -> TLSConfig:
        """The worker's `[internal_tls]` with the flags applied."""
        return from_file.override(cert=self.tls_cert, key=self.tls_key, ca=self.tls_ca,
                                  require_client_cert=self.tls_require_client_cert, server_name=self.tls_server_name)

    @property
    def public_host(self) -> str:
        """The host peers and the router use for this process."""
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    def check(self) -> None:
        if self.group_size < 1 or not 0 <= self.rank < self.group_size:
            raise ValueError(f"--rank {self.rank} is not in [0, --group-size {self.group_size})")


def read_serve_file(path: str | Path | None, sections: tuple[str, ...]) -> tuple[ServeConfig, dict[str, Any]]:
    """`ServeConfig` from a `.toml`/`.json` file (defaults when `path` is None) and the raw tables of
    `sections`, removed before ServeConfig (which forbids unknown fields) decodes the rest."""
    if path is None:
        return ServeConfig(), {}
    return ServeConfig.load_with_sections(path, sections)


@dataclass(frozen=True)
class WorkerFiles:
    """A worker's `--config` file after its flags: what every role reads the same way."""

    serve: ServeConfig
    """With `internal_tls` overridden by the `--tls-*` flags."""
    role_table: dict[str, Any]
    """The role's own table (`[prefill]`, `[decode]`), raw: the role decodes it."""
    kv_transfer: KVTransferConfig


def read_worker_files(opts: WorkerOptions) -> WorkerFiles:
    serve, extra = read_serve_file(opts.config, (opts.role, "kv_transfer"))
    serve = msgspec.structs.replace(serve, internal_tls=opts.internal_tls(serve.internal_tls))
    kv = kv_transfer_config_from_table(extra.get("kv_transfer", {}), opts.public_host, opts.nixl_port,
                                       serve.internal_tls)
    return WorkerFiles(serve, extra.get(opts.role, {}), kv)


def worker_id(opts: WorkerOptions, configured: str | None) -> str:
    """`--worker-id`, else the config file's, else `<role>-<host>-<pid>`."""
    return opts.worker_id or configured or f"{opts.role}-{socket.gethostname()}-{os.getpid()}"


def model_source(opts: WorkerOptions, serve: ServeConfig) -> ModelSource:
    """`--checkpoint` / `--preset` / `--dtype` over the config file's `[model]`."""
    return ModelSource(preset=opts.preset or serve.model.preset, checkpoint=opts.checkpoint or serve.model.checkpoint,
                       dtype=opts.dtype or serve.model.dtype, engram=serve.model.engram)


def load_model(source: ModelSource, seed: int, serve: ServeConfig, device: str) -> LoadedModel:
    """The served model (weights in `source.dtype` resolved for `device`), its config checked against
    the cache geometry."""
    dtype = source.weights_dtype(device)
    log.info("model weights in %s (config `[model] dtype` %s, device %s)", dtype, source.dtype, device)
    loaded = load_worker_model(source.checkpoint, source.preset, seed, device, dtype, source.engram)
    serve.validate_against(loaded.model.config)
    return loaded


def worker_memory_need(role: str, loaded: LoadedModel, serve: ServeConfig, kv_transfer: KVTransferConfig,
                       rows: int, rows_field: str, extra: tuple[tuple[str, int, str], ...] = (),
                       modules: tuple[torch.nn.Module | None, ...] = ()) -> MemoryNeed:
    """What a worker will hold on its GPU: the weights (`loaded` and `modules`, e.g. the drafter),
    the block pool, the transfer's staging buffer, the role's `extra` parts, and one pass of `rows`
    token rows (sized by `[role] rows_field`)."""
    config = loaded.model.config
    block_bytes = BlockLayout.from_config(config, serve.cache.block_size).block_bytes
    parts = (("weights", module_bytes((loaded.model, *modules)), "[model] checkpoint (a smaller model)"),
             ("block pool", serve.cache.num_blocks * block_bytes, "[cache] num_blocks"),
             ("KV staging", staging_bytes(kv_transfer), "[kv_transfer] staging_slots"),
             *extra,
             ("activations (estimate)", activation_bytes(config, rows), f"[{role}] {rows_field}"))
    return MemoryNeed(tuple(p for p in parts if p[1] > 0))


def check_gpu_share(role: str, share: GpuShare | None, need: MemoryNeed) -> None:
    """`check_fits` on a GPU (nothing on a CPU), logging the need against the share."""
    if share is None:
        return
    log.info("%s worker on %s: needs %.2f GiB (%s) of a %.2f GiB share", role, share.device,
             need.total_bytes / GIB, need.describe(), share.budget_bytes / GIB)
    check_fits(role, share, need)


@dataclass
class KVPlane:
    """A worker's KV side: the paged pool and its cache manager, the feed of its KV events, the
    process's metrics registry, the NIXL agent registering the whole pool."""

    layout: BlockLayout
    feed: KVEventFeed
    cache: KVCacheManager
    registry: CollectorRegistry
    agent: NixlTransferAgent

    def close(self) -> None:
        """Release the agent, then the pool (after the server and the engine have stopped)."""
        self.agent.close()
        self.cache.close()


def build_kv_plane(loaded: LoadedModel, serve: ServeConfig, kv_transfer: KVTransferConfig, device: str,
                   cache_id: str, agent_name: str, publish_events: bool = True) -> KVPlane:
    """`publish_events`: the cache's events go to the feed (the group leader's; a follower rank's
    cache mirrors the leader's and publishes nothing)."""
    config, block_size = loaded.model.config, serve.cache.block_size
    layout = BlockLayout.from_config(config, block_size)
    feed = KVEventFeed()
    cache = KVCacheManager(layout, serve.cache, cache_id, device,
                           event_sink=feed.publish if publish_events else None)
    registry = CollectorRegistry(auto_describe=True)
    agent = NixlTransferAgent(kv_transfer, KVRegion(cache.pool.storage, layout.block_bytes),
                              KVLayout.from_config(config, block_size, model_id=loaded.model_id,
                                                   weights_dtype=loaded.weights_dtype), agent_name,
                              metrics=TransferMetrics(registry))
    return KVPlane(layout, feed, cache, registry, agent)


def build_server(opts: WorkerOptions, serve: ServeConfig, drain_timeout_s: float,
                 max_workers: int = 16) -> tuple[GrpcServer, DrainController]:
    """The bound (not started) gRPC server with `Lifecycle`, and the drain controller behind it."""
    server = GrpcServer(opts.host, opts.grpc_port, max_workers=max_workers, tls=serve.internal_tls,
                        health_port=opts.health_port, token=serve.internal_token())
    drain = DrainController(server.health, drain_timeout_s)
    add_lifecycle(server, drain)
    return server, drain


def stop_serving(server: GrpcServer, feed: KVEventFeed) -> None:
    """End the KV event streams and stop the server (the engine and the KV plane stop after)."""
    feed.close()
    server.stop(grace_s=1.0)


# ------------------------------------------------------------------ draining


class Drainable(Protocol):
    """What a worker drains: its engine (prefill) or its group (decode)."""

    def stop_accepting(self) -> None:
        """Take no new requests from now on."""

    def in_flight(self) -> int:
        """Requests still running."""

    def hand_back(self) -> None:
        """End every running request with UNAVAILABLE (the router re-places it); returns at once."""


def drain_requests(target: Drainable, drain: DrainController) -> bool:
    """Stop accepting, let in-flight requests finish until the drain deadline, hand back the rest;
    report to `drain`. True when nothing had to be handed back."""
    target.stop_accepting()
    while target.in_flight() and time.monotonic() < drain.deadline_s:
        time.sleep(DRAIN_POLL_S)
    left = target.in_flight()
    if left:
        log.warning("drain deadline: handing back %d requests", left)
        target.hand_back()
        end = time.monotonic() + HAND_BACK_WAIT_S
        while target.in_flight() and time.monotonic() < end:
            time.sleep(DRAIN_POLL_S)
    drain.finish(left == 0, target.in_flight())
    return left == 0


def serve_until_drained(drain: DrainController, health: Health, alive: Callable[[], bool],
                        target: Drainable, failed: Callable[[], bool] | None = None) -> bool:
    """Refresh liveness until a drain is requested, drain `target`, then keep answering health
    checks until the process is told to exit. True when nothing had to be handed back; the caller
    stops its parts. `failed()` True (the engine's thread died): return False at once, not alive, so
    the process exits and its supervisor starts it again (`cedserve serve`; a pod's liveness probe
    would only notice after its period)."""
    while not drain.wait_requested(HEALTH_POLL_S):
        if failed is not None and failed():
            health.set_alive(False)
            health.set_ready(False)
            return False
        health.set_alive(alive())
    drained = drain_requests(target, drain)
    while not drain.wait_exit(HEALTH_POLL_S):
        health.set_alive(alive())
    return drained
