"""Token sampling shared by both worker kinds (prefill samples the first token, decode the rest).

`SamplingParams` mirrors the `cedserve.v1.SamplingParams` proto. `probabilities` applies
temperature, top-k and top-p to logits and returns the distribution actually sampled from, which
DSpark's lossless acceptance needs as the target distribution p. Greedy (temperature 0) is a one-hot
distribution on the argmax, so the same acceptance code covers both modes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus mass kept (1 = off)."""
    top_k: int = 0
    """Most likely tokens kept (0 = off)."""
    seed: int | None = None
    """Per-request seed; the same seed and prompt give the same tokens."""
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    logprobs: int = 0
    """Top-n logprobs to return per token (0 = none)."""
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0 or self.temperature > 100:
            raise ValueError(f"field `sampling.temperature`: must be in [0, 100], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"field `sampling.top_p`: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"field `sampling.top_k`: must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"field `sampling.max_tokens`: must be >= 1, got {self.max_tokens}")
        if not 0 <= self.logprobs <= 20:
            raise ValueError(f"field `sampling.logprobs`: must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution sampled from, float32 `[..., vocab]`, after temperature, top-k and top-p."""
    logits = logits.float()
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    scaled = logits / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = scaled.topk(params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded from the request's seed, or None for the global RNG."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from `logits [vocab]`."""
    probs = probabilities(logits, params)
    if params.greedy:
        return int(probs.argmax())
    return int(torch.multinomial(probs, 1, generator=generator))


def top_logprobs(logits: Tensor, n: int) -> list[tuple[int, float]]:
    """The `n` most likely tokens of `logits [vocab]` with their log-probabilities."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logp.topk(n)
    return [(int(i), float(v)) for i, v in zip(ids, values)]
