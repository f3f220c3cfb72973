"""What disaggregation adds to the time to first token at low load: colocated against disaggregated,
same prompts, same machine, one request at a time, old code beside new.

For each source tree (`--tree NAME=PATH`, its own `.venv`) two systems are started with
`PATH/.venv/bin/cedserve serve` (`--device`, the demo checkpoint unless `--serve-args` says
otherwise): `NAME/disagg` (1 prefill + 1 decode worker) and `NAME/colocated` (no prefill worker, 1
decode worker that prefills); the disaggregated router's `decode_only_max_tokens` is 0, so that no
short prompt is served decode-only there. Every round sends one fresh prompt (random ids, a cache salt of its
own: no prefix hit) to every system in turn, the order reversed every other round, so a shared
machine's load falls on all of them alike.

Per request: the client's first and second token, the usage (`ttft_s` from the router's receipt,
`kv_transfer_s`: the sender's open to close, overlapping the compute), and the phases, as the
deltas of the components' histogram sums around the request (one request in flight: the deltas are
that request's): the router's `cedserve_router_request_phase_seconds` (place, reserve, first token),
the prefill worker's `cedserve_prefill_phase_seconds` (admit, compute, ship, first token, state,
handoff) and the decode worker's local-prefill step (`cedserve_decode_join_step_seconds{kind=prefill}`)
and KV wait. A tree whose code predates a metric reports none for it.

"Beyond compute" is the router's TTFT less the model work on the first token's path: the prefill
worker's chunks and decoder replay (and, where it comes before the token, the state's encoding)
disaggregated; the local-prefill step colocated. That part is what the 5 ms target is about; the
compute itself differs by machine (and on CPU differs between the two paths far more than on a GPU).

    python benchmarks/disagg_ttft.py --tree old=/work/wt/base --tree new=. \\
        --prompt-tokens 64,256,512 --long-tokens 2048 --rounds 12 --long-rounds 4 --runs 3 \\
        --out docs/benchmarks/disagg-ttft-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cedserve.client import AsyncClient, Piece
from cedserve.common.machine import describe_machine

_METRIC = re.compile(r'^(cedserve_\w+?)_sum(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_METRICS_LINE = re.compile(r"^metrics of (\S+): (\S+)$")
_READY = "CEDSERVE_READY "

ROUTER_PHASES = ("place", "reserve", "first_token")
PREFILL_PHASES = ("admit", "compute", "ship", "first_token", "ship_state", "handoff")


@dataclass
class System:
    """One running `cedserve serve`: its public address and its processes' metrics URLs."""

    name: str
    tree: str
    colocated: bool
    proc: subprocess.Popen[str]
    address: str = ""
    metrics: dict[str, str] = field(default_factory=dict)


def start(name: str, tree: Path, colocated: bool, device: str, extra: list[str], log_root: Path) -> System:
    log_dir = log_root / name.replace("/", "-")
    log_dir.mkdir(parents=True, exist_ok=True)
    if not colocated:  # every prompt through the prefill worker: the router would serve short ones decode-only
        config = log_dir / "serve.toml"
        config.write_text("[router]\ndecode_only_max_tokens = 0\n")
        extra = ["--config", str(config), *extra]
    cmd = [str(tree / ".venv" / "bin" / "cedserve"), "serve", "--device", device, "--port", "0",
           "--http-port", "-1", "--prefill-workers", "0" if colocated else "1", "--decode-workers", "1",
           "--log-dir", str(log_dir), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    return System(name, str(tree), colocated, proc)


def wait_ready(system: System, timeout_s: float) -> None:
    assert system.proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    for line in system.proc.stdout:
        line = line.rstrip()
        if (m := _METRICS_LINE.match(line)) is not None:
            system.metrics[m.group(1)] = m.group(2)
        if line.startswith(_READY):
            system.address = json.loads(line[len(_READY):])["address"]
            return
        if time.monotonic() > deadline:
            break
    raise RuntimeError(f"{system.name} did not become ready (exit code {system.proc.poll()})")


def stop(system: System) -> None:
    if system.proc.poll() is None:
        os.killpg(system.proc.pid, signal.SIGINT)
        try:
            system.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(system.proc.pid, signal.SIGKILL)
            system.proc.wait()


def scrape(system: System) -> dict[str, float]:
    """Every histogram's sum, keyed `process:metric{labels}`."""
    sums: dict[str, float] = {}
    for process, url in system.metrics.items():
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        for line in text.splitlines():
            if (m := _METRIC.match(line)) is not None:
                labels = ",".join(f"{k}={v}" for k, v in _LABEL.findall(m.group(2) or ""))
                sums[f"{process}:{m.group(1)}{{{labels}}}"] = float(m.group(3))
    return sums


def phases(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The request's seconds by phase, from the sums' deltas (absent metrics are left out)."""
    def delta(key: str) -> float | None:
        return after[key] - before.get(key, 0.0) if key in after else None

    picks = {f"router.{p}": f"router:cedserve_router_request_phase_seconds{{phase={p}}}" for p in ROUTER_PHASES}
    picks.update({f"prefill.{p}": f"prefill0:cedserve_prefill_phase_seconds{{phase={p}}}" for p in PREFILL_PHASES})
    picks.update({"prefill.queue": "prefill0:cedserve_prefill_queue_seconds{effort_class=low}",
                  "prefill.arrival_to_first_token": "prefill0:cedserve_prefill_first_token_seconds{}",
                  "decode.local_prefill_step": "decode0:cedserve_decode_join_step_seconds{kind=prefill}",
                  "decode.transfer_wait": "decode0:cedserve_decode_transfer_wait_seconds{}",
                  "decode.join_queue": "decode0:cedserve_decode_queue_seconds{effort_class=low}"})
    out = {}
    for name, key in picks.items():
        value = delta(key)
        if value is not None:
            out[name] = value
    return out


async def one(system: System, client: AsyncClient, prompt: list[int], max_tokens: int, salt: str) -> dict[str, Any]:
    before = await asyncio.to_thread(scrape, system)
    start = time.perf_counter()
    arrivals: list[float] = []

    def on_piece(piece: Piece) -> None:
        arrivals.extend([time.perf_counter() - start] * len(piece.token_ids))

    done = await client.generate(prompt, on_piece=on_piece, max_tokens=max_tokens, cache_salt=salt, effort="low")
    await asyncio.sleep(0.05)  # the prefill's `done` and the lease's release settle before the scrape
    after = await asyncio.to_thread(scrape, system)
    usage = done.usage
    return {"client_ttft_s": arrivals[0], "client_second_token_s": arrivals[min(1, len(arrivals) - 1)],
            "router_ttft_s": float(usage["ttft_s"]), "kv_transfer_s": float(usage.get("kv_transfer_s", 0.0)),
            "phases_s": phases(before, after)}


def on_path_compute(record: dict[str, Any], colocated: bool, state_before_token: bool) -> float | None:
    """The model work between the router's receipt and the first token (see the module docstring)."""
    p = record["phases_s"]
    if colocated:
        return p.get("decode.local_prefill_step")
    if "prefill.compute" not in p:
        return None
    return p["prefill.compute"] + p["prefill.first_token"] + (p.get("prefill.ship_state", 0.0)
                                                             if state_before_token else 0.0)


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def run_once(systems: list[System], prompt_lens: list[int], rounds: dict[int, int], max_tokens: int,
                   vocab: int, warmup: int, rng: random.Random, run: int) -> dict[str, dict[str, list[dict[str, Any]]]]:
    clients = {s.name: AsyncClient(s.address, timeout_s=300) for s in systems}
    try:
        for i in range(warmup):
            for s in systems:
                await one(s, clients[s.name], [rng.randrange(3, vocab) for _ in range(64)], max_tokens,
                          f"warm{run}-{i}-{rng.random()}")
        records: dict[str, dict[str, list[dict[str, Any]]]] = {str(n): {s.name: [] for s in systems}
                                                                for n in prompt_lens}
        for n in prompt_lens:
            for r in range(rounds[n]):
                prompt = [rng.randrange(3, vocab) for _ in range(n)]
                order = systems if r % 2 == 0 else list(reversed(systems))
                for s in order:
                    rec = await one(s, clients[s.name], prompt, max_tokens, f"{s.name}-{run}-{n}-{r}-{rng.random()}")
                    records[str(n)][s.name].append(rec)
                    print(f"run {run} {n:>5} tokens {s.name:<16} ttft {1e3 * rec['router_ttft_s']:8.1f} ms",
                          file=sys.stderr, flush=True)
        return records
    finally:
        for c in clients.values():
            await c.close()


def summarize(records: list[dict[str, Any]], colocated: bool, state_before_token: bool) -> dict[str, Any]:
    def col(key: str) -> list[float]:
        return [r[key] for r in records]

    out: dict[str, Any] = {"requests": len(records),
                           "client_ttft_p50_ms": 1e3 * p50(col("client_ttft_s")),
                           "router_ttft_p50_ms": 1e3 * p50(col("router_ttft_s")),
                           "client_second_token_p50_ms": 1e3 * p50(col("client_second_token_s")),
                           "kv_transfer_p50_ms": 1e3 * p50(col("kv_transfer_s"))}
    compute = [on_path_compute(r, colocated, state_before_token) for r in records]
    if all(c is not None for c in compute):
        out["compute_on_path_p50_ms"] = 1e3 * p50([c for c in compute if c is not None])
        out["beyond_compute_p50_ms"] = 1e3 * p50([r["router_ttft_s"] - c for r, c in zip(records, compute)
                                                  if c is not None])
    names = sorted({k for r in records for k in r["phases_s"]})
    out["phases_p50_ms"] = {k: 1e3 * p50([r["phases_s"][k] for r in records if k in r["phases_s"]]) for k in names}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH of a source tree with its .venv "
                    "(repeat: old and new side by side)")
    ap.add_argument("--state-after-token", action="append", default=[], metavar="NAME",
                    help="trees whose prefill worker ships the bounded state after the first token (its encoding "
                         "is then not on the first token's path)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--serve-args", default="", help="more `cedserve serve` arguments for every system")
    ap.add_argument("--prompt-tokens", default="64,256,512")
    ap.add_argument("--long-tokens", default="2048", help="longer prompts, with --long-rounds each ('' for none)")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--long-rounds", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3, help="fresh systems per run")
    ap.add_argument("--max-tokens", type=int, default=2, help="at least 2: the decode worker takes part")
    ap.add_argument("--vocab", type=int, default=4000, help="prompt ids drawn from [3, vocab)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ready-timeout-s", type=float, default=600)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    trees = {name: Path(path).resolve() for name, path in (t.split("=", 1) for t in args.tree)}
    short = [int(x) for x in args.prompt_tokens.split(",") if x]
    long = [int(x) for x in args.long_tokens.split(",") if x]
    rounds = args.rounds_by_len = {**{n: args.rounds for n in short}, **{n: args.long_rounds for n in long}}
    rng = random.Random(args.seed)
    raw: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="disagg-ttft-") as tmp:
        for run in range(args.runs):
            systems = [start(f"{name}/{kind}", tree, kind == "colocated", args.device, args.serve_args.split(),
                             Path(tmp) / f"run{run}") for name, tree in trees.items() for kind in ("disagg", "colocated")]
            try:
                for s in systems:
                    wait_ready(s, args.ready_timeout_s)
                raw.append(asyncio.run(run_once(systems, short + long, rounds, args.max_tokens, args.vocab,
                                                args.warmup, rng, run)))
            finally:
                for s in systems:
                    stop(s)
    report = build_report(args, trees, raw)
    print_table(report)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


def build_report(args: argparse.Namespace, trees: dict[str, Path], raw: list[dict[str, Any]]) -> dict[str, Any]:
    by_run = []
    for run_records in raw:
        by_run.append({n: {name: summarize(recs, name.endswith("/colocated"),
                                           name.split("/")[0] not in args.state_after_token)
                           for name, recs in systems.items()} for n, systems in run_records.items()})
    combined: dict[str, dict[str, Any]] = {}
    for n in raw[0]:
        combined[n] = {}
        for name in raw[0][n]:
            recs = [r for run_records in raw for r in run_records[n][name]]
            combined[n][name] = summarize(recs, name.endswith("/colocated"),
                                          name.split("/")[0] not in args.state_after_token)
        for tree in trees:
            dis, col = combined[n][f"{tree}/disagg"], combined[n][f"{tree}/colocated"]
            gap: dict[str, float] = {"ttft_gap_p50_ms": dis["router_ttft_p50_ms"] - col["router_ttft_p50_ms"]}
            gap["ttft_gap_beyond_transfer_p50_ms"] = gap["ttft_gap_p50_ms"] - dis["kv_transfer_p50_ms"]
            if "beyond_compute_p50_ms" in dis and "beyond_compute_p50_ms" in col:
                gap["gap_beyond_compute_p50_ms"] = dis["beyond_compute_p50_ms"] - col["beyond_compute_p50_ms"]
            combined[n][f"{tree}/gap"] = gap
    return {"benchmark": "disagg-ttft", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": {**describe_machine(args.device), "loadavg_at_end": os.getloadavg()},
            "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
            "trees": {name: str(path) for name, path in trees.items()}, "note": args.note,
            "device": args.device, "serve_args": args.serve_args, "max_tokens": args.max_tokens, "runs": args.runs,
            "rounds": {str(k): v for k, v in sorted(args.rounds_by_len.items())},
            "combined": combined, "by_run": by_run, "requests": raw}


def print_table(report: dict[str, Any]) -> None:
    print("\nTTFT p50 (ms, router receipt to first token), all runs pooled; per run in the JSON's by_run")
    print(f"{'prompt':>6} {'system':<18} {'ttft':>8} {'client':>8} {'kv_xfer':>8} {'compute':>8} {'beyond':>8} "
          f"{'2nd tok':>8}")
    for n, systems in report["combined"].items():
        for name, s in systems.items():
            if name.endswith("/gap"):
                continue
            print(f"{n:>6} {name:<18} {s['router_ttft_p50_ms']:8.1f} {s['client_ttft_p50_ms']:8.1f} "
                  f"{s['kv_transfer_p50_ms']:8.1f} {s.get('compute_on_path_p50_ms', float('nan')):8.1f} "
                  f"{s.get('beyond_compute_p50_ms', float('nan')):8.1f} {s['client_second_token_p50_ms']:8.1f}")
        for name, g in systems.items():
            if name.endswith("/gap"):
                print(f"{n:>6} {name:<18} gap {g['ttft_gap_p50_ms']:8.1f}, less transfer "
                      f"{g['ttft_gap_beyond_transfer_p50_ms']:8.1f}, beyond compute "
                      f"{g.get('gap_beyond_compute_p50_ms', float('nan')):8.1f}")
    print("\nphases p50 (ms)")
    for n, systems in report["combined"].items():
        for name, s in systems.items():
            if not name.endswith("/gap") and s["phases_p50_ms"]:
                print(f"{n:>6} {name:<18} " + ", ".join(f"{k} {v:.2f}" for k, v in s["phases_p50_ms"].items()))


if __name__ == "__main__":
    main()
