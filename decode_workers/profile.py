"""Measured step costs: the curves DSpark's verification length maximises over, and `LoadReport.step_s`.

`seconds(rows)` predicts a target pass over `rows` rows from a least-squares line through the last
passes measured (fixed cost plus cost per row); until enough distinct sizes are seen it uses the
configured prior. `draft_seconds(num_seqs)` predicts a DSpark draft pass for `num_seqs` sequences the
same way (no prior: 0 until one is measured, the mean while all measured passes had one size), so
the decision to draft at all (`DSparkProposer`) counts what the draft pass itself costs. `step_s()`
is seconds per decode step by batch size (index = batch size), an exponential average of whole
steps, for the router's placement formula. `cycle_rates(batch)` is what whole steady steps yielded
per second with a draft pass and without (`record_cycle`): where drafting steps clearly yielded less,
the proposer turns drafting down whatever its prediction says, since the passes leave out what a
drafting step costs besides them (observe, acceptance, syncs).

`calibrated(confidences)` corrects the drafter's confidences by what verification measured
(`SurvivalCalibration`): a confidence head trained on per-position agreement predicts the
marginal chance of draft k, and the product c_1 ... c_j then undercounts how often a j-prefix
survives (errors cluster), which made the cost check decline drafting that paid.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

MIN_SAMPLES = 8
"""Passes measured before the fitted line replaces the prior."""
MIN_CYCLES = 3
"""Whole steady steps of each kind (drafting, plain) at a batch size before `cycle_rates` answers."""
CYCLE_EMA = 0.1
"""Weight of the newest whole step in `cycle_rates`' averages."""
STALE_CYCLES = 32
"""A kind (drafting, plain) last seen more than this many steady steps ago at a batch size starts its
average afresh from its next step: after the veto, drafting steps come only as the proposer's probes
(8 to 64 steps apart), and an average still weighing the old ones kept drafting vetoed for hundreds
of steps after a noisy spell had passed (two of six CPU runs declined 60 and 85 of 104 steps where
drafting paid 1.6x, docs/benchmarks/dspark-probe-explore-cpu.json)."""


class CostLine:
    """Least-squares `fixed + per_unit * size` over the last `window` measured (size, seconds).

    The fit is asked for every decode step (twice a drafting step) after a `record` each step, so it
    keeps running sums instead of walking the window: O(1) a step, where the walk over 512 samples
    took ~140 us of the step's host time on the dev VM. The float sums are recomputed from the
    window once per `window` records, so rounding cannot build up over a long run."""

    def __init__(self, prior: tuple[float, float] | None, window: int = 512) -> None:
        self.prior = prior
        """(fixed, per unit) before `MIN_SAMPLES` of two distinct sizes; None: the measured mean
        (flat) while only one size was seen, 0 before any."""
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._fit: tuple[float, float] | None = None
        self._sizes: dict[int, int] = {}  # size -> samples of it in the window
        self._sum_r = self._sum_rr = 0  # exact (sizes are ints)
        self._sum_s = self._sum_rs = 0.0
        self._since_exact = 0  # records since the float sums were last summed afresh

    def record(self, size: int, seconds: float) -> None:
        size, seconds = int(size), float(seconds)
        if len(self._samples) == self._samples.maxlen:
            old_r, old_s = self._samples[0]
            self._add(old_r, old_s, -1)
        self._samples.append((size, seconds))
        self._add(size, seconds, 1)
        self._since_exact += 1
        if self._since_exact >= (self._samples.maxlen or 1):
            self._since_exact = 0
            self._sum_s = sum(s for _, s in self._samples)
            self._sum_rs = sum(r * s for r, s in self._samples)
        self._fit = None

    def _add(self, size: int, seconds: float, sign: int) -> None:
        self._sum_r += sign * size
        self._sum_rr += sign * size * size
        self._sum_s += sign * seconds
        self._sum_rs += sign * size * seconds
        left = self._sizes.get(size, 0) + sign
        if left:
            self._sizes[size] = left
        else:
            self._sizes.pop(size, None)

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
        return self._sum_s / len(self._samples), 0.0

    def _least_squares(self) -> tuple[float, float] | None:
        n = len(self._samples)
        if n < MIN_SAMPLES or len(self._sizes) < 2:
            return None
        var_n = n * self._sum_rr - self._sum_r * self._sum_r  # n^2 var(r), exact: > 0 with two sizes
        slope = max((n * self._sum_rs - self._sum_r * self._sum_s) / var_n, 0.0)
        return max((self._sum_s - slope * self._sum_r) / n, 0.0), slope


class SurvivalCalibration:
    """Per draft position j, the ratio of verified prefixes that survived past j to the survival
    the drafter predicted for them, over about the last `window` verifications (exponential
    decay), starting from `prior_weight` verifications at ratio 1.

    A step's verifications are recorded together in one numpy pass (`record_many`; a Python loop per
    request and position took ~175 us a step at batch 32 on the dev VM), with the result of `record`
    for each in turn, up to float rounding."""

    BATCH_MIN = 4
    """Verifications from which a caller records with `record_many`: below it numpy's fixed cost makes
    the pass slower than `record` each (the engine's calibration at batch 1: 39 against 12 us)."""

    def __init__(self, window: int = 256, prior_weight: float = 4.0) -> None:
        self.window = window
        self.prior_weight = prior_weight
        self._predicted: list[float] = []
        self._survived: list[float] = []
        self._count: list[float] = []

    def record(self, predicted: Sequence[float], accepted: int) -> None:
        """One verification: `predicted[j]` the drafter's survival of the first j + 1 drafts (the
        product of their confidences), for the positions verified; `accepted` how many survived."""
        keep = 1.0 - 1.0 / self.window
        while len(self._predicted) < len(predicted):
            self._predicted.append(0.0)
            self._survived.append(0.0)
            self._count.append(0.0)
        for j in range(len(self._predicted)):
            self._predicted[j] *= keep
            self._survived[j] *= keep
            self._count[j] *= keep
        for j, value in enumerate(predicted):
            self._predicted[j] += float(value)
            self._survived[j] += float(accepted > j)
            self._count[j] += 1.0

    def record_many(self, predicted: np.ndarray, lengths: np.ndarray, accepted: np.ndarray) -> None:
        """Verifications in order: row i of `predicted [n, K]` holds the drafter's survival of its
        first `lengths[i]` positions (the rest is ignored), `accepted[i]` how many survived."""
        n = predicted.shape[0]
        if n == 0:
            return
        width = int(lengths.max())
        while len(self._predicted) < width:
            self._predicted.append(0.0)
            self._survived.append(0.0)
            self._count.append(0.0)
        keep = 1.0 - 1.0 / self.window
        # record i is decayed by the n - 1 - i records after it
        weights = keep ** np.arange(n - 1, -1, -1, dtype=np.float64)[:, None]  # [n, 1]
        positions = np.arange(width)[None, :]
        valid = positions < lengths[:, None]  # [n, width]
        decay = keep**n
        sums = (
            (weights * np.where(valid, predicted[:, :width], 0.0)).sum(axis=0),
            (weights * (valid & (accepted[:, None] > positions))).sum(axis=0),
            (weights * valid).sum(axis=0),
        )
        for kept, added in zip((self._predicted, self._survived, self._count), sums):
            values = np.asarray(kept) * decay
            values[:width] += added
            kept[:] = values.tolist()

    def ratios(self, k: int) -> list[float]:
        """Measured / predicted survival for positions 0..k-1; a position never verified takes the
        ratio of the one before (so its own c_k stays as the drafter said), 1.0 before any."""
        out: list[float] = []
        for j in range(k):
            if j < len(self._predicted) and self._predicted[j] > 0:
                # the prior: `prior_weight` verifications that survived as often as predicted
                prior = self.prior_weight * self._predicted[j] / self._count[j]
                out.append((self._survived[j] + prior) / (self._predicted[j] + prior))
            else:
                out.append(out[-1] if out else 1.0)
        return out

    def calibrated(self, confidences: Tensor) -> Tensor:
        """`confidences [..., K]` (c_k) -> confidences whose running product is the calibrated
        survival: survival x measured ratio, kept in [0, 1] and non-increasing along k. (numpy in
        float64: it runs on the host between the GPU's passes, like `choose_verify_lengths`.)"""
        c = np.clip(confidences.detach().cpu().numpy().astype(np.float64), 0.0, 1.0)
        survival = np.cumprod(c, axis=-1)
        ratio = np.asarray(self.ratios(confidences.shape[-1]), dtype=np.float64)
        fixed = np.minimum.accumulate(np.clip(survival * ratio, 0.0, 1.0), axis=-1)
        previous = np.concatenate([np.ones_like(fixed[..., :1]), fixed[..., :-1]], axis=-1)
        out = np.where(previous > 0, fixed / np.maximum(previous, 1e-12), 0.0)
        return torch.from_numpy(out).to(confidences.dtype)


class StepProfile:
    def __init__(self, prior_s: float, prior_per_row_s: float, window: int = 512, ema: float = 0.2) -> None:
        self.survival = SurvivalCalibration()
        """How the drafter's predicted survival compares with what verification measured."""
        self.prior = (prior_s, prior_per_row_s)
        self._passes = CostLine(self.prior, window)
        self._drafts = CostLine(None, window)
        self._by_batch: dict[int, float] = {}
        self._cycles: dict[tuple[int, bool], tuple[float, float, int]] = {}  # (batch, drafted) -> (s, tokens, n)
        self._cycle_seen: dict[tuple[int, bool], int] = {}  # (batch, drafted) -> steady steps counted when last seen
        self._steady_steps = 0
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

    def record_cycle(self, batch: int, seconds: float, tokens: int, drafted: bool) -> None:
        """One steady step (no join, no preemption) of `batch` requests emitted `tokens` in `seconds`,
        with a draft pass (`drafted`) or without: what a drafting step really costs and yields, the
        draft pass, the verify pass, observe and every sync in it included. Averaged over about the
        last 10 steps of each kind (a step's tokens range over 1 .. K + 1 per request); a kind not seen
        for `STALE_CYCLES` steady steps starts afresh (its count kept)."""
        key = (batch, drafted)
        self._steady_steps += 1
        old = self._cycles.get(key)
        stale = old is not None and self._steady_steps - self._cycle_seen[key] > STALE_CYCLES
        self._cycle_seen[key] = self._steady_steps
        if old is None or stale:
            self._cycles[key] = (seconds, float(tokens), 1 if old is None else old[2] + 1)
            return
        keep = 1 - CYCLE_EMA
        self._cycles[key] = (keep * old[0] + CYCLE_EMA * seconds, keep * old[1] + CYCLE_EMA * tokens, old[2] + 1)

    def cycle_rates(self, batch: int) -> tuple[float, float] | None:
        """(tokens/s of drafting steps, tokens/s of plain steps) at `batch`, as whole steady steps
        measured them; None until each kind was seen `MIN_CYCLES` times at that batch size."""
        drafting, plain = self._cycles.get((batch, True)), self._cycles.get((batch, False))
        if drafting is None or plain is None or min(drafting[2], plain[2]) < MIN_CYCLES:
            return None
        return drafting[1] / drafting[0], plain[1] / plain[0]

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

    def steps_per_s_many(self, rows: np.ndarray) -> np.ndarray:
        """`steps_per_s` of each entry of `rows` (one line lookup for all: `choose_verify_lengths`)."""
        fixed, per_row = self._passes.line()
        return 1.0 / np.maximum(fixed + per_row * rows.astype(np.float64), 1e-6)

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
