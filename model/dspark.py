"""DSpark: the speculative drafter (not in the public reference; semantics from DESIGN section 1).

Context. For every target position t the drafter keeps one context vector
    c_t = RMSNorm(W_c [h_a(t); h_b(t); h_c(t)])          # [hidden]
where h_l(t) is the attention input of backbone layer l (`dspark_target_layer_ids`, 37-39 when
released) averaged over the mHC streams. Only the last `sliding_window` vectors matter, so this
state is bounded like every SWA ring (`DraftState`).

Draft pass. The block is the anchor (the last accepted token) followed by `dspark_block_size - 1`
copies of the noise token. Each of the `num_nextn_predict_layers` draft layers runs
attention + MoE (`dspark_n_routed_experts`, top `dspark_num_experts_per_tok`) on one residual
stream. Attention keys are the context vectors of the window before the anchor (projected by the
layer's own K=V latent) plus the block's own positions, which see each other bidirectionally. The
shared LM head turns the final states into base logits U_k for all block positions at once.

Markov and confidence heads (rank r = `dspark_markov_rank`):
    q_k(v) ∝ exp(U_k(v) + (W1[x_{k-1}] W2)_v)       # x_0 = anchor; sampled left to right
    c_k    = sigmoid(w · [h_k; W1[x_{k-1}]])          # survival of a j-prefix = c_1 ... c_j
The drafts, their distributions q_k (for lossless acceptance) and c_k (for the verification length)
come out of one call, for a whole batch of sequences at once (`Drafter.draft_batch`).

Checkpoint names (ours; the released layout is not public): `dspark.fc.weight [D, 3D]`,
`dspark.norm.weight`, `dspark.layers.N.{attn_norm,ffn_norm}.weight`, `dspark.layers.N.attn.*`
(same names as backbone attention minus the compressed branch), `dspark.layers.N.ffn.*` (MoE),
`dspark.final_norm.weight`, `dspark.markov.w1 [V, r]`, `dspark.markov.w2 [r, V]`,
`dspark.confidence.weight [1, D + r]`, `dspark.confidence.bias [1]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from cedserve.kernels.grouped_linear import linear
from cedserve.model.attention import GroupedOutput, sink_attention
from cedserve.model.config import ModelConfig
from cedserve.model.moe import MoE
from cedserve.model.norm import RMSNorm
from cedserve.model.rope import RopeTable, apply_rope


@dataclass
class DraftState:
    """One sequence's drafter memory: the newest context vectors.

    It keeps `window + rollback` vectors so that rolling back up to `rollback` rejected positions
    still leaves a full window; attention reads the newest `window`.
    """

    vectors: Tensor  # [n <= window + rollback, hidden]
    end_position: int  # position after the newest vector
    window: int
    rollback: int
    last_confidences: Tensor | None = None
    """float32 `[K]` on the host: c_1..c_K of this sequence's latest draft (None: none yet). The
    serving proposer predicts the next draft's worth from it."""

    @staticmethod
    def new(config: ModelConfig, device: torch.device | None = None) -> DraftState:
        return DraftState(torch.zeros(0, config.hidden_size, device=device), 0, config.sliding_window,
                          config.dspark_block_size + 1)

    @property
    def window_vectors(self) -> Tensor:
        """The vectors attention reads: `[min(n, window), hidden]`."""
        return self.vectors[max(0, self.vectors.shape[0] - self.window) :]

    def extend(self, vectors: Tensor) -> None:
        """Append context vectors of the next positions, keeping the newest `window + rollback`."""
        joined = torch.cat([self.vectors, vectors.to(self.vectors.dtype)])
        self.vectors = joined[max(0, joined.shape[0] - self.window - self.rollback) :]
        self.end_position += int(vectors.shape[0])

    def truncate(self, end_position: int) -> None:
        """Forget vectors at or after `end_position` (rejected drafts)."""
        drop = self.end_position - end_position
        if drop < 0 or drop > self.vectors.shape[0]:
            raise ValueError(f"cannot roll the draft state back from {self.end_position} to {end_position}")
        self.vectors = self.vectors[: self.vectors.shape[0] - drop]
        self.end_position = end_position


@dataclass(frozen=True)
class Draft:
    """One draft pass for one sequence (k = block size)."""

    tokens: list[int]  # [k] drafted tokens x_1..x_k
    probs: Tensor  # float32 [k, vocab]: q_k each token was drawn from
    confidences: Tensor  # float32 [k]: c_k


@dataclass(frozen=True)
class DraftRequest:
    """One sequence to draft for in a batched draft pass."""

    anchor: int  # the token at position `state.end_position` (the last accepted one)
    state: DraftState
    temperature: float = 0.0  # <= 0: greedy
    generator: torch.Generator | None = None  # the request's own stream (None: the global one)


class DraftAttention(nn.Module):
    """Shared-K=V latent attention with a sink, over context keys plus a bidirectional block."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        heads, dim = config.num_attention_heads, config.head_dim
        self.wq_a = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, heads * dim, bias=False)
        self.wkv = nn.Linear(config.hidden_size, dim, bias=False)
        self.kv_norm = RMSNorm(dim, config.rms_norm_eps)
        self.wo_a = GroupedOutput(heads * dim // config.o_groups, config.o_groups, config.o_lora_rank)
        self.wo_b = nn.Linear(config.o_groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(heads))

    def forward(self, x: Tensor, context: Tensor, rope: RopeTable, positions: Tensor, ctx_positions: Tensor) -> Tensor:
        """`x [k, D]` block states at `positions [k]`; `context [n, D]` at `ctx_positions [n]`.
        Batched (training): `x [A, k, D]`, `positions [A, k]`, `context [A, n, D]`,
        `ctx_positions [A, n]`; a negative context position marks padding, which no query sees."""
        c = self.config
        cos, sin = rope.cos_sin(positions)
        q = self.wq_b(self.q_norm(self.wq_a(x))).unflatten(-1, (c.num_attention_heads, c.head_dim))
        q = apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
        block_kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        ccos, csin = rope.cos_sin(ctx_positions)
        ctx_kv = apply_rope(self.kv_norm(self.wkv(context)), ccos, csin)
        keys = torch.cat([ctx_kv, block_kv], dim=-2)
        # all visible (window + block) but padding: [(A,) k, n + k]
        zero = torch.zeros((), device=x.device)
        padding = torch.where(ctx_positions < 0, torch.full_like(zero, float("-inf")), zero)
        block = torch.zeros(*positions.shape, device=x.device)
        bias = torch.cat([padding, block], dim=-1).unsqueeze(-2).expand(*x.shape[:-1], -1)
        out = sink_attention(q, keys.to(q.dtype), bias, self.attn_sink, c.head_dim**-0.5)
        out = apply_rope(out, cos.unsqueeze(-2), sin.unsqueeze(-2), inverse=True)
        projected: Tensor = self.wo_b(self.wo_a(out.reshape(*out.shape[:-2], c.o_groups, -1)))
        return projected


class DraftLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = DraftAttention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = MoE(config.replace(n_routed_experts=config.dspark_n_routed_experts,
                                      num_experts_per_tok=config.dspark_num_experts_per_tok))

    def forward(self, x: Tensor, context: Tensor, rope: RopeTable, positions: Tensor, ctx_positions: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), context, rope, positions, ctx_positions)
        out: Tensor = x + self.ffn(self.ffn_norm(x))
        return out


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.zeros(vocab, rank))  # zeros until a checkpoint lands: no offset
        self.w2 = nn.Parameter(torch.zeros(rank, vocab))

    def bias(self, previous: Tensor) -> Tensor:
        """Logit offsets `[n, V]` given the previous tokens `[n]`."""
        return self.w1[previous] @ self.w2


class Drafter(nn.Module):
    """The DSpark draft model. It shares the target's embedding and LM head (passed in)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        hidden, taps = config.hidden_size, len(config.dspark_target_layer_ids)
        self.fc = nn.Linear(taps * hidden, hidden, bias=False)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList([DraftLayer(config) for _ in range(config.num_nextn_predict_layers)])
        self.final_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.markov = MarkovHead(config.vocab_size, config.dspark_markov_rank)
        self.confidence = nn.Linear(hidden + config.dspark_markov_rank, 1)
        self.rope = RopeTable((config.rope_parameters or {})["main"], config.head_dim, config.max_position_embeddings)

    def context_vectors(self, taps: Tensor) -> Tensor:
        """`taps [..., S, n_taps, hc, D]` (attention inputs of the tapped layers, per stream) -> `[..., S, D]`.
        The stream mean is taken in the taps' dtype (as a prefill worker averages the taps it ships),
        then cast to the drafter's."""
        averaged = taps.mean(dim=-2).flatten(-2).to(self.fc.weight.dtype)
        # an observe's few rows in float32 on CUDA: the grouped kernel, not cuBLAS's ~52 us pick
        # (`kernels.grouped_linear.linear`; anything else is `F.linear`)
        projected = linear(averaged, self.fc.weight) if averaged.dim() == 2 else self.fc(averaged)
        vectors: Tensor = self.norm(projected)
        return vectors

    def block_states(self, block: Tensor, context: Tensor, positions: Tensor, ctx_positions: Tensor,
                     embed: nn.Embedding) -> Tensor:
        """Final states `[..., k, D]` of draft blocks `block [..., k]` (token ids) at `positions`,
        over context vectors `context [..., n, D]` at `ctx_positions` (see `DraftAttention`)."""
        x = embed(block)
        for layer in self.layers:
            x = layer(x, context.to(x.dtype), self.rope, positions, ctx_positions)
        h: Tensor = self.final_norm(x)
        return h

    def heads(self, h: Tensor, base: Tensor, previous: Tensor) -> tuple[Tensor, Tensor]:
        """Markov-adjusted logits `U_k + W1[x_{k-1}] W2` (float32 `[..., V]`) and confidences c_k
        (float32 `[..., 1]`) of block states `h [..., D]` with base logits `base [..., V]`, given
        the previous tokens `previous [...]`."""
        row = self.markov.w1[previous]  # [..., r]
        logits = base + (row @ self.markov.w2).float()
        confidence = torch.sigmoid(self.confidence(torch.cat([h, row.to(h.dtype)], -1))).float()
        return logits, confidence

    @torch.no_grad()
    def draft(self, anchor: int, state: DraftState, embed: nn.Embedding, lm_head: nn.Module,
              temperature: float = 0.0, generator: torch.Generator | None = None) -> Draft:
        """Draft `dspark_block_size` tokens after `anchor`, the token at position `state.end_position`."""
        return self.draft_batch([DraftRequest(anchor, state, temperature, generator)], embed, lm_head)[0]

    @torch.no_grad()
    def draft_batch(self, requests: Sequence[DraftRequest], embed: nn.Embedding, lm_head: nn.Module) -> list[Draft]:
        """One draft pass for several sequences: their context windows padded to the longest (a
        negative context position masks a pad, see `DraftAttention`), all blocks through the draft
        layers and the LM head at once, then the Markov/confidence heads left to right for all rows.

        Equal to drafting each request alone up to float rounding (the batched matmuls); a request's
        random stream is exactly what it would consume alone (`_sample_batch`)."""
        c = self.config
        k, batch = c.dspark_block_size, len(requests)
        if batch == 0:
            return []
        device = embed.weight.device
        windows = [r.state.window_vectors for r in requests]
        if any(w.shape[0] == 0 for w in windows):
            raise ValueError("draft_batch: every request needs at least one context vector")
        context = pad_sequence(windows, batch_first=True)  # [B, n, D], zeros after each window
        lengths = torch.tensor([w.shape[0] for w in windows], device=device)[:, None]  # [B, 1]
        ends = torch.tensor([r.state.end_position for r in requests], device=device)  # [B]
        offsets = torch.arange(context.shape[1], device=device)  # [n]
        # [B, n]: the window's positions, then -1 (a pad no query sees)
        ctx_positions = torch.where(offsets < lengths, ends[:, None] - lengths + offsets, -1)
        block = torch.full((batch, k), c.dspark_noise_token_id, dtype=torch.long, device=device)  # [B, k]
        block[:, 0] = torch.tensor([r.anchor for r in requests], device=device)
        positions = ends[:, None] + torch.arange(k, device=device)  # [B, k]
        h = self.block_states(block, context, positions, ctx_positions, embed)  # [B, k, D]
        base = lm_head(h).float()  # [B, k, V]: U_k
        return self._sample_batch(requests, block[:, 0], h, base)

    def _sample_batch(self, requests: Sequence[DraftRequest], anchors: Tensor, h: Tensor, base: Tensor) -> list[Draft]:
        """Markov-adjusted tokens left to right for all rows at once.

        Greedy rows (temperature <= 0) take the argmax and draw nothing. A sampled row's token at
        each position is `argmax(q / E)` with `E ~ Exp(1)^V` drawn from the request's generator
        (float32, on the generator's device): the exponential race, which is how `torch.multinomial`
        draws one sample, so a request consumes exactly the stream that `k` calls of
        `torch.multinomial(q_k, 1, generator=g)` would, in position order, and draws the same tokens
        (tests/unit/test_dspark.py checks both). The noise is drawn up front, request by request, so
        requests sharing one generator (None: the global one) draw in the same order as one by one.
        """
        batch, k, vocab = base.shape
        temperature = torch.tensor([max(r.temperature, 0.0) for r in requests], device=base.device)
        sampled = temperature > 0  # [B]
        noise = self._race_noise(requests, k, vocab, base.device) if bool(sampled.any()) else None  # [B, k, V]
        scale = torch.where(sampled, temperature, torch.ones_like(temperature))[:, None]  # [B, 1]
        previous = anchors
        tokens, probs, confs = [], [], []
        for pos in range(k):
            logits, confidence = self.heads(h[:, pos], base[:, pos], previous)  # [B, V], [B, 1]
            dist = torch.zeros_like(logits).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)  # greedy: one-hot
            if noise is not None:
                dist = torch.where(sampled[:, None], torch.softmax(logits / scale, dim=-1), dist)
                previous = (dist / noise[:, pos]).argmax(-1)  # greedy rows' noise is 1
            else:
                previous = dist.argmax(-1)
            tokens.append(previous)
            probs.append(dist)
            confs.append(confidence[:, 0])
        token_rows = torch.stack(tokens, 1).tolist()  # [B][k]: the pass's one host sync
        prob_rows, conf_rows = torch.stack(probs, 1), torch.stack(confs, 1)  # [B, k, V], [B, k]
        return [Draft(token_rows[i], prob_rows[i], conf_rows[i]) for i in range(batch)]

    @staticmethod
    def _race_noise(requests: Sequence[DraftRequest], k: int, vocab: int, device: torch.device) -> Tensor:
        """`[B, k, V]` Exp(1) draws of every sampled request, k rows of V in position order from its
        own generator (1 for greedy requests)."""
        noise = torch.ones(len(requests), k, vocab, device=device)
        for i, r in enumerate(requests):
            if r.temperature > 0:
                where = r.generator.device if r.generator is not None else device
                rows = [torch.empty(vocab, device=where).exponential_(1, generator=r.generator) for _ in range(k)]
                noise[i] = torch.stack(rows).to(device)
        return noise
