"""CSA2 compressor fused with the record writer, and the index-key writer.

The reference model's compressor (`DeepseekV41Compressor`, KV-source layers) turns the hidden
states of `m = compress_ratio` consecutive tokens into one KV latent:

* m > 1: per token, `kv = x @ wkv^T` and `gate = x @ wgate^T` in float32; per group and channel,
  `latent = sum_r kv[r] * softmax_r(gate[r])` (fp32), cast to the activation dtype;
* m = 1: `latent = x @ wkv^T` (activation dtype), no gate;

then `latent = RMSNorm(latent)` (the returned, *pre-RoPE* latent the indexer's `wk` reads), then
RoPE of its last `rope_dim` channels at the group's first position (`cos`/`sin` of the compress
rope, computed by the caller), then the FP4 main-KV record (288 B at 512) at the group's slot.
The index key of a group is `RMSNorm_k(latent @ wk^T)`, RoPE'd at the same position, as an FP4
index-key record (68 B at 128): :func:`norm_rope_write_index_key`.

The projections are GEMMs and stay with the caller (cuBLAS); the kernel fuses everything after
them: pool, RMSNorm, RoPE, quantize, pack, store (one read of the projections, one write of the
records and of the latent). Groups are complete ones only: the caller keeps a partial group's
projected rows (fewer than m) and prepends them to the next call, as the reference's cache does.

Layers: `_compress_kernel` (`_compressor_kernels.py`), the launchers :func:`compress_write_main_kv`
and :func:`norm_rope_write_index_key`, and the torch references :func:`compress_reference` /
:func:`norm_rope_reference` that follow the reference model's dtype steps exactly (the kernel
rounds at the same steps; its exp / rsqrt / sums may differ by an ulp, so a record can differ
from the reference's in rare elements that sit on a rounding boundary).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cedserve.kernels.paged import PagedRecords
from cedserve.kernels.records import record_format, write_records_reference
from cedserve.kernels.triton_support import (
    Impl,
    cdiv,
    check_tensor,
    hardware_fp8,
    next_power_of_2,
    pdl_launch,
    resolve_impl,
)

_FLOATS = (torch.float32, torch.bfloat16)
_ROUND_CODE = {torch.float32: 0, torch.bfloat16: 1}


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The reference's interleaved RoPE of the last `2 * cos.shape[-1]` channels of `x [G, D]`:
    fp32 math, result in `x.dtype`."""
    pairs = cos.shape[-1]
    nope, rot = x[..., : x.shape[-1] - 2 * pairs], x[..., x.shape[-1] - 2 * pairs:]
    even, odd = rot[..., 0::2].float(), rot[..., 1::2].float()
    c, s = cos.float(), sin.float()
    rotated = torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The reference's RMSNorm: fp32 statistics, normalised value cast to `x.dtype`, then
    `weight *` (result in the promoted dtype)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE of the last `2 * cos.shape[-1]` channels of a latent `x [G, D]` as the compressor
    applies it before the record (fp32 math, result in `x.dtype`): the records of
    :func:`compress_write_main_kv` are bit for bit `pack_main_kv(rope_reference(latent, cos, sin))`
    of the latent it returns."""
    return _rope(x, cos, sin)


def pool_groups(kv: Tensor, gate: Tensor | None, ratio: int, act_dtype: torch.dtype) -> Tensor:
    """Softmax-gated pooling of `ratio` consecutive rows: `kv, gate [G * ratio, D]` -> `[G, D]` in
    `act_dtype` (ratio 1: `kv` itself, cast)."""
    if ratio == 1 or gate is None:
        return kv.to(act_dtype)
    groups = kv.shape[0] // ratio
    kv_g = kv.float().view(groups, ratio, -1)
    weights = gate.float().view(groups, ratio, -1).softmax(dim=1)
    return (kv_g * weights).sum(dim=1).to(act_dtype)


def compress_reference(kv: Tensor, gate: Tensor | None, norm_weight: Tensor, eps: float, cos: Tensor,
                       sin: Tensor, ratio: int, act_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(pre-RoPE latent `[G, D]`, RoPE'd latent `[G, D]`), both in
    `promote(norm_weight.dtype, act_dtype)`: the values the reference model stores (before the
    FP4 quantizer) and hands to the indexer."""
    latent = _rms_norm(pool_groups(kv, gate, ratio, act_dtype), norm_weight, eps)
    return latent, _rope(latent, cos, sin)


def compress_error_bound(kv: Tensor, gate: Tensor | None, norm_weight: Tensor, eps: float, ratio: int,
                         act_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(exact latent `[G, D]` in float64, per-element error bound) for checking a computed latent
    (the kernel's or :func:`compress_reference`'s) as `|latent - exact| <= bound`.

    The latent is three roundings to the output dtype (pooled value, normalised value, times the
    weight), each within half an ulp, i.e. `u = 2**-8` (bf16) or `2**-24` (fp32) relative; the
    fp32 pooling sum, exp, division and rsqrt add a few fp32 ulps, relative to the pooled *terms*
    (`sum_r |kv_r * softmax_r|`), which exceed the result where the sum cancels. So
    `bound = C * u * (|exact| + rstd * |weight| * sum_r |kv_r * softmax_r|)` with C = 4 for bf16
    (3 roundings + slack) and 16 for fp32 (3 roundings + GPU exp / division / rsqrt, ~2 ulps each).
    Two correct implementations may differ by one bf16 ulp of the pooled value, which RMSNorm and
    the weight carry into up to 2-3 ulps of the latent: a tighter check against the fp32 reference
    itself would flag correct kernels."""
    dim = kv.shape[-1]
    kv64 = kv.double().view(-1, ratio, dim)
    if ratio > 1 and gate is not None:
        terms = kv64 * gate.double().view(-1, ratio, dim).softmax(dim=1)
    else:
        terms = kv64
    pooled = terms.sum(dim=1)
    rstd = torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + eps)
    weight = norm_weight.double()
    exact = weight * pooled * rstd
    unit, factor = (2.0**-8, 4.0) if torch.promote_types(norm_weight.dtype, act_dtype) == torch.bfloat16 else (2.0**-24, 16.0)
    bound = factor * unit * (exact.abs() + rstd * weight.abs() * terms.abs().sum(dim=1))
    return exact, bound


def norm_rope_reference(k: Tensor, norm_weight: Tensor, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE(RMSNorm(k)): an index key before its FP4 quantizer (`k [G, D]` in the activation dtype)."""
    return _rope(_rms_norm(k, norm_weight, eps), cos, sin)


def _check_common(op: str, x: Tensor, groups: int, norm_weight: Tensor, cos: Tensor, sin: Tensor,
                  slot_mapping: Tensor, dest: PagedRecords, kind: str) -> int:
    dim = x.shape[1]
    check_tensor(norm_weight, f"{op}: norm_weight", dtypes=_FLOATS, dim=1)
    if norm_weight.shape[0] != dim:
        raise ValueError(f"{op}: norm_weight must be [{dim}], got {list(norm_weight.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(t, f"{op}: {name}", dtypes=_FLOATS, dim=2)
        if t.shape[0] != groups or 2 * t.shape[1] > dim:
            raise ValueError(f"{op}: {name} must be [{groups}, rope_dim / 2 <= {dim // 2}], got {list(t.shape)}")
    if cos.shape != sin.shape or cos.stride() != sin.stride() or cos.dtype != sin.dtype:
        raise ValueError(f"{op}: cos and sin must have one shape, dtype and strides")
    check_tensor(slot_mapping, f"{op}: slot_mapping", dtypes=(torch.int32, torch.int64), dim=1)
    if slot_mapping.shape[0] != groups:
        raise ValueError(f"{op}: slot_mapping must have {groups} entries, got {slot_mapping.shape[0]}")
    fmt = record_format(kind)
    if fmt.record_bytes(dim) != dest.record_bytes:
        raise ValueError(f"{op}: D={dim} makes {fmt.record_bytes(dim)} B records, dest holds {dest.record_bytes} B")
    half = dim // 2
    pairs_per_block = fmt.scale_block // 2
    if half & (half - 1) or half < pairs_per_block:
        raise ValueError(f"{op}: the kernel needs D / 2 to be a power of two >= {pairs_per_block}, got D={dim}")
    return dim


def _launch(op: str, kv: Tensor, gate: Tensor | None, ratio: int, act_dtype: torch.dtype, norm_weight: Tensor,
            eps: float, cos: Tensor, sin: Tensor, slot_mapping: Tensor, dest: PagedRecords, kind: str,
            latent: Tensor | None) -> None:
    from cedserve.kernels import _compressor_kernels as k

    groups, dim = slot_mapping.shape[0], kv.shape[1]
    if groups == 0:
        return
    fmt = record_format(kind)
    half = dim // 2
    nb = dim // fmt.scale_block
    wpb = fmt.scale_block // 8
    word_stores = dest.alignment >= 4
    out_dtype = torch.promote_types(norm_weight.dtype, act_dtype)
    block_g = max(1, min(16, 2048 // next_power_of_2(dim)))
    gate_t = gate if gate is not None else kv
    latent_t = latent if latent is not None else kv
    k._compress_kernel[(cdiv(groups, block_g),)](
        kv, kv.stride(0), gate_t, gate_t.stride(0), norm_weight, cos, sin, cos.stride(0),
        slot_mapping, dest.storage, latent_t, latent_t.stride(0),
        groups, float(eps),
        dest.num_slots, dest.offset_bytes, dest.slots_per_block, dest.slot_stride_bytes, dest.block_stride_bytes,
        RATIO=ratio, FORMAT=fmt.format_id, HALF=half, NB=nb, WPB=wpb, ROPE_PAIRS=cos.shape[1],
        ACT_ROUND=_ROUND_CODE[act_dtype], OUT_ROUND=_ROUND_CODE[out_dtype], BLOCK_G=block_g,
        WORD_STORES=word_stores, SCALE_WORDS=word_stores and nb % 4 == 0, WRITE_LATENT=latent is not None,
        HW_FP8=hardware_fp8(kv.device), num_warps=4, enable_fp_fusion=False, **pdl_launch(kv.device),
    )


def compress_write_main_kv(kv: Tensor, gate: Tensor | None, norm_weight: Tensor, eps: float, cos: Tensor,
                           sin: Tensor, slot_mapping: Tensor, dest: PagedRecords, *, ratio: int,
                           act_dtype: torch.dtype = torch.bfloat16, latent_out: Tensor | None = None,
                           impl: Impl = "auto") -> Tensor:
    """Compress `G` complete groups and write their main-KV records; returns the pre-RoPE latent
    `[G, D]` (dtype `promote(norm_weight.dtype, act_dtype)`, written into `latent_out` if given).

    `kv [G * ratio, D]` (and `gate`, same shape, for ratio > 1; None for ratio 1) are the
    compressor's projections (fp32 for ratio > 1, as the reference computes them); `cos/sin
    [G, rope_dim / 2]` the compress rope at each group's first position; `slot_mapping [G]` the
    groups' main-KV slots (-1 = compute the latent but skip the record)."""
    op = "compress_write_main_kv"
    if ratio < 1:
        raise ValueError(f"{op}: ratio must be >= 1, got {ratio}")
    check_tensor(kv, f"{op}: kv", dtypes=_FLOATS, dim=2)
    if kv.shape[0] % ratio:
        raise ValueError(f"{op}: kv rows ({kv.shape[0]}) must be whole groups of {ratio}")
    groups = kv.shape[0] // ratio
    if ratio > 1:
        if gate is None:
            raise ValueError(f"{op}: ratio {ratio} needs the gate projection")
        check_tensor(gate, f"{op}: gate", dtypes=_FLOATS, dim=2)
        if gate.shape != kv.shape:
            raise ValueError(f"{op}: gate must match kv {list(kv.shape)}, got {list(gate.shape)}")
    if act_dtype not in _ROUND_CODE:
        raise TypeError(f"{op}: act_dtype must be float32 or bfloat16, got {act_dtype}")
    _check_common(op, kv, groups, norm_weight, cos, sin, slot_mapping, dest, "main")
    out_dtype = torch.promote_types(norm_weight.dtype, act_dtype)
    if latent_out is None:
        latent_out = torch.empty(groups, kv.shape[1], dtype=out_dtype, device=kv.device)
    elif latent_out.shape != (groups, kv.shape[1]) or latent_out.dtype != out_dtype or latent_out.stride(-1) != 1:
        raise ValueError(f"{op}: latent_out must be [{groups}, {kv.shape[1]}] {out_dtype} with contiguous rows")
    tensors = [kv, norm_weight, cos, sin, slot_mapping, dest.storage, latent_out] + ([gate] if gate is not None else [])
    if resolve_impl(impl, op, *tensors) == "torch":
        latent, rotated = compress_reference(kv, gate if ratio > 1 else None, norm_weight, eps, cos, sin, ratio,
                                             act_dtype)
        write_records_reference("main", rotated, slot_mapping, dest)
        return latent_out.copy_(latent)
    _launch(op, kv, gate if ratio > 1 else None, ratio, act_dtype, norm_weight, eps, cos, sin, slot_mapping, dest,
            "main", latent_out)
    return latent_out


def norm_rope_write_index_key(k: Tensor, norm_weight: Tensor, eps: float, cos: Tensor, sin: Tensor,
                              slot_mapping: Tensor, dest: PagedRecords, *, impl: Impl = "auto") -> None:
    """Index keys of `G` groups: `k [G, D]` (`latent @ wk^T`, activation dtype) -> RMSNorm ->
    RoPE at the groups' first positions (`cos/sin [G, rope_dim / 2]`) -> FP4 index-key records at
    `slot_mapping [G]`."""
    op = "norm_rope_write_index_key"
    check_tensor(k, f"{op}: k", dtypes=_FLOATS, dim=2)
    _check_common(op, k, k.shape[0], norm_weight, cos, sin, slot_mapping, dest, "index")
    if resolve_impl(impl, op, k, norm_weight, cos, sin, slot_mapping, dest.storage) == "torch":
        write_records_reference("index", norm_rope_reference(k, norm_weight, eps, cos, sin), slot_mapping, dest)
        return
    _launch(op, k, None, 1, k.dtype, norm_weight, eps, cos, sin, slot_mapping, dest, "index", None)
