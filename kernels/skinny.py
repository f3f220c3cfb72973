"""Matmuls with a handful of rows: a DSpark verify pass (1 + drafts rows at batch 1) in float32.

A decode step at one row per request multiplies by every weight with cuBLAS's GEMV; at 2-16 rows,
float32, cuBLAS picks tiled GEMMs (32 x 32 FFMA tiles, split-K reductions) that read the same bytes
several times slower: on an H100, mini-40's batch-1 verify step (6 rows) spent 3.1 ms in matmuls
where the 1-row step spent 0.8 (docs/benchmarks/gpu-2026-12-06c, `decode-step-h100.json`).
:func:`skinny_matmul` is one Triton program per `BLOCK_N` output columns that reads its slab of the
weight once and multiplies it with every row (`_skinny_mm_kernel`); :func:`linear` and :func:`bmm`
route a call there when it is float32 on a CUDA device with `SKINNY_MIN_ROWS <= rows <=
SKINNY_MAX_ROWS`, and to torch otherwise. The op is registered as `cedserve::skinny_mm` so Inductor-compiled functions
(`model/fused.py`) keep it as one opaque call and CUDA graphs capture its launch.

The sums run in float32 FMAs in `BLOCK_K` steps, another order than cuBLAS's: results agree with a
float64 reference to float32 rounding (tests/kernels/test_skinny.py), not bit for bit with cuBLAS.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from cedserve.kernels.triton_support import cdiv, next_power_of_2

SKINNY_MIN_ROWS = 2
"""Fewest rows :func:`linear` and :func:`bmm` send to the kernel (one row stays with cuBLAS's GEMV)."""

SKINNY_MAX_ROWS = 16
"""Most rows :func:`linear` and :func:`bmm` send to the kernel (its `[rows, BLOCK_N, BLOCK_K]`
products live in registers)."""

ENABLED = os.environ.get("CEDSERVE_SKINNY_MATMUL", "1") != "0"
"""`CEDSERVE_SKINNY_MATMUL=0` sends every call to torch (benchmarks time the step both ways; read once,
at import, so that a compiled or captured step sees one choice)."""

_ELEMENTS = 8192
"""Products per program per K step (`M_P2 * BLOCK_N * BLOCK_K`): 64 registers a thread at 4 warps."""


def skinny_blocks(rows: int, n: int, k: int) -> tuple[int, int, int]:
    """`(M_P2, BLOCK_N, BLOCK_K)` for `rows` x `k` by `k` x `n`: `BLOCK_K` up to 64 along the
    reduction, `BLOCK_N` what the register budget leaves, at least 8."""
    m_p2 = next_power_of_2(rows)
    block_k = min(64, max(16, next_power_of_2(k)))
    block_n = max(8, min(64, _ELEMENTS // (m_p2 * block_k), next_power_of_2(n)))
    return m_p2, block_n, block_k


def _launch(x: Tensor, w: Tensor, out: Tensor, blocks: tuple[int, int] | None = None) -> None:
    """The kernel into `out`; `blocks` = `(BLOCK_N, BLOCK_K)` instead of :func:`skinny_blocks`'s
    (benchmarks/skinny_gemm.py sweeps them)."""
    from cedserve.kernels._skinny_kernels import _skinny_mm_kernel

    batch, rows, k = x.shape
    n = w.shape[1]
    m_p2, block_n, block_k = skinny_blocks(rows, n, k)
    if blocks is not None:
        block_n, block_k = blocks
    _skinny_mm_kernel[(cdiv(n, block_n), batch)](
        x, w, out, rows, n, k, *x.stride(), *w.stride(), *out.stride(),
        M_P2=m_p2, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )


@torch.library.custom_op("cedserve::skinny_mm", mutates_args=())
def skinny_mm(x: Tensor, w: Tensor) -> Tensor:
    """`x [B, M, K] @ w[B, N, K]^T` -> `[B, M, N]` (contiguous, x's dtype), through the kernel;
    any strides."""
    if x.dim() != 3 or w.dim() != 3 or x.shape[0] != w.shape[0] or x.shape[2] != w.shape[2]:
        raise ValueError(f"skinny_mm: x must be [B, M, K] and w [B, N, K], got {list(x.shape)} and {list(w.shape)}")
    if x.shape[1] > 4 * SKINNY_MAX_ROWS:
        raise ValueError(f"skinny_mm: at most {4 * SKINNY_MAX_ROWS} rows, got {x.shape[1]}")
    out = torch.empty(x.shape[0], x.shape[1], w.shape[1], dtype=x.dtype, device=x.device)
    if out.numel():
        _launch(x, w, out)
    return out


@skinny_mm.register_fake
def _skinny_mm_fake(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], x.shape[1], w.shape[1])


def skinny_matmul(x: Tensor, w: Tensor) -> Tensor:
    """`x [M, K] @ w[N, K]^T` (F.linear's layout) -> `[M, N]`, or batched `[B, M, K]`, `[B, N, K]`."""
    if x.dim() == 2:
        out: Tensor = skinny_mm(x.unsqueeze(0), w.unsqueeze(0))
        return out.squeeze(0)
    batched: Tensor = skinny_mm(x, w)
    return batched


def _skinny(x: Tensor, w: Tensor, rows: int) -> bool:
    # only attributes Dynamo resolves while tracing (the callers are compiled with fullgraph=True)
    return (ENABLED and x.dtype == torch.float32 and w.dtype == torch.float32
            and SKINNY_MIN_ROWS <= rows <= SKINNY_MAX_ROWS and x.device.type == "cuda" and w.device == x.device)


def linear(x: Tensor, w: Tensor) -> Tensor:
    """`F.linear(x, w)` (no bias) for `x [..., K]`, through the kernel where it pays (see the module)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not _skinny(x, w, rows):
        return F.linear(x, w)
    return skinny_matmul(x.reshape(rows, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])


def bmm(x: Tensor, w: Tensor) -> Tensor:
    """`torch.bmm(x [B, M, K], w [B, K, N])`, through the kernel where it pays (see the module)."""
    if not _skinny(x, w, x.shape[1]):
        return torch.bmm(x, w)
    out: Tensor = skinny_mm(x, w.transpose(1, 2))
    return out
