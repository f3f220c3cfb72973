"""`LinkMeter`: the benchmark's references for one agent's link, straight to NIXL.

The load test (`loadtest.py`) reads every transfer figure as a ratio to what NIXL itself does with
the same bytes: one request of ONE descriptor (`raw`), or of the descriptors the layout would use
for some blocks, or the bytes cut into back-to-back requests (`requests`). These go around the
engine (no chunks, no staging, no leases) through the agent's registered memory and the peer it
loaded at the handshake, and they overwrite the peer's first bytes: benchmark only, never on a
serving agent.

A WRITE carries a `Probe(probe_id)` notification whose arrival the peer's meter records
(`arrival`), so a rate can be taken where the bytes land. The meter installs itself as the
engine's probe sink; while a probe is awaited (`expect`) the engine polls as during a transfer,
so the arrival time is as sharp as a chunk's.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Literal

import numpy as np

from cedserve.kv_transfer.agent import NixlTransferAgent
from cedserve.kv_transfer.descriptors import block_descs, single_desc
from cedserve.kv_transfer.transfers import PeerState
from cedserve.kv_transfer.wire import encode_notice
from cedserve.proto import kv_transfer_pb2 as pb

_KEEP_ARRIVALS = 64  # the last probe arrivals kept for `arrival`


class LinkMeter:
    """Raw NIXL requests from one agent, and the probe arrivals it records (a `ProbeSink`)."""

    def __init__(self, agent: NixlTransferAgent) -> None:
        self._agent = agent
        self._memory = agent.memory
        self._backend = agent.memory.backend
        self._lock = threading.Lock()
        self._arrivals: OrderedDict[int, float] = OrderedDict()  # probe id -> arrival (monotonic)
        self._awaited: set[int] = set()
        agent.engine.probe_sink = self

    # ------------------------------------------------------------------ the receiving side

    def arrived(self, probe_id: int, at_s: float) -> None:
        with self._lock:
            self._arrivals[probe_id] = at_s
            self._awaited.discard(probe_id)
            while len(self._arrivals) > _KEEP_ARRIVALS:
                self._arrivals.popitem(last=False)

    def awaiting(self) -> bool:
        with self._lock:
            return bool(self._awaited)

    def expect(self, probe_id: int) -> None:
        """Poll as during a transfer until `Probe(probe_id)` arrives."""
        with self._lock:
            self._awaited.add(probe_id)
        self._agent.engine.wake()

    def arrival(self, probe_id: int, timeout_s: float = 10.0) -> float:
        """When `Probe(probe_id)` arrived here (monotonic), waiting up to `timeout_s` for it."""
        end = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if probe_id in self._arrivals:
                    return self._arrivals[probe_id]
            if time.monotonic() > end:
                raise TimeoutError(f"probe {probe_id} did not arrive within {timeout_s} s")
            time.sleep(0.001)

    # ------------------------------------------------------------------ the sending side

    def raw(self, peer_name: str, nbytes: int, op: Literal["WRITE", "READ"] = "WRITE", probe_id: int = 0,
            blocks: tuple[np.ndarray, np.ndarray] | None = None, timeout_s: float = 60.0) -> tuple[float, float]:
        """One NIXL request: ONE descriptor of `nbytes` between the starts of our region and the
        peer's, or, with `blocks=(local_ids, peer_ids)`, those blocks as the engine posts them: by
        index into the prepared pool lists (cross-layer; NIXL merges runs), else the descriptors this
        layout builds per transfer. Returns `(posted_s, done_s)` on this host's monotonic clock. Polled without
        sleeping (NIXL sends the notification when a poll sees the request complete), as the peer
        polls for the probe: NIXL's own rate, not the engine's poll interval."""
        peer = self._agent.engine.live_peer(peer_name)
        region = self._memory.region
        if blocks is not None:
            descs = block_descs(self._memory.layout, self._memory.address, peer.kv, blocks[0], blocks[1])
        elif nbytes > self._fits(peer):
            raise ValueError(f"raw: {nbytes} bytes exceed a region")
        else:
            descs = single_desc(region.base_address, region.device_id, peer.kv.base_address, peer.kv.device_id,
                                nbytes)
        notif = encode_notice("", probe=pb.Probe(probe_id=probe_id)) if op == "WRITE" else b""
        prepped = blocks is not None and self._memory.blocks_list is not None and peer.blocks_list is not None
        start = time.monotonic()
        if prepped:
            assert blocks is not None and self._memory.blocks_list is not None and peer.blocks_list is not None
            handle, status = self._backend.post_blocks(op, self._memory.blocks_list, blocks[0], peer.blocks_list,
                                                       blocks[1], peer_name, notif)
        else:
            handle, status = self._backend.post(op, descs, self._memory.mem, peer.kv_mem, peer_name, notif)
        while status == "PROC":
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"raw: {nbytes} B not done after {timeout_s} s")
            time.sleep(0)
            status = self._backend.status(handle, peer_name)
        done = time.monotonic()
        self._backend.release(handle, peer_name)
        if status != "DONE":
            raise RuntimeError(f"raw: NIXL {op} ended {status}")
        return start, done

    def requests(self, peer_name: str, nbytes: int, pieces: int, probe_base: int,
                 timeout_s: float = 60.0) -> dict[str, float]:
        """`nbytes` from the start of our region to the start of the peer's as `pieces` NIXL WRITE
        requests of one descriptor each, posted back to back, each with its `Probe(probe_base + i)`
        notification, then polled without sleeping: what a transfer of that many chunks costs in
        NIXL itself. Returns the first post, the time spent inside the posts, and when the sender
        saw the last one complete (monotonic)."""
        peer = self._agent.engine.live_peer(peer_name)
        if pieces < 1 or nbytes % pieces or nbytes > self._fits(peer):
            raise ValueError(f"requests: {nbytes} bytes in {pieces} pieces do not fit the regions")
        region = self._memory.region
        size = nbytes // pieces
        handles = []
        in_post = 0.0
        start = time.monotonic()
        for i in range(pieces):
            descs = single_desc(region.base_address + i * size, region.device_id,
                                peer.kv.base_address + i * size, peer.kv.device_id, size)
            t0 = time.monotonic()
            handle, status = self._backend.post("WRITE", descs, self._memory.mem, peer.kv_mem, peer_name,
                                                encode_notice("", probe=pb.Probe(probe_id=probe_base + i)))
            in_post += time.monotonic() - t0
            handles.append([handle, status])
        while any(h[1] == "PROC" for h in handles):
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"requests: not done after {timeout_s} s")
            for h in handles:
                if h[1] == "PROC":
                    h[1] = self._backend.status(h[0], peer_name)
        done = time.monotonic()
        for handle, status in handles:
            self._backend.release(handle, peer_name)
            if status != "DONE":
                raise RuntimeError(f"requests: NIXL WRITE ended {status}")
        return {"posted_s": start, "in_post_s": in_post, "done_s": done}

    def _fits(self, peer: PeerState) -> int:
        """The most bytes one request may move between the two regions."""
        return min(self._memory.region.nbytes, peer.kv.num_blocks * peer.block_bytes)
