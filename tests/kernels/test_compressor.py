"""CSA2 compressor + record writer and index-key writer (`cedserve.kernels.compressor`): the fused
Triton kernel against the torch reference that follows the reference model's dtype steps.

The kernel rounds at the same steps as the reference; its exp / rsqrt / fp32 sums may differ by
a few fp32 ulps (GPU exp2 / rsqrt / division are not the CPU's), which can move a pooled value
across a bf16 rounding boundary, and RMSNorm and the weight carry that one-ulp difference into up to
2-3 bf16 ulps of the latent. So the latent (and the reference's, as a control) is checked against
the float64 latent within `compress_error_bound` (4 half-ulps of bf16, 16 of fp32, relative to the
pooled terms); the records must then be, bit for bit, the records of the kernel's own latent
(`pack_main_kv(rope_reference(latent))`), and decode to the reference's values except in at most
0.5 % of the elements, each off by at most the largest E2M1 step (2 x the block scale). Storage and
the latent output are poisoned first; unwritten bytes would show as mismatches.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from cedserve.kernels.compressor import (
    compress_error_bound,
    compress_reference,
    compress_write_main_kv,
    norm_rope_reference,
    norm_rope_write_index_key,
    rope_reference,
)
from cedserve.kernels.paged import PagedRecords
from cedserve.kernels.records import (
    RecordKind,
    read_records_reference,
    record_format,
    write_records_reference,
)

pytestmark = pytest.mark.kernels
CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _dest(kind: RecordKind, dim: int, slots: int, gen: torch.Generator, device: torch.device) -> PagedRecords:
    rb = record_format(kind).record_bytes(dim)
    pool = torch.randint(0, 256, (-(-slots // 8), 16 + 8 * rb), generator=gen, device=device, dtype=torch.uint8)
    return PagedRecords.region(pool, 16, 8, rb)


def _twin(dest: PagedRecords) -> PagedRecords:
    return PagedRecords(dest.storage.clone(), dest.record_bytes, dest.slots_per_block, dest.slot_stride_bytes,
                        dest.block_stride_bytes, dest.offset_bytes)


def _check_records(kind: RecordKind, dest: PagedRecords, expected: PagedRecords, slots: Tensor) -> None:
    written = torch.zeros(dest.storage.numel(), dtype=torch.bool, device=slots.device)
    starts = dest.byte_offsets(slots[slots >= 0])
    written[(starts.unsqueeze(-1) + torch.arange(dest.record_bytes, device=slots.device)).flatten()] = True
    outside = ~written
    assert torch.equal(dest.storage.view(-1)[outside], expected.storage.view(-1)[outside]), \
        "bytes outside the written records changed"
    got = read_records_reference(kind, dest, slots)
    want = read_records_reference(kind, expected, slots)
    differ = got != want
    assert differ.float().mean() <= 5e-3, f"{int(differ.sum())} of {differ.numel()} decoded values differ"
    block = record_format(kind).scale_block
    amax = want.abs().view(want.shape[0], -1, block).amax(-1, keepdim=True).expand(-1, -1, block).reshape(want.shape)
    top_step = 2 * amax / 6  # the largest E2M1 step (4 -> 6) at the block's scale
    assert bool(((got - want).abs() <= 1.01 * top_step + 1e-30).all())


def _check_latent(latent: Tensor, ref: Tensor, kv: Tensor, gate: Tensor | None, weight: Tensor, eps: float,
                  ratio: int, act: torch.dtype) -> None:
    assert latent.dtype == ref.dtype
    exact, bound = compress_error_bound(kv, gate, weight, eps, ratio, act)
    assert bool(((ref.double() - exact).abs() <= bound).all()), "the reference itself misses the bound"
    err = (latent.double() - exact).abs()
    assert bool((err <= bound).all()), f"latent off by {float((err / bound).max()):.3g} x the bound"


def _check_own_records(dest: PagedRecords, latent: Tensor, cos: Tensor, sin: Tensor, slots: Tensor) -> None:
    """The records are exactly those of the kernel's own latent (RoPE'd by the reference)."""
    own = _twin(dest)
    write_records_reference("main", rope_reference(latent, cos, sin), slots, own)
    assert torch.equal(dest.storage, own.storage), "records differ from pack_main_kv(rope(latent))"


def _tables(groups: int, pairs: int, gen: torch.Generator, device: torch.device) -> tuple[Tensor, Tensor]:
    angle = torch.rand(groups, pairs, generator=gen, device=device) * 50
    return angle.cos(), angle.sin()


@pytest.mark.parametrize(("ratio", "dim", "rope", "act"), [
    (2, 512, 64, torch.bfloat16),  # released CSA2 layers 2, 8, 14
    (1, 512, 64, torch.bfloat16),  # released layer 20
    (2, 64, 16, torch.float32),    # fixture geometry, fp32 model
    (1, 64, 16, torch.bfloat16),
])
def test_compress_write_main_kv(ratio: int, dim: int, rope: int, act: torch.dtype, gen: torch.Generator,
                                device: torch.device) -> None:
    groups = 11 if dim == 512 else 21  # crosses the kernel's 4- / 16-group programs
    kv = torch.randn(groups * ratio, dim, generator=gen, device=device) * 3
    gate = torch.randn(groups * ratio, dim, generator=gen, device=device) * 2 if ratio > 1 else None
    if ratio == 1:
        kv = kv.to(act)  # m = 1: the projection is in the activation dtype
    weight = (1 + 0.2 * torch.randn(dim, generator=gen, device=device)).to(act)
    cos, sin = _tables(groups, rope // 2, gen, device)
    dest = _dest("main", dim, 2 * groups + 5, gen, device)
    expected = _twin(dest)
    slots = torch.randperm(dest.num_slots, generator=gen, device=device)[:groups]
    slots[2] = -1
    latent = torch.full((groups, dim), float("nan"), dtype=act, device=device)
    compress_write_main_kv(kv, gate, weight, 1e-6, cos, sin, slots, dest, ratio=ratio, act_dtype=act,
                           latent_out=latent, impl="triton")
    ref_latent, ref_rotated = compress_reference(kv, gate, weight, 1e-6, cos, sin, ratio, act)
    write_records_reference("main", ref_rotated, slots, expected)
    _check_latent(latent, ref_latent, kv, gate, weight, 1e-6, ratio, act)
    _check_own_records(dest, latent, cos, sin, slots)
    _check_records("main", dest, expected, slots)


@pytest.mark.parametrize(("dim", "rope"), [(128, 64), (32, 16)])
def test_norm_rope_write_index_key(dim: int, rope: int, gen: torch.Generator, device: torch.device) -> None:
    groups = 37
    k = (torch.randn(groups, dim, generator=gen, device=device) * 4).bfloat16()
    weight = (1 + 0.2 * torch.randn(dim, generator=gen, device=device)).bfloat16()
    cos, sin = _tables(groups, rope // 2, gen, device)
    dest = _dest("index", dim, groups + 3, gen, device)
    expected = _twin(dest)
    slots = torch.randperm(dest.num_slots, generator=gen, device=device)[:groups]
    norm_rope_write_index_key(k, weight, 1e-6, cos, sin, slots, dest, impl="triton")
    write_records_reference("index", norm_rope_reference(k, weight, 1e-6, cos, sin), slots, expected)
    _check_records("index", dest, expected, slots)


def test_pooling_is_the_reference_math(device: torch.device) -> None:
    """Two tokens with gates (0, log 3) pool as 1/4 and 3/4; RMSNorm then makes the rms 1."""
    kv = torch.tensor([[4.0, 0.0], [0.0, 4.0]], device=device).repeat(1, 16)
    gate = torch.zeros(2, 32, device=device)
    gate[1] = torch.tensor(3.0).log()
    latent, rotated = compress_reference(kv, gate, torch.ones(32, device=device), 0.0, torch.ones(1, 0, device=device),
                                         torch.zeros(1, 0, device=device), 2, torch.float32)
    assert torch.allclose(latent[0, :2] / latent[0, 1], torch.tensor([1 / 3, 1.0], device=device))
    assert torch.allclose(latent.pow(2).mean(), torch.tensor(1.0, device=device))
    assert torch.equal(rotated, latent)


@pytest.mark.gpu
@requires_cuda
def test_gpu_realistic(gen: torch.Generator, device: torch.device) -> None:
    groups, dim = 4096, 512
    kv = torch.randn(2 * groups, dim, generator=gen, device=device)
    gate = torch.randn(2 * groups, dim, generator=gen, device=device)
    weight = (1 + 0.2 * torch.randn(dim, generator=gen, device=device)).bfloat16()
    cos, sin = _tables(groups, 32, gen, device)
    dest = _dest("main", dim, groups, gen, device)
    expected = _twin(dest)
    slots = torch.randperm(dest.num_slots, generator=gen, device=device)[:groups]
    latent = compress_write_main_kv(kv, gate, weight, 1e-20, cos, sin, slots, dest, ratio=2, impl="triton")
    ref_latent, ref_rotated = compress_reference(kv, gate, weight, 1e-20, cos, sin, 2, torch.bfloat16)
    write_records_reference("main", ref_rotated, slots, expected)
    _check_latent(latent, ref_latent, kv, gate, weight, 1e-20, 2, torch.bfloat16)
    _check_own_records(dest, latent, cos, sin, slots)
    _check_records("main", dest, expected, slots)
