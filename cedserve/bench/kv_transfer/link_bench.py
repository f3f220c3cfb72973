"""`cedserve bench kv-transfer --prefill-address --decode-address`: the KV link between two RUNNING workers.

Unlike the matrix load test (`loadtest.py`, which starts its own processes), this mode measures the
link a deployment really has: it calls `ProbeLink` on the prefill worker, which reserves blocks on
the decode worker through its normal Reserve path, WRITEs a seeded pattern into them over its NIXL
agent, has the decode worker check their digest and frees both sides (`prefill_workers/link_probe.py`).
One call per iteration (after `--warmup` untimed ones); the table shows each iteration's bytes,
seconds, GB/s, descriptors and verification, and the median GB/s is compared with `--min-gbps`.

Exit status: 0 when every iteration verified and the median reached `--min-gbps`; 1 when a probe
failed or did not verify, the median fell short, or `--timeout-s` passed; 2 for bad arguments (no
token). The `helm test` Job runs exactly this (docs/deploy.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

import grpc

from cedserve.common.credentials import token_metadata
from cedserve.common.machine import loadavg
from cedserve.common.tls import TLSConfig, open_channel
from cedserve.proto import worker_pb2 as wpb
from cedserve.proto import worker_pb2_grpc as wpb_grpc

TOKEN_ENV = "CEDSERVE_KV_TRANSFER_TOKEN"
MIB = 1 << 20
SEED_BASE = 0x6C696E6B  # each iteration fills its blocks with another seed


class LinkBenchError(Exception):
    """The run cannot go on (a probe failed, the deadline passed); the message says why."""


@dataclass(frozen=True)
class Iteration:
    """One probe as the prefill worker reported it."""

    index: int
    """0-based among timed iterations; negative for warm-up ones."""
    num_bytes: int
    num_blocks: int
    block_bytes: int
    transfer_s: float
    gbps: float
    descriptors: int
    verified: bool
    wall_s: float


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The live-worker flags of `cedserve bench kv-transfer` (the `helm test` contract, docs/deploy.md)."""
    g = p.add_argument_group("between running workers (the `helm test` mode; docs/kv_transfer.md)")
    g.add_argument("--prefill-address", metavar="HOST:PORT", help="a prefill worker's internal gRPC address: it sends")
    g.add_argument("--decode-address", metavar="HOST:PORT",
                   help="a decode worker's internal gRPC address (dialed by the prefill worker): it receives")
    g.add_argument("--size-mib", type=float, default=64.0, help="MiB moved per iteration (rounded up to whole blocks)")
    g.add_argument("--iterations", type=int, default=3, help="timed iterations")
    g.add_argument("--warmup", type=int, default=1, help="untimed iterations first (connection set-up)")
    g.add_argument("--min-gbps", type=float, default=0.0,
                   help="exit 1 when the median GB/s is below this (0: only completion and verification count)")
    g.add_argument("--timeout-s", type=float, default=300.0, help="deadline of the whole run")
    g.add_argument("--token", help=f"the workers' KV-transfer token (default: --token-file, else ${TOKEN_ENV})")
    g.add_argument("--token-file", metavar="PATH", help="file holding the token (the chart mounts its Secret)")
    g.add_argument("--tls-ca", metavar="PEM", help="CA bundle that verifies the prefill worker ([internal_tls] ca)")
    g.add_argument("--tls-cert", metavar="PEM", help="client certificate (mTLS)")
    g.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    g.add_argument("--tls-server-name", metavar="NAME", help="name expected in the worker's certificate "
                   "(the chart's tls.internal.serverName)")


def read_token(args: argparse.Namespace) -> str:
    """`--token`, else the `--token-file` contents, else `$CEDSERVE_KV_TRANSFER_TOKEN`; `ValueError` when none."""
    if args.token:
        return str(args.token)
    if args.token_file:
        try:
            return Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"--token-file {args.token_file}: {exc.strerror}") from None
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise ValueError(f"no KV-transfer token: give --token, --token-file or ${TOKEN_ENV}")
    return token


def check_arguments(args: argparse.Namespace) -> None:
    if not args.prefill_address or not args.decode_address:
        raise ValueError("--prefill-address and --decode-address go together")
    for name in ("size_mib", "iterations", "timeout_s"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.warmup < 0 or args.min_gbps < 0:
        raise ValueError("--warmup and --min-gbps cannot be negative")


def client_tls(args: argparse.Namespace) -> TLSConfig:
    """TLS of the channel to the prefill worker (plaintext without --tls-ca/--tls-cert); `ValueError`."""
    return TLSConfig(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca, server_name=args.tls_server_name)


def run_probes(args: argparse.Namespace, token: str, tls: TLSConfig, log: TextIO | None = None) -> list[Iteration]:
    """`--warmup` + `--iterations` probes, in order (a line each to `log`, default stderr);
    `LinkBenchError` at the first failure."""
    log = log if log is not None else sys.stderr
    deadline = time.monotonic() + args.timeout_s
    num_bytes = max(1, int(args.size_mib * MIB))
    out: list[Iteration] = []
    with open_channel(args.prefill_address, tls) as channel:
        stub = wpb_grpc.PrefillWorkerStub(channel)  # type: ignore[no-untyped-call]
        for i in range(-args.warmup, args.iterations):
            left = deadline - time.monotonic()
            if left <= 0:
                raise LinkBenchError(f"--timeout-s {args.timeout_s:g} passed after {len(out)} probes")
            request = wpb.ProbeLinkRequest(decode_address=args.decode_address, num_bytes=num_bytes,
                                           seed=SEED_BASE + i + args.warmup, timeout_ms=int(left * 1000 * 0.95))
            try:
                reply: wpb.ProbeLinkReply = stub.ProbeLink(request, timeout=left, metadata=token_metadata(token))
            except grpc.RpcError as exc:
                raise LinkBenchError(_rpc_message(exc, args.prefill_address)) from None
            it = Iteration(i, reply.num_bytes, reply.num_blocks, reply.block_bytes, reply.transfer_s, reply.gbps, reply.descriptors, reply.verified,
                           reply.wall_s)
            out.append(it)
            print(f"# {'warm-up' if i < 0 else f'iteration {i}'}: {_row(it)} ({reply.prefill_agent} -> "
                  f"{reply.decode_agent})", file=log, flush=True)
            if not reply.verified:
                raise LinkBenchError(f"iteration {i}: the decode worker's blocks hash to {reply.received_sha256}, "
                                     f"the sent ones to {reply.sha256}: the bytes arrived wrong")
    return out


def _rpc_message(exc: grpc.RpcError, address: str) -> str:
    code = exc.code()
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return f"prefill worker at {address} refused the token (UNAUTHENTICATED): {exc.details()}"
    return f"ProbeLink on the prefill worker at {address} failed: {code.name}: {exc.details()}"


def _row(it: Iteration) -> str:
    return (f"{it.num_bytes / MIB:>9.1f} {it.transfer_s:>9.4f} {it.gbps:>7.2f} {it.descriptors:>11d} "
            f"{'yes' if it.verified else 'NO':>8} {it.wall_s:>7.2f}")


def render_table(args: argparse.Namespace, timed: list[Iteration]) -> str:
    head = f"{'iter':>6} {'MiB':>9} {'seconds':>9} {'GB/s':>7} {'descriptors':>11} {'verified':>8} {'wall s':>7}"
    lines = [f"KV link {args.prefill_address} (prefill) -> {args.decode_address} (decode)", head, "-" * len(head)]
    lines += [f"{it.index:>6} {_row(it)}" for it in timed]
    rates = [it.gbps for it in timed]
    if rates:
        lines.append(f"median {statistics.median(rates):.2f} GB/s, min {min(rates):.2f}, max {max(rates):.2f}"
                     + (f"; required {args.min_gbps:g}" if args.min_gbps else ""))
    return "\n".join(lines)


def main(args: argparse.Namespace, argv: list[str]) -> int:
    """Run the live mode (see the module docstring); the exit status."""
    try:
        check_arguments(args)
        token = read_token(args)
        tls = client_tls(args)
    except ValueError as exc:
        print(f"cedserve bench kv-transfer: {exc}", file=sys.stderr)
        return 2
    started = time.time()
    error = ""
    iterations: list[Iteration] = []
    try:
        iterations = run_probes(args, token, tls)
    except LinkBenchError as exc:
        error = str(exc)
    timed = [it for it in iterations if it.index >= 0]
    median = statistics.median(it.gbps for it in timed) if timed and not error else 0.0
    if not error and median < args.min_gbps:
        error = f"median {median:.2f} GB/s is below --min-gbps {args.min_gbps:g}"
    print(render_table(args, timed))
    if args.json:
        _write_json(Path(args.json), args, argv, started, iterations, median, error)
    if error:
        print(f"cedserve bench kv-transfer: FAILED: {error}", file=sys.stderr)
        return 1
    print(f"cedserve bench kv-transfer: OK: {len(timed)} x {args.size_mib:g} MiB verified, median {median:.2f} GB/s")
    return 0


def _redacted(argv: list[str]) -> list[str]:
    """`argv` with a `--token` value replaced."""
    out = []
    for i, a in enumerate(argv):
        hidden = a.startswith("--token=") or (i > 0 and argv[i - 1] == "--token")
        out.append("--token=***" if a.startswith("--token=") else "***" if hidden else a)
    return out


def _write_json(path: Path, args: argparse.Namespace, argv: list[str], started: float, iterations: list[Iteration],
                median: float, error: str) -> None:
    out = {"date": dt.datetime.fromtimestamp(started, dt.timezone.utc).isoformat(timespec="seconds"),
           "command": "cedserve bench kv-transfer " + " ".join(_redacted(argv)),
           "machine": {"hostname": socket.gethostname(), "cores": os.cpu_count(), "python": platform.python_version(),
                       "kernel": platform.release(), "loadavg_at_end": loadavg()},
           "prefill_address": args.prefill_address, "decode_address": args.decode_address,
           "size_mib": args.size_mib, "min_gbps": args.min_gbps, "median_gbps": median,
           "ok": not error, "error": error, "iterations": [asdict(it) for it in iterations],
           "notes": "gbps: bytes / seconds, seconds from the prefill worker's first NIXL chunk to its DONE; "
                    "wall_s: the whole probe (reserve, fill, transfer, digest check, free); negative index: warm-up"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"# wrote {path}", file=sys.stderr)
