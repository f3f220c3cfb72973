"""`StepProfile`'s cost lines: the running least-squares fit equals a fit over the window's samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cedserve.decode_workers.profile import MIN_SAMPLES, CostLine, StepProfile


def _walk_fit(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """The fit walked over the samples in float64 (the line's definition: slope >= 0, intercept >= 0)."""
    r = np.array([x for x, _ in samples], dtype=np.float64)
    s = np.array([y for _, y in samples], dtype=np.float64)
    slope = max(float(((r - r.mean()) * (s - s.mean())).sum() / ((r - r.mean()) ** 2).sum()), 0.0)
    return max(float(s.mean() - slope * r.mean()), 0.0), slope


@pytest.mark.parametrize("seed", range(4))
def test_running_fit_equals_the_window_walk(seed: int) -> None:
    rng = np.random.default_rng(seed)
    window = 64
    line = CostLine(prior=(0.05, 0.001), window=window)
    kept: list[tuple[int, float]] = []
    for i in range(1_000):  # ~15 windows: evictions, and the float sums summed afresh several times
        size = int(rng.choice([1, 6, 12, 32]))
        seconds = float(1e-3 + 2e-5 * size + rng.normal(0, 1e-4))
        line.record(size, seconds)
        kept = [*kept, (size, seconds)][-window:]
        if (i % 37 == 0 and i >= window) or i > 990:
            fixed, per_unit = line.line()
            want_fixed, want_per_unit = _walk_fit(kept)
            assert fixed == pytest.approx(want_fixed, rel=1e-9, abs=1e-15)
            assert per_unit == pytest.approx(want_per_unit, rel=1e-9, abs=1e-15)
            assert line.seconds(8) == pytest.approx(want_fixed + 8 * want_per_unit, rel=1e-9)


def test_prior_until_enough_samples_of_two_sizes() -> None:
    line = CostLine(prior=(0.05, 0.001), window=16)
    for _ in range(MIN_SAMPLES + 4):  # many samples, one size: still the prior
        line.record(4, 0.002)
    assert line.line() == (0.05, 0.001)
    for _ in range(16):  # the window now holds two sizes only: the window's own fit
        line.record(8, 0.003)
    assert line.line() == (0.05, 0.001)  # the 4s were all evicted: one size again
    line.record(2, 0.0015)
    fixed, per_unit = line.line()
    assert per_unit > 0 and fixed + 8 * per_unit == pytest.approx(0.003, rel=0.05)


def test_no_prior_takes_the_mean_then_a_decreasing_cost_is_flat() -> None:
    line = CostLine(prior=None, window=32)
    assert line.line() == (0.0, 0.0)
    line.record(3, 0.004)
    line.record(3, 0.002)
    assert line.line() == pytest.approx((0.003, 0.0))
    for size in range(1, 20):  # cost falling with size: slope clipped at 0, the mean left
        line.record(size, 0.01 - 0.0004 * size)
    fixed, per_unit = line.line()
    assert per_unit == 0.0 and fixed == pytest.approx(_walk_fit([(3, 0.004), (3, 0.002)] + [
        (size, 0.01 - 0.0004 * size) for size in range(1, 20)])[0])


def test_steps_per_s_many_is_steps_per_s_of_each() -> None:
    profile = StepProfile(0.05, 0.001)
    for i in range(40):
        profile.record_pass(1 + i % 7, 0.002 + 1e-4 * (1 + i % 7))
    rows = np.arange(1, 50, dtype=np.int64)
    many = profile.steps_per_s_many(rows)
    assert many.tolist() == pytest.approx([profile.steps_per_s(int(n)) for n in rows], rel=1e-12)


def test_recording_a_batch_equals_recording_each_in_turn() -> None:
    """`record_many` (a step's verifications in one numpy pass) leaves what `record` of each row in
    turn leaves, rows of different lengths included, so the calibrated confidences agree."""
    from cedserve.decode_workers.profile import SurvivalCalibration

    rng = np.random.default_rng(5)
    one, many = SurvivalCalibration(window=64), SurvivalCalibration(window=64)
    for _ in range(30):
        n = int(rng.integers(1, 9))
        lengths = rng.integers(1, 6, size=n)
        predicted = np.cumprod(rng.random((n, 5)), axis=1)
        accepted = rng.integers(0, 6, size=n)
        for row, length, ok in zip(predicted, lengths, accepted):
            one.record(row[:length].tolist(), int(ok))
        many.record_many(predicted, lengths, accepted)
        assert many.ratios(7) == pytest.approx(one.ratios(7), rel=1e-12)
    confidences = torch.tensor(rng.random((4, 5)), dtype=torch.float32)
    torch.testing.assert_close(many.calibrated(confidences), one.calibrated(confidences), rtol=1e-6, atol=0)


def test_ratios_fill_positions_never_verified_from_the_one_before() -> None:
    from cedserve.decode_workers.profile import SurvivalCalibration

    cal = SurvivalCalibration(window=10, prior_weight=0.0)
    assert cal.ratios(3) == [1.0, 1.0, 1.0]
    cal.record([0.5, 0.25], 1)  # position 0 survived (ratio 1 / 0.5), position 1 did not (0)
    assert cal.ratios(4) == pytest.approx([2.0, 0.0, 0.0, 0.0])
