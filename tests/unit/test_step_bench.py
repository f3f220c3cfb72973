"""`benchmarks/step.py`'s attribution of a profiled step's kernels to the parts of a layer: each kernel
to the range that held its launch (found by correlation id in the profiled run, which needs a GPU;
pairing by order broke when a part's launches and kernels did not count alike); its overlapped
steps' loop reads the tokens of the same steps in series."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import step

pytestmark = pytest.mark.unit


def test_kernels_go_to_the_range_that_launched_them() -> None:
    # two layers' "moe" and "attend" ranges, a nested "select" inside the second "attend"
    parts = [(0.0, 10.0, "attend"), (10.0, 20.0, "moe"), (20.0, 40.0, "attend"), (25.0, 30.0, "select"),
             (40.0, 50.0, "moe")]
    kernels: list[tuple[float | None, str, float]] = [
        (2.0, "attn", 5.0), (12.0, "gemm", 20.0), (21.0, "attn", 7.0), (26.0, "topk", 3.0), (31.0, "attn", 1.0),
        (45.0, "gemm", 30.0), (60.0, "sample", 2.0), (13.0, "bmm", 4.0), (None, "orphan", 1.0)]
    rows = {r["part"]: r for r in step.attribute_kernels(parts, kernels, top=2)}
    assert set(rows) == {"attend", "moe", "select", "(outside)", "(unlinked)"}
    assert rows["attend"]["kernels"] == 3 and rows["attend"]["ms"] == pytest.approx(0.013)
    assert rows["attend"]["top"] == [{"name": "attn", "kernels": 3, "ms": pytest.approx(0.013)}]
    assert rows["moe"]["kernels"] == 3 and rows["moe"]["ms"] == pytest.approx(0.054)
    assert [k["name"] for k in rows["moe"]["top"]] == ["gemm", "bmm"]  # heaviest first, at most `top`
    assert rows["select"]["kernels"] == 1 and rows["select"]["top"][0]["name"] == "topk"  # the inner range
    assert rows["(outside)"]["top"][0]["name"] == "sample"
    assert rows["(unlinked)"]["top"][0]["name"] == "orphan"
    order = [r["part"] for r in step.attribute_kernels(parts, kernels)]
    assert order[:2] == ["attend", "moe"]  # most kernels first, ties by name


def test_library_ops_put_the_old_bmm_and_topk_back_for_their_cells() -> None:
    """`--paths graph-fused-before` measures the step as it was before the grouped_linear kernel and
    the argmax routing: inside the context the fused step's `wo_a` is cuBLAS's `bmm` whatever impl it
    asks for and the routing's top-k is `topk`; after, the kernel's launcher and the rounds again."""
    from cedserve.kernels.grouped_linear import grouped_linear, grouped_linear_reference
    from cedserve.model import fused

    x, w = torch.randn(3, 2, 8), torch.randn(2 * 4, 8)
    scores = torch.tensor([[0.1, 0.7, 0.3, 0.9]])
    with step.library_ops(True):
        assert fused.grouped_linear is not grouped_linear
        assert torch.equal(fused.grouped_linear(x, w, "triton"), grouped_linear_reference(x, w))
        assert fused.ARGMAX_TOPK == 0
        assert sorted(fused.pick_topk(scores, 2, by_argmax=True).tolist()[0]) == [1, 3]
    assert fused.grouped_linear is grouped_linear and fused.ARGMAX_TOPK > 0
    assert fused.pick_topk(scores, 2, by_argmax=True).tolist() == [[3, 1]]
    with step.library_ops(False):
        assert fused.grouped_linear is grouped_linear and fused.ARGMAX_TOPK > 0


def test_overlapped_steps_read_the_tokens_of_steps_in_series() -> None:
    """`graph-fused-overlap`'s loop (`OverlappedSteps`, the engine's launch-then-collect): each step
    fed the step before's picks on the device reads back the tokens of the same steps in series."""
    from decode_support import prompt, tiny

    from cedserve.model.runner import ModelRunner, RunnerConfig

    model, _ = tiny()
    runner = ModelRunner(model, RunnerConfig(max_slots=3, max_context=128))
    state = model.new_state()
    model.prefill(prompt(24, 6), state)
    first = [7, 99, 300]

    def fresh() -> None:
        for slot in range(3):
            runner.load(slot, state)

    fresh()
    series, tokens = [], first
    for _ in range(5):
        tokens = runner.step_logits([0, 1, 2], tokens).argmax(-1).tolist()
        series.append(tokens)
    fresh()
    steps = step.OverlappedSteps(runner, 3, first)
    for _ in range(5):
        steps()
    assert len(steps.picks) == 4  # the fifth is still in flight
    steps.collect()
    assert steps.picks == series
