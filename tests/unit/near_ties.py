"""Which outputs of a pass depend on a value that float32 noise can round either way.

Two float32 computations of one value (another BLAS or vector ISA, a batch of rows against one row,
the prefill runner's fused projections against the modules) differ in the last bits. Where that
value is then quantized (an FP8 or FP4 record's code or scale, a bf16 rounding) and lies within the
noise of a rounding boundary, the two round apart by one step, and the step reaches later positions
and layers: ~1e-3 in logits, 0.1-0.3 where it also flips a near-tied top-k pick of an indexer (see
the reference fixture's README). Which values lie that close is a property of the weights and
inputs; which way each rounds is the machine's. So a test comparing two paths cannot demand
float-noise agreement everywhere, but it can ask the model which outputs such a tie can reach:
`rounding_envelope` reruns one path with every quantizer input nudged by noise a few times larger
than the measured cross-CPU noise (fresh noise per seed) and reports how far each output moved.
An output that no nudge moved depends on no near-tie, and must agree to float noise; one that moved
may differ, by about as much as the nudges moved it (`assert_close_but_near_ties`).

Measured on fixture A (a Xeon with AVX-512, its AVX2 and SSE4.2 kernel sets): quantizer inputs of
two kernel sets differ by <= 2e-6 of their block's largest magnitude before the first flip.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from cedserve.kernels import reference
from cedserve.model import kv_format

NUDGE = 2e-6
"""Nudge size (the noise's standard deviation), relative to each quantization block's largest
magnitude (bf16: to the value): twice the largest cross-CPU difference measured, so a tie the other
machine rounded apart is crossed by about half the nudges."""
SEEDS = 8
"""Reruns; a tie within the cross-CPU noise escapes all of them with probability ~0.5**8."""


@contextmanager
def nudged_quantizers(seed: int, nudge: float = NUDGE) -> Iterator[None]:
    """Within the block, every FP8/FP4 quantization (`cedserve.kernels.reference`: records and fake
    quantization alike) and every bf16 KV rounding (`cedserve.model.kv_format`) sees its input plus
    Gaussian noise of `nudge` times the block's largest magnitude. Only the rounded values change."""
    gen = torch.Generator().manual_seed(seed)

    def noise(x: Tensor, scale: Tensor) -> Tensor:
        return x + nudge * scale * torch.randn(x.shape, generator=gen, dtype=x.dtype)

    fp8, fp4 = reference._fp8_quantize, reference._fp4_quantize
    round_bf16, bf16_bytes = kv_format._round_bf16, kv_format._bf16_bytes

    def fp8_nudged(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return fp8(noise(blocks, blocks.abs().amax(-1, keepdim=True)))

    def fp4_nudged(blocks: Tensor, scale_format: str) -> tuple[Tensor, Tensor, Tensor]:
        return fp4(noise(blocks, blocks.abs().amax(-1, keepdim=True)), scale_format)

    def round_bf16_nudged(x: Tensor) -> Tensor:
        return round_bf16(noise(x.float(), x.float().abs()))

    def bf16_bytes_nudged(x: Tensor) -> Tensor:
        return bf16_bytes(noise(x.float(), x.float().abs()))

    reference._fp8_quantize, reference._fp4_quantize = fp8_nudged, fp4_nudged
    kv_format._round_bf16, kv_format._bf16_bytes = round_bf16_nudged, bf16_bytes_nudged
    try:
        yield
    finally:
        reference._fp8_quantize, reference._fp4_quantize = fp8, fp4
        kv_format._round_bf16, kv_format._bf16_bytes = round_bf16, bf16_bytes


def rounding_envelope(run: Callable[[], Tensor], seeds: int = SEEDS) -> Tensor:
    """How far each element of `run()` moves, at most, when its quantizers' inputs are nudged
    (`nudged_quantizers`, `seeds` reruns): zero where no near-tie reaches it."""
    base = run()
    moved = torch.zeros_like(base)
    for seed in range(seeds):
        with nudged_quantizers(seed):
            moved = torch.maximum(moved, (run() - base).abs())
    return moved


def assert_close_but_near_ties(
    got: Tensor, want: Tensor, run: Callable[[], Tensor], tight: float, flip_margin: float, what: str
) -> None:
    """`got` (what `run()` returns) equals `want` within `tight + flip_margin * moved` in each row
    (last dim reduced; leading dims flattened), `moved` being how far the nudges moved that row
    (`rounding_envelope(run)`): within `tight` where no near-tie reaches, and where one does, by
    about as much as rounding it the other way moved the row here. The envelope is computed only
    when some row is off by more than `tight`."""
    error = (got - want).abs().flatten(0, -2).amax(-1)
    worst = int(error.argmax())
    if error[worst] <= tight:
        return
    moved = rounding_envelope(run).flatten(0, -2).amax(-1)
    excess = error - (tight + flip_margin * moved)
    row = int(excess.argmax())
    assert excess[row] <= 0, (
        f"{what}: row {row} is off by {error[row].item():.3g}, its near-ties move it by {moved[row].item():.3g}"
        f" (worst abs error {error[worst].item():.3g} at row {worst}; {int((moved > tight).sum())}/{moved.numel()}"
        f" rows reachable from a near-tie)"
    )
