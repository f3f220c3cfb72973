"""The model reproduces the public reference's logits on fixture A (see its README).

Tolerances. Our forward follows the reference's operation order; on the development CPU the
worst errors are <= 4.2e-7 for full forwards (0.0, bit for bit, with two BLAS threads) and
<= 4.1e-6 for cached decode, the size of the reference's own cached-vs-full gap. Elsewhere (another BLAS, GPU) float32 rounding moves
logits by ~1e-6, so TIGHT = 1e-4 leaves a 100x margin. Rounding can also flip a near-tied
top-k pick of the sparse indexer, which moves later logits by 0.1-0.3; the reference shows this
itself for the 200-token prompt 2 (its chunked prefill differs from its full forward by 0.30).
So prompt 2 is held to TIGHT on most positions but may exceed it, up to FLIP_BOUND, on at most
FLIP_FRACTION of its rows. Greedy tokens of prompts 0 and 1 must match exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from conftest import ReferenceA

pytestmark = pytest.mark.unit

TIGHT = 1e-4
FLIP_BOUND = 0.5
FLIP_FRACTION = 0.25
FLIP_TOLERANT_PROMPTS = {2}
DECODE_STEPS = 24


def _greedy_decode(ref: ReferenceA, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Logits of each greedy step (row 0: the prompt's last position) and the chosen tokens."""
    model = ref.model
    state = model.new_state()
    last = model.prefill(prompt, state)[-1:]
    rows, tokens = [last], []
    for _ in range(DECODE_STEPS):
        tokens.append(int(last[0].argmax()))
        last = model.decode_step([tokens[-1]], [state])
        rows.append(last)
    return torch.cat(rows[:DECODE_STEPS]), tokens


def _greedy_decode_paged(ref: ReferenceA, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """`_greedy_decode` on the paged attention path (`cedserve.model.paged_attention`, its
    torch-reference backend: the CPU form of the kernels' path): the prompt as one chunk on its own,
    then each step a `forward_batch` decode chunk (the padded group)."""
    from cedserve.model.network import BatchItem

    model = ref.model
    state = model.new_state()
    model.use_paged_attention("reference")
    try:
        last = model.prefill(prompt, state)[-1:]
        rows, tokens = [last], []
        for _ in range(DECODE_STEPS):
            tokens.append(int(last[0].argmax()))
            (out,) = model.forward_batch([BatchItem([tokens[-1]], state)])
            last = out.logits[-1:]
            rows.append(last)
    finally:
        model.use_paged_attention(None)
    return torch.cat(rows[:DECODE_STEPS]), tokens


def _check_close(got: torch.Tensor, want: torch.Tensor, prompt_index: int, what: str) -> None:
    per_row = (got - want).abs().amax(dim=-1)
    worst = int(per_row.argmax())
    detail = f"{what} prompt {prompt_index}: worst abs error {per_row[worst].item():.3g} at row {worst}"
    if prompt_index not in FLIP_TOLERANT_PROMPTS:
        assert per_row[worst] <= TIGHT, detail
        return
    loose = int((per_row > TIGHT).sum())
    assert per_row[worst] <= FLIP_BOUND, detail
    assert loose <= FLIP_FRACTION * per_row.numel(), f"{detail}; {loose}/{per_row.numel()} rows above {TIGHT}"


@pytest.mark.parametrize("prompt_index", [0, 1, 2])
def test_full_forward_logits(reference_a: ReferenceA, prompt_index: int) -> None:
    prompt = reference_a.prompts[prompt_index]
    got = reference_a.model.prefill(prompt, reference_a.model.new_state())
    want = reference_a.tensor(f"logits_{prompt_index}")
    assert got.shape == want.shape
    _check_close(got, want, prompt_index, "full forward")


@pytest.mark.parametrize("prompt_index", [0, 1, 2])
def test_paged_full_forward_logits(reference_a: ReferenceA, prompt_index: int) -> None:
    """The prompt as one chunk through the paged path (window slots, two-level top-k over paged index
    keys, sparse attention over picked slots) gives the reference's full-forward logits."""
    model = reference_a.model
    model.use_paged_attention("reference")
    try:
        got = model.prefill(reference_a.prompts[prompt_index], model.new_state())
    finally:
        model.use_paged_attention(None)
    _check_close(got, reference_a.tensor(f"logits_{prompt_index}"), prompt_index, "paged full forward")


@pytest.mark.parametrize("prompt_index", [0, 1, 2])
def test_cached_greedy_decode(reference_a: ReferenceA, prompt_index: int) -> None:
    got, tokens = _greedy_decode(reference_a, reference_a.prompts[prompt_index])
    _check_close(got, reference_a.tensor(f"decode_logits_{prompt_index}"), prompt_index, "decode")
    if prompt_index in (0, 1):
        assert tokens == reference_a.results[prompt_index]["greedy_new_tokens"]


@pytest.mark.parametrize("prompt_index", [0, 1, 2])
def test_paged_decode_reproduces_the_reference(reference_a: ReferenceA, prompt_index: int) -> None:
    """Decode steps through the paged arena, the two-level top-k over paged index keys and sparse
    attention over picked slots (the kernels' addressing, on their torch references) give the
    reference's cached-decode logits as the dense path does."""
    got, tokens = _greedy_decode_paged(reference_a, reference_a.prompts[prompt_index])
    _check_close(got, reference_a.tensor(f"decode_logits_{prompt_index}"), prompt_index, "paged decode")
    if prompt_index in (0, 1):
        assert tokens == reference_a.results[prompt_index]["greedy_new_tokens"]
