"""When the Triton kernels run, and how they are launched on CPU.

Every op in `cedserve.kernels` has three layers: a private `@triton.jit` kernel (in a
`_<op>_kernels.py` module that imports triton), a typed launcher that checks shapes, dtypes and
strides, and a torch reference beside the launcher. Importing an op module never imports triton:
the kernel module is loaded on the first launch, so the torch references work on machines without
triton.

`TRITON_INTERPRET=1` runs the kernels on CPU tensors through Triton's interpreter (tests do this
when there is no GPU; it must be set before triton is imported). Two interpreter gaps shape the
kernels: its `tl.dot` mishandles bfloat16 operands (it multiplies their raw uint16 bits), so
kernels take a `DOT_F32` constexpr that upcasts dot operands to float32 there (exact: bf16
products are exact in fp32); and its float8 casts do not round like the GPU, so quantizers round
by hand.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Literal

import torch
from torch import Tensor

Impl = Literal["auto", "triton", "torch"]
"""Which layer an op runs: "triton" (the kernel), "torch" (the reference) or "auto" (the kernel
where it can run: CUDA tensors, or CPU tensors under `TRITON_INTERPRET=1`; the reference
elsewhere)."""


@functools.cache
def triton_available() -> bool:
    """Whether the `triton` package can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def gluon_hopper_available() -> bool:
    """Whether this Triton has Gluon's Hopper API (warpgroup MMAs, async copies), which the Gluon
    kernels are written in; the Triton kernels run without it. A fact of the installed Triton."""
    try:
        importlib.import_module("triton.experimental.gluon.language.nvidia.hopper")
        importlib.import_module("triton.experimental.gluon.language.nvidia.ampere")
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_triton(op: str) -> None:
    """`ImportError` naming the extra to install when triton is missing."""
    if not triton_available():
        raise ImportError(f"{op}: the Triton kernel needs the `triton` package "
                          "(pip install 'cedserve[kernels]'); pass impl='torch' for the reference")


def can_launch(*tensors: Tensor) -> bool:
    """Whether a kernel can run on these tensors: all on one CUDA device, or all on CPU while
    interpreting, and triton importable."""
    if not triton_available():
        return False
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return False
    device = next(iter(devices))
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def resolve_impl(impl: Impl, op: str, *tensors: Tensor) -> Literal["triton", "torch"]:
    """Turn `impl` into the layer to run; `ValueError` when "triton" cannot run on `tensors`."""
    if impl == "torch":
        return "torch"
    if impl == "auto":
        return "triton" if can_launch(*tensors) else "torch"
    if impl != "triton":
        raise ValueError(f"{op}: impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    require_triton(op)
    if not can_launch(*tensors):
        raise ValueError(f"{op}: the Triton kernel needs all tensors on one CUDA device "
                         "(or on CPU with TRITON_INTERPRET=1)")
    return "triton"


def hardware_fp8(device: torch.device) -> bool:
    """Whether kernels may round to E4M3 with the GPU's conversion instruction (sm89+, not in the
    interpreter, whose float8 casts round differently); otherwise they round by hand. Both give
    the reference's bytes (the GPU tests check the hardware path, the CPU tests the other)."""
    if device.type != "cuda" or interpreting():
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    """Compute capability of CUDA device `index` (asked once per process: launchers run per step)."""
    return torch.cuda.get_device_capability(index)


PDL_ENV = "CEDSERVE_PDL"
"""`CEDSERVE_PDL=1`: the project's Triton kernels launch with programmatic dependent launch on
sm90+ (`pdl_launch`); read at each launch, so a graph keeps what was set when it was captured."""

_PDL_ON = {"PDL": True, "launch_pdl": True}


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """Launch options for programmatic dependent launch (PDL), `{}` when off. With them a kernel may
    be launched while the kernel before it in the stream still runs (the launch gap, ~1 us a kernel
    inside a CUDA graph, overlaps its predecessor's tail): every kernel taking them starts with
    `gdc_wait` (it reads nothing before its predecessors have finished and their writes are
    visible) and then lets its own successor launch (`gdc_launch_dependents`). The results are the
    same bits either way; off unless `CEDSERVE_PDL=1` (on sm90+, CUDA, not interpreting), and for a
    launch that `torch.compile` traces into its graph (Inductor then launches the kernel itself)."""
    if device.type != "cuda" or os.environ.get(PDL_ENV, "0") != "1" or interpreting():
        return {}
    if torch.compiler.is_compiling():  # a launch traced into a compiled graph: Inductor launches it, as it does its own
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _PDL_ON if _capability(index) >= (9, 0) else {}


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(n - 1, 0).bit_length()


def log2_if_power_of_2(n: int) -> int:
    """log2(n) when n is a power of two, else -1 (Gluon kernels then divide instead of shifting)."""
    return n.bit_length() - 1 if n > 0 and n & (n - 1) == 0 else -1


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints (`triton.cdiv` without importing triton)."""
    return -(-a // b)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a nominal 1 on CPU)."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def check_tensor(t: Tensor, what: str, *, dtypes: tuple[torch.dtype, ...], dim: int,
                 last_contiguous: bool = True) -> None:
    """`TypeError`/`ValueError` unless `t` has one of `dtypes`, `dim` dimensions and (optionally)
    a unit stride in its last dimension."""
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{what}: dtype must be one of ({names}), got {t.dtype}")
    if t.dim() != dim:
        raise ValueError(f"{what}: expected {dim} dimensions, got shape {list(t.shape)}")
    if last_contiguous and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{what}: the last dimension must be contiguous (stride 1), got strides {t.stride()}")
