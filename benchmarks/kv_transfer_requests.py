"""What a NIXL request costs by itself: the same bytes as 1, 2, 4 or 16 single-descriptor WRITE
requests posted back to back between two worker processes (one GPU each with `--device cuda`), each
with a notification, polled without sleeping. Prints a table and writes JSON.

    python benchmarks/kv_transfer_requests.py --device cuda --json /tmp/requests.json

GB/s counts from the first post to the last notification's arrival at the receiver; `post us` is
the time spent inside NIXL's post calls per request (how long a request holds the posting thread).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path

from cedserve.bench.kv_transfer.harness import LayoutSpec, PeerProcess, WorkerSpec
from cedserve.bench.kv_transfer.loadtest import _gpu_count, parse_tokens
from cedserve.common.machine import describe_machine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sizes", default="32K,128K,1M", help="bytes of this many tokens of the model's layout")
    p.add_argument("--pieces", default="1,2,4,16")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    layout = LayoutSpec().build()
    sizes = [parse_tokens(s) // 64 * layout.block_bytes for s in args.sizes.split(",")]
    pieces = [int(x) for x in args.pieces.split(",")]
    blocks = max(sizes) // layout.block_bytes + 64
    cfg = {"auth_token": "requests-bench", "peer_timeout_s": 3.0, "heartbeat_interval_s": 0.5}
    env = (lambda i: {"CUDA_VISIBLE_DEVICES": str(i % _gpu_count())}) if args.device == "cuda" else (lambda i: {})
    recv = PeerProcess(WorkerSpec("decode0", blocks, device=args.device, config=cfg), env=env(0))
    send = PeerProcess(WorkerSpec("prefill0", blocks, device=args.device, config=cfg, seed=1), env=env(1))
    rows = []
    try:
        send.call("handshake", address=recv.info["control_address"])
        probe = 1
        for nbytes in sizes:
            for k in pieces:
                gbps, post_us = [], []
                for _ in range(args.reps + 1):  # the first round warms the mappings up
                    ids = list(range(probe, probe + k))
                    probe += k
                    recv.call("expect_probe", probe_ids=ids)
                    r = send.call("requests", peer="decode0", nbytes=nbytes - nbytes % k, pieces=k, probe_base=ids[0])
                    last = max(recv.call("probe", probe_ids=ids)["arrivals"])
                    gbps.append(nbytes / (last - r["posted_s"]) / 1e9)
                    post_us.append(r["in_post_s"] / k * 1e6)
                row = {"bytes": nbytes, "pieces": k, "gbps": statistics.median(gbps[1:]),
                       "post_us_per_request": statistics.median(post_us[1:]), "gbps_all": gbps[1:]}
                rows.append(row)
                print(f"{nbytes / 1e6:9.1f} MB x{k:<3} {row['gbps']:8.1f} GB/s  post {row['post_us_per_request']:8.1f} us/request",
                      flush=True)
    finally:
        send.close()
        recv.close()
    out = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "command": "python benchmarks/kv_transfer_requests.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": describe_machine(args.device), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
