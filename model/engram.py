"""Engram conditional memory: hashed n-gram tables gated into the residual streams.

Token ids are first mapped to a smaller vocabulary in which tokens that normalise alike
(case, accents, whitespace) share an id. For each position, the 2..N-grams ending there are
hashed, per Engram layer, by XOR-ing `id * multiplier` over the look-back and reducing modulo
one prime per (n-gram size, head); each (size, head) owns a disjoint row range of the layer's
table. The rows are projected to a key per stream and one shared value; a stream takes the
value in proportion to a sigmoid gate on its (normalised) agreement with its key.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cedserve.model.config import ModelConfig
from cedserve.model.tokenizer import build_compressed_token_map

_MILLER_RABIN_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin, exact for every n < 3.3e24."""
    if n < 2:
        return False
    for p in _MILLER_RABIN_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _MILLER_RABIN_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = pow(x, 2, n)
            if x == n - 1:
                break
        else:
            return False
    return True


def table_primes(config: ModelConfig) -> list[list[list[int]]]:
    """Bucket sizes `[layer][n-gram size - 2][head]`: for every (layer, size), the `n_heads`
    smallest primes >= `engram_vocab_size` not taken by an earlier (layer, size, head)."""
    taken: set[int] = set()
    out: list[list[list[int]]] = []
    for _ in config.engram_layer_ids:
        per_size: list[list[int]] = []
        for _ in range(config.engram_max_ngram_size - 1):
            sizes, candidate = [], config.engram_vocab_size - 1
            for _ in range(config.engram_n_heads):
                candidate += 1
                while candidate in taken or not is_prime(candidate):
                    candidate += 1
                taken.add(candidate)
                sizes.append(candidate)
            per_size.append(sizes)
        out.append(per_size)
    return out


def check_table_sizes(config: ModelConfig) -> None:
    """`ValueError` unless each Engram table has exactly the rows its hash buckets address
    (the sum of that layer's primes); a mismatch would index past the table or waste rows."""
    for layer, rows, primes in zip(config.engram_layer_ids, config.engram_num_embeddings, table_primes(config)):
        needed = sum(sum(p) for p in primes)
        if rows != needed:
            raise ValueError(f"model config field `engram_num_embeddings`: layer {layer} has {rows} rows, "
                             f"but its hash buckets need {needed} (engram_vocab_size={config.engram_vocab_size}, "
                             f"{config.engram_n_heads} heads, n-grams 2..{config.engram_max_ngram_size})")


def hash_multipliers(layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int) -> Tensor:
    """Odd multipliers `[layers, max_ngram_size]` (int64), one per look-back, drawn from a
    numpy PCG64 stream seeded `10007 * layer_id`; bounded so `id * multiplier` fits int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = []
    for layer_id in layer_ids:
        draws = np.random.default_rng(10007 * layer_id).integers(0, bound, size=(max_ngram_size,), dtype=np.int64)
        rows.append(torch.from_numpy(draws * 2 + 1))
    return torch.stack(rows)


def load_compressed_token_map(tokenizer_json: str, config: ModelConfig) -> list[int]:
    """Token map from a `tokenizer.json`; raises `ValueError` if its size disagrees with
    `engram_compressed_vocab_size` (every hash would land elsewhere)."""
    from tokenizers import Tokenizer

    mapping, size = build_compressed_token_map(Tokenizer.from_file(tokenizer_json))
    if size != config.engram_compressed_vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer_json} gives a compressed vocabulary of {size}, but the config's "
            f"engram_compressed_vocab_size is {config.engram_compressed_vocab_size}"
        )
    return mapping


def hash_rows(history: Tensor, history_len: Tensor, compressed: Tensor, multipliers: Tensor, primes: Tensor,
              offsets: Tensor, pad_id: int) -> Tensor:
    """`EngramHasher.hash_rows` as a function of tensors (the decode step compiles it with the history
    gather, `cedserve.model.fused.engram_hashes`): `multipliers [L, N]`, `primes [L, N-1, heads]`,
    `offsets [L, (N-1)*heads]` as the hasher holds them."""
    max_ngram = multipliers.shape[-1]
    keep = max_ngram - 1
    grams = [compressed]
    for shift in range(1, max_ngram):
        source = history[:, keep - shift]
        grams.append(torch.where(history_len >= shift, source, torch.full_like(source, pad_id)))
    return hash_grams(torch.stack(grams, dim=-1), multipliers, primes, offsets)


def hash_grams(tokens: Tensor, multipliers: Tensor, primes: Tensor, offsets: Tensor) -> Tensor:
    """Row ids `[..., L, (N-1)*heads]` of the n-grams `tokens [..., N]` (the token itself first, then
    the ids before it, newest first): each layer's rolling multiply-xor hash of the 2..N-grams, modulo
    each head's prime, offset to its rows."""
    products = tokens.unsqueeze(-2) * multipliers  # [..., L, N]
    rolling, hashes = products[..., 0], []
    for i in range(1, multipliers.shape[-1]):
        rolling = torch.bitwise_xor(rolling, products[..., i])
        hashes.append(rolling.unsqueeze(-1) % primes[:, i - 1])
    return torch.cat(hashes, dim=-1) + offsets


class EngramHasher:
    """Hash ids of the n-grams ending at each position, for all Engram layers at once."""

    def __init__(self, config: ModelConfig, token_map: Sequence[int]) -> None:
        primes = table_primes(config)
        self.max_ngram = config.engram_max_ngram_size
        self.primes = torch.tensor(primes, dtype=torch.long)  # [L, N-1, heads]
        flat = self.primes.flatten(1)
        self.offsets = torch.cumsum(flat, dim=1) - flat  # [L, (N-1)*heads], per-layer row starts
        self.multipliers = hash_multipliers(config.engram_layer_ids, self.max_ngram, config.engram_compressed_vocab_size)
        self.token_map = torch.tensor(list(token_map), dtype=torch.long)
        self.pad_id = int(self.token_map[config.engram_pad_id])

    def compress(self, token_ids: Tensor) -> Tensor:
        return self.token_map.to(token_ids.device)[token_ids.long()]

    def to(self, device: torch.device) -> EngramHasher:
        """This hasher with its tables on `device` (a graph-captured step reads them there: a copy
        from host memory cannot be captured)."""
        moved = copy.copy(self)
        for name in ("primes", "offsets", "multipliers", "token_map"):
            setattr(moved, name, getattr(self, name).to(device))
        return moved

    def hash_rows(self, history: Tensor, history_len: Tensor, compressed: Tensor) -> Tensor:
        """`hash_ids` for one new token per row, with each row's own history length (no host
        values, so a captured decode step can run it): `history [B, N-1]` right-aligned compressed
        ids of the tokens before, of which the last `history_len [B]` are known; `compressed [B]`
        -> `[B, layers, (N-1)*heads]`. Equals `hash_ids(history[b, N-1-len:], compressed[b:b+1],
        start)` of each row when its start >= len (unknown history reads the pad id)."""
        return hash_rows(history, history_len, compressed, self.multipliers, self.primes, self.offsets, self.pad_id)

    def hash_ids(self, history: Tensor, compressed: Tensor, start: int) -> Tensor:
        """Row ids `[S, layers, (N-1)*heads]` for compressed ids `[S]` at positions
        `start..start+S-1`, given the compressed ids of the tokens just before (`history`, exact
        with `min(start, N-1)` of them; look-back past a shorter history reads the pad id).
        Batched: `history [B, h]`, `compressed [B, S]` -> `[B, S, layers, (N-1)*heads]`."""
        full = torch.cat([history, compressed], dim=-1)
        first = full.shape[-1] - compressed.shape[-1]
        positions = torch.arange(start, start + compressed.shape[-1], device=compressed.device)
        index = torch.arange(first, full.shape[-1], device=compressed.device)
        grams = []
        for shift in range(self.max_ngram):
            source = full[..., (index - shift).clamp_min(0)]
            known = (positions >= shift) & (index >= shift)  # unknown history counts as the start
            grams.append(torch.where(known, source, torch.full_like(source, self.pad_id)))
        tokens = torch.stack(grams, dim=-1)  # [(B,) S, N]
        device = tokens.device
        return hash_grams(tokens, self.multipliers.to(device), self.primes.to(device), self.offsets.to(device))


ENGRAM_SCALE_BLOCK = 32
"""FP8 Engram table rows carry one float scale per 32 channels (`embed.scale [rows, head_dim / 32]`)."""


def dequantize_engram_rows(raw: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """FP8 rows `raw [..., head_dim]` times their block scales `scale [..., head_dim / 32]`, as
    `dtype`. Elementwise per row (one float32 product per value), so a gathered subset dequantizes to
    the same bits as the whole table, on any device (the model runner dequantizes staged rows on the
    GPU, `cedserve.model.engram_staging`)."""
    blocks = raw.float().view(*raw.shape[:-1], -1, ENGRAM_SCALE_BLOCK)
    return (blocks * scale.float().unsqueeze(-1)).view(raw.shape).to(dtype)


class EngramEmbedding(nn.Module):
    """Table rows `weight [rows, head_dim]`; FP8 tables carry `scale [rows, head_dim / 32]`."""

    def __init__(self, rows: int, head_dim: int, block: int = ENGRAM_SCALE_BLOCK) -> None:
        super().__init__()
        self.block = block
        self.weight = nn.Parameter(torch.zeros(rows, head_dim))  # defined until a checkpoint lands
        self.scale = nn.Parameter(torch.ones(rows, max(1, head_dim // block)))

    def forward(self, ids: Tensor) -> Tensor:
        values = F.embedding(ids, self.weight)
        if self.weight.dtype == torch.float8_e4m3fn:
            scales = F.embedding(ids, self.scale).float()
            blocks = values.float().view(*values.shape[:-1], -1, self.block)
            values = (blocks * scales.unsqueeze(-1)).flatten(-2)
        return values


class Engram(nn.Module):
    """Checkpoint names under `layers.N.engram.`: `embed.weight`, `embed.scale`, `wkv`,
    `q_weight`, `k_weight`. With `with_table=False` the table lives outside the module (an
    `EngramStore` serving rows from host memory) and the module has no `embed`."""

    def __init__(self, config: ModelConfig, rows: int, with_table: bool = True) -> None:
        super().__init__()
        hidden, hc = config.hidden_size, config.hc_mult
        columns = (config.engram_max_ngram_size - 1) * config.engram_n_heads
        self.eps = config.rms_norm_eps
        self.embed = EngramEmbedding(rows, config.engram_head_dim) if with_table else None
        self.wkv = nn.Linear(columns * config.engram_head_dim, hidden * (hc + 1), bias=False)
        self.q_weight = nn.Parameter(torch.ones(hc, hidden))
        self.k_weight = nn.Parameter(torch.ones(hc, hidden))

    def lookup(self, hash_ids: Tensor) -> Tensor:
        """Rows of the in-module table: `hash_ids [S, columns]` -> `[S, columns, head_dim]`."""
        if self.embed is None:
            raise RuntimeError("this Engram layer's table is served by an EngramStore, not the module")
        rows: Tensor = self.embed(hash_ids)
        return rows

    def forward(self, streams: Tensor, rows: Tensor) -> Tensor:
        """`streams [S, hc, D]`, table `rows [S, columns, head_dim]` -> `[S, hc, D]` (`engram_mix`)."""
        return engram_mix(streams, rows, self.wkv.weight, self.q_weight, self.k_weight, self.eps)


def engram_mix(streams: Tensor, rows: Tensor, wkv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float) -> Tensor:
    """`Engram.forward` as a function of its weights (the decode step compiles it: `FusedOps.engram`):
    `streams [S, hc, D]`, table `rows [S, columns, head_dim]`, `wkv [(hc + 1) D, columns * head_dim]`,
    `q_weight`, `k_weight [hc, D]` -> `[S, hc, D]`. Each stream is gated by its normalised dot
    product with its key and gets the gated value added."""
    hc, hidden = q_weight.shape
    kv = F.linear(rows.flatten(-2).to(wkv.dtype), wkv)
    key = kv[:, : hc * hidden].float().view(-1, hc, hidden)  # [S, hc, D]
    value = kv[:, hc * hidden :]  # [S, D]
    h = streams.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    weight = q_weight.float() * k_weight.float()
    dot = (h * weight * key).sum(-1) * rstd * hidden**-0.5  # [S, hc]
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    out: Tensor = (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)
    return out
