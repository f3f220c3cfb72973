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


# ------------------------------------------------------------------ batched drafting


def _reference_draft(drafter: Drafter, anchor: int, state: DraftState, embed: nn.Embedding, head: nn.Linear,
                     temperature: float, generator: torch.Generator | None) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """The one-sequence path written out: one block, `torch.multinomial` draws left to right."""
    config = drafter.config
    k = config.dspark_block_size
    block = torch.tensor([anchor] + [config.dspark_noise_token_id] * (k - 1))
    positions = torch.arange(state.end_position, state.end_position + k)
    context = state.window_vectors
    ctx_pos = torch.arange(state.end_position - context.shape[0], state.end_position)
    with torch.no_grad():
        h = drafter.block_states(block, context, positions, ctx_pos, embed)
        base = head(h).float()
        tokens, probs, confs, previous = [], [], [], anchor
        for pos in range(k):
            logits, confidence = drafter.heads(h[pos : pos + 1], base[pos : pos + 1], torch.tensor([previous]))
            if temperature > 0:
                dist = torch.softmax(logits[0] / temperature, dim=-1)
                previous = int(torch.multinomial(dist, 1, generator=generator))
            else:
                dist = torch.zeros_like(logits[0]).scatter_(0, logits[0].argmax(-1, keepdim=True), 1.0)
                previous = int(logits[0].argmax())
            tokens.append(previous)
            probs.append(dist)
            confs.append(confidence[0, 0])
    return tokens, torch.stack(probs), torch.stack(confs)


def _random_states(drafter: Drafter, seed: int) -> list[DraftState]:
    """Windows of every length class: one vector, partial, full, full plus rollback, at scattered positions."""
    config = drafter.config
    gen = torch.Generator().manual_seed(seed)
    full = config.sliding_window + config.dspark_block_size + 1
    states = []
    for n, start in [(1, 0), (3, 40), (config.sliding_window, 7), (full + 9, 1000), (5, 123)]:
        state = DraftState.new(config)
        state.end_position = start
        taps = torch.randn(n, len(config.dspark_target_layer_ids), config.hc_mult, config.hidden_size, generator=gen)
        with torch.no_grad():
            state.extend(drafter.context_vectors(taps))
        states.append(state)
    return states


TEMPERATURES = {"greedy": [0.0] * 5, "sampled": [0.7, 1.0, 1.3, 0.5, 2.0], "mixed": [0.0, 0.9, 0.0, 1.1, 0.6]}


@pytest.mark.parametrize("mode", sorted(TEMPERATURES))
def test_draft_batch_equals_one_sequence_at_a_time(mode: str) -> None:
    from cedserve.model.dspark import DraftRequest

    drafter, embed, head = _random_drafter(10 + len(mode))
    states = _random_states(drafter, seed=len(mode))
    anchors = torch.randint(0, drafter.config.vocab_size, (len(states),)).tolist()
    temps = TEMPERATURES[mode]
    seeds = [100 + i for i in range(len(states))]
    expected = [_reference_draft(drafter, a, s, embed, head, t, torch.Generator().manual_seed(seed))
                for a, s, t, seed in zip(anchors, states, temps, seeds)]
    gens = [torch.Generator().manual_seed(seed) for seed in seeds]
    got = drafter.draft_batch([DraftRequest(a, s, t, g) for a, s, t, g in zip(anchors, states, temps, gens)],
                              embed, head)
    for (tokens, probs, confs), draft, t, g, seed in zip(expected, got, temps, gens, seeds):
        assert draft.tokens == tokens
        torch.testing.assert_close(draft.probs, probs, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(draft.confidences, confs, atol=1e-6, rtol=1e-5)
        # The request's stream: what k multinomial draws consume when sampled, nothing when greedy.
        alone = torch.Generator().manual_seed(seed)
        if t > 0:
            for _ in range(drafter.config.dspark_block_size):
                torch.multinomial(torch.ones(drafter.config.vocab_size), 1, generator=alone)
        assert torch.equal(g.get_state(), alone.get_state())


def test_draft_batch_shares_the_global_stream_in_request_order() -> None:
    from cedserve.model.dspark import DraftRequest

    drafter, embed, head = _random_drafter(20)
    states = _random_states(drafter, seed=3)[:3]
    torch.manual_seed(5)
    expected = [_reference_draft(drafter, 9, s, embed, head, 1.0, None)[0] for s in states]
    torch.manual_seed(5)
    got = drafter.draft_batch([DraftRequest(9, s, 1.0) for s in states], embed, head)
    assert [d.tokens for d in got] == expected


def test_draft_batch_edges() -> None:
    from cedserve.model.dspark import DraftRequest

    drafter, embed, head = _random_drafter(21)
    assert drafter.draft_batch([], embed, head) == []
    with pytest.raises(ValueError, match="at least one context vector"):
        drafter.draft_batch([DraftRequest(3, _state(drafter, 2)), DraftRequest(3, DraftState.new(drafter.config))],
                            embed, head)
