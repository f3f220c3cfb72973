"""Where a request's TPOT goes: per-token arrival times at the client against the decode worker's own
step times, for systems side by side (one request at a time, alternated between them).

Each request (a fresh random prompt with a cache salt of its own, greedy, `max_tokens` output tokens)
is timed at the client token by token; the decode worker's `cedserve_decode_step_seconds` (count and
sum) is read before and after it. With one request in flight every step in that window is this
request's, so per request:

    tpot         (last token - first token) / (tokens - 1), as `cedserve bench serve` counts it
    first gap    first token (the prefill side's) -> second (the decode worker's first step: the join)
    steady ITL   (last token - second token) / (tokens - 2): the decode steps after the join
    join         the request's first decode step (read when the second token arrives)
    steady step  the decode worker's mean step after the join, and its steps per token (DSpark: < 1)
    outside      client span from the second to the last token minus the steps in it, per step:
                 everything not in a step (engine loop, decode -> router -> client streaming)
    phases       per token after the join: each phase of `cedserve_decode_loop_phase_seconds`
                 (the engine loop's tick and step, the Decode stream's handoff and gRPC write:
                 docs/decode.md, Where a token's time goes); `loop` the tick's phases but the model
                 pass and the idle wait (what the loop adds to the model, in series); `rest` the
                 steady span less the loop's busy time (the loop idle or waiting on nothing it
                 times). The stream's phases run on another thread, beside the next step: they add
                 latency, and hold the GIL, but are not in series with the loop. NaN on a worker
                 without the histogram

`--concurrency 1,4,8` runs each case again with N requests at once per round (`_group`): TPOT per
request at the client; the phases per output token over the window from every request's second
token to the last one's end; the step per token as a request's share of the batch's steps; the
join and `outside` columns need one request in flight (NaN).

The systems are named in `--system NAME=ADDRESS,METRICS_URL` (running systems: the metrics URL of the
decode worker is printed by `cedserve serve` at start-up), or started here by `--serve NAME[:KEY=VALUE,...]`
(`cedserve serve` on free ports; KEY is `section.field` of the serve config, e.g.
`--serve replay:decode.ship_state=false --serve shipped:decode.ship_state=true`). On CUDA the started
systems share the GPU: each worker gets `--gpu-share` of it.

`--dspark-pair ON,OFF` (two of the systems, one drafting and one not, e.g. `--serve on --serve
off:decode.dspark=false`) reports issue 28's DSpark figure per case: the TPOT speedup (OFF's p50 over
ON's) against its bound, the tokens ON's verifications emitted each (`cedserve_decode_tokens_per_verify`:
1 + the drafts accepted), and the fraction of the bound reached. Measure it on `--prompts heldout`
(windows of the demo corpus's held-out code): on random ids every draft is a guess, and the engine's
cost check rightly declines to draft.

`--serve-bin NAME=PATH` starts NAME's system with another `cedserve` executable (another tree's
virtual environment: the old code beside the new in one run).

    python benchmarks/tpot.py --serve replay:decode.ship_state=false --serve shipped:decode.ship_state=true \\
        --prompt-tokens 600 --max-tokens 12,64 --rounds 10 --out docs/benchmarks/tpot-cpu.json
    python benchmarks/tpot.py --serve old --serve new --serve-bin old=../base/.venv/bin/cedserve \\
        --max-tokens 64 --rounds 10 --out docs/benchmarks/decode-loop-phases-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from cedserve.client import AsyncClient, CedserveError, Piece
from cedserve.launcher import shipped_demo_checkpoint

STEP = "cedserve_decode_step_seconds"
TOKENS = "cedserve_decode_output_tokens_total"
PHASE = "cedserve_decode_loop_phase_seconds"
VERIFY = "cedserve_decode_tokens_per_verify"
STREAM_PHASES = ("handoff", "grpc_write")
PHASES = ("idle_wait", "commands", "poll", "report", "schedule", "join", "propose", "plan", "model", "accept",
          "persist", "observe", "account", "handoff", "grpc_write")
"""`decode_workers/metrics.py`'s LOOP_PHASES (a worker without the histogram reads as NaN)."""
EXTRA = ("loop", "rest", "loop_per_step", "model_per_step")


@dataclass(frozen=True)
class System:
    address: str
    metrics_url: str


@dataclass(frozen=True)
class Reading:
    """The decode worker's counters at one moment."""

    steps: int
    step_s: float
    tokens: int
    """Output tokens the worker emitted so far."""
    phase_s: dict[str, float]
    """Seconds so far by loop phase (NaN: the worker has no such histogram)."""
    verifies: int = 0
    """DSpark verification passes so far, counted per request (`cedserve_decode_tokens_per_verify`)."""
    verify_tokens: float = 0.0
    """Tokens those passes emitted (each: 1 + the drafts it accepted)."""


def _steps(metrics_url: str) -> Reading:
    """The decode worker's steps, step seconds and phase seconds so far."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    values = {}
    for name in (f"{STEP}_count", f"{STEP}_sum", TOKENS, f"{VERIFY}_count", f"{VERIFY}_sum"):
        m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
        values[name] = float(m.group(1)) if m else 0.0
    phases = {}
    for phase in PHASES:
        m = re.search(rf'^{PHASE}_sum{{phase="{phase}"}} ([0-9.e+-]+)$', text, re.M)
        phases[phase] = float(m.group(1)) if m else float("nan")
    return Reading(int(values[f"{STEP}_count"]), values[f"{STEP}_sum"], int(values[TOKENS]), phases,
                   int(values[f"{VERIFY}_count"]), values[f"{VERIFY}_sum"])


def _paths(metrics_url: str) -> dict[str, bool]:
    """The decode worker's `cedserve_decode_path_on` gauges (empty for a worker without them)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) > 0
            for m in re.finditer(r'^cedserve_decode_path_on\{path="([a-z_]+)"\} ([0-9.e+-]+)$', text, re.M)}


def _phase_rows(before: Reading, after: Reading, steady_span_s: float, tokens: int, steps: int) -> dict[str, float]:
    """Per token of the window between two readings: each phase's seconds, the loop's in-series
    overhead (`loop`: every tick phase but the model pass and the idle wait), and the span's rest
    (the span less the loop's busy time)."""
    out = {f"phase_{p}_s": (after.phase_s[p] - before.phase_s[p]) / tokens for p in PHASES}
    busy = [p for p in PHASES if p != "idle_wait" and p not in STREAM_PHASES]
    out["phase_loop_s"] = sum(out[f"phase_{p}_s"] for p in busy if p != "model")
    out["phase_rest_s"] = steady_span_s / tokens - sum(out[f"phase_{p}_s"] for p in busy)
    # per step too: with DSpark a step emits a varying number of tokens
    out["phase_loop_per_step_s"] = out["phase_loop_s"] * tokens / steps
    out["phase_model_per_step_s"] = out["phase_model_s"] * tokens / steps
    return out


async def _one(client: AsyncClient, system: System, prompt: list[int], max_tokens: int, salt: str) -> dict[str, float]:
    r0 = await asyncio.to_thread(_steps, system.metrics_url)
    start = time.perf_counter()
    arrivals: list[float] = []  # one per token, at its chunk's arrival
    at_second: list[asyncio.Future[Reading]] = []  # the counters when the second token arrived

    def on_piece(piece: Piece) -> None:
        arrivals.extend([time.perf_counter() - start] * len(piece.token_ids))
        if len(arrivals) >= 2 and not at_second:  # read off the event loop: later arrivals stay on time
            at_second.append(asyncio.ensure_future(asyncio.to_thread(_steps, system.metrics_url)))

    done = await client.generate(prompt, on_piece=on_piece, max_tokens=max_tokens, cache_salt=salt, effort="high")
    r1 = await asyncio.to_thread(_steps, system.metrics_url)
    mid = await at_second[0]
    steps0, step_s0, steps1, step_s1, steps_mid, step_s_mid = r0.steps, r0.step_s, r1.steps, r1.step_s, mid.steps, mid.step_s
    n, steps = len(arrivals), steps1 - steps0
    span, steady_span = arrivals[-1] - arrivals[0], arrivals[-1] - arrivals[1]
    # the join is the request's first step; the read at the second token counts it alone unless the
    # next step ended before the read (then the split is unknown: NaN)
    split = steps_mid - steps0 == 1 and steps1 > steps_mid
    join_s = step_s_mid - step_s0 if split else float("nan")
    steady_steps, steady_s = steps1 - steps_mid, step_s1 - step_s_mid
    return {"tokens": n, "draft_tokens": int(done.usage.get("draft_tokens", 0)),
            "accepted_drafts": int(done.usage.get("accepted_draft_tokens", 0)), "ttft_s": arrivals[0], "tpot_s": span / (n - 1), "first_gap_s": arrivals[1] - arrivals[0],
            "steady_itl_s": steady_span / (n - 2), "steps": steps,
            "outside_per_step_s": (steady_span - steady_s) / steady_steps if split else float("nan"),
            "join_step_s": join_s, "steady_step_s": steady_s / steady_steps if split else float("nan"),
            "steady_steps_per_token": steady_steps / (n - 2) if split else float("nan"),
            "steady_step_per_token_s": steady_s / (n - 2) if split else float("nan"),
            # TPOT (and the steady ITL) over the decode engine's step time per token after the join
            "tpot_over_step": span / (n - 1) / (steady_s / (n - 2)) if split else float("nan"),
            "itl_over_step": steady_span / steady_s if split else float("nan"),
            # the same over every step of the request, its join included: needs no read between two
            # steps (a GPU's few-ms steps often outrun the read at the second token, leaving no split)
            "step_per_token_all_s": (step_s1 - step_s0) / (n - 1),
            "tpot_over_step_all": span / (step_s1 - step_s0) if step_s1 > step_s0 else float("nan"),
            # DSpark: the request's verification passes and the tokens they emitted
            "verifications": r1.verifies - r0.verifies, "verify_tokens": r1.verify_tokens - r0.verify_tokens,
            **(_phase_rows(mid, r1, steady_span, n - 2, steady_steps) if split else
               {f"phase_{p}_s": float("nan") for p in (*PHASES, *EXTRA)})}


async def _group(client: AsyncClient, system: System, prompts: list[list[int]], max_tokens: int,
                 salt: str) -> list[dict[str, float]]:
    """`len(prompts)` requests at once (batch > 1), one row per request. The worker's counters are
    read once every request has its second token (all joined) and after the last ends; the phases
    per token are that window's, over the output tokens the worker emitted in it (all requests').
    `outside_per_step` and `join_step` need one request in flight: NaN here."""
    start = time.perf_counter()
    arrivals: list[list[float]] = [[] for _ in prompts]
    joined: list[asyncio.Future[Reading]] = []

    def on_piece(i: int) -> Any:
        def on(piece: Piece) -> None:
            arrivals[i].extend([time.perf_counter() - start] * len(piece.token_ids))
            if not joined and all(len(a) >= 2 for a in arrivals):
                joined.append(asyncio.ensure_future(asyncio.to_thread(_steps, system.metrics_url)))
        return on

    await asyncio.gather(*(client.generate(p, on_piece=on_piece(i), max_tokens=max_tokens, cache_salt=f"{salt}-{i}",
                                           effort="high") for i, p in enumerate(prompts)))
    r1 = await asyncio.to_thread(_steps, system.metrics_url)
    mid = await joined[0]
    steps, tokens, step_s = r1.steps - mid.steps, r1.tokens - mid.tokens, r1.step_s - mid.step_s
    ok = steps > 0 and tokens > 0
    step_per_token = step_s * len(prompts) / tokens if ok else float("nan")  # a request's share: 1 / len(prompts)
    phases = (_phase_rows(mid, r1, 0.0, tokens, steps) if ok else {f"phase_{p}_s": float("nan") for p in (*PHASES, *EXTRA)})
    phases["phase_rest_s"] = float("nan")  # the span is per request, the loop's time is the batch's
    rows = []
    for a in arrivals:
        n = len(a)
        tpot = (a[-1] - a[0]) / (n - 1)
        rows.append({"tokens": n, "draft_tokens": 0, "accepted_drafts": 0, "ttft_s": a[0], "tpot_s": tpot,
                     "first_gap_s": a[1] - a[0], "steady_itl_s": (a[-1] - a[1]) / (n - 2), "steps": steps,
                     "outside_per_step_s": float("nan"), "join_step_s": float("nan"),
                     "steady_step_s": step_s / steps if ok else float("nan"),
                     "steady_steps_per_token": steps * len(prompts) / tokens if ok else float("nan"),
                     "steady_step_per_token_s": step_per_token, "tpot_over_step": tpot / step_per_token,
                     "itl_over_step": (a[-1] - a[1]) / (n - 2) / step_per_token,
                     "step_per_token_all_s": step_per_token, "tpot_over_step_all": tpot / step_per_token,
                     # the batch's verifications in the window, a request's share (their ratio is the batch's)
                     "verifications": (r1.verifies - mid.verifies) / len(prompts),
                     "verify_tokens": (r1.verify_tokens - mid.verify_tokens) / len(prompts), **phases})
    return rows


def _summary(rows: list[dict[str, float]]) -> dict[str, float]:
    """Medians over the requests (ms for seconds)."""
    out: dict[str, float] = {"requests": len(rows), "tokens": statistics.median(r["tokens"] for r in rows)}
    for key in ("ttft_s", "tpot_s", "first_gap_s", "steady_itl_s", "outside_per_step_s", "join_step_s",
                "steady_step_s", "steady_steps_per_token", "steady_step_per_token_s", "tpot_over_step", "itl_over_step",
                "step_per_token_all_s", "tpot_over_step_all", *(f"phase_{p}_s" for p in (*PHASES, *EXTRA))):
        values = [r[key] for r in rows if r[key] == r[key]]
        scale = 1e3 if key.endswith("_s") else 1.0
        out[key[:-2] + "_ms" if key.endswith("_s") else key] = scale * statistics.median(values) if values else float("nan")
    out["draft_tokens"] = statistics.fmean(r["draft_tokens"] for r in rows)  # means: small counts
    out["accepted_drafts"] = statistics.fmean(r["accepted_drafts"] for r in rows)
    out["requests_split"] = sum(1 for r in rows if r["join_step_s"] == r["join_step_s"])
    verifications = sum(r["verifications"] for r in rows)
    # pooled over the requests: tokens a verification emitted, 1 + the drafts it accepted (DSpark's bound
    # on tokens per step; NaN without verifications)
    out["verifications"] = statistics.fmean(r["verifications"] for r in rows)
    out["tokens_per_verify"] = sum(r["verify_tokens"] for r in rows) / verifications if verifications else float("nan")
    return out


def dspark_pairs(results: dict[str, Any], pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Issue 28's DSpark figure per case and pair (ON drafting, OFF not): the speedup in TPOT (p50 of
    OFF over p50 of ON, requests alternated in one run) against its bound, the tokens ON's verifications
    emitted each (1 + mean accepted drafts); `fraction` = speedup / bound (the issue asks >= 0.9 at batch
    1, >= 0.8 at 32)."""
    rows = []
    for case, by_system in results.items():
        for on, off in pairs:
            if on not in by_system or off not in by_system:
                continue
            a, b = by_system[on]["median"], by_system[off]["median"]
            speedup = b["tpot_ms"] / a["tpot_ms"] if a["tpot_ms"] > 0 else float("nan")
            bound = a["tokens_per_verify"]
            rows.append({"case": case, "on": on, "off": off, "tpot_on_ms": a["tpot_ms"], "tpot_off_ms": b["tpot_ms"],
                         "speedup": speedup, "tokens_per_verify": bound, "verifications_per_request": a["verifications"],
                         "fraction_of_bound": speedup / bound if bound == bound and bound > 0 else float("nan")})
    return rows


PromptSource = Callable[[random.Random, int], list[int]]
"""A fresh prompt of the given length (random ids, or a window of held-out code)."""


def random_prompts(vocab: int) -> PromptSource:
    return lambda rng, n: [rng.randrange(3, vocab) for _ in range(n)]


def heldout_prompts(checkpoint: Path) -> PromptSource:
    """Windows of the demo corpus's held-out code (the standard library files `training/data.py`
    holds out), tokenized with the checkpoint's tokenizer, at random offsets: text the drafter can
    predict as well as it did in training, where random ids make every draft a guess."""
    from cedserve.model.tokenizer import TextCodec
    from cedserve.training.data import code_files, load_corpus, token_stream

    config = json.loads((checkpoint / "config.json").read_text())
    vocab = int(config.get("text_config", config)["vocab_size"])  # a composite checkpoint nests it
    codec = TextCodec.from_file(checkpoint, vocab)
    stream = token_stream(codec.tokenizer, code_files(load_corpus().heldout)).tolist()

    def take(rng: random.Random, n: int) -> list[int]:
        if len(stream) < n:
            raise ValueError(f"the held-out code has {len(stream)} tokens, fewer than a {n}-token prompt")
        start = rng.randrange(0, len(stream) - n + 1)
        return list(stream[start:start + n])
    return take


async def run(systems: dict[str, System], prompt_lens: list[int], max_tokens: list[int], rounds: int,
              prompt: PromptSource, warmup: int, seed: int, concurrency: list[int] | None = None) -> dict[str, Any]:
    clients = {name: AsyncClient(s.address, timeout_s=300) for name, s in systems.items()}
    rng = random.Random(seed)
    try:
        for i in range(warmup):
            for name, client in clients.items():
                await _one(client, systems[name], prompt(rng, prompt_lens[0]), 8,
                           f"warm-{name}-{i}-{seed}")
        out: dict[str, Any] = {}
        for c in concurrency or [1]:
            for n in prompt_lens:
                for m in max_tokens:
                    rows: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
                    failed: dict[str, int] = {}
                    for r in range(rounds):
                        prompts = [prompt(rng, n) for _ in range(c)]
                        order = list(systems) if r % 2 == 0 else list(reversed(systems))
                        for name in order:
                            salt = f"{name}-{c}-{n}-{m}-{r}-{seed}"
                            if c == 1:
                                rows[name].append(await _one(clients[name], systems[name], prompts[0], m, salt))
                            else:
                                try:
                                    rows[name].extend(await _group(clients[name], systems[name], prompts, m, salt))
                                except CedserveError as exc:  # kept out of the medians, counted in the JSON
                                    print(f"# {name}, round {r}: {exc}", file=sys.stderr)
                                    failed[name] = failed.get(name, 0) + 1
                    case = f"prompt {n}, {m} tokens" + (f", x{c}" if c > 1 else "")
                    out[case] = {name: {"median": _summary(rows[name]), "failed_rounds": failed.pop(name, 0),
                                        "requests": rows[name]} for name in systems}
        return out
    finally:
        for client in clients.values():
            await client.close()


def _phase_table(results: dict[str, Any]) -> str:
    """Per token after the join, ms: each phase with any time, then the remainder outside the worker."""
    keys = [*(p for p in PHASES if p != "idle_wait"), "loop", "rest", "loop_per_step"]
    names = {"grpc_write": "grpc", "loop_per_step": "loop/st", "schedule": "sched", "persist": "persst",
             "observe": "obsrv", "account": "acct", "commands": "cmds", "propose": "propse", "handoff": "hndoff"}
    head = f"{'case':<27} {'system':<9} " + " ".join(f"{names.get(k, k):>6}" for k in keys)
    lines = [head, "-" * len(head)]
    for case, by_system in results.items():
        for name, r in by_system.items():
            s = r["median"]
            cells = [s.get(f"phase_{k}_ms", float("nan")) for k in keys]
            lines.append(f"{case:<27} {name:<9} " + " ".join(f"{c:>6.2f}" for c in cells))
    lines.append("per output token after the join, medians over requests, ms; loop: the tick's phases but the model "
                 "pass (in series with it), loop/st: the same per step; hndoff, grpc: the stream's thread, beside the next "
                 "step; rest: the span less the loop's busy time; NaN: no phase histogram")
    return "\n".join(lines)


def _table(results: dict[str, Any]) -> str:
    head = (f"{'case':<27} {'system':<9} {'TTFT':>5} {'TPOT':>6} {'1st gap':>7} {'join':>6} {'ITL':>6} "
            f"{'step':>6} {'steps/tok':>9} {'outside/step':>12} {'TPOT/step':>9} {'ITL/step':>8} {'step/tok all':>12} "
            f"{'TPOT/all':>8}")
    lines = [head, "-" * len(head)]
    for case, by_system in results.items():
        for name, r in by_system.items():
            s = r["median"]
            lines.append(f"{case:<27} {name:<9} {s['ttft_ms']:>5.0f} {s['tpot_ms']:>6.1f} {s['first_gap_ms']:>7.1f} "
                         f"{s['join_step_ms']:>6.1f} {s['steady_itl_ms']:>6.1f} {s['steady_step_ms']:>6.1f} "
                         f"{s['steady_steps_per_token']:>9.2f} {s['outside_per_step_ms']:>12.2f} "
                         f"{s['tpot_over_step']:>9.2f} {s['itl_over_step']:>8.2f} "
                         f"{s['step_per_token_all_ms']:>12.2f} {s['tpot_over_step_all']:>8.2f}")
    lines.append("medians over requests, ms. 1st gap: first -> second token at the client; join: the decode "
                 "worker's first step of the request; ITL, step, steps/tok: after it; outside/step: client span "
                 "after the join minus its steps, per step; X/step: X over the step time per token after the join; "
                 "step/tok all, TPOT/all: every step of the request (its join too) per token after the first, "
                 "TPOT over it")
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _toml(settings: list[str], gpu_share: float | None) -> str:
    tables: dict[str, list[str]] = {}
    for item in settings:
        key, value = item.split("=", 1)
        section, field = key.split(".", 1)
        literal = value if re.fullmatch(r"true|false|-?[0-9.e+-]+", value) else json.dumps(value)
        tables.setdefault(section, []).append(f"{field} = {literal}")
    if gpu_share is not None:
        for role in ("prefill", "decode"):
            tables.setdefault(role, []).append(f"gpu_memory_fraction = {gpu_share}")
    return "".join(f"[{section}]\n" + "\n".join(lines) + "\n\n" for section, lines in tables.items())


@contextmanager
def _serve(specs: list[str], device: str, gpu_share: float, workdir: Path,
           binaries: dict[str, str]) -> Iterator[dict[str, System]]:
    """Start one `cedserve serve` per spec (in parallel) and yield their systems; drain them at exit."""
    procs: dict[str, subprocess.Popen[str]] = {}
    configs: dict[str, str] = {}
    try:
        for spec in specs:
            name, _, rest = spec.partition(":")
            config = workdir / f"{name}.toml"
            configs[name] = _toml([s for s in rest.split(",") if s], gpu_share if device == "cuda" else None)
            config.write_text(configs[name])
            port = _free_port()
            procs[name] = subprocess.Popen(
                [binaries.get(name, str(Path(sys.executable).parent / "cedserve")), "serve", "--device", device, "--port", str(port),
                 "--http-port", str(_free_port()), "--config", str(config), "--log-dir", str(workdir / f"logs-{name}")],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        systems = {name: _ready(name, proc) for name, proc in procs.items()}
        yield systems
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def _ready(name: str, proc: subprocess.Popen[str]) -> System:
    assert proc.stdout is not None
    metrics = ""
    for line in proc.stdout:
        if line.startswith("metrics of decode0:"):
            metrics = line.split(":", 1)[1].strip()
        if line.startswith("CEDSERVE_READY"):
            ready = json.loads(line.split(" ", 1)[1])
            if not metrics:
                raise RuntimeError(f"{name}: no decode metrics endpoint was printed")
            return System(ready["address"], metrics)
    raise RuntimeError(f"{name}: cedserve serve exited with {proc.wait()} before it was ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", action="append", default=[], help="NAME=ADDRESS,METRICS_URL (repeat; alternated)")
    ap.add_argument("--serve", action="append", default=[], help="NAME[:section.field=value,...] (repeat)")
    ap.add_argument("--serve-bin", action="append", default=[],
                    help="NAME=PATH: the `cedserve` executable that starts --serve NAME (another tree's)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="of the systems --serve starts")
    ap.add_argument("--gpu-share", type=float, default=0.2, help="with cuda: each started worker's GPU memory share")
    ap.add_argument("--prompt-tokens", default="600", help="the agentic sessions' prompts: ~580 tokens")
    ap.add_argument("--max-tokens", default="12,64", help="12: the agentic sessions' mean output on the H200 run")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--vocab", type=int, default=500, help="prompt ids drawn from [3, vocab)")
    ap.add_argument("--prompts", choices=("random", "heldout"), default="random",
                    help="random ids (default), or windows of the demo corpus's held-out code tokenized with "
                    "--checkpoint's tokenizer (what DSpark's acceptance is measured on)")
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="with --prompts heldout: the served checkpoint folder (default: the shipped demo)")
    ap.add_argument("--concurrency", default="1",
                    help="requests in flight at once, e.g. 1,4 (> 1: phases per token over the batch's window)")
    ap.add_argument("--dspark-pair", action="append", default=[], metavar="ON,OFF",
                    help="two system names, drafting and not: report TPOT speedup against DSpark's bound (repeat)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not args.system and not args.serve:
        ap.error("name at least one --system or --serve")
    given = {}
    for spec in args.system:
        name, rest = spec.split("=", 1)
        address, metrics = rest.split(",", 1)
        given[name] = System(address, metrics)
    prompt_lens = [int(x) for x in args.prompt_tokens.split(",")]
    max_tokens = [int(x) for x in args.max_tokens.split(",")]
    if min(max_tokens) < 3:
        ap.error("--max-tokens: at least 3 (a first gap and a steady token)")
    names = {*given, *(spec.partition(":")[0] for spec in args.serve)}
    pairs: list[tuple[str, str]] = []
    for spec in args.dspark_pair:
        on, _, off = spec.partition(",")
        if on not in names or off not in names or on == off:
            ap.error(f"--dspark-pair {spec!r}: give two different system names of {sorted(names)}, drafting first")
        pairs.append((on, off))
    binaries = dict(spec.split("=", 1) for spec in args.serve_bin)
    if args.prompts == "heldout":
        source = heldout_prompts(args.checkpoint or shipped_demo_checkpoint())
    else:
        source = random_prompts(args.vocab)
    with tempfile.TemporaryDirectory(prefix="tpot-") as tmp, _serve(args.serve, args.device, args.gpu_share,
                                                                       Path(tmp), binaries) as started:
        systems = {**given, **started}
        paths = {name: _paths(system.metrics_url) for name, system in systems.items()}
        for name, on in paths.items():
            print(f"# {name}: decode paths on: {', '.join(p for p, v in on.items() if v) or 'none (eager)'}")
        load_before = os.getloadavg()
        t0 = time.monotonic()
        results = asyncio.run(run(systems, prompt_lens, max_tokens, args.rounds, source, args.warmup, args.seed,
                                  [int(x) for x in args.concurrency.split(",")]))
        wall_s = time.monotonic() - t0
    print(_table(results))
    print()
    print(_phase_table(results))
    dspark = dspark_pairs(results, pairs)
    for d in dspark:
        print(f"{d['case']:<27} DSpark {d['on']} vs {d['off']}: TPOT {d['tpot_on_ms']:.2f} vs {d['tpot_off_ms']:.2f} ms, "
              f"speedup {d['speedup']:.2f}, bound {d['tokens_per_verify']:.2f} tokens a verification "
              f"({d['verifications_per_request']:.1f} a request), {d['fraction_of_bound']:.2f} of it")
    report = {"benchmark": "tpot", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", *sys.argv]),
              "machine": {"hostname": platform.node(), "cores": os.cpu_count(), "python": platform.python_version(),
                          "loadavg_before": [round(x, 2) for x in load_before],
                          "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
              "device": args.device, "note": args.note, "systems": args.system + args.serve,
              "binaries": binaries, "paths": paths, "rounds": args.rounds, "prompts": args.prompts,
              "wall_s": round(wall_s, 1), "results": results, "dspark": dspark}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"# wrote {args.out}")


if __name__ == "__main__":
    main()
