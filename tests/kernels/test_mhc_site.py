"""One fused mHC site (`cedserve.kernels.mhc.hc_site`: expansion, projection, tail, collapse and
RMSNorm in two launches) against float64, and its torch reference against the modules' composition.

Tolerances, per output, against float64 on fresh random inputs:

* `streams`: the expansion rounded once to the streams dtype; a float32 sum in another order may
  round to the neighbour, so one ulp of the dtype (relative) plus 1e-5 (float32 sums of values ~10);
* `pre`, `post`, `comb` (float32, in [0, 2]): checked against the float64 site over the kernel's own
  rounded streams (a streams element one ulp away moves the projection by more than the rest of the
  float32 work); 1e-5 covers dot products of up to 16,384 float32 products and the tail (2e-6 alone);
* `x`: the collapse and the normalised value are each rounded to the streams dtype (half an ulp
  each, relative; seen up to 0.8 ulp in bf16), so 1.25 ulps of it plus 1e-5 (1.75 with a bf16 norm
  weight, one rounding more).

Outputs come from `torch.empty` and are NaN-poisoned before the launch, so an unwritten element fails.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor

from cedserve.kernels import mhc as mhc_kernels
from cedserve.kernels.mhc import Expansion, HcSite, hc_site, hc_site_reference
from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model
from cedserve.model.mhc import hc_collapse, hc_expand, hc_mixes
from cedserve.model.norm import RMSNorm
from cedserve.model.presets import preset
from cedserve.model.runner import ModelRunner, RunnerConfig
from cedserve.model.tokenizer import tiny_tokenizer_path

pytestmark = pytest.mark.kernels
CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
HC, ITERS, HC_EPS, NORM_EPS = 4, 20, 1e-6, 1e-6
COEF_ATOL = 1e-5
"""pre / post / comb vs float64 over the kernel's streams."""
VALUE_ATOL = 1e-5
"""streams and x: the absolute part of their bound (the relative part in ulps of the dtype below)."""
STREAMS_ULPS, X_ULPS = 1.0, 1.25


def _inputs(rows: int, dim: int, dtype: torch.dtype, expand: bool, gen: torch.Generator,
            device: torch.device) -> tuple[list[Tensor], Expansion | None]:
    """streams, pre_prev, fn, scale, base, norm weight as a model has them (positive pre, post in
    [0, 2], a row-stochastic-ish comb), `fn` scaled so the projection is ~3 whatever the width."""
    width = (2 + HC) * HC

    def rand(*shape: int) -> Tensor:
        return torch.rand(*shape, generator=gen, device=device)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    streams = (randn(rows, HC, dim) * 2).to(dtype)
    fn = randn(width, HC * dim) * 3 / (HC * dim) ** 0.5
    inputs = [streams, rand(rows, HC) + HC_EPS, fn, rand(3) + 0.5, randn(width), rand(dim) + 0.5]
    if not expand:
        return inputs, None
    comb = rand(rows, HC, HC)
    return inputs, ((randn(rows, dim) * 2).to(dtype), rand(rows, HC) * 2, comb / comb.sum(-1, keepdim=True))


def _poison_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    original = torch.empty

    def poisoned(*size: Any, **kwargs: Any) -> Tensor:
        out = original(*size, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(mhc_kernels.torch, "empty", poisoned)


def _check(got: HcSite, inputs: list[Tensor], expand: Expansion | None) -> None:
    streams, weight = inputs[0], inputs[5]
    dtype, ulp = streams.dtype, torch.finfo(streams.dtype).eps
    assert got.streams.dtype == dtype and got.streams.shape == streams.shape
    assert got.x.dtype == torch.promote_types(weight.dtype, dtype)
    for name, out in zip(HcSite._fields, got):
        assert not out.isnan().any(), f"{name}: unwritten elements"
    wide = [t.double() for t in inputs]
    if expand is None:
        assert got.streams is streams  # nothing to expand: the input itself
    else:
        out, post, comb = (t.double() for t in expand)
        _within("streams", got.streams, hc_expand(out, wide[0], post, comb), STREAMS_ULPS * ulp)
    exact = hc_site_reference(got.streams.double(), *wide[1:], ITERS, HC_EPS, NORM_EPS)
    _within("x", got.x, exact.x, X_ULPS * ulp)
    for name in ("pre", "post", "comb"):
        out, ref = getattr(got, name), getattr(exact, name)
        assert out.dtype == torch.float32 and out.shape == ref.shape, name
        err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
        assert err <= COEF_ATOL, f"{name}: max error {err:.3g} against float64"


def _within(name: str, out: Tensor, ref: Tensor, rtol: float) -> None:
    excess = (out.double() - ref).abs() - (rtol * ref.abs() + VALUE_ATOL)
    worst = excess.max().item() if excess.numel() else 0.0
    assert worst <= 0, f"{name}: exceeds its bound by {worst:.3g}"


SHAPES = [(1, 256), (3, 256), (33, 256), (5, 200), (1, 4096), (3, 4096)]
"""(rows, hidden): mini-40's width from one row to past two row blocks, a width no block divides,
the released width (fn [24, 16384]) at small batch."""


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("rows", "dim"), SHAPES)
def test_site_matches_float64(rows: int, dim: int, dtype: torch.dtype, gen: torch.Generator,
                              device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs, expand = _inputs(rows, dim, dtype, True, gen, device)
    _poison_empty(monkeypatch)
    got = hc_site(*inputs, ITERS, HC_EPS, NORM_EPS, expand=expand, impl="triton")
    _check(got, inputs, expand)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_site_without_expansion(dtype: torch.dtype, gen: torch.Generator, device: torch.device,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A site after an Engram layer (or the first): the streams as they come, read in place from
    a wider buffer (row and stream strides of their own)."""
    inputs, _ = _inputs(6, 256, dtype, False, gen, device)
    wide = torch.randn(6, 5, 300, generator=gen, device=device).to(dtype)
    wide[:, 1:, 7:263] = inputs[0]
    inputs[0] = wide[:, 1:, 7:263]
    _poison_empty(monkeypatch)
    got = hc_site(*inputs, ITERS, HC_EPS, NORM_EPS, impl="triton")
    _check(got, inputs, None)


@pytest.mark.parametrize("blocks", [(1, 64), (4, 32)])
def test_site_gpu_blocks(blocks: tuple[int, int], gen: torch.Generator, device: torch.device,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's block shapes (one and four rows per program, several column chunks per row) in
    any run: the partials of many chunks summed by the second kernel."""
    monkeypatch.setattr(mhc_kernels, "_site_blocks", lambda rows, dim: blocks)
    inputs, expand = _inputs(6, 256, torch.bfloat16, True, gen, device)
    got = hc_site(*inputs, ITERS, HC_EPS, NORM_EPS, expand=expand, impl="triton")
    _check(got, inputs, expand)


def test_site_bf16_weight_and_sublayer_output(gen: torch.Generator, device: torch.device) -> None:
    """A bf16 model: the norm weight bf16 too (x in bf16, rounded once more), fn float32."""
    inputs, expand = _inputs(3, 256, torch.bfloat16, True, gen, device)
    inputs[5] = inputs[5].bfloat16()
    got = hc_site(*inputs, ITERS, HC_EPS, NORM_EPS, expand=expand, impl="triton")
    assert got.x.dtype == torch.bfloat16
    exact = hc_site_reference(got.streams.double(), *(t.double() for t in inputs[1:]), ITERS, HC_EPS, NORM_EPS)
    _within("x", got.x, exact.x, (X_ULPS + 0.5) * torch.finfo(torch.bfloat16).eps)


def test_no_rows(device: torch.device) -> None:
    inputs, expand = _inputs(0, 256, torch.bfloat16, True, torch.Generator(device=device), device)
    got = hc_site(*inputs, ITERS, HC_EPS, NORM_EPS, expand=expand, impl="triton")
    assert got.streams.shape == (0, HC, 256) and got.x.shape == (0, 256) and got.comb.shape == (0, HC, HC)


def test_bad_inputs(gen: torch.Generator, device: torch.device) -> None:
    inputs, expand = _inputs(2, 64, torch.float32, True, gen, device)
    assert expand is not None
    streams, pre_prev, fn, scale, base, weight = inputs

    def site(**changed: Any) -> HcSite:
        args = {"streams": streams, "pre_prev": pre_prev, "fn": fn, "scale": scale, "base": base,
                "norm_weight": weight, "expand": expand, **changed}
        return hc_site(sinkhorn_iters=ITERS, hc_eps=HC_EPS, norm_eps=NORM_EPS, impl="triton", **args)

    with pytest.raises(TypeError, match="streams: dtype"):
        site(streams=streams.double())
    with pytest.raises(ValueError, match="power-of-two"):
        site(streams=streams[:, :3])
    with pytest.raises(ValueError, match="fn must be"):
        site(fn=fn[:, :-1])
    with pytest.raises(ValueError, match="pre_prev must be a contiguous"):
        site(pre_prev=torch.cat([pre_prev, pre_prev], dim=1)[:, :HC])  # rows of a wider buffer
    with pytest.raises(ValueError, match="base must be"):
        site(base=base[:-1])
    with pytest.raises(ValueError, match="norm_weight"):
        site(norm_weight=weight[:-1])
    with pytest.raises(ValueError, match="comb"):
        site(expand=(expand[0], expand[1], expand[2].transpose(1, 2)))
    with pytest.raises(ValueError, match="expanded output"):
        site(expand=(expand[0][:1], expand[1], expand[2]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("expand", [False, True])
def test_reference_is_the_modules_composition(dtype: torch.dtype, expand: bool) -> None:
    """`hc_site_reference` is, bit for bit, what `Block.forward` computes around a sublayer:
    `hc_expand`, `hc_mixes` and the sublayer's `RMSNorm` over `hc_collapse` (CPU, torch)."""
    gen = torch.Generator().manual_seed(5)
    inputs, expansion = _inputs(7, 96, dtype, expand, gen, torch.device("cpu"))
    streams, pre_prev, fn, scale, base, weight = inputs
    got = hc_site_reference(*inputs, ITERS, HC_EPS, NORM_EPS, expand=expansion)
    if expansion is not None:
        streams = hc_expand(expansion[0], streams, expansion[1], expansion[2])
    mix = hc_mixes(streams, fn, scale, base, ITERS, HC_EPS, NORM_EPS)
    norm = RMSNorm(96, NORM_EPS)
    norm.weight.data.copy_(weight)
    assert torch.equal(got.streams, streams)
    assert torch.equal(got.x, norm(hc_collapse(streams, pre_prev)))
    for name in ("pre", "post", "comb"):
        assert torch.equal(getattr(got, name), getattr(mix, name)), name


@pytest.mark.skipif(CUDA, reason="the interpreter's run; on a GPU tests/unit/test_runner_gpu.py runs the step")
def test_slot_step_with_the_kernel_site() -> None:
    """The tiny model's decode step over slots (`SlotStep`: sites with the MoE output pending
    across layers, expansions before Engram layers and the logits, DSpark taps) gives the same
    logits and taps with the Triton site as with its torch reference (float32 model)."""
    # 4 Sinkhorn iterations instead of 20: the interpreter's time is in the tail's ops
    config = fit_config_to_tokenizer(preset("tiny"), tiny_tokenizer_path()).replace(hc_sinkhorn_iters=4)
    model, _ = random_model(config, tiny_tokenizer_path(), seed=3)
    model.use_paged_attention("reference")
    gen = torch.Generator().manual_seed(4)
    states = []
    for length in (2, 9):
        state = model.new_state()
        model.prefill(torch.randint(3, 500, (length,), generator=gen).tolist(), state)
        states.append(state)
    outputs = []
    for impl in ("torch", "triton"):
        runner = ModelRunner(model, RunnerConfig(max_slots=2, max_context=128))
        for slot, state in enumerate(states):
            runner.load(slot, copy.deepcopy(state))
        runner.slot_step.site_impl = impl
        outputs.append(runner.step_outputs([0, 1], [5, 7]))
    (logits, taps), (kernel_logits, kernel_taps) = outputs
    assert taps.shape[1] == len(config.dspark_target_layer_ids) > 0
    torch.testing.assert_close(kernel_logits, logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(kernel_taps, taps, atol=1e-5, rtol=0)


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("rows", "dim"), [(1, 4096), (64, 4096), (256, 4096), (64, 256), (300, 256)])
def test_cuda_site_matches_float64(rows: int, dim: int, dtype: torch.dtype, gen: torch.Generator,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The released width from one row to a large bucket, mini-40's past 8 rows (four rows a program)."""
    inputs, expand = _inputs(rows, dim, dtype, True, gen, torch.device("cuda"))
    _poison_empty(monkeypatch)
    got = hc_site(*inputs, ITERS, HC_EPS, NORM_EPS, expand=expand, impl="triton")
    _check(got, inputs, expand)
    again = hc_site(*inputs, ITERS, HC_EPS, NORM_EPS, expand=expand, impl="triton")
    for name, a, b in zip(HcSite._fields, got, again):
        assert torch.equal(a, b), f"{name}: not deterministic"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("expand", [False, True])
def test_cuda_site_is_two_launches(expand: bool, gen: torch.Generator) -> None:
    from torch.profiler import ProfilerActivity, profile

    inputs, expansion = _inputs(8, 4096, torch.bfloat16, expand, gen, torch.device("cuda"))
    hc_site(*inputs, ITERS, HC_EPS, NORM_EPS, expand=expansion)  # compiles
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        hc_site(*inputs, ITERS, HC_EPS, NORM_EPS, expand=expansion)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 2 and all("_hc_site_" in name for name in kernels), kernels
