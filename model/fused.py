"""The decode step's chains of small ops as pure functions of tensors, fused by Inductor on CUDA.

A decode step at small batch is bound by how many kernels it launches, not by FLOPs or bytes: a
layer's norms, RoPE, mHC expansion, the window-slot arithmetic and a small MoE are each five to
twenty elementwise kernels of a few microseconds. Each function here is one such chain, written as
the modules compute it (`RMSNorm`, `apply_rope`, `hc_expand`, `Attention._project` / `_output`, the
compressor's step, `MoE.forward` with every expert dense), taking its weights as arguments so that
one compiled graph serves every layer (an mHC site's projection, tail, collapse and norm are Triton
kernels instead: `cedserve.kernels.mhc.hc_site`). `FusedOps(compiled=True)` wraps each in
`torch.compile(fullgraph=True)`; with `compiled=False` they run as written (the CPU
path, which the tests compare with the modules).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from cedserve.kernels.grouped_linear import grouped_linear, linear
from cedserve.kernels.paged import entries_to_slots
from cedserve.kernels.reference import fake_quant_fp4
from cedserve.kernels.triton_support import Impl
from cedserve.model.compressor import pool_groups
from cedserve.model.device_sampling import sample_rows
from cedserve.model.engram import engram_mix, hash_rows
from cedserve.model.mhc import hc_expand
from cedserve.model.moe import score_logits
from cedserve.model.norm import rms_normalize
from cedserve.model.rope import apply_rope, rope_cos_sin


def project(x: Tensor, wa: Tensor, q_rank: int, q_norm: Tensor, wq_b: Tensor, kv_norm: Tensor, cos: Tensor,
            sin: Tensor, heads: int, eps: float, q_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`Attention._project` from one GEMM over the weights that read `x [B, hidden]`: `wa` holds `wq_a`'s
    `q_rank` rows, then `wkv`'s, then any more (an index source's `weights_proj`). Returns the query
    residual `[B, q_rank]`, RoPE'd queries `[B, H, D]` in `q_dtype` (the attention's), window KV `[B, D]`
    and the further rows' logits `[B, rest]` (`[B, 0]` when there are none)."""
    a = linear(x, wa)  # [B, q_rank + D + rest]
    dim = kv_norm.shape[0]
    q_residual = q_norm * rms_normalize(a[:, :q_rank], eps)
    q = linear(q_residual, wq_b).view(x.shape[0], heads, -1)
    q = apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2)).to(q_dtype)
    kv = apply_rope(kv_norm * rms_normalize(a[:, q_rank:q_rank + dim], eps), cos, sin)
    return q_residual, q, kv, a[:, q_rank + dim:]


def unrope_output(out: Tensor, cos: Tensor, sin: Tensor, groups: int, dtype: torch.dtype) -> Tensor:
    """The attention's `out [B, H, D]` (any dtype: cast to `dtype` first) with RoPE undone, as `wo_a`'s
    groups read it: `[B, groups, H * D / groups]`."""
    out = apply_rope(out.to(dtype), cos.unsqueeze(-2), sin.unsqueeze(-2), inverse=True)
    return out.reshape(out.shape[0], groups, -1)


def output(out: Tensor, cos: Tensor, sin: Tensor, wo_a: Tensor, groups: int, wo_b: Tensor,
           unrope: Callable[..., Tensor] = unrope_output, impl: Impl = "torch") -> Tensor:
    """`Attention._output` of the attention's `out [B, H, D]`: inverse RoPE (`unrope`: compiled in
    `FusedOps`), grouped `wo_a` (`grouped_linear` with `impl`: one Triton launch on a GPU, where
    cuBLAS's float32 `bmm` took ~35 us at 2-192 rows), `wo_b` -> `[B, hidden]`."""
    return linear(grouped_linear(unrope(out, cos, sin, groups, wo_b.dtype), wo_a, impl), wo_b)


def index_query(q_residual: Tensor, wq_b: Tensor, head_logits: Tensor, cos: Tensor, sin: Tensor, heads: int,
                block: int) -> tuple[Tensor, Tensor]:
    """`Indexer.query` (no autograd) and `Indexer.head_weights` from `weights_proj`'s logits
    `head_logits [B, H]`: RoPE'd, FP4 fake-quantized index queries `[B, H, d]` in bf16 (exact: what
    `layer_topk` scores) and float32 head weights `[B, H]`."""
    q = linear(q_residual, wq_b).view(q_residual.shape[0], heads, -1)
    q = apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
    return fake_quant_fp4(q, block, "ue8m0").to(torch.bfloat16), head_logits.float() * heads**-0.5


def window_slots(positions: Tensor, slots: Tensor, first: Tensor, window: int, ring: int) -> tuple[Tensor, Tensor]:
    """Every layer's window at once: (each row's ring slot for its new record `[B]`, the same in every
    layer, and each layer's window ring slots `[L, B, W]`, -1 where the position is before 0 or before
    the layer's ring's first position `first [L, slots]`): the rings of `ring` rows per slot hold
    position p at row `p % ring`."""
    base = slots * ring
    keys = positions.unsqueeze(-1) - (window - 1) + torch.arange(window, device=positions.device)  # [B, W]
    inside = (keys >= 0) & (keys >= first[:, slots].unsqueeze(-1))  # [L, B, W]
    table = torch.where(inside, base.unsqueeze(-1) + keys.remainder(ring), -1).to(torch.int32)
    return base + positions % ring, table


def write_pending(x: Tensor, w: Tensor, pending_kv: Tensor, pending_gate: Tensor, slots: Tensor,
                  positions: Tensor) -> None:
    """A ratio m > 1 compressor's rows into their slots' pending rings: the float32 projections
    `x [B, D] @ w^T` (`w` = `[wkv; wgate]`) at ring row `position % ring`, in place. Kept out of the
    compiled `global_kv_from_rings` on purpose: written and read back inside one Inductor graph, the
    rings are a mutation followed by a gather of the same buffer, which a GPU kernel may reorder
    (the compiled step's replays disagreed with eager on an H200 while its CPU code agreed)."""
    ring, dim = pending_kv.shape[1], pending_kv.shape[2]
    projected = linear(x.float(), w)  # [B, 2D]: latent, then gate
    rows = positions % ring
    pending_kv[slots, rows] = projected[:, :dim]
    pending_gate[slots, rows] = projected[:, dim:]


def global_kv_from_rings(x: Tensor, w: Tensor, norm: Tensor, wk: Tensor, k_norm: Tensor, pending_kv: Tensor | None,
                         pending_gate: Tensor | None, slots: Tensor, positions: Tensor, block_table: Tensor,
                         scratch_slot: int, inv_freq: Tensor, rope_scaling: float, ratio: int, entries_per_block: int,
                         eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """`global_kv` after `write_pending` (ratio m > 1: the rings hold the rows' projections already;
    this reads them only, a pure function of its inputs)."""
    if pending_kv is None or pending_gate is None:
        latent = norm * rms_normalize(linear(x, w), eps)
        entry, complete = positions, None
    else:
        ring = pending_kv.shape[1]
        entry = positions // ratio
        group = ((entry * ratio).unsqueeze(-1) + torch.arange(ratio, device=x.device)) % ring  # [B, m]
        pooled = pool_groups(pending_kv[slots.unsqueeze(-1), group], pending_gate[slots.unsqueeze(-1), group], ratio)
        latent = norm * rms_normalize(pooled.squeeze(1).to(x.dtype), eps)
        complete = positions % ratio == ratio - 1
    cos, sin = rope_cos_sin(entry * ratio, inv_freq, rope_scaling)
    keys = apply_rope(k_norm * rms_normalize(linear(latent, wk), eps), cos, sin)
    slot_map = entries_to_slots(entry.unsqueeze(-1), block_table, entries_per_block).squeeze(-1)
    keep = slots != scratch_slot
    if complete is not None:
        keep = keep & complete
    return apply_rope(latent, cos, sin), keys, torch.where(keep, slot_map, -1)


def global_kv(x: Tensor, w: Tensor, norm: Tensor, wk: Tensor, k_norm: Tensor, pending_kv: Tensor | None,
              pending_gate: Tensor | None, slots: Tensor, positions: Tensor, block_table: Tensor, scratch_slot: int,
              inv_freq: Tensor, rope_scaling: float, ratio: int, entries_per_block: int, eps: float,
              from_rings: Callable[..., tuple[Tensor, Tensor, Tensor]] = global_kv_from_rings,
              ) -> tuple[Tensor, Tensor, Tensor]:
    """The compressor's step for rows `x [B, D]` (`SlotStep._write_global_kv`): RoPE'd main KV `[B, D]`,
    index keys `[B, d]` of each row's group and its record slot `[B]` (-1 where the row's group is not
    complete, and for padding rows at `scratch_slot`: shared pools hold real blocks). Ratio 1: `w` is
    `wkv`. Ratio m > 1: `w` is float32 `[wkv; wgate]`; the rows' projections go into the slots' pending
    rings `pending_kv`, `pending_gate` `[slots, ring, D]` first (`write_pending`: every row before any
    group is pooled, a slot's rows may share a group), then each row pools its group's m positions
    (`from_rings`: `global_kv_from_rings`, or its compiled form)."""
    if pending_kv is not None and pending_gate is not None:
        write_pending(x, w, pending_kv, pending_gate, slots, positions)
    return from_rings(x, w, norm, wk, k_norm, pending_kv, pending_gate, slots, positions, block_table, scratch_slot,
                      inv_freq, rope_scaling, ratio, entries_per_block, eps)


def dense_moe(x: Tensor, gate: Tensor, bias: Tensor, w13: Tensor, w2: Tensor, scoring: str, temp: float, top_k: int,
              renorm: bool, scaling: float, limit: float, by_argmax: bool = False) -> Tensor:
    """`MoE.forward` with every routed expert run over every row (unrouted pairs weighted 0) and the
    shared expert as one more, weighted 1: `x [B, D]`; float32 `gate [E, D]`, `bias [E]`; `w13
    [E + 1, 2I, D]` (each expert's `w1` rows, then its `w3` rows; the shared expert last) and `w2
    [E + 1, D, I]` (`dense_experts`). `by_argmax`: `route_topk`'s."""
    weights, indices = route_topk(x, gate, bias, scoring, temp, top_k, renorm, scaling, by_argmax)  # [B, k]
    ids = torch.arange(w13.shape[0], device=x.device)
    # [B, E + 1]: each expert's routing weight (a one-hot sum: at most one term is nonzero, so exact)
    routing = ((indices.unsqueeze(-1) == ids) * weights.unsqueeze(-1)).sum(dim=1)
    routing = torch.where(ids == w13.shape[0] - 1, 1.0, routing)
    return dense_experts(x, routing, w13, w2, limit)


def dense_experts(x: Tensor, routing: Tensor, w13: Tensor, w2: Tensor, limit: float) -> Tensor:
    """Every stacked expert over every row of `x [B, D]`, weighted by float32 `routing [B, E']`
    (0 where a row does not route to the expert: exact), summed: `[B, D]` in `x.dtype`. `w13 [E', 2I,
    D]`, `w2 [E', D, I]`. Two GEMMs for every expert: gate and up as one over the flattened `w13`,
    the down projections as one batched GEMM; each expert's output is rounded to `x.dtype` before
    the float32 sum."""
    experts, inter = w13.shape[0], w2.shape[-1]
    gate_up = linear(x, w13.flatten(0, 1)).view(x.shape[0], experts, 2 * inter).float()  # [B, E', 2I]
    g, u = gate_up[..., :inter], gate_up[..., inter:]
    if limit > 0:
        u, g = u.clamp(-limit, limit), g.clamp(max=limit)
    y = routing.unsqueeze(-1) * (F.silu(g) * u)  # [B, E', I]
    down = torch.bmm(y.transpose(0, 1).to(x.dtype), w2.transpose(1, 2))  # [E', B, D]
    return down.float().sum(dim=0).to(x.dtype)


ARGMAX_TOPK = 4
"""Largest `top_k` that `route_topk(by_argmax=True)` picks by repeated argmax rather than `topk`."""


def pick_topk(scores: Tensor, k: int, by_argmax: bool) -> Tensor:
    """The indices of the `k` largest of `scores [B, E]` along the last dimension, `[B, k]`, in no
    promised order. `by_argmax` (and `k <= ARGMAX_TOPK`): `k` rounds of argmax, each masking its
    pick with -inf, in descending order (ties: the lowest index first). Compiled, Inductor fuses
    those rounds with the scoring around them into one reduction kernel, where `topk` is an
    extern op of its own (`sbtopk::gatherTopK`, ~5 us a layer on an H100 at 8 experts and one row).
    Uncompiled, `topk` is one kernel and the rounds 2k, so the eager and graph paths keep `topk`."""
    if not by_argmax or k > ARGMAX_TOPK or k >= scores.shape[-1]:
        return scores.topk(k, dim=-1, sorted=False).indices
    ids = torch.arange(scores.shape[-1], device=scores.device)
    picks = []
    for _ in range(k):
        pick = scores.argmax(dim=-1, keepdim=True)  # [B, 1]
        picks.append(pick)
        scores = torch.where(ids == pick, float("-inf"), scores)  # pointwise: fuses, where a scatter would not
    return torch.cat(picks, dim=-1)


def route_topk(x: Tensor, gate: Tensor, bias: Tensor, scoring: str, temp: float, top_k: int, renorm: bool,
               scaling: float, by_argmax: bool = False) -> tuple[Tensor, Tensor]:
    """`moe.route` with float32 `gate [E, D]` and `bias [E]`: float32 weights `[B, k]`, indices `[B, k]`.
    `by_argmax`: the picks by `pick_topk`'s rounds of argmax (the compiled ops' choice)."""
    scores = score_logits(linear(x.float(), gate) / temp, scoring)
    # Unsorted: the same experts, without the sort a sorted top-k adds per layer (one more kernel each
    # on CUDA); the callers scatter the pairs or sum them per row, so their order does not matter.
    indices = pick_topk(scores + bias, top_k, by_argmax)
    weights = scores.gather(1, indices)
    if renorm and top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, indices


def route_with_shared(x: Tensor, gate: Tensor, bias: Tensor, scoring: str, temp: float, top_k: int, renorm: bool,
                      scaling: float, by_argmax: bool = False) -> tuple[Tensor, Tensor]:
    """`route_topk` with the shared expert as one more pair of every row: expert `E` (after the routed
    ones), weight 1: `[B, k + 1]` each."""
    weights, indices = route_topk(x, gate, bias, scoring, temp, top_k, renorm, scaling, by_argmax)
    shared = torch.full_like(indices[:, :1], gate.shape[0])
    return torch.cat([weights, torch.ones_like(weights[:, :1])], dim=1), torch.cat([indices, shared], dim=1)


def engram_hashes(compressed: Tensor, slots: Tensor, positions: Tensor, engram_ids: Tensor, engram_first: Tensor,
                  keep: int, multipliers: Tensor, primes: Tensor, offsets: Tensor, pad_id: int) -> Tensor:
    """The rows' Engram hash ids `[B, layers, (N-1)*heads]` from their slots' id rings (`engram_ids
    [slots, ring]`, this step's ids already written; `engram_first [slots]` the first position each
    ring holds): the `keep` ids before each row's position, how many of them are known, then
    `engram.hash_rows` (the gather, the masks and the hash arithmetic, some twenty small integer
    kernels as written)."""
    ring = engram_ids.shape[1]
    before = positions.unsqueeze(-1) - keep + torch.arange(keep, device=positions.device)  # [B, N-1]
    history = engram_ids[slots.unsqueeze(-1), before.remainder(ring)]
    known = (positions - engram_first[slots].clamp_min(0)).clamp(0, keep)
    return hash_rows(history, known, compressed, multipliers, primes, offsets, pad_id)


RECOMPILE_LIMIT = 64
"""Dynamo's per-function recompile limit while fused ops are compiled (`FusedOps`)."""


def compiled_form(fn: Callable[..., Any]) -> Callable[..., Any]:
    """What `FusedOps(compiled=True)` hands Inductor for `fn`: the routing functions pick their top-k
    by rounds of argmax, which Inductor fuses (`pick_topk`); the rest as written."""
    if fn in (dense_moe, route_topk, route_with_shared):
        return partial(fn, by_argmax=True)
    return fn


class FusedOps:
    """The functions above, compiled (`compiled=True`, CUDA) or as written; `kernels` (default:
    `compiled`) sends `wo_a` to its Triton kernel (CUDA, or CPU under `TRITON_INTERPRET=1`)."""

    def __init__(self, compiled: bool, kernels: bool | None = None) -> None:
        self.compiled = compiled
        if compiled:
            # One compiled function serves every layer and batch bucket, with two index dtypes
            # (`entries_to_slots`: long entries and int32 picks): the engine's bucket set recompiled
            # it past Dynamo's default limit of 8, a hard failure under fullgraph (H200 run 4).
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            # dynamic=None: a second batch size makes the batch dimension symbolic; widths and head
            # counts stay constants (dynamic=True made them symbols too, and Inductor's Triton codegen
            # then failed to split `view(B, heads, -1)` into FP4 blocks: "CantSplit", torch 2.11)
            return torch.compile(compiled_form(fn), fullgraph=True) if compiled else fn

        self.project = wrap(project)
        grouped: Impl = "auto" if (compiled if kernels is None else kernels) else "torch"
        self.output = partial(output, unrope=wrap(unrope_output), impl=grouped)  # wo_a's kernel stays outside Inductor
        self.index_query = wrap(index_query)
        self.window_slots = wrap(window_slots)
        self.global_kv = partial(global_kv, from_rings=wrap(global_kv_from_rings))  # ring writes stay eager
        self.dense_moe = wrap(dense_moe)
        self.dense_experts = wrap(dense_experts)
        self.route_topk = wrap(route_topk)
        self.route_with_shared = wrap(route_with_shared)
        self.expand = wrap(hc_expand)
        self.entries_to_slots = wrap(entries_to_slots)
        self.sample_rows = wrap(sample_rows)
        self.engram_hashes = wrap(engram_hashes)
        self.engram = wrap(engram_mix)
