"""`KVTransferConfig`: everything the transfer layer reads, as one frozen, validated struct.

It decodes from the serve config's TOML/JSON through msgspec like the other subsystems (a bad field
is named). Environment variables are not read here; UCX's own variables are *written* from
`ucx_tls` / `ucx_net_devices` in one place (`nixl_backend.apply_ucx_environment`) before the agent
exists, because UCX reads them when its context is created.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from cedserve.common.tls import TLSConfig
from cedserve.model.config_table import decode_table, fail


class KVTransferConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The NIXL agent, its control plane, chunking, packing, liveness and failure policy."""

    backends: tuple[str, ...] = ("UCX",)
    """NIXL backends to create; only UCX moves KV today."""
    ucx_error_handling_mode: Literal["peer", "none"] = "peer"
    """UCX endpoint error handling; `peer` makes a dead peer's endpoint fail fast instead of hanging."""
    ucx_tls: str | None = None
    """If set, exported as UCX_TLS before the agent starts (e.g. `rc,cuda_copy,cuda_ipc` on an RDMA
    cluster so a missing NIC fails loud instead of silently falling back to TCP; `tcp` between hosts
    without RDMA). None leaves UCX's choice."""
    ucx_net_devices: str | None = None
    """If set, exported as UCX_NET_DEVICES (e.g. `mlx5_0:1`, or the veth of a test namespace)."""
    ucx_num_workers: int = 1
    """UCX workers per agent (`num_workers` backend parameter)."""
    progress_thread: bool = False
    """NIXL's own progress thread. It busy-polls a whole core while idle, so by default the agent's
    progress loop drives UCX instead (it polls only while transfers are in flight)."""
    control_host: str = "127.0.0.1"
    """Address the KVTransferControl gRPC service binds to (the worker's cluster address)."""
    control_port: int = 0
    """Port of the control service; 0 binds a free one and reports it."""
    auth_token: str = ""
    """Shared secret every control-plane call carries (`authorization: Bearer <token>`). Required:
    the agent refuses to start without one, since a handshake grants write access to the block pool."""
    mode: Literal["write", "read"] = "write"
    """Default direction: the sender WRITEs into reserved blocks (decode-first), or the receiver READs."""
    chunk_blocks: int | None = None
    """Most blocks per NIXL transfer request. Each `write_blocks` call is one chunk; direct chunks
    already queued behind each other leave as one request up to this size, so a busy sender posts
    few large requests and an idle one each chunk at once. None: 8192 blocks (466 MB at the released
    geometry) for device memory, where every request costs about the same fixed time however large
    (docs/kv_transfer.md), 1024 (58 MB) for host memory, where a post copies synchronously."""
    pack_below_bytes: int | None = None
    """Pack a chunk through the staging buffers when its mean descriptor (after coalescing contiguous
    runs) is smaller than this. None picks by memory: 1 MiB for device memory, where small
    descriptors run at a few percent of the link, and 0 (never) for host memory, where they cost
    little (docs/benchmarks/kv-transfer-cpu.json measures both)."""
    staging_slots: int | None = None
    """Slots in this agent's staging buffer (0: none, packing disabled). Allocated and registered only
    when packing can happen (`pack_threshold` > 0). None: 16 for device memory, 8 for host memory."""
    staging_slot_bytes: int | None = None
    """Bytes per staging slot; a packed chunk is at most one slot. None: 64 MiB for device memory (a
    128K-token request in two slots, so one gather, one descriptor and one scatter per 1,178 blocks),
    16 MiB for host memory."""
    staging_slots_per_request: int | None = None
    """Receiver slots a WRITE reservation may hold at once (the sender's credits). None: 2 for device
    memory (8 requests in flight share 16 slots), 4 for host memory."""
    lease_s: float = 30.0
    """Default lease of a reservation: the transfer fails with DEADLINE if not done by then."""
    heartbeat_interval_s: float = 0.15
    """Interval of heartbeat notifications to every connected peer."""
    peer_timeout_s: float = 0.9
    """A peer silent for this long is declared dead and its transfers fail (PEER_SILENT)."""
    abort_drain_s: float = 0.9
    """How long a side whose memory the peer may touch waits for the peer's abort acknowledgement."""
    poll_interval_s: float | None = None
    """Progress-loop sleep while this side has NIXL requests in flight, chunks waiting, or bytes
    landing. NIXL sends a WRITE's notification only when a poll sees the request complete, so this
    adds to every chunk's latency. None: 20 us for device memory (a 116 MB chunk crosses NVLink in
    0.3 ms), 200 us for host memory (where the copy itself needs the cores)."""
    target_poll_s: float | None = None
    """Progress-loop sleep while transfers are open but only the peer acts (a reservation waiting for
    its first chunk). None: 200 us for device memory, 1 ms for host memory."""
    doorbell: bool = False
    """Sleep the progress loop on a UDP socket that peers ring after each data-path notification
    (`kv_transfer/doorbell.py`), so a receiver sees news within a thread wake-up instead of at its
    next poll. Off by default: it measured no gain (one H200, two processes: 128K-token requests 0.19
    of raw with it against 0.20 without; the 2-core VM: within noise at the defaults,
    docs/benchmarks/kv-transfer-fixed-cost-cpu.json) and it opens a UDP port that takes datagrams
    from anyone (a datagram only ends a sleep)."""
    announce_posts: bool | None = None
    """WRITE: send the receiver a `ChunkPosted` notification (and ring its doorbell) as soon as each
    NIXL request is posted, so it polls at `poll_interval_s` until that request's `ChunkDone`, which
    follows the bytes, and sees it at once. Sent after the post returns, so a host-memory post that
    copies synchronously for tens of ms does not keep the receiver polling short meanwhile; on host
    transports that need the target's progress to finish a request (shared memory) the receiver's
    polls then finish it. None: on. (It was off for host memory while the receiver kept polling short
    from the first notice to the end of the transfer, through the next request's synchronous copy;
    now it polls short only while a request is outstanding: on the 2-core dev VM 4K/32K-token
    contiguous requests' fixed cost 0.89 / 0.46 ms with it against 1.28 / 1.35 without, 128K equal,
    docs/benchmarks/kv-transfer-fixed-cost-announce-cpu.json.)"""
    spin_s: float | None = None
    """While this side is hot (a request of its own in flight, or one the peer announced landing), the
    progress loop steps again at once, yielding the core and the GIL between rounds, for up to this
    long per hot spell before it falls back to `poll_interval_s` sleeps. A sleep and its wake-up cost
    every request tens of microseconds on each side (more in a VM) and one per detection: the
    sender's completion poll, the receiver's notification drain. Bounded, since a spinning Python
    thread keeps the process's other threads from the GIL meanwhile. None: 0.5 ms for device memory,
    0 (never) for host memory (on a small host the spin takes the cores a host copy needs)."""
    spin_switch_interval_s: float | None = None
    """During a spin spell (`spin_s`) the interpreter's thread switch interval is at most this
    (`sys.setswitchinterval`; the process's, restored when the last spell ends): a spinning thread
    holds the GIL between its yields, and a thread that released it (a staging copy waiting on its
    stream, the caller's `write_blocks`) otherwise waits up to the default 5 ms before the
    interpreter forces a hand-over. None: 0 (leave it) until a GPU run shows it pays: on the dev VM
    (2 cores, Python 3.11, the two threads pinned to different cores) a thread's GIL-releasing
    50 us wait came back as fast beside a spinning thread as alone (median 72 us against 71), so the
    ~0.5 ms per staging copy seen in an agent on an H100 may have another cause (the CUDA driver's
    locks while UCX polls, a stream sync's own wait). `benchmarks/staging_probe.py` tells."""
    caller_posts_last: bool | None = None
    """WRITE: `write_blocks(last=True)` posts what is queued of its transfer from the caller's thread
    (the chunks queued behind each other merge into one request) instead of waking the progress
    thread to do it: the producer's last handoff, the part of a transfer nothing overlaps, skips a
    thread wake-up and a step of the loop. Earlier chunks still leave from the progress thread. The
    call then returns once NIXL has the request (or, with `caller_waits_s`, once it completed). None: on for device memory (a post takes tens of
    us), off for host memory (a host post copies synchronously: the caller would block for it)."""
    caller_waits_s: float | None = None
    """WRITE, with `caller_posts_last`: after its post, `write_blocks(last=True)` polls the request from
    the caller's thread until it completes, for up to this long, and settles the transfer there (the
    sender's DONE, its `on_finish` on this thread); a request still running then is left to the
    progress loop. On one H100 (two processes, cuda_ipc) the loop's first poll of a whole 128K-token
    request came 0.24-0.33 ms after its post returned and already saw it done, where NIXL alone posts
    and completes the same request in 0.14 ms. Timed on the next H100 (gpu-2026-12-07c, beside the
    engine without it): the caller's own polls saw the request done 0.20-0.27 ms after the post
    returned, as the loop did (0.20-0.33), while the loop ran beside them. With `caller_holds_lock`
    (the loop blocked meanwhile) it saw them done 0.18-0.21 ms after the post: the default since
    (gpu-2026-12-08). None: 2 ms for device memory (with `caller_holds_lock`), 0 (off) for host memory
    (a host post copies synchronously; the loop finishes the request)."""
    caller_holds_lock: bool | None = None
    """WRITE, with `caller_posts_last`: the caller keeps the engine's lock from preparing its last post
    until the post returns and, with `caller_waits_s`, through its polls until the request completes
    (without yielding between polls). The progress loop then waits on the lock, blocked with the GIL
    released, instead of running Python beside the caller's NIXL calls: on one H100 the engine's post
    of a contiguous 128K-token request took 0.16-0.23 ms and its completion 0.20-0.33 ms more, where
    NIXL alone, in a process whose loop idles, posts, completes and notifies the same request in
    0.13-0.23 ms (gpu-2026-12-07b/c). One H100, each request in one call, 3 rounds beside the engine
    without it (gpu-2026-12-08): contiguous 4K / 128K-token requests 0.38 / 0.43 of the raw NIXL rate
    against 0.30 / 0.32 (post 0.22 / 0.19 ms against 0.27 / 0.36, post to done 0.18 / 0.21 against
    0.33 / 0.43); scattered ones 0.14-0.15 against 0.12-0.16 (their staging copies dominate). Other
    transfers' producers wait for the lock meanwhile (a post and at most `caller_waits_s`). None: on
    for device memory, off for host memory."""
    run_descs_max: int | None = None
    """A cross-layer request whose block pairs form at most this many runs is posted as one descriptor
    per run (built for it, as a staging slot's is) instead of by index into the prepared block lists,
    where NIXL walks every index: on one H100 the post of a contiguous 128K-token request (2,048
    indices, one run) took 0.21 ms by index against 0.05 ms for a packed one of one descriptor. Timed on
    the next H100 (gpu-2026-12-07c): the post of one run descriptor took as long (0.16-0.23 ms), and
    building its descriptor list per request added 0.15-0.27 ms before the post (contiguous 128K:
    0.25-0.29 of raw against 0.35 by index). 0: always by index. None: 0."""
    idle_poll_s: float = 0.005
    """Progress-loop sleep with nothing in flight (heartbeats and notifications still flow)."""
    tls: TLSConfig = msgspec.field(default_factory=TLSConfig)
    """TLS of the control service and of calls to peers' ones: the worker's `[internal_tls]` table."""
    on_failure: Literal["fail", "recompute"] = "fail"
    """What a failed transfer lets the caller do: `fail` the request, or `recompute` the KV locally
    (the error says so and the fallback is counted; never silent)."""

    def __post_init__(self) -> None:
        if not self.backends:
            fail("kv_transfer", "backends", "must name at least one NIXL backend")
        if not 0 <= self.control_port <= 65535:
            fail("kv_transfer", "control_port", f"must be in [0, 65535], got {self.control_port}")
        for name in ("chunk_blocks", "ucx_num_workers", "staging_slot_bytes", "staging_slots_per_request"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                fail("kv_transfer", name, f"must be positive, got {getattr(self, name)}")
        if self.staging_slots is not None and self.staging_slots < 0:
            fail("kv_transfer", "staging_slots", f"must be >= 0, got {self.staging_slots}")
        if self.pack_below_bytes is not None and self.pack_below_bytes < 0:
            fail("kv_transfer", "pack_below_bytes", f"must be >= 0 or null, got {self.pack_below_bytes}")
        for name in ("lease_s", "heartbeat_interval_s", "peer_timeout_s", "abort_drain_s",
                     "poll_interval_s", "target_poll_s", "idle_poll_s"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                fail("kv_transfer", name, f"must be positive, got {getattr(self, name)}")
        if self.spin_s is not None and not 0 <= self.spin_s <= 0.1:
            fail("kv_transfer", "spin_s", f"must be in [0, 0.1] s, got {self.spin_s}")
        if self.spin_switch_interval_s is not None and not 0 <= self.spin_switch_interval_s <= 0.005:
            fail("kv_transfer", "spin_switch_interval_s", f"must be in [0, 0.005] s, got {self.spin_switch_interval_s}")
        if self.caller_waits_s is not None and not 0 <= self.caller_waits_s <= 0.1:
            fail("kv_transfer", "caller_waits_s", f"must be in [0, 0.1] s, got {self.caller_waits_s}")
        if self.run_descs_max is not None and self.run_descs_max < 0:
            fail("kv_transfer", "run_descs_max", f"must be >= 0, got {self.run_descs_max}")
        if self.heartbeat_interval_s * 2 > self.peer_timeout_s:
            fail("kv_transfer", "peer_timeout_s", f"{self.peer_timeout_s} s leaves room for fewer than two heartbeats "
                  f"at {self.heartbeat_interval_s} s")

    def resolved(self, device_memory: bool) -> KVTransferConfig:
        """This config with every field left None (chosen by memory kind) filled in for an agent whose
        block pool is in device memory or not; explicit values stay."""
        device = {"chunk_blocks": 8192, "staging_slots": 16, "staging_slot_bytes": 64 << 20,
                  "staging_slots_per_request": 2, "poll_interval_s": 2e-5, "target_poll_s": 2e-4,
                  "announce_posts": True, "caller_posts_last": True, "spin_s": 5e-4,
                  "spin_switch_interval_s": 0.0, "caller_waits_s": 2e-3, "run_descs_max": 0,
                  "caller_holds_lock": True}
        host = {"chunk_blocks": 1024, "staging_slots": 8, "staging_slot_bytes": 16 << 20,
                "staging_slots_per_request": 4, "poll_interval_s": 2e-4, "target_poll_s": 1e-3,
                "announce_posts": True, "caller_posts_last": False, "spin_s": 0.0,
                "spin_switch_interval_s": 0.0, "caller_waits_s": 0.0, "run_descs_max": 0,
                "caller_holds_lock": False}
        defaults = device if device_memory else host
        return msgspec.structs.replace(self, **{k: v for k, v in defaults.items() if getattr(self, k) is None})

    def pack_threshold(self, device_memory: bool) -> int:
        """Mean descriptor bytes below which a chunk is packed (0: never)."""
        if self.staging_slots == 0:
            return 0
        if self.pack_below_bytes is not None:
            return self.pack_below_bytes
        return (1 << 20) if device_memory else 0


def kv_transfer_config_from_table(table: Mapping[str, Any], control_host: str, control_port: int,
                                  tls: TLSConfig | None = None) -> KVTransferConfig:
    """A worker's `[kv_transfer]` config-file table, with `auth_token_file` read here (the token never
    sits in the config file itself), the control plane bound where the worker's flags say and secured
    by `tls` (the worker's `[internal_tls]`). `ValueError` names the field on a bad value."""
    values: dict[str, Any] = dict(table)
    if tls is not None:
        values["tls"] = msgspec.to_builtins(tls)
    token_file = values.pop("auth_token_file", None)
    if token_file:
        values["auth_token"] = Path(token_file).read_text().strip()
    values.update(control_host=control_host, control_port=control_port)
    return decode_table(KVTransferConfig, values, "kv_transfer")
