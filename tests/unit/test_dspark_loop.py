"""A greedy speculative decoding loop, end to end, is lossless: it emits exactly the tokens of plain
greedy decoding with the target alone.

One step: the drafter proposes K tokens after the anchor (the last emitted token, not yet consumed
by the target); `verify` scores anchor + drafts in one pass; `accept_greedy` keeps the drafts that
equal the target's argmax and adds the target's own next token; `commit` keeps the anchor and the
accepted drafts in the target's state; the draft state is extended with the pass's taps and
truncated to the kept positions.

A random drafter almost never matches a random target, so a second run drafts the target's true
continuation with one token corrupted at a position that cycles through 0..K, exercising every
acceptance length, including all K (a bonus token).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from cedserve.decode_workers.speculative import accept_greedy
from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model
from cedserve.model.dspark import Drafter, DraftState
from cedserve.model.network import CEDModel
from cedserve.model.presets import preset
from cedserve.model.tokenizer import tiny_tokenizer_path

pytestmark = pytest.mark.unit

NUM_TOKENS = 30
PROMPT = [0, 17, 202, 45, 311, 9, 88, 150, 273, 61, 5]

Propose = Callable[[int, DraftState, int], list[int]]
"""(anchor, draft state, number of tokens emitted so far) -> K drafts."""


@pytest.fixture(scope="module")
def models() -> Iterator[tuple[CEDModel, Drafter]]:
    config = fit_config_to_tokenizer(preset("tiny"), tiny_tokenizer_path())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's ops are too small for intra-op threads
    yield random_model(config, tiny_tokenizer_path(), seed=7)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def greedy(models: tuple[CEDModel, Drafter]) -> list[int]:
    """Plain greedy decoding with the target alone, K tokens beyond NUM_TOKENS (for the oracle)."""
    model, _ = models
    state = model.new_state()
    tokens = [int(model.prefill(PROMPT, state)[-1].argmax())]
    while len(tokens) < NUM_TOKENS + model.config.dspark_block_size:
        tokens.append(int(model.decode_step([tokens[-1]], [state])[0].argmax()))
    return tokens


def speculative_greedy(model: CEDModel, drafter: Drafter, propose: Propose) -> tuple[list[int], list[int]]:
    """Emitted tokens (NUM_TOKENS of them) and the number of drafts accepted at each step."""
    state, draft_state = model.new_state(), DraftState.new(model.config)
    prompt = model.prefill_with_taps(PROMPT, state)
    draft_state.extend(drafter.context_vectors(prompt.taps))
    emitted, accepted = [int(prompt.logits[-1].argmax())], []
    while len(emitted) < NUM_TOKENS:
        anchor = emitted[-1]
        drafts = propose(anchor, draft_state, len(emitted))
        verification = model.verify([anchor, *drafts], state)
        verdict = accept_greedy(drafts, verification.logits)
        model.commit(state, verification.snapshot, 1 + verdict.num_accepted)
        draft_state.extend(drafter.context_vectors(verification.taps))
        draft_state.truncate(state.position)
        emitted.extend(verdict.tokens)
        accepted.append(verdict.num_accepted)
        assert draft_state.end_position == state.position
    return emitted[:NUM_TOKENS], accepted


def test_dspark_drafts_are_lossless(models: tuple[CEDModel, Drafter], greedy: list[int]) -> None:
    model, drafter = models

    def propose(anchor: int, draft_state: DraftState, _: int) -> list[int]:
        return drafter.draft(anchor, draft_state, model.embed, model.lm_head).tokens

    emitted, _ = speculative_greedy(model, drafter, propose)
    assert emitted == greedy[:NUM_TOKENS]


def test_every_acceptance_length_is_lossless(models: tuple[CEDModel, Drafter], greedy: list[int]) -> None:
    model, drafter = models
    k, vocab = model.config.dspark_block_size, model.config.vocab_size
    steps: list[int] = []

    def propose(_anchor: int, _state: DraftState, emitted: int) -> list[int]:
        drafts = list(greedy[emitted : emitted + k])
        wrong = len(steps) % (k + 1)  # k: all drafts right
        if wrong < k:
            drafts[wrong] = (drafts[wrong] + 1) % vocab
        steps.append(wrong)
        return drafts

    emitted, accepted = speculative_greedy(model, drafter, propose)
    assert emitted == greedy[:NUM_TOKENS]
    assert accepted == steps[: len(accepted)]
    assert set(accepted) == set(range(k + 1))
