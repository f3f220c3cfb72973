"""`cedserve bench kv-transfer`: the KV transfer load test.

With `--prefill-address` and `--decode-address` it instead measures the link between two RUNNING
workers (`link_bench.py`: what `helm test` runs); everything below is the matrix mode.

One receiver (decode) process and one or more sender (prefill) processes, on this host, in two
network namespaces joined by a veth pair (`--netns`: UCX over TCP, as between machines), or on
other hosts (`--hosts`, started over ssh). Block pools use the model's real block layout
(`--preset`, `--block-size`: 56,960 B per 64-token block at the released geometry).

For each cell of the matrix (request size x batch x READ/WRITE x fan-in x layout x block
allocation x packing) it runs `--reps` rounds: the driver reserves blocks on the receiver (decode
first), hands the reservations to the senders, which stream their blocks in prefill-sized pieces,
and waits on both sides. It reports aggregate GB/s, p50/p99 per-request latency and descriptors per
request, and, in the same run and processes, the raw NIXL rate of ONE descriptor of the same bytes
and a plain memory copy of them, so every figure reads as a ratio. The `per_layer` layout moves the
same bytes the way a conventional paged cache would (one descriptor per block per layer).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cedserve.bench.kv_transfer import link_bench
from cedserve.bench.kv_transfer.harness import LayoutSpec, NetnsPair, PeerProcess, WorkerSpec
from cedserve.common.machine import describe_machine, loadavg

_TOKEN = "kv-transfer-bench"  # a private token for the bench's own processes


@dataclass(frozen=True)
class Cell:
    layout: str
    alloc: str
    pack: str
    mode: str
    tokens: int
    batch: int
    fan_in: int

    @property
    def group(self) -> tuple[str, str]:
        """Cells sharing a group run on the same processes (layout and packing are agent config)."""
        return self.layout, self.pack

    def key(self) -> str:
        return f"{self.layout}-{self.alloc}-{self.pack}-{self.mode}-{self.tokens}-b{self.batch}-f{self.fan_in}"


def parse_tokens(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1024, "M": 1024 * 1024}.get(text[-1:], 1)
    return int(float(text.rstrip("KM")) * scale)


def default_matrix(sizes: Sequence[int], batches: Sequence[int], modes: Sequence[str],
                   fan_ins: Sequence[int], max_multi_tokens: int) -> list[Cell]:
    """The main matrix on our layout (random block ids, packing by size), contiguous block ids
    (WRITE, every batch: the steady-state rate with several requests in flight), plus on single
    requests: the per-layer baseline and forced packing. Requests larger than `max_multi_tokens`
    run only alone (memory)."""
    cells = []
    for tokens in sizes:
        multi = [b for b in batches if b == 1 or tokens <= max_multi_tokens]
        for mode in modes:
            for batch in batches:
                for fan_in in fan_ins:
                    if (batch > 1 or fan_in > 1) and tokens > max_multi_tokens:
                        continue
                    cells.append(Cell("cross_layer", "random", "auto", mode, tokens, batch, fan_in))
            cells.append(Cell("per_layer", "random", "off", mode, tokens, 1, 1))
        cells += [Cell("cross_layer", "contiguous", "auto", "write", tokens, b, 1) for b in multi or [1]]
        cells.append(Cell("cross_layer", "random", "on", "write", tokens, 1, 1))
    return cells


class Group:
    """The processes of one (layout, packing) group: a receiver and `fan_in` senders."""

    def __init__(self, args: argparse.Namespace, layout: str, pack: str, recv_blocks: int, send_blocks: int,
                 senders: int, netns: NetnsPair | None) -> None:
        base_cfg: dict[str, Any] = {"auth_token": _TOKEN, "peer_timeout_s": args.peer_timeout_s,
                                    "heartbeat_interval_s": args.peer_timeout_s / 6,
                                    "lease_s": 600.0}
        if args.chunk_blocks is not None:
            base_cfg["chunk_blocks"] = args.chunk_blocks
        for item in args.set:  # --set KEY=VALUE: any KVTransferConfig field, JSON-typed
            key, _, value = item.partition("=")
            base_cfg[key] = json.loads(value)
        if pack == "off":
            base_cfg["pack_below_bytes"] = 0
        elif pack == "on":
            base_cfg["pack_below_bytes"] = 1 << 30
        lay = (LayoutSpec(kind=layout, preset=None, raw_block_bytes=args.block_bytes, raw_layers=4)
               if args.block_bytes else LayoutSpec(kind=layout, preset=args.preset, block_size=args.block_size))
        cuda = args.device == "cuda"
        gpus = _gpu_count() if cuda else 0

        def launch(name: str, blocks: int, index: int, side: int) -> PeerProcess:
            cfg = dict(base_cfg)
            prefix: list[str] = []
            env: dict[str, str] = {}
            if netns is not None:
                cfg.update(netns.config(side))
                prefix = netns.prefix(side)
            elif args.hosts:  # receiver on the first host, senders round-robin on the others
                others = args.hosts[1:] or args.hosts
                host = args.hosts[0] if side == 0 else others[(index - 1) % len(others)]
                cfg["control_host"] = host
                prefix = ["ssh", host]
            if cuda and gpus:
                env["CUDA_VISIBLE_DEVICES"] = str(index % gpus)
            spec = WorkerSpec(name=name, num_blocks=blocks, layout=lay, device=args.device, config=cfg,
                              seed=index)
            return PeerProcess(spec, prefix=prefix, env=env)

        self.receiver = launch("decode0", recv_blocks, 0, 0)
        self.senders = [launch(f"prefill{i}", send_blocks, i + 1, 1) for i in range(senders)]
        for i, s in enumerate(self.senders):
            s.call("handshake", address=self.receiver.info["control_address"])
            s.call("fill", seed=100 + i, timeout_s=600)
        self.block_bytes = int(self.receiver.info["block_bytes"])
        self.same_clock = not args.hosts  # one kernel: CLOCK_MONOTONIC agrees across processes
        self._next_probe = 1

    def close(self) -> None:
        for p in [*self.senders, self.receiver]:
            p.close()

    def reference(self, nbytes: int, mode: str, cell: Cell | None = None) -> float:
        """Seconds of one NIXL request of `nbytes`, straight to NIXL: ONE descriptor, or with `cell`,
        the descriptors the cell's layout and block allocation make (in one request: NIXL's own
        cost of many descriptors). A WRITE is timed from its post on the sender to its notification's
        arrival on the receiver (one clock on one host), like the transfers; a READ until done."""
        extra: dict[str, Any] = {}
        if cell is not None:
            blocks = nbytes // self.block_bytes
            extra = {"alloc": cell.alloc, "num_blocks": blocks}
        probe = self._next_probe
        self._next_probe += 1
        if mode == "write":
            if extra:
                extra["peer_num_blocks"] = self.receiver.info["num_blocks"]
            if self.same_clock:  # the receiver polls as during a transfer while it waits for the probe
                self.receiver.call("expect_probe", probe_ids=[probe])
            (posted, done), = self.senders[0].call("raw", peer="decode0", nbytes=nbytes, op="WRITE",
                                                   probe_base=probe, **extra)["times"]
            if self.same_clock:
                done = self.receiver.call("probe", probe_ids=[probe])["arrivals"][0]
        else:
            if extra:
                extra["peer_num_blocks"] = self.senders[0].info["num_blocks"]
            (posted, done), = self.receiver.call("raw", peer="prefill0", nbytes=nbytes, op="READ",
                                                 probe_base=probe, **extra)["times"]
        return float(done - posted)

    def memcpy(self, nbytes: int) -> float:
        return float(self.senders[0].call("memcpy", nbytes=nbytes)["seconds"][0])

    def pack_cost(self, num_blocks: int, alloc: str) -> tuple[float, float]:
        """Seconds of one staging gather and one scatter of the cell's blocks (in the sender)."""
        got = self.senders[0].call("pack_cost", num_blocks=num_blocks, alloc=alloc, reps=3)
        return min(got["gather_s"]), min(got["scatter_s"])

    def run(self, cell: Cell, reps: int, stream_blocks: int, verify: bool) -> dict[str, Any]:
        blocks = cell.tokens // self.block_size_tokens
        latencies: list[float] = []
        from_write: list[float] = []
        phases: dict[str, list[float]] = {name: [] for name in _PHASES}
        descriptors: list[int] = []
        gbps: list[float] = []
        failures: list[str] = []
        verified: bool | None = None
        raw: list[float] = []
        same: list[float] = []
        copy: list[float] = []
        pack: list[tuple[float, float]] = []
        cpu: dict[str, list[float]] = {"sender": [], "receiver": []}
        polls: list[float] = []
        nbytes = blocks * self.block_bytes
        for rep in range(reps):
            names = [[f"{cell.key()}-r{rep}-s{j}-b{i}" for i in range(cell.batch)] for j in range(cell.fan_in)]
            requests = [{"request_id": rid, "num_blocks": blocks, "sender": f"prefill{j}", "mode": cell.mode}
                        for j in range(cell.fan_in) for rid in names[j]]
            res = self.receiver.call("reserve", requests=requests, alloc=cell.alloc)["reservations"]
            ids = [self.senders[j].send("send", reservations=res[j * cell.batch:(j + 1) * cell.batch],
                                        alloc=cell.alloc, stream_blocks=stream_blocks)
                   for j in range(cell.fan_in)]
            local = [self.senders[j].reply(m)["local_ids"] for j, m in enumerate(ids)]
            waits = [self.senders[j].send("wait", role="sender", request_ids=names[j], timeout_s=600)
                     for j in range(cell.fan_in)]
            sent = [self.senders[j].reply(m, 700)["results"] for j, m in enumerate(waits)]
            all_names = [rid for group in names for rid in group]
            got = self.receiver.call("wait", role="receiver", request_ids=all_names, timeout_s=600)["results"]
            walls, done = [], 0
            for j in range(cell.fan_in):
                failures += [f"{rid}: {r.get('error', r['state'])}" for rid, r in sent[j].items()
                             if r["state"] != "done"]
                ok = {rid: r for rid, r in sent[j].items() if r["state"] == "done" and got[rid]["state"] == "done"}
                if not ok:
                    continue
                # Latency: sender open() to the bytes in place on the receiver (its DONE), when both
                # clocks agree; else to the sender's own completion. The round's rate counts from the
                # first write_blocks call: open() asks the receiver's control plane first, a round
                # trip that a prefill worker makes when the request arrives, not when its KV is ready.
                ends = {rid: got[rid]["finished_s"] if self.same_clock else r["finished_s"] for rid, r in ok.items()}
                walls.append((max(ends.values()), min(r.get("first_write_s", r["started_s"]) for r in ok.values())))
                done += len(ok)
                latencies += [ends[rid] - r["started_s"] for rid, r in ok.items()]
                from_write += [ends[rid] - r.get("first_write_s", r["started_s"]) for rid, r in ok.items()]
                if self.same_clock:
                    for rid, r in ok.items():
                        for name, value in _phases(r, got[rid]).items():
                            phases[name].append(value)
                descriptors += [r["descriptors"] + got[rid]["descriptors"] for rid, r in ok.items()]
                polls += [float(r["status_polls"]) for r in ok.values() if r.get("status_polls") is not None]
            failures += [f"{rid} (receiver): {r.get('error', r['state'])}" for rid, r in got.items()
                         if r["state"] != "done"]
            for j in range(cell.fan_in):
                cpu["sender"] += _cpu_per_request(sent[j].values())
            cpu["receiver"] += _cpu_per_request(got.values())
            if verify and rep == 0 and not failures:
                rid = names[0][0]
                check = self.receiver.call("verify", request_id=rid, src_seed=100, src_ids=local[0][rid],
                                           timeout_s=600)
                verified = bool(check["ok"])
            self.receiver.call("release", request_ids=all_names)
            if walls:
                wall = (max(e for e, _ in walls) - min(st for _, st in walls) if self.same_clock
                        else max(e - st for e, st in walls))
                gbps.append(done * blocks * self.block_bytes / wall / 1e9)
            # The references run right after each round, so load on a shared host hits both alike.
            raw.append(nbytes / self.reference(nbytes, cell.mode) / 1e9)
            same.append(nbytes / self.reference(nbytes, cell.mode, cell) / 1e9)
            copy.append(nbytes / self.memcpy(nbytes) / 1e9)
            if cell.layout == "cross_layer":
                pack.append(self.pack_cost(blocks, cell.alloc))
        out: dict[str, Any] = {**asdict(cell), "blocks_per_request": blocks, "bytes_per_request": nbytes,
                               "reps": reps, "gbps": _median(gbps), "gbps_best": max(gbps, default=0.0),
                               "raw_gbps": _median(raw), "raw_gbps_best": max(raw, default=0.0),
                               "nixl_same_descs_gbps": _median(same), "memcpy_gbps": _median(copy),
                               "gbps_all": [round(x, 3) for x in gbps], "raw_gbps_all": [round(x, 3) for x in raw],
                               "p50_ms": _pct(latencies, 50) * 1e3, "p99_ms": _pct(latencies, 99) * 1e3,
                               "p50_from_write_ms": _pct(from_write, 50) * 1e3,
                               "descriptors_per_request": statistics.mean(descriptors) if descriptors else 0,
                               # the sender's NIXL status polls per request (an older engine: None)
                               "sender_status_polls_p50": _pct(polls, 50) if polls else None,
                               "gather_ms": _median([g for g, _ in pack]) * 1e3,
                               "scatter_ms": _median([s for _, s in pack]) * 1e3,
                               "phases_p50_ms": {name: round(_pct(v, 50) * 1e3, 4) for name, v in phases.items() if v},
                               # host CPU (every thread of the process) per request, median over rounds
                               "sender_cpu_us_per_request": round(_median(cpu["sender"]) * 1e6, 1),
                               "receiver_cpu_us_per_request": round(_median(cpu["receiver"]) * 1e6, 1),
                               "verified": verified, "failures": failures[:5]}
        out["ratio_to_raw"] = out["gbps"] / out["raw_gbps"] if out["raw_gbps"] else 0.0
        # How often the sender's loop looked while its request ran: the post's return to the poll
        # that saw it done, over the polls (one request per transfer: `--stream-blocks` above its size).
        seen = out["phases_p50_ms"].get("returned_to_nixl_done")
        out["sender_poll_interval_us"] = (round(seen * 1e3 / out["sender_status_polls_p50"], 2)
                                          if seen is not None and out["sender_status_polls_p50"] else None)
        # What a request costs beyond moving its bytes at the raw one-descriptor rate.
        out["fixed_ms"] = out["p50_from_write_ms"] - (nbytes / out["raw_gbps"] / 1e6 if out["raw_gbps"] else 0.0)
        out["ratio_to_raw_best"] = out["gbps_best"] / out["raw_gbps_best"] if out["raw_gbps_best"] else 0.0
        out["ratio_to_memcpy"] = out["gbps"] / out["memcpy_gbps"] if out["memcpy_gbps"] else 0.0
        out["ratio_to_nixl_same_descs"] = (out["gbps"] / out["nixl_same_descs_gbps"]
                                           if out["nixl_same_descs_gbps"] else 0.0)
        return out

    block_size_tokens = 64


def _cpu_per_request(results: Iterable[dict[str, Any]]) -> list[float]:
    """One process's CPU seconds per request in a round: from the earliest start to the latest end of
    its DONE requests' `cpu_start_s` / `cpu_end_s` (its `time.process_time`: every thread, the
    progress loop's polls and the harness's own commands included), over how many there were; [] when
    none carries them."""
    marks = [(r["cpu_start_s"], r["cpu_end_s"]) for r in results if r.get("state") == "done" and "cpu_end_s" in r]
    if not marks:
        return []
    return [(max(e for _, e in marks) - min(b for b, _ in marks)) / len(marks)]


_PHASES = ("writes", "closed_to_sender_done", "queued", "posted_to_sender_done", "sender_to_receiver_done",
           "sender_staging", "receiver_staging", "post_call", "returned_to_nixl_done", "nixl_done_to_sender_done")
"""Where a request's time from its first `write_blocks` goes (one clock; see `_phases`)."""


def _phases(sent: dict[str, Any], got: dict[str, Any]) -> dict[str, float]:
    """One request's time, in seconds, split at the sender's last handoff (`write_blocks(last=True)`),
    the start of its last NIXL post, the sender's DONE (a poll saw the last request complete; NIXL
    then sends its notification) and the receiver's DONE: `writes` (the producer's calls),
    `closed_to_sender_done`, itself `queued` (handoff to post: the thread wake-up and the step before
    it) plus `posted_to_sender_done` (the post, the bytes, the completion poll), and
    `sender_to_receiver_done` (the notification and the receiver's poll); beside them, each side's
    time in staging copies (`sender_staging`: gathers, `receiver_staging`: scatters, each with its
    wait), which fall inside the phases above. An engine that does not stamp its posts (an older
    one) gives all but the two parts of `closed_to_sender_done` and the staging times; a request
    without a handoff (READ) none. `posted_to_sender_done` splits further where the engine stamps
    them: `post_call` (the last post itself), `returned_to_nixl_done` (from its return to the poll that
    saw it complete: the bytes and the polling) and `nixl_done_to_sender_done` (the handle's release,
    the doorbell and the bookkeeping before the sender's DONE)."""
    first, closed, post = sent.get("first_write_s"), sent.get("closed_s"), sent.get("last_post_s")
    if first is None or closed is None:
        return {}
    out = {"writes": closed - first, "closed_to_sender_done": sent["finished_s"] - closed,
           "sender_to_receiver_done": got["finished_s"] - sent["finished_s"]}
    if post is not None:
        out.update(queued=post - closed, posted_to_sender_done=sent["finished_s"] - post)
    returned, seen = sent.get("last_posted_s"), sent.get("nixl_done_s")
    if post is not None and returned is not None and seen is not None:
        out.update(post_call=returned - post, returned_to_nixl_done=seen - returned,
                   nixl_done_to_sender_done=sent["finished_s"] - seen)
    if sent.get("staging_s") is not None and got.get("staging_s") is not None:
        out.update(sender_staging=sent["staging_s"], receiver_staging=got["staging_s"])
    return out


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def render_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'layout':<11} {'alloc':<10} {'pack':<4} {'mode':<5} {'tokens':>7} {'b':>2} {'fi':>2} "
            f"{'GB/s':>6} {'raw1':>6} {'ratio':>5} {'sameD':>6} {'memcpy':>6} {'p50 ms':>8} {'p99 ms':>8} {'fixed':>6} "
            f"{'desc/req':>8} {'cpu us s/r':>13} ok")
    lines = [head, "-" * len(head)]
    for r in rows:
        tokens = f"{r['tokens'] // 1024}K" if r["tokens"] < 1 << 20 else f"{r['tokens'] >> 20}M"
        ok = "FAIL" if r["failures"] else ("v" if r["verified"] else "-")
        lines.append(f"{r['layout']:<11} {r['alloc']:<10} {r['pack']:<4} {r['mode']:<5} {tokens:>7} "
                     f"{r['batch']:>2} {r['fan_in']:>2} {r['gbps']:>6.2f} {r['raw_gbps']:>6.2f} "
                     f"{r['ratio_to_raw']:>5.2f} {r['nixl_same_descs_gbps']:>6.2f} {r['memcpy_gbps']:>6.2f} "
                     f"{r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r.get('fixed_ms', 0.0):>6.2f} "
                     f"{r['descriptors_per_request']:>8.0f} "
                     f"{r.get('sender_cpu_us_per_request', 0.0):>6.0f}/{r.get('receiver_cpu_us_per_request', 0.0):<6.0f} "
                     f"{ok}")
    return "\n".join(lines)


def render_phases(rows: list[dict[str, Any]]) -> str:
    """Each cell's `phases_p50_ms` on one line (ms), with the sender's status polls per request."""
    lines = []
    for r in rows:
        if not r.get("phases_p50_ms"):
            continue
        parts = " ".join(f"{name}={ms:.3f}" for name, ms in r["phases_p50_ms"].items())
        polls = r.get("sender_status_polls_p50")
        tail = "" if polls is None else f" | polls {polls:.0f}, every {r.get('sender_poll_interval_us')} us"
        lines.append(f"# phases {r['alloc']} {r['tokens']}: {parts}{tail}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cedserve bench kv-transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4K,32K,128K,1M", help="request sizes in tokens")
    p.add_argument("--batch", default="1,4", help="requests per sender per round")
    p.add_argument("--modes", default="write,read")
    p.add_argument("--fan-in", default="1,2", help="prefill senders into one decode receiver")
    p.add_argument("--max-multi-tokens", default="128K", help="larger requests run only alone (memory)")
    p.add_argument("--only", default="", help="comma list of substrings; keep cells whose key has all")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--preset", default="v4.1-flash")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--block-bytes", type=int, default=0,
                   help="model-free blocks of this many bytes (a multiple of 4: four layers) instead of the "
                   "preset's; tiny blocks leave only the per-request fixed cost")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--stream-blocks", type=int, default=128, help="blocks per write_blocks call (a prefill chunk)")
    p.add_argument("--chunk-blocks", type=int, default=None,
                   help="most blocks per NIXL request (default: KVTransferConfig's)")
    p.add_argument("--peer-timeout-s", type=float, default=3.0,
                   help="liveness timeout of the bench's agents (generous: a loaded host must not flap)")
    p.add_argument("--netns", action="store_true", help="receiver and senders in two network namespaces (veth, TCP)")
    p.add_argument("--hosts", default="", help="comma list: receiver host, then sender hosts (started over ssh)")
    p.add_argument("--json", default="", help="write results here (matrix mode default: "
                   "docs/benchmarks/kv-transfer-<device>.json when run from a checkout; live mode: only when given)")
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a KVTransferConfig field of every agent, e.g. --set target_poll_s=0.0005")
    link_bench.add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.prefill_address or args.decode_address:
        return link_bench.main(args, list(argv if argv is not None else sys.argv[1:]))
    args.hosts = [h for h in args.hosts.split(",") if h]
    sizes = [parse_tokens(s) for s in args.sizes.split(",") if s]
    batches = [int(b) for b in args.batch.split(",") if b]
    fan_ins = [int(f) for f in args.fan_in.split(",") if f]
    modes = [m for m in args.modes.split(",") if m]
    cells = default_matrix(sizes, batches, modes, fan_ins, parse_tokens(args.max_multi_tokens))
    for term in filter(None, args.only.split(",")):
        cells = [c for c in cells if term in c.key()]
    if not cells:
        print("cedserve bench kv-transfer: no cells selected", file=sys.stderr)
        return 2
    Group.block_size_tokens = args.block_size
    started = time.time()
    machine = describe_machine(args.device)
    rows: list[dict[str, Any]] = []
    netns = NetnsPair().__enter__() if args.netns else None
    try:
        for group in dict.fromkeys(c.group for c in cells):
            group_cells = [c for c in cells if c.group == group]
            blocks = max(c.tokens // args.block_size for c in group_cells)
            recv_blocks = max(c.tokens // args.block_size * c.batch * c.fan_in for c in group_cells) + 64
            send_blocks = max(c.tokens // args.block_size * c.batch for c in group_cells) + 64
            senders = max(c.fan_in for c in group_cells)
            print(f"# group layout={group[0]} pack={group[1]}: {senders} sender(s), pools "
                  f"{recv_blocks}/{send_blocks} blocks, largest request {blocks} blocks", file=sys.stderr)
            g = Group(args, group[0], group[1], recv_blocks, send_blocks, senders, netns)
            try:
                for cell in group_cells:
                    row = g.run(cell, args.reps, args.stream_blocks, not args.no_verify)
                    rows.append(row)
                    print(render_table([row]).splitlines()[-1], file=sys.stderr, flush=True)
            finally:
                g.close()
    finally:
        if netns is not None:
            netns.__exit__()
    print(render_table(rows))
    print(render_phases(rows))
    out = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "command": "cedserve bench kv-transfer " + " ".join(argv if argv is not None else sys.argv[1:]),
           "machine": machine, "elapsed_s": round(time.time() - started, 1),
           "loadavg_at_end": loadavg(),
           "topology": ("two network namespaces, veth, UCX tcp" if args.netns else
                        f"hosts {args.hosts}" if args.hosts else "one host, loopback (UCX default transports)"),
           "notes": ("gbps: aggregate bytes / wall of a round (median over reps), from the senders' first "
                     "write_blocks call to the last receiver DONE; raw_gbps (raw1): one NIXL request "
                     "of ONE descriptor of bytes_per_request between the same processes, post to arrival "
                     "of its notification at the receiver, measured right after each round; "
                     "nixl_same_descs_gbps (sameD): one NIXL request of the cell's blocks as the engine posts them "
                     "(cross-layer: by index into the prepared pool lists, NIXL merging runs; per-layer: the "
                     "layout's descriptors), straight to NIXL: NIXL's own cost of the engine's request; memcpy_gbps: one "
                     "in-process copy of the same bytes; latency: sender open() to the receiver's DONE "
                     "(to the sender's own on_finish across hosts); p50_from_write_ms: from the sender's first "
                     "write_blocks call instead; fixed_ms: p50_from_write_ms minus bytes_per_request at raw_gbps "
                     "(what a request costs beyond its bytes); gather_ms / scatter_ms: one staging gather / "
                     "scatter of the request's blocks in the sender's process (best of 3, waited for), what "
                     "packing adds per request at most; phases_p50_ms: medians of a request's time split at "
                     "its last write_blocks call, the start of its last post, the sender's DONE and the "
                     "receiver's DONE (writes, closed_to_sender_done = queued + posted_to_sender_done, sender_to_receiver_done)"),
           "cells": rows}
    path = Path(args.json) if args.json else _default_json(args.device, args.netns)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
        print(f"# wrote {path}", file=sys.stderr)
    return 1 if any(r["failures"] for r in rows) else 0


def _default_json(device: str, netns: bool) -> Path | None:
    docs = Path.cwd() / "docs" / "benchmarks"
    if not docs.is_dir():
        return None
    return docs / f"kv-transfer-{device}{'-netns' if netns else ''}.json"


if __name__ == "__main__":
    raise SystemExit(main())
