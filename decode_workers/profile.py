"""Measured step costs: the curve DSpark's verification length maximises over, and `LoadReport.step_s`.

`seconds(rows)` predicts a target pass over `rows` rows from a least-squares line through the last
passes measured (fixed cost plus cost per row); until enough distinct sizes are seen it uses the
configured prior. `step_s()` is seconds per decode step by batch size (index = batch size), an
exponential average of whole steps, for the router's placement formula.
"""

from __future__ import annotations

from collections import deque

MIN_SAMPLES = 8
"""Passes measured before the fitted line replaces the prior."""


class StepProfile:
    def __init__(self, prior_s: float, prior_per_row_s: float, window: int = 512, ema: float = 0.2) -> None:
        self.prior = (prior_s, prior_per_row_s)
        self._passes: deque[tuple[int, float]] = deque(maxlen=window)
        self._by_batch: dict[int, float] = {}
        self._ema = ema
        self._fit: tuple[float, float] | None = None

    def record_pass(self, rows: int, seconds: float) -> None:
        """One target pass over `rows` rows took `seconds`."""
        self._passes.append((rows, seconds))
        self._fit = None

    def record_step(self, batch: int, seconds: float) -> None:
        """One whole decode step (drafting included) of `batch` requests took `seconds`."""
        old = self._by_batch.get(batch)
        self._by_batch[batch] = seconds if old is None else (1 - self._ema) * old + self._ema * seconds

    def line(self) -> tuple[float, float]:
        """(fixed seconds, seconds per row) of a pass."""
        if self._fit is None:
            self._fit = self._least_squares() or self.prior
        return self._fit

    def seconds(self, rows: int) -> float:
        fixed, per_row = self.line()
        return max(fixed + per_row * rows, 1e-6)

    def steps_per_s(self, rows: int) -> float:
        return 1.0 / self.seconds(rows)

    def step_s(self) -> list[float]:
        """Seconds per step by batch size 0..max seen (gaps filled from the nearest smaller size)."""
        if not self._by_batch:
            return []
        out, last = [], 0.0
        for batch in range(max(self._by_batch) + 1):
            last = self._by_batch.get(batch, last)
            out.append(last)
        return out

    def _least_squares(self) -> tuple[float, float] | None:
        if len(self._passes) < MIN_SAMPLES or len({r for r, _ in self._passes}) < 2:
            return None
        n = len(self._passes)
        mean_r = sum(r for r, _ in self._passes) / n
        mean_s = sum(s for _, s in self._passes) / n
        var = sum((r - mean_r) ** 2 for r, _ in self._passes)
        slope = sum((r - mean_r) * (s - mean_s) for r, s in self._passes) / var
        slope = max(slope, 0.0)
        return max(mean_s - slope * mean_r, 0.0), slope
