"""Evaluate the trained demo checkpoint (`cedserve/assets/demo`, `cedserve.training.demo`) on held-out code.

Held-out text: the files of the running interpreter's standard library that the trainer's fixed
split holds out (`crc32(path) % 50 == 0`, `training/data.py`), tokenized with the checkpoint's
tokenizer. Four measurements, all through the serving entry points:

1. KV format: perplexity of held-out windows (`prefill` of each) with the FP4/FP8 record cache
   against a bf16 cache (`KVFormat.BF16`: the same values unquantized).
2. Bounded replay: a prompt is encoded (`encode_chunk`: the prefill worker's path), a decode-side
   state is built from its global KV alone and rebuilt by `replay` over the last 128 / 256 / exact
   tokens, then the continuation is scored; perplexity and KL against the full prefill.
3. DSpark: greedy decoding through the decode engine (`DecodeEngine`, continuous batching, one
   target pass per step) from held-out prompts: mean accepted drafts per verification. The prompts
   are spread evenly over the held-out code (`spread_rows`, `code_files`: no generated charmap
   tables, which any drafter copies), the same rows the drafter trainer's acceptance replay uses.
4. Decode speed at batch 1, 8 and 32 (`--batches`), distinct prompts per request, in one run with
   the modes' steps interleaved (`--modes`): DSpark off; `per-sequence`, the drafting before issue 8
   (one draft pass per sequence); `batched`, one draft pass for the batch; both verifying every draft
   (5); and `batched+cost-check`, the serving set-up (adaptive verification, and the proposer's
   check against the engine's measured costs that turns drafting down where it cannot pay). Per
   cell: tokens/s, median step time, the draft pass's and observe's share of a step.

    python benchmarks/demo_eval.py --device cuda --out docs/benchmarks/demo-eval-h200.json
    python benchmarks/demo_eval.py --device cpu --ppl-rows 4 --replay-rows 2 --batches 1 2 --steps 2 \\
        --out build/demo-eval-cpu.json      # a quick CPU check
    python benchmarks/demo_eval.py --device cpu --parts speed --batches 1 8 32 --steps 6 \
        --out docs/benchmarks/demo-eval-speed-cpu.json   # the decode-speed cells only

Prints a table and writes JSON (date, machine, command).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from cedserve.decode_workers.config import DecodeConfig
from cedserve.decode_workers.drafting import DSparkProposer, Observation
from cedserve.decode_workers.engine import DecodeEngine
from cedserve.decode_workers.messages import AttachCommand, Sampling, Tokens
from cedserve.decode_workers.profile import StepProfile
from cedserve.decode_workers.sequence import DecodeSequence
from cedserve.decode_workers.state_io import exact_replay_span
from cedserve.model.cache.config import KVCacheConfig
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.cache.manager import KVCacheManager
from cedserve.model.checkpoint import load_model
from cedserve.model.checkpoint_writer import load_drafter
from cedserve.model.dspark import Draft, Drafter, DraftRequest, DraftState
from cedserve.model.kv_format import KVFormat
from cedserve.model.network import CEDModel
from cedserve.model.state import SequenceState
from cedserve.model.tokenizer import TextCodec
from cedserve.training.data import code_files, consecutive_rows, load_corpus, spread_rows, token_stream


def default_checkpoint() -> Path:
    return Path(str(resources.files("cedserve") / "assets" / "demo"))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------ 1. KV format


def nll(logits: Tensor, targets: Tensor) -> Tensor:
    """Per-token negative log-likelihood (float64)."""
    return F.cross_entropy(logits.double(), targets, reduction="none")


def kv_format_perplexity(model: CEDModel, rows: Tensor) -> dict[str, Any]:
    out: dict[str, Any] = {"rows": rows.shape[0], "tokens_per_row": rows.shape[1] - 1}
    per_format = {}
    for fmt in KVFormat:
        losses = [nll(model.prefill(row[:-1], model.new_state(fmt)), row[1:]) for row in rows]
        per_format[fmt] = torch.cat(losses)
        out[f"{fmt.value}_loss"] = float(per_format[fmt].mean())
        out[f"{fmt.value}_perplexity"] = math.exp(out[f"{fmt.value}_loss"])
    out["perplexity_delta_pct"] = 100 * (out["records_perplexity"] / out["bf16_perplexity"] - 1)
    return out


# ------------------------------------------------------------------ 2. bounded replay


def decode_side_state(model: CEDModel, encoded: SequenceState) -> SequenceState:
    """What a decode worker holds after the transfer: the prompt's global KV records only (shared
    with `encoded`: states replace tensors, never write into them)."""
    state = model.new_state()
    for layer, kv in encoded.global_kv.items():
        state.global_kv[layer].set_records(kv.main, kv.index_keys)
    state.position = encoded.position
    return state


def replay_perplexity(model: CEDModel, rows: Tensor, prompt_len: int, spans: dict[str, int]) -> list[dict[str, Any]]:
    """Each row: `prompt_len` prompt tokens, the rest scored. Reference: one prefill of the row."""
    exact_logits: list[Tensor] = []
    replayed: dict[str, list[Tensor]] = {name: [] for name in spans}
    targets = []
    for row in rows:
        prompt, cont = row[:prompt_len], row[prompt_len:]
        exact_logits.append(model.prefill(row[:-1], model.new_state())[prompt_len - 1 :])
        targets.append(cont)
        encoded = model.new_state()
        model.encode_chunk(prompt, encoded)  # the prefill worker's pass: encoder + decoder KV source
        for name, span in spans.items():
            state = decode_side_state(model, encoded)
            last = model.replay(prompt[-span:], state)[-1:]
            rest = model.prefill(cont[:-1], state)
            replayed[name].append(torch.cat([last, rest]))
    target = torch.cat(targets)
    exact = torch.cat(exact_logits)
    exact_loss = float(nll(exact, target).mean())
    results = [{"span": "prefill (reference)", "tokens": 0, "loss": exact_loss, "perplexity": math.exp(exact_loss),
                "perplexity_delta_pct": 0.0, "mean_kl": 0.0, "top1_agreement": 1.0}]
    p = torch.log_softmax(exact.double(), dim=-1)
    for name, span in spans.items():
        logits = torch.cat(replayed[name])
        loss = float(nll(logits, target).mean())
        q = torch.log_softmax(logits.double(), dim=-1)
        results.append({"span": name, "tokens": span, "loss": loss, "perplexity": math.exp(loss),
                        "perplexity_delta_pct": 100 * (math.exp(loss - exact_loss) - 1),
                        "mean_kl": float((p.exp() * (p - q)).sum(-1).mean()),
                        "top1_agreement": float((logits.argmax(-1) == exact.argmax(-1)).float().mean())})
    return results


# ------------------------------------------------------------------ 3-4. DSpark and decode speed


def prefilled(model: CEDModel, drafter: Drafter, prompt: Tensor) -> tuple[SequenceState, DraftState, int]:
    """The prompt's state, the drafter's memory of it (as a replaying decode worker builds), the
    greedy first token."""
    state = model.new_state()
    out = model.prefill_with_taps(prompt, state)
    draft = DraftState.new(model.config, prompt.device)
    draft.extend(drafter.context_vectors(out.taps))
    return state, draft, int(out.logits[-1].argmax())


class PerSequenceProposer(DSparkProposer):
    """The drafting path before issue 8, kept as the benchmark's baseline: one draft pass per
    sequence (`Drafter.draft`) and one `context_vectors` call per sequence in `observe`."""

    def propose(self, seqs: Sequence[DecodeSequence]) -> list[Draft | None]:
        out: list[Draft | None] = []
        for seq in seqs:
            state = seq.draft
            if state is None or state.end_position != len(seq.tokens) - 1 or state.vectors.shape[0] == 0:
                out.append(None)
                continue
            d = self.drafter.draft(seq.anchor, state, self.model.embed, self.model.lm_head, seq.params.temperature,
                                   seq.generator)
            out.append(Draft(d.tokens[: self.max_tokens], d.probs[: self.max_tokens], d.confidences[: self.max_tokens]))
        return out


class TimedProposer:
    """Forwards to a proposer and adds up the seconds its calls take (the draft pass, observe).
    `cost_check`: hand the engine's profile on (`attach_profile`), so the inner proposer may decline
    drafting; otherwise it always drafts."""

    def __init__(self, inner: DSparkProposer, device: str, cost_check: bool) -> None:
        self.inner, self.device, self.cost_check = inner, device, cost_check
        self.propose_s = self.observe_s = 0.0

    @property
    def max_tokens(self) -> int:
        return self.inner.max_tokens

    def attach_profile(self, profile: StepProfile, verify_all: bool) -> None:
        if self.cost_check:
            self.inner.attach_profile(profile, verify_all)

    def propose(self, seqs: Sequence[DecodeSequence]) -> list[Draft | None]:
        start = time.perf_counter()
        out = self.inner.propose(seqs)
        _sync(self.device)
        self.propose_s += time.perf_counter() - start
        return out

    def observe(self, seq: DecodeSequence, first_position: int, taps: Tensor, keep_end: int) -> None:
        start = time.perf_counter()
        self.inner.observe(seq, first_position, taps, keep_end)
        _sync(self.device)
        self.observe_s += time.perf_counter() - start

    def observe_many(self, observations: Sequence[Observation]) -> None:
        start = time.perf_counter()
        self.inner.observe_many(observations)
        _sync(self.device)
        self.observe_s += time.perf_counter() - start

    def release(self, seq: DecodeSequence, keep: bool) -> None:
        self.inner.release(seq, keep)


MODES = ("off", "per-sequence", "batched", "batched+cost-check")
"""Decode cells: no DSpark; the per-sequence drafting of before issue 8; one batched draft pass per
step (every draft verified, as the per-sequence cell); the same with the engine's adaptive
verification and the proposer's cost check fed by the engine's `StepProfile` (the serving set-up)."""


@dataclass
class Cell:
    """One mode's engine at one batch size, and what its timed steps measured."""

    mode: str
    engine: DecodeEngine
    timed: TimedProposer | None
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)  # this process's CPU seconds per step
    emitted: int = 0
    start: dict[str, float] = field(default_factory=dict)

    def counters(self) -> dict[str, float]:
        e, t = self.engine, self.timed
        return {"drafted": e.drafted_tokens, "accepted": e.accepted_drafts, "verify_passes": e.verify_passes,
                "propose_s": t.propose_s if t else 0.0, "observe_s": t.observe_s if t else 0.0,
                "declined": t.inner.declined_steps if t else 0}


def new_cell(model: CEDModel, drafter: Drafter, prompts: list[Tensor], mode: str, steps: int, device: str,
             draft_tokens: int, profile: StepProfile | None = None) -> Cell:
    """One mode's engine decoding `prompts`; `profile`: the measured costs of an earlier cell of the
    same mode, as one long-running worker would have them (the batch-1 prompts decoded in turn)."""
    batch = len(prompts)
    block = 64
    dspark = mode != "off"
    longest = max(p.shape[0] for p in prompts) + (steps + 4) * (draft_tokens + 1)
    num_blocks = batch * (longest // block + 2) + 8
    layout = BlockLayout.from_config(model.config, block)
    cache = KVCacheManager(layout, KVCacheConfig(block_size=block, num_blocks=num_blocks), "demo-eval", device)
    adaptive = mode == "batched+cost-check"
    config = DecodeConfig(max_running_requests=batch, dspark=dspark,
                          adaptive_verify=adaptive, draft_tokens=draft_tokens, device=device,
                          kernel_warmup=False)  # an engine per cell; its warm-up rounds compile the kernels
    kind = PerSequenceProposer if mode == "per-sequence" else DSparkProposer
    timed = TimedProposer(kind(drafter, model, draft_tokens), device, cost_check=adaptive) if dspark else None
    engine = DecodeEngine(config, model, cache, proposer=timed)
    if profile is not None:
        engine.profile = profile
        if timed is not None:
            timed.attach_profile(profile, verify_all=not adaptive)
    for i, prompt in enumerate(prompts):
        state, draft, first = prefilled(model, drafter, prompt)
        tokens = prompt.tolist()
        cmd = AttachCommand(0, f"r{i}", f"l{i}", tuple(tokens), first, 100, Sampling(max_tokens=100_000, ignore_eos=True))
        engine.attach_state(f"r{i}", tokens, state, first, cmd, draft=draft)
    return Cell(mode, engine, timed)


def timed_step(cell: Cell, device: str) -> None:
    _sync(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = cell.engine.step()
    _sync(device)
    cell.times.append(time.perf_counter() - start)
    cell.cpu_times.append(time.process_time() - cpu_start)
    cell.emitted += sum(len(o.token_ids) for o in outputs if isinstance(o, Tokens))


def cell_report(group: list[Cell], batch: int) -> dict[str, Any]:
    """One mode's figures over its cells (one per prompt group: at batch 1, one per prompt)."""
    cell = group[0]
    d: dict[str, float] = {}
    for c in group:
        end = c.counters()
        for key in end:
            d[key] = d.get(key, 0.0) + end[key] - c.start[key]
    times = [t for c in group for t in c.times]
    cpu_times = [t for c in group for t in c.cpu_times]
    emitted = sum(c.emitted for c in group)
    steps = len(times)
    step_s = statistics.median(times)
    per_request_step = emitted / (batch * steps)
    verifies = int(d["verify_passes"])
    report = {"batch": batch, "mode": cell.mode, "dspark": cell.timed is not None, "steps": steps,
              "prompts": batch * len(group), "tokens": emitted, "step_ms": 1000 * step_s, "step_ms_min": 1000 * min(times),
              "step_cpu_ms": 1000 * statistics.median(cpu_times),
              "step_ms_each": [round(1000 * t, 1) for t in times],
              "tokens_per_s": batch * per_request_step / step_s, "tokens_per_s_mean": emitted / sum(times),
              "tokens_per_step": per_request_step, "drafted": int(d["drafted"]), "accepted": int(d["accepted"]),
              "verify_passes": verifies, "accepted_per_verify": d["accepted"] / verifies if verifies else 0.0}
    if cell.timed is not None:
        report["draft_ms_per_step"] = 1000 * d["propose_s"] / steps
        report["observe_ms_per_step"] = 1000 * d["observe_s"] / steps
        report["declined_steps"] = int(d["declined"])
    return report


def draft_pass_cost(model: CEDModel, drafter: Drafter, prompt_rows: Tensor, batches: list[int], device: str,
                    repeats: int = 7) -> list[dict[str, Any]]:
    """The draft pass alone, per step of a batch: `Drafter.draft` once per sequence (before issue 8)
    against one `Drafter.draft_batch`, greedy, on the prompts' real drafter memories; the fastest of
    `repeats` (on a shared machine the minimum is the cost, the rest is other jobs)."""
    memories = [(int(p[-1]), prefilled(model, drafter, p)[1]) for p in prompt_rows[: max(batches)]]
    out = []
    for batch in batches:
        chosen = memories[:batch]
        requests = [DraftRequest(anchor, state) for anchor, state in chosen]
        one_by_one = [functools.partial(drafter.draft, anchor, state, model.embed, model.lm_head)
                      for anchor, state in chosen]
        batched = [functools.partial(drafter.draft_batch, requests, model.embed, model.lm_head)]
        row: dict[str, Any] = {"batch": batch}
        for name, calls in (("per_sequence_ms", one_by_one), ("batched_ms", batched)):
            times, cpu_times = [], []
            for _ in range(repeats):
                _sync(device)
                start, cpu_start = time.perf_counter(), time.process_time()
                for call in calls:
                    call()
                _sync(device)
                times.append(time.perf_counter() - start)
                cpu_times.append(time.process_time() - cpu_start)
            row[name] = 1000 * min(times)
            row[name.replace("_ms", "_cpu_ms")] = 1000 * min(cpu_times)
        row["ratio"] = row["per_sequence_ms"] / row["batched_ms"]
        row["cpu_ratio"] = row["per_sequence_cpu_ms"] / row["batched_cpu_ms"]
        out.append(row)
    return out


def decode_speed(model: CEDModel, drafter: Drafter, prompt_rows: Tensor, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every mode at every batch (same prompts). The modes' steps are interleaved (one step of each in
    turn), so a load change on a shared machine hits them alike; each DSpark cell gets its speedup
    over "off" (median step times)."""
    reports = []
    for batch in args.batches:
        steps = args.steps or (48 if batch == 1 else 8)
        # batch 1 decodes `--batch1-prompts` prompts one after another (steps split between them), so
        # its figure is not one prompt's luck; a larger batch decodes its first `batch` prompts at once
        groups = ([prompt_rows[i : i + 1] for i in range(min(args.batch1_prompts, prompt_rows.shape[0]))]
                  if batch == 1 else [prompt_rows[:batch]])
        per_group = max(1, steps // len(groups))
        by_mode: dict[str, list[Cell]] = {mode: [] for mode in args.modes}
        for rows in groups:
            # each mode's engine keeps the cost profile its earlier prompts measured (one worker)
            cells = [new_cell(model, drafter, list(rows), mode, per_group + args.warmup_steps, args.device,
                              args.draft_tokens, by_mode[mode][-1].engine.profile if by_mode[mode] else None)
                     for mode in args.modes]
            # untimed warm-up: the drafter's memory fills from the first pass's taps, and the engine's
            # cost line (verification lengths, the cost check) replaces its prior as a running worker's has
            for _ in range(1 + (args.warmup_steps if rows is groups[0] else 0)):
                for cell in cells:
                    cell.engine.step()
            for cell in cells:
                cell.start = cell.counters()
            for _ in range(per_group):
                for cell in cells:
                    timed_step(cell, args.device)
            for cell in cells:
                by_mode[cell.mode].append(cell)
        plain: dict[str, Any] | None = None
        for group in by_mode.values():
            cell = group[0]
            report = cell_report(group, batch)
            if cell.mode == "off":
                plain = report
            elif plain is not None:
                report["speedup"] = report["tokens_per_s"] / plain["tokens_per_s"]
                report["step_ratio"] = report["step_ms"] / plain["step_ms"]
                # fastest steps: on a shared machine the least disturbed measure of each mode's cost
                report["speedup_at_min_step"] = (report["tokens_per_step"] / report["step_ms_min"]) / (
                    plain["tokens_per_step"] / plain["step_ms_min"])
                # CPU seconds of this process: what a step costs whatever else the machine runs
                report["speedup_cpu_time"] = (report["tokens_per_step"] / report["step_cpu_ms"]) / (
                    plain["tokens_per_step"] / plain["step_cpu_ms"])
            reports.append(report)
            print(f"  batch {batch} {cell.mode}: {report['tokens_per_s']:.1f} tok/s, {report['step_ms']:.1f} ms/step",
                  flush=True)
    return reports


def greedy_sample(model: CEDModel, codec: TextCodec, prompt: str, tokens: int) -> str:
    ids = codec.encode(prompt)
    state = model.new_state()
    logits = model.prefill(ids, state)[-1]
    out: list[int] = []
    for _ in range(tokens):
        out.append(int(logits.argmax()))
        logits = model.prefill([out[-1]], state)[-1]
    return prompt + codec.decode(out)


# ------------------------------------------------------------------ main


def machine(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "torch": torch.__version__, "cpu_count": os.cpu_count(),
                            "load_average_1m_at_start": os.getloadavg()[0]}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, default=None, help="default: the shipped demo checkpoint")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--heldout-every", type=int, default=50)
    p.add_argument("--ppl-rows", type=int, default=64, help="held-out windows for the KV-format perplexity")
    p.add_argument("--ppl-len", type=int, default=512)
    p.add_argument("--replay-rows", type=int, default=32)
    p.add_argument("--replay-prompt", type=int, default=384)
    p.add_argument("--replay-continuation", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens of the decode cells")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="decode cells per batch")
    p.add_argument("--parts", nargs="+", choices=("quality", "speed"), default=["quality", "speed"],
                   help="quality: KV format and replay perplexity; speed: the decode cells")
    p.add_argument("--steps", type=int, default=0, help="timed steps per decode cell (0: 48 at batch 1, 8 beyond)")
    p.add_argument("--warmup-steps", type=int, default=8,
                   help="untimed steps before a batch's first cells are timed (the cost profile's warm-up)")
    p.add_argument("--batch1-prompts", type=int, default=8, help="prompts the batch-1 cells decode in turn")
    p.add_argument("--draft-tokens", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--note", default="")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine(args.device)
    info["torch_threads"] = torch.get_num_threads()
    folder = args.checkpoint or default_checkpoint()
    model = load_model(folder, device=args.device)
    drafter = load_drafter(folder, model.config).to(args.device)
    codec = TextCodec.from_file(folder, model.config.vocab_size)
    corpus = load_corpus(heldout_every=args.heldout_every)
    heldout = token_stream(codec.tokenizer, corpus.heldout).to(args.device)
    print(f"checkpoint {folder}; held-out: {len(corpus.heldout)} files, {heldout.shape[0]:,} tokens ({corpus.root})",
          flush=True)

    ppl: dict[str, Any] = {}
    replay: list[dict[str, Any]] = []
    if "quality" in args.parts:
        ppl = kv_format_perplexity(model, consecutive_rows(heldout, args.ppl_len + 1, args.ppl_rows))
        print(f"KV format ({ppl['rows']} x {ppl['tokens_per_row']} tokens): records ppl "
              f"{ppl['records_perplexity']:.3f}, bf16 ppl {ppl['bf16_perplexity']:.3f}, "
              f"delta {ppl['perplexity_delta_pct']:+.3f}%", flush=True)
        exact = exact_replay_span(model.config)
        spans = {"128": 128, "256": 256, f"exact ({exact})": exact}
        replay_len = args.replay_prompt + args.replay_continuation + 1
        replay = replay_perplexity(model, consecutive_rows(heldout[args.ppl_len * args.ppl_rows :], replay_len,
                                                           args.replay_rows), args.replay_prompt, spans)
        print(f"{'replay span':>20} {'ppl':>8} {'d ppl %':>8} {'mean KL':>10} {'top-1':>6}")
        for r in replay:
            print(f"{r['span']:>20} {r['perplexity']:8.3f} {r['perplexity_delta_pct']:+8.3f} {r['mean_kl']:10.2e} "
                  f"{r['top1_agreement']:6.3f}", flush=True)

    cells: list[dict[str, Any]] = []
    draft_cost: list[dict[str, Any]] = []
    acceptance = 0.0
    if "speed" in args.parts:
        # held-out code spread over its files (no charmap tables): the drafter trainer's replay prompts
        prompt_rows = spread_rows(token_stream(codec.tokenizer, code_files(corpus.heldout)).to(args.device),
                                  args.prompt_len, max(args.batches))
        draft_cost = draft_pass_cost(model, drafter, prompt_rows, args.batches, args.device)
        print(f"{'batch':>5} {'draft pass ms, per sequence':>28} {'batched':>8} {'ratio':>6} {'CPU ms':>7} "
              f"{'batched':>8} {'ratio':>6}")
        for r in draft_cost:
            print(f"{r['batch']:5d} {r['per_sequence_ms']:28.1f} {r['batched_ms']:8.1f} {r['ratio']:6.1f} "
                  f"{r['per_sequence_cpu_ms']:7.1f} {r['batched_cpu_ms']:8.1f} {r['cpu_ratio']:6.1f}", flush=True)
        cells = decode_speed(model, drafter, prompt_rows, args)
        print(f"{'batch':>5} {'mode':>18} {'tok/s':>9} {'step ms':>8} {'draft ms':>8} {'obs ms':>7} "
              f"{'tok/step':>8} {'acc/verify':>10} {'declined':>8} {'speedup':>7} {'at min':>6} {'CPU ms':>7} {'by CPU':>6}")
        for c in cells:
            print(f"{c['batch']:5d} {c['mode']:>18} {c['tokens_per_s']:9.1f} {c['step_ms']:8.1f} "
                  f"{c.get('draft_ms_per_step', 0.0):8.1f} {c.get('observe_ms_per_step', 0.0):7.1f} "
                  f"{c['tokens_per_step']:8.2f} {c['accepted_per_verify']:10.2f} {c.get('declined_steps', 0):8d} "
                  f"{c.get('speedup', 1.0):7.2f} {c.get('speedup_at_min_step', 1.0):6.2f} {c['step_cpu_ms']:7.1f} "
                  f"{c.get('speedup_cpu_time', 1.0):6.2f}", flush=True)
        spec_cells = [c for c in cells if c["dspark"]]
        verifies = sum(c["verify_passes"] for c in spec_cells)
        acceptance = sum(c["accepted"] for c in spec_cells) / verifies if verifies else 0.0
        print(f"DSpark: {acceptance:.2f} accepted drafts per verification of up to {args.draft_tokens} "
              f"({1 + acceptance:.2f} tokens per target pass) over {verifies} verifications", flush=True)
    sample = ""
    if "quality" in args.parts:
        sample = greedy_sample(model, codec, "def fibonacci(", 48)
        print("greedy sample:\n" + sample, flush=True)

    info["load_average_1m_at_end"] = os.getloadavg()[0]
    report = {"benchmark": "demo_eval", "date": started, "machine": info, "device": args.device,
              "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "checkpoint": str(folder),
              "heldout": {"root": str(corpus.root), "files": len(corpus.heldout), "tokens": int(heldout.shape[0])},
              "note": args.note, "kv_format": ppl, "replay": replay, "decode": cells,
              "draft_pass": draft_cost,
              "dspark_accepted_per_verify": acceptance, "draft_tokens": args.draft_tokens,
              "greedy_sample": sample, "seconds": round(time.perf_counter() - t0, 1)}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
