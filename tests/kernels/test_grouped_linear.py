"""`wo_a`'s grouped projection in one launch (`cedserve.kernels.grouped_linear`) against a float64
reference of the same sum, on fresh random inputs.

Tolerance, per output element: float32 operands, `1e-5 * sum_k |x||w|` (a float32 dot product of K
terms rounds to ~sqrt(K) * 2^-24 of that; a wrong group, row or column is off by O(1) of it);
bf16 / fp16 operands (exact products, a float32 sum, one rounding to the output dtype): an ulp of
the output dtype plus the same float32 term (a GPU rounds to nearest, half an ulp; Triton's CPU
interpreter may round its float32 -> bf16 cast a whole ulp away).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

from cedserve.kernels import grouped_linear as gl
from cedserve.kernels.grouped_linear import grouped_linear, grouped_linear_reference

pytestmark = pytest.mark.kernels


def _check(got: Tensor, x: Tensor, w: Tensor) -> None:
    groups = x.shape[1]
    wg = w.double().view(groups, -1, x.shape[-1])  # [G, R, K]
    exact = torch.einsum("ngk,grk->ngr", x.double(), wg).flatten(1)
    scale = torch.einsum("ngk,grk->ngr", x.double().abs(), wg.abs()).flatten(1)
    assert got.shape == exact.shape and got.dtype == x.dtype
    assert not got.isnan().any()
    ulp = 0.0 if x.dtype == torch.float32 else torch.finfo(x.dtype).eps
    bound = 1e-5 * scale + ulp * exact.abs()
    excess = ((got.double() - exact).abs() - bound).max().item()
    assert excess <= 0, f"error past the bound by {excess:.3g}"


@pytest.mark.parametrize("rows", [1, 2, 6, 17, 64, 65, 192])
def test_float32_matches_float64(rows: int, gen: torch.Generator, device: torch.device) -> None:
    groups, r, k = 2, 128, 1024  # mini-40's wo_a
    x = torch.randn(rows, groups, k, generator=gen, device=device)
    w = torch.randn(groups * r, k, generator=gen, device=device) / k**0.5
    _check(grouped_linear(x, w, impl="triton"), x, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_operands(dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> None:
    x = torch.randn(6, 4, 96, generator=gen, device=device).to(dtype)
    w = (torch.randn(4 * 24, 96, generator=gen, device=device) / 10).to(dtype)
    _check(grouped_linear(x, w, impl="triton"), x, w)


def test_ragged_shapes_and_strided_rows(gen: torch.Generator, device: torch.device) -> None:
    """K and R not multiples of any block, groups of 3, and `x` a view whose rows and groups are
    strided (the attention output reshaped from a wider buffer)."""
    groups, r, k, rows = 3, 40, 100, 9
    wide = torch.randn(rows, groups, k + 7, generator=gen, device=device)
    x = wide[:, :, 3:3 + k]
    assert not x.is_contiguous()
    w = torch.randn(groups * r, k, generator=gen, device=device)
    _check(grouped_linear(x, w, impl="triton"), x, w)


@pytest.mark.parametrize(("splits", "dtype"), [(2, torch.float32), (3, torch.float32), (64, torch.float32),
                                             (3, torch.bfloat16)])
def test_k_splits_sum_to_the_same_product(splits: int, dtype: torch.dtype, gen: torch.Generator,
                                          device: torch.device) -> None:
    """`K` cut across programs (float32 partials per split, a second launch adding them in order):
    within the same bound, K ragged against the blocks (split counts past K's blocks are capped),
    and the same bits on a second call (no atomics)."""
    groups, r, k, rows = 2, 40, 1000, 7
    x = torch.randn(rows, groups, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(groups * r, k, generator=gen, device=device) / k**0.5).to(dtype)
    got = grouped_linear(x, w, impl="triton", splits=splits)
    _check(got, x, w)
    assert torch.equal(grouped_linear(x, w, impl="triton", splits=splits), got)


def test_blocks_split_k_until_the_sms_are_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the interpreter, mini-40's wo_a at decode rows gets about one program per SM: 16 splits of
    64 at 6 and 32 rows on 132 SMs, fewer when the rows give more programs, one when K has one block."""
    monkeypatch.setattr(gl, "interpreting", lambda: False)
    monkeypatch.setattr(gl, "num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    for rows in (6, 32):
        block_m, block_r, block_k, k_split = gl._blocks(rows, 2, 128, 1024, cpu)
        assert block_m == (16 if rows == 6 else 32)
        assert (block_r, block_k, k_split) == (32, 64, 64) and 2 * 4 * 1024 // k_split <= 132
    assert gl._blocks(192, 2, 128, 1024, cpu)[3] == 256  # 24 programs a split: 5 wanted, 4 of 256
    assert gl._blocks(6, 2, 128, 64, cpu)[3] == 64
    assert gl._blocks(6, 2, 128, 1024, cpu, splits=1)[3] == 1024


def test_bad_splits_are_refused(device: torch.device) -> None:
    x, w = torch.randn(3, 2, 8, device=device), torch.randn(2 * 4, 8, device=device)
    with pytest.raises(ValueError, match="splits"):
        grouped_linear(x, w, impl="triton", splits=0)


def test_auto_sends_one_row_and_many_rows_to_bmm(monkeypatch: pytest.MonkeyPatch, gen: torch.Generator,
                                     device: torch.device) -> None:
    monkeypatch.setattr(gl, "MAX_ROWS", 4)
    x = torch.randn(5, 2, 32, generator=gen, device=device)
    w = torch.randn(2 * 16, 32, generator=gen, device=device)
    assert torch.equal(grouped_linear(x, w), grouped_linear_reference(x, w))
    _check(grouped_linear(x[:4], w), x[:4], w)
    def no_kernel(*args: object) -> None:
        raise AssertionError("the kernel was launched")

    monkeypatch.setattr(gl, "_blocks", no_kernel)
    assert torch.equal(grouped_linear(x[:1], w), grouped_linear_reference(x[:1], w))  # one row: cuBLAS's GEMV
    with pytest.raises(AssertionError, match="launched"):
        grouped_linear(x[:2], w)


def test_zero_rows(device: torch.device) -> None:
    out = grouped_linear(torch.empty(0, 2, 8, device=device), torch.zeros(6, 8, device=device), impl="triton")
    assert out.shape == (0, 6)


def test_bad_inputs_are_named(device: torch.device) -> None:
    x = torch.zeros(2, 2, 8, device=device)
    with pytest.raises(ValueError, match="G \\* R, K"):
        grouped_linear(x, torch.zeros(5, 8, device=device))
    with pytest.raises(ValueError, match="G \\* R, K"):
        grouped_linear(x, torch.zeros(6, 9, device=device))
    with pytest.raises(TypeError, match="share a dtype"):
        grouped_linear(x, torch.zeros(6, 8, device=device, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="impl"):
        grouped_linear(x, torch.zeros(6, 8, device=device), impl="cuda")  # type: ignore[arg-type]


def test_auto_keeps_autograd(gen: torch.Generator, device: torch.device) -> None:
    """Training reaches `wo_a` with gradients on: "auto" takes the differentiable `bmm` there."""
    x = torch.randn(3, 2, 16, generator=gen, device=device, requires_grad=True)
    w = torch.randn(2 * 8, 16, generator=gen, device=device, requires_grad=True)
    grouped_linear(x, w).sum().backward()
    assert x.grad is not None and w.grad is not None
    assert torch.allclose(w.grad.view(2, 8, 16), x.detach().sum(0).unsqueeze(1).expand(2, 8, 16))


def test_the_benchmark_forms_run_the_kernel(gen: torch.Generator, device: torch.device) -> None:
    """benchmarks/batched_gemm.py's Triton forms launch the kernel at every row count (one row too,
    which "auto" leaves to cuBLAS) and compute the step's sums."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import batched_gemm

    for rows in (1, 6):
        x = torch.randn(rows, 2, 64, generator=gen, device=device)
        w = torch.randn(2 * 16, 64, generator=gen, device=device)
        _check(batched_gemm.wo_a_forms(x, w, 2)["grouped_linear (Triton)"](), x, w)
        flat = batched_gemm.linear_forms(x.flatten(1), w.view(16, 128).contiguous())["grouped_linear G=1 (Triton)"]()
        _check(flat, x.flatten(1).unsqueeze(1), w.view(16, 128))


@pytest.mark.parametrize("rows,r,k", [(2, 128, 128), (8, 128, 128), (16, 1152, 128), (32, 8, 128), (8, 256, 64)])
def test_row_linear_matches_float64(rows: int, r: int, k: int, gen: torch.Generator, device: torch.device) -> None:
    """`cedserve::row_linear` (the kernel as one group): the demo step's float32 projections at verify
    row counts, against float64."""
    x = torch.randn(rows, k, generator=gen, device=device)
    w = torch.randn(r, k, generator=gen, device=device) / k**0.5
    got = torch.ops.cedserve.row_linear(x, w)
    _check(got, x.unsqueeze(1), w)


def test_linear_sends_float32_verify_rows_to_the_kernel_on_cuda(monkeypatch: pytest.MonkeyPatch,
                                                                 gen: torch.Generator, device: torch.device) -> None:
    """`linear`: the kernel for float32 at 2 .. ROW_LINEAR_MAX_ROWS rows on CUDA; cuBLAS for one row,
    more rows, bf16, a CPU tensor, and where autograd records."""
    x = torch.randn(40, 64, generator=gen, device=device)
    w = torch.randn(48, 64, generator=gen, device=device)
    launched: list[int] = []
    kernel = gl.grouped_linear

    def counting(x: Tensor, weight: Tensor, impl: str = "auto", **kwargs: object) -> Tensor:
        launched.append(x.shape[0])
        return kernel(x, weight, impl, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gl, "grouped_linear", counting)
    for rows in (1, 2, 8, 32, 33, 40):
        _check(gl.linear(x[:rows], w), x[:rows].unsqueeze(1), w)
    assert gl.linear(x[:8].bfloat16(), w.bfloat16()).dtype == torch.bfloat16
    wg = w.clone().requires_grad_(True)
    gl.linear(x[:8], wg).sum().backward()
    assert wg.grad is not None
    assert launched == ([2, 8, 32] if device.type == "cuda" else [])
    monkeypatch.setattr(gl, "ROW_LINEAR_MAX_ROWS", 0)  # the switch benchmarks/dspark_cycle.py turns off
    gl.linear(x[:8], w)
    assert launched == ([2, 8, 32] if device.type == "cuda" else [])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor and CUDA graphs: a CUDA device")
def test_row_linear_compiles_and_captures(gen: torch.Generator, device: torch.device) -> None:
    """Inside `torch.compile(fullgraph=True)` (as `FusedOps` compiles `project`) and a captured CUDA
    graph, `linear` gives the eager kernel's bits."""
    w = torch.randn(128, 128, generator=gen, device=device)

    def chain(x: Tensor) -> Tensor:
        return torch.relu(gl.linear(x * 2.0, w)) + 1.0

    compiled = torch.compile(chain, fullgraph=True)
    x = torch.randn(8, 128, generator=gen, device=device)
    want = chain(x)
    assert torch.equal(compiled(x), want)
    static = x.clone()
    compiled(static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(static)
    static.copy_(torch.randn(8, 128, generator=gen, device=device))
    graph.replay()
    assert torch.equal(out, chain(static))
