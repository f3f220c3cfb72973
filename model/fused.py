"""The decode step's chains of small ops as pure functions of tensors, fused by Inductor on CUDA.

A decode step at small batch is bound by how many kernels it launches, not by FLOPs or bytes: a
layer's norms, RoPE, mHC collapse and expansion, the window-slot arithmetic and a small MoE are each
five to twenty elementwise kernels of a few microseconds. Each function here is one such chain,
written as the modules compute it (`RMSNorm`, `apply_rope`, `hc_collapse` / `hc_expand`,
`Attention._project` / `_output`, `MoE.forward` with every expert dense), taking its weights as
arguments so that one compiled graph serves every layer. `FusedOps(compiled=True)` wraps each in
`torch.compile(fullgraph=True)`; with `compiled=False` they run as written (the CPU
path, which the tests compare with the modules).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from cedserve.kernels.paged import entries_to_slots
from cedserve.kernels.reference import fake_quant_fp4
from cedserve.model.device_sampling import sample_rows
from cedserve.model.mhc import hc_collapse, hc_expand
from cedserve.model.moe import score_logits
from cedserve.model.norm import rms_normalize
from cedserve.model.rope import apply_rope


def collapse_norm(streams: Tensor, pre: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`RMSNorm(hc_collapse(streams, pre))`: a sublayer's input `[B, D]`."""
    return weight * rms_normalize(hc_collapse(streams, pre), eps)


def mix_logits(streams: Tensor, fn: Tensor, eps: float) -> Tensor:
    """The mHC site's projection `[B, (2 + hc) * hc]` (`hc_mixes` before its fused tail)."""
    flat = rms_normalize(streams.flatten(start_dim=-2).float(), eps)
    return flat @ fn.float().t()


def project(x: Tensor, wq_a: Tensor, q_norm: Tensor, wq_b: Tensor, wkv: Tensor, kv_norm: Tensor, cos: Tensor,
            sin: Tensor, heads: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """`Attention._project`: query residual `[B, q_lora]`, RoPE'd queries `[B, H, D]`, window KV `[B, D]`."""
    q_residual = q_norm * rms_normalize(F.linear(x, wq_a), eps)
    q = F.linear(q_residual, wq_b).view(x.shape[0], heads, -1)
    q = apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
    kv = apply_rope(kv_norm * rms_normalize(F.linear(x, wkv), eps), cos, sin)
    return q_residual, q, kv


def output(out: Tensor, cos: Tensor, sin: Tensor, wo_a: Tensor, groups: int, wo_b: Tensor) -> Tensor:
    """`Attention._output`: inverse RoPE, grouped `wo_a`, `wo_b` -> `[B, hidden]`."""
    out = apply_rope(out, cos.unsqueeze(-2), sin.unsqueeze(-2), inverse=True)
    x = out.reshape(out.shape[0], groups, -1)  # [B, G, in]
    w = wo_a.view(groups, -1, x.shape[-1]).transpose(1, 2)  # [G, in, rank]
    grouped = torch.bmm(x.transpose(0, 1), w).transpose(0, 1).flatten(1)
    return F.linear(grouped, wo_b)


def index_query(q_residual: Tensor, wq_b: Tensor, cos: Tensor, sin: Tensor, heads: int, block: int) -> Tensor:
    """`Indexer.query` (no autograd): RoPE'd, FP4 fake-quantized index queries `[B, H, d]`."""
    q = F.linear(q_residual, wq_b).view(q_residual.shape[0], heads, -1)
    q = apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
    return fake_quant_fp4(q, block, "ue8m0")


def window_slots(positions: Tensor, slots: Tensor, first: Tensor, window: int, ring: int) -> tuple[Tensor, Tensor]:
    """(each row's ring slot for its new record `[B]`, its window's ring slots `[B, W]`, -1 where
    the position is before 0 or before the ring's first position `first [B]`): the rings of `ring`
    rows per slot hold position p at row `p % ring`."""
    base = slots * ring
    keys = positions.unsqueeze(-1) - (window - 1) + torch.arange(window, device=positions.device)
    inside = (keys >= 0) & (keys >= first.unsqueeze(-1))
    table = torch.where(inside, base.unsqueeze(-1) + keys.remainder(ring), -1).to(torch.int32)
    return base + positions % ring, table


def dense_moe(x: Tensor, gate: Tensor, bias: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, s1: Tensor, s3: Tensor,
              s2: Tensor, scoring: str, temp: float, top_k: int, renorm: bool, scaling: float, limit: float
              ) -> Tensor:
    """`MoE.forward` with every routed expert run over every row (unrouted pairs weighted 0):
    `x [B, D]`; `gate [E, D]`, `bias [E]`; stacked `w1`, `w3 [E, I, D]`, `w2 [E, D, I]`; the shared
    expert's `s1`, `s3 [I, D]`, `s2 [D, I]`."""
    scores = score_logits(F.linear(x.float(), gate.float()) / temp, scoring)
    indices = (scores + bias.float()).topk(top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    if renorm and top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    routing = torch.zeros(x.shape[0], w1.shape[0], device=x.device).scatter(1, indices, weights * scaling)
    xe = x.unsqueeze(0).expand(w1.shape[0], -1, -1)  # [E, B, D]
    g, u = torch.bmm(xe, w1.transpose(1, 2)).float(), torch.bmm(xe, w3.transpose(1, 2)).float()
    if limit > 0:
        u, g = u.clamp(-limit, limit), g.clamp(max=limit)
    y = routing.t().unsqueeze(-1) * (F.silu(g) * u)  # [E, B, I]
    routed = torch.bmm(y.to(x.dtype), w2.transpose(1, 2)).float().sum(dim=0)
    sg, su = F.linear(x, s1).float(), F.linear(x, s3).float()
    if limit > 0:
        su, sg = su.clamp(-limit, limit), sg.clamp(max=limit)
    shared = F.linear((F.silu(sg) * su).to(x.dtype), s2).float()
    return (routed + shared).to(x.dtype)


RECOMPILE_LIMIT = 64
"""Dynamo's per-function recompile limit while fused ops are compiled (`FusedOps`)."""


class FusedOps:
    """The functions above, compiled (`compiled=True`, CUDA) or as written."""

    def __init__(self, compiled: bool) -> None:
        if compiled:
            # One compiled function serves every layer and batch bucket, with two index dtypes
            # (`entries_to_slots`: long entries and int32 picks): the engine's bucket set recompiled
            # it past Dynamo's default limit of 8, a hard failure under fullgraph (H200 run 4).
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            # dynamic=None: a second batch size makes the batch dimension symbolic; widths and head
            # counts stay constants (dynamic=True made them symbols too, and Inductor's Triton codegen
            # then failed to split `view(B, heads, -1)` into FP4 blocks: "CantSplit", torch 2.11)
            return torch.compile(fn, fullgraph=True) if compiled else fn

        self.collapse_norm = wrap(collapse_norm)
        self.mix_logits = wrap(mix_logits)
        self.project = wrap(project)
        self.output = wrap(output)
        self.index_query = wrap(index_query)
        self.window_slots = wrap(window_slots)
        self.dense_moe = wrap(dense_moe)
        self.expand = wrap(hc_expand)
        self.entries_to_slots = wrap(entries_to_slots)
        self.sample_rows = wrap(sample_rows)
