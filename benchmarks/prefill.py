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

Memory: every pass runs in chunks of `--chunk-tokens`; the largest temporaries are one chunk's
attention logits over every compressed entry (`[heads, chunk, prompt / m]` float32: 4.3 GB for a
2,048-token chunk at 128K on mini-40), so `--chunk-tokens 1024` halves the peak. The preset is
stretched (`presets.stretch_context`) when a prompt exceeds its positions (mini-40: 64K). The
per-row peak device memory is reported on CUDA. `--time-budget-s` starts no new prompt length after
that many seconds (the rest are recorded as skipped), so a run's length is bounded.

    python benchmarks/prefill.py --preset mini-40 --tokens 1024 2048 --out docs/benchmarks/prefill-cpu.json
    python benchmarks/prefill.py --device cuda --tokens 4096 16384 65536 131072 --time-budget-s 200 \\
        --out docs/benchmarks/prefill-cuda.json
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
from cedserve.model.presets import preset, stretch_context
from cedserve.model.tokenizer import tiny_tokenizer_path
from cedserve.prefill_workers.config import PrefillWorkerConfig
from cedserve.prefill_workers.engine import PrefillEngine
from cedserve.prefill_workers.validation import RequestLimits, validate_prefill
from cedserve.proto import worker_pb2 as wpb

REPO = Path(__file__).resolve().parents[1]
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


def time_engine(model: CEDModel, tokens: list[int], chunk: int, span: int, device: str) -> Timing:
    layout = BlockLayout.from_config(model.config, BLOCK)
    cache = KVCacheManager(layout, KVCacheConfig(block_size=BLOCK, num_blocks=len(tokens) // BLOCK + 4),
                           "bench", device)
    config = PrefillWorkerConfig(worker_id="bench", chunk_tokens=chunk, step_token_budget=chunk, replay_span=span,
                                 device=device)
    engine = PrefillEngine(model, cache, None, config)
    limits = RequestLimits(model.config.vocab_size, len(tokens), BLOCK, span, "bench")
    spec = validate_prefill(wpb.PrefillRequest(request_id="bench", token_ids=tokens), limits)
    sync(device)
    start = clocks()
    job = engine.submit(spec)
    while True:
        engine.step()
        kinds = [job.events.get().WhichOneof("event") for _ in range(job.events.qsize())]
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


def build(preset_name: str, seed: int, device: str, max_tokens: int) -> CEDModel:
    """The preset with random weights (as `cedserve worker --preset` builds it), stretched to reach
    `max_tokens` positions."""
    config = stretch_context(fit_config_to_tokenizer(preset(preset_name), tiny_tokenizer_path()), max_tokens)
    model, _ = random_model(config, tiny_tokenizer_path(), seed)
    return model.to(device)


def peak_memory_gb(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    peak = torch.cuda.max_memory_allocated(torch.device(device)) / 1e9
    torch.cuda.reset_peak_memory_stats(torch.device(device))
    return round(peak, 2)


def measure(model: CEDModel, n: int, args: argparse.Namespace) -> dict[str, Any]:
    tokens = torch.randint(3, TOKEN_ID_LIMIT, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    peak_memory_gb(args.device)
    engine = time_engine(model, tokens, args.chunk_tokens, args.replay_span, args.device)
    encoder = time_loop(model, tokens, args.chunk_tokens, "encode_chunk", args.device)
    row: dict[str, Any] = {"prompt_tokens": n, "load_average_1m": round(os.getloadavg()[0], 2)}
    row.update(_cells("engine", n, engine))
    row.update(_cells("encoder", n, encoder))
    if not args.skip_all_layers:
        all_layers = time_loop(model, tokens, args.chunk_tokens, "prefill", args.device)
        row.update(_cells("all_layers", n, all_layers))
        row.update(engine_share_cpu=round(engine[1] / all_layers[1], 3),
                   engine_share_wall=round(engine[0] / all_layers[0], 3),
                   speedup_cpu=round(all_layers[1] / engine[1], 2), speedup_wall=round(all_layers[0] / engine[0], 2))
    row["peak_memory_gb"] = peak_memory_gb(args.device)
    print(json.dumps(row), flush=True)
    return row


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
    model = build(args.preset, args.seed, args.device, max(args.tokens))
    plan = model.config
    print(f"{args.preset}: {plan.num_hidden_layers} layers, encoder {plan.num_encoder_layers}; device {args.device}",
          flush=True)
    warm = list(range(3, 3 + 2 * BLOCK))  # first calls pay one-time costs (allocator, kernel selection)
    time_engine(model, warm, 2 * BLOCK, args.replay_span, args.device)
    for method in ("encode_chunk", "prefill"):
        time_loop(model, warm, args.chunk_tokens, method, args.device)
    result: dict[str, Any] = {
        "benchmark": "prefill", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", os.path.relpath(sys.argv[0], REPO), *(argv or sys.argv[1:])]),
        "machine": info, "preset": args.preset, "num_layers": plan.num_hidden_layers,
        "encoder_layers": plan.num_encoder_layers, "chunk_tokens": args.chunk_tokens, "replay_span": args.replay_span,
        "device": args.device, "note": args.note, "results": []}
    for n in args.tokens:
        if args.time_budget_s and time.monotonic() - started > args.time_budget_s:
            result["results"].append({"prompt_tokens": n, "skipped": f"time budget of {args.time_budget_s} s spent"})
            print(f"{n}: skipped (time budget)", flush=True)
            continue
        result["results"].append(measure(model, n, args))
        if args.out:  # after every row: a long run stopped early keeps what it measured
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
