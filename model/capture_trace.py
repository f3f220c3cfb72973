"""Whether a step can be captured as a CUDA graph and replayed with other inputs, checked on any device.

A CUDA graph records kernels with their arguments as they were at capture: the tensors' addresses,
every Python number, every shape. A replay is right only if the step, run with other inputs staged
in the same buffers, would have launched the same kernels with the same arguments. A step that reads
a value on the host (`.item()`, `.tolist()`, a shape taken from data), builds a tensor from host data
or addresses a tensor made outside the step's static buffers breaks that silently: the replay
computes the capture's step.

`trace(fn)` runs `fn()` under a dispatch mode and records every ATen operation and every Triton
kernel launch with its arguments:
tensors by where they live (a buffer that existed before the step, by address; one the step made,
by the order it was made in) with their shapes, strides and dtypes, other arguments by value.
Host data turned into a tensor (`torch.tensor(...)`, `x[:, 0] = 1.0`) is recorded by value: a
graph replays the values it was captured with, right only where they are the same every step.
`compare(a, b)` finds the first difference between two traces of the same bucket. The model runner's
tests trace the eager step twice with different staged inputs (tests/kernels/test_capture_trace.py);
on a GPU the same test runs on the CUDA branches as they run there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

HOST_READS = frozenset({"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default",
                        "aten.equal.default", "aten.nonzero.default", "aten.masked_select.default",
                        "aten.unique_consecutive.default", "aten._unique2.default", "aten.unique_dim.default"})
"""Operations that read device values on the host or size their output by data: none may run in a
captured step."""


@dataclass(frozen=True)
class Op:
    """One recorded operation: its name and its arguments as described by `_Recorder.describe`."""

    name: str
    args: Any

    def __str__(self) -> str:
        return f"{self.name}{self.args}"


@dataclass
class Trace:
    ops: list[Op] = field(default_factory=list)

    @property
    def host_reads(self) -> list[Op]:
        return [op for op in self.ops if op.name in HOST_READS]


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, trace: Trace) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.trace = trace
        self.made: dict[int, int] = {}  # storage address -> order of the op output that owns it

    def describe(self, x: Any) -> Any:
        if isinstance(x, torch.UntypedStorage | torch.TypedStorage):
            address = x.data_ptr()
            return ("made", self.made[address]) if address in self.made else ("storage", address)
        if not isinstance(x, Tensor):
            if isinstance(x, float) and x != x:  # NaN compares unequal to itself
                return "nan"
            if isinstance(x, torch.ScriptObject):  # a collective's process group: no `==`
                return ("object", str(x._type().qualified_name()))
            return x
        address = x.untyped_storage().data_ptr()
        if address == 0:  # no storage yet (an empty tensor)
            where: tuple[str, int] = ("empty", 0)
        elif address in self.made:
            where = ("made", self.made[address])
        else:
            where = ("buffer", address)
        return (*where, tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.device.type)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.lift_fresh.default:  # a tensor from host data: the capture keeps its values
            described: Any = ("host data", args[0].dtype, args[0].tolist())
        else:
            described = tree_map(self.describe, (args, kwargs))
        self.trace.ops.append(Op(str(func), described))
        out = func(*args, **kwargs)
        if func is torch.ops.aten.lift_fresh.default:  # its input was made outside any operation
            self.made[out.untyped_storage().data_ptr()] = len(self.trace.ops) - 1
            return out
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                address = t.untyped_storage().data_ptr()
                if address and address not in inputs:  # a new allocation (views and in-place keep theirs)
                    self.made[address] = len(self.trace.ops) - 1
        return out


    def launch(self, kernel: Any, args: Any, kwargs: Any, grid: Any) -> None:
        name = getattr(getattr(kernel, "fn", None), "__name__", type(kernel).__name__)
        grid = grid if isinstance(grid, tuple) else "a function of the arguments"
        self.trace.ops.append(Op(f"triton.{name}", tree_map(self.describe, (args, kwargs, grid))))


@contextlib.contextmanager
def _triton_launches(recorder: _Recorder) -> Iterator[None]:
    """Record each Triton kernel launch as one operation (its arguments described as an ATen op's)
    and run it outside the dispatch mode (the CPU interpreter's own copies are not the step's)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield
        return
    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def recording(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            if not warmup:
                recorder.launch(self, args, kwargs, grid)
            with _disable_current_modes():
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        return run

    try:
        for cls, original in originals.items():
            cls.run = recording(original)
        yield
    finally:
        for cls, original in originals.items():
            cls.run = original


def trace(fn: Callable[[], Any]) -> tuple[Trace, Any]:
    """Run `fn()` recording its operations and Triton launches; returns the trace and what `fn`
    returned."""
    recorded = Trace()
    recorder = _Recorder(recorded)
    with _triton_launches(recorder), recorder:
        result = fn()
    return recorded, result


def compare(a: Trace, b: Trace) -> str | None:
    """None when the two traces would be the same graph; else where they first differ."""
    for i, (x, y) in enumerate(zip(a.ops, b.ops)):
        if x != y:
            return f"op {i} differs:\n  first:  {x}\n  second: {y}"
    if len(a.ops) != len(b.ops):
        return f"{len(a.ops)} ops, then {len(b.ops)}"
    return None
