"""The CED prefill path: encoder-only chunks plus the decoder KV source, then decoder replay.

`encode_chunk` must write exactly the global KV a full prefill writes (same records, byte for
byte here: same operations on the same inputs), and replaying the decoder over a span that covers
its receptive field (`decoder layers x (sliding_window - 1)` tokens) must leave the sequence in
the state a full prefill leaves, so later decode steps match exactly. Shorter spans are the
"bounded replay" approximation; their error is measured and printed, not asserted small.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import pytest
import torch

from cedserve.model.network import BoundaryHidden

if TYPE_CHECKING:
    from conftest import ReferenceA

pytestmark = pytest.mark.unit

TOL = 1e-4


def test_encode_then_replay_equals_prefill(reference_a: ReferenceA) -> None:
    model, prompt = reference_a.model, reference_a.prompts[0]
    config = model.config
    full_state = model.new_state()
    full = model.prefill(prompt, full_state)

    state = model.new_state()
    encoded = model.encode_chunk(prompt, state)
    for layer, kv in state.global_kv.items():
        assert torch.equal(kv.main, full_state.global_kv[layer].main), f"main KV of layer {layer}"
        assert torch.equal(kv.index_keys, full_state.global_kv[layer].index_keys), f"index keys of layer {layer}"
        assert torch.equal(encoded.global_kv[layer].main, kv.main)
    for layer in range(config.num_encoder_layers):
        assert torch.equal(state.swa[layer], full_state.swa[layer]), f"window of layer {layer}"

    decoder_layers = config.num_hidden_layers - config.num_encoder_layers
    span = encoded.boundary.last(decoder_layers * (config.sliding_window - 1))
    logits = model.replay_decoder(span, state)
    assert (logits[-1] - full[-1]).abs().max() <= TOL
    for layer in range(config.num_hidden_layers):
        assert torch.equal(state.swa[layer], full_state.swa[layer]), f"window of layer {layer}"
    token = int(full[-1].argmax())
    assert torch.equal(model.decode_step([token], [state]), model.decode_step([token], [full_state]))


def test_chunked_encode_ships_every_record_once(reference_a: ReferenceA) -> None:
    """Chunks differ from one pass only by float rounding, so values are compared with TOL."""
    model, prompt = reference_a.model, reference_a.prompts[0]
    full_state = model.new_state()
    full = model.prefill(prompt, full_state)
    state = model.new_state()
    chunks = [model.encode_chunk(prompt[:17], state), model.encode_chunk(prompt[17:], state)]
    for layer, kv in state.global_kv.items():
        assert [c.global_kv[layer].first_entry for c in chunks] == [0, chunks[0].global_kv[layer].main.shape[0]]
        assert torch.equal(torch.cat([c.global_kv[layer].main for c in chunks]), kv.main)
        assert torch.equal(torch.cat([c.global_kv[layer].index_keys for c in chunks]), kv.index_keys)
        torch.testing.assert_close(kv.main_values(), full_state.global_kv[layer].main_values(), atol=TOL, rtol=0)
    boundary = BoundaryHidden.concat([c.boundary for c in chunks])
    assert boundary.positions.tolist() == list(range(len(prompt)))
    logits = model.replay_decoder(boundary, state)
    assert (logits - full).abs().max() <= TOL


@pytest.mark.parametrize("span", [1, 8])
def test_short_replay_is_bounded_approximation(reference_a: ReferenceA, span: int) -> None:
    model, prompt = reference_a.model, reference_a.prompts[0]
    full_state = model.new_state()
    full = model.prefill(prompt, full_state)
    state = model.new_state()
    boundary = model.encode_chunk(prompt, state).boundary
    logits = model.replay_decoder(boundary.last(span), copy.deepcopy(state))
    err = float((logits[-1] - full[-1]).abs().max())
    print(f"replay span {span}: last-token logit error {err:.3g}")
    assert torch.isfinite(logits).all() and err < 5.0


def test_replay_span_must_end_at_sequence_position(reference_a: ReferenceA) -> None:
    model, prompt = reference_a.model, reference_a.prompts[0]
    state = model.new_state()
    boundary = model.encode_chunk(prompt[:10], state).boundary
    model.encode_chunk(prompt[10:12], state)
    with pytest.raises(ValueError, match="replay span ends"):
        model.replay_decoder(boundary, state)


def test_replay_rebuilds_bounded_state_from_global_kv(reference_a: ReferenceA) -> None:
    """A decode worker that received only the global KV (and the position) rebuilds windows,
    the ratio-2 compressor's partial group and the Engram history from the last tokens. Over the
    whole (39-token, odd) sequence the replay runs the same operations as the prefill, so the
    rebuilt state is identical and decoding continues bit for bit."""
    model, prompt = reference_a.model, reference_a.prompts[0][:39]
    full_state = model.new_state()
    full = model.prefill(prompt, full_state)
    received = copy.deepcopy(full_state)
    for layer in received.swa:
        received.swa[layer] = received.swa[layer][:0]
    for kv in received.global_kv.values():
        kv.pending = type(kv.pending).empty(model.config.head_dim)
    received.engram_tail = received.engram_tail[:0]

    logits = model.replay(prompt, received)
    assert torch.equal(logits, full)
    for layer in received.swa:
        assert torch.equal(received.swa[layer], full_state.swa[layer])
    assert received.global_kv[2].pending.kv.shape[0] == 1
    assert torch.equal(received.global_kv[2].pending.gate, full_state.global_kv[2].pending.gate)
    assert torch.equal(received.engram_tail, full_state.engram_tail)
    for token in (3, 4, 5):
        assert torch.equal(model.decode_step([token], [received]), model.decode_step([token], [full_state]))


def test_short_replay_of_all_layers_is_bounded_approximation(reference_a: ReferenceA) -> None:
    model, prompt = reference_a.model, reference_a.prompts[0]
    full_state = model.new_state()
    full = model.prefill(prompt, full_state)
    received = copy.deepcopy(full_state)
    logits = model.replay(prompt[-9:], received)
    err = float((logits[-1] - full[-1]).abs().max())
    print(f"9-token replay of all layers: last-token logit error {err:.3g}")
    assert torch.isfinite(logits).all() and err < 5.0
    assert received.position == full_state.position
    assert all(received.swa[layer].shape == full_state.swa[layer].shape for layer in received.swa)
