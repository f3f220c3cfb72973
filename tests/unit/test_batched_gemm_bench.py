"""`benchmarks/batched_gemm.py`'s forms compute what the step's two batched GEMMs compute (float64
reference, float32 forms on the CPU), so its GPU timings compare like with like."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from cedserve.kernels.triton_support import can_launch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import batched_gemm

from cedserve.model.attention import GroupedOutput

pytestmark = pytest.mark.unit


def runnable(forms: dict[str, Any], x: torch.Tensor) -> dict[str, Any]:
    """The forms this process can run: the Triton ones need a GPU or the interpreter, which the kernel
    tier sets for the whole process (tests/kernels/test_grouped_linear.py runs them there too)."""
    return {name: fn for name, fn in forms.items() if "(Triton)" not in name or can_launch(x)}


@pytest.mark.parametrize("rows", [1, 6])
def test_wo_a_forms_equal_the_grouped_output(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    module = GroupedOutput(in_per_group=32, groups=3, rank=8)  # the step's wo_a
    with torch.no_grad():
        module.weight.copy_(torch.randn(24, 32, generator=gen))
    x = torch.randn(rows, 3, 32, generator=gen)
    want = module(x.unsqueeze(1)).squeeze(1).double()  # [rows, G * rank]
    for form, fn in runnable(batched_gemm.wo_a_forms(x, module.weight.detach(), 3), x).items():
        torch.testing.assert_close(fn().double(), want, atol=1e-4, rtol=1e-5, msg=form)


@pytest.mark.parametrize("rows", [1, 6])
def test_down_forms_equal_the_dense_experts_sum(rows: int) -> None:
    gen = torch.Generator().manual_seed(10 + rows)
    y = torch.randn(rows, 5, 16, generator=gen)  # [B, E', I]
    w2 = torch.randn(5, 24, 16, generator=gen)  # [E', D, I]
    want = sum(y[:, e].double() @ w2[e].double().t() for e in range(5))  # each expert's output, summed
    assert isinstance(want, torch.Tensor)
    for form, fn in batched_gemm.down_forms(y, w2).items():
        torch.testing.assert_close(fn().double(), want, atol=1e-4, rtol=1e-5, msg=form)


def test_linear_forms_equal_f_linear() -> None:
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(6, 40, generator=gen), torch.randn(24, 40, generator=gen)
    want = x.double() @ w.double().T
    for form, fn in runnable(batched_gemm.linear_forms(x, w), x).items():
        torch.testing.assert_close(fn().double(), want, atol=1e-4, rtol=1e-5, msg=form)
