"""Decode throughput: tokens/s and time per output token by batch size and context length, with and
without DSpark, through the real decode engine (continuous batching, one target pass per step).

Each cell prefills one random prompt of `context` tokens, hands a copy of its state to the engine per
request (a shipped state: no transfer, no replay), lets the engine take a warm-up step or two (the
drafter's memory fills from the first pass's taps), then times `--steps` steps. Reported per cell:

* `tokens_per_s`: output tokens of the whole batch per second (median step time);
* `tpot_ms`: time per output token of one request (median step time / tokens per request per step);
* `tokens_per_step`: tokens each request emits per step (1 without DSpark; 1 + accepted drafts with);
* DSpark: drafts proposed/accepted and the measured speedup over the same cell without it.

The preset's drafter has random weights, so its drafts are almost never accepted and the measured
DSpark speedup is below 1: it shows what drafting and verifying K positions cost. `projected_speedup`
applies the measured step times to the acceptance rates reported for the trained drafter (mean
accepted length 2.82 on GSM8K, 3.51 "golden"): speedup = tokens per step x plain step / DSpark step.
DSpark cells verify every draft (no adaptive shortening) so their step time is the full-length cost.

    python benchmarks/decode.py --preset mini-40 --contexts 64 256 --batches 1 4 \\
        --out docs/benchmarks/decode-cpu.json
    python benchmarks/decode.py --device cuda --preset mini-40 --contexts 1024 8192 --batches 1 8 32 \\
        --out docs/benchmarks/decode-cuda.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from cedserve.decode_workers.config import DecodeConfig
from cedserve.decode_workers.drafting import DSparkProposer
from cedserve.decode_workers.engine import DecodeEngine
from cedserve.decode_workers.messages import AttachCommand, Sampling, Tokens
from cedserve.model.cache.config import KVCacheConfig
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.cache.manager import KVCacheManager
from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model
from cedserve.model.dspark import Drafter
from cedserve.model.network import CEDModel
from cedserve.model.presets import preset
from cedserve.model.state import SequenceState
from cedserve.model.tokenizer import tiny_tokenizer_path

TOKENIZER_VOCAB = 512
REPORTED_ACCEPTANCE = {"gsm8k": 2.82, "golden": 3.51}
"""Mean tokens per verification pass the DSpark report gives for the trained drafter (DESIGN section 2)."""


def build(preset_name: str, seed: int, device: str) -> tuple[CEDModel, Drafter]:
    """The preset with random weights. Its vocabulary is cut to the shipped tokenizer's (512): Engram
    looks tokens up through the tokenizer's map, so a generated id beyond it has no Engram row."""
    config = fit_config_to_tokenizer(preset(preset_name), tiny_tokenizer_path())
    vocab = min(config.vocab_size, TOKENIZER_VOCAB)
    config = config.replace(vocab_size=vocab, dspark_noise_token_id=min(config.dspark_noise_token_id, vocab - 1))
    model, drafter = random_model(config, tiny_tokenizer_path(), seed)
    return model.to(device), drafter.to(device)


def prefilled(model: CEDModel, context: int, seed: int) -> tuple[list[int], SequenceState, int, float]:
    """A random prompt, the state after it, its greedy first token, and the prefill seconds."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, min(model.config.vocab_size, 512), (context,), generator=gen).tolist()
    state = model.new_state()
    start = time.perf_counter()
    first = int(model.prefill(tokens, state)[-1].argmax())
    return tokens, state, first, time.perf_counter() - start


def run_cell(model: CEDModel, drafter: Drafter, prompt: tuple[list[int], SequenceState, int], batch: int,
             dspark: bool, steps: int, device: str, draft_tokens: int) -> dict[str, Any]:
    tokens, state, first = prompt
    block = 64
    num_blocks = batch * (len(tokens) // block + 8) + 8
    layout = BlockLayout.from_config(model.config, block)
    cache = KVCacheManager(layout, KVCacheConfig(block_size=block, num_blocks=num_blocks), "bench", device)
    config = DecodeConfig(block_size=block, num_blocks=num_blocks, max_running_requests=batch, dspark=dspark,
                          adaptive_verify=False, draft_tokens=draft_tokens, device=device)
    proposer = DSparkProposer(drafter, model, draft_tokens) if dspark else None
    engine = DecodeEngine(config, model, cache, proposer=proposer)
    for i in range(batch):
        cmd = AttachCommand(0, f"r{i}", f"l{i}", tuple(tokens), first, 100,
                            Sampling(max_tokens=100_000, ignore_eos=True))
        engine.attach_state(f"r{i}", tokens, copy.deepcopy(state), first, cmd)
    for _ in range(2 if dspark else 1):  # joins; the drafter's memory fills from the first pass's taps
        engine.step()
    drafted0, accepted0 = engine.drafted_tokens, engine.accepted_drafts
    emitted, times = 0, []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        outputs = engine.step()
        _sync(device)
        times.append(time.perf_counter() - start)
        emitted += sum(len(o.token_ids) for o in outputs if isinstance(o, Tokens))
    per_request_step = emitted / (batch * steps)
    step_s = statistics.median(times)  # a shared machine's load spikes hit single steps: the median resists
    drafted, accepted = engine.drafted_tokens - drafted0, engine.accepted_drafts - accepted0
    return {"context": len(tokens), "batch": batch, "dspark": dspark, "steps": steps, "tokens": emitted,
            "step_ms_each": [round(1000 * t, 1) for t in times], "step_ms": 1000 * step_s,
            "tokens_per_s": batch * per_request_step / step_s, "tpot_ms": 1000 * step_s / per_request_step,
            "tokens_per_step": per_request_step, "drafted": drafted, "accepted": accepted}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


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
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mini-40")
    p.add_argument("--device", default="cpu")
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 256])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--steps", type=int, default=3, help="timed steps per cell (after the warm-up)")
    p.add_argument("--draft-tokens", type=int, default=0, help="drafts per pass (0: the model's block size)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default="")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    info = machine(args.device)
    model, drafter = build(args.preset, args.seed, args.device)
    warm = prefilled(model, 16, args.seed)  # first calls allocate and dispatch slowly: keep them out of the cells
    run_cell(model, drafter, warm[:3], 1, True, 1, args.device, args.draft_tokens)
    rows, prefills = [], {}
    for context in args.contexts:
        tokens, state, first, seconds = prefilled(model, context, args.seed + context)
        prefills[context] = seconds
        for batch in args.batches:
            plain = run_cell(model, drafter, (tokens, state, first), batch, False, args.steps, args.device,
                             args.draft_tokens)
            spec = run_cell(model, drafter, (tokens, state, first), batch, True, args.steps, args.device,
                            args.draft_tokens)
            compare(plain, spec)
            rows += [plain, spec]
            for r in (plain, spec):
                print(f"ctx {r['context']:>6} batch {r['batch']:>3} dspark {r['dspark']!s:>5}: "
                      f"{r['tokens_per_s']:8.2f} tok/s  tpot {r['tpot_ms']:9.1f} ms  "
                      f"tokens/step {r['tokens_per_step']:.2f}", flush=True)
    info["load_average_1m_at_end"] = os.getloadavg()[0]
    report = {"benchmark": "decode", "date": started, "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
              "machine": info, "preset": args.preset, "device": args.device,
              "draft_tokens": args.draft_tokens or model.config.dspark_block_size, "note": args.note,
              "prefill_s_by_context": prefills, "reported_acceptance": REPORTED_ACCEPTANCE, "results": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
