"""Prefill throughput: the encoder-only engine against running all layers over the same prompt.

For each prompt length, in one process and on the same random weights:

* `engine`: the prefill worker's engine end to end (`PrefillEngine`, no decode target): chunked
  `encode_chunk` (encoder layers + the decoder KV source's compressor and index keys), records
  stored into paged blocks, prefix-cache commits, then the decoder replay over the last
  `--replay-span` tokens and sampling of the first token;
* `encoder`: the bare `encode_chunk` loop over the same chunks (the engine's overhead is the gap);
* `all_layers`: `CEDModel.prefill` over the same chunks: every layer, what a non-CED prefill runs.

The report's claim is that prefill costs about half of an all-layer pass (8B of 16B active
parameters); `engine_share_cpu` = engine CPU time / all-layer CPU time measures it on this plan and
machine (on a GPU, where the process's CPU time is the launching thread's, `engine_share_wall`).
Wall times are reported too; on a shared host they carry other jobs' load, which CPU time
(`time.process_time`, all of this process's threads) mostly does not.

`--attention off kernels reference` times the paths of `prefill.paged_attention` side by side, each
for every length: the dense path (every compressed entry dequantized and masked for every token of
a chunk) and the paged path (each token's window and top-k picks through the kernels, or their torch
references); a paged row carries its speedup over the dense row of its length. `--repeats 2` reports
the second engine run (the first, whose wall time is kept as `engine_first_wall_s`, compiles the
kernel variants a length needs).

Memory: every pass runs in chunks of `--chunk-tokens`; the largest temporaries are one chunk's
attention logits over every compressed entry (`[heads, chunk, prompt / m]` float32: 4.3 GB for a
2,048-token chunk at 128K on mini-40), so `--chunk-tokens 1024` halves the peak. The preset is
stretched (`presets.stretch_context`) when a prompt exceeds its positions (mini-40: 64K). The
per-row peak device memory is reported on CUDA. `--time-budget-s` starts no new prompt length after
that many seconds (the rest are recorded as skipped), so a run's length is bounded.

    python benchmarks/prefill.py --preset mini-40 --tokens 1024 2048 --out docs/benchmarks/prefill-cpu.json
    python benchmarks/prefill.py --device cuda --tokens 4096 16384 65536 131072 --time-budget-s 200 \\
        --out docs/benchmarks/prefill-cuda.json
    python benchmarks/prefill.py --device cuda --attention off kernels --repeats 2 --skip-all-layers \\
        --tokens 4096 32768 131072 --out docs/benchmarks/prefill-paged-h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from cedserve.model.cache.config import KVCacheConfig
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.cache.manager import KVCacheManager
from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model
from cedserve.model.network import CEDModel
from cedserve.model.presets import preset, released_attention, stretch_context
from cedserve.model.tokenizer import tiny_tokenizer_path
from cedserve.prefill_workers.config import PrefillWorkerConfig
from cedserve.prefill_workers.engine import PrefillEngine
from cedserve.prefill_workers.service import wire_event
from cedserve.prefill_workers.validation import RequestLimits, validate_prefill
from cedserve.proto import worker_pb2 as wpb

REPO = Path(__file__).resolve().parents[1]
ROUTED: dict[str, object] = {"effort": 75, "sampling": wpb.SamplingParams(top_p=1.0)}
"""Effort and sampling as the router resolves them (the internal plane has no "unset")."""
BLOCK = 64
TOKEN_ID_LIMIT = 500  # the tiny tokenizer's Engram token map covers ids < 512 (see docs/prefill.md)


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    return {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "load_average_1m_at_start": os.getloadavg()[0]}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


Timing = tuple[float, float]
"""(wall seconds, CPU seconds of this process): on a shared host the CPU time is the steadier
measure of compute, since other jobs stretch the wall time."""


def clocks() -> Timing:
    return time.perf_counter(), time.process_time()


def since(start: Timing) -> Timing:
    wall, cpu = clocks()
    return wall - start[0], cpu - start[1]


def time_engine(model: CEDModel, tokens: list[int], chunk: int, span: int, device: str,
                attention: str = "off") -> Timing:
    """`attention` is a path (`prefill.paged_attention`), with "+tf32" for `prefill.matmul_tf32` and
    "+runner" for the prefill runner (`prefill.runner = "on"`, one bucket of `chunk` tokens, its graph
    captured on CUDA inside the timed run's engine set-up, not its time); else the runner is off."""
    attention, *flags = attention.split("+")
    layout = BlockLayout.from_config(model.config, BLOCK)
    cache = KVCacheManager(layout, KVCacheConfig(block_size=BLOCK, num_blocks=len(tokens) // BLOCK + 4),
                           "bench", device)
    config = PrefillWorkerConfig(worker_id="bench", chunk_tokens=chunk, step_token_budget=chunk, replay_span=span,
                                 device=device, paged_attention=attention, matmul_tf32="tf32" in flags,
                                 runner="on" if "runner" in flags else "off", runner_buckets=(chunk,),
                                 kernel_warmup=False)  # an engine per run: --repeats shows the first run's compiles
    engine = PrefillEngine(model, cache, None, config)
    limits = RequestLimits(model.config.vocab_size, len(tokens), BLOCK, span, "bench")
    spec = validate_prefill(wpb.PrefillRequest(request_id="bench", token_ids=tokens, **ROUTED), limits)
    sync(device)
    start = clocks()
    job = engine.submit(spec)
    while True:
        engine.step()
        kinds = [wire_event(job.events.get(), "bench").WhichOneof("event") for _ in range(job.events.qsize())]
        if "done" in kinds or "error" in kinds:
            break
    sync(device)
    elapsed = since(start)
    assert "error" not in kinds, kinds
    cache.close()
    return elapsed


def time_loop(model: CEDModel, tokens: list[int], chunk: int, method: str, device: str) -> Timing:
    state = model.new_state()
    ids = torch.tensor(tokens, device=device)
    sync(device)
    start = clocks()
    for i in range(0, len(tokens), chunk):
        getattr(model, method)(ids[i:i + chunk], state)
    sync(device)
    return since(start)


def _cells(name: str, n: int, t: Timing) -> dict[str, float]:
    return {f"{name}_wall_s": round(t[0], 3), f"{name}_cpu_s": round(t[1], 3),
            f"{name}_tokens_per_s": round(n / t[0], 1), f"{name}_tokens_per_cpu_s": round(n / t[1], 1)}


def build(preset_name: str, seed: int, device: str, max_tokens: int, released: bool = False) -> CEDModel:
    """The preset with random weights (as `cedserve worker --preset` builds it), stretched to reach
    `max_tokens` positions; `released`: with the released attention geometry."""
    config = fit_config_to_tokenizer(preset(preset_name), tiny_tokenizer_path())
    config = stretch_context(released_attention(config) if released else config, max_tokens)
    model, _ = random_model(config, tiny_tokenizer_path(), seed)
    return model.to(device)


def peak_memory_gb(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    peak = torch.cuda.max_memory_allocated(torch.device(device)) / 1e9
    torch.cuda.reset_peak_memory_stats(torch.device(device))
    return round(peak, 2)


def measure(model: CEDModel, n: int, attention: str, args: argparse.Namespace) -> dict[str, Any]:
    """One prompt length on one attention path: the engine `--repeats` times (the last is reported,
    the first's wall time too: on the kernels it includes compiling the variants this length needs),
    then the bare encoder loop and (unless skipped) the all-layer pass."""
    tokens = torch.randint(3, TOKEN_ID_LIMIT, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    peak_memory_gb(args.device)
    runs = [time_engine(model, tokens, args.chunk_tokens, args.replay_span, args.device, attention)
            for _ in range(args.repeats)]
    engine = runs[-1]
    encoder = time_loop(model, tokens, args.chunk_tokens, "encode_chunk", args.device)  # the engine set the path
    row: dict[str, Any] = {"prompt_tokens": n, "attention": attention, "load_average_1m": round(os.getloadavg()[0], 2)}
    row.update(_cells("engine", n, engine))
    if len(runs) > 1:
        row["engine_first_wall_s"] = round(runs[0][0], 3)
    row.update(_cells("encoder", n, encoder))
    if not args.skip_all_layers:
        all_layers = time_loop(model, tokens, args.chunk_tokens, "prefill", args.device)
        row.update(_cells("all_layers", n, all_layers))
        row.update(engine_share_cpu=round(engine[1] / all_layers[1], 3),
                   engine_share_wall=round(engine[0] / all_layers[0], 3),
                   speedup_cpu=round(all_layers[1] / engine[1], 2), speedup_wall=round(all_layers[0] / engine[0], 2))
    row["peak_memory_gb"] = peak_memory_gb(args.device)
    model.use_paged_attention(None)
    print(json.dumps(row), flush=True)
    return row


def compare_paths(rows: list[dict[str, Any]]) -> None:
    """Each paged row's speedup over the dense row of its prompt length, measured in the same run
    (wall time on a GPU, CPU time elsewhere: the steadier on a shared host)."""
    dense = {r["prompt_tokens"]: r for r in rows if r.get("attention") == "off"}
    for row in rows:
        base = dense.get(row["prompt_tokens"])
        if base is None or row is base or "engine_wall_s" not in row:
            continue
        for name in ("engine", "encoder", "all_layers"):
            if f"{name}_wall_s" in row:
                row[f"{name}_speedup_over_dense_wall"] = round(base[f"{name}_wall_s"] / row[f"{name}_wall_s"], 2)
                row[f"{name}_speedup_over_dense_cpu"] = round(base[f"{name}_cpu_s"] / row[f"{name}_cpu_s"], 2)


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'tokens':>8} {'attention':>9} {'engine tok/s':>12} {'encoder tok/s':>13} {'all layers tok/s':>16} "
          f"{'engine vs dense':>15} {'peak GB':>7}")
    for r in rows:
        if "engine_wall_s" not in r:
            print(f"{r['prompt_tokens']:>8} {'':>9} skipped")
            continue
        vs = r.get("engine_speedup_over_dense_wall", "")
        print(f"{r['prompt_tokens']:>8} {r['attention']:>9} {r['engine_tokens_per_s']:>12} "
              f"{r['encoder_tokens_per_s']:>13} {r.get('all_layers_tokens_per_s', ''):>16} {vs!s:>15} "
              f"{r['peak_memory_gb']!s:>7}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mini-40")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="prompt lengths (default: 1024 2048 on CPU, 4096 16384 65536 131072 on CUDA)")
    p.add_argument("--chunk-tokens", type=int, default=2048)
    p.add_argument("--replay-span", type=int, default=128)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--skip-all-layers", action="store_true", help="time only the prefill engine")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default); 1 keeps "
                   "a shared host's load from inflating CPU time through spinning OpenMP threads")
    p.add_argument("--time-budget-s", type=float, default=0.0, help="start no new prompt length after this "
                   "many seconds (0: no limit); skipped lengths are recorded")
    p.add_argument("--attention", nargs="+", default=["off"],
                   choices=["off", "kernels", "reference", "off+tf32", "kernels+tf32", "kernels+runner",
                            "kernels+runner+tf32", "off+runner"],
                   help="attention paths to time side by side (`prefill.paged_attention`): off = dense; "
                        "+tf32: with `prefill.matmul_tf32` (CUDA); +runner: chunks through the prefill "
                        "runner (`prefill.runner`; its graphs on CUDA)")
    p.add_argument("--released-attention", action="store_true",
                   help="the released attention geometry on the preset (`presets.released_attention`)")
    p.add_argument("--repeats", type=int, default=1, help="engine runs per cell (the last is reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default="", help="free text stored with the results")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tokens is None:
        args.tokens = [4096, 16384, 65536, 131072] if args.device.startswith("cuda") else [1024, 2048]
    started = time.monotonic()
    info = machine()
    model = build(args.preset, args.seed, args.device, max(args.tokens), args.released_attention)
    plan = model.config
    print(f"{args.preset}: {plan.num_hidden_layers} layers, encoder {plan.num_encoder_layers}; device {args.device}",
          flush=True)
    warm = list(range(3, 3 + 2 * BLOCK))  # first calls pay one-time costs (allocator, kernel selection)
    for attention in args.attention:
        time_engine(model, warm, 2 * BLOCK, args.replay_span, args.device, attention)
        for method in ("encode_chunk", "prefill"):
            time_loop(model, warm, args.chunk_tokens, method, args.device)
        model.use_paged_attention(None)
    result: dict[str, Any] = {
        "benchmark": "prefill", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", os.path.relpath(sys.argv[0], REPO), *(argv or sys.argv[1:])]),
        "machine": info, "preset": args.preset, "num_layers": plan.num_hidden_layers,
        "encoder_layers": plan.num_encoder_layers, "released_attention": args.released_attention,
        "chunk_tokens": args.chunk_tokens, "replay_span": args.replay_span,
        "device": args.device, "attention": args.attention, "repeats": args.repeats, "note": args.note,
        "results": []}
    rows: list[dict[str, Any]] = result["results"]
    for n in args.tokens:
        for attention in args.attention:
            if args.time_budget_s and time.monotonic() - started > args.time_budget_s:
                rows.append({"prompt_tokens": n, "attention": attention,
                             "skipped": f"time budget of {args.time_budget_s} s spent"})
                print(f"{n} {attention}: skipped (time budget)", flush=True)
                continue
            rows.append(measure(model, n, attention, args))
            compare_paths(rows)
            if args.out:  # after every row: a long run stopped early keeps what it measured
                Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
