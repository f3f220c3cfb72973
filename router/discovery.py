"""Kubernetes worker discovery: the router follows the EndpointSlices of each pool's headless Service.

The chart (helm/cedserve, docs/deploy.md) gives every pool a headless Service whose EndpointSlices,
labelled `kubernetes.io/service-name=<service>`, list the pool's pods. For each role one thread,
through the `kubernetes` client and the router's namespaced Role:

1. lists the slices (a consistent snapshot and its `resourceVersion`);
2. watches from that version: ADDED/MODIFIED replace a slice, DELETED drops it, BOOKMARK only moves
   the version on; a watch that ends (its `timeoutSeconds`, a dropped connection) resumes from the
   last version seen;
3. relists when the API server answers 410 Gone (the version was compacted away), as an HTTP status
   or as an ERROR event in the stream.

After every change the usable endpoints of all slices, deduplicated, go to `on_change(role,
endpoints)`; `attach` turns that into `WorkerPool.sync(role, endpoints, "kubernetes")` on the
router's loop. An endpoint is usable when it is `serving` (readiness, which `publishNotReadyAddresses`
does not override, unlike `ready`; `ready` when a server does not report `serving`) and not
`terminating`. Its worker id is its pod's name (`targetRef.name`); the router dials the slice's port
named `grpc`. Errors never clear the pool: the last known workers stay until the API says otherwise.
The static worker list (`--prefill`/`--decode`) is independent of discovery and stays as it is.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cedserve.router.config import DiscoveryConfig, WorkerEndpoint
from cedserve.router.workers import WorkerPool

log = logging.getLogger(__name__)
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SOURCE = "kubernetes"
_HTTP_GONE = 410


class DiscoveryError(RuntimeError):
    """Discovery cannot start (no `kubernetes` package, no credentials)."""


def _usable(conditions: Mapping[str, Any] | None) -> bool:
    conditions = conditions or {}
    serving = conditions.get("serving")
    if serving is None:
        serving = conditions.get("ready")
    return serving is not False and not conditions.get("terminating", False)


def _host_port(address: str, address_type: str, port: int) -> str:
    return f"[{address}]:{port}" if address_type == "IPv6" else f"{address}:{port}"


def slice_endpoints(slice_: Mapping[str, Any], service: str, port_name: str) -> list[WorkerEndpoint]:
    """Usable endpoints of one EndpointSlice (JSON as the API serves it)."""
    port = next((p.get("port") for p in slice_.get("ports") or () if p.get("name") == port_name), None)
    if port is None:
        return []
    out = []
    for ep in slice_.get("endpoints") or ():
        addresses = ep.get("addresses") or ()
        if not addresses or not _usable(ep.get("conditions")):
            continue
        ref = ep.get("targetRef") or {}
        pod = ref.get("name") if ref.get("kind", "Pod") == "Pod" else None
        worker_id = str(pod) if pod else f"{service}-{addresses[0]}"
        out.append(WorkerEndpoint(worker_id, _host_port(addresses[0], slice_.get("addressType", "IPv4"), int(port))))
    return out


def merge_endpoints(slices: Iterable[Mapping[str, Any]], service: str, port_name: str) -> list[WorkerEndpoint]:
    """Usable endpoints of all slices of a Service, one per worker id, sorted by id. (During a slice
    split a pod may appear twice; the first slice by name wins.)"""
    seen: dict[str, WorkerEndpoint] = {}
    for s in sorted(slices, key=lambda s: str(s.get("metadata", {}).get("name", ""))):
        for ep in slice_endpoints(s, service, port_name):
            seen.setdefault(ep.worker_id, ep)
    return [seen[w] for w in sorted(seen)]


class _ServiceWatch:
    """List + watch of one Service's EndpointSlices, on a daemon thread."""

    def __init__(self, api: Any, config: DiscoveryConfig, role: str, service: str,
                 on_change: Callable[[str, list[WorkerEndpoint]], None], stop: threading.Event) -> None:
        self.api, self.config, self.role, self.service = api, config, role, service
        self.on_change, self.stop = on_change, stop
        self.selector = f"{SERVICE_NAME_LABEL}={service}"
        self.slices: dict[str, dict[str, Any]] = {}
        self.published: list[WorkerEndpoint] | None = None
        self.relists = 0
        self._resp: Any = None
        self.thread = threading.Thread(target=self.run, daemon=True, name=f"discovery-{role}")

    def run(self) -> None:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        while not self.stop.is_set():
            try:
                version = self._list()
                self._watch(version)
            except ApiException as exc:
                if exc.status == _HTTP_GONE:
                    log.info("discovery of %s: resource version expired; listing again", self.service)
                    continue
                self._backoff(f"API error {exc.status} {exc.reason}")
            except (HTTPError, OSError, ValueError, AttributeError) as exc:
                # AttributeError: urllib3 reading a response that `close` shut from another thread.
                if self.stop.is_set():
                    return
                self._backoff(f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Unblock a watch read (called from another thread after `stop` is set). Shutting the
        socket down wakes the reading thread; closing the response would wait for its lock."""
        sock = getattr(getattr(self._resp, "connection", None), "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed: nothing to wake
                log.debug("shutting the watch of %s down", self.service, exc_info=True)

    def _backoff(self, why: str) -> None:
        log.warning("discovery of %s in %s: %s; keeping the last known workers, retrying in %.0f s",
                    self.service, self.config.namespace, why, self.config.retry_s)
        self.stop.wait(self.config.retry_s)

    def _list(self) -> str:
        resp = self.api.list_namespaced_endpoint_slice(self.config.namespace, label_selector=self.selector,
                                                       _preload_content=False, _request_timeout=30)
        body = json.loads(resp.data)
        self.relists += 1
        self.slices = {item["metadata"]["name"]: item for item in body.get("items") or ()}
        self._publish()
        return str(body.get("metadata", {}).get("resourceVersion", ""))

    def _watch(self, version: str) -> None:
        from kubernetes.client.exceptions import ApiException
        from kubernetes.watch.watch import iter_resp_lines

        while not self.stop.is_set():
            resp = self.api.list_namespaced_endpoint_slice(
                self.config.namespace, label_selector=self.selector, watch=True, resource_version=version,
                allow_watch_bookmarks=True, timeout_seconds=self.config.watch_timeout_s, _preload_content=False,
                _request_timeout=(10, self.config.watch_timeout_s + 15))
            self._resp = resp
            try:
                for line in iter_resp_lines(resp):  # type: ignore[no-untyped-call]
                    if self.stop.is_set():
                        return
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        raise ApiException(status=int(obj.get("code", 500)),
                                           reason=f"{obj.get('reason')}: {obj.get('message')}")
                    version = str(obj.get("metadata", {}).get("resourceVersion", version))
                    self._apply(str(event.get("type")), obj)
            finally:
                self._resp = None
                resp.release_conn()

    def _apply(self, kind: str, obj: dict[str, Any]) -> None:
        name = obj.get("metadata", {}).get("name")
        if kind == "BOOKMARK" or not name:
            return
        if kind == "DELETED":
            self.slices.pop(name, None)
        elif kind in ("ADDED", "MODIFIED"):
            self.slices[name] = obj
        self._publish()

    def _publish(self) -> None:
        endpoints = merge_endpoints(self.slices.values(), self.service, self.config.port_name)
        if endpoints != self.published:
            self.published = endpoints
            log.info("discovery: %s workers of %s: %s", self.role, self.service,
                     ", ".join(f"{e.worker_id}@{e.address}" for e in endpoints) or "none")
            self.on_change(self.role, endpoints)


def api_from_environment() -> Any:
    """A `DiscoveryV1Api` from the in-cluster service account, else `$KUBECONFIG` / ~/.kube/config."""
    try:
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException
    except ImportError as exc:
        raise ImportError("Kubernetes discovery needs the `kubernetes` package: pip install 'cedserve[k8s]'") from exc
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    except ConfigException:
        try:
            config.load_kube_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except (ConfigException, OSError) as exc:
            raise DiscoveryError(f"no in-cluster service account and no usable kubeconfig: {exc}") from exc
    return api_for(configuration)


def api_for(configuration: Any) -> Any:
    """A `DiscoveryV1Api` for a `kubernetes.client.Configuration` (e.g. a test server's host)."""
    from kubernetes import client

    return client.DiscoveryV1Api(client.ApiClient(configuration))


class KubernetesDiscovery:
    """One watch thread per role; `on_change(role, endpoints)` runs on those threads."""

    def __init__(self, config: DiscoveryConfig, on_change: Callable[[str, list[WorkerEndpoint]], None],
                 api: Any = None) -> None:
        self.config = config
        self.api = api if api is not None else api_from_environment()
        self._stop = threading.Event()
        self.watches = [_ServiceWatch(self.api, config, role, service, on_change, self._stop)
                        for role, service in sorted(config.services.items())]

    def start(self) -> None:
        for w in self.watches:
            w.thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        for w in self.watches:
            w.close()
        for w in self.watches:
            if w.thread.is_alive():
                w.thread.join(timeout_s)

    @classmethod
    def attach(cls, pool: WorkerPool, config: DiscoveryConfig, loop: asyncio.AbstractEventLoop,
               api: Any = None) -> KubernetesDiscovery:
        """Discovery that keeps `pool`'s Kubernetes-sourced workers equal to the usable endpoints."""

        def on_change(role: str, endpoints: list[WorkerEndpoint]) -> None:
            try:
                loop.call_soon_threadsafe(pool.sync, role, endpoints, SOURCE)
            except RuntimeError:  # the router's loop has closed: it is shutting down
                log.debug("discovery change after the router stopped: %s", endpoints)

        discovery = cls(config, on_change, api)
        discovery.start()
        return discovery
