"""Router figures: placement decision latency at scale, and router overhead per request on loopback.

1. Placement: 1,000 workers (500 prefill, 500 decode), a global index of >= 1M (block, worker)
   entries fed through real KV event batches, a 64K-token prompt (1,000 block hashes). Each decision
   is what the router does per request: hash-chain walk over the index for every holder, the loads,
   and the cost formula over all 250,000 pairs. p50/p99 over many decisions.
2. Overhead: the same streamed request through the router and directly against the workers
   (scripted in-process fake workers on loopback gRPC, so only the router's own work differs).

    python benchmarks/router.py --out docs/benchmarks/router-cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from cedserve.model.cache.events import AllBlocksCleared, BlockStored, KVEventBatch, Tier
from cedserve.model.cache.hashing import hash_blocks
from cedserve.router.index import GlobalPrefixIndex
from cedserve.router.placement import DecodeLoad, LinkRates, PrefillLoad, RequestShape, place


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_placement(num_workers: int, index_entries: int, prompt_blocks: int, decisions: int) -> dict[str, float]:
    rng = random.Random(0)
    index = GlobalPrefixIndex()
    prefill_ids = [f"p{i}" for i in range(num_workers // 2)]
    decode_ids = [f"d{i}" for i in range(num_workers // 2)]
    # Many distinct prompt families; each worker holds some families' prefixes in some tier.
    families = [hash_blocks(list(range(f * 7, f * 7 + 64 * prompt_blocks)), f"tenant{f % 10}", 64)
                for f in range(8)]
    per_worker = max(1, index_entries // num_workers)
    for w in prefill_ids + decode_ids:
        fam = families[rng.randrange(len(families))]
        held = fam[: rng.randrange(1, prompt_blocks)]
        filler = [rng.randbytes(32) for _ in range(max(0, per_worker - len(held)))]
        tier = rng.choice([Tier.DEVICE, Tier.HOST, Tier.DISK])
        index.apply(KVEventBatch(w, 0, [AllBlocksCleared(), BlockStored(held, tier), BlockStored(filler, Tier.DEVICE)],
                                 epoch=1))
    req = RequestShape(prompt_blocks * 64, 75, 64, 56_960)
    links = LinkRates({}, {"host": 2e10, "disk": 2e9}, default_transfer_bytes_per_s=5e10)
    times = []
    for k in range(decisions):
        hashes = families[k % len(families)]
        start = time.perf_counter()
        hits = index.prefix_hits(hashes)
        pl = [PrefillLoad(w, rng.randrange(0, 50_000), 2e4,
                          cached_blocks=hits[w].blocks_by_tier[Tier.DEVICE] if w in hits else 0,
                          offloaded_blocks={"host": hits[w].blocks_by_tier[Tier.HOST] if w in hits else 0,
                                            "disk": hits[w].blocks_by_tier[Tier.DISK] if w in hits else 0})
              for w in prefill_ids]
        dl = [DecodeLoad(w, rng.randrange(0, 64), 20_000, [0.02, 0.02, 0.021, 0.022], 5e3,
                         cached_blocks=hits[w].total_blocks if w in hits else 0) for w in decode_ids]
        place(req, pl, dl, links, decode_only_max_tokens=256)
        times.append(time.perf_counter() - start)
    return {"workers": num_workers, "index_entries": index.num_entries, "prompt_blocks": prompt_blocks,
            "decisions": decisions, "p50_ms": 1e3 * _pct(times, 0.5), "p99_ms": 1e3 * _pct(times, 0.99),
            "mean_ms": 1e3 * statistics.fmean(times)}


def bench_overhead(requests: int) -> dict[str, float]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
    import grpc
    from test_router_service import Cluster  # the scripted fake workers of the router tests

    from cedserve.client import Client
    from cedserve.model.presets import preset
    from cedserve.model.tokenizer import tiny_tokenizer_path
    from cedserve.proto import worker_pb2, worker_pb2_grpc

    ckpt = Path("build/bench_router_ckpt")
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps(preset("tiny").to_hf_dict()))
    (ckpt / "tokenizer.json").write_bytes(tiny_tokenizer_path().read_bytes())
    cluster = Cluster(ckpt)
    try:
        routed, direct = [], []
        prompt = list(range(3, 3 + 200))
        d_addr = next(h.endpoint.address for h in cluster.router.pool.workers.values() if h.role == "decode")
        p_addr = next(h.endpoint.address for h in cluster.router.pool.workers.values() if h.role == "prefill")
        with Client(cluster.address, timeout_s=30) as client, grpc.insecure_channel(d_addr) as dch, \
                grpc.insecure_channel(p_addr) as pch:
            dstub, pstub = worker_pb2_grpc.DecodeWorkerStub(dch), worker_pb2_grpc.PrefillWorkerStub(pch)
            for _ in range(requests):
                t = time.perf_counter()
                client.generate(prompt, max_tokens=16)
                routed.append(time.perf_counter() - t)
                t = time.perf_counter()  # the same calls, made directly
                lease = dstub.Reserve(worker_pb2.ReserveRequest(request_id="x", prompt_tokens=len(prompt)))
                first = next(iter(pstub.Prefill(worker_pb2.PrefillRequest(request_id="x", token_ids=prompt))))
                for _ in dstub.Decode(worker_pb2.DecodeRequest(
                        request_id="x", lease_id=lease.lease_id, token_ids=prompt,
                        first_token=first.first_token.token_id,
                        sampling=worker_pb2.SamplingParams(max_tokens=16))):
                    pass
                direct.append(time.perf_counter() - t)
    finally:
        cluster.close()
    return {"requests": requests, "routed_p50_ms": 1e3 * _pct(routed, 0.5), "direct_p50_ms": 1e3 * _pct(direct, 0.5),
            "overhead_p50_ms": 1e3 * (_pct(routed, 0.5) - _pct(direct, 0.5)),
            "routed_p99_ms": 1e3 * _pct(routed, 0.99), "direct_p99_ms": 1e3 * _pct(direct, 0.99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--index-entries", type=int, default=1_000_000)
    parser.add_argument("--prompt-blocks", type=int, default=1000)
    parser.add_argument("--decisions", type=int, default=200)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/router-cpu.json"))
    args = parser.parse_args()
    placement = bench_placement(args.workers, args.index_entries, args.prompt_blocks, args.decisions)
    print(f"placement: {placement['workers']} workers, {placement['index_entries']:,} index entries, "
          f"{placement['prompt_blocks']}-block prompt: p50 {placement['p50_ms']:.2f} ms, p99 {placement['p99_ms']:.2f} ms")
    overhead = bench_overhead(args.requests)
    print(f"overhead: routed p50 {overhead['routed_p50_ms']:.2f} ms vs direct {overhead['direct_p50_ms']:.2f} ms "
          f"(+{overhead['overhead_p50_ms']:.2f} ms per 16-token request)")
    report = {"benchmark": "router", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.node()} {platform.machine()} CPU, Python {platform.python_version()}",
              "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
              "placement": placement, "overhead": overhead}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
