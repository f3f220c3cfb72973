"""kill -9 under load: `cedserve bench held --scenarios kill` and the chaos e2e test.

Against a real, supervised `cedserve serve` (cedserve/supervise.py), each round:

1. waits until the system serves and no worker holds a block (the baseline);
2. starts `clients` threads that each send short streamed requests one after another, a fresh
   channel per request (as independent clients would; a router restarted on its port is reached at
   once, without a channel's reconnect backoff);
3. after `lead_s`, kill -9 of one process of the kind (router, prefill worker, decode worker), found
   by this system's log folder in its command line, never by name (other systems may run here);
4. keeps the load on until a request sent after the kill has completed and the killed part is back
   (for a worker: the router lists it healthy again), then stops the load and waits for every
   request to end;
5. reads every worker's held blocks (`GetLoad`, the same count as the `cedserve_decode_held_blocks`
   and `cedserve_prefill_held_blocks` gauges) until they are back to the baseline.

Per round it reports:
- `detected_s`: kill to the system acting on the death. A worker: the router lists it unhealthy (or
  replaced by its restart, whichever it shows first; polled every 20 ms). The router: every
  client whose request was in flight has its status (their streams break).
- `inflight_ended_s`: kill to the last request that was in flight at the kill ending, with its
  outcome; `inflight` counts them by status.
- `serving_again_s`: kill to the first completion of a request sent after the kill.
- `restored_s`: kill to the killed part serving again (its worker id healthy in the router's list
  under a new process; the router: answering that list).
- `blocks_back_s`: the load's end to every worker's held blocks back to the baseline; None (a leak)
  when not within `blocks_give_up_s`, with `held_blocks` as last read.
- router kills only: `orphans_freed_s`, the kill to every worker's held blocks back to the baseline
  (read from the workers directly, every 50 ms): what the dead router left held (leases between
  Reserve and Decode) coming back by lease expiry. Measured while the router is down; None when it
  had not come back by the time the restarted router answered (its new load then mixes in). With
  `pause_for_orphans` the load sends nothing new from the kill until then (at most `give_up_s`), so
  the figure is exact however fast the router restarts, and `serving_again_s` includes that pause.
  `orphan_blocks`: the most blocks held above the baseline from 0.5 s after the kill (in-flight
  decodes end at once: their streams break).
- `no_status`: requests that ended with neither a completion nor a status (must be 0).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from cedserve.client import CedserveError, Client
from cedserve.common.credentials import token_metadata
from cedserve.launcher import TOKEN_FILE_NAME
from cedserve.proto import worker_pb2, worker_pb2_grpc

KINDS = ("router", "prefill", "decode")
KILL_PROMPT = "def quicksort(items):\n    "


class ServeProcess:
    """A `cedserve serve` process started here, and its processes found through its log folder."""

    def __init__(self, root: Path, checkpoint: Path | None, *extra: str, start_timeout_s: float = 300.0) -> None:
        self.root = root
        self.log_dir = root / "logs"
        self.out, self.err = root / "serve.out", root / "serve.err"
        root.mkdir(parents=True, exist_ok=True)
        with_checkpoint = ["--checkpoint", str(checkpoint)] if checkpoint is not None else []
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cedserve.cli", "serve", *with_checkpoint, "--port", "0", "--http-port", "0",
                 "--device", "cpu", "--log-dir", str(self.log_dir), *extra],
                stdout=out, stderr=err, start_new_session=True)
        self.address = self._wait_address(start_timeout_s)
        self.token = (self.log_dir / "run" / TOKEN_FILE_NAME).read_text().strip()

    def _wait_address(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.out.read_text().splitlines():
                if line.startswith("cedserve is serving on "):
                    return line.split()[4]
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"cedserve serve did not start: {self.err.read_text()[-3000:]}")

    def http_port(self) -> int:
        """The OpenAI-compatible HTTP API's port, from the start-up lines."""
        for line in self.out.read_text().splitlines():
            if line.startswith("OpenAI-compatible HTTP API: "):
                return int(line.rsplit(":", 1)[1].split("/")[0])
        raise RuntimeError("no HTTP API line")

    def processes(self) -> dict[int, str]:
        return processes_under(self.log_dir)

    def pid(self, needle: str) -> int:
        return pid_under(self.log_dir, needle)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def processes_under(log_dir: Path) -> dict[int, str]:
    """The processes whose command line names `log_dir` (a system's own): pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(log_dir) in cmdline:
            found[int(entry.name)] = cmdline
    return found


def pid_under(log_dir: Path, needle: str) -> int:
    """The pid of the system's cedserve process whose command line holds `needle`."""
    for pid, cmdline in processes_under(log_dir).items():
        if needle in cmdline and "cedserve.cli" in cmdline:
            return pid
    raise LookupError(f"no cedserve process with {needle!r} under {log_dir}")


KIND_NEEDLE = {"router": " router ", "prefill": "--worker-id prefill0", "decode": "--worker-id decode0"}
"""How a kind's first process is told apart in the embedded system's command lines."""
KIND_WORKER_ID = {"prefill": "prefill0", "decode": "decode0"}


@dataclass
class Sent:
    """One request of the load: when it was sent and ended (monotonic), and how."""

    start: float
    end: float = 0.0
    status: str = ""
    """"OK", a gRPC code name, or "NO_STATUS" (the stream ended with neither)."""


@dataclass
class Load:
    """`clients` threads sending `KILL_PROMPT` one request after another until stopped; with
    `prompt_tokens`, a fresh random prompt of that many token ids each (nothing cached: every one
    goes through a prefill worker, between its decode lease and its Decode call for a while)."""

    address: str
    clients: int
    max_tokens: int
    prompt_tokens: int = 0
    timeout_s: float = 60.0
    sent: list[Sent] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    paused: threading.Event = field(default_factory=threading.Event)
    """Set: the clients send nothing new until it is cleared."""
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._client, daemon=True, name=f"load-{i}")
                         for i in range(self.clients)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Stop sending and wait for the requests in flight to end."""
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 10)

    def snapshot(self) -> list[Sent]:
        with self._lock:
            return list(self.sent)

    def _client(self) -> None:
        while not self._stop.is_set():
            if self.paused.is_set():
                time.sleep(0.02)
                continue
            one = Sent(time.monotonic())
            with self._lock:
                self.sent.append(one)
            one.status = self._send()
            one.end = time.monotonic()
            if one.status != "OK":
                time.sleep(0.05)  # a system that refuses at once is not flooded in a tight loop

    def _send(self) -> str:
        prompt: str | list[int] = KILL_PROMPT
        if self.prompt_tokens:
            prompt = [random.randrange(3, 500) for _ in range(self.prompt_tokens)]
        try:
            with Client(self.address, timeout_s=self.timeout_s) as client:
                for _ in client.stream(prompt, max_tokens=self.max_tokens):
                    pass
                return "OK" if client.last is not None else "NO_STATUS"
        except CedserveError as exc:
            return str(exc.code.name)


def held_blocks(address: str, token: str) -> dict[str, int] | None:
    """Blocks each healthy worker holds for requests (`LoadReport.held_blocks`); None when the router
    or a worker listed healthy does not answer."""
    from cedserve.router.lifecycle import list_workers

    out = {}
    try:
        for w in list_workers(address, timeout_s=5.0, token=token):
            if not w["healthy"]:
                continue
            with grpc.insecure_channel(w["address"]) as channel:
                stub: Any = (worker_pb2_grpc.DecodeWorkerStub(channel) if w["role"] == "decode"  # type: ignore[no-untyped-call]
                             else worker_pb2_grpc.PrefillWorkerStub(channel))  # type: ignore[no-untyped-call]
                load = stub.GetLoad(worker_pb2.LoadRequest(), timeout=5.0, metadata=token_metadata(token))
            out[w["worker_id"]] = int(load.held_blocks)
    except grpc.RpcError:
        return None
    return out


def _workers(address: str, token: str) -> dict[str, tuple[bool, str]] | None:
    """worker id -> (healthy, address) as the router lists them; None when the router does not answer."""
    from cedserve.router.lifecycle import list_workers

    try:
        return {w["worker_id"]: (bool(w["healthy"]), str(w["address"]))
                for w in list_workers(address, timeout_s=2.0, token=token)}
    except grpc.RpcError:
        return None


class _Watch:
    """Polls the router's worker list from a thread during a round: when the killed part was seen
    down, and when it was back."""

    def __init__(self, address: str, token: str, kind: str, before: dict[str, tuple[bool, str]]) -> None:
        self.address, self.token, self.kind = address, token, kind
        self.worker_id = KIND_WORKER_ID.get(kind, "")
        self.old_address = before.get(self.worker_id, (True, ""))[1]
        self.down_at: float | None = None
        self.back_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="chaos-watch")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(0.02) and self.back_at is None:
            workers = _workers(self.address, self.token)
            now = time.monotonic()
            if self.kind == "router":
                if workers is None and self.down_at is None:
                    self.down_at = now
                elif workers is not None and self.down_at is not None:
                    self.back_at = now
                continue
            if workers is None:
                continue
            healthy, address = workers.get(self.worker_id, (False, ""))
            moved = address != self.old_address
            if self.down_at is None and (not healthy or moved):
                self.down_at = now
            if healthy and moved:
                self.back_at = now


def kill_round(address: str, token: str, log_dir: Path, kind: str, clients: int, max_tokens: int,
               lead_s: float = 1.5, give_up_s: float = 60.0, blocks_give_up_s: float = 40.0,
               prompt_tokens: int = 0, pause_for_orphans: bool = False) -> dict[str, Any]:
    """One round (module docstring): kill -9 of `kind`'s process under `clients` streams of load."""
    baseline = _wait_baseline(address, token, give_up_s)
    before = _workers(address, token) or {}
    load = Load(address, clients, max_tokens, prompt_tokens)
    load.start()
    time.sleep(lead_s)
    watch = _Watch(address, token, kind, before)
    pid = pid_under(log_dir, KIND_NEEDLE[kind])
    watch.start()
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    orphans: tuple[float | None, int] = (None, 0)
    if kind == "router":
        if pause_for_orphans:
            load.paused.set()
        orphans = _orphans_freed(before, token, baseline, killed, None if pause_for_orphans else watch, give_up_s)
        load.paused.clear()
    try:
        serving = _wait_for(lambda: _first_ok_after(load.snapshot(), killed), killed, give_up_s)
        _wait_for(lambda: watch.back_at, killed, give_up_s)
    finally:
        watch.stop()
        load.stop()
    stopped = time.monotonic()
    blocks_back, last = _wait_blocks(address, token, baseline, blocks_give_up_s)
    sent = load.snapshot()
    inflight = [s for s in sent if s.start < killed and (s.end == 0.0 or s.end > killed)]
    inflight_end = max((s.end for s in inflight), default=killed)
    detected = watch.down_at
    if kind == "router":  # the clients in flight are the ones to learn of it
        detected = inflight_end if all(s.status != "NO_STATUS" and s.end for s in inflight) else None
    return {
        "kind": kind, "pid": pid, "requests": len(sent), "status": dict(Counter(s.status for s in sent)),
        "inflight": dict(Counter(s.status for s in inflight)),
        "no_status": sum(1 for s in sent if s.status in ("", "NO_STATUS")),
        "detected_s": _since(killed, detected), "inflight_ended_s": _since(killed, inflight_end),
        "serving_again_s": _since(killed, serving), "restored_s": _since(killed, watch.back_at),
        "blocks_back_s": _since(stopped, blocks_back), "held_blocks": last, "baseline_held_blocks": baseline,
        **({"orphans_freed_s": _since(killed, orphans[0]), "orphan_blocks": orphans[1]} if kind == "router" else {}),
    }


def _worker_load(address: str, token: str) -> worker_pb2.LoadReport | None:
    """A worker's load report, whichever its role (None when it does not answer)."""
    with grpc.insecure_channel(address) as channel:
        for stub_class in (worker_pb2_grpc.DecodeWorkerStub, worker_pb2_grpc.PrefillWorkerStub):
            stub: Any = stub_class(channel)
            try:
                load: worker_pb2.LoadReport = stub.GetLoad(worker_pb2.LoadRequest(), timeout=2.0,
                                                           metadata=token_metadata(token))
                return load
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    return None
    return None


def _orphans_freed(workers: dict[str, tuple[bool, str]], token: str, baseline: dict[str, int], killed: float,
                   watch: _Watch | None, give_up_s: float) -> tuple[float | None, int]:
    """Router kills: (when every worker held no more than its baseline, read from the workers; None
    if the restarted router answered first (`watch`; None: the load is paused, no such limit) or not
    within `give_up_s`; the most blocks held above the baseline from 0.5 s after the kill)."""
    most = 0
    while time.monotonic() - killed < give_up_s and (watch is None or watch.back_at is None):
        held = {}
        for worker_id, (_, worker_address) in workers.items():
            load = _worker_load(worker_address, token)
            if load is not None:
                held[worker_id] = int(load.held_blocks)
        now = time.monotonic()
        if now - killed > 0.5:
            most = max([most, *(n - baseline.get(w, 0) for w, n in held.items())])
        if held and all(n <= baseline.get(w, 0) for w, n in held.items()):
            return now, most
        time.sleep(0.05)
    return None, most


def _since(start: float, when: float | None) -> float | None:
    return None if when is None else round(max(0.0, when - start), 3)


def _first_ok_after(sent: Sequence[Sent], killed: float) -> float | None:
    ends = [s.end for s in sent if s.start > killed and s.status == "OK"]
    return min(ends) if ends else None


def _wait_for(probe: Callable[[], float | None], since: float, give_up_s: float) -> float | None:
    while time.monotonic() - since < give_up_s:
        found = probe()
        if found is not None:
            return found
        time.sleep(0.02)
    return None


def _wait_baseline(address: str, token: str, give_up_s: float) -> dict[str, int]:
    """Every worker healthy, a request served, and what the workers hold then (0 once idle)."""
    start = time.monotonic()
    while True:
        workers = _workers(address, token)
        if workers and all(healthy for healthy, _ in workers.values()):
            try:
                with Client(address, timeout_s=30) as client:
                    client.generate(KILL_PROMPT, max_tokens=2)
            except CedserveError:
                pass
            else:
                held = _wait_blocks(address, token, {}, 30.0)[1]
                if held is not None:
                    return held
        if time.monotonic() - start > give_up_s:
            raise RuntimeError(f"the system at {address} did not come back to serving within {give_up_s:.0f} s")
        time.sleep(0.2)


def _wait_blocks(address: str, token: str, baseline: dict[str, int],
                 give_up_s: float) -> tuple[float | None, dict[str, int] | None]:
    """(when every worker held no more than its baseline (0 where none), the last reading)."""
    start = time.monotonic()
    last = None
    while time.monotonic() - start < give_up_s:
        held = held_blocks(address, token)
        if held is not None:
            last = held
            if all(n <= baseline.get(w, 0) for w, n in held.items()):
                return time.monotonic(), held
        time.sleep(0.05)
    return None, last


def kill_rounds(address: str, token: str, log_dir: Path, kinds: Sequence[str], rounds: int, clients: int,
                max_tokens: int, log: Callable[[str], None] = print, prompt_tokens: int = 0,
                pause_for_orphans: bool = False) -> dict[str, Any]:
    """`rounds` kills of each kind in turn (router, prefill, decode, router, ...), and a summary per kind."""
    out: dict[str, Any] = {"rounds": rounds, "clients": clients, "max_tokens": max_tokens,
                           "prompt_tokens": prompt_tokens, "pause_for_orphans": pause_for_orphans, "per_kill": []}
    for i in range(rounds):
        for kind in kinds:
            r = kill_round(address, token, log_dir, kind, clients, max_tokens, prompt_tokens=prompt_tokens,
                           pause_for_orphans=pause_for_orphans)
            out["per_kill"].append(r)
            log(f"kill {i + 1}/{rounds} {kind:>7}: detected {r['detected_s']} s, serving again {r['serving_again_s']} s, "
                f"restored {r['restored_s']} s, blocks back {r['blocks_back_s']} s, in flight {r['inflight']}, "
                f"no status {r['no_status']}"
                + (f", orphans {r['orphan_blocks']} blocks freed {r['orphans_freed_s']} s" if kind == "router" else ""))
    out["summary"] = {kind: summarize_kills([r for r in out["per_kill"] if r["kind"] == kind]) for kind in kinds}
    return out


def worst_of(rows: Sequence[dict[str, Any]], key: str) -> float | None:
    """The largest value; None when any row has none (or there are no rows)."""
    values = [r[key] for r in rows]
    return None if any(v is None for v in values) or not values else max(values)


def summarize_kills(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    def worst(key: str) -> float | None:
        values = [r[key] for r in rows]
        return None if any(v is None for v in values) or not values else max(values)

    def median(key: str) -> float | None:
        values = sorted(r[key] for r in rows if r.get(key) is not None)
        return values[len(values) // 2] if values else None

    status: Counter[str] = Counter()
    for r in rows:
        status.update(r["inflight"])
    orphans = [r for r in rows if "orphans_freed_s" in r]
    extra = {"orphans_freed_s_max": worst_of(orphans, "orphans_freed_s"),
             "orphans_freed_s_median": median("orphans_freed_s") if orphans else None,
             "orphans_outlived_restart": sum(1 for r in orphans if r["orphans_freed_s"] is None)} if orphans else {}
    return {**extra, "kills": len(rows), "detected_s_max": worst("detected_s"), "detected_s_median": median("detected_s"),
            "serving_again_s_max": worst("serving_again_s"), "serving_again_s_median": median("serving_again_s"),
            "restored_s_max": worst("restored_s"), "blocks_back_s_max": worst("blocks_back_s"),
            "leaks": sum(1 for r in rows if r["blocks_back_s"] is None),
            "inflight_status": dict(status), "no_status": sum(r["no_status"] for r in rows)}
