"""FP8 block-scaled and FP4 expert weight formats: layout, round trip, errors."""

from __future__ import annotations

import pytest
import torch

from cedserve.kernels.weight_formats import (
    dequantize_fp4_weight,
    dequantize_fp8_weight,
    quantize_fp4_weight,
    quantize_fp8_weight,
)


@pytest.mark.parametrize("shape", [(1, 1), (128, 128), (130, 257), (7, 300)])
def test_fp8_weight_round_trip(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(hash(shape) % 1000)
    w = torch.randn(shape, generator=g, dtype=torch.float64) * 0.05
    q, s = quantize_fp8_weight(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # UE8M0: powers of two
    back = dequantize_fp8_weight(q, s, torch.float64)
    # E4M3 keeps 3 mantissa bits: relative error per element <= 2^-4 for normal values; the
    # power-of-two scale can push small elements into subnormals, so bound the norm too.
    assert torch.linalg.norm(back - w) / torch.linalg.norm(w) < 0.04
    tile_amax = w.abs().max()
    assert (back - w).abs().max() <= tile_amax * 2.0**-4


def test_fp8_weight_exact_on_grid_values() -> None:
    w = torch.tensor([[1.0, -0.5, 0.25, 448.0 / 64]], dtype=torch.float32)
    q, s = quantize_fp8_weight(w)
    assert torch.equal(dequantize_fp8_weight(q, s), w)


def test_fp8_weight_scale_shape_is_checked() -> None:
    q, s = quantize_fp8_weight(torch.randn(200, 200))
    with pytest.raises(ValueError, match="weight_scale_inv"):
        dequantize_fp8_weight(q, s[:1])


@pytest.mark.parametrize("shape", [(1, 32), (3, 64), (65, 96)])
def test_fp4_weight_layout_and_round_trip(shape: tuple[int, int]) -> None:
    w = torch.randn(shape, dtype=torch.float64) * 0.02
    packed, scale = quantize_fp4_weight(w)
    assert packed.shape == (shape[0], shape[1] // 2) and scale.shape == (shape[0], shape[1] // 32)
    back = dequantize_fp4_weight(packed, scale, torch.float64)
    # E2M1 with a power-of-two scale: worst-case error is half the widest grid step (1 of 6)
    # times the scale, i.e. <= amax/6 * 2 * 0.5 per block; check per block.
    blocks = w.view(shape[0], -1, 32)
    bound = blocks.abs().amax(-1, keepdim=True) / 6 * 2 * 0.5 * 2  # scale <= 2 * amax / 6
    assert ((back.view_as(blocks) - blocks).abs() <= bound + 1e-12).all()


def test_fp4_weight_nibble_order() -> None:
    # A block whose amax is 6 gets scale 2^0 (byte 127); values on the grid encode exactly.
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2] = 6.0, -0.5, 1.5
    packed, scale = quantize_fp4_weight(w)
    assert scale.tolist() == [[127]]
    assert packed[0, 0].item() == (0x7 | (0x9 << 4))  # even element (6.0) low, odd (-0.5) high
    assert packed[0, 1].item() == 0x3  # 1.5, then +0
    assert torch.equal(dequantize_fp4_weight(packed, scale), w)


def test_non_finite_weights_rejected() -> None:
    bad = torch.ones(4, 32)
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_fp8_weight(bad)
    with pytest.raises(ValueError, match="NaN"):
        quantize_fp4_weight(bad)
