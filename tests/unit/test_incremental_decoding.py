"""Cached, chunked and token-by-token processing equal one full forward.

Prompt 0 (40 tokens) crosses the 8-token window 5 times, the ratio-2 groups of layers 2-5 at
every other token, and the candidate pool's 2-entry blocks. The computations differ only in
float32 summation order (different matmul shapes), about 1e-6 here; TOL = 1e-4 leaves margin
without hiding a wrong mask or a dropped entry (those move logits by > 1e-2). Longer prompts are
not used: there the rounding can flip a near-tied top-k pick (see the conformance test).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from cedserve.model.state import SequenceState

if TYPE_CHECKING:
    from conftest import ReferenceA

pytestmark = pytest.mark.unit

TOL = 1e-4


def _worst(got: torch.Tensor, want: torch.Tensor) -> tuple[float, int]:
    per_row = (got - want).abs().amax(dim=-1)
    return float(per_row.max()), int(per_row.argmax())


def test_token_by_token_equals_full_forward(reference_a: ReferenceA) -> None:
    model, prompt = reference_a.model, reference_a.prompts[0]
    full = model.prefill(prompt, model.new_state())
    state = model.new_state()
    stepped = torch.cat([model.decode_step([token], [state]) for token in prompt])
    err, row = _worst(stepped, full)
    assert err <= TOL, f"token-by-token vs full: {err:.3g} at position {row}"


@pytest.mark.parametrize("chunks", [(20, 20), (7, 13, 1, 19), (3, 3, 3, 31)])
def test_chunked_prefill_equals_full_forward(reference_a: ReferenceA, chunks: tuple[int, ...]) -> None:
    model, prompt = reference_a.model, reference_a.prompts[0]
    whole_state = model.new_state()
    full = model.prefill(prompt, whole_state)
    state, outs, start = model.new_state(), [], 0
    for size in chunks:
        outs.append(model.prefill(prompt[start : start + size], state))
        start += size
    err, row = _worst(torch.cat(outs), full)
    assert err <= TOL, f"chunks {chunks}: {err:.3g} at position {row}"
    _assert_same_state_shape(state, whole_state)


def _assert_same_state_shape(a: SequenceState, b: SequenceState) -> None:
    assert a.position == b.position
    assert {k: v.shape for k, v in a.swa.items()} == {k: v.shape for k, v in b.swa.items()}
    for layer, kv in a.global_kv.items():
        other = b.global_kv[layer]
        assert kv.num_entries == other.num_entries
        assert kv.pending.kv.shape == other.pending.kv.shape
        assert torch.allclose(kv.main_values(), other.main_values(), atol=TOL)


def test_state_is_bounded_and_only_sources_store_global_kv(reference_a: ReferenceA) -> None:
    model = reference_a.model
    config = model.config
    state = model.new_state()
    model.prefill(reference_a.prompts[0][:39], state)
    assert set(state.global_kv) == set(config.kv_source_layer_ids)
    assert all(records.shape[0] == config.sliding_window - 1 for records in state.swa.values())
    for layer, kv in state.global_kv.items():
        ratio = config.compress_ratios[layer]
        assert kv.num_entries == 39 // ratio
        assert kv.pending.kv.shape[0] == 39 % ratio
    expected_bytes = sum(
        (config.head_dim // 2 + config.head_dim // 16 + config.index_head_dim // 2 + config.index_head_dim // 32)
        * (39 // config.compress_ratios[layer])
        for layer in config.kv_source_layer_ids
    )
    assert state.global_kv_bytes() == expected_bytes


def test_decode_step_batches_independent_sequences(reference_a: ReferenceA) -> None:
    model = reference_a.model
    prompts = [reference_a.prompts[0][:10], reference_a.prompts[0][10:23]]
    states = [model.new_state() for _ in prompts]
    singles = []
    for prompt, state in zip(prompts, states):
        model.prefill(prompt, state)
        alone = model.new_state()
        model.prefill(prompt, alone)
        singles.append(model.decode_step([7], [alone]))
    batched = model.decode_step([7, 7], states)
    assert torch.equal(batched, torch.cat(singles))
