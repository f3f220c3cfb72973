"""Record writers and readers (`cedserve.kernels.records`): the Triton kernels against the torch
reference, bit for bit, on every byte of poisoned storage.

Each case writes into storage filled with random bytes (poison) and compares the *whole* storage
with the reference's, so a missing byte, a byte written past a record, or a row that should have
been skipped all fail. Readers write into NaN-poisoned outputs and are compared on the float32
bit patterns (signed zeros count).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from cedserve.kernels.paged import PagedRecords
from cedserve.kernels.records import (
    RecordKind,
    read_records,
    read_records_reference,
    record_format,
    write_records,
    write_records_reference,
)

pytestmark = pytest.mark.kernels
CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _poisoned(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> Tensor:
    return torch.randint(0, 256, shape, generator=gen, device=device, dtype=torch.uint8)


def _twin(dest: PagedRecords) -> PagedRecords:
    """Same addressing over a copy of the storage (for the reference)."""
    return PagedRecords(dest.storage.clone(), dest.record_bytes, dest.slots_per_block, dest.slot_stride_bytes,
                        dest.block_stride_bytes, dest.offset_bytes)


def _make_dest(layout: str, record_bytes: int, slots_wanted: int, gen: torch.Generator,
               device: torch.device) -> PagedRecords:
    if layout == "flat":  # rows wider than a record, at an odd byte offset: byte stores
        table = _poisoned((slots_wanted, record_bytes + 11), gen, device)
        return PagedRecords.flat(table[:, 3 : 3 + record_bytes + 5], record_bytes)
    # a pool of blocks holding a region of 8 (or, "region6", 6) records at a 16-aligned offset: word stores
    per_block = 6 if layout == "region6" else 8
    blocks = -(-slots_wanted // per_block)
    pool = _poisoned((blocks, per_block * record_bytes + 48), gen, device)
    return PagedRecords.region(pool, 32, per_block, record_bytes)


def _inputs(tokens: int, dim: int, dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> Tensor:
    """Rows with a wide dynamic range: per-row scales from 2**-20 to 2**20."""
    x = torch.randn(tokens, dim, generator=gen, device=device)
    x = x * torch.exp2(torch.randint(-20, 21, (tokens, 1), generator=gen, device=device).float())
    return x.to(dtype)


def edge_rows(dim: int, block: int, device: torch.device) -> Tensor:
    """float32 rows that sit on every rounding boundary of the three quantizers."""
    rows = [torch.zeros(dim), torch.full((dim,), -0.0), torch.full((dim,), 1e-40), torch.full((dim,), -3e38)]
    e2m1_ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5,
                              -3.5, -5.0, -0.1])
    rows.append(e2m1_ties.repeat(dim // 16))  # UE8M0 scale 1 when the block holds 6
    # E4M3 scale ties: amax / 6 exactly between two E4M3 values (normal and subnormal), and ties
    # of the E4M3 elements of SWA records (scale 2**-8 for amax 0.11)
    for amax_over_6 in (1.0625, 1.5 * 2.0**-9, 2.5 * 2.0**-9, 464.0 / 1.0001, 3.0 * 2.0**-8):
        row = torch.linspace(-1, 1, dim) * amax_over_6 * 6
        row[::block] = amax_over_6 * 6
        rows.append(row)
    e4m3_ties = torch.tensor([1.0625, 1.1875, 0.0048828125 * 1.5, -2.0**-10, 448.0, 460.0, 0.001, -0.0])
    row = e4m3_ties.repeat(dim // 8) * 2.0**-8
    row[::32] = 0.11
    rows.append(row)
    return torch.stack(rows).to(device)


KINDS: list[tuple[RecordKind, int]] = [("main", 512), ("index", 128), ("swa", 512), ("main", 64), ("index", 32),
                                       ("swa", 64)]


def _check_write(kind: RecordKind, x: Tensor, layout: str, gen: torch.Generator, device: torch.device,
                 **launch: int) -> None:
    fmt = record_format(kind)
    rb = fmt.record_bytes(x.shape[1])
    dest = _make_dest(layout, rb, 2 * x.shape[0] + 8, gen, device)
    expected = _twin(dest)
    slots = torch.randperm(dest.num_slots, generator=gen, device=device)[: x.shape[0]]
    if x.shape[0] > 2:
        slots[1] = -1  # skipped row
    write_records(kind, x, slots, dest, impl="triton", **launch)
    write_records_reference(kind, x, slots, expected)
    diff = (dest.storage != expected.storage).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at byte {diff[0].tolist()}"


@pytest.mark.parametrize("layout", ["flat", "region"])
@pytest.mark.parametrize(("kind", "dim"), KINDS)
def test_write_matches_reference(kind: RecordKind, dim: int, layout: str, gen: torch.Generator,
                                 device: torch.device) -> None:
    # token counts cross the kernel's token blocks (8 rows at 512 channels, 32 at 128, 64 at 64)
    tokens = {512: 19, 128: 37, 64: 67, 32: 67}[dim]
    _check_write(kind, _inputs(tokens, dim, torch.bfloat16, gen, device), layout, gen, device)


@pytest.mark.parametrize("layout", ["flat", "region"])
@pytest.mark.parametrize(("kind", "dim"), [k for k in KINDS if k[0] != "swa"])
def test_write_v5_matches_reference(kind: RecordKind, dim: int, layout: str, gen: torch.Generator,
                                    device: torch.device) -> None:
    # v5 (`_write_words_v5_kernel`): 2 tiles per program so rows cross tiles (the prefetched
    # tile) and programs, a ragged last tile, a skipped row; bf16 (fast E2M1) and fp32 (v3 path)
    block_t = 8 if dim == 512 else 16
    x = _inputs(3 * 2 * block_t - 5, dim, torch.bfloat16, gen, device)
    _check_write(kind, x, layout, gen, device, version=5, block_t=block_t, tiles=2)
    _check_write(kind, x[:7].float(), layout, gen, device, version=5, block_t=block_t, tiles=2)


@pytest.mark.parametrize("kind", ["main", "index"])
def test_write_v5_edge_values(kind: RecordKind, gen: torch.Generator, device: torch.device) -> None:
    dim = 128 if kind == "index" else 512
    rows = edge_rows(dim, record_format(kind).scale_block, device)
    _check_write(kind, rows, "region", gen, device, version=5)
    _check_write(kind, rows.bfloat16(), "region", gen, device, version=5)


@pytest.mark.parametrize("kind", ["main", "index", "swa"])
def test_write_edge_values(kind: RecordKind, gen: torch.Generator, device: torch.device) -> None:
    dim = 128 if kind == "index" else 512
    rows = edge_rows(dim, record_format(kind).scale_block, device)
    _check_write(kind, rows, "region", gen, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_input_dtypes(dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> None:
    _check_write("main", _inputs(11, 64, dtype, gen, device), "region", gen, device)


def test_write_strided_rows(gen: torch.Generator, device: torch.device) -> None:
    x = _inputs(9, 2 * 128, torch.bfloat16, gen, device)[:, 128:]  # row stride 256, D 128
    _check_write("index", x, "flat", gen, device)


def test_write_skips_bad_slots_and_empty(gen: torch.Generator, device: torch.device) -> None:
    dest = _make_dest("region", 68, 16, gen, device)
    before = dest.storage.clone()
    x = _inputs(3, 128, torch.bfloat16, gen, device)
    write_records("index", x, torch.tensor([-1, dest.num_slots, 10**12], device=device), dest, impl="triton")
    write_records("index", x[:0], torch.zeros(0, dtype=torch.int64, device=device), dest, impl="triton")
    assert torch.equal(dest.storage, before)


@pytest.mark.parametrize(("kind", "dim"), KINDS[:3] + KINDS[4:5])
def test_read_matches_reference(kind: RecordKind, dim: int, gen: torch.Generator, device: torch.device) -> None:
    rb = record_format(kind).record_bytes(dim)
    src = _make_dest("flat", rb, 40, gen, device)
    write_records_reference(kind, _inputs(40, dim, torch.float32, gen, device), torch.arange(40, device=device), src)
    slots = torch.randint(-1, 40, (21,), generator=gen, device=device)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full((21, dim), float("nan"), dtype=dtype, device=device)
        read_records(kind, src, slots, out=out, impl="triton")
        expected = read_records_reference(kind, src, slots, dtype)
        assert torch.equal(out.float().view(torch.int32), expected.float().view(torch.int32))


def test_launcher_checks(device: torch.device) -> None:
    dest = PagedRecords.flat(torch.zeros(4, 288, dtype=torch.uint8, device=device), 288)
    with pytest.raises(ValueError, match="288 B"):
        write_records("main", torch.zeros(2, 256, device=device), torch.zeros(2, dtype=torch.int64, device=device),
                      dest)
    with pytest.raises(TypeError, match="dtype"):
        write_records("main", torch.zeros(2, 512, dtype=torch.int32, device=device),
                      torch.zeros(2, dtype=torch.int64, device=device), dest)
    with pytest.raises(ValueError, match="contiguous"):
        write_records("main", torch.zeros(512, 2, device=device).t(), torch.zeros(2, dtype=torch.int64,
                                                                                   device=device), dest)
    with pytest.raises(ValueError, match="expected 2 slots"):
        write_records("main", torch.zeros(2, 512, device=device), torch.zeros(3, dtype=torch.int64, device=device),
                      dest)
    with pytest.raises(ValueError, match="record kind"):
        write_records("fp4", torch.zeros(2, 512, device=device), torch.zeros(2, dtype=torch.int64,
                                                                             device=device), dest)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(("kind", "dim"), KINDS[:3])
def test_gpu_realistic(kind: RecordKind, dim: int, gen: torch.Generator, device: torch.device) -> None:
    x = torch.cat([_inputs(8192, dim, torch.bfloat16, gen, device), edge_rows(dim, 16, device).bfloat16()])
    _check_write(kind, x, "region", gen, device)
    _check_write(kind, x[:1000].float(), "flat", gen, device)


def _tie_rows(kind: RecordKind, dtype: torch.dtype, dim: int, gen: torch.Generator, device: torch.device) -> Tensor:
    """Blocks whose amax pins the scale s (6 * s exactly, so s = amax / 6), the other elements on
    every E2M1 tie t * s and on its two neighbours in `dtype`, random signs: every scale of the
    format that `dtype` can pin this way (all E4M3 values for main records, powers of two for index)."""
    block = record_format(kind).scale_block
    if kind == "main":
        scales = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    else:
        span = 20 if dtype == torch.bfloat16 else 12  # fp16: 6 * s and s / 4 stay normal
        scales = [2.0**k for k in range(-span, span + 1)]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 3.0, 6.0])
    blocks = []
    for s in scales:
        at = (ties * s).to(dtype)
        vals = torch.cat([at, torch.nextafter(at, torch.full_like(at, float("inf"))), torch.nextafter(at, torch.zeros_like(at))])
        vals = vals[(vals.float() <= 6 * s)]
        for chunk in vals.split(block - 1):
            b = torch.cat([torch.tensor([6 * s], dtype=dtype), chunk, chunk[:1].repeat(block - 1 - chunk.numel())])
            blocks.append(b)
    x = torch.stack(blocks)
    x = x * torch.where(torch.rand(x.shape, generator=torch.Generator().manual_seed(5)) < 0.5, -1.0, 1.0).to(dtype)
    per_row = dim // block
    x = torch.cat([x, x[: -x.shape[0] % per_row or x.shape[0]][: (-x.shape[0]) % per_row]])
    return x.reshape(-1, dim).to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["main", "index"])
def test_write_fast_e2m1_ties(kind: RecordKind, dtype: torch.dtype, gen: torch.Generator,
                              device: torch.device) -> None:
    # v4's one-multiply E2M1 rounding (`_e2m1_code_fast`) against the reference on every tie and
    # its neighbours, for every scale: bit-exact, like the v3 path on the same rows
    rows = _tie_rows(kind, dtype, 64, gen, device)
    _check_write(kind, rows, "region", gen, device)
    fmt = record_format(kind)
    dest = _make_dest("region", fmt.record_bytes(64), rows.shape[0], gen, device)
    expected = _twin(dest)
    slots = torch.arange(rows.shape[0], device=device)
    write_records(kind, rows, slots, dest, version=3, impl="triton")
    write_records_reference(kind, rows, slots, expected)
    assert torch.equal(dest.storage, expected.storage)


@pytest.mark.parametrize("nudge", [-3, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_write_v5_ties_inexact_reciprocal(dtype: torch.dtype, nudge: int, gen: torch.Generator,
                                          device: torch.device) -> None:
    # v5 main-KV writer: 1 / scale from an approximate reciprocal (MUFU.RCP on the GPU, <= 1 ulp);
    # here the correctly rounded one moved by 3 ulps either way must still give the reference's
    # bytes on every E2M1 tie and its neighbours for every E4M3 scale (the GPU run repeats this
    # with the hardware reciprocal: test_gpu_v5_ties)
    rows = _tie_rows("main", dtype, 64, gen, device)
    _check_write("main", rows, "region", gen, device, version=5, block_t=64, rcp_nudge=nudge)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("kind", ["main", "index"])
def test_gpu_v5_ties(kind: RecordKind, gen: torch.Generator, device: torch.device) -> None:
    for dtype in (torch.bfloat16, torch.float16):
        _check_write(kind, _tie_rows(kind, dtype, 512 if kind == "main" else 128, gen, device), "region", gen, device,
                     version=5)
    x = torch.cat([_inputs(8192, 512 if kind == "main" else 128, torch.bfloat16, gen, device),
                   edge_rows(512 if kind == "main" else 128, 16, device).bfloat16()])
    _check_write(kind, x, "region", gen, device, version=5)


def test_write_v13_refuses_what_it_cannot_run(gen: torch.Generator, device: torch.device) -> None:
    # the Gluon index-key writer (v13) runs on sm_90 only, for 128-wide bf16 / fp16 rows
    x = _inputs(4, 128, torch.float32, gen, device)
    dest = _make_dest("region", record_format("index").record_bytes(128), 8, gen, device)
    with pytest.raises(ValueError, match=r"version 13 cannot run here: .*bf16"):
        write_records("index", x, torch.arange(4, device=device), dest, version=13, impl="triton")
    if device.type != "cuda":
        with pytest.raises(ValueError, match=r"version 13 cannot run here: .*sm_90"):
            write_records("index", x.bfloat16(), torch.arange(4, device=device), dest, version=13, impl="triton")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() != (9, 0), reason="v13 is Gluon for sm_90")
@pytest.mark.parametrize(("block_t", "tiles", "num_warps"), [(None, None, None), (16, 3, 4), (64, 1, 8)])
def test_gpu_v13_index_writer(block_t: int | None, tiles: int | None, num_warps: int | None,
                              gen: torch.Generator, device: torch.device) -> None:
    # bit-exact on every byte of poisoned storage: random rows over 40 binades, edge rows, every
    # E2M1 tie and its neighbours for every power-of-two scale, a skipped row, ragged tile ends;
    # blocks of 8 records (slot -> block by a shift) and of 6 (by a division)
    launch = {k: v for k, v in (("block_t", block_t), ("tiles", tiles), ("num_warps", num_warps)) if v is not None}
    for dtype in (torch.bfloat16, torch.float16):
        _check_write("index", _tie_rows("index", dtype, 128, gen, device), "region", gen, device, version=13,
                     **launch)
    x = torch.cat([_inputs(8195, 128, torch.bfloat16, gen, device), edge_rows(128, 16, device).bfloat16()])
    _check_write("index", x, "region", gen, device, version=13, **launch)
    _check_write("index", x, "region6", gen, device, version=13, **launch)
    x16 = (torch.randn(37, 128, generator=gen, device=device) * 300).half()  # fp16 rows (within its range)
    _check_write("index", x16, "region", gen, device, version=13, **launch)
    _check_write("index", x16, "region6", gen, device, version=13, **launch)
    if block_t is None:  # the launcher's default picks v13 on this GPU
        _check_write("index", x, "region", gen, device)
