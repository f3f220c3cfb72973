"""Host overhead of one decode pass: torch ops per pass, per layer and per sequence, host syncs, and
where the time goes (`CEDModel.forward_batch` over B sequences of different lengths, one decode token
each, or a verify-shaped chunk with `--rows`).

On a GPU every torch op is at least one kernel launch (~5-10 us of host time each), so for small models
the op count of a pass, not the FLOPs, sets its time; it is a hardware-independent proxy that a CPU run
measures exactly. Host syncs are ops that make the host wait for the device (`.item()`, `int(t)`,
`bool(t)`, `.tolist()`, `nonzero`, `unique`, masked selection): each drains the GPU's queue.

Counted with a `TorchDispatchMode` (every op after autograd, i.e. what reaches a backend), attributed to
the attention, the MoE (routing + experts, through `local_moe`), or the rest (Engram, mHC, norms, embed,
logits). By default mHC's tail (sigmoids + Sinkhorn) counts as the one fused-kernel launch a CUDA
pass makes (`--mhc kernel`; the torch reference computes it, uncounted); `--mhc torch` counts the
torch ops of the CPU path. Timed passes always run the CPU path. `ops_per_layer_per_seq` = (ops at batch B - ops at batch 1) / ((B - 1) x layers): the part that
grows with the batch. Wall time is the median of `--repeats` passes on this machine (each pass from the
same states: they are restored after it).

    python benchmarks/decode_profile.py --model demo --batches 1 8 32
    python benchmarks/decode_profile.py --model mini-40 --batches 1 32 --context 160 \\
        --out docs/benchmarks/decode-profile-cpu.json
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
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from cedserve.kernels.mhc import hc_mix_tail_reference
from cedserve.model import mhc
from cedserve.model.attention import Attention
from cedserve.model.checkpoint import load_model
from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model
from cedserve.model.moe import MoE
from cedserve.model.network import BatchItem, CEDModel
from cedserve.model.presets import preset
from cedserve.model.state import SequenceState
from cedserve.model.tokenizer import tiny_tokenizer_path

DEMO_CHECKPOINT = Path(__file__).resolve().parent.parent / "cedserve" / "assets" / "demo"
SYNC_OPS = ("_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select",
            "repeat_interleave")
"""Ops that copy a value to the host (or size an output by data) and so wait for the device."""


class OpCounter(TorchDispatchMode):
    """Counts every dispatched op by name and by the section (module kind) it ran in."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter[str] = Counter()
        self.by_section: Counter[str] = Counter()
        self.launches: Counter[str] = Counter()  # ops that compute (not views): a kernel each on a GPU
        self.section = ["other"]
        self.paused = False  # inside a stand-in for a fused kernel: its ops are not counted

    def kernel(self, name: str) -> None:
        """Count one fused (Triton) launch, which does not dispatch through torch."""
        self.by_name[name] += 1
        self.by_section[self.section[-1]] += 1
        self.launches[self.section[-1]] += 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.paused:
            return func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.by_name[name] += 1
        self.by_section[self.section[-1]] += 1
        if not func.is_view:
            self.launches[self.section[-1]] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def sections(counter: OpCounter) -> Iterator[None]:
    """Attribute ops run inside attention (`forward`, `forward_batch`) and MoE (`forward`) to those
    sections, by wrapping the classes' methods for the duration."""
    wrapped = []
    for cls, kind in ((Attention, "attention"), (MoE, "moe")):
        for name in ("forward", "forward_batch"):
            original = cls.__dict__.get(name)
            if original is None:
                continue

            def inside(self: nn.Module, *args: Any, _original: Any = original, _kind: str = kind, **kwargs: Any) -> Any:
                counter.section.append(_kind)
                try:
                    return _original(self, *args, **kwargs)
                finally:
                    counter.section.pop()

            setattr(cls, name, inside)
            wrapped.append((cls, name, original))
    try:
        yield
    finally:
        for cls, name, original in wrapped:
            setattr(cls, name, original)


@contextmanager
def fused_mhc(counter: OpCounter) -> Iterator[None]:
    """Count `hc_mixes`' tail as a GPU pass runs it: its three output allocations and one launch of
    the fused kernel (`cedserve.kernels.mhc`), computed here by the uncounted torch reference."""
    original = mhc.hc_mix_tail

    def stand_in(mixes: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        for _ in range(3):
            mixes.new_empty(0)
        counter.kernel("triton:_hc_mix_tail_kernel")
        counter.paused = True
        try:
            return hc_mix_tail_reference(mixes, *args)
        finally:
            counter.paused = False

    mhc.hc_mix_tail = stand_in  # type: ignore[assignment]
    try:
        yield
    finally:
        mhc.hc_mix_tail = original


@contextmanager
def count_tolist(counts: Counter[str]) -> Iterator[None]:
    """`Tensor.tolist` copies to the host without dispatching an op: count its calls directly."""
    original = torch.Tensor.tolist

    def counted(self: torch.Tensor) -> Any:
        counts["tolist"] += 1
        return original(self)

    torch.Tensor.tolist = counted  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]


def build(name: str, seed: int) -> CEDModel:
    if name == "demo":
        return load_model(DEMO_CHECKPOINT)
    config = fit_config_to_tokenizer(preset(name), tiny_tokenizer_path())
    model, _ = random_model(config, tiny_tokenizer_path(), seed)
    return model


def prefilled_states(model: CEDModel, lengths: list[int], seed: int, chunk: int) -> list[SequenceState]:
    """One random prompt, prefilled in chunks; a copy of its state at each length (in `lengths` order)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, min(model.config.vocab_size, 512), (max(lengths),), generator=gen).tolist()
    state, at, copies = model.new_state(), 0, {}
    for end in sorted(set(lengths)):
        while at < end:
            step = min(chunk, end - at)
            model.prefill(tokens[at:at + step], state)
            at += step
        copies[end] = copy.deepcopy(state)
    return [copy.deepcopy(copies[n]) for n in lengths]


def measure(model: CEDModel, states: list[SequenceState], rows: int, repeats: int, mhc_kernel: bool) -> dict[str, Any]:
    """Op counts of one pass, and its median wall time, from the same states every time."""
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(4, min(model.config.vocab_size, 512), (rows,), generator=gen).tolist() for _ in states]
    snaps = [s.snapshot() for s in states]

    def one_pass() -> None:
        model.forward_batch([BatchItem(t, s, snapshot=rows > 1) for t, s in zip(tokens, states)])
        for s, snap in zip(states, snaps):
            s.restore(snap)

    one_pass()  # warm-up
    counter, extra = OpCounter(), Counter[str]()
    with sections(counter), count_tolist(extra), fused_mhc(counter) if mhc_kernel else nullcontext(), counter:
        one_pass()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
    syncs = {name: counter.by_name[name] for name in SYNC_OPS if counter.by_name[name]}
    syncs.update(extra)
    return {"ops": sum(counter.by_name.values()), "ops_by_section": dict(counter.by_section),
            "compute_ops": sum(counter.launches.values()), "compute_ops_by_section": dict(counter.launches),
            "syncs": syncs, "num_syncs": sum(syncs.values()), "pass_ms": 1000 * statistics.median(times),
            "top_ops": dict(counter.by_name.most_common(12))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo", help="demo (the shipped checkpoint) or a preset: mini-40, tiny")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=96, help="sequence b holds context + 5 b tokens")
    p.add_argument("--rows", type=int, default=1, help="tokens per sequence in the pass (1: decode; 6: verify K=5)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mhc", choices=("kernel", "torch"), default="kernel",
                   help="count mHC's tail as the fused kernel (one launch, what a CUDA pass runs) or as the "
                        "torch ops a CPU pass runs")
    p.add_argument("--label", default="", help="recorded with the results (e.g. the commit)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    model = build(args.model, args.seed)
    layers = model.config.num_hidden_layers
    states = prefilled_states(model, [args.context + 5 * b for b in range(max(args.batches))], args.seed, 512)
    results: list[dict[str, Any]] = []
    for batch in args.batches:
        row = {"batch": batch, "rows": args.rows, **measure(model, states[:batch], args.rows, args.repeats, args.mhc == "kernel")}
        results.append(row)
        print(f"{args.model} batch {batch:>3} rows {args.rows}: {row['ops']:>7} ops ({row['compute_ops']} computing) "
              f"{row['num_syncs']:>5} syncs  {row['pass_ms']:8.1f} ms  computing ops by section "
              f"{row['compute_ops_by_section']}", flush=True)
    base = results[0]
    for row in results[1:]:
        grown = (row["batch"] - base["batch"]) * layers
        row["ops_per_layer_per_seq"] = (row["ops"] - base["ops"]) / grown
        row["compute_ops_per_layer_per_seq"] = (row["compute_ops"] - base["compute_ops"]) / grown
        row["syncs_per_layer_per_seq"] = (row["num_syncs"] - base["num_syncs"]) / grown
        print(f"  batch {row['batch']}: {row['ops_per_layer_per_seq']:.1f} ops "
              f"({row['compute_ops_per_layer_per_seq']:.1f} computing) and "
              f"{row['syncs_per_layer_per_seq']:.2f} syncs per layer per extra sequence")
    report = {"benchmark": "decode_profile", "date": started, "label": args.label,
              "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
              "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                          "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                          "load_average_1m": os.getloadavg()[0]},
              "model": args.model, "mhc": args.mhc, "layers": layers, "context": args.context, "results": results}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
