"""One decode step, three ways side by side: the model's `forward_batch` over per-sequence states (the
path the decode engine takes today, paged kernels on), the model runner's static slot step run
eagerly, and the same step replayed as a captured CUDA graph (`cedserve.model.runner`).

Per cell (preset, context, batch, path), on one device:

* `step_ms`: median wall time of `--steps` steps (host clock around a synchronised step; each
  step ends with the tokens on the host: `forward_batch`'s argmax `.tolist()`, the runner's one copy);
* `gpu_kernel_ms`, `kernels_per_step`: device kernel time and count per step (torch profiler over
  `--profile-steps` steps; graph replays show their kernels);
* `host_syncs_per_step`: device-to-host copies plus explicit synchronise calls per step (profiler);
  the runner's step makes three by design, all at its edges: the copy of its sampled tokens and the
  stream synchronise that waits for them, and, before it stages the next inputs, an event synchronise
  on the previous step's input copy (the pinned staging buffer is free again; it returns at once
  after a step whose tokens were read). A graph cell reads ~3.3: the profiler's own closing calls
  spread over the profiled steps;
* `memory_floor_ms`: bytes the step must read (every weight but the embedding tables, and per row
  each layer's window, its top-k main-KV records and its index scan) over the copy bandwidth
  measured in the same run.

`--paths graph-fused-overlap` adds, beside each `graph-fused` cell of one row per request, the same
graphs' plain steps launched back to back as `decode.overlap` runs them (`OverlappedSteps`; `step_ms`
there is a loop's wall time over its steps, synchronised only at the loop's ends).

`--dtypes float32 bfloat16` measures every cell once per weights dtype (`[model] dtype`: the model
built from the same seed, `checkpoint.cast_weights`), on the same synthetic states and tokens; a
cell's `dtype` names it, and a bfloat16 cell also carries `vs_float32_*`: its eager step's logits
against the float32 model's on the same state (random weights: flat logits, so the greedy agreement
is a sanity check, not a quality figure).

States are synthetic: records of random values at the cell's context (what a prefill would leave,
at the shapes that matter; the weights are random anyway), so a 64K x 32 cell costs no prefill.

    python benchmarks/step.py --contexts 4096 --batches 1 --steps 5      # any CUDA host
    python benchmarks/step.py --contexts 4096 --batches 1 32 --rows 1 6  # + DSpark verify steps (1 + 5 rows)
    python benchmarks/step.py --contexts 4096 65536 --batches 1 32 --released-attention both \\
        --out docs/benchmarks/decode-step-h200.json
    python benchmarks/step.py --released-attention yes --contexts 65536 --batches 32 \\
        --paths eager graph graph-fused --dtypes float32 bfloat16     # issue 28: bf16 beside float32
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from cedserve.kernels.grouped_linear import grouped_linear_reference
from cedserve.kernels.triton_support import PDL_ENV
from cedserve.model import fused, presets
from cedserve.model.checkpoint import cast_weights
from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model
from cedserve.model.config import AttentionMode
from cedserve.model.engram import engram_mix
from cedserve.model.kv_format import KVFormat, encode_index_key, encode_main, encode_window
from cedserve.model.network import BatchItem, CEDModel
from cedserve.model.runner import FED, ModelRunner, RunnerConfig
from cedserve.model.state import SequenceState
from cedserve.model.tokenizer import tiny_tokenizer_path
from cedserve.serving.worker_model import torch_dtype

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
TOKENIZER_VOCAB = 512


def build_model(preset_name: str, released: bool, max_context: int, device: str, seed: int = 0,
                dtype: str = "float32") -> CEDModel:
    config = fit_config_to_tokenizer(presets.preset(preset_name), tiny_tokenizer_path())
    vocab = min(config.vocab_size, TOKENIZER_VOCAB)
    config = config.replace(vocab_size=vocab, dspark_noise_token_id=min(config.dspark_noise_token_id, vocab - 1))
    if released:
        config = presets.released_attention(config)
    config = presets.stretch_context(config, max_context)
    model, _ = random_model(config, tiny_tokenizer_path(), seed)
    return cast_weights(model, torch_dtype(dtype)).to(device)


def synthetic_state(model: CEDModel, context: int, gen: torch.Generator) -> SequenceState:
    """A record state at position `context`: random window, global KV and pending values."""
    config, device = model.config, model.embed.weight.device
    state = model.new_state()
    state.position = context

    def rand(n: int, dim: int) -> torch.Tensor:
        return torch.randn(n, dim, generator=gen).to(device)

    keep = min(context, config.sliding_window - 1)
    for layer in state.swa:
        state.swa[layer] = encode_window(rand(keep, config.head_dim), KVFormat.RECORDS)
    for kv in state.global_kv.values():
        entries = context // kv.ratio
        kv.set_records(encode_main(rand(entries, config.head_dim), KVFormat.RECORDS),
                       encode_index_key(rand(entries, config.index_head_dim), KVFormat.RECORDS))
        rest = context - entries * kv.ratio
        kv.pending = type(kv.pending)(rand(rest, config.head_dim), rand(rest, config.head_dim))
    if model.hasher is not None:
        tokens = torch.randint(3, config.vocab_size, (config.engram_max_ngram_size - 1,), generator=gen).to(device)
        state.engram_tail = model.hasher.compress(tokens)
    return state


def floor_bytes(model: CEDModel, context: int, batch: int) -> int:
    """Bytes one step must read: weights (no embedding tables) + each row's attention reads."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                  if not name.endswith("embed.weight") and ".embed." not in name)
    per_row = 0
    for spec in config.layer_plan:
        per_row += config.sliding_window * (config.head_dim + config.head_dim // 32)
        if spec.compress_ratio:
            per_row += config.index_topk * (config.head_dim // 2 + config.head_dim // 16)
        if spec.mode in (AttentionMode.FULL, AttentionMode.REINDEX):
            scanned = context // spec.compress_ratio
            if spec.mode is AttentionMode.REINDEX and config.has_candidate_pool:
                scanned = min(scanned, config.candidate_topk_blocks * config.candidate_block_size)
            per_row += scanned * (config.index_head_dim // 2 + config.index_head_dim // 32)
    return weights + batch * per_row


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a 1 GiB device copy (64 MiB on a CPU), read + write."""
    src = torch.randn((256 if device == "cuda" else 16) * 1024 * 1024, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(times)


def profile(run: Callable[[], None], steps: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    sync()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        sync()
    kernels = kernel_us = d2h = syncs = 0.0
    by_name: dict[str, list[float]] = {}
    for event in prof.events():
        name = event.name
        if event.device_type == torch.autograd.DeviceType.CUDA:
            if name.startswith("Memcpy"):
                d2h += "DtoH" in name
            elif not name.startswith("Memset"):
                kernels += 1
                kernel_us += event.time_range.elapsed_us()
                entry = by_name.setdefault(name[:80], [0.0, 0.0])
                entry[0] += 1 / steps
                entry[1] += event.time_range.elapsed_us() / 1000 / steps
        elif name in SYNC_CALLS:
            syncs += 1
    # the profiler's own closing synchronise is not a step's
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]
    return {"gpu_kernel_ms": kernel_us / 1000 / steps, "kernels_per_step": kernels / steps,
            "host_syncs_per_step": (d2h + max(0, syncs - 1)) / steps,
            "top_kernels": [{"name": n, "per_step": round(c, 1), "ms": round(ms, 3)} for n, (c, ms) in top],
            # every kernel, most launched first: where a bucket's launches go (which chains to fuse next)
            "all_kernels": [{"name": n, "per_step": round(c, 2), "ms": round(ms, 4)}
                            for n, (c, ms) in sorted(by_name.items(), key=lambda kv: (-kv[1][0], kv[0]))]}


def part_profile(runner: ModelRunner, run: Callable[[], None]) -> list[dict[str, Any]]:
    """Kernels launched and device ms per part of a layer (`SlotStep.annotate`'s ranges, summed over the
    layers) in one eager step of `runner` (its graphs set aside): which chains a fusion would pay for,
    and which kernels a part's time goes to (`attribute_kernels`)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    runner.slot_step.annotate = True
    try:
        with runner.uncaptured():
            run()
            sync()
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run()
                sync()
    finally:
        runner.slot_step.annotate = False
    events = prof.events()
    parts = [(e.time_range.start, e.time_range.end, e.name[5:]) for e in events if e.name.startswith("slot:")]
    return attribute_kernels(parts, kernel_launches(events))


def kernel_launches(events: Any) -> list[tuple[float | None, str, float]]:
    """Every kernel of a profile's `events` as `(its launch's host time, name, us)` for
    `attribute_kernels` (None: its launch was not found). A kernel's id is its launch's CUDA
    correlation id (`cudaLaunchKernel`, or `cudaGraphLaunch` for a replay's kernels); its linked id,
    the op or range it ran under."""
    cpu = torch.autograd.DeviceType.CPU
    launched = {e.id: e.time_range.start for e in events if e.device_type == cpu and "Launch" in e.name}
    ops = {e.id: e.time_range.start for e in events if e.device_type == cpu and "Launch" not in e.name}
    return [(launched.get(e.id, ops.get(getattr(e, "linked_correlation_id", 0))), e.name, e.time_range.elapsed_us())
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]


def attribute_kernels(parts: list[tuple[float, float, str]], kernels: list[tuple[float | None, str, float]],
                      top: int = 4) -> list[dict[str, Any]]:
    """Each kernel `(launch time, name, us)` to the part whose range `(start, end, name)` holds its
    launch ("(outside)" when none does, "(unlinked)" when its launch was not found): per part the
    kernels, their ms and the `top` kernels by ms, most kernels first. (Nested ranges: the
    innermost, the latest-starting one that holds the launch.)"""
    import bisect

    ordered = sorted(parts)
    starts = [p[0] for p in ordered]
    table: dict[str, dict[str, list[float]]] = {}
    for at, name, us in kernels:
        part = "(unlinked)"
        if at is not None:
            part = "(outside)"
            k = bisect.bisect_right(starts, at) - 1
            while k >= 0:
                if at <= ordered[k][1]:
                    part = ordered[k][2]
                    break
                k -= 1
        entry = table.setdefault(part, {}).setdefault(name[:80], [0.0, 0.0])
        entry[0] += 1
        entry[1] += us / 1000
    rows = []
    for part, by_name in table.items():
        count = sum(c for c, _ in by_name.values())
        ms = sum(t for _, t in by_name.values())
        heavy = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
        rows.append({"part": part, "kernels": int(count), "ms": round(ms, 3),
                     "top": [{"name": n, "kernels": int(c), "ms": round(t, 3)} for n, (c, t) in heavy]})
    return sorted(rows, key=lambda r: (-r["kernels"], r["part"]))


def sync_sites(run: Callable[[], None]) -> list[str]:
    """Where `run` makes the host wait for the device: the project's frame under each synchronising
    call that torch's sync debug mode reports (one eager step)."""
    import traceback
    import warnings

    sites: list[str] = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            original = warnings.showwarning

            def record(*args: Any, **kwargs: Any) -> None:
                frames = [f for f in traceback.extract_stack() if "cedserve" in f.filename or "benchmarks" in f.filename]
                sites.append(" < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-4:][::-1]))

            warnings.showwarning = record
            run()
            sync()
            warnings.showwarning = original
        for w in caught:
            if "synchroniz" in str(w.message):
                sites.append(f"{Path(w.filename).name}:{w.lineno}")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sorted(set(sites))


def timed(run: Callable[[], None], steps: int) -> float:
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def run_cells(args: argparse.Namespace, released: bool, dtype: str, bandwidth: float, log: Callable[[str], None],
              cells: list[dict[str, Any]]) -> None:
    """Append the variant's cells to `cells` as each is measured (`log` writes the JSON after each).
    Every dtype's variant draws the same states and tokens (the generator restarts per variant)."""
    max_context = max(args.contexts) + args.warmup + args.steps + args.profile_steps + 64
    backend = "kernels" if args.device == "cuda" else "reference"
    model = build_model(args.preset, released, max_context, args.device, dtype=dtype)
    model.use_paged_attention(backend)
    reference = None
    if dtype != "float32":  # the float32 model of the same seed, for `vs_float32_*`
        reference = build_model(args.preset, released, max_context, args.device)
        reference.use_paged_attention(backend)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    name = args.preset + (" released-attention" if released else "") + ("" if dtype == "float32" else f" {dtype}")
    for context in args.contexts:
        base = synthetic_state(model, context, gen)
        cases = [(batch, rows) for batch in args.batches for rows in args.rows]
        config = RunnerConfig(max_slots=max(args.batches), max_context=max_context, max_rows_per_slot=max(args.rows),
                              buckets=tuple(sorted({b * r for b, r in cases})))
        runner = ModelRunner(model, config)
        graph_runners = {"graph": runner}
        for path in ("graph-fused", "graph-fused-tf32", "graph-fused-grouped", "graph-fused-before"):
            if path in args.paths and args.device == "cuda":
                graph_runners[path] = ModelRunner(model, RunnerConfig(**{
                    **config.__dict__, "compile_fused": True, "grouped_attention": path.endswith("-grouped")}))
                if path.endswith("-before"):  # the Engram mix eager, as before it was a fused op
                    graph_runners[path].slot_step.ops.engram = engram_mix
        for batch, rows in cases:
            floor_ms = 1000 * floor_bytes(model, context, batch) / bandwidth
            states = [copy.deepcopy(base) for _ in range(batch)]
            feed = [int(t) for t in torch.randint(3, vocab, (batch * rows,), generator=gen)]
            versus = dtype_agreement(model, reference, base, feed, rows) if reference is not None else {}
            if versus:
                log(f"{name} {context}x{batch}x{rows} eager vs float32: max |dlogit| "
                    f"{versus['vs_float32_max_abs_logit_diff']:.3f}, relative {versus['vs_float32_rel_logit_err']:.4f}, "
                    f"greedy agreement {versus['vs_float32_greedy_agreement']:.3f}")

            def eager(feed: list[int] = feed, states: list[SequenceState] = states, rows: int = rows) -> None:
                # rows > 1: a verify chunk (anchor + drafts), every draft rejected: the state goes back
                items = [BatchItem(feed[i * rows:(i + 1) * rows], s, snapshot=rows > 1) for i, s in enumerate(states)]
                outs = model.forward_batch(items)
                torch.cat([out.logits for out in outs]).argmax(-1).tolist()
                for state, out in zip(states, outs):
                    if out.snapshot is not None:
                        state.restore(out.snapshot)

            slot_rows = [slot for slot in range(batch) for _ in range(rows)]

            def slot_step(feed: list[int] = feed, slot_rows: list[int] = slot_rows, rows: int = rows,
                          runner: ModelRunner = runner) -> None:
                start = {slot: runner.position(slot) for slot in set(slot_rows)}
                runner.step(slot_rows, feed)
                if rows > 1:
                    for slot, position in start.items():
                        runner.rewind(slot, position)

            for slot in range(batch):
                runner.load(slot, base)
            paths: list[tuple[str, Callable[[], None]]] = [("eager", eager), ("runner-eager", slot_step)]
            for path, run in paths:
                if path not in args.paths:
                    continue
                for _ in range(args.warmup):
                    run()
                cells.append(cell(name, context, batch, rows, path, timed(run, args.steps),
                                  profile(run, args.profile_steps), floor_ms, dtype))
                cells[-1].update(versus)
                log(row(cells[-1]))
            for path, graph_runner in graph_runners.items():
                if path in args.paths and args.device == "cuda":
                    with tf32(path.endswith("-tf32")), library_ops(path.endswith("-before")):
                        run_graph(path, graph_runner, base, batch, slot_step, name, context, rows, floor_ms, args,
                                  log, cells, dtype)
                    cells[-1].update(versus)
            if "graph-fused-overlap" in args.paths and args.device == "cuda" and rows == 1 and "graph-fused" in graph_runners:
                run_overlap(graph_runners["graph-fused"], base, batch, name, context, floor_ms, args, log, cells, dtype)
            del states
            gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()


@contextlib.contextmanager
def tf32(on: bool) -> Iterator[None]:
    """float32 matmuls on TF32 tensor cores while `on` (the runner's graphs keep the kernels captured
    under it: capture and replay both run inside)."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@contextlib.contextmanager
def library_ops(on: bool) -> Iterator[None]:
    """While `on`, the fused step runs two chains as it did before session 28/29's changes, for a
    side-by-side cell: `wo_a` by cuBLAS's `bmm` (not the `grouped_linear` kernel) and the MoE's
    top-k by `topk` (not `fused.pick_topk`'s fused rounds of argmax: `ARGMAX_TOPK = 0`; Dynamo
    guards that global, so the compiled routing recompiles). Graphs keep what was captured under
    it, so capture and the uncaptured comparisons both run inside."""
    if not on:
        yield
        return
    before, argmax_topk = fused.grouped_linear, fused.ARGMAX_TOPK
    fused.grouped_linear = lambda x, weight, impl="torch": grouped_linear_reference(x, weight)
    fused.ARGMAX_TOPK = 0
    try:
        yield
    finally:
        fused.grouped_linear, fused.ARGMAX_TOPK = before, argmax_topk


def run_graph(path: str, runner: ModelRunner, base: SequenceState, batch: int,
              slot_step: Callable[..., None], name: str, context: int, rows: int, floor_ms: float,
              args: argparse.Namespace, log: Callable[[str], None], cells: list[dict[str, Any]],
              dtype: str = "float32") -> None:
    """Time `slot_step` on `runner` replaying its CUDA graphs (captured at its first cell)."""
    for slot in range(batch):
        runner.load(slot, base)
    parts = part_profile(runner, lambda: slot_step(runner=runner))
    log(f"{path} {context}x{batch}x{rows}: kernels per part (eager step, all layers): " + "; ".join(
        f"{p['part']} {p['kernels']} ({p['ms']:.2f} ms)" for p in parts))
    heavy = sorted(((k["ms"], p["part"], k["name"], k["kernels"]) for p in parts for k in p["top"]), reverse=True)[:6]
    log("  heaviest: " + "; ".join(f"{part}: {kname[:48]} x{count} {ms:.2f} ms" for ms, part, kname, count in heavy))
    PARTS[f"{name} {context}x{batch}x{rows} {path}"] = parts
    if not runner.graphs_captured:
        sites = sync_sites(lambda: slot_step(runner=runner))
        log(f"{path}: runner eager step: {len(sites)} synchronising sites: {sites[:20]}")
        capture_start = time.perf_counter()
        report = runner.capture()
        log(f"{path}: captured buckets {report.buckets} in {time.perf_counter() - capture_start:.1f} s "
            f"(Inductor compiles included), {torch.cuda.memory_reserved() / 1e9:.1f} GB reserved")
    for slot in range(batch):
        runner.load(slot, base)
    agreement = graph_vs_eager(runner, base, batch, rows)
    for slot in range(batch):
        runner.load(slot, base)

    def step() -> None:
        slot_step(runner=runner)

    for _ in range(args.warmup):
        step()
    cells.append(cell(name, context, batch, rows, path, timed(step, args.steps), profile(step, args.profile_steps),
                      floor_ms, dtype))
    cells[-1].update(agreement)
    log(row(cells[-1]))
    log(f"  vs the same step uncaptured: max |dlogit| {agreement['max_abs_logit_diff_vs_uncaptured']:.2e}, greedy "
        f"agreement {agreement['greedy_agreement_vs_uncaptured']:.3f}; vs forward_batch: max |dlogit| "
        f"{agreement['max_abs_logit_diff_vs_eager']:.2e} (logit scale {agreement['logit_scale']:.2f}), greedy "
        f"agreement {agreement['greedy_agreement_vs_eager']:.3f}, rows tied at the k-th index pick "
        f"{agreement['index_top_ties']}")
    log("  top kernels: " + "; ".join(f"{k['name'][:40]} x{k['per_step']:.0f} {k['ms']:.2f} ms"
                                     for k in cells[-1]["top_kernels"][:8]))


class OverlappedSteps:
    """Plain steps of `batch` slots launched back to back as the decode engine's overlapped steps run
    them (`decode.overlap`: `SlotBook.launch` / `collect`): each step's rows are `FED` the picks the
    step before left on the device (`ModelRunner.remember`), its picks are copied behind it into one
    of two pinned buffers, and the host waits for the step before's copy only after launching this
    one. `picks` collects every step's tokens as the host reads them."""

    def __init__(self, runner: ModelRunner, batch: int, first: list[int]) -> None:
        self.runner, self.slots, self.first = runner, list(range(batch)), first
        cuda = runner.device.type == "cuda"
        self.buffers = [torch.zeros(batch, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self.pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self.launched = 0
        self.picks: list[list[int]] = []

    def __call__(self) -> None:
        tokens = self.first if self.launched == 0 else [FED] * len(self.slots)
        logits, _ = self.runner.step_outputs(self.slots, tokens)
        picks = logits.argmax(dim=-1)
        self.runner.remember(len(self.slots), picks)
        host = self.buffers[self.launched % 2]
        host.copy_(picks, non_blocking=True)
        done = None
        if picks.is_cuda:
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
        self.launched += 1
        self.collect()
        self.pending = (host, done)

    def collect(self) -> None:
        if self.pending is not None:
            host, done = self.pending
            if done is not None:
                done.synchronize()
            self.picks.append(host.tolist())
            self.pending = None


def run_overlap(runner: ModelRunner, base: SequenceState, batch: int, name: str, context: int, floor_ms: float,
                args: argparse.Namespace, log: Callable[[str], None], cells: list[dict[str, Any]],
                dtype: str = "float32") -> None:
    """The `graph-fused` runner's plain step overlapped (`OverlappedSteps`), path `graph-fused-overlap`:
    `step_ms` is the wall time of `--steps` steps back to back, synchronised only at the loop's ends,
    over the steps (a step's own wait is for the step before it). First the tokens: 6 overlapped steps
    against 6 in series from the same states and the same first tokens (`overlap_tokens_equal`)."""
    gen = torch.Generator().manual_seed(11)
    first = [int(t) for t in torch.randint(3, runner.model.config.vocab_size, (batch,), generator=gen)]

    def fresh() -> None:
        for slot in range(batch):
            runner.load(slot, base)

    fresh()
    series, tokens = [], first
    for _ in range(6):
        tokens = runner.step_logits(list(range(batch)), tokens).argmax(-1).tolist()
        series.append(tokens)
    fresh()
    check = OverlappedSteps(runner, batch, first)
    for _ in range(6):
        check()
    check.collect()
    fresh()
    steps = OverlappedSteps(runner, batch, first)
    for _ in range(args.warmup):
        steps()

    def loop() -> float:
        sync()
        start = time.perf_counter()
        for _ in range(args.steps):
            steps()
        steps.collect()
        sync()
        return 1000 * (time.perf_counter() - start) / args.steps

    step_ms = statistics.median(loop() for _ in range(3))
    cells.append(cell(name, context, batch, 1, "graph-fused-overlap", step_ms, profile(steps, args.profile_steps),
                      floor_ms, dtype))
    cells[-1]["overlap_tokens_equal"] = check.picks == series
    log(row(cells[-1]))
    log(f"  overlapped steps' tokens {'equal' if check.picks == series else 'DIFFER FROM'} the steps in series")


def graph_vs_eager(runner: ModelRunner, base: SequenceState, batch: int, rows: int) -> dict[str, Any]:
    """One step of the runner's graphs against the same step uncaptured (`runner.uncaptured()`) and
    against `CEDModel.forward_batch`, from the same state and tokens: the largest logit difference,
    the logits' scale and how often the greedy tokens agree. The uncaptured step is the check of the
    replay (the same kernels in the same order). `forward_batch` is another top-k implementation, so
    where a layer's index scores tie at its k-th pick the two may pick different entries, both
    correct: random weights make such ties common (a token whose index head weights are all negative
    scores every entry its ReLU zeroes at 0, the top score), and then those figures differ a lot
    without anything being wrong; `index_top_ties` counts the rows whose k-th and (k+1)-th dense
    index scores are equal, summed over the full-scan index layers."""
    model = runner.model
    gen = torch.Generator().manual_seed(7)
    feed = [int(t) for t in torch.randint(3, model.config.vocab_size, (batch * rows,), generator=gen)]
    slot_rows = [slot for slot in range(batch) for _ in range(rows)]

    def fresh() -> None:
        for slot in range(batch):
            runner.load(slot, base)

    with torch.no_grad():
        fresh()
        graph = runner.step_logits(slot_rows, feed).float()
        fresh()
        with runner.uncaptured():
            uncaptured = runner.step_logits(slot_rows, feed).float()
        items = [BatchItem(feed[i * rows:(i + 1) * rows], copy.deepcopy(base)) for i in range(batch)]
        eager = torch.cat([out.logits for out in model.forward_batch(items)]).float()
    return {"max_abs_logit_diff_vs_uncaptured": float((graph - uncaptured).abs().max()),
            "greedy_agreement_vs_uncaptured": float((graph.argmax(-1) == uncaptured.argmax(-1)).float().mean()),
            "max_abs_logit_diff_vs_eager": float((graph - eager).abs().max()),
            "logit_scale": float(eager.abs().max()),
            "greedy_agreement_vs_eager": float((graph.argmax(-1) == eager.argmax(-1)).float().mean()),
            "index_top_ties": index_top_ties(model, base, feed, rows)}


def index_top_ties(model: CEDModel, base: SequenceState, feed: list[int], rows: int) -> int:
    """Rows whose index scores tie at the k-th pick, summed over the full-scan index layers of a
    `forward_batch` pass from `base`: where two top-k implementations may rightly pick different
    entries."""
    from cedserve.kernels import indexer
    from cedserve.model import paged_attention

    ties = [0]
    original = paged_attention.layer_topk

    def spy(config: Any, layer_id: int, q: torch.Tensor, weights: torch.Tensor, keys: Any, width: int,
            pool: Any, impl: Any) -> Any:
        if config.layer_plan[layer_id].mode is AttentionMode.FULL:
            dense = indexer.range_scores_reference(q.to(torch.bfloat16), weights, keys, width)
            k = config.index_topk
            if dense.shape[1] > k:
                top = dense.topk(k + 1, dim=1).values
                ties[0] += int(((top[:, k - 1] == top[:, k]) & torch.isfinite(top[:, k])).sum())
        return original(config, layer_id, q, weights, keys, width, pool, impl)

    paged_attention.layer_topk = spy
    try:
        with torch.no_grad():
            items = [BatchItem(feed[i * rows:(i + 1) * rows], copy.deepcopy(base)) for i in range(len(feed) // rows)]
            model.forward_batch(items)
    finally:
        paged_attention.layer_topk = original
    return ties[0]


def dtype_agreement(model: CEDModel, reference: CEDModel, base: SequenceState, feed: list[int],
                    rows: int) -> dict[str, Any]:
    """One eager step (`forward_batch`) of `model` against the float32 `reference` from the same state
    and tokens: the largest logit difference, the relative error and how often the greedy tokens agree."""
    batch = len(feed) // rows
    logits = []
    for m in (model, reference):
        items = [BatchItem(feed[i * rows:(i + 1) * rows], copy.deepcopy(base)) for i in range(batch)]
        with torch.no_grad():
            logits.append(torch.cat([out.logits for out in m.forward_batch(items)]).float())
    got, want = logits
    return {"vs_float32_max_abs_logit_diff": float((got - want).abs().max()),
            "vs_float32_rel_logit_err": float((got - want).norm() / want.norm()),
            "vs_float32_greedy_agreement": float((got.argmax(-1) == want.argmax(-1)).float().mean())}


PARTS: dict[str, list[dict[str, Any]]] = {}
"""`part_profile` per runner (its first cell), written beside the cells."""


def cell(preset: str, context: int, batch: int, rows: int, path: str, step_ms: float, prof: dict[str, Any],
         floor_ms: float, dtype: str = "float32") -> dict[str, Any]:
    return {"preset": preset, "context": context, "batch": batch, "rows": rows, "path": path, "dtype": dtype,
            "step_ms": round(step_ms, 3), "gpu_kernel_ms": round(prof["gpu_kernel_ms"], 3),
            "gpu_busy": round(prof["gpu_kernel_ms"] / step_ms, 3) if step_ms else 0.0,
            "kernels_per_step": prof["kernels_per_step"], "host_syncs_per_step": prof["host_syncs_per_step"],
            "memory_floor_ms": round(floor_ms, 4), "top_kernels": prof["top_kernels"], "all_kernels": prof["all_kernels"]}


def row(c: dict[str, Any]) -> str:
    return (f"{c['preset']:<37} {c['context']:>7} {c['batch']:>5} {c['rows']:>4} {c['path']:<13} {c['step_ms']:>9.2f} "
            f"{c['gpu_kernel_ms']:>8.2f} {c['gpu_busy']:>5.0%} {c['kernels_per_step']:>8.0f} "
            f"{c['host_syncs_per_step']:>6.0f} {c['memory_floor_ms']:>8.3f}")


def pdl_settings() -> dict[str, bool | None]:
    """Which kernels this process launches with programmatic dependent launch: the project's Triton
    kernels (`CEDSERVE_PDL=1`, `kernels.triton_support.pdl_launch`) and Inductor's
    (`TORCHINDUCTOR_ENABLE_PDL=1`; None where this torch has no such setting). Both are set per
    process, so a side-by-side comparison is one process per setting on the same machine."""
    import torch._inductor.config as inductor_config

    return {"triton": os.environ.get(PDL_ENV, "0") == "1",
            "inductor": getattr(inductor_config.triton, "enable_pdl", None)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="mini-40")
    parser.add_argument("--released-attention", choices=("no", "yes", "both"), default="no")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--rows", type=int, nargs="+", default=[1],
                        help="rows per request: 1 (decode) or 1 + drafts (a DSpark verify, every draft rejected)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--paths", nargs="+", default=["eager", "runner-eager", "graph", "graph-fused"],
                        help="eager (forward_batch), runner-eager (the slot step uncaptured), graph (its CUDA "
                        "graphs), graph-fused (the same with compile_fused), graph-fused-tf32 (the same with "
                        "float32 matmuls on TF32 tensor cores), graph-fused-grouped (graph-fused with a request's rows attended "
                        "together: RunnerConfig.grouped_attention), graph-fused-before (graph-fused with "
                        "wo_a on cuBLAS's bmm, the MoE's top-k by topk and the Engram mix eager: the path before "
                        "the grouped_linear kernel, the fused argmax routing and the compiled Engram mix), "
                        "graph-fused-overlap (graph-fused's plain steps launched back to back, each fed the "
                        "step before's picks on the device, as decode.overlap runs them; needs graph-fused)")
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32"],
                        help="weights dtypes to measure, each on the same states and tokens ([model] dtype; "
                        "a bfloat16 cell also reports its logits against float32's, vs_float32_*)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke run of the same code (no graphs; times mean nothing)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/step.py times CUDA steps: no CUDA device here (--device cpu for a smoke run)",
              file=sys.stderr)
        return 2
    bandwidth = copy_bandwidth(args.device)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    header = (f"{'preset':<37} {'context':>7} {'batch':>5} {'rows':>4} {'path':<13} {'step ms':>9} {'gpu ms':>8} "
              f"{'busy':>5} {'kernels':>8} {'syncs':>6} {'floor ms':>8}")
    print(header, flush=True)
    cells: list[dict[str, Any]] = []
    variants = {"no": [False], "yes": [True], "both": [False, True]}[args.released_attention]
    def write() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")

    def log(line: str) -> None:
        print(line, flush=True)
        write()  # after every cell: a run cut short keeps what it measured

    result: dict[str, Any] = {}
    result.update({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.node()} " + (torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"), "torch": torch.__version__,
              "command": "python benchmarks/step.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "copy_bandwidth_tb_s": round(bandwidth / 1e12, 3), "pdl": pdl_settings(), "cells": cells, "parts": PARTS})
    for released in variants:
        for dtype in args.dtypes:
            run_cells(args, released, dtype, bandwidth, log, cells)
    write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
