"""Decode throughput: tokens/s and time per output token by batch size and context length, with and
without DSpark, through the real decode engine (continuous batching, one target pass per step), on one
device or expert-parallel over several (`--ep 2`: one process per GPU, NCCL; gloo on CPU).

One random prompt of the longest context is prefilled once, in chunks of `--prefill-chunk` tokens
(all layers, as a decode worker's local prefill would), and the state is copied at every context
length on the way. Each cell hands a copy of that state to the engine per request (a shipped state:
no transfer, no replay), lets the engine take a warm-up step or two (the drafter's memory fills from
the first pass's taps), then times `--steps` steps. Reported per cell:

* `tokens_per_s`: output tokens of the whole batch (all ranks) per second (median step time);
* `tpot_ms`: time per output token of one request (median step time / tokens per request per step);
* `tokens_per_step`: tokens each request emits per step (1 without DSpark; 1 + accepted drafts with);
* DSpark: drafts proposed/accepted and the measured speedup over the same cell without it;
* `peak_memory_gb` on CUDA (this rank's device);
* `loop_step_ms`, `loop_tokens_per_s`, `loop_gpu_busy`: the same number of steps again back to back,
  synchronised only at the loop's ends (`_unsynced_loop`: what overlapped steps, `-overlap`, change).

The preset's drafter has random weights, so its drafts are almost never accepted and the measured
DSpark speedup is below 1: it shows what drafting and verifying K positions cost. `projected_speedup`
applies the measured step times to the acceptance rates reported for the trained drafter (mean
accepted length 2.82 on GSM8K, 3.51 "golden"): speedup = tokens per step x plain step / DSpark step.
DSpark cells verify every draft (no adaptive shortening) so their step time is the full-length cost.

Expert parallelism (`--ep R`): R processes, rank r on `cuda:r` (or the CPU with gloo); each holds
every layer's attention and 1/R of the routed experts (`shard_experts`) and decodes `batch / R` of
the cell's requests (attention is data parallel); tokens travel to their experts' ranks and back at
every MoE layer (`TorchDistributedEP`). A cell's `batch` is the group's total; rank 0 reports, with
each step's time the slowest rank's.

Contexts beyond the preset's positions stretch it (`presets.stretch_context`). Memory at 128K on
mini-40: 117 MB of global KV per request (as state and as blocks), and the prefill's attention
temporaries (`[heads, chunk, context / m]` float32). `--time-budget-s` starts no new cell after that
many seconds (the rest are recorded as skipped), so a run's length is bounded.

Decode attention (`--attention`, `DecodeConfig.paged_attention`): `off` is the dense path (every
layer dequantizes each sequence's window and whole global KV into a padded batch), `kernels` the
compact-cache kernels over a paged copy of the records (`model/paged_attention.py`; `auto` takes them
on CUDA), `reference` the same path on the kernels' torch references (`auto` on a CPU). Several values time each cell once per path, in order, and a path after `off` reports
`speedup_over_dense`. `--warmup-steps` untimed steps come first (a kernel variant compiles on its
first launch; their times are `warmup_ms_each`); `--released-attention` puts the released attention
geometry (64 heads x 512, 32 index heads, top-512 in 2,048 blocks) on the preset.

    python benchmarks/decode.py --preset mini-40 --contexts 64 256 --batches 1 4 \\
        --out docs/benchmarks/decode-cpu.json
    python benchmarks/decode.py --contexts 64 --batches 2 --steps 2 --ep 2      # two CPU ranks, gloo
    python benchmarks/decode.py --device cuda --contexts 4096 16384 --batches 1 8 32 --time-budget-s 200 \\
        --out docs/benchmarks/decode-cuda.json
    python benchmarks/decode.py --device cuda --contexts 65536 --batches 8 32 --warmup-steps 4 \\
        --attention off kernels --out docs/benchmarks/decode-paged-h200-mini40.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import queue
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cedserve.decode_workers.config import DecodeConfig
from cedserve.decode_workers.drafting import DSparkProposer
from cedserve.decode_workers.engine import DecodeEngine
from cedserve.decode_workers.expert_parallel import ExpertParallel, TorchDistributedEP, shard_experts
from cedserve.decode_workers.messages import AttachCommand, Sampling, Tokens
from cedserve.decode_workers.slot_drafting import SlotDSparkProposer
from cedserve.model import presets
from cedserve.model.cache.config import KVCacheConfig
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.cache.manager import KVCacheManager
from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model
from cedserve.model.dspark import Drafter
from cedserve.model.network import CEDModel
from cedserve.model.presets import preset, stretch_context
from cedserve.model.state import SequenceState
from cedserve.model.tokenizer import tiny_tokenizer_path

TOKENIZER_VOCAB = 512
BLOCK = 64
REPORTED_ACCEPTANCE = {"gsm8k": 2.82, "golden": 3.51}
"""Mean tokens per verification pass the DSpark report gives for the trained drafter (DESIGN section 2)."""


@dataclass(frozen=True)
class Group:
    """This process's place in an expert-parallel group."""

    ep: TorchDistributedEP
    control: Any
    """A gloo group for the benchmark's own bookkeeping (CPU tensors, whatever the device)."""

    def max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return float(t.item())

    def sum(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, group=self.control)
        return int(t.item())


@dataclass(frozen=True)
class Prefilled:
    """A prompt's state after its last token, its greedy first token, and the seconds to get there."""

    tokens: list[int]
    state: SequenceState
    first: int
    seconds: float


def build(preset_name: str, seed: int, device: str, max_context: int,
          released_attention: bool = False) -> tuple[CEDModel, Drafter]:
    """The preset with random weights, stretched to `max_context` positions. Its vocabulary is cut to
    the shipped tokenizer's (512): Engram looks tokens up through the tokenizer's map, so a generated id
    beyond it has no Engram row."""
    config = fit_config_to_tokenizer(preset(preset_name), tiny_tokenizer_path())
    vocab = min(config.vocab_size, TOKENIZER_VOCAB)
    config = config.replace(vocab_size=vocab, dspark_noise_token_id=min(config.dspark_noise_token_id, vocab - 1))
    if released_attention:  # the released checkpoint's attention and index geometry
        config = presets.released_attention(config)
    config = stretch_context(config, max_context + 64)  # room for the decoded tokens too
    model, drafter = random_model(config, tiny_tokenizer_path(), seed)
    return model.to(device), drafter.to(device)


def prefill_contexts(model: CEDModel, contexts: list[int], seed: int, chunk: int, device: str) -> dict[int, Prefilled]:
    """One random prompt of the longest context, prefilled in chunks; a copy of the state at each context."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, min(model.config.vocab_size, 512), (max(contexts),), generator=gen).tolist()
    state, out, at = model.new_state(), {}, 0
    start = time.perf_counter()
    for end in sorted(set(contexts)):
        logits = None
        while at < end:
            step = min(chunk, end - at)
            logits = model.prefill(tokens[at:at + step], state)
            at += step
        assert logits is not None
        _sync(device)
        out[end] = Prefilled(tokens[:end], copy.deepcopy(state), int(logits[-1].argmax()),
                             time.perf_counter() - start)
    return out


def run_cell(model: CEDModel, drafter: Drafter, prompt: Prefilled, batch: int, dspark: bool, steps: int,
             device: str, draft_tokens: int, group: Group | None = None, attention: str = "auto",
             warmup_steps: int = 1, runner: str = "off") -> dict[str, Any]:
    """`batch` requests on this rank (of the group's): warm-up, then `steps` timed steps."""
    gc.collect()  # the previous cell's engine and states (cycles) before this cell's peak memory
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    ep: ExpertParallel | None = group.ep if group is not None else None
    world = ep.world_size if ep is not None else 1
    num_blocks = batch * (len(prompt.tokens) // BLOCK + 8) + 8
    layout = BlockLayout.from_config(model.config, BLOCK)
    cache = KVCacheManager(layout, KVCacheConfig(block_size=BLOCK, num_blocks=num_blocks), "bench", device)
    config = DecodeConfig(max_running_requests=batch, dspark=dspark,
                          adaptive_verify=False, draft_tokens=draft_tokens, device=device,
                          paged_attention=attention, kernel_warmup=False,  # per cell: --warmup-steps instead
                          runner=runner.split("-")[0], compile_fused="-fused" in runner,
                          runner_drafter=("on" if runner.startswith("on") else "auto") if "-drafter" in runner else "off",
                          matmul_tf32=runner.endswith("-tf32"), overlap="-overlap" in runner)
    proposer = DSparkProposer(drafter, model, draft_tokens) if dspark else None
    engine = DecodeEngine(config, model, cache, proposer=proposer, ep=ep)
    for i in range(batch):
        cmd = AttachCommand(0, f"r{i}", f"l{i}", tuple(prompt.tokens), prompt.first, 100,
                            Sampling(max_tokens=100_000, ignore_eos=True))
        engine.attach_state(f"r{i}", prompt.tokens, copy.deepcopy(prompt.state), prompt.first, cmd)
    warmup_times = []
    first_tokens: list[int] = []  # request r0's tokens, every step: runner modes of one cell must agree
    for _ in range(max(warmup_steps, 2 if dspark else 1)):  # joins; the drafter's memory fills from the first
        _sync(device)  # pass's taps; the first launches of each kernel variant compile it (JIT)
        start = time.perf_counter()
        _keep_first(engine.step(), first_tokens)
        _sync(device)
        warmup_times.append(time.perf_counter() - start)
    drafted0, accepted0 = engine.drafted_tokens, engine.accepted_drafts
    _peak_memory_gb(device)
    emitted, times = 0, []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        outputs = engine.step()
        _keep_first(outputs, first_tokens)
        _sync(device)
        elapsed = time.perf_counter() - start
        times.append(group.max(elapsed) if group is not None else elapsed)  # the slowest rank's step
        emitted += sum(len(o.token_ids) for o in outputs if isinstance(o, Tokens))
    loop = _unsynced_loop(engine, steps, device, group, first_tokens)
    drafted, accepted = int(engine.drafted_tokens - drafted0), int(engine.accepted_drafts - accepted0)
    if group is not None:
        emitted, drafted, accepted = group.sum(emitted), group.sum(drafted), group.sum(accepted)
    total = batch * world
    per_request_step = emitted / (total * steps)
    step_s = statistics.median(times)  # a shared machine's load spikes hit single steps: the median resists
    cache.close()
    return {"context": len(prompt.tokens), "batch": total, "ep": world, "dspark": dspark,
            "attention": engine.paged_attention, "runner": engine.slots is not None, "runner_mode": runner,
            "drafter_on_slots": isinstance(engine.proposer, SlotDSparkProposer), "steps": steps,
            "tokens": emitted, "warmup_ms_each": [round(1000 * t, 1) for t in warmup_times],
            "step_ms_each": [round(1000 * t, 1) for t in times], "step_ms": 1000 * step_s,
            "tokens_per_s": total * per_request_step / step_s, "tpot_ms": 1000 * step_s / per_request_step,
            "tokens_per_step": per_request_step, "drafted": drafted, "accepted": accepted,
            "peak_memory_gb": _peak_memory_gb(device), "r0_tokens": first_tokens, **loop}


def _keep_first(outputs: list[Any], into: list[int]) -> list[Any]:
    into.extend(t for o in outputs if isinstance(o, Tokens) and o.request_id == "r0" for t in o.token_ids)
    return outputs


def _unsynced_loop(engine: DecodeEngine, steps: int, device: str, group: Group | None,
                   first_tokens: list[int]) -> dict[str, Any]:
    """`steps` more steps back to back, the device synchronised only before the first and after the
    last: what a decode worker's loop gets. An overlapped step (`decode.overlap`) returns the step
    before's tokens while the device runs its own, which the synchronised per-step times above
    cannot show; for the others the two agree but for the synchronise calls. `loop_step_ms`: the
    loop's wall time per step; `loop_gpu_busy`: kernel time (torch profiler over a second such loop,
    on CUDA) over that wall time, the figure issue 28 asks >= 85 % of (`loop_gpu_busy_profiled`: over
    the profiled loop's own, slower, wall time)."""
    def run() -> tuple[float, int]:
        _sync(device)
        start = time.perf_counter()
        emitted = 0
        for _ in range(steps):
            emitted += sum(len(o.token_ids) for o in _keep_first(engine.step(), first_tokens) if isinstance(o, Tokens))
        _sync(device)
        elapsed = time.perf_counter() - start
        return (group.max(elapsed) if group is not None else elapsed), emitted

    elapsed, emitted = run()
    out: dict[str, Any] = {"loop_step_ms": 1000 * elapsed / steps, "loop_tokens": emitted,
                           "loop_tokens_per_s": (group.sum(emitted) if group is not None else emitted) / elapsed}
    if device.startswith("cuda") and group is None:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            profiled, _ = run()
        kernel_us = sum(e.time_range.elapsed_us() for e in prof.events()
                        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")))
        # the profiler's own host work slows the loop it watches (a batch-1 step 4.6 -> 6.3 ms on an
        # H100), not its kernels: busy is their time over the unwatched loop's
        out.update({"loop_gpu_kernel_ms": kernel_us / 1000 / steps, "loop_profiled_step_ms": 1000 * profiled / steps,
                    "loop_gpu_busy": round(kernel_us / 1e6 / elapsed, 3),
                    "loop_gpu_busy_profiled": round(kernel_us / 1e6 / profiled, 3)})
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def _peak_memory_gb(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    peak = torch.cuda.max_memory_allocated(torch.device(device)) / 1e9
    torch.cuda.reset_peak_memory_stats(torch.device(device))
    return round(peak, 2)


def compare(plain: dict[str, Any], spec: dict[str, Any]) -> None:
    """Add the DSpark cell's measured and projected speedups over the plain cell."""
    spec["speedup"] = spec["tokens_per_s"] / plain["tokens_per_s"]
    ratio = plain["step_ms"] / spec["step_ms"]
    spec["projected_speedup"] = {name: a * ratio for name, a in REPORTED_ACCEPTANCE.items()}


def machine(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
                            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "python": platform.python_version(), "torch": torch.__version__,
                            "load_average_1m_at_start": os.getloadavg()[0]}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        info["gpus"] = torch.cuda.device_count()
    return info


def run_all(args: argparse.Namespace, device: str, control: Any = None) -> tuple[list[dict[str, Any]],
                                                                                 dict[int, float]]:
    """Every cell this process takes part in (all ranks of a group call it with the same arguments;
    `control` is the group's gloo group, None alone)."""
    started = time.monotonic()
    model, drafter = build(args.preset, args.seed, device, max(args.contexts), args.released_attention)
    warm = prefill_contexts(model, [16], args.seed, 16, device)[16]  # first calls allocate and dispatch slowly
    prompts = prefill_contexts(model, args.contexts, args.seed, args.prefill_chunk, device)
    group, rank, ep_world = None, 0, 1
    if control is not None:  # every rank prefilled with all experts; now keep only this rank's
        rank, ep_world = dist.get_rank(), dist.get_world_size()
        shard_experts(model, rank, ep_world)
        group = Group(TorchDistributedEP(model.config.n_routed_experts, None, control), control)
    run_cell(model, drafter, warm, 1, True, 1, device, args.draft_tokens, group)
    rows: list[dict[str, Any]] = []
    for context in args.contexts:
        for batch in args.batches:
            if batch % ep_world:
                continue
            elapsed = time.monotonic() - started
            if args.time_budget_s and (group.max(elapsed) if group is not None else elapsed) > args.time_budget_s:
                rows.append({"context": context, "batch": batch, "ep": ep_world,
                             "skipped": f"time budget of {args.time_budget_s} s spent"})
                continue
            dense: dict[bool, dict[str, Any]] = {}
            for attention, runner in [(a, r) for r in args.runner for a in args.attention]:
                pair = [run_cell(model, drafter, prompts[context], batch // ep_world, dspark, args.steps, device,
                                 args.draft_tokens, group, attention, args.warmup_steps, runner)
                        for dspark in {"both": (False, True), "off": (False,), "on": (True,)}[args.dspark]]
                if len(pair) == 2:
                    compare(*pair)
                for r in pair:  # the same cell on the dense path, measured just before in this run
                    if r["attention"] == "off":
                        dense[r["dspark"]] = r
                    elif r["dspark"] in dense:
                        r["speedup_over_dense"] = dense[r["dspark"]]["step_ms"] / r["step_ms"]
                rows += pair
                if rank == 0:
                    for r in pair:
                        over = f"  x{r['speedup_over_dense']:.2f} vs dense" if "speedup_over_dense" in r else ""
                        print(f"ctx {r['context']:>6} batch {r['batch']:>3} ep {r['ep']} dspark {r['dspark']!s:>5} "
                              f"attention {r['attention']:>9} runner {r['runner']!s:>5}"
                              f"{' drafter on slots' if r['drafter_on_slots'] else ''}: "
                              f"{r['tokens_per_s']:8.2f} tok/s  "
                              f"tpot {r['tpot_ms']:9.1f} ms  tokens/step {r['tokens_per_step']:.2f}  "
                              f"peak {r['peak_memory_gb']} GB{over}", flush=True)
                        busy = f", GPU busy {r['loop_gpu_busy']:.0%}" if "loop_gpu_busy" in r else ""
                        print(f"    {r['runner_mode']}: back to back {r['loop_step_ms']:.3f} ms a step{busy}; "
                              f"r0's first tokens {r['r0_tokens'][:12]}", flush=True)
    return rows, {c: p.seconds for c, p in prompts.items()}


def ep_worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    """One rank of an expert-parallel group (spawned by `main`)."""
    cuda = args.device.startswith("cuda")
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    if args.threads:
        torch.set_num_threads(args.threads)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    control = dist.new_group(backend="gloo") if cuda else dist.group.WORLD
    try:
        rows, prefills = run_all(args, device, control)
        if rank == 0:
            out.put((rows, prefills, machine(device)))
    finally:
        dist.destroy_process_group()


def _run_group(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[int, float], dict[str, Any]]:
    import torch.multiprocessing as mp

    if args.device.startswith("cuda") and torch.cuda.device_count() < args.ep:
        raise SystemExit(f"--ep {args.ep} needs {args.ep} CUDA devices, found {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=ep_worker, args=(rank, args.ep, port, args, out)) for rank in range(args.ep)]
    for p in procs:
        p.start()
    result = None
    while result is None:
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        try:
            result = out.get(timeout=1.0)
        except queue.Empty:  # the ranks are still running
            continue
    for p in procs:
        p.join(timeout=60)
    rows, prefills, info = result
    return rows, prefills, info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mini-40")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (with --ep R: cuda:0 .. cuda:R-1)")
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 256])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4], help="requests per cell (the group's total)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per cell (after the warm-up)")
    p.add_argument("--dspark", choices=("both", "off", "on"), default="both",
                   help="each cell without DSpark, with it, or both (default; the DSpark cell reports its speedup)")
    p.add_argument("--draft-tokens", type=int, default=0, help="drafts per pass (0: the model's block size)")
    p.add_argument("--runner", nargs="+", default=["off"], choices=["auto", "off", "on", "auto-fused", "auto-fused-tf32",
                                                                   "auto-fused-drafter", "auto-fused-drafter-tf32",
                                                                   "on-drafter", "off-tf32", "auto-fused-overlap",
                                                                   "on-overlap"],
                   help="`decode.runner` values to time, each cell once per value (auto: the model runner's "
                        "CUDA graphs for the target's rows, plain and DSpark verify, on one CUDA rank; -fused: "
                        "with `decode.compile_fused`; -drafter: the DSpark drafter's pass on slots too, "
                        "`decode.runner_drafter = auto`, on with on-drafter (a CPU: its eager pass); -tf32: with `decode.matmul_tf32`; "
                        "-overlap: with `decode.overlap`, compare its loop_step_ms)")
    p.add_argument("--attention", nargs="+", default=["auto"], choices=["auto", "off", "kernels", "reference"],
                   help="decode attention paths to time, each cell once per path (`decode.paged_attention`: "
                        "off = dense masks, kernels = the compact-cache kernels over paged records); a path "
                        "after `off` reports its speedup over it")
    p.add_argument("--warmup-steps", type=int, default=1,
                   help="untimed steps per cell first (their times are reported as warmup_ms_each: a kernel "
                        "variant's first launch compiles it)")
    p.add_argument("--released-attention", action="store_true",
                   help="the released attention geometry on the preset (64 heads x 512, 32 index heads, top-512 "
                        "in a pool of 2,048 blocks): the Gluon kernels' shapes")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="tokens per prefill call")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (one process and device each)")
    p.add_argument("--time-budget-s", type=float, default=0.0, help="start no new cell after this many "
                   "seconds (0: no limit); skipped cells are recorded")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default="")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if args.ep > 1:
        rows, prefills, info = _run_group(args)
    else:
        device = args.device
        info = machine(device)
        rows, prefills = run_all(args, device)
    info["load_average_1m_at_end"] = os.getloadavg()[0]
    report = {"benchmark": "decode", "date": started, "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
              "machine": info, "preset": args.preset, "released_attention": args.released_attention,
              "device": args.device, "ep": args.ep,
              "draft_tokens": args.draft_tokens or preset(args.preset).dspark_block_size, "note": args.note,
              "prefill_s_by_context": prefills, "reported_acceptance": REPORTED_ACCEPTANCE, "results": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
