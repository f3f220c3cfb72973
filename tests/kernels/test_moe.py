"""Routed-expert grouped GEMMs (`cedserve.kernels.moe`): the Triton kernels (bf16 and FP4
weights) and the torch grouped-matmul path against the float32 reference.

Tolerance: every path accumulates in fp32 and rounds the weighted SwiGLU activation and each
expert's output to bf16, like the reference, but sums in another order, so a rounding can flip:
|out - ref| <= 1e-2 * max|ref| + 1e-2 * |ref|. Per-pair outputs are NaN-poisoned before the launch.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from cedserve.kernels.moe import (
    ExpertWeights,
    MoeConfig,
    dispatch,
    moe_experts,
    moe_experts_per_pair,
    moe_experts_reference,
)
from cedserve.kernels.weight_formats import quantize_fp4_weight

pytestmark = pytest.mark.kernels
CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _weights(experts: int, out: int, inp: int, fp4: bool, gen: torch.Generator, device: torch.device) -> ExpertWeights:
    w = torch.randn(experts, out, inp, generator=gen, device=device) * inp**-0.5
    if not fp4:
        return ExpertWeights(w.bfloat16().contiguous())
    packed = [quantize_fp4_weight(e.cpu()) for e in w]
    return ExpertWeights(torch.stack([p for p, _ in packed]).to(device), torch.stack([s for _, s in packed]).to(device))


def _routing(tokens: int, experts: int, top_k: int, gen: torch.Generator, device: torch.device) -> tuple[Tensor, Tensor]:
    """Distinct experts per token, never the last expert (an idle expert must be harmless)."""
    scores = torch.rand(tokens, experts - 1, generator=gen, device=device)
    ids = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=gen, device=device) * 1.5
    return ids, weights


def _check(out: Tensor, ref: Tensor) -> None:
    assert not out.isnan().any()
    err = (out.float() - ref.float()).abs()
    bound = 1e-2 * ref.float().abs().max() + 1e-2 * ref.float().abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.4g} vs max |ref| {ref.float().abs().max():.4g}"


@pytest.mark.parametrize("fp4", [False, True])
def test_triton_matches_reference(fp4: bool, gen: torch.Generator, device: torch.device) -> None:
    # 96 = 1.5 tiles of 64 intermediate channels, 160 hidden = 2.5 tiles of 64: ragged edges;
    # 23 tokens x 3 experts over 6 experts: several 16-row tiles per expert
    experts, hidden, inter, tokens, top_k = 6, 160, 96, 23, 3
    x = torch.randn(tokens, hidden, generator=gen, device=device).bfloat16() * 2
    ids, weights = _routing(tokens, experts, top_k, gen, device)
    w13 = _weights(experts, 2 * inter, hidden, fp4, gen, device)
    w2 = _weights(experts, hidden, inter, fp4, gen, device)
    config = MoeConfig(block_m=16, block_n=64, block_k=64)
    per_pair = torch.full((tokens, top_k, hidden), float("nan"), dtype=torch.bfloat16, device=device)
    moe_experts_per_pair(x, ids, weights, w13, w2, swiglu_limit=1.0, out=per_pair, impl="triton", config=config)
    ref_pairs = moe_experts_per_pair(x, ids, weights, w13, w2, swiglu_limit=1.0, impl="torch")
    _check(per_pair, ref_pairs)  # every pair row written (NaN-poisoned), each close to its expert's output
    ref = moe_experts_reference(x, ids, weights, w13, w2, swiglu_limit=1.0)  # the clamps bite at 1.0
    _check(moe_experts(x, ids, weights, w13, w2, swiglu_limit=1.0, impl="triton", config=config), ref)


def test_no_clamp_and_one_token(gen: torch.Generator, device: torch.device) -> None:
    experts, hidden, inter = 3, 64, 64
    x = torch.randn(1, hidden, generator=gen, device=device).bfloat16()
    ids, weights = _routing(1, experts, 2, gen, device)
    w13, w2 = _weights(experts, 2 * inter, hidden, True, gen, device), _weights(experts, hidden, inter, True, gen, device)
    _check(moe_experts(x, ids, weights, w13, w2, swiglu_limit=0.0, impl="triton",
                       config=MoeConfig(block_n=64, block_k=64)),
           moe_experts_reference(x, ids, weights, w13, w2, swiglu_limit=0.0))


def test_grouped_mm_matches_reference(gen: torch.Generator, device: torch.device) -> None:
    experts, hidden, inter, tokens = 5, 64, 32, 17
    x = torch.randn(tokens, hidden, generator=gen, device=device).bfloat16()
    ids, weights = _routing(tokens, experts, 2, gen, device)
    w13, w2 = _weights(experts, 2 * inter, hidden, False, gen, device), _weights(experts, hidden, inter, False, gen,
                                                                                  device)
    _check(moe_experts(x, ids, weights, w13, w2, swiglu_limit=3.0, impl="grouped_mm"),
           moe_experts_reference(x, ids, weights, w13, w2, swiglu_limit=3.0))


def test_dispatch_tiles(device: torch.device) -> None:
    ids = torch.tensor([[2, 0], [2, 1], [2, 0]], device=device)  # expert 0: 2 pairs, 1: 1, 2: 3, 3: 0
    plan = dispatch(ids, num_experts=4, block_m=2)
    assert plan.block_expert.tolist()[:4] == [0, 1, 2, 2] and set(plan.block_expert.tolist()[4:]) <= {-1}
    rows = plan.padded_pair.view(-1, 2).tolist()
    assert rows[:4] == [[1, 5], [3, -1], [0, 2], [4, -1]]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("tokens", [64, 2048])
def test_gpu_realistic(tokens: int, gen: torch.Generator, device: torch.device) -> None:
    # the released intermediate width; hidden 2048 (not 5120) keeps the float32 reference small
    experts, hidden, inter, top_k = 16, 2048, 2304, 6
    x = torch.randn(tokens, hidden, generator=gen, device=device).bfloat16()
    ids, weights = _routing(tokens, experts, top_k, gen, device)
    for fp4 in (True, False):
        w13 = _weights(experts, 2 * inter, hidden, fp4, gen, device)
        w2 = _weights(experts, hidden, inter, fp4, gen, device)
        ref = moe_experts_reference(x, ids, weights, w13, w2, swiglu_limit=10.0)
        _check(moe_experts(x, ids, weights, w13, w2, swiglu_limit=10.0, impl="triton"), ref)
        if not fp4:
            _check(moe_experts(x, ids, weights, w13, w2, swiglu_limit=10.0, impl="grouped_mm"), ref)
