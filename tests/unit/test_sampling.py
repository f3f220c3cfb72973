"""Sampling: the processed distribution, seeds, and precise errors for bad parameters."""

from __future__ import annotations

import pytest
import torch

from cedserve.model.sampling import SamplingParams, make_generator, probabilities, sample, top_logprobs


def test_greedy_is_one_hot_argmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    probs = probabilities(logits, SamplingParams())
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.sum(-1), torch.ones(3))
    assert sample(logits[0], SamplingParams()) == int(logits[0].argmax())


def test_top_k_and_top_p_against_a_direct_computation() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    p = torch.softmax(logits, -1)
    k2 = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(k2, torch.tensor([p[0], p[1], 0, 0, 0]) / (p[0] + p[1]))
    # top_p: the smallest prefix of sorted probabilities whose mass reaches top_p.
    mass = float(p[0] + p[1])
    tp = probabilities(logits, SamplingParams(temperature=1.0, top_p=mass - 1e-3))
    assert torch.allclose(tp, k2)
    assert torch.allclose(probabilities(logits, SamplingParams(temperature=2.0)), torch.softmax(logits / 2, -1))


def test_seed_reproduces_and_frequencies_follow_p() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0])
    params = SamplingParams(temperature=1.0, seed=123)
    a = [sample(logits, params, make_generator(params)) for _ in range(3)]
    b = [sample(logits, params, make_generator(params)) for _ in range(3)]
    assert a == b
    gen = make_generator(params)
    draws = torch.tensor([sample(logits, params, gen) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.softmax(logits, -1), atol=0.03)


def test_top_logprobs() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0])
    (best, lp), _ = top_logprobs(logits, 2)
    assert best == 1 and lp == pytest.approx(float(torch.log_softmax(logits, -1)[1]))


@pytest.mark.parametrize(("field", "kwargs"), [
    ("temperature", {"temperature": -1.0}), ("top_p", {"top_p": 0.0}), ("top_k", {"top_k": -2}),
    ("max_tokens", {"max_tokens": 0}), ("logprobs", {"logprobs": 50})])
def test_bad_params_name_the_field(field: str, kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
