"""Where a DSpark decode cycle's time goes, phase by phase, beside the plain decode step, in one process.

`benchmarks/tpot.py` measures issue 28's DSpark bound through `cedserve serve` and reads the decode
loop's phase histograms, which give host seconds per phase but not what the GPU did in them. This
runs the decode engine itself (the same `DecodeEngine`, model runner and slot drafter a decode worker
builds from the default `[decode]` table) on the shipped demo checkpoint, one request at a time on
held-out code (so the drafter's guesses are accepted as in serving), and profiles a stretch of steps
with the torch profiler. Each engine phase (`schedule`, `join`, `propose`, `plan`, `model`, `accept`,
`persist`, `observe`, `account`: the phases of `cedserve_decode_loop_phase_seconds`) is marked in the
trace, and per phase and step it reports:

* `host_ms`: wall time on the host (what the loop waits for, kernels included when it synchronises);
* `kernels`, `gpu_ms`: kernels launched in the phase (by launch time, graph replays' kernels included)
  and their device time;
* `syncs`: calls that make the host wait for the device (`cudaStreamSynchronize`, device-to-host
  copies, ...).

Per system (`on`: DSpark with the engine's adaptive verification, as served; `off`: no drafting):
median step ms, tokens per step, tokens/s; and for the pair the DSpark bound of issue 28:
tokens/s on / ((tokens per verification) x tokens/s off). On a CPU the same runs (no kernels are
counted; useful to test the script and to count host work).

    python benchmarks/dspark_cycle.py --device cuda --prompt-tokens 600 --steps 40 --profile-steps 12 \\
        --out docs/benchmarks/dspark-cycle-h100.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import itertools
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step import attribute_kernels, kernel_launches  # benchmarks/step.py
from tpot import heldout_prompts  # benchmarks/tpot.py

from cedserve.decode_workers.config import DecodeConfig
from cedserve.decode_workers.drafting import DSparkProposer
from cedserve.decode_workers.engine import DecodeEngine
from cedserve.decode_workers.messages import AttachCommand, CancelCommand, Sampling, Tokens
from cedserve.decode_workers.metrics import DECODE_PATHS
from cedserve.kernels import grouped_linear as grouped_linear_module
from cedserve.launcher import shipped_demo_checkpoint
from cedserve.model.cache.config import KVCacheConfig
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.cache.manager import KVCacheManager
from cedserve.model.checkpoint import cast_weights, load_model
from cedserve.model.checkpoint_writer import load_drafter
from cedserve.model.dspark import Drafter
from cedserve.model.network import CEDModel
from cedserve.serving.worker_model import torch_dtype

BLOCK = 64
PHASES = ("schedule", "join", "propose", "plan", "model", "accept", "persist", "observe", "account")
HOST_TOP = 6
"""Outermost host calls listed per phase (`phase_table`'s `host_top`)."""
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""Runtime calls that block the host until the device catches up (`cudaMemcpy`: the synchronous
copy, `.item()` / `.tolist()` of a device tensor; `cudaMemcpyAsync` does not count)."""


class MarkedPhases:
    """The engine's phase timer, marking each phase's end in the profiler's trace as well."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def lap(self, phase: str, since: float) -> float:
        with torch.profiler.record_function(f"lap:{phase}"):
            pass
        return float(self.inner.lap(phase, since))

    def add(self, phase: str, seconds: float) -> None:
        self.inner.add(phase, seconds)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def prefill(model: CEDModel, tokens: list[int], chunk: int = 2048) -> tuple[Any, int]:
    state = model.new_state()
    logits = None
    for at in range(0, len(tokens), chunk):
        logits = model.prefill(tokens[at:at + chunk], state)
    assert logits is not None
    return state, int(logits[-1].argmax())


def build_engine(model: CEDModel, drafter: Drafter | None, args: argparse.Namespace,
                 dspark: bool) -> tuple[DecodeEngine, KVCacheManager]:
    """An engine as a decode worker builds it from the default `[decode]` table (one request at a time)."""
    blocks = (args.prompt_tokens + args.steps * 8 + 4 * BLOCK) // BLOCK + 8
    layout = BlockLayout.from_config(model.config, BLOCK)
    cache = KVCacheManager(layout, KVCacheConfig(block_size=BLOCK, num_blocks=blocks), "bench", args.device)
    config = DecodeConfig(max_running_requests=args.max_running, dspark=dspark, device=args.device,
                          compile_fused=args.compile_fused, kernel_warmup=False,  # the untimed first steps compile instead
                          runner=args.runner, runner_drafter=args.runner_drafter, matmul_tf32=args.matmul_tf32)
    probe_every = 1 if args.cost_check == "off" else 8  # 1: the proposer drafts at every anchor
    proposer = (DSparkProposer(drafter, model, config.draft_tokens, probe_every=probe_every)
                if dspark and drafter is not None else None)
    return DecodeEngine(config, model, cache, proposer=proposer), cache


def phase_table(prof: Any, steps: int) -> dict[str, dict[str, float]]:
    """Per phase: host ms, kernels, kernel ms and syncs per step, from the `lap:` marks (module docstring)."""
    events = prof.events()
    cpu = torch.autograd.DeviceType.CPU
    marks = sorted((e.time_range.start, e.time_range.end, e.name[4:]) for e in events if e.name.startswith("lap:"))
    parts = [(prev[1], cur[0], cur[2]) for prev, cur in itertools.pairwise(marks) if cur[2] != "start"]
    by_part = {r["part"]: r for r in attribute_kernels(parts, kernel_launches(events))}
    syncs = [e.time_range.start for e in events if e.device_type == cpu and e.name.startswith(SYNC_CALLS)
             and not e.name.startswith("cudaMemcpyAsync")]
    # the host's own calls: ops and runtime calls that no other op holds (what the phase's Python made)
    outer = [(e.time_range.start, e.time_range.elapsed_us(), e.name) for e in events
             if e.device_type == cpu and getattr(e, "cpu_parent", None) is None and not e.name.startswith("lap:")]
    table: dict[str, dict[str, Any]] = {}
    for phase in PHASES:
        spans = [(a, b) for a, b, name in parts if name == phase]
        row = by_part.get(phase, {"kernels": 0, "ms": 0.0, "top": []})
        calls: dict[str, list[float]] = {}
        for at, us, name in outer:
            if any(a <= at <= b for a, b in spans):
                entry = calls.setdefault(name[:60], [0.0, 0.0])
                entry[0] += 1
                entry[1] += us
        host_ms = sum(b - a for a, b in spans) / 1000 / steps
        in_calls = sum(us for _, us in calls.values()) / 1000 / steps
        table[phase] = {
            "host_ms": host_ms,
            "kernels": row["kernels"] / steps,
            "gpu_ms": row["ms"] / steps,
            "syncs": sum(any(a <= t <= b for a, b in spans) for t in syncs) / steps,
            "top": row["top"],
            "host_calls_ms": in_calls,  # in outermost ops and runtime calls; the rest is Python between them
            "host_top": [{"name": name, "calls": n / steps, "ms": us / 1000 / steps}
                         for name, (n, us) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:HOST_TOP]],
        }
    return table


@contextlib.contextmanager
def uncompiled_drafter() -> Iterator[None]:
    """Engines built inside take the drafter's pass uncompiled whatever `decode.compile_fused` says."""
    from cedserve.decode_workers import engine as engine_module

    original = engine_module.DraftRunnerConfig
    engine_module.DraftRunnerConfig = functools.partial(original, compile_fused=False)  # type: ignore[misc]
    try:
        yield
    finally:
        engine_module.DraftRunnerConfig = original  # type: ignore[misc]


def run_system(model: CEDModel, drafter: Drafter | None, args: argparse.Namespace, dspark: bool,
               prompts: list[list[int]], log: Callable[[str], None], name: str = "") -> dict[str, Any]:
    """One engine for the system; each prompt in turn decoded for `--steps` steps (its first
    `--warmup-steps` untimed), then cancelled; the profiled stretch is the last prompt's last
    `--profile-steps` steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    gc.collect()
    engine, cache = build_engine(model, drafter, args, dspark)
    engine.metrics.phases = MarkedPhases(engine.metrics.phases)  # type: ignore[assignment]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    times: list[float] = []
    tokens = verify_tokens = 0
    verify_steps: list[float] = []  # the timed steps that verified drafts
    table: dict[str, dict[str, float]] = {}
    emitted_ids: list[list[int]] = []  # each prompt's greedy continuation (the systems must agree)
    for i, prompt in enumerate(prompts):
        state, first = prefill(model, prompt)
        rid = f"r{i}"
        cmd = AttachCommand(0, rid, f"l{i}", tuple(prompt), first, 100, Sampling(max_tokens=100_000, ignore_eos=True))
        engine.attach_state(rid, prompt, copy.deepcopy(state), first, cmd)
        ids: list[int] = []
        emitted_ids.append(ids)
        for step in range(args.steps):
            profiled = i == len(prompts) - 1 and step == args.steps - args.profile_steps
            if profiled:
                sync(args.device)
                prof = torch_profile(activities=activities)
                prof.__enter__()
            sync(args.device)
            verifies = engine.verify_passes
            start = time.perf_counter()
            with torch.profiler.record_function("lap:start"):
                pass
            outputs = engine.step()
            sync(args.device)
            elapsed = time.perf_counter() - start
            chunk = [t for o in outputs if isinstance(o, Tokens) for t in o.token_ids]
            ids.extend(chunk)
            if step >= args.warmup_steps:
                times.append(elapsed)
                emitted = len(chunk)
                tokens += emitted
                if engine.verify_passes > verifies:  # this step verified drafts
                    verify_steps.append(elapsed)
                    verify_tokens += emitted
        if i == len(prompts) - 1:
            prof.__exit__(None, None, None)
            if args.trace:  # the host's timeline too: which calls of a phase its host time goes to
                args.trace.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(args.trace / f"{name or ('on' if dspark else 'off')}.json"))
            table = phase_table(prof, args.profile_steps)
        engine.cancel(CancelCommand(0, rid))  # its blocks and slots back before the next request
    steps = len(times)
    step_ms = 1000 * statistics.median(times)
    per_step = tokens / steps
    result = {"dspark": dspark, "steps": steps, "step_ms": step_ms, "mean_step_ms": 1000 * sum(times) / steps,
              "tokens_per_step": per_step, "tokens_per_s": tokens / sum(times),
              "drafted": int(engine.drafted_tokens), "accepted": int(engine.accepted_drafts),
              "verify_steps": len(verify_steps),
              "tokens_per_verify_step": verify_tokens / len(verify_steps) if verify_steps else None,
              "verify_step_ms": 1000 * statistics.median(verify_steps) if verify_steps else None,
              "declined_steps": int(getattr(engine.proposer, "declined_steps", 0)),
              "plain_probes": int(getattr(engine.proposer, "plain_probes", 0)),
              "proposer": type(engine.proposer).__name__,
              "paths": {p: bool(engine.metrics.registry.get_sample_value("cedserve_decode_path_on", {"path": p}))
                        for p in DECODE_PATHS},
              "phases": table, "token_ids": emitted_ids}
    log(f"{name or ('on' if dspark else 'off'):>4} step {step_ms:7.2f} ms  tokens/step {per_step:5.2f}  "
        f"tokens/s {result['tokens_per_s']:8.1f}  (proposer {result['proposer']}; paths on: "
        f"{', '.join(p for p, v in result['paths'].items() if v) or 'none'})")
    if dspark:
        each = (f" ({result['verify_step_ms']:.2f} ms, {result['tokens_per_verify_step']:.2f} tokens each)"
                if verify_steps else "")
        log(f"     {len(verify_steps)} of {steps} steps verified drafts{each}; the cost check declined "
            f"{result['declined_steps']} steps and made {result['plain_probes']} plain probes")
    log(f"     {'phase':<9} {'host ms':>8} {'kernels':>8} {'gpu ms':>7} {'syncs':>6}")
    for phase, row in table.items():
        if row["host_ms"] >= 0.005 or row["kernels"]:
            log(f"     {phase:<9} {row['host_ms']:8.3f} {row['kernels']:8.1f} {row['gpu_ms']:7.3f} {row['syncs']:6.1f}")
    for phase, row in table.items():  # where each costly phase's host time goes
        if row["host_ms"] >= 0.1:
            calls = ", ".join(f"{c['name']} x{c['calls']:.1f} {c['ms']:.3f}" for c in row["host_top"])
            log(f"     {phase}: {row['host_calls_ms']:.3f} of {row['host_ms']:.3f} ms in calls ({calls})")
    cache.close()
    return result


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--checkpoint", type=Path, default=None, help="default: the shipped demo checkpoint")
    p.add_argument("--prompt-tokens", type=int, default=600)
    p.add_argument("--prompts", type=int, default=2, help="requests per system, one after the other")
    p.add_argument("--steps", type=int, default=40, help="engine steps per request")
    p.add_argument("--warmup-steps", type=int, default=4, help="untimed first steps of each request")
    p.add_argument("--profile-steps", type=int, default=12, help="the last request's last N steps, profiled")
    p.add_argument("--max-running", type=int, default=4, help="decode.max_running_requests (the graphs' buckets)")
    p.add_argument("--runner", default="auto", choices=("auto", "on", "off"), help="decode.runner")
    p.add_argument("--runner-drafter", default="auto", choices=("auto", "on", "off"), help="decode.runner_drafter")
    p.add_argument("--compile-fused", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--systems", default="off,on",
                   help="off (no drafting), on (DSpark as configured), on-drafter-uncompiled (DSpark, the "
                        "drafter's pass uncompiled: the `on` of before its compiled sampling loop)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the weights' dtype (`[model] dtype`; the reference's float32 parameters stay float32)")
    p.add_argument("--matmul-tf32", action=argparse.BooleanOptionalAction, default=False,
                   help="decode.matmul_tf32: float32 products on TF32 tensor cores")
    p.add_argument("--f32-rows-kernel", default="on", choices=("on", "off"),
                   help="off: float32 projections of 2-32 rows on cuBLAS, as before `kernels.grouped_linear.linear`")
    p.add_argument("--cost-check", default="on", choices=("on", "off"),
                   help="off: DSpark drafts at every anchor (the phases of drafting steps alone)")
    p.add_argument("--trace", type=Path, help="a folder: each system's profiled steps as a Chrome trace (<system>.json)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not 0 < args.profile_steps <= args.steps - args.warmup_steps:
        p.error("--profile-steps must be in 1 .. steps - warmup-steps")
    if args.f32_rows_kernel == "off":
        grouped_linear_module.ROW_LINEAR_MAX_ROWS = 0  # before any step is compiled
    checkpoint = args.checkpoint or shipped_demo_checkpoint()
    dtype = torch_dtype(args.dtype)
    model = load_model(checkpoint, dtype=dtype, device=args.device)
    drafter = cast_weights(load_drafter(checkpoint, model.config), dtype).to(args.device)
    source = heldout_prompts(checkpoint)
    rng = random.Random(args.seed)
    prompts = [source(rng, args.prompt_tokens) for _ in range(args.prompts)]
    lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    started = time.perf_counter()
    systems = {}
    for name in args.systems.split(","):
        if name == "on-drafter-uncompiled":  # the drafter's pass as before its compiled sampling loop
            with uncompiled_drafter():
                systems[name] = run_system(model, drafter, args, True, prompts, log, name)
        else:
            systems[name] = run_system(model, drafter, args, name == "on", prompts, log, name)
    summary = {}
    off = systems.get("off")
    for name, on in systems.items():
        if name == "off" or off is None:
            continue
        # tokens per verification: over the steps that verified (the check may decline some steps)
        per_verify = on.get("tokens_per_verify_step") or on["tokens_per_step"]
        bound = per_verify * off["tokens_per_s"]
        summary[name] = {"speedup": on["tokens_per_s"] / off["tokens_per_s"], "tokens_per_verify": per_verify,
                         "fraction_of_bound": on["tokens_per_s"] / bound,
                         "cycle_over_plain_step": on["step_ms"] / off["step_ms"]}
        agree = [_common_prefix(a, b) for a, b in zip(off["token_ids"], on["token_ids"])]
        shorter = [min(len(a), len(b)) for a, b in zip(off["token_ids"], on["token_ids"])]
        summary[name]["greedy_agreement"] = {"agreeing_prefix": agree, "compared": shorter}
        log(f"greedy tokens: {name} agrees with off over {agree} of the first {shorter} (each prompt)")
        log(f"DSpark {name} vs off: speedup {summary[name]['speedup']:.2f}, {per_verify:.2f} tokens a step, "
            f"{summary[name]['fraction_of_bound']:.2f} of the bound; a drafting step costs "
            f"{summary[name]['cycle_over_plain_step']:.2f}x a plain one")
    if args.out:
        machine = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__}
        if args.device.startswith("cuda"):
            machine["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine,
            "command": " ".join(sys.argv), "seconds": round(time.perf_counter() - started, 1),
            "checkpoint": str(checkpoint), "systems": systems, "summary": summary, "log": lines}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
