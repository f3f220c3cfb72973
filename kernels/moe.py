"""Routed-expert compute for a token-to-expert dispatch: grouped GEMMs with the clamped SwiGLU.

For tokens `x [N, hidden]` routed to experts `topk_ids [N, k]` with weights `topk_weights [N, k]`
(already renormalised and scaled by the router), :func:`moe_experts` returns

    y[n] = sum_j  w2[e_nj] @ bf16( topk_weights[n, j] * silu(min(g, L)) * clamp(u, -L, L) ),
    g = w1[e_nj] @ x[n],  u = w3[e_nj] @ x[n],  L = swiglu_limit (no clamps when L <= 0)

which is the reference model's `DeepseekV41Expert` (up clamped on both sides, gate from above, the
routing weight applied before the down projection, each expert's output rounded to `x.dtype`
and summed in fp32). The shared expert is not included (run it as a dense MLP, or append it as
expert `E` with weight 1).

Weights (:class:`ExpertWeights`) are stacked per projection: `w13` holds `[w1; w3]` (`[E, 2I,
hidden]`: gate rows first, then up rows) and `w2` is `[E, hidden, I]`, either bf16 or FP4 in the
checkpoint's layout (`cedserve.kernels.weight_formats`: E2M1 pairs `[E, out, in/2]` + UE8M0
scales `[E, out, in/32]`).

Implementations (`impl`):

* "triton": sort pairs by expert into `BLOCK_M` tiles (no host sync), `_moe_gate_up_kernel` then
  `_moe_down_kernel`; FP4 weights are decoded in registers (W4A16: a quarter of bf16's weight
  traffic, which is what decode is bound by).
* "grouped_mm": `torch._grouped_mm` over the expert-sorted rows (bf16 weights only; on Hopper it
  is CUTLASS's grouped GEMM), SwiGLU in torch.
* "torch": the reference, a loop over experts in float32 (:func:`moe_experts_reference`).

:func:`moe_experts_per_pair` returns the per-(token, expert) outputs before the sum (what an
expert-parallel combine ships back to the token's rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from cedserve.kernels.triton_support import Impl, cdiv, check_tensor, interpreting, pdl_launch, resolve_impl
from cedserve.kernels.weight_formats import FP4_WEIGHT_BLOCK, dequantize_fp4_weight

MoeImpl = Literal["auto", "triton", "grouped_mm", "torch"]


@dataclass(frozen=True)
class ExpertWeights:
    """One projection of every expert: bf16 `weight [E, out, in]`, or FP4 `weight` uint8
    `[E, out, in/2]` with UE8M0 `scale` uint8 `[E, out, in/32]` (the checkpoint's layout)."""

    weight: Tensor
    scale: Tensor | None = None

    def __post_init__(self) -> None:
        w, s = self.weight, self.scale
        if w.dim() != 3 or not w.is_contiguous():
            raise ValueError(f"ExpertWeights.weight must be a contiguous [E, out, in] tensor, got {list(w.shape)}")
        if s is None:
            if w.dtype != torch.bfloat16:
                raise TypeError(f"ExpertWeights: unquantized weights must be bf16, got {w.dtype}")
            return
        if w.dtype != torch.uint8 or s.dtype != torch.uint8:
            raise TypeError(f"ExpertWeights: FP4 weight and scale must be uint8, got {w.dtype}/{s.dtype}")
        if s.shape != (w.shape[0], w.shape[1], 2 * w.shape[2] // FP4_WEIGHT_BLOCK) or not s.is_contiguous():
            raise ValueError(f"ExpertWeights: FP4 scale must be contiguous "
                             f"{[w.shape[0], w.shape[1], 2 * w.shape[2] // FP4_WEIGHT_BLOCK]}, got {list(s.shape)}")
        if (2 * w.shape[2]) % FP4_WEIGHT_BLOCK:
            raise ValueError(f"ExpertWeights: FP4 in_features must be a multiple of {FP4_WEIGHT_BLOCK}")

    @property
    def fp4(self) -> bool:
        return self.scale is not None

    @property
    def num_experts(self) -> int:
        return int(self.weight.shape[0])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[2]) * (2 if self.fp4 else 1)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored weights (and scales)."""
        extra = 0 if self.scale is None else self.scale.numel()
        return int(self.weight.numel() * self.weight.element_size() + extra)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """`[E, out, in]` of `dtype` (exact for FP4 in bf16 and fp32)."""
        if self.scale is None:
            return self.weight.to(dtype)
        return torch.stack([dequantize_fp4_weight(w, s, dtype) for w, s in zip(self.weight, self.scale)])


@dataclass(frozen=True)
class MoeConfig:
    """Tile sizes of the Triton path (None = heuristic on the number of (token, expert) pairs)."""

    block_m: int | None = None
    block_n: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def resolve(self, pairs: int, num_experts: int) -> MoeConfig:
        rows_per_expert = pairs / max(num_experts, 1)
        block_m = self.block_m or (16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 64 else 64)
        block_n = self.block_n or (64 if block_m <= 32 else 128)
        block_k = self.block_k or 128
        return MoeConfig(block_m, block_n, block_k, self.num_warps or 4, self.num_stages or 2)


def _swiglu(gate_up: Tensor, inter: int, limit: float) -> Tensor:
    gate, up = gate_up[:, :inter].float(), gate_up[:, inter:].float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return F.silu(gate) * up


def _per_pair_reference(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: ExpertWeights, w2: ExpertWeights,
                        swiglu_limit: float) -> Tensor:
    """bf16 `[N, k, hidden]`: every pair's expert output, float32 GEMMs on the dequantized weights,
    the weighted activation and the output rounded to `x.dtype` (as the model)."""
    tokens, top_k = topk_ids.shape
    inter = w2.in_features
    out = torch.empty(tokens, top_k, x.shape[1], dtype=x.dtype, device=x.device)
    w13_f, w2_f = w13.dequantize(), w2.dequantize()
    for expert in sorted(set(topk_ids.flatten().tolist())):
        rows, slot = torch.where(topk_ids == expert)
        h = _swiglu(x[rows].float() @ w13_f[expert].t(), inter, swiglu_limit)
        h = (topk_weights[rows, slot, None].float() * h).to(x.dtype)
        out[rows, slot] = (h.float() @ w2_f[expert].t()).to(x.dtype)
    return out


def moe_experts_reference(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: ExpertWeights,
                          w2: ExpertWeights, swiglu_limit: float) -> Tensor:
    """Torch reference of :func:`moe_experts`: per expert, float32 GEMMs on the dequantized
    weights, bf16 rounding of the weighted activation and of each expert's output, fp32 sum."""
    return _per_pair_reference(x, topk_ids, topk_weights, w13, w2, swiglu_limit).float().sum(1).to(x.dtype)


@dataclass(frozen=True)
class Dispatch:
    """(token, expert) pairs sorted by expert (no host sync: sizes are upper bounds)."""

    order: Tensor
    """int64 `[P]`: pair ids (`token * k + j`) sorted by expert, stable."""
    counts: Tensor
    """int64 `[E]`: pairs per expert."""
    block_expert: Tensor
    """int32 `[max_tiles]`: expert of each BLOCK_M tile, -1 for unused tiles."""
    padded_pair: Tensor
    """int32 `[max_tiles * BLOCK_M]`: pair id of each tile row, -1 for padding."""


def dispatch(topk_ids: Tensor, num_experts: int, block_m: int) -> Dispatch:
    """Sort the pairs of `topk_ids [N, k]` by expert into `block_m`-row tiles of one expert."""
    flat = topk_ids.flatten().long()
    pairs = flat.numel()
    device = flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    tiles = counts.add(block_m - 1).div(block_m, rounding_mode="floor")
    tile_end = tiles.cumsum(0)
    max_tiles = cdiv(pairs, block_m) + min(num_experts, pairs)
    tile_ids = torch.arange(max_tiles, device=device)
    block_expert = torch.searchsorted(tile_end, tile_ids, right=True)
    block_expert = torch.where(tile_ids < tile_end[-1], block_expert, torch.full_like(block_expert, -1))
    first_pair = counts.cumsum(0) - counts  # exclusive
    sorted_expert = flat[order]
    rank = torch.arange(pairs, device=device) - first_pair[sorted_expert]
    row = (tile_end - tiles)[sorted_expert] * block_m + rank
    padded_pair = torch.full((max_tiles * block_m,), -1, dtype=torch.int32, device=device)
    padded_pair[row] = order.to(torch.int32)
    return Dispatch(order, counts, block_expert.to(torch.int32), padded_pair)


def _moe_grouped_mm(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: ExpertWeights, w2: ExpertWeights,
                    swiglu_limit: float) -> Tensor:
    tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten().long()
    order = torch.argsort(flat, stable=True)
    offs = torch.bincount(flat, minlength=w13.num_experts).cumsum(0).to(torch.int32)
    rows = x[order // top_k]
    gate_up = torch._grouped_mm(rows, w13.weight.transpose(1, 2), offs=offs)
    h = _swiglu(gate_up, w2.in_features, swiglu_limit) * topk_weights.flatten()[order, None].float()
    down = torch._grouped_mm(h.to(x.dtype), w2.weight.transpose(1, 2), offs=offs)
    per_pair = torch.empty_like(down)
    per_pair[order] = down
    return per_pair.view(tokens, top_k, -1)


def _check(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: ExpertWeights, w2: ExpertWeights) -> None:
    op = "moe_experts"
    check_tensor(x, f"{op}: x", dtypes=(torch.bfloat16,), dim=2)
    check_tensor(topk_ids, f"{op}: topk_ids", dtypes=(torch.int32, torch.int64), dim=2)
    check_tensor(topk_weights, f"{op}: topk_weights", dtypes=(torch.float32, torch.bfloat16), dim=2)
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} "
                         f"must both be [{x.shape[0]}, k]")
    hidden = x.shape[1]
    if w13.num_experts != w2.num_experts or w13.fp4 != w2.fp4:
        raise ValueError(f"{op}: w13 and w2 must have the same experts and format")
    if w13.in_features != hidden or w2.out_features != hidden or w13.out_features != 2 * w2.in_features:
        raise ValueError(f"{op}: expected w13 [E, 2I, {hidden}] and w2 [E, {hidden}, I], got "
                         f"[E, {w13.out_features}, {w13.in_features}] and [E, {w2.out_features}, {w2.in_features}]")


def moe_experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: ExpertWeights, w2: ExpertWeights, *,
                swiglu_limit: float, config: MoeConfig | None = None, impl: MoeImpl = "auto") -> Tensor:
    """Routed-expert output `[N, hidden]` (bf16) of `x [N, hidden]` bf16 (module docstring): the
    per-pair outputs of :func:`moe_experts_per_pair` summed over `k` in fp32."""
    _check(x, topk_ids, topk_weights, w13, w2)
    if impl == "torch" or (impl == "auto" and resolve_impl("auto", "moe_experts", x, w13.weight) == "torch"):
        return moe_experts_reference(x, topk_ids, topk_weights, w13, w2, swiglu_limit)
    per_pair = moe_experts_per_pair(x, topk_ids, topk_weights, w13, w2, swiglu_limit=swiglu_limit, config=config,
                                    impl=impl)
    return per_pair.float().sum(1).to(x.dtype)


def moe_experts_per_pair(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: ExpertWeights, w2: ExpertWeights,
                         *, swiglu_limit: float, out: Tensor | None = None, config: MoeConfig | None = None,
                         impl: MoeImpl = "auto") -> Tensor:
    """Each (token, expert) pair's weighted expert output, bf16 `[N, k, hidden]` (what an
    expert-parallel combine sends back to the token's rank); `out` may be given (contiguous)."""
    _check(x, topk_ids, topk_weights, w13, w2)
    tokens, top_k = topk_ids.shape
    hidden, inter = x.shape[1], w2.in_features
    if out is None:
        out = torch.empty(tokens, top_k, hidden, dtype=x.dtype, device=x.device)
    elif out.shape != (tokens, top_k, hidden) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"moe_experts_per_pair: out must be a contiguous {[tokens, top_k, hidden]} {x.dtype} tensor")
    if impl == "grouped_mm":
        if w13.fp4:
            raise ValueError("moe_experts: impl='grouped_mm' needs bf16 weights")
        return out.copy_(_moe_grouped_mm(x, topk_ids, topk_weights, w13, w2, swiglu_limit))
    layer: Impl = "triton" if impl == "triton" else "torch" if impl == "torch" else "auto"
    if resolve_impl(layer, "moe_experts", x, topk_ids, topk_weights, w13.weight, w2.weight, out) == "torch":
        return out.copy_(_per_pair_reference(x, topk_ids, topk_weights, w13, w2, swiglu_limit))
    if tokens == 0:
        return out
    from cedserve.kernels import _moe_kernels as k

    cfg = (config or MoeConfig()).resolve(tokens * top_k, w13.num_experts)
    assert cfg.block_m and cfg.block_n and cfg.block_k and cfg.num_warps and cfg.num_stages
    plan = dispatch(topk_ids, w13.num_experts, cfg.block_m)
    tiles = plan.block_expert.shape[0]
    h = torch.empty(tiles * cfg.block_m, inter, dtype=x.dtype, device=x.device)
    per_pair = out.view(tokens * top_k, hidden)
    route_w = topk_weights.flatten().float().contiguous()
    s13 = w13.scale if w13.scale is not None else w13.weight
    s2 = w2.scale if w2.scale is not None else w2.weight
    dot_f32 = interpreting()
    k._moe_gate_up_kernel[(tiles, cdiv(inter, cfg.block_n))](
        x, x.stride(0), plan.block_expert, plan.padded_pair, route_w,
        w13.weight, w13.weight.stride(0), w13.weight.stride(1), s13, s13.stride(0), s13.stride(1),
        h, h.stride(0), hidden, inter, float(swiglu_limit),
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FP4=w13.fp4,
        HAS_LIMIT=swiglu_limit > 0, DOT_F32=dot_f32, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x.device),
    )
    k._moe_down_kernel[(tiles, cdiv(hidden, cfg.block_n))](
        h, h.stride(0), plan.block_expert, plan.padded_pair,
        w2.weight, w2.weight.stride(0), w2.weight.stride(1), s2, s2.stride(0), s2.stride(1),
        per_pair, per_pair.stride(0), hidden, inter,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FP4=w2.fp4, DOT_F32=dot_f32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(h.device),
    )
    return out
