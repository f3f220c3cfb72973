"""DSpark acceptance is lossless and the verification length follows the throughput objective."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch

from cedserve.decode_workers.speculative import (
    accept_greedy,
    accept_rejection,
    choose_verify_lengths,
    expected_tokens,
)


def test_greedy_keeps_matching_prefix() -> None:
    logits = torch.full((4, 10), -1.0)
    for row, tok in enumerate([3, 5, 7, 9]):
        logits[row, tok] = 1.0
    assert accept_greedy([3, 5, 2], logits).tokens == [3, 5, 7]
    assert accept_greedy([3, 5, 7], logits).tokens == [3, 5, 7, 9]  # all pass: bonus
    assert accept_greedy([], logits[:1]).tokens == [3]
    with pytest.raises(ValueError, match="rows"):
        accept_greedy([1, 2], logits)


def test_rejection_sampling_is_lossless() -> None:
    # Emitted first token must follow p_1 whatever q is: compare the empirical law with p over many
    # trials (fresh random distributions; tolerance from the binomial standard error).
    gen = torch.Generator().manual_seed(7)
    vocab, k, trials = 6, 2, 20_000
    p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, -1)
    counts = torch.zeros(vocab)
    pair_counts: dict[tuple[int, int], int] = {}
    for _ in range(trials):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        out = accept_rejection(drafts, q, p, generator=gen).tokens
        counts[out[0]] += 1
        if len(out) >= 2:
            pair_counts[(out[0], out[1])] = pair_counts.get((out[0], out[1]), 0) + 1
    freq = counts / trials
    stderr = (p[0] * (1 - p[0]) / trials).sqrt()
    assert ((freq - p[0]).abs() <= 5 * stderr + 1e-3).all(), (freq, p[0])


def test_rejection_identical_distributions_accept_everything() -> None:
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(4, 8, generator=gen), -1)
    verdict = accept_rejection([1, 2, 3], p[:3], p, generator=gen)
    assert verdict.num_accepted == 3 and len(verdict.tokens) == 4


def test_expected_tokens() -> None:
    c = torch.tensor([[0.5, 0.5, 0.5]])
    assert expected_tokens(c, torch.tensor([0])).item() == 1.0
    assert expected_tokens(c, torch.tensor([2])).item() == pytest.approx(1 + 0.5 + 0.25)


def _brute_force(conf: torch.Tensor, rate: object) -> float:
    batch, k = conf.shape
    best = 0.0
    for combo in itertools.product(range(k + 1), repeat=batch):
        lengths = torch.tensor(combo)
        value = float(expected_tokens(conf, lengths).sum()) * rate(int(lengths.sum()) + batch)  # type: ignore[operator]
        best = max(best, value)
    return best


@pytest.mark.parametrize("seed", range(5))
def test_verify_lengths_match_brute_force(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    conf = torch.rand(3, 4, generator=gen) ** 0.3

    def rate(n: Any) -> Any:  # a saturating throughput curve: flat until 6 positions, then 1/n (ints or arrays)
        return 100.0 / np.maximum(6, n)

    lengths = choose_verify_lengths(conf, rate)
    got = float(expected_tokens(conf, lengths).sum()) * float(rate(int(lengths.sum()) + 3))
    assert got == pytest.approx(_brute_force(conf, rate), rel=1e-9)


def test_verify_lengths_extremes() -> None:
    conf = torch.tensor([[0.99] * 5, [0.01] * 5])
    free = choose_verify_lengths(conf, lambda n: 1.0)  # verification costs nothing: verify all
    assert free.tolist() == [5, 5]
    # A pass costs a fixed overhead plus a little per position: confident drafts pay, hopeless don't.
    costly = choose_verify_lengths(conf, lambda n: 1.0 / (1.0 + 0.1 * n))
    assert costly.tolist() == [5, 0]
    # Cost purely linear in positions: no draft with c < 1 can beat one token per position.
    assert choose_verify_lengths(conf, lambda n: 1.0 / n).tolist() == [0, 0]


def test_verify_lengths_respect_each_requests_cap() -> None:
    """Caps (an effort's draft limit) bound each request; within them the choice is unchanged."""
    conf = torch.tensor([[0.99] * 5, [0.99] * 5, [0.5] * 5])
    caps = torch.tensor([5, 2, 0])
    assert choose_verify_lengths(conf, lambda n: 1.0, caps).tolist() == [5, 2, 0]
    costly = choose_verify_lengths(conf, lambda n: 1.0 / (1.0 + 0.1 * n), caps)
    assert costly.tolist() == [5, 2, 0]
    assert choose_verify_lengths(conf, lambda n: 1.0 / n, caps).tolist() == [0, 0, 0]
    assert choose_verify_lengths(conf[:, :0], lambda n: 1.0, torch.tensor([0, 0, 0])).tolist() == [0, 0, 0]


def test_verify_lengths_count_the_draft_pass() -> None:
    # 4 requests with a good drafter (c = 0.9); a pass costs 50 ms + 1 ms per row.
    conf = torch.full((4, 5), 0.9)
    rate = lambda n: 1.0 / (0.05 + 0.001 * n)  # noqa: E731
    assert choose_verify_lengths(conf, rate).tolist() == [5, 5, 5, 5]  # the drafts exist: verify them
    # Deciding whether to draft at all: a 1 s draft pass cannot pay for 4 x 3.7 extra tokens
    # (4 tokens per 54 ms without drafting), a 20 ms one can.
    assert choose_verify_lengths(conf, rate, draft_s=1.0).tolist() == [0, 0, 0, 0]
    assert choose_verify_lengths(conf, rate, draft_s=0.02).tolist() == [5, 5, 5, 5]
    # Break-even: verifying everything yields 4 x 4.69 tokens in 74 ms + d; it pays while d < ~0.16 s.
    tokens = float(expected_tokens(conf, torch.full((4,), 5)).sum())
    break_even = tokens / (4 * rate(4)) - 1.0 / rate(24)
    assert choose_verify_lengths(conf, rate, draft_s=break_even * 0.99).sum() > 0
    assert choose_verify_lengths(conf, rate, draft_s=break_even * 1.01).sum() == 0
    with pytest.raises(ValueError, match="draft_s"):
        choose_verify_lengths(conf, rate, draft_s=-1.0)


def test_survival_calibration_moves_predicted_survival_to_the_measured_one() -> None:
    from cedserve.decode_workers.profile import SurvivalCalibration

    cal = SurvivalCalibration(window=10_000, prior_weight=4.0)
    raw = torch.tensor([0.5, 0.4, 0.5, 0.5, 0.5])  # conditional c_k; survival 0.5, 0.2, 0.1, 0.05, 0.025
    assert torch.allclose(cal.calibrated(raw), raw)  # nothing measured: unchanged
    predicted = torch.cumprod(raw.double(), 0).tolist()
    # drafts that in truth survive much longer than predicted: 2 of 3 verifications accept all 5
    for i in range(300):
        cal.record(predicted, 5 if i % 3 else 0)
    survival = torch.cumprod(cal.calibrated(raw).double(), 0)
    # measured survival is 2/3 at every position; the prior (4 verifications at the prediction)
    # pulls it slightly toward the prediction; kept <= 1 and non-increasing
    assert abs(float(survival[0]) - 2 / 3) < 0.01
    assert torch.all(survival[1:] <= survival[:-1] + 1e-12) and float(survival.max()) <= 1.0
    assert abs(float(survival[4]) - 2 / 3) < 0.03
    # positions never verified keep the prediction
    cal2 = SurvivalCalibration()
    cal2.record(predicted[:2], 2)
    assert torch.allclose(cal2.calibrated(raw)[2:], raw[2:].to(torch.float32))
    # a batch [B, K] with zero confidences past a request's limit stays finite
    out = cal.calibrated(torch.tensor([[0.5, 0.0, 0.0, 0.0, 0.0], [0.9, 0.9, 0.9, 0.9, 0.9]]))
    assert torch.isfinite(out).all() and float(out[0, 1:].abs().max()) == 0.0
