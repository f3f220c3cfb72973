"""The fused mHC tail (`cedserve.kernels.mhc`): sigmoids + Sinkhorn in one launch, against the
torch reference in float64 (the same order of operations; float32 reference checked too).

Tolerance: every output is in [0, 2]; the kernel's float32 rounding (and a GPU's `exp`/division)
keeps it within 2e-6 of the float64 reference and of the float32 torch path. Outputs are
NaN-poisoned before the launch so that an unwritten element fails.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from cedserve.kernels import mhc as mhc_kernels
from cedserve.kernels.mhc import hc_mix_tail, hc_mix_tail_reference
from cedserve.model.mhc import hc_mixes

pytestmark = pytest.mark.kernels
CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
ATOL = 2e-6


def _inputs(tokens: int, hc: int, gen: torch.Generator, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    width = (2 + hc) * hc
    mixes = torch.randn(tokens, width, generator=gen, device=device) * 3
    scale = torch.rand(3, generator=gen, device=device) + 0.5
    base = torch.randn(width, generator=gen, device=device)
    return mixes, scale, base


def _poisoned_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs of the launcher come from `new_empty`: fill them with NaN first."""
    original = Tensor.new_empty

    def poisoned(self: Tensor, *size: Any, **kwargs: Any) -> Tensor:
        return original(self, *size, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(Tensor, "new_empty", poisoned)


def _check(got: tuple[Tensor, ...], mixes: Tensor, scale: Tensor, base: Tensor, iters: int, eps: float) -> None:
    exact = hc_mix_tail_reference(mixes.double(), scale.double(), base.double(), iters, eps)
    torch32 = hc_mix_tail_reference(mixes, scale, base, iters, eps)
    for name, out, ref, ref32 in zip(("pre", "post", "comb"), got, exact, torch32):
        assert out.dtype == torch.float32 and out.shape == ref.shape, name
        assert not out.isnan().any(), f"{name}: unwritten elements"
        err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
        assert err <= ATOL, f"{name}: max error {err:.3g} against float64"
        err32 = (out - ref32).abs().max().item() if out.numel() else 0.0
        assert err32 <= ATOL, f"{name}: max error {err32:.3g} against the float32 torch path"


@pytest.mark.parametrize("hc", [2, 4, 8])
@pytest.mark.parametrize("tokens", [0, 1, 3, 70])
def test_triton_matches_reference(tokens: int, hc: int, gen: torch.Generator, device: torch.device,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # 70 tokens = more than one 64-token program for hc=4 (a ragged last block)
    mixes, scale, base = _inputs(tokens, hc, gen, device)
    _poisoned_empty(monkeypatch)
    got = hc_mix_tail(mixes, scale, base, 20, 1e-6, impl="triton")
    _check(got, mixes, scale, base, 20, 1e-6)


@pytest.mark.parametrize("iters", [1, 2, 7])
def test_iteration_counts(iters: int, gen: torch.Generator, device: torch.device,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    mixes, scale, base = _inputs(5, 4, gen, device)
    _poisoned_empty(monkeypatch)
    got = hc_mix_tail(mixes, scale, base, iters, 1e-3, impl="triton")
    _check(got, mixes, scale, base, iters, 1e-3)


def test_strided_rows(gen: torch.Generator, device: torch.device) -> None:
    """Rows of a wider buffer (row stride != width) are read in place."""
    mixes, scale, base = _inputs(6, 4, gen, device)
    wide = torch.randn(6, 40, generator=gen, device=device)
    wide[:, 3:27] = mixes
    got = hc_mix_tail(wide[:, 3:27], scale, base, 20, 1e-6, impl="triton")
    _check(got, mixes, scale, base, 20, 1e-6)


def test_bad_inputs(device: torch.device) -> None:
    mixes = torch.zeros(2, 24, device=device)
    scale, base = torch.ones(3, device=device), torch.zeros(24, device=device)
    with pytest.raises(ValueError, match="width"):
        hc_mix_tail(torch.zeros(2, 23, device=device), scale, base, 20, 1e-6, impl="triton")
    with pytest.raises(ValueError, match="power-of-two"):
        hc_mix_tail(torch.zeros(2, 15, device=device), scale, torch.zeros(15, device=device), 20, 1e-6, impl="triton")
    with pytest.raises(TypeError, match="dtype"):
        hc_mix_tail(mixes.double(), scale, base, 20, 1e-6, impl="triton")
    with pytest.raises(ValueError, match="base"):
        hc_mix_tail(mixes, scale, base[:20], 20, 1e-6, impl="triton")


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("tokens", [1, 32])
def test_model_hc_mixes_uses_the_kernel_on_cuda(tokens: int, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """`model.mhc.hc_mixes` on CUDA runs the kernel, not the torch tail (which is ~250 ops: a
    fallback would fail the op count), and agrees with the CPU (torch) path."""
    hc, dim = 4, 64
    streams = torch.randn(tokens, hc, dim, generator=gen, device="cuda").bfloat16()
    fn = torch.randn((2 + hc) * hc, hc * dim, generator=gen, device="cuda") * 0.05
    scale = torch.rand(3, generator=gen, device="cuda") + 0.5
    base = torch.randn((2 + hc) * hc, generator=gen, device="cuda")
    launched = []
    original = mhc_kernels.hc_mix_tail

    def spy(*args: Any, **kwargs: Any) -> tuple[Tensor, Tensor, Tensor]:
        launched.append(kwargs.get("impl"))
        return original(*args, **kwargs)

    monkeypatch.setattr("cedserve.model.mhc.hc_mix_tail", spy)
    ops = _Ops()
    with ops:
        got = hc_mixes(streams, fn, scale, base, 20, 1e-6, 1e-6)
    torch.cuda.synchronize()
    assert launched == ["triton"]
    assert "_softmax" not in ops.names and len(ops.names) < 30, ops.names
    ref = hc_mixes(streams.cpu(), fn.cpu(), scale.cpu(), base.cpu(), 20, 1e-6, 1e-6)
    for name in ("pre", "post", "comb"):
        err = (getattr(got, name).cpu() - getattr(ref, name)).abs().max().item()
        assert err <= 1e-5, f"{name}: {err:.3g}"  # the projection matmul rounds differently on the GPU


@pytest.mark.gpu
@requires_cuda
def test_cuda_kernel_matches_reference_many_tokens(gen: torch.Generator) -> None:
    mixes, scale, base = _inputs(4099, 4, gen, torch.device("cuda"))
    got = hc_mix_tail(mixes, scale, base, 20, 1e-6, impl="triton")
    _check(got, mixes, scale, base, 20, 1e-6)
