"""A boundary fake of the Kubernetes API server: EndpointSlice list and watch, over real HTTP.

Speaks what the `kubernetes` client sends for `DiscoveryV1Api.list_namespaced_endpoint_slice`:

    GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=k=v[,k=v]
        -> EndpointSliceList with metadata.resourceVersion
    ... &watch=true&resourceVersion=N&timeoutSeconds=T[&allowWatchBookmarks=true]
        -> chunked JSON lines {"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...} for every
           change after N, then live ones until T seconds pass or `drop_watches()`

Resource versions are one counter over the whole store. `compact()` forgets the history: a watch
from an older version gets 410 Gone, as an ERROR event (what the API server does) or, with
`gone_as_status`, as the HTTP status; clients must list again. Every request is logged in
`requests` as (path, query) so tests can see relists.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

_PREFIX = "/apis/discovery.k8s.io/v1/namespaces/"


@dataclass(frozen=True)
class Pod:
    """One endpoint of a slice."""

    name: str
    ip: str
    serving: bool = True
    terminating: bool = False


def endpoint_slice(namespace: str, name: str, service: str, pods: list[Pod], port: int,
                   port_name: str = "grpc") -> dict[str, Any]:
    """An EndpointSlice as a headless Service with publishNotReadyAddresses has it: `ready` true
    unless terminating, `serving` the pod's readiness."""
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": name, "namespace": namespace, "labels": {"kubernetes.io/service-name": service}},
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [p.ip],
                       "conditions": {"ready": not p.terminating, "serving": p.serving, "terminating": p.terminating},
                       "targetRef": {"kind": "Pod", "name": p.name, "namespace": namespace}} for p in pods],
    }


class FakeKubeAPI:
    def __init__(self, gone_as_status: bool = False) -> None:
        self.gone_as_status = gone_as_status
        self.requests: list[tuple[str, dict[str, str]]] = []
        self._cond = threading.Condition()
        self._version = 100
        self._oldest = 100  # watches from below this version get 410
        self._objects: dict[tuple[str, str], dict[str, Any]] = {}
        self._history: list[tuple[int, str, dict[str, Any]]] = []
        self._generation = 0  # bumped by drop_watches
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self.drop_watches()
        self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------------ store

    def put(self, obj: dict[str, Any]) -> None:
        """Create or replace an object (ADDED or MODIFIED)."""
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        with self._cond:
            kind = "MODIFIED" if key in self._objects else "ADDED"
            self._record(kind, obj)
            self._objects[key] = obj

    def delete(self, namespace: str, name: str) -> None:
        with self._cond:
            obj = self._objects.pop((namespace, name))
            self._record("DELETED", obj)

    def compact(self) -> None:
        """Forget the history, up to and including the newest version: a watch from any version a
        client has seen gets 410 Gone, even one fully up to date (else whether the client must
        relist would depend on whether it had seen the last event: a race in the tests)."""
        with self._cond:
            self._history.clear()
            self._version += 1
            self._oldest = self._version + 1

    def drop_watches(self) -> None:
        """End every open watch (as an API server restart does)."""
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def count(self, watch: bool) -> int:
        """Requests seen: lists (watch=False) or watches."""
        return sum(1 for _, q in self.requests if (q.get("watch") == "true") == watch)

    def _record(self, kind: str, obj: dict[str, Any]) -> None:
        self._version += 1
        obj["metadata"]["resourceVersion"] = str(self._version)
        self._history.append((self._version, kind, json.loads(json.dumps(obj))))
        self._cond.notify_all()

    # ------------------------------------------------------------------ HTTP

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                api.requests.append((url.path, query))
                parts = url.path[len(_PREFIX):].split("/") if url.path.startswith(_PREFIX) else []
                if len(parts) != 2 or parts[1] != "endpointslices":
                    return self._json(404, _status(404, "NotFound", f"no route {url.path}"))
                if query.get("watch") == "true":
                    return self._watch(parts[0], query)
                with api._cond:
                    items = [o for (ns, _), o in api._objects.items() if ns == parts[0] and _selects(query, o)]
                    body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                            "metadata": {"resourceVersion": str(api._version)}, "items": items}
                self._json(200, body)

            def _json(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _chunk(self, event: dict[str, Any]) -> None:
                data = json.dumps(event).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def _watch(self, namespace: str, query: dict[str, str]) -> None:
                since = int(query.get("resourceVersion") or 0)
                deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
                with api._cond:
                    gone = since + 1 < api._oldest
                    generation = api._generation
                if gone and api.gone_as_status:
                    return self._json(410, _status(410, "Expired", f"too old resource version: {since}"))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    if gone:
                        self._chunk({"type": "ERROR", "object": _status(410, "Expired",
                                                                        f"too old resource version: {since}")})
                    else:
                        self._stream(namespace, query, since, deadline, generation)
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass
                self.close_connection = True

            def _stream(self, namespace: str, query: dict[str, str], since: int, deadline: float,
                        generation: int) -> None:
                sent = since
                while True:
                    with api._cond:
                        while (api._generation == generation and time.monotonic() < deadline
                               and not any(v > sent for v, _, _ in api._history)):
                            api._cond.wait(max(0.0, deadline - time.monotonic()))
                        if api._generation != generation or sent + 1 < api._oldest:
                            return
                        pending = [(v, k, o) for v, k, o in api._history if v > sent]
                        version = api._version
                    for v, kind, obj in pending:
                        sent = v
                        if obj["metadata"]["namespace"] == namespace and _selects(query, obj):
                            self._chunk({"type": kind, "object": obj})
                    if time.monotonic() >= deadline:
                        if query.get("allowWatchBookmarks") == "true":
                            self._chunk({"type": "BOOKMARK", "object": {
                                "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                                "metadata": {"resourceVersion": str(version)}}})
                        return

        return Handler


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason,
            "message": message}


def _selects(query: dict[str, str], obj: dict[str, Any]) -> bool:
    """Equality-based `labelSelector` (k=v, comma-separated), the only kind the router sends."""
    labels = obj.get("metadata", {}).get("labels", {})
    for term in filter(None, query.get("labelSelector", "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True
