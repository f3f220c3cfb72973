"""Which outputs of a pass depend on a value that float32 noise can round either way.

Two float32 computations of one value (another BLAS or vector ISA, a batch of rows against one row,
the prefill runner's fused projections against the modules) differ in the last bits. Where that
value is then quantized (an FP8 or FP4 record's code or scale, a bf16 rounding) and lies within the
noise of a rounding boundary, the two round apart by one step, and the step reaches later positions
and layers: ~1e-3 in logits, 0.1-0.3 where it also flips a near-tied top-k pick of an indexer (see
the reference fixture's README). Which values lie that close is a property of the weights and
inputs; which way each rounds is the machine's. So a test comparing two paths cannot demand
float-noise agreement everywhere, but it can ask the model which outputs such a tie can reach:
`rounding_envelope` reruns one path with every quantizer input, indexer top-k score and MoE route
nudged by noise twice the largest measured cross-CPU difference (fresh noise per seed) and reports
how far each output moved.
A row that no nudge moved, nor any row before it, depends on no near-tie and must agree to float
noise; later rows may differ by about as much as the nudges moved rows (`assert_close_but_near_ties`).

Measured on fixture A (a Xeon with AVX-512, its AVX2 and SSE4.2 kernel sets): quantizer inputs of
two kernel sets differ by <= 2e-6 of their block's largest magnitude before the first flip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from cedserve.kernels import reference
from cedserve.model import attention, kv_format, moe, paged_attention
from cedserve.model.config import ModelConfig

NUDGE = 2e-6
"""Nudge size (the noise's standard deviation), relative to each quantization block's largest
magnitude (bf16: to the value): twice the largest cross-CPU difference measured, so a tie the other
machine rounded apart is crossed by about half the nudges."""
SEEDS = 8
"""Reruns; a tie within the cross-CPU noise escapes all of them with probability ~0.5**8."""


@contextmanager
def nudged_quantizers(seed: int, nudge: float = NUDGE) -> Iterator[None]:
    """Within the block, every FP8/FP4 quantization (`cedserve.kernels.reference`: records and fake
    quantization alike) sees its input plus Gaussian noise of `nudge` times the block's largest
    magnitude; every bf16 KV rounding (`cedserve.model.kv_format`), every indexer top-k pick (the
    dense path's scores, the paged path's per-head weights) and every MoE routing (`moe.route`: its
    gate weight) sees its input times `1 + nudge * noise`
    (exact ties, as the ReLU's zeros, stay ties: both paths break those alike). Only the rounded
    values and the picks change."""
    gen = torch.Generator().manual_seed(seed)

    def noise(x: Tensor, scale: Tensor) -> Tensor:
        return x + nudge * scale * torch.randn(x.shape, generator=gen, dtype=x.dtype)

    def relative(x: Tensor) -> Tensor:
        return torch.where(torch.isfinite(x), noise(x, x.abs()), x)

    saved = {
        (reference, "_fp8_quantize"): reference._fp8_quantize,
        (reference, "_fp4_quantize"): reference._fp4_quantize,
        (kv_format, "_round_bf16"): kv_format._round_bf16,
        (kv_format, "_bf16_bytes"): kv_format._bf16_bytes,
        (attention, "select_topk"): attention.select_topk,
        (attention, "select_candidate_blocks"): attention.select_candidate_blocks,
        (paged_attention, "index_topk"): paged_attention.index_topk,
        (moe, "route"): moe.route,
    }
    fp8, fp4 = reference._fp8_quantize, reference._fp4_quantize
    round_bf16, bf16_bytes = kv_format._round_bf16, kv_format._bf16_bytes
    select_topk, select_blocks, index_topk = (
        attention.select_topk,
        attention.select_candidate_blocks,
        paged_attention.index_topk,
    )
    route = moe.route

    def fp8_nudged(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return fp8(noise(blocks, blocks.abs().amax(-1, keepdim=True)))

    def fp4_nudged(blocks: Tensor, scale_format: str) -> tuple[Tensor, Tensor, Tensor]:
        return fp4(noise(blocks, blocks.abs().amax(-1, keepdim=True)), scale_format)

    def round_bf16_nudged(x: Tensor) -> Tensor:
        return round_bf16(relative(x.float()))

    def bf16_bytes_nudged(x: Tensor) -> Tensor:
        return bf16_bytes(relative(x.float()))

    def select_topk_nudged(scores: Tensor, k: int) -> Tensor:
        return select_topk(relative(scores), k)

    def select_blocks_nudged(scores: Tensor, visible: Tensor, topk_blocks: int, block_size: int) -> Tensor:
        return select_blocks(relative(scores), visible, topk_blocks, block_size)

    def index_topk_nudged(q: Tensor, weights: Tensor, *args: Any, **kwargs: Any) -> Any:
        return index_topk(q, relative(weights), *args, **kwargs)

    def route_nudged(x: Tensor, weight: Tensor, bias: Tensor, config: ModelConfig) -> tuple[Tensor, Tensor]:
        return route(x, relative(weight.float()), bias, config)

    reference._fp8_quantize, reference._fp4_quantize = fp8_nudged, fp4_nudged
    kv_format._round_bf16, kv_format._bf16_bytes = round_bf16_nudged, bf16_bytes_nudged
    attention.select_topk, attention.select_candidate_blocks = select_topk_nudged, select_blocks_nudged
    paged_attention.index_topk = index_topk_nudged
    moe.route = route_nudged
    try:
        yield
    finally:
        for (module, name), original in saved.items():
            setattr(module, name, original)


def rounding_envelope(run: Callable[[], Tensor], seeds: int = SEEDS) -> Tensor:
    """How far each element of `run()` moves, at most, when its quantizers' inputs are nudged
    (`nudged_quantizers`, `seeds` reruns): zero where no near-tie reaches it."""
    base = run()
    moved = torch.zeros_like(base)
    for seed in range(seeds):
        with nudged_quantizers(seed):
            moved = torch.maximum(moved, (run() - base).abs())
    return moved


def causal_reach(moved: Tensor, sequences: Tensor | None = None) -> Tensor:
    """For each row, the most `moved` holds at it or at an earlier row of its sequence: rows
    `[rows]` in causal order within each sequence; `sequences [rows]` labels each row's sequence
    (None: all one sequence). Independent sequences (a batch's slots) do not reach each other."""
    if sequences is None:
        return torch.cummax(moved, dim=0).values
    reach = torch.empty_like(moved)
    for label in sequences.unique():
        rows = (sequences == label).nonzero().squeeze(1)
        reach[rows] = torch.cummax(moved[rows], dim=0).values
    return reach


def assert_close_but_near_ties(
    got: Tensor, want: Tensor, run: Callable[[], Tensor], tight: float, flip_margin: float, what: str,
    sequences: Tensor | None = None,
) -> None:
    """`got` (what `run()` returns, rows `[positions, ...]` in causal order) equals `want` within
    `tight` in each row (other dims reduced) that no nudge moves and no nudge moves a row before:
    those depend on no near-tie. Later rows may differ by up to `flip_margin` times the farthest the
    nudges moved any row up to them (`rounding_envelope(run)`): once a tie rounded apart has moved the
    stream, later rows' own discrete picks (an indexer's top-k, the MoE route) may flip too, each
    moving its row about as far as the picks the nudges flipped. The envelope is computed only when
    some row is off by more than `tight`. With `sequences` (`causal_reach`), rows come from several
    independent sequences, each in causal order, and "before" means earlier in the same sequence."""
    error = (got - want).abs().flatten(1).amax(-1)
    worst = int(error.argmax())
    if error[worst] <= tight:
        return
    moved = rounding_envelope(run).flatten(1).amax(-1)
    reach = causal_reach(moved, sequences)
    excess = error - (tight + flip_margin * reach)
    row = int(excess.argmax())
    assert excess[row] <= 0, (
        f"{what}: row {row} is off by {error[row].item():.3g}; nudges moved rows up to it by <= {reach[row].item():.3g}"
        f" (worst abs error {error[worst].item():.3g} at row {worst}; first row a near-tie reaches:"
        f" {int((moved > tight).int().argmax()) if bool((moved > tight).any()) else None})"
    )
