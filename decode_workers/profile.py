"""Measured step costs: the curves DSpark's verification length maximises over, and `LoadReport.step_s`.

`seconds(rows)` predicts a target pass over `rows` rows from a least-squares line through the last
passes measured (fixed cost plus cost per row); until enough distinct sizes are seen it uses the
configured prior. `draft_seconds(num_seqs)` predicts a DSpark draft pass for `num_seqs` sequences the
same way (no prior: 0 until one is measured, the mean while all measured passes had one size), so
the decision to draft at all (`DSparkProposer`) counts what the draft pass itself costs. `step_s()`
is seconds per decode step by batch size (index = batch size), an exponential average of whole
steps, for the router's placement formula.
"""

from __future__ import annotations

from collections import deque

MIN_SAMPLES = 8
"""Passes measured before the fitted line replaces the prior."""


class CostLine:
    """Least-squares `fixed + per_unit * size` over the last `window` measured (size, seconds)."""

    def __init__(self, prior: tuple[float, float] | None, window: int = 512) -> None:
        self.prior = prior
        """(fixed, per unit) before `MIN_SAMPLES` of two distinct sizes; None: the measured mean
        (flat) while only one size was seen, 0 before any."""
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float] | None = None

    def record(self, size: int, seconds: float) -> None:
        self._samples.append((size, seconds))
        self._fit = None

    def line(self) -> tuple[float, float]:
        """(fixed seconds, seconds per unit)."""
        if self._fit is None:
            self._fit = self._least_squares() or self._fallback()
        return self._fit

    def seconds(self, size: int) -> float:
        fixed, per_unit = self.line()
        return fixed + per_unit * size

    def _fallback(self) -> tuple[float, float]:
        if self.prior is not None:
            return self.prior
        if not self._samples:
            return 0.0, 0.0
        return sum(s for _, s in self._samples) / len(self._samples), 0.0

    def _least_squares(self) -> tuple[float, float] | None:
        if len(self._samples) < MIN_SAMPLES or len({r for r, _ in self._samples}) < 2:
            return None
        n = len(self._samples)
        mean_r = sum(r for r, _ in self._samples) / n
        mean_s = sum(s for _, s in self._samples) / n
        var = sum((r - mean_r) ** 2 for r, _ in self._samples)
        slope = sum((r - mean_r) * (s - mean_s) for r, s in self._samples) / var
        slope = max(slope, 0.0)
        return max(mean_s - slope * mean_r, 0.0), slope


class StepProfile:
    def __init__(self, prior_s: float, prior_per_row_s: float, window: int = 512, ema: float = 0.2) -> None:
        self.prior = (prior_s, prior_per_row_s)
        self._passes = CostLine(self.prior, window)
        self._drafts = CostLine(None, window)
        self._by_batch: dict[int, float] = {}
        self._ema = ema

    def record_pass(self, rows: int, seconds: float) -> None:
        """One target pass over `rows` rows took `seconds`."""
        self._passes.record(rows, seconds)

    def record_draft(self, num_seqs: int, seconds: float) -> None:
        """One draft pass (drafts for `num_seqs` sequences, host sync included) took `seconds`."""
        self._drafts.record(num_seqs, seconds)

    def record_step(self, batch: int, seconds: float) -> None:
        """One whole decode step (drafting included) of `batch` requests took `seconds`."""
        old = self._by_batch.get(batch)
        self._by_batch[batch] = seconds if old is None else (1 - self._ema) * old + self._ema * seconds

    def line(self) -> tuple[float, float]:
        """(fixed seconds, seconds per row) of a target pass."""
        return self._passes.line()

    def draft_line(self) -> tuple[float, float]:
        """(fixed seconds, seconds per sequence) of a draft pass."""
        return self._drafts.line()

    def seconds(self, rows: int) -> float:
        return max(self._passes.seconds(rows), 1e-6)

    def steps_per_s(self, rows: int) -> float:
        return 1.0 / self.seconds(rows)

    def draft_seconds(self, num_seqs: int) -> float:
        """Predicted seconds of a draft pass for `num_seqs` sequences (0 before any is measured)."""
        return max(self._drafts.seconds(num_seqs), 0.0) if num_seqs > 0 else 0.0

    def step_s(self) -> list[float]:
        """Seconds per step by batch size 0..max seen (gaps filled from the nearest smaller size)."""
        if not self._by_batch:
            return []
        out, last = [], 0.0
        for batch in range(max(self._by_batch) + 1):
            last = self._by_batch.get(batch, last)
            out.append(last)
        return out
