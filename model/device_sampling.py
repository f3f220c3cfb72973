"""Sampling on the device, per row, with no host value: what a captured decode step ends with.

`sample_rows` draws one token per row of `logits [B, vocab]` under each row's temperature, top-k and
top-p (`cedserve.model.sampling.probabilities`' rules: greedy at temperature 0, top-k then top-p over
the temperature-scaled softmax, the token that crosses top-p kept) by the Gumbel-max trick. The
noise is counter-based: a hash of (seed, counter, token id), so a row's draw depends only on its
request's seed and the position it samples at, never on which other rows share the batch, and a
captured graph replays it without a generator's host-side offset. Requests without a seed get a
seed from the host's generator when they join.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF


def _fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def uniform_noise(seeds: Tensor, counters: Tensor, vocab: int) -> Tensor:
    """float32 `[..., vocab]` in (0, 1): hash of (`seeds`, `counters`, token id), `seeds` and
    `counters` long tensors broadcast together (`[B]` each: one row per request; `[B, 1]` with
    `[B, k]`: k counters per request, each row the values `[B]` calls would give)."""
    token = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    row = _fmix32((seeds & _MASK32) ^ _fmix32((counters * 0x9E3779B9 + (seeds >> 32)) & _MASK32))
    h = _fmix32((row.unsqueeze(-1) ^ (token * 0x27D4EB2F)) & _MASK32)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def sample_rows(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seeds: Tensor,
                counters: Tensor) -> Tensor:
    """Token ids long `[B]` of `logits [B, vocab]` (module docstring). `temperature`, `top_p`:
    float32 `[B]` (0: greedy; 1: no nucleus cut); `top_k`: long `[B]` (0: off)."""
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    ordered, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    keep = (top_k <= 0).unsqueeze(-1) | (rank < top_k.unsqueeze(-1))
    # top-k by value, as `probabilities` does: ties with the k-th value stay
    kth = ordered.gather(1, (top_k.clamp(1, vocab) - 1).unsqueeze(-1))
    keep = keep | ((top_k > 0).unsqueeze(-1) & (ordered >= kth))
    ordered = ordered.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    drop = (probs.cumsum(-1) - probs) >= top_p.unsqueeze(-1)
    ordered = ordered.masked_fill(drop & (top_p < 1.0).unsqueeze(-1), float("-inf"))
    noise = uniform_noise(seeds, counters, vocab).gather(1, order)
    gumbel = -torch.log(-torch.log(noise))
    picked = order.gather(1, (ordered + gumbel).argmax(-1, keepdim=True)).squeeze(-1)
    return torch.where(greedy, logits.argmax(-1), picked)
