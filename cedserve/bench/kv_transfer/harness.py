"""Multi-process harness for the transfer layer: worker processes driven over stdin/stdout, and the
network namespaces that make two of them look like two hosts.

`PeerProcess` starts `python -m cedserve.bench.kv_transfer.harness --spec JSON` (optionally behind a
prefix: `ip netns exec NS`, or `ssh HOST` for real hosts) and sends it JSON-line commands; the
worker owns one `NixlTransferAgent` over a block pool of its own, a free-list allocator, and answers
each command with one JSON line. The e2e tests and `cedserve bench kv-transfer` play the router:
they reserve on the receiver, hand the reservation (protobuf, base64) to the sender, and wait on both.

`NetnsPair` builds two namespaces joined by a veth pair with addresses from the RFC 2544
benchmarking range 198.18.0.0/15 (UCX's TCP transport skips link-local 169.254/16 interfaces, so
those cannot carry UCX), and UCX is pinned to `tcp` on that veth: bytes cross a real TCP connection
between two network stacks, as between machines.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch

from cedserve.kv_transfer.config import KVTransferConfig
from cedserve.kv_transfer.errors import KVTransferError
from cedserve.kv_transfer.protocol import TransferMode
from cedserve.kv_transfer.region import KVLayout, KVRegion, LayoutKind
from cedserve.kv_transfer.staging import put_rows, take_rows
from cedserve.kv_transfer.state import TransferResult
from cedserve.kv_transfer.wire import reservation_from_pb, reservation_to_pb
from cedserve.proto import kv_transfer_pb2 as pb

_TAG = "@@kvh "


# ---------------------------------------------------------------------- specs, layout, patterns


@dataclass
class LayoutSpec:
    """A model layout (`preset` + `block_size`) or a model-free one (`raw_block_bytes`)."""

    kind: str = LayoutKind.CROSS_LAYER.value
    preset: str | None = "v4.1-flash"
    block_size: int = 64
    raw_block_bytes: int = 0
    raw_layers: int = 1

    def build(self) -> KVLayout:
        kind = LayoutKind(self.kind)
        if self.preset is None:
            return KVLayout.raw(self.raw_block_bytes, kind, self.raw_layers)
        from cedserve.model.presets import preset

        return KVLayout.from_config(preset(self.preset), self.block_size, kind)


@dataclass
class WorkerSpec:
    name: str
    num_blocks: int
    layout: LayoutSpec = field(default_factory=LayoutSpec)
    device: str = "cpu"
    config: dict[str, Any] = field(default_factory=dict)
    """KVTransferConfig fields (auth_token, control_host, ucx_tls, ...)."""
    seed: int = 0


def pattern_rows(seed: int, block_ids: np.ndarray, block_bytes: int, device: torch.device) -> torch.Tensor:
    """`[n, block_bytes]` uint8: row i = (j + 131 * id_i + 7919 * seed) mod 256 for byte j."""
    row = (torch.arange(block_bytes, device=device) % 256).to(torch.uint8)
    offs = torch.from_numpy((block_ids.astype(np.int64) * 131 + seed * 7919) % 256).to(torch.uint8).to(device)
    return row[None, :] + offs[:, None]


def write_logical(layout: KVLayout, region: KVRegion, block_ids: np.ndarray, rows: torch.Tensor) -> None:
    for view, start, stop in layout.segment_views(region):
        put_rows(view, block_ids, rows[:, start:stop].contiguous())


def read_logical(layout: KVLayout, region: KVRegion, block_ids: np.ndarray) -> torch.Tensor:
    parts = []
    for view, _, _ in layout.segment_views(region):
        out = torch.empty(block_ids.size, view.shape[1], dtype=torch.uint8, device=view.device)
        take_rows(view, block_ids, out)
        parts.append(out)
    return torch.cat(parts, dim=1)


class FreeList:
    """Block allocator of a test worker: contiguous (lowest free ids) or random (scattered) ids."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        self.free = np.ones(num_blocks, dtype=bool)
        self.rng = np.random.default_rng(seed)

    def allocate(self, n: int, pattern: str) -> np.ndarray:
        candidates = np.flatnonzero(self.free)
        if candidates.size < n:
            raise ValueError(f"out of blocks: want {n}, {candidates.size} free")
        ids = candidates[:n] if pattern == "contiguous" else self.rng.choice(candidates, n, replace=False)
        self.free[ids] = False
        return ids.astype(np.int64)

    def release(self, ids: Sequence[int] | np.ndarray) -> None:
        self.free[np.asarray(ids, dtype=np.int64)] = True

    @property
    def num_free(self) -> int:
        return int(self.free.sum())


def result_dict(result: TransferResult | None) -> dict[str, Any]:
    if result is None:
        return {"state": "error", "error": "no result recorded"}
    out: dict[str, Any] = {
        "request_id": result.request_id, "state": result.state.value, "bytes": result.num_bytes,
        "descriptors": result.num_descriptors, "chunks": result.num_chunks,
        "latency_s": result.finished_s - result.started_s, "duration_s": result.duration_s,
        "finished_s": result.finished_s, "started_s": result.started_s, "closed_s": result.closed_s,
        "last_post_s": getattr(result, "last_post_s", None),  # None from a tree before it existed
        "staging_s": getattr(result, "staging_s", None), "last_posted_s": getattr(result, "last_posted_s", None),
        "nixl_done_s": getattr(result, "nixl_done_s", None), "status_polls": getattr(result, "status_polls", None)}
    if result.error is not None:
        out.update(cause=result.error.cause.value, error=str(result.error))
    return out


# ---------------------------------------------------------------------- the worker process


class Worker:
    """One agent and its pool, answering harness commands (see `handle`)."""

    def __init__(self, spec: WorkerSpec) -> None:
        from cedserve.bench.kv_transfer.link_meter import LinkMeter
        from cedserve.kv_transfer.agent import NixlTransferAgent

        self.spec = spec
        self.layout = spec.layout.build()
        device = torch.device(spec.device)
        tensor = torch.zeros(spec.num_blocks * self.layout.block_bytes, dtype=torch.uint8, device=device)
        self.region = KVRegion(tensor, self.layout.block_bytes)
        self.config = msgspec.convert(spec.config, KVTransferConfig)
        self.agent = NixlTransferAgent(self.config, self.region, self.layout, spec.name)
        self.meter = LinkMeter(self.agent)
        self.blocks = FreeList(spec.num_blocks, spec.seed)
        self.lock = threading.Lock()
        self.results: dict[str, TransferResult] = {}
        self.held: dict[str, np.ndarray] = {}  # receiver blocks holding DONE transfers
        self.send_errors: dict[str, str] = {}
        self.first_write: dict[str, float] = {}  # request -> its first write_blocks call (monotonic)
        self.cpu_start: dict[str, float] = {}
        """request -> this process's CPU seconds (every thread: `time.process_time`) at its start (the
        sender's first write_blocks call, the receiver's reservation); `cpu_end`: at its `on_finish`."""
        self.cpu_end: dict[str, float] = {}
        self.send_blocks: dict[str, np.ndarray] = {}  # sender blocks allocated per request
        self._copy_dst: torch.Tensor | None = None
        self.after_reply: threading.Thread | None = None
        """A writer `send` prepared, started once its reply is out (see `_send`)."""

    def _on_finish(self, result: TransferResult) -> None:
        cpu = time.process_time()
        with self.lock:
            self.results[result.request_id] = result
            if result.request_id in self.cpu_start:
                self.cpu_end[result.request_id] = cpu
            if result.role.value == "receiver" and result.state.value == "done":
                self.held[result.request_id] = np.asarray(result.block_ids, dtype=np.int64)
            elif result.role.value == "receiver":
                self.blocks.release(result.block_ids)
            else:  # the sender owns every block it allocated for the request, written or not yet
                self.blocks.release(self.send_blocks.pop(result.request_id, np.zeros(0, dtype=np.int64)))

    def handle(self, cmd: str, a: dict[str, Any]) -> dict[str, Any]:
        method = getattr(self, f"cmd_{cmd}", None)
        if method is None:
            raise ValueError(f"unknown harness command {cmd!r}")
        result: dict[str, Any] = method(a)
        return result

    def cmd_info(self, a: dict[str, Any]) -> dict[str, Any]:
        agent = self.agent
        return {"name": agent.name, "control_address": agent.control_address, "pid": os.getpid(),
                "num_blocks": self.region.num_blocks, "block_bytes": self.region.block_bytes,
                "compat_hash": agent.compatibility().compat_hash}

    def cmd_handshake(self, a: dict[str, Any]) -> dict[str, Any]:
        return {"peer": self.agent.handshake(a["address"], a.get("timeout_s", 10.0))}

    def cmd_fill(self, a: dict[str, Any]) -> dict[str, Any]:
        """Fill every block with `pattern_rows(seed, id)`."""
        ids = np.arange(self.region.num_blocks, dtype=np.int64)
        for s in range(0, ids.size, 512):
            part = ids[s: s + 512]
            rows = pattern_rows(a["seed"], part, self.region.block_bytes, self.region.tensor.device)
            write_logical(self.layout, self.region, part, rows)
        return {}

    def cmd_reserve(self, a: dict[str, Any]) -> dict[str, Any]:
        out = []
        for r in a["requests"]:
            ids = self.blocks.allocate(r["num_blocks"], a.get("alloc", "random"))
            with self.lock:
                self.cpu_start[r["request_id"]] = time.process_time()
            res = self.agent.receiver().reserve(r["request_id"], ids, sender=r["sender"],
                                                mode=TransferMode(r.get("mode", "write")),
                                                lease_s=r.get("lease_s"), on_finish=self._on_finish)
            out.append(base64.b64encode(reservation_to_pb(res).SerializeToString()).decode())
        return {"reservations": out}

    def cmd_wait(self, a: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for rid in a["request_ids"]:
            side = self.agent.sender() if a["role"] == "sender" else self.agent.receiver()
            try:
                out[rid] = result_dict(side.wait(rid, a.get("timeout_s", 60.0)))
            except KVTransferError:
                with self.lock:
                    out[rid] = result_dict(self.results.get(rid))
            except (TimeoutError, KeyError) as exc:
                out[rid] = {"state": "error", "error": self.send_errors.get(rid) or f"{type(exc).__name__}: {exc}"}
            if a["role"] == "sender" and rid in self.first_write:
                out[rid]["first_write_s"] = self.first_write[rid]
            with self.lock:
                start, end = self.cpu_start.pop(rid, None), self.cpu_end.pop(rid, None)
            if start is not None and end is not None:
                out[rid]["cpu_start_s"], out[rid]["cpu_end_s"] = start, end
        return {"results": out}

    def cmd_verify(self, a: dict[str, Any]) -> dict[str, Any]:
        """Compare a DONE request's blocks with the pattern of the sender's blocks `src_ids`."""
        with self.lock:
            dst = self.held.get(a["request_id"])
        if dst is None:
            return {"ok": False, "reason": "no DONE transfer held"}
        src = np.asarray(a["src_ids"], dtype=np.int64)
        bad = 0
        for s in range(0, dst.size, 512):
            want = pattern_rows(a["src_seed"], src[s: s + 512], self.region.block_bytes, self.region.tensor.device)
            got = read_logical(self.layout, self.region, dst[s: s + 512])
            bad += int((want != got).any(dim=1).sum())
        return {"ok": bad == 0, "mismatched_blocks": bad}

    def cmd_release(self, a: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            for rid in a["request_ids"]:
                held = self.held.pop(rid, None)
                if held is not None:
                    self.blocks.release(held)
        return {}

    def cmd_abort(self, a: dict[str, Any]) -> dict[str, Any]:
        return {"found": self.agent.abort(a["request_id"])}

    def cmd_free(self, a: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            return {"free_blocks": self.blocks.num_free, "held": len(self.held),
                    "active": self.agent.active_transfers(),
                    "staging_free": self.agent.staging.free_slots if self.agent.staging else 0}

    def cmd_notices(self, a: dict[str, Any]) -> dict[str, Any]:
        """Data-path notifications this agent received so far, by kind (its metrics)."""
        metrics = self.agent.metrics
        return {kind: metrics.value("cedserve_kv_transfer_notices_total", kind=kind)
                for kind in ("chunk_posted", "chunk_done", "chunk_ready", "chunk_consumed", "slot_free")}

    def cmd_raw(self, a: dict[str, Any]) -> dict[str, Any]:
        """Single-descriptor NIXL requests: `(posted_s, done_s)` per rep (probe ids from `probe_base`)."""
        blocks = None
        if a.get("alloc"):  # the descriptors of `num_blocks` blocks allocated like the cell's
            n, peer_blocks = a["num_blocks"], a["peer_num_blocks"]
            rng = np.random.default_rng(a.get("probe_base", 0))
            pick = (lambda total: np.arange(n, dtype=np.int64)) if a["alloc"] == "contiguous" else (
                lambda total: rng.choice(total, n, replace=False).astype(np.int64))
            blocks = (pick(self.region.num_blocks), pick(peer_blocks))
        times = [self.meter.raw(a["peer"], a["nbytes"], a.get("op", "WRITE"), a.get("probe_base", 0) + i, blocks)
                 for i in range(a.get("reps", 1))]
        return {"times": times}

    def cmd_requests(self, a: dict[str, Any]) -> dict[str, Any]:
        """`nbytes` as `pieces` back-to-back single-descriptor WRITE requests (`LinkMeter.requests`)."""
        return self.meter.requests(a["peer"], a["nbytes"], a["pieces"], a["probe_base"])

    def cmd_expect_probe(self, a: dict[str, Any]) -> dict[str, Any]:
        for p in a["probe_ids"]:
            self.meter.expect(p)
        return {}

    def cmd_probe(self, a: dict[str, Any]) -> dict[str, Any]:
        return {"arrivals": [self.meter.arrival(p) for p in a["probe_ids"]]}

    def cmd_memcpy(self, a: dict[str, Any]) -> dict[str, Any]:
        """One in-process copy of `nbytes` of the pool (the bench's memory-copy reference)."""
        src = self.region.tensor[: a["nbytes"]]
        if self._copy_dst is None or self._copy_dst.numel() < src.numel():
            self._copy_dst = torch.ones_like(src)  # touched once: time the copy, not page faults
        dst = self._copy_dst[: src.numel()]
        seconds = []
        for _ in range(a.get("reps", 1)):
            t0 = time.perf_counter()
            dst.copy_(src)
            if dst.device.type == "cuda":
                torch.cuda.synchronize(dst.device)
            seconds.append(time.perf_counter() - t0)
        return {"seconds": seconds}

    def cmd_pack_cost(self, a: dict[str, Any]) -> dict[str, Any]:
        """Seconds of one staging gather and one scatter of `num_blocks` of this pool, ids allocated as
        `alloc` (the bench's reference for packing): rows into a scratch buffer and back to the same
        blocks (their bytes unchanged), on a stream of their own, each waited for, as the engine does
        (with the row copies every engine version has, so an older one runs it too)."""
        n = a["num_blocks"]
        ids = (np.arange(n, dtype=np.int64) if a.get("alloc") == "contiguous"
               else np.random.default_rng(n).choice(self.region.num_blocks, n, replace=False).astype(np.int64))
        blocks = self.region.blocks()
        rows = torch.empty(n, self.region.block_bytes, dtype=torch.uint8, device=blocks.device)
        stream = torch.cuda.Stream(blocks.device) if blocks.is_cuda else None  # type: ignore[no-untyped-call]

        def timed(copy: Any) -> float:
            t0 = time.perf_counter()
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                copy()
            if stream is not None:
                stream.synchronize()
            return time.perf_counter() - t0

        gather_s, scatter_s = [], []
        for _ in range(a.get("reps", 3)):
            gather_s.append(timed(lambda: take_rows(blocks, ids, rows)))
            scatter_s.append(timed(lambda: put_rows(blocks, ids, rows)))
        return {"gather_s": gather_s, "scatter_s": scatter_s}

    def cmd_send(self, a: dict[str, Any]) -> dict[str, Any]:
        return self._send(a)

    def _send(self, a: dict[str, Any]) -> dict[str, Any]:
        """Open every reservation, then stream each request's blocks in `stream_blocks` pieces
        (round-robin across the batch, `pace_s` apart: prefill chunks finishing) on a thread."""
        sender = self.agent.sender()
        plans = []
        local: dict[str, list[int]] = {}
        for b64 in a["reservations"]:
            res = reservation_from_pb(pb.Reservation.FromString(base64.b64decode(b64)))
            ids = self.blocks.allocate(res.num_blocks, a.get("alloc", "random"))
            with self.lock:
                self.send_blocks[res.request_id] = ids
            local[res.request_id] = ids.tolist()
            plans.append((res, ids))
        stream = max(1, int(a.get("stream_blocks", 256)))
        pace = float(a.get("pace_s", 0.0))
        # Opened before this command answers, so a `wait` sent right after finds every transfer
        # (open asks the receiver's control plane first: it takes a round trip).
        pending = []
        for res, ids in plans:
            try:
                sender.open(res, timeout_s=a.get("timeout_s"), on_finish=self._on_finish)
                pending.append((res.request_id, ids))
            except (ValueError, KVTransferError) as exc:
                self.send_errors[res.request_id] = str(exc)
                with self.lock:
                    self.blocks.release(self.send_blocks.pop(res.request_id))

        def run(pending: list[tuple[str, np.ndarray]]) -> None:
            cursor = dict.fromkeys((rid for rid, _ in pending), 0)
            while pending:
                still = []
                for rid, ids in pending:
                    end = min(cursor[rid] + stream, ids.size)
                    if rid not in self.first_write:
                        self.first_write[rid] = time.monotonic()
                        with self.lock:
                            self.cpu_start[rid] = time.process_time()
                    try:
                        sender.write_blocks(rid, ids[cursor[rid]:end], last=end == ids.size)
                    except (ValueError, KVTransferError) as exc:
                        self.send_errors[rid] = str(exc)
                        continue
                    cursor[rid] = end
                    if end < ids.size:
                        still.append((rid, ids))
                pending = still
                if pending and pace:
                    time.sleep(pace)

        # Started once the reply is written (`worker_main`): encoding the reply (every block id) on this
        # thread while the writer queued would hold the GIL inside the measured window, and a 128K-token
        # request's 2,048 ids cost the engine's progress thread a wait that grows with the request.
        self.after_reply = threading.Thread(target=run, args=(pending,), name="harness-send", daemon=True)
        return {"local_ids": local}


def worker_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="cedserve KV transfer harness worker (driven over stdin)")
    parser.add_argument("--spec", required=True, help="WorkerSpec as JSON")
    args = parser.parse_args(argv)
    raw = json.loads(args.spec)
    raw["layout"] = LayoutSpec(**raw.get("layout", {}))
    worker = Worker(WorkerSpec(**raw))
    out = sys.stdout

    def reply(obj: dict[str, Any]) -> None:
        out.write(_TAG + json.dumps(obj) + "\n")
        out.flush()

    reply({"id": 0, "ok": True, "result": worker.handle("info", {})})
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        if msg["cmd"] == "quit":
            worker.agent.close()
            reply({"id": msg["id"], "ok": True, "result": {}})
            break
        try:
            reply({"id": msg["id"], "ok": True, "result": worker.handle(msg["cmd"], msg.get("args", {}))})
            if worker.after_reply is not None:
                worker.after_reply.start()
                worker.after_reply = None
        except Exception as exc:  # report to the driver instead of dying silently
            reply({"id": msg["id"], "ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return 0


# ---------------------------------------------------------------------- the driver side


class HarnessError(RuntimeError):
    pass


class PeerProcess:
    """A worker process and the pipe to it."""

    def __init__(self, spec: WorkerSpec, *, prefix: Sequence[str] = (), env: dict[str, str] | None = None,
                 python: str = sys.executable, start_timeout_s: float = 60.0) -> None:
        self.spec = spec
        # stderr (NIXL/UCX logs) goes to a file: a pipe nobody reads would fill and block the worker
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in close()
            prefix=f"kvh-{spec.name}-", suffix=".log", delete=False)
        inner = [python, "-m", "cedserve.bench.kv_transfer.harness", "--spec", json.dumps(asdict(spec))]
        if prefix and prefix[0] == "ssh":  # a remote shell: same checkout path and venv on that host
            extra = [f"{k}={v}" for k, v in (env or {}).items()]
            cmd = [*prefix, f"cd {shlex.quote(os.getcwd())} && " + shlex.join(["env", *extra, *inner])]
        else:
            cmd = [*prefix, *inner]
        full_env = {**os.environ, **(env or {})}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, bufsize=1, env=full_env)
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._stash: dict[int, dict[str, Any]] = {}
        self._next_id = 1
        self._start_timeout_s = start_timeout_s
        self._info: dict[str, Any] | None = None
        threading.Thread(target=self._read, daemon=True).start()

    @property
    def info(self) -> dict[str, Any]:
        """The worker's `info` reply (name, control address, pid, ...), waiting for it to start.
        Start several workers first and read `info` after, so they start in parallel."""
        if self._info is None:
            self._info = self._wait_reply(0, self._start_timeout_s)
        return self._info

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(_TAG):
                self._replies.put(json.loads(line[len(_TAG):]))
        self._replies.put({"id": -1, "ok": False, "error": "worker exited"})

    def _wait_reply(self, msg_id: int, timeout_s: float) -> dict[str, Any]:
        end = time.monotonic() + timeout_s
        while True:
            msg = self._stash.pop(msg_id, None)
            if msg is None:
                try:
                    msg = self._replies.get(timeout=max(0.0, end - time.monotonic()))
                except queue.Empty:
                    raise HarnessError(f"{self.spec.name}: no reply in {timeout_s} s\n{self.log_tail()}") from None
            if msg["id"] == -1:
                self._replies.put(msg)  # stays visible to every later wait
                raise HarnessError(f"{self.spec.name}: worker exited ({self.proc.poll()})\n{self.log_tail()}")
            if msg["id"] != msg_id:
                self._stash[msg["id"]] = msg  # a reply someone else will ask for
                continue
            if not msg["ok"]:
                raise HarnessError(f"{self.spec.name}: {msg['error']}")
            result: dict[str, Any] = msg["result"]
            return result

    def send(self, cmd: str, **args: Any) -> int:
        """Send a command without waiting; returns its id for `reply`."""
        msg_id = self._next_id
        self._next_id += 1
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"id": msg_id, "cmd": cmd, "args": args}) + "\n")
        self.proc.stdin.flush()
        return msg_id

    def reply(self, msg_id: int, timeout_s: float = 120.0) -> dict[str, Any]:
        return self._wait_reply(msg_id, timeout_s)

    def call(self, cmd: str, timeout_s: float = 120.0, **args: Any) -> dict[str, Any]:
        return self.reply(self.send(cmd, **args), timeout_s)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.proc.send_signal(sig)

    def log_tail(self, n: int = 3000) -> str:
        try:
            with open(self._log.name, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def close(self, timeout_s: float = 10.0, graceful: bool = True) -> None:
        """Ask the worker to close its agent and exit (`graceful`), or kill it."""
        if self.proc.poll() is None and not graceful:
            self.proc.kill()
        if self.proc.poll() is None:
            with contextlib.suppress(HarnessError, BrokenPipeError, OSError):  # it may be dying already
                self.call("quit", timeout_s=timeout_s)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        os.unlink(self._log.name)


# ---------------------------------------------------------------------- network namespaces


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (no root, no `ip`, no veth support)."""


class NetnsPair:
    """Two network namespaces joined by one veth pair: `a` at `addr_a`, `b` at `addr_b`."""

    def __init__(self, subnet_index: int | None = None) -> None:
        tag = f"{os.getpid() % 100000}{int(time.monotonic() * 1000) % 1000}"
        self.ns = (f"kvx{tag}a", f"kvx{tag}b")
        self.dev = (f"kvx{tag}va", f"kvx{tag}vb")
        third = (subnet_index if subnet_index is not None else os.getpid()) % 250
        self.addr = (f"198.18.{third}.1", f"198.18.{third}.2")
        self._made: list[str] = []

    def __enter__(self) -> NetnsPair:
        try:
            for ns in self.ns:
                self._ip("netns", "add", ns)
                self._made.append(ns)
            self._ip("link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, addr in zip(self.ns, self.dev, self.addr):
                self._ip("link", "set", dev, "netns", ns)
                self._ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                self._ip("-n", ns, "link", "set", dev, "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
        except NetnsUnavailable:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in self._made:  # deleting a namespace deletes its end of the veth, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()

    @staticmethod
    def _ip(*args: str) -> None:
        try:
            done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NetnsUnavailable(f"`ip {' '.join(args)}`: {exc}") from None
        if done.returncode:
            raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")

    def prefix(self, side: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side]]

    def config(self, side: int) -> dict[str, Any]:
        """KVTransferConfig fields pinning the control plane and UCX (TCP) to this side's veth."""
        return {"control_host": self.addr[side], "ucx_tls": "tcp", "ucx_net_devices": self.dev[side]}


def netns_unavailable_reason() -> str | None:
    """None if a namespace pair can be made here, else why not."""
    try:
        with NetnsPair(subnet_index=249):
            return None
    except NetnsUnavailable as exc:
        return str(exc)


if __name__ == "__main__":
    raise SystemExit(worker_main())
