"""DSpark verification: lossless acceptance of drafted tokens and the choice of verification length.

Drafting proposes up to K tokens per request from the draft distribution q_k (Markov-adjusted, see
DESIGN section 1). The target model then scores all of them in one pass, giving p_1..p_{K+1}.

Acceptance is lossless rejection sampling: draft token x_k is kept with probability
min(1, p_k(x_k) / q_k(x_k)); at the first rejection the token is resampled from
normalise(max(0, p_k - q_k)) and the rest are dropped; when all pass, a bonus token is sampled from
p_{K+1}. The emitted tokens are then distributed exactly as if sampled from the target alone.
Greedy decoding keeps drafts while they equal the target's argmax and then emits the argmax.

Verification length: the confidence head gives c_1..c_K; the chance that the first j drafts all
survive is prod(c_1..c_j), so verifying j drafts yields on average 1 + sum_{i<=j} prod(c_1..c_i)
tokens and costs j + 1 positions in the target pass. Lengths are chosen jointly for the batch to
maximise expected tokens per second, given a profiled curve of target steps per second by the
number of positions verified in the step. Whether to draft at all is the same choice with the
draft pass's own measured cost added to every step that verifies a draft (`draft_s`): when the
best lengths are all 0 the batch's expected gain does not pay for drafting (`DSparkProposer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class Verdict:
    """What one request emits after a verification pass."""

    num_accepted: int
    """Drafted tokens kept (0..K)."""
    tokens: list[int]
    """Tokens to append: the accepted drafts plus one corrected or bonus token."""


def accept_greedy(draft_tokens: Sequence[int], target_logits: Tensor, argmax: Sequence[int] | None = None) -> Verdict:
    """Keep drafts while each equals the target argmax; then emit the target's own token.

    `target_logits`: `[K + 1, vocab]`, row k scoring the position of draft k (row K: the bonus);
    `argmax`: its rows' argmax when the caller has them on the host already (no device sync here).
    """
    k = len(draft_tokens)
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows for {k} drafts (need {k + 1})")
    if argmax is None:
        argmax = target_logits.argmax(dim=-1).tolist()
    elif len(argmax) != k + 1:
        raise ValueError(f"argmax has {len(argmax)} rows for {k} drafts (need {k + 1})")
    n = 0
    while n < k and draft_tokens[n] == argmax[n]:
        n += 1
    return Verdict(n, [*draft_tokens[:n], int(argmax[n])])


def accept_rejection(draft_tokens: Sequence[int], draft_probs: Tensor, target_probs: Tensor,
                     generator: torch.Generator | None = None) -> Verdict:
    """Lossless rejection sampling of K drafts.

    `draft_probs`: `[K, vocab]` (q_k, the distribution each draft was sampled from);
    `target_probs`: `[K + 1, vocab]` (p_k after temperature/top-p/top-k processing).
    """
    k = len(draft_tokens)
    if draft_probs.shape[0] != k or target_probs.shape[0] != k + 1:
        raise ValueError(f"need {k} draft rows and {k + 1} target rows, got {draft_probs.shape[0]} "
                         f"and {target_probs.shape[0]}")
    p = target_probs.double()
    q = draft_probs.double()
    drafts = torch.tensor(list(draft_tokens), dtype=torch.long)
    rows = torch.arange(k)
    ratio = p[rows, drafts] / q[rows, drafts].clamp_min(1e-300)
    u = torch.rand(k, generator=generator, dtype=torch.float64)
    rejected = (u >= ratio).nonzero()
    if rejected.numel() == 0:
        bonus = torch.multinomial(p[k], 1, generator=generator).item()
        return Verdict(k, [*draft_tokens, int(bonus)])
    n = int(rejected[0].item())
    residual = (p[n] - q[n]).clamp_min(0.0)
    total = residual.sum()
    # p == q on the support leaves no residual mass; the draft was then only rejected through u's
    # rounding edge, and p itself is the right distribution to sample from.
    dist = residual / total if total > 0 else p[n]
    token = torch.multinomial(dist, 1, generator=generator).item()
    return Verdict(n, [*draft_tokens[:n], int(token)])


def expected_tokens(confidences: Tensor, lengths: Tensor) -> Tensor:
    """Expected tokens emitted per request: 1 + sum_{i<=j} prod(c_1..c_i), `j = lengths[b]`.

    `confidences`: `[batch, K]` in [0, 1]; `lengths`: `[batch]` ints in [0, K]. (numpy inside, as
    `choose_verify_lengths`.)
    """
    survival = np.cumprod(_host(confidences), axis=-1)  # [batch, K]
    mask = np.arange(confidences.shape[-1]) < _host(lengths)[:, None]
    return torch.from_numpy(1.0 + (survival * mask).sum(axis=-1))


def choose_verify_lengths(confidences: Tensor, steps_per_s: Callable[[np.ndarray], np.ndarray | float],
                          max_lengths: Tensor | None = None, draft_s: float = 0.0) -> Tensor:
    """Per-request verification lengths maximising the batch's expected tokens per second.

    `steps_per_s(n)` is the profiled rate of target passes verifying `n` positions in total
    (`n = batch + sum(lengths)`), asked once for an int64 array of every total (a scalar answer
    is taken for all of them): one call, not one per position, since at batch 32 the per-total
    Python calls were most of the choice's host time. `max_lengths [batch]` (default K) caps each request (its effort's
    draft limit; its confidences past the cap are ignored). `draft_s` is what drafting adds to a
    step that verifies any draft (the draft pass, `StepProfile.draft_seconds`): count it when the
    choice decides whether to draft at all, leave it 0 once the drafts exist (then it is spent
    whatever is verified). All zeros: drafting does not pay for this batch.

    For a fixed total, the best lengths come from adding positions one at a time where the expected
    gain is largest: each request's survival is non-increasing in j, so its gains are too, and the
    greedy order is exact. That order is one stable sort of all gains (ties: the lower request, then
    the earlier position). Every total from 0 to batch x K is scored and the best kept, so no shape
    of the rate curve is assumed.

    Computed in numpy (float64) on the host: it runs twice a drafting step, between the GPU's passes
    (the GPU waits for it), and as ~40 torch CPU ops it took ~170 us a call on the dev VM.
    """
    if draft_s < 0:
        raise ValueError(f"draft_s must be >= 0, got {draft_s}")
    batch, k = confidences.shape
    caps = np.full(batch, k) if max_lengths is None else np.clip(_host(max_lengths).astype(np.int64), 0, k)
    survival = np.cumprod(_host(confidences), axis=-1)  # [batch, K]
    allowed = (np.arange(k) < caps[:, None]).ravel()  # [batch * K], row-major
    gains = survival.ravel()[allowed]
    rows = np.repeat(np.arange(batch), k)[allowed]
    order = np.argsort(-gains, kind="stable")  # the greedy order (stable: ties keep row-major order)
    lengths = np.zeros(batch, dtype=np.int64)
    if gains.shape[0] == 0:
        return torch.from_numpy(lengths)
    tokens = batch + np.cumsum(gains[order])  # [T]: expected tokens after 1..T positions
    totals = batch + np.arange(tokens.shape[0] + 1, dtype=np.int64)  # [T + 1]: no drafts, then 1..T positions
    rates = np.broadcast_to(np.asarray(steps_per_s(totals), dtype=np.float64), totals.shape)
    values = tokens / (1.0 / rates[1:] + draft_s)
    best = int(values.argmax())
    if float(values[best]) > batch * float(rates[0]):
        lengths = np.bincount(rows[order[: best + 1]], minlength=batch).astype(np.int64)
    return torch.from_numpy(lengths)


def _host(t: Tensor) -> np.ndarray:
    """A host tensor's values as a float64 (or int) numpy array, without a copy where none is needed."""
    array = t.detach().cpu().numpy()
    return array.astype(np.float64) if array.dtype.kind == "f" else array
