"""Interleaved partial RoPE: the plain `main` table (SWA-only layers) and the YaRN `compress` table.

Only the last `qk_rope_head_dim` channels of a vector rotate; channel pairs (2i, 2i+1) of that
slice form one complex number. Layers with a compressed branch rotate queries, window KV,
compressed entries and indexer vectors with the `compress` table; SWA-only layers use `main`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


def default_inv_freq(theta: float, rope_dim: int) -> Tensor:
    """`theta ** (-2i / rope_dim)` for i < rope_dim / 2, float32 `[rope_dim // 2]`."""
    return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))


def _yarn_correction_dim(rotations: float, rope_dim: int, theta: float, original_len: int) -> float:
    return (rope_dim * math.log(original_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))


def yarn_inv_freq(params: Mapping[str, Any], rope_dim: int, max_position_embeddings: int) -> Tensor:
    """YaRN frequencies: interpolated (divided by `factor`) below the `beta_slow` rotation
    count, untouched above `beta_fast`, a linear ramp between (bounds floored/ceiled)."""
    theta = float(params["rope_theta"])
    original_len = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original_len
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)
    low = _yarn_correction_dim(beta_fast, rope_dim, theta, original_len)
    high = _yarn_correction_dim(beta_slow, rope_dim, theta, original_len)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight


class RopeTable:
    """One rope flavour: inverse frequencies plus the cos/sin scaling (YaRN's attention factor)."""

    def __init__(self, params: Mapping[str, Any], head_dim: int, max_position_embeddings: int) -> None:
        self.rope_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            self.inv_freq = default_inv_freq(float(params["rope_theta"]), self.rope_dim)
            self.scaling = 1.0
        elif rope_type == "yarn":
            self.inv_freq = yarn_inv_freq(params, self.rope_dim, max_position_embeddings)
            factor = float(params.get("factor") or 1.0)
            default_scaling = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
            self.scaling = float(params.get("attention_factor") or default_scaling)
        else:
            raise ValueError(f"rope_parameters: unsupported rope_type {rope_type!r}")

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos/sin at integer `positions [N]`, each float32 `[N, rope_dim // 2]`."""
        return rope_cos_sin(positions, self.inv_freq.to(positions.device), self.scaling)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
    """`RopeTable.cos_sin` from its inverse frequencies `[rope_dim // 2]` and scaling (a pure function of
    tensors, for compiled callers)."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.unsqueeze(0)
    return freqs.cos() * scaling, freqs.sin() * scaling


def device_rope(table: RopeTable, device: torch.device) -> RopeTable:
    """`table` with its inverse frequencies on `device`: `cos_sin` then copies nothing from the host
    (what a captured step needs)."""
    moved = copy.copy(table)
    moved.inv_freq = table.inv_freq.to(device)
    return moved


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Rotate the trailing `2 * cos.shape[-1]` channels of `x [..., D]` by interleaved pairs.

    `cos`/`sin` must broadcast against `x[..., :rope_dim:2]` (e.g. `[S, 1, rope_dim/2]` for
    `x [S, H, D]`). `inverse=True` applies the conjugate rotation.
    """
    if inverse:
        sin = -sin
    rope_dim = cos.shape[-1] * 2
    nope, rot = x[..., :-rope_dim], x[..., -rope_dim:]
    even, odd = rot[..., 0::2].float(), rot[..., 1::2].float()
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)
