"""Effort as the queue class: the decode and prefill engines' queues in arrival order against
earliest-due order (`effort_queue_slack_s`), on the same arrivals, side by side.

Both arms run the real engines (scheduler, cache, model) on the same random weights and the same
seeded arrival schedules (Poisson at `--load` x the engine's capacity; efforts drawn from
`--effort-mix`, default low 30 % / high 50 % / max 20 %):

* `decode`: `DecodeEngine` with `--batch` running slots; each request arrives with a shipped state
  (`attach_state`, a copy of one prefilled prompt) and decodes its effort's token budget
  (`max_output_tokens x effort / 100`, EOS ignored), so its cost grows with its effort as in
  serving. Reported per request: arrival to its first output token and to its last. Earliest due
  first is shortest expected job first here, so the mean should fall;
* `prefill`: `PrefillEngine` with `--prefill-running` slots and prefill-only requests whose lengths
  (uniform in `--prefill-lengths`) do not depend on effort: reordering alone, so the low class gains
  what the max class pays. Reported: arrival to first token.

Time. Queueing delays near saturation magnify every fluctuation of the service rate, and a shared
2-core machine's load swings by tens of percent, so wall-clock waits of two arms are not comparable
(a first version measured the same arm 0.98 s and 4.17 s apart on two schedules). The engines
therefore run on a virtual clock (`clock=`, which both take for arrivals, due times and latencies)
that each step advances by a cost measured on this machine before the arms: the median step time
with n requests running for decode, and a least-squares line (fixed + per token + per prompt
ended) for prefill (both in the JSON). Every scheduling decision is the engines' own; only the
passage of time is modelled, identically for both arms.

    python benchmarks/effort_queue.py --out docs/benchmarks/effort-queue-cpu.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cedserve.bench.serve.agentic import parse_effort_mix
from cedserve.bench.serve.metrics import percentile
from cedserve.decode_workers.config import DecodeConfig
from cedserve.decode_workers.engine import DecodeEngine
from cedserve.decode_workers.messages import AttachCommand, Finished, Sampling, Tokens
from cedserve.model.cache.config import KVCacheConfig
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.cache.manager import KVCacheManager
from cedserve.model.effort import effort_class
from cedserve.model.network import CEDModel
from cedserve.model.sampling import SamplingParams
from cedserve.prefill_workers.config import PrefillWorkerConfig
from cedserve.prefill_workers.engine import PrefillEngine
from cedserve.prefill_workers.validation import PrefillSpec
from cedserve.serving.worker_model import load_worker_model

BLOCK = 64
PREFILL_CHUNK = 128
CLASSES = ("low", "high", "max")


@dataclass(frozen=True)
class Arrival:
    at_s: float
    effort: int
    prompt_len: int


def arrivals(n: int, rate: float, mix: Sequence[tuple[int, float]], lengths: tuple[int, int],
             seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    levels, weights = [e for e, _ in mix], [w for _, w in mix]
    out, at = [], 0.0
    for _ in range(n):
        at += rng.expovariate(rate)
        out.append(Arrival(at, rng.choices(levels, weights)[0], rng.randint(*lengths)))
    return out


class VirtualClock:
    """The engines' clock in these runs: it advances by each step's modelled cost (below), so arms see
    the same time whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------------------------- decode

def output_tokens(effort: int, max_output: int) -> int:
    """The workload's output length at an effort level: `max_output` at 100, in proportion below (the
    arms differ in their queue order only, so any length that grows with effort serves)."""
    return max(1, max_output * effort // 100)


def decode_engine(model: CEDModel, batch: int, slack_s: float, max_output: int, num_blocks: int,
                  clock: VirtualClock | None = None) -> DecodeEngine:
    layout = BlockLayout.from_config(model.config, BLOCK)
    cache = KVCacheManager(layout, KVCacheConfig(block_size=BLOCK, num_blocks=num_blocks), "bench")
    config = DecodeConfig(max_running_requests=batch, dspark=False,
                          max_output_tokens=max_output, effort_queue_slack_s=slack_s, kernel_warmup=False)
    return DecodeEngine(config, model, cache, clock=clock or time.monotonic)


def decode_step_costs(model: CEDModel, prompt: list[int], state: Any, first: int, batch: int,
                      max_output: int, steps: int = 5) -> list[float]:
    """Measured seconds of a decode step with n = 1..batch requests running (median of `steps`)."""
    costs = [0.0]
    for n in range(1, batch + 1):
        engine = decode_engine(model, n, 0.0, max_output, n * 4 + 8)
        for i in range(n):
            cmd = AttachCommand(0, f"c{i}", f"lc{i}", tuple(prompt), first, 100,
                                Sampling(max_tokens=max_output, ignore_eos=True))
            engine.attach_state(f"c{i}", prompt, copy.deepcopy(state), first, cmd)
        engine.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        engine.cache.close()
        costs.append(statistics.median(times))
    return costs


def run_decode(model: CEDModel, prompt: list[int], state: Any, first: int, schedule: list[Arrival],
               batch: int, slack_s: float, max_output: int, costs: list[float]) -> list[dict[str, Any]]:
    """The real engine on the virtual clock: each step advances it by the measured cost of a step with
    as many requests as emitted in it."""
    num_blocks = len(schedule) * (-(-(len(prompt) + max_output + 8) // BLOCK)) + 8
    clock = VirtualClock()
    engine = decode_engine(model, batch, slack_s, max_output, num_blocks, clock)
    pending = list(enumerate(schedule))
    first_out: dict[str, float] = {}
    done: dict[str, float] = {}
    while len(done) < len(schedule):
        if not engine.has_work() and pending:
            clock.now = max(clock.now, pending[0][1].at_s)
        now = clock.now
        while pending and pending[0][1].at_s <= now:
            i, a = pending.pop(0)
            cmd = AttachCommand(0, f"r{i}", f"l{i}", tuple(prompt), first, a.effort,
                                Sampling(max_tokens=output_tokens(a.effort, max_output), ignore_eos=True))
            clock.now = a.at_s  # its due time counts from its own arrival
            engine.attach_state(f"r{i}", prompt, copy.deepcopy(state), first, cmd)
        clock.now = now
        outputs = engine.step()
        emitted = {o.request_id for o in outputs if isinstance(o, Tokens)}
        clock.now += costs[min(len(emitted), batch)]
        for o in outputs:
            if isinstance(o, Tokens):
                first_out.setdefault(o.request_id, clock.now)
            elif isinstance(o, Finished):
                done[o.request_id] = clock.now
    engine.cache.close()
    return [{"effort": a.effort, "class": effort_class(a.effort), "queue_s": first_out[f"r{i}"] - a.at_s,
             "e2e_s": done[f"r{i}"] - a.at_s} for i, a in enumerate(schedule)]


# ---------------------------------------------------------------------------------------------- prefill

def prefill_engine(model: CEDModel, running: int, longest: int, slack_s: float,
                   clock: VirtualClock | None = None) -> PrefillEngine:
    layout = BlockLayout.from_config(model.config, BLOCK)
    num_blocks = running * (-(-longest // BLOCK)) + 8
    cache = KVCacheManager(layout, KVCacheConfig(block_size=BLOCK, num_blocks=num_blocks), "bench-p")
    config = PrefillWorkerConfig(worker_id="bench-p", chunk_tokens=PREFILL_CHUNK, step_token_budget=2 * PREFILL_CHUNK,
                                 max_running_requests=running, effort_queue_slack_s=slack_s, kernel_warmup=False)
    return PrefillEngine(model, cache, None, config, clock=clock or time.monotonic)


def prefill_spec(model: CEDModel, rid: str, length: int, effort: int, gen: torch.Generator, salt: str) -> PrefillSpec:
    tokens = torch.randint(3, min(model.config.vocab_size, 512), (length,), generator=gen)
    return PrefillSpec(rid, tokens.numpy().astype(np.int64), effort, salt, None, None,
                       PrefillWorkerConfig().replay_span, SamplingParams())


def prefill_step_cost(model: CEDModel, lengths: tuple[int, int], seed: int) -> tuple[float, float, float]:
    """Seconds of a prefill step as `fixed + per_token x tokens + per_end x prompts ended` (a prompt's
    last step also runs the decoder replay and samples): least squares over the measured steps of
    prompts across the length range, one at a time."""
    engine = prefill_engine(model, 1, lengths[1], 0.0)
    gen = torch.Generator().manual_seed(seed)
    rows, ys = [], []
    for i, length in enumerate(np.linspace(lengths[0], lengths[1], 6).astype(int)):
        job = engine.submit(prefill_spec(model, f"cal{i}", int(length), 75, gen, f"cal-{seed}"))
        while job.phase.value != "ended":
            start = time.perf_counter()
            tokens = engine.step()
            ys.append(time.perf_counter() - start)
            rows.append([1.0, tokens, float(job.phase.value == "ended")])
    engine.cache.close()
    (fixed, per_token, per_end), *_ = np.linalg.lstsq(np.asarray(rows), np.asarray(ys), rcond=None)
    return float(fixed), float(per_token), float(per_end)


def run_prefill(model: CEDModel, schedule: list[Arrival], running: int, slack_s: float, seed: int,
                cost: tuple[float, float, float]) -> list[dict[str, Any]]:
    """The real engine on the virtual clock: each step advances it by its modelled cost
    (`prefill_step_cost`)."""
    clock = VirtualClock()
    engine = prefill_engine(model, running, max(a.prompt_len for a in schedule), slack_s, clock)
    gen = torch.Generator().manual_seed(seed)
    pending, jobs = list(enumerate(schedule)), {}
    firsts: dict[int, float] = {}
    while len(firsts) < len(schedule):
        if len(jobs) == len(firsts) and pending:  # idle: on to the next arrival
            clock.now = max(clock.now, pending[0][1].at_s)
        now = clock.now
        while pending and pending[0][1].at_s <= now:
            i, a = pending.pop(0)
            clock.now = a.at_s
            jobs[i] = engine.submit(prefill_spec(model, f"p{i}", a.prompt_len, a.effort, gen, f"salt-{seed}"))
        clock.now = now
        tokens = engine.step()
        ended = [i for i, job in jobs.items() if i not in firsts and job.first_token is not None]
        clock.now += cost[0] + cost[1] * tokens + cost[2] * len(ended)
        for i in ended:
            firsts[i] = clock.now
    engine.cache.close()
    return [{"effort": a.effort, "class": effort_class(a.effort), "ttft_s": firsts[i] - a.at_s}
            for i, a in enumerate(schedule)]


# ---------------------------------------------------------------------------------------------- report

def summarize(rows: list[dict[str, Any]], key: str) -> dict[str, dict[str, float]]:
    out = {}
    for klass in ("all", *CLASSES):
        vals = [r[key] for r in rows if klass in ("all", r["class"])]
        if vals:
            out[klass] = {"n": len(vals), "mean": statistics.fmean(vals), "p90": percentile(vals, 90)}
    return out


def table(title: str, arms: dict[str, dict[str, dict[str, float]]]) -> None:
    fifo, due = arms["arrival order"], arms["earliest due"]
    print(f"\n{title}")
    print(f"{'class':>6} {'n':>4} | {'FIFO mean':>9} {'p90':>7} | {'due mean':>9} {'p90':>7} | {'mean ratio':>10}")
    for klass in ("all", *CLASSES):
        if klass not in fifo:
            continue
        a, b = fifo[klass], due[klass]
        print(f"{klass:>6} {a['n']:>4} | {a['mean']:9.2f} {a['p90']:7.2f} | {b['mean']:9.2f} {b['p90']:7.2f} | "
              f"{b['mean'] / a['mean']:10.2f}")


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "load_average_1m_at_start": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--requests", type=int, default=60, help="per repeat and arm")
    ap.add_argument("--load", type=float, default=0.9, help="offered load over each engine's capacity")
    ap.add_argument("--effort-mix", default="low:0.3,high:0.5,max:0.2")
    ap.add_argument("--batch", type=int, default=4, help="decode engine's running slots")
    ap.add_argument("--max-output-tokens", type=int, default=48, help="token budget at effort 100")
    ap.add_argument("--slack-s", type=float, default=DecodeConfig().effort_queue_slack_s)
    ap.add_argument("--prompt-tokens", type=int, default=64, help="the decode requests' prompt")
    ap.add_argument("--prefill-lengths", default="64,1024", help="MIN,MAX prompt tokens of the prefill requests")
    ap.add_argument("--prefill-running", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="arrival schedules (seeds)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    mix = parse_effort_mix(args.effort_mix)
    model = load_worker_model(None, args.preset, seed=args.seed).model
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(3, min(model.config.vocab_size, 512), (args.prompt_tokens,), generator=gen).tolist()
    state = model.new_state()
    first = int(model.prefill(prompt, state)[-1].argmax())

    costs = decode_step_costs(model, prompt, state, first, args.batch, args.max_output_tokens)
    mean_tokens = sum(w * output_tokens(e, args.max_output_tokens) for e, w in mix) / sum(w for _, w in mix)
    decode_rate = args.load * args.batch / (costs[args.batch] * mean_tokens)
    print(f"decode step {', '.join(f'{1000 * c:.1f}' for c in costs[1:])} ms at 1..{args.batch} running; "
          f"{mean_tokens:.1f} tokens a request; offered {decode_rate:.2f} requests/s", flush=True)
    lo, hi = (int(x) for x in args.prefill_lengths.split(","))
    prefill_cost, prefill_rate = (0.0, 0.0, 0.0), 0.0
    if not args.skip_prefill:
        prefill_cost = prefill_step_cost(model, (lo, hi), args.seed)
        service = statistics.fmean(-(-n // PREFILL_CHUNK) * prefill_cost[0] + n * prefill_cost[1] + prefill_cost[2]
                                   for n in range(lo, hi + 1))
        prefill_rate = args.load * args.prefill_running / service
        print(f"prefill step {1000 * prefill_cost[0]:.1f} ms + {1e6 * prefill_cost[1]:.1f} us a token + "
              f"{1000 * prefill_cost[2]:.1f} ms a prompt's end; offered {prefill_rate:.2f} requests/s", flush=True)

    arms = {"arrival order": 0.0, "earliest due": args.slack_s}
    decode_rows: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    prefill_rows: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for rep in range(args.repeats):
        schedule = arrivals(args.requests, decode_rate, mix, (args.prompt_tokens, args.prompt_tokens),
                            args.seed + rep)
        pschedule = arrivals(args.requests, prefill_rate or 1.0, mix, (lo, hi), args.seed + 100 + rep)
        for name, slack in arms.items():
            start = time.perf_counter()
            decode_rows[name] += run_decode(model, prompt, state, first, schedule, args.batch, slack,
                                            args.max_output_tokens, costs)
            print(f"  schedule {rep} decode {name}: {time.perf_counter() - start:.1f} s", flush=True)
            if not args.skip_prefill:
                start = time.perf_counter()
                prefill_rows[name] += run_prefill(model, pschedule, args.prefill_running, slack, args.seed + rep,
                                                  prefill_cost)
                print(f"  schedule {rep} prefill {name}: {time.perf_counter() - start:.1f} s", flush=True)
    results: dict[str, Any] = {
        "decode_e2e_s": {n: summarize(r, "e2e_s") for n, r in decode_rows.items()},
        "decode_queue_s": {n: summarize(r, "queue_s") for n, r in decode_rows.items()},
    }
    table("decode: arrival to last token (virtual s)", results["decode_e2e_s"])
    table("decode: arrival to first token (virtual s)", results["decode_queue_s"])
    if not args.skip_prefill:
        results["prefill_ttft_s"] = {n: summarize(r, "ttft_s") for n, r in prefill_rows.items()}
        table("prefill: arrival to first token (virtual s)", results["prefill_ttft_s"])
    if args.out:
        report = {"benchmark": "effort_queue", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                  "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
                  "machine": machine(), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  "decode_step_s_by_running": costs[1:], "decode_rate": decode_rate,
                  "prefill_step_s": dict(zip(("fixed", "per_token", "per_end"), prefill_cost)),
                  "prefill_rate": prefill_rate, "results": results,
                  "requests": {"decode": decode_rows, "prefill": prefill_rows}}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
