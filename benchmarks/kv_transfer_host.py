"""Host (CPU) cost of one KV-transfer request, split by phase, with the real NIXL agent.

Two parts, both with tiny blocks (`--block-bytes`, default 64 B) so that moving bytes costs next to
nothing and what remains is the software on the host:

1. NIXL phases (two `NixlBackend`s in this process, UCX loopback), per request of `--blocks`
   blocks, contiguous and scattered ids:
   - `descs_build`: the numpy descriptor lists (`coalesced_descs`) the per-transfer path builds;
   - `get_xfer_descs`: NIXL's descriptor-list objects from them (both sides);
   - `initialize_xfer`: a request from those lists (NIXL validates every descriptor);
   - `make_prepped_xfer`: a request from block indices into the pool lists prepared once;
   - `post`: `transfer()` (the post itself);
   - `complete`: `check_xfer_state` until DONE (and how many polls);
   - `notif`: the receiver's `get_new_notifs` until the request's notification is there;
   - `release`: `release_xfer_handle`;
   - `repost`: re-posting a finished prepared request (`transfer(handle, notif)`), no new handle.
2. The engine (`NixlTransferAgent`, two agents in this process): per request, `write_blocks` calls
   as a prefill streams them (`--stream-blocks` per call, or all at once), from the first call to
   the sender's and the receiver's DONE, for the engine's current polling and with
   `--set`-style overrides (`--variant NAME:KEY=VALUE,...`).

Prints a table, writes JSON (`--json`, default docs/benchmarks/kv-transfer-host-cpu.json).

    python benchmarks/kv_transfer_host.py --reps 200
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cedserve.common.machine import describe_machine
from cedserve.kv_transfer.config import KVTransferConfig
from cedserve.kv_transfer.descriptors import RegionAddress, coalesced_descs
from cedserve.kv_transfer.nixl_backend import NixlBackend
from cedserve.kv_transfer.region import KVLayout, KVRegion


def _us(values: list[float]) -> float:
    return statistics.median(values) * 1e6 if values else 0.0


def nixl_phases(block_bytes: int, blocks: int, pool: int, reps: int) -> list[dict[str, Any]]:
    cfg = KVTransferConfig(auth_token="host-bench")
    src_t = torch.ones(pool * block_bytes, dtype=torch.uint8)
    dst_t = torch.zeros(pool * block_bytes, dtype=torch.uint8)
    a, b = NixlBackend("hostbench-src", cfg), NixlBackend("hostbench-dst", cfg)
    rows = []
    try:
        a.register(src_t)
        b.register(dst_t)
        peer = a.add_peer(b.metadata())
        b.add_peer(a.metadata())
        agent, other = a._agent, b._agent
        local_list = a.prep_blocks(None, src_t.data_ptr(), block_bytes, pool, 0, "DRAM")
        remote_list = a.prep_blocks(peer, dst_t.data_ptr(), block_bytes, pool, 0, "DRAM")
        la, ra = RegionAddress(src_t.data_ptr(), pool, 0), RegionAddress(dst_t.data_ptr(), pool, 0)
        rng = np.random.default_rng(0)
        for alloc in ("contiguous", "scattered"):
            ph: dict[str, list[float]] = {k: [] for k in (
                "descs_build", "get_xfer_descs", "initialize_xfer", "make_prepped_xfer", "post", "complete",
                "notif", "release", "repost", "send_notif", "get_new_notifs_empty")}
            polls: list[int] = []
            for rep in range(reps + 3):
                if alloc == "contiguous":
                    src = np.arange(blocks, dtype=np.int64)
                    dst = np.arange(blocks, dtype=np.int64) + blocks
                else:
                    src = rng.choice(pool, blocks, replace=False).astype(np.int64)
                    dst = rng.choice(pool, blocks, replace=False).astype(np.int64)
                tag = f"r{rep}".encode()
                t0 = time.perf_counter()
                descs = coalesced_descs(la, ra, block_bytes, src, dst)
                t1 = time.perf_counter()
                ld = agent.get_xfer_descs(descs.local, "DRAM")
                rd = agent.get_xfer_descs(descs.remote, "DRAM")
                t2 = time.perf_counter()
                h1 = agent.initialize_xfer("WRITE", ld, rd, peer, tag)
                t3 = time.perf_counter()
                agent.release_xfer_handle(h1)
                t4 = time.perf_counter()
                h = agent.make_prepped_xfer("WRITE", a._lists[local_list], src.astype(np.int32),
                                            a._lists[remote_list], dst.astype(np.int32), tag)
                t5 = time.perf_counter()
                status = agent.transfer(h)
                t6 = time.perf_counter()
                # The target is progressed too (as its agent's loop does): UCX emulates some puts over
                # active messages on shared memory, which complete only when the target polls.
                n, seen, t8 = 0, False, 0.0
                while status == "PROC":
                    status = agent.check_xfer_state(h)
                    n += 1
                    if not seen and any(tag in v for v in other.get_new_notifs().values()):
                        seen, t8 = True, time.perf_counter()
                t7 = time.perf_counter()
                while not seen:
                    if any(tag in v for v in other.get_new_notifs().values()):
                        seen, t8 = True, time.perf_counter()
                t8 = max(t8, t7)
                status = agent.transfer(h, tag + b"x")  # the same request again
                seen = False
                while status == "PROC" or not seen:
                    if status == "PROC":
                        status = agent.check_xfer_state(h)
                    seen = seen or any(tag + b"x" in v for v in other.get_new_notifs().values())
                t10 = time.perf_counter()
                agent.release_xfer_handle(h)
                t11 = time.perf_counter()
                agent.send_notif(peer, b"hb")
                t12 = time.perf_counter()
                while not other.get_new_notifs():
                    pass
                t13 = time.perf_counter()
                other.get_new_notifs()
                t14 = time.perf_counter()
                if rep < 3:
                    continue  # warm-up
                ph["descs_build"].append(t1 - t0)
                ph["get_xfer_descs"].append(t2 - t1)
                ph["initialize_xfer"].append(t3 - t2)
                ph["make_prepped_xfer"].append(t5 - t4)
                ph["post"].append(t6 - t5)
                ph["complete"].append(t7 - t6)
                ph["notif"].append(t8 - t7)
                ph["repost"].append(t10 - t8)
                ph["release"].append(t11 - t10)
                ph["send_notif"].append(t12 - t11)
                ph["get_new_notifs_empty"].append(t14 - t13)
                polls.append(n)
            runs = descs.count
            row = {"part": "nixl", "alloc": alloc, "blocks": blocks, "block_bytes": block_bytes,
                   "descriptors": runs, "polls": statistics.median(polls),
                   **{f"{k}_us": round(_us(v), 2) for k, v in ph.items()}}
            row["per_transfer_path_us"] = round(row["descs_build_us"] + row["get_xfer_descs_us"]
                                                + row["initialize_xfer_us"], 2)
            rows.append(row)
    finally:
        a.close()
        b.close()
    return rows


def engine(block_bytes: int, blocks: int, stream: int, reps: int, variant: str,
           overrides: dict[str, Any]) -> list[dict[str, Any]]:
    from cedserve.kv_transfer.agent import NixlTransferAgent
    from cedserve.kv_transfer.protocol import TransferMode

    layout = KVLayout.raw(block_bytes)
    pool = blocks * 3
    cfg = KVTransferConfig(auth_token="host-bench", peer_timeout_s=5.0, heartbeat_interval_s=0.5, **overrides)
    src = KVRegion(torch.ones(pool * block_bytes, dtype=torch.uint8), block_bytes)
    dst = KVRegion(torch.zeros(pool * block_bytes, dtype=torch.uint8), block_bytes)
    sender = NixlTransferAgent(cfg, src, layout, f"hb-send-{variant}")
    receiver = NixlTransferAgent(cfg, dst, layout, f"hb-recv-{variant}")
    rows = []
    try:
        sender.handshake(receiver.control_address)
        rng = np.random.default_rng(1)
        for alloc in ("contiguous", "scattered"):
            calls: list[float] = []
            send_done: list[float] = []
            recv_done: list[float] = []
            opens: list[float] = []
            last_post: list[float] = []
            cpu: list[float] = []
            for rep in range(reps + 2):
                rid = f"{variant}-{alloc}-{rep}"
                ids = (np.arange(blocks, dtype=np.int64) if alloc == "contiguous"
                       else rng.choice(pool, blocks, replace=False).astype(np.int64))
                dids = (np.arange(blocks, dtype=np.int64) if alloc == "contiguous"
                        else rng.choice(pool, blocks, replace=False).astype(np.int64))
                res = receiver.receiver().reserve(rid, dids, sender=sender.name, mode=TransferMode.WRITE,
                                                  lease_s=30.0, on_finish=None)
                t0 = time.perf_counter()
                sender.sender().open(res, timeout_s=30.0, on_finish=None)
                t1 = time.perf_counter()
                time.sleep(0.002)  # both loops back asleep, as when a prefill's first KV is ready
                t2 = time.perf_counter()
                start_mono, start_cpu = time.monotonic(), time.process_time()
                for s in range(0, blocks, stream):
                    sender.sender().write_blocks(rid, ids[s: s + stream], last=s + stream >= blocks)
                t3 = time.perf_counter()
                r_send = sender.sender().wait(rid, 30.0)
                r_recv = receiver.receiver().wait(rid, 30.0)
                cpu_s = time.process_time() - start_cpu
                if rep < 2:
                    continue
                opens.append(t1 - t0)
                cpu.append(cpu_s)
                last_post.append((r_send.last_post_s or start_mono) - start_mono)
                calls.append(t3 - t2)
                send_done.append(r_send.finished_s - start_mono)
                recv_done.append(r_recv.finished_s - start_mono)
            rows.append({"part": "engine", "variant": variant, "alloc": alloc, "blocks": blocks,
                         "block_bytes": block_bytes, "stream_blocks": stream, "overrides": overrides,
                         "open_us": round(_us(opens), 1), "write_calls_us": round(_us(calls), 1),
                         "write_call_us_each": round(_us(calls) / -(-blocks // stream), 2),
                         "last_post_us": round(_us(last_post), 1),
                         "cpu_us": round(_us(cpu), 1),
                         "sender_done_us": round(_us(send_done), 1), "receiver_done_us": round(_us(recv_done), 1),
                         "receiver_done_p90_us": round(float(np.percentile(recv_done, 90)) * 1e6, 1)})
    finally:
        sender.close()
        receiver.close()
    return rows


def _parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    name, _, rest = text.partition(":")
    out: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        out[k] = json.loads(v)
    return name, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block-bytes", type=int, default=64)
    p.add_argument("--blocks", type=int, default=2048, help="blocks per request (2,048: a 128K-token request)")
    p.add_argument("--stream-blocks", type=int, default=128, help="blocks per write_blocks call (engine part)")
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--engine-reps", type=int, default=30)
    p.add_argument("--variant", action="append", default=[],
                   help="engine variant NAME:KEY=JSON,... (KVTransferConfig fields); default: the config's own")
    p.add_argument("--skip-nixl", action="store_true")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    started = time.time()
    rows: list[dict[str, Any]] = []
    if not args.skip_nixl:
        rows += nixl_phases(args.block_bytes, args.blocks, args.blocks * 4, args.reps)
        keys = [k for k in rows[0] if k.endswith("_us")]
        print(f"{'NIXL phase, us per request':<28}" + "".join(f"{r['alloc']:>12}" for r in rows))
        print(f"{'descriptors (merged runs)':<28}" + "".join(f"{r['descriptors']:>12}" for r in rows))
        for k in keys:
            print(f"{k[:-3]:<28}" + "".join(f"{r[k]:>12.1f}" for r in rows))
        print(f"{'polls until DONE':<28}" + "".join(f"{r['polls']:>12.0f}" for r in rows))
    variants = [_parse_variant(v) for v in args.variant] or [("default", {})]
    erows: list[dict[str, Any]] = []
    for name, overrides in variants:
        for stream in sorted({args.stream_blocks, args.blocks}):
            erows += engine(args.block_bytes, args.blocks, stream, args.engine_reps, name, overrides)
    print(f"\n{'engine variant':<16} {'alloc':<11} {'stream':>6} {'open':>8} {'writes':>8} {'each':>7} "
          f"{'last post':>10} {'send DONE':>10} {'recv DONE':>10} {'recv p90':>9} {'cpu':>7}  (us; from the first write_blocks)")
    for r in erows:
        print(f"{r['variant']:<16} {r['alloc']:<11} {r['stream_blocks']:>6} {r['open_us']:>8.0f} "
              f"{r['write_calls_us']:>8.0f} {r['write_call_us_each']:>7.1f} {r['last_post_us']:>10.0f} "
              f"{r['sender_done_us']:>10.0f} {r['receiver_done_us']:>10.0f} {r['receiver_done_p90_us']:>9.0f} "
              f"{r['cpu_us']:>7.0f}")
    rows += erows
    out = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "command": "python benchmarks/kv_transfer_host.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": describe_machine("cpu"), "elapsed_s": round(time.time() - started, 1),
           "notes": ("Host cost per request, tiny blocks (bytes cost ~nothing). nixl rows: medians in us of each "
                     "NIXL phase, two agents in one process over UCX loopback; per_transfer_path = numpy lists + "
                     "get_xfer_descs + initialize_xfer (what a post without prepared lists costs before posting). "
                     "engine rows: two NixlTransferAgents in one process; writes = all write_blocks calls of a "
                     "request; last_post = from the first write_blocks call to the start of the sender's last NIXL post; "
                     "send/recv DONE = from the first write_blocks call to that side's finish; cpu = the process's "
                     "CPU time (every thread: caller, both progress loops) from the first write_blocks call to "
                     "both sides' DONE."),
           "rows": rows}
    path = Path(args.json) if args.json else Path("docs/benchmarks/kv-transfer-host-cpu.json")
    if path.parent.is_dir():
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"# wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
