"""Kernel launches Inductor generates for each `FusedOps` function of the slot step, per call and per step.

Runs one decode step of a preset's `SlotStep` (random weights, fused ops as written) and records the
arguments of the first call of each fused function at each distinct argument signature (shapes,
dtypes, constants: e.g. `project` at a main-RoPE and at a compress-RoPE layer). Each recorded call is
then compiled alone (`torch.compile(fullgraph=True)`, as `FusedOps(compiled=True)`) and the
generated wrapper's `call` is read: every generated kernel (`triton_*.run` on CUDA, `cpp_fused_*` on
a CPU), every extern kernel (`extern_kernels.mm`, `bmm`, ...: cuBLAS, each its own launch, plus any
split-K reduce cuBLAS adds, which this cannot see), every aten fallback (`torch.ops.aten.topk`, ...:
one or more launches) and every `copy_` back into a mutated input counts one launch.

On a CPU the count is a proxy for CUDA's: Inductor's C++ backend fuses differently from its Triton
one (and a C++ kernel may hold loops a GPU would launch separately). Run it on the GPU for the real
graph (`benchmarks/step.py` counts the kernels of each part of the captured step with the profiler).

    python benchmarks/fused_launches.py                       # mini-40, 4 rows, CPU or CUDA
    python benchmarks/fused_launches.py --preset tiny --rows 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._inductor.utils import run_and_get_code

from cedserve.model import presets
from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model
from cedserve.model.fused import FusedOps, compiled_form
from cedserve.model.slot_step import SlotStep
from cedserve.model.slots import SlotPools, SlotShape
from cedserve.model.tokenizer import tiny_tokenizer_path

_GENERATED = re.compile(r"^\s*(?:cpp_fused_\w+\(|triton_\w+\.run\()", re.MULTILINE)
_EXTERN = re.compile(r"^\s*(?:\w+ = )?extern_kernels\.(\w+)\(", re.MULTILINE)
_FALLBACK = re.compile(r"^\s*\w+ = torch\.ops\.(?:aten|prims)\.(\w+)\.\w+\(", re.MULTILINE)
_COPY_BACK = re.compile(r"^\s*\w+\.copy_\(", re.MULTILINE)


@dataclass
class Recorded:
    """One fused function at one argument signature: its first arguments and how often a step calls it."""

    name: str
    args: tuple[Any, ...]
    calls: int = 0


@dataclass
class Launches:
    generated: int = 0
    extern: list[str] = field(default_factory=list)
    fallback: list[str] = field(default_factory=list)
    copy_back: int = 0

    @property
    def total(self) -> int:
        return self.generated + len(self.extern) + len(self.fallback) + self.copy_back


def _signature(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)


class Recorder:
    """A `FusedOps` stand-in that runs each function as written and records its calls."""

    def __init__(self) -> None:
        self.plain = FusedOps(compiled=False)
        self.calls: dict[tuple[str, tuple[Any, ...]], Recorded] = {}

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.plain, name)

        def record(*args: Any) -> Any:
            key = (name, _signature(args))
            if key not in self.calls:
                self.calls[key] = Recorded(name, tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
            self.calls[key].calls += 1
            return fn(*args)

        return record


def _call_body(code: str) -> str:
    """The generated module's `call` function (where the launches are)."""
    start = code.find("def call(")
    if start < 0:
        return ""
    end = code.find("\ndef ", start + 1)
    runner = code.find("\nclass Runner", start + 1)
    ends = [e for e in (end, runner) if e > 0]
    return code[start:min(ends)] if ends else code[start:]


def count_launches(name: str, args: tuple[Any, ...]) -> Launches:
    fn = getattr(FusedOps(compiled=False), name)
    fn = compiled_form(fn)  # the routing as compiled: rounds of argmax
    torch._dynamo.reset()
    _, codes = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    out = Launches()
    for code in codes:
        body = _call_body(code)
        out.generated += len(_GENERATED.findall(body))
        out.extern += _EXTERN.findall(body)
        out.fallback += _FALLBACK.findall(body)
        out.copy_back += len(_COPY_BACK.findall(body))
    return out


def record_step(preset: str, rows: int, context: int, device: str) -> tuple[SlotStep, Recorder]:
    config = fit_config_to_tokenizer(presets.preset(preset), tiny_tokenizer_path())
    model, _ = random_model(config, tiny_tokenizer_path(), seed=0)
    model = model.to(device)
    pools = SlotPools(model.config, SlotShape(max_slots=rows, max_context=context), torch.device(device))
    step = SlotStep(model, pools, fused=False)
    recorder = Recorder()
    step.ops = recorder  # type: ignore[assignment]
    pools.position[:rows] = torch.arange(rows, device=device) * 7 + context // 2  # ratio-2 groups mid and end
    slots = torch.arange(rows, device=device)
    step.forward(torch.arange(3, 3 + rows, device=device), slots, torch.zeros_like(slots))
    return step, recorder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="mini-40")
    parser.add_argument("--rows", type=int, default=4, help="rows of the step (its batch bucket)")
    parser.add_argument("--context", type=int, default=256, help="slot capacity in tokens")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="also write the table as JSON to this path")
    args = parser.parse_args(argv)
    torch._dynamo.config.recompile_limit = 64
    _, recorder = record_step(args.preset, args.rows, args.context, args.device)
    rows_out: list[dict[str, Any]] = []
    for rec in recorder.calls.values():
        launches = count_launches(rec.name, rec.args)
        rows_out.append({"function": rec.name, "calls_per_step": rec.calls, "launches_per_call": launches.total,
                         "launches_per_step": launches.total * rec.calls, "generated": launches.generated,
                         "extern": launches.extern, "fallback": launches.fallback, "copy_back": launches.copy_back})
    print(f"{args.preset}, {args.rows} rows, {args.device} (Inductor's generated code; a CPU is a proxy for CUDA)")
    print(f"{'function':<18} {'calls':>5} {'per call':>8} {'per step':>8}  generated  extern / fallback")
    for r in rows_out:
        print(f"{r['function']:<18} {r['calls_per_step']:>5} {r['launches_per_call']:>8} {r['launches_per_step']:>8}"
              f"  {r['generated']:>9}  {', '.join(r['extern'] + r['fallback']) or '-'}")
    total = sum(r["launches_per_step"] for r in rows_out)
    print(f"{'total':<18} {'':>5} {'':>8} {total:>8}")
    result = {"preset": args.preset, "rows": args.rows, "device": args.device, "torch": torch.__version__,
              "functions": rows_out, "launches_per_step": total}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
