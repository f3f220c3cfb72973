"""DSpark drafter: block semantics, Markov and confidence heads, bounded rollback-able state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cedserve.model.dspark import Drafter, DraftState
from cedserve.model.presets import preset


def _random_drafter(seed: int) -> tuple[Drafter, nn.Embedding, nn.Linear]:
    torch.manual_seed(seed)
    config = preset("tiny")
    drafter = Drafter(config)
    for name, p in drafter.named_parameters():
        with torch.no_grad():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.3)
    embed = nn.Embedding(config.vocab_size, config.hidden_size)
    head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    return drafter, embed, head


def _state(drafter: Drafter, n: int) -> DraftState:
    config = drafter.config
    state = DraftState.new(config)
    taps = torch.randn(n, len(config.dspark_target_layer_ids), config.hc_mult, config.hidden_size)
    state.extend(drafter.context_vectors(taps))
    return state


def test_draft_shapes_and_heads() -> None:
    drafter, embed, head = _random_drafter(0)
    state = _state(drafter, 5)
    draft = drafter.draft(17, state, embed, head, temperature=1.0, generator=torch.Generator().manual_seed(1))
    k = drafter.config.dspark_block_size
    assert len(draft.tokens) == k and draft.probs.shape == (k, drafter.config.vocab_size)
    assert torch.allclose(draft.probs.sum(-1), torch.ones(k), atol=1e-5)
    assert ((draft.confidences > 0) & (draft.confidences < 1)).all()
    for pos, token in enumerate(draft.tokens):
        assert draft.probs[pos, token] > 0


def test_greedy_follows_the_markov_adjusted_argmax() -> None:
    drafter, embed, head = _random_drafter(1)
    state = _state(drafter, 9)
    draft = drafter.draft(5, state, embed, head, temperature=0.0)
    # Recompute by hand: base logits from the block, then U_k + W1[x_{k-1}] W2 left to right.
    config = drafter.config
    block = torch.tensor([5] + [config.dspark_noise_token_id] * (config.dspark_block_size - 1))
    positions = torch.arange(state.end_position, state.end_position + block.shape[0])
    ctx_pos = torch.arange(state.end_position - state.window_vectors.shape[0], state.end_position)
    x = embed(block)
    with torch.no_grad():
        for layer in drafter.layers:
            x = layer(x, state.window_vectors, drafter.rope, positions, ctx_pos)
        base = head(drafter.final_norm(x))
        prev, expected = 5, []
        for k in range(block.shape[0]):
            token = int((base[k] + drafter.markov.w1[prev] @ drafter.markov.w2).argmax())
            expected.append(token)
            prev = token
    assert draft.tokens == expected


def test_block_is_bidirectional_and_context_matters() -> None:
    drafter, _, _ = _random_drafter(2)
    state = _state(drafter, 6)
    layer = drafter.layers[0]
    positions = torch.arange(6, 11)
    ctx_pos = torch.arange(0, 6)
    x = torch.randn(5, drafter.config.hidden_size)
    with torch.no_grad():
        base = layer(x, state.vectors, drafter.rope, positions, ctx_pos)
        later = x.clone()
        later[4] += 1.0
        # Position 0 sees position 4: the block attends both ways.
        assert not torch.allclose(layer(later, state.vectors, drafter.rope, positions, ctx_pos)[0], base[0])
        other_ctx = state.vectors + 0.5
        assert not torch.allclose(layer(x, other_ctx, drafter.rope, positions, ctx_pos)[0], base[0])


def test_state_is_bounded_and_rolls_back() -> None:
    drafter, _, _ = _random_drafter(3)
    window = drafter.config.sliding_window
    state = _state(drafter, window + 50)
    assert state.vectors.shape[0] == window + state.rollback and state.end_position == window + 50
    assert state.window_vectors.shape[0] == window
    kept = state.window_vectors.clone()
    state.extend(torch.randn(drafter.config.dspark_block_size, drafter.config.hidden_size))
    state.truncate(window + 50)
    # Rolling back a whole rejected block restores the exact window.
    assert torch.equal(state.window_vectors, kept)
    with pytest.raises(ValueError, match="roll the draft state back"):
        state.truncate(0)
