"""Programmatic dependent launch (`CEDSERVE_PDL=1`, `kernels.triton_support.pdl_launch`): when the
kernels take it, and that a chain of dependent kernels launched with it gives the same bits as
without it, eagerly and replayed from a CUDA graph (each kernel reads its predecessor's output, so
a kernel that started reading before its predecessor finished would read stale values)."""

from __future__ import annotations

import pytest
import torch

from cedserve.kernels import triton_support
from cedserve.kernels.grouped_linear import grouped_linear
from cedserve.kernels.triton_support import PDL_ENV, pdl_launch

pytestmark = pytest.mark.kernels

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def test_off_unless_asked_for_on_a_hopper_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(triton_support, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(triton_support, "interpreting", lambda: False)
    monkeypatch.delenv(PDL_ENV, raising=False)
    assert pdl_launch(cuda) == {}  # not asked for
    monkeypatch.setenv(PDL_ENV, "1")
    assert pdl_launch(cuda) == {"PDL": True, "launch_pdl": True}
    assert pdl_launch(torch.device("cpu")) == {}  # the interpreter launches no PDL
    monkeypatch.setattr(triton_support, "_capability", lambda index: (8, 0))
    assert pdl_launch(cuda) == {}  # before sm90 there is none
    monkeypatch.setattr(triton_support, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(triton_support, "interpreting", lambda: True)
    assert pdl_launch(cuda) == {}
    monkeypatch.setattr(triton_support, "interpreting", lambda: False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert pdl_launch(cuda) == {}  # traced into a compiled graph: Inductor launches it


def _chain(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """Each projection reads the one before it; two K splits make each a pair of launches (the
    partial sums, then their sum), so the chain is 2 x len(weights) dependent kernels."""
    for w in weights:
        x = grouped_linear(x.view(x.shape[0], 1, -1), w, splits=2)
        x = x / x.abs().amax().clamp(min=1e-6)  # a torch kernel between: PDL beside ordinary launches
    return x


@pytest.mark.skipif(not HOPPER, reason="needs an sm90+ CUDA device")
def test_a_dependent_chain_gives_the_same_bits_with_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator(device="cuda").manual_seed(7)
    dim = 512
    x = torch.randn(8, dim, device="cuda", generator=gen)
    weights = [torch.randn(dim, dim, device="cuda", generator=gen) / dim ** 0.5 for _ in range(12)]
    monkeypatch.delenv(PDL_ENV, raising=False)
    expected = _chain(x, weights)
    monkeypatch.setenv(PDL_ENV, "1")
    assert pdl_launch(x.device)  # the chain below does launch with PDL
    for _ in range(3):
        assert torch.equal(_chain(x, weights), expected)
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _chain(static_x, weights)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(static_x, weights)
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
