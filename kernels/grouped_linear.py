"""A grouped linear layer at decode row counts: `wo_a`'s block-diagonal projection in one
or two launches.

Attention's `wo_a` projects each group of heads on its own: from `x [N, G, K]` and the checkpoint's
`weight [G * R, K]` (group g's rows are `[g * R, (g + 1) * R)`),

    out[n, g * R + r] = sum_k x[n, g, k] * weight[g * R + r, k]          -> [N, G * R]

which :func:`grouped_linear_reference` computes as one `torch.bmm` (the model's `GroupedOutput`).
On an H100 that `bmm` in float32 took 34-36 us a call at 2 to 192 rows against 2.9 us at one row
(cuBLAS picks a 32x32 tile kernel there; `benchmarks/batched_gemm.py`, docs/benchmarks/
gpu-2026-12-06e): 1.4 ms of a 40-layer verify step. :func:`grouped_linear` is one Triton launch, two with K splits
(`_grouped_linear_kernels.py`) whose grid spreads the weight's rows over the GPU, each program
reading its block of weights once for up to `MAX_BLOCK_M` rows, with the group's `K` split across
programs until every SM has one (float32 partials, added in split order by a second launch: without
the splits `wo_a` had 16 programs and took 22-45 us a call on an H100). Float32 products are full
float32 (not TF32); results agree with the `bmm` to float32 rounding of a sum in another order.

The same kernel as one group is :func:`linear`'s float32 product at 2 to `ROW_LINEAR_MAX_ROWS` rows on
CUDA: cuBLAS's float32 GEMM picks a ~52 us kernel at 8 and 16 rows for `[128, 128]` weights (the demo
checkpoint's `wa`, `wo_b` and compressor), against 5.9 us at 6 rows and 2.6 us (a GEMV) at one; the
kernel takes 5.3-7.5 us at 2-32 rows for every projection of the demo's step (an H100,
`benchmarks/batched_gemm.py --preset demo`, docs/benchmarks/gpu-2026-12-07d). A DSpark verify pass
(1 + 5 rows, bucket 8) spent 1.3 ms of its 2.4 ms in those GEMMs (25 a step). :func:`linear` calls it
through the custom op `cedserve::row_linear`, which `torch.compile` keeps as one opaque call.

Implementations (`impl`): "triton" (CUDA tensors, or CPU under `TRITON_INTERPRET=1`), "torch"
(:func:`grouped_linear_reference`) or "auto" (the kernel where it can run and `MIN_ROWS <= N <=
MAX_ROWS`; the `bmm` at one row, where cuBLAS's GEMV was fast, above 256 rows, since prefill chunks
of thousands of rows are cuBLAS's strength, and where autograd records, since the kernel has no
backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from cedserve.kernels.triton_support import (
    Impl,
    cdiv,
    check_tensor,
    interpreting,
    next_power_of_2,
    num_sms,
    pdl_launch,
    resolve_impl,
)

MIN_ROWS = 2
"""Fewest rows "auto" sends to the kernel: at one row cuBLAS runs the `bmm` as a GEMV at 2.9 us (H100),
which the kernel is not known to beat; from 2 rows on it took ~35 us."""

MAX_ROWS = 256
"""Most rows "auto" sends to the kernel (decode buckets, verify rows); more go to the `bmm`."""

ROW_LINEAR_MAX_ROWS = 32
"""Most rows :func:`linear` sends to the kernel (float32, CUDA); more, and one row, go to cuBLAS."""

MAX_BLOCK_M = 64
"""Most rows a program holds (`[BLOCK_M, BLOCK_R]` float32 accumulators in registers)."""

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_linear_reference(x: Tensor, weight: Tensor) -> Tensor:
    """`x [N, G, K]`, `weight [G * R, K]` -> `[N, G * R]` by `torch.bmm` (the module docstring's sum)."""
    groups = x.shape[1]
    w = weight.view(groups, -1, x.shape[-1]).transpose(1, 2)  # [G, K, R]
    return torch.bmm(x.transpose(0, 1), w).transpose(0, 1).flatten(1)


def grouped_linear(x: Tensor, weight: Tensor, impl: Impl = "auto", *, splits: int | None = None) -> Tensor:
    """`out [N, G * R]` in `x`'s dtype (module docstring) from `x [N, G, K]` and `weight [G * R, K]`
    of the same dtype (float32, bf16 or fp16), both with a unit stride in K. `splits`: how many
    programs share a column block's `K` (None: enough to give every SM a program; see `_blocks`)."""
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[-1] != x.shape[-1] or weight.shape[0] % x.shape[1]:
        raise ValueError(f"grouped_linear: expected x [N, G, K] and weight [G * R, K], got {list(x.shape)} "
                         f"and {list(weight.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"grouped_linear: x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    if splits is not None and splits < 1:
        raise ValueError(f"grouped_linear: splits must be positive, got {splits}")
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)  # the kernel has no backward
    if impl == "auto" and (not MIN_ROWS <= x.shape[0] <= MAX_ROWS or needs_grad):
        impl = "torch"
    if resolve_impl(impl, "grouped_linear", x, weight) == "torch":
        return grouped_linear_reference(x, weight)
    check_tensor(x, "grouped_linear: x", dtypes=_DTYPES, dim=3)
    check_tensor(weight, "grouped_linear: weight", dtypes=_DTYPES, dim=2)
    rows, groups, k = x.shape
    r = weight.shape[0] // groups
    out = torch.empty(rows, groups * r, dtype=x.dtype, device=x.device)
    if rows == 0 or out.numel() == 0:
        return out
    from cedserve.kernels._grouped_linear_kernels import _grouped_linear_kernel, _sum_splits_kernel

    block_m, block_r, block_k, k_split = _blocks(rows, groups, r, k, x.device, splits)
    n_splits = cdiv(k, k_split)
    # several splits: float32 partial sums per split, added in split order by a second launch
    target = out if n_splits == 1 else torch.empty(n_splits, rows, groups * r, dtype=torch.float32, device=x.device)
    _grouped_linear_kernel[(groups * cdiv(r, block_r), cdiv(rows, block_m), n_splits)](
        x, x.stride(0), x.stride(1),
        weight, weight.stride(0),
        target, target.stride(0) if n_splits > 1 else 0, groups * r,
        rows, k, r, k_split,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        IEEE=x.dtype == torch.float32, DOT_F32=interpreting(),
        num_warps=4, **pdl_launch(x.device),
    )
    if n_splits > 1:
        block = 4096 if interpreting() else 1024
        _sum_splits_kernel[(cdiv(out.numel(), block),)](target, target.stride(0), out, out.numel(),
                                                         SPLITS=n_splits, BLOCK=block, num_warps=4, **pdl_launch(target.device),)
    return out


def _blocks(rows: int, groups: int, r: int, k: int, device: torch.device,
            splits: int | None = None) -> tuple[int, int, int, int]:
    """`(BLOCK_M, BLOCK_R, BLOCK_K, K_SPLIT)`: all rows in one row block up to `MAX_BLOCK_M` (16 at
    least: `tl.dot`'s smallest tile), column blocks of 32, and the group's `K` cut into splits of
    `K_SPLIT` (a multiple of `BLOCK_K`) until every SM has a program. Without the splits mini-40's
    `wo_a` (2 groups of 128 columns) was 16 programs each walking K = 1,024 in 16 steps: 22 us at 6
    rows and 40 us at 32 on an H100 (gpu-2026-12-07)."""
    block_m = min(max(next_power_of_2(rows), 16), MAX_BLOCK_M)
    if interpreting():  # the interpreter pays per program: few, large ones
        block_r, block_k = min(max(next_power_of_2(r), 16), 128), min(max(next_power_of_2(k), 16), 512)
        wanted = splits or 1
    else:
        block_r, block_k = 32, 64
        programs = groups * cdiv(r, block_r) * cdiv(rows, block_m)
        wanted = splits or max(1, num_sms(device) // programs)
    k_blocks = cdiv(k, block_k)
    k_split = cdiv(k_blocks, min(wanted, k_blocks)) * block_k
    return block_m, block_r, block_k, k_split


@torch.library.custom_op("cedserve::row_linear", mutates_args=())
def row_linear(x: Tensor, weight: Tensor) -> Tensor:
    """`x [N, K] @ weight [R, K]^T` -> `[N, R]` by the grouped kernel as one group (`impl` "triton"):
    an opaque call to `torch.compile`, so a compiled function can hold it."""
    return grouped_linear(x.unsqueeze(1), weight, "triton")


@row_linear.register_fake
def _row_linear_fake(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """`F.linear(x, weight)` (no bias) for `x [N, K]`; a float32 product of `MIN_ROWS` to
    `ROW_LINEAR_MAX_ROWS` rows on CUDA runs the grouped kernel as one group (`row_linear`; module
    docstring: cuBLAS's pick there took ~52 us at some row counts). Full float32 products either way;
    the two sum in different orders (agree to float32 rounding)."""
    if (x.dim() == 2 and x.is_cuda and x.dtype == torch.float32 and weight.dtype == torch.float32
            and MIN_ROWS <= x.shape[0] <= ROW_LINEAR_MAX_ROWS
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        out: Tensor = torch.ops.cedserve.row_linear(x if x.stride(-1) == 1 else x.contiguous(),
                                                    weight if weight.stride(-1) == 1 else weight.contiguous())
        return out
    return F.linear(x, weight)
