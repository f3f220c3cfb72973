"""Concatenated and stacked weights held once (`cedserve.model.weight_views`): the modules' weights
become row blocks of the one tensor, outputs unchanged, a second build returns the same tensor, and
an in-place checkpoint load reaches both."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cedserve.model.config import ModelConfig
from cedserve.model.device_moe import DeviceMoE
from cedserve.model.fused import FusedOps
from cedserve.model.moe import MoE
from cedserve.model.presets import preset
from cedserve.model.weight_views import concat_rows, stack_experts

pytestmark = pytest.mark.unit


def _linears(seed: int, rows: tuple[int, ...], cols: int = 8) -> list[nn.Linear]:
    torch.manual_seed(seed)
    return [nn.Linear(cols, r, bias=False) for r in rows]


def test_concat_rows_views_the_modules_weights() -> None:
    layers = _linears(0, (3, 5, 2))
    x = torch.randn(4, 8)
    expected = [layer(x).detach() for layer in layers]
    copy = torch.cat([layer.weight.detach() for layer in layers]).clone()
    whole = concat_rows([layer.weight for layer in layers])
    assert torch.equal(whole, copy)
    starts = [0, 3, 8]
    for layer, start, want in zip(layers, starts, expected, strict=True):
        assert layer.weight.data_ptr() == whole[start].data_ptr()  # a view, not a copy
        assert isinstance(layer.weight, nn.Parameter) and layer.weight.requires_grad
        assert torch.equal(layer(x), want)
    assert concat_rows([layer.weight for layer in layers]).data_ptr() == whole.data_ptr()  # built again: the same
    with torch.no_grad():
        layers[1].weight.copy_(torch.full((5, 8), 0.5))  # a checkpoint loaded in place
    assert torch.equal(whole[3:8], torch.full((5, 8), 0.5))


def test_concat_rows_in_another_order_or_dtype_copies() -> None:
    a, b = _linears(1, (3, 4))
    whole = concat_rows([a.weight, b.weight])
    swapped = concat_rows([b.weight, a.weight])  # not the layout the views have: a new tensor
    assert swapped.data_ptr() != whole.data_ptr()
    assert torch.equal(swapped, torch.cat([b.weight, a.weight]).detach())
    c, d = nn.Linear(8, 2, bias=False).double(), nn.Linear(8, 2, bias=False)  # float64 beside float32
    mixed = concat_rows([c.weight, d.weight])
    assert mixed.dtype == torch.float64 and mixed.shape == (4, 8)
    assert torch.equal(mixed, torch.cat([c.weight.detach(), d.weight.detach().double()]))
    assert c.weight.data_ptr() != mixed.data_ptr() and d.weight.dtype == torch.float32  # not re-pointed


def test_stack_experts_layout() -> None:
    torch.manual_seed(2)
    experts = [(nn.Linear(4, 6, bias=False), nn.Linear(4, 6, bias=False), nn.Linear(6, 4, bias=False))
               for _ in range(3)]
    want13 = torch.stack([torch.cat([w1.weight, w3.weight]) for w1, w3, _ in experts]).detach().clone()
    want2 = torch.stack([w2.weight for _, _, w2 in experts]).detach().clone()
    w13, w2 = stack_experts([(w1.weight, w3.weight) for w1, w3, _ in experts], [w2.weight for _, _, w2 in experts])
    assert torch.equal(w13, want13) and torch.equal(w2, want2)
    assert experts[1][1].weight.data_ptr() == w13[1, 6:].data_ptr()
    assert experts[2][2].weight.data_ptr() == w2[2].data_ptr()


def test_device_moe_holds_the_experts_once() -> None:
    config: ModelConfig = preset("tiny")
    torch.manual_seed(3)
    moe = MoE(config)
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = moe(x)
        params_before = sum(p.numel() for p in moe.parameters())
        first = DeviceMoE(moe, "dense")
        again = DeviceMoE(moe, "dense")
        assert again.dense[0].data_ptr() == first.dense[0].data_ptr()
        assert moe.experts[0].w1.weight.data_ptr() == first.dense[0].data_ptr()
        assert moe.shared_experts.w2.weight.data_ptr() == first.dense[1][-1].data_ptr()
        assert sum(p.numel() for p in moe.parameters()) == params_before
        torch.testing.assert_close(moe(x), want, atol=0, rtol=0)  # the module reads the same values
        # the stacked GEMMs sum in another order than the module's per-expert linears (float32)
        torch.testing.assert_close(first(x, FusedOps(compiled=False)), want, atol=1e-4, rtol=1e-4)
