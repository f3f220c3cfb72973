"""The skinny float32 matmul (`cedserve.kernels.skinny`): against a float64 reference on fresh random
inputs, plain and batched, contiguous and strided weights, every row count the routing sends it and
the edges of its blocks (N and K not multiples of them).

Tolerance: inputs are unit normals and weights scaled by 1 / sqrt(K), so outputs are O(1); float32
FMAs summed in another order than the reference stay within 2e-5 absolute (K <= 1,024). Outputs come
from `torch.empty`: the test poisons them with NaN so that an element the kernel skips fails.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cedserve.kernels import skinny

pytestmark = pytest.mark.kernels
ATOL = 2e-5


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    original = torch.empty

    def empty(*size: Any, **kwargs: Any) -> torch.Tensor:
        out = original(*size, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(skinny.torch, "empty", empty)


@pytest.mark.parametrize(("rows", "n", "k"), [(2, 2048, 128), (6, 24, 1024), (6, 644, 256), (16, 70, 33),
                                              (3, 5, 7), (1, 8, 256), (12, 129, 200)])
def test_matmul_equals_float64(rows: int, n: int, k: int, gen: torch.Generator, device: torch.device,
                               poisoned: None) -> None:
    x = torch.randn(rows, k, generator=gen, device=device)
    w = torch.randn(n, k, generator=gen, device=device) / k**0.5
    got = skinny.skinny_matmul(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    want = x.double() @ w.double().T
    assert float((got.double() - want).abs().max()) <= ATOL


@pytest.mark.parametrize(("batch", "rows", "n", "k"), [(2, 6, 128, 1024), (9, 6, 256, 128), (3, 2, 33, 65)])
def test_batched_with_transposed_weights_equals_float64(batch: int, rows: int, n: int, k: int, gen: torch.Generator,
                                                       device: torch.device, poisoned: None) -> None:
    """`bmm`'s layout: weights `[B, K, N]`, read through a transposed view (strides, not a copy)."""
    x = torch.randn(batch, rows, k, generator=gen, device=device)
    w = torch.randn(batch, k, n, generator=gen, device=device) / k**0.5
    got = skinny.skinny_mm(x, w.transpose(1, 2))
    assert got.shape == (batch, rows, n)
    want = torch.bmm(x.double(), w.double())
    assert float((got.double() - want).abs().max()) <= ATOL


def test_strided_rows_and_fake_shape(gen: torch.Generator, device: torch.device) -> None:
    """Rows taken from a wider buffer (a slice of a projection, as `fused.project` passes) and the
    op's registered fake (what torch.compile sees) agreeing on the output shape."""
    wide = torch.randn(6, 300, generator=gen, device=device)
    x = wide[:, 20:148]  # [6, 128], row stride 300
    w = torch.randn(96, 128, generator=gen, device=device) / 128**0.5
    got = skinny.skinny_matmul(x, w)
    assert float((got.double() - x.double() @ w.double().T).abs().max()) <= ATOL
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fx, fw = mode.from_tensor(x.unsqueeze(0)), mode.from_tensor(w.unsqueeze(0))
    with mode:
        fake = skinny.skinny_mm(fx, fw)
    assert tuple(fake.shape) == (1, 6, 96)


def test_bad_shapes_are_refused(device: torch.device) -> None:
    with pytest.raises(ValueError, match="x must be"):
        skinny.skinny_mm(torch.zeros(2, 3, device=device), torch.zeros(1, 4, 3, device=device))
    with pytest.raises(ValueError, match="at most"):
        skinny.skinny_mm(torch.zeros(1, 65, 8, device=device), torch.zeros(1, 4, 8, device=device))


def test_routing_keeps_torch_where_the_kernel_does_not_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    """`linear` / `bmm` send only float32 CUDA calls of 2-16 rows to the kernel: one row (cuBLAS's
    GEMV), more rows, bfloat16 and CPU tensors stay with torch, whose results they then equal exactly."""
    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(skinny, "skinny_matmul", lambda x, w: calls.append(tuple(x.shape)) or x @ w.T)
    x, w = torch.randn(6, 32), torch.randn(8, 32)
    assert torch.equal(skinny.linear(x, w), torch.nn.functional.linear(x, w))  # CPU
    assert torch.equal(skinny.bmm(x.unsqueeze(0), w.T.unsqueeze(0)), torch.bmm(x.unsqueeze(0), w.T.unsqueeze(0)))
    assert calls == []
    assert skinny._skinny(x, w, 6) is False
    if torch.cuda.is_available():
        xc, wc = x.cuda(), w.cuda()
        assert skinny._skinny(xc, wc, 6) and not skinny._skinny(xc, wc, 1) and not skinny._skinny(xc, wc, 17)
        assert not skinny._skinny(xc.bfloat16(), wc.bfloat16(), 6)
