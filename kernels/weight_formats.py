"""Checkpoint weight formats: FP8 block-scaled linear weights and FP4 expert weights.

DeepSeek's released checkpoints store most linear weights as FP8 and the routed experts as FP4:

FP8 linear weight `W` of shape `[out, in]`:
    `name.weight`            float8_e4m3fn `[out, in]`
    `name.weight_scale_inv`  float32 `[ceil(out/128), ceil(in/128)]`: one scale per 128 x 128 tile,
                             a power of two when `scale_fmt` is `ue8m0`
    dequantized `W[i, j] = weight[i, j] * weight_scale_inv[i // 128, j // 128]`

FP4 expert weight `W` of shape `[out, in]` (`in` a multiple of 32):
    `name.weight`            uint8 `[out, in/2]`: E2M1 codes, the even input channel in the low nibble
    `name.weight_scale`      uint8 `[out, in/32]`: UE8M0 exponent bytes, one per 32 input channels
    dequantized `W[i, j] = e2m1(code[i, j]) * 2**(scale[i, j // 32] - 127)`

Both quantizers here produce exactly those tensors from float weights (for the tiny random
checkpoints), and the dequantizers are what the loader uses. Pure torch; imports nothing else of
the project except the E2M1 codec beside it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cedserve.kernels.reference import E2M1_MAX, E4M3_MAX, e2m1_decode, e2m1_encode, ue8m0_decode

FP8_WEIGHT_BLOCK = 128
FP4_WEIGHT_BLOCK = 32


def _pow2_ceil(t: Tensor) -> Tensor:
    return torch.exp2(torch.ceil(torch.log2(t)))


def _tile_view(w: Tensor, block: int) -> tuple[Tensor, int, int]:
    """Pad `[out, in]` to whole tiles and view as `[out_tiles, block, in_tiles, block]`."""
    out_dim, in_dim = w.shape
    ot, it = -(-out_dim // block), -(-in_dim // block)
    padded = torch.zeros(ot * block, it * block, dtype=torch.float32, device=w.device)
    padded[:out_dim, :in_dim] = w.float()
    return padded.view(ot, block, it, block), out_dim, in_dim


def quantize_fp8_weight(w: Tensor, block: int = FP8_WEIGHT_BLOCK, pow2_scales: bool = True) -> tuple[Tensor, Tensor]:
    """`(weight float8_e4m3fn [out, in], weight_scale_inv float32 [ceil(out/b), ceil(in/b)])`."""
    if w.dim() != 2:
        raise ValueError(f"FP8 weights are 2-D, got shape {tuple(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError("cannot quantize a weight with NaN or inf")
    tiles, out_dim, in_dim = _tile_view(w, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12)  # [ot, it]
    scale = amax / E4M3_MAX
    if pow2_scales:
        scale = _pow2_ceil(scale)
    q = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.view(tiles.shape[0] * block, tiles.shape[2] * block)[:out_dim, :in_dim].contiguous()
    return q, scale.contiguous()


def dequantize_fp8_weight(weight: Tensor, scale_inv: Tensor, dtype: torch.dtype = torch.float32,
                          block: int = FP8_WEIGHT_BLOCK) -> Tensor:
    """Float weights from an FP8 weight and its per-tile scales; shapes are checked."""
    out_dim, in_dim = weight.shape
    expected = (-(-out_dim // block), -(-in_dim // block))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} "
                         f"for a [{out_dim}, {in_dim}] weight with {block}x{block} tiles")
    scale = scale_inv.float().repeat_interleave(block, 0)[:out_dim].repeat_interleave(block, 1)[:, :in_dim]
    return (weight.float() * scale).to(dtype)


def quantize_fp4_weight(w: Tensor, block: int = FP4_WEIGHT_BLOCK) -> tuple[Tensor, Tensor]:
    """`(weight uint8 [out, in/2], weight_scale uint8 UE8M0 [out, in/block])`."""
    if w.dim() != 2 or w.shape[1] % block:
        raise ValueError(f"FP4 weights are 2-D with in_features a multiple of {block}, got {tuple(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError("cannot quantize a weight with NaN or inf")
    blocks = w.float().view(w.shape[0], -1, block)
    amax = blocks.abs().amax(dim=-1).clamp_min(E2M1_MAX * 2.0**-126)
    exponent = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-126, 127)
    scale = torch.exp2(exponent)
    codes = e2m1_encode((blocks / scale[..., None]).clamp(-E2M1_MAX, E2M1_MAX)).view(w.shape[0], -1)
    packed = torch.bitwise_or(codes[:, 0::2], torch.bitwise_left_shift(codes[:, 1::2], 4))
    return packed.contiguous(), (exponent + 127).to(torch.uint8)


def dequantize_fp4_weight(weight: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32,
                          block: int = FP4_WEIGHT_BLOCK) -> Tensor:
    """Float weights from packed E2M1 codes and UE8M0 scales; shapes are checked."""
    if weight.dtype not in (torch.uint8, torch.int8) or scale.dtype != torch.uint8:
        raise ValueError(f"FP4 weight must be uint8/int8 with uint8 scales, got {weight.dtype}/{scale.dtype}")
    out_dim, half_in = weight.shape
    if tuple(scale.shape) != (out_dim, 2 * half_in // block):
        raise ValueError(f"weight_scale has shape {tuple(scale.shape)}, expected {(out_dim, 2 * half_in // block)}")
    packed = weight.view(torch.uint8)
    codes = torch.stack([torch.bitwise_and(packed, 0xF), torch.bitwise_right_shift(packed, 4)], dim=-1)
    values = e2m1_decode(codes.view(out_dim, -1)).view(out_dim, -1, block)
    return (values * ue8m0_decode(scale)[..., None]).view(out_dim, -1).to(dtype)
