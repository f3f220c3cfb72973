"""The DSpark drafter's pass over slots: its memory in a preallocated ring, a fixed-shape step.

`Drafter.draft_batch` pads each request's `DraftState.window_vectors` (tensors of its own) into a
batch whose shape changes every step, runs its MoE with a host sync per layer and ends in one more
(`.tolist()`). Here the memory of up to `max_slots` requests lives at fixed device addresses
(`DraftPools`):

* `vectors [slots + 1, ring, hidden]`: slot s's context vector of position p at row `p % ring`, with
  `ring = window + rollback`, what a `DraftState` keeps (rolling back `rollback` rejected positions
  still leaves a full window). The last slot is the scratch that a bucket's padding rows read.

Which positions a slot holds the host knows (`DraftRunner` mirrors each slot's extent), so the step
takes them as inputs: `DraftStep.forward(slots, anchors, ends, counts, temperature, seeds, probs)`
drafts `dspark_block_size` tokens after each row's anchor (the token at position `end`) over the
`count` newest vectors before it, as `Drafter.draft_batch` does: equal up to float rounding (the
context is padded to the window rather than to the batch's longest, the MoE runs on the device), the
same greedy tokens. No host value is read and every shape depends only on the row count, so
`cedserve.model.draft_runner` captures it as one CUDA graph per bucket; a CPU runs it as is.

Sampling. Greedy rows (temperature <= 0) take the argmax, as the eager drafter does. A sampled row
draws token k from q_k by the eager drafter's exponential race, `argmax(q_k / E)`, with E = -log U and
U the counter-based hash of `cedserve.model.device_sampling` over (the request's seed xor
`DRAFT_SEED_SALT`, the drafted token's position, the token id): the same distribution q_k from
another stream than the request's torch generator (lossless acceptance needs only that each draft
was drawn from the q_k it comes with).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cedserve.model.device_moe import DeviceMoE, MoeMode, resolve_moe_mode
from cedserve.model.device_sampling import uniform_noise
from cedserve.model.dspark import Drafter, DraftLayer, DraftState
from cedserve.model.fused import FusedOps
from cedserve.model.network import CEDModel
from cedserve.model.rope import device_rope

HOISTED_NOISE_ELEMENTS = 1 << 22
"""Up to this many `[B, k, vocab]` elements the pass hashes every drafted position's noise at once
(~20 kernels) instead of once per position (~20 each; uncompiled, ~100 of the pass's ~620 ops at
k = 6). The same values; larger products (a released vocabulary at larger buckets) keep the
per-position `[B, vocab]` temporaries, the hash's int64 intermediates being 8 bytes an element."""

DRAFT_SEED_SALT = 0x5D_EECE_66D
"""Mixed into a request's seed for its drafts, so they never reuse the target sampler's noise."""


class DraftPools:
    """Every slot's drafter memory at fixed device addresses (module docstring)."""

    def __init__(self, drafter: Drafter, max_slots: int, device: torch.device) -> None:
        if max_slots < 1:
            raise ValueError(f"draft runner field `max_slots`: must be >= 1, got {max_slots}")
        config = drafter.config
        shape = DraftState.new(config)  # the eager memory's window and rollback
        self.window, self.rollback = shape.window, shape.rollback
        self.ring = self.window + self.rollback
        self.max_slots = max_slots
        self.scratch_slot = max_slots
        self.device = torch.device(device)
        # [slots + 1, ring, hidden], float32 as a `DraftState`'s vectors (whatever the drafter's dtype)
        self.vectors = torch.zeros(max_slots + 1, self.ring, config.hidden_size, device=self.device)

    @property
    def nbytes(self) -> int:
        return self.vectors.numel() * self.vectors.element_size()

    def write(self, slots: Tensor, positions: Tensor, vectors: Tensor) -> None:
        """Vectors `[N, hidden]` of positions `[N]` into slots `[N]` (each (slot, position) once)."""
        self.vectors[slots, positions.remainder(self.ring)] = vectors.to(self.vectors.dtype)

    def read(self, slot: int, first: int, end: int) -> Tensor:
        """A copy of slot `slot`'s vectors of positions `first .. end - 1`: `[end - first, hidden]`."""
        rows = torch.arange(first, end, device=self.device).remainder(self.ring)
        return self.vectors[slot, rows].clone()


@dataclass
class DraftOutputs:
    """What one draft step leaves on the device (a graph's static outputs)."""

    tokens: Tensor  # long [B, k]: x_1 .. x_k
    confidences: Tensor  # float32 [B, k]: c_1 .. c_k
    packed: Tensor  # float64 [B, 2k]: tokens, then confidences: the host's one copy


class DraftStep:
    """The drafter's pass over slots (module docstring)."""

    def __init__(self, drafter: Drafter, model: CEDModel, pools: DraftPools, moe: MoeMode = "auto",
                 compiled: bool = False) -> None:
        self.drafter, self.model, self.pools = drafter, model, pools
        self.config = drafter.config
        self.device = pools.device
        self.rope = device_rope(drafter.rope, self.device)
        self.layers = [layer for layer in drafter.layers if isinstance(layer, DraftLayer)]
        kernels = self.device.type == "cuda"
        mode = resolve_moe_mode(moe, self.config.dspark_n_routed_experts, kernels)
        self.moes = [DeviceMoE(layer.ffn, mode) for layer in self.layers]
        self.ops = FusedOps(compiled=compiled)
        self.sample = torch.compile(self._sample, fullgraph=True) if compiled else self._sample
        """`_sample`, or with `compiled` (Inductor) its left-to-right loop as a few fused kernels: as
        written it is ~75 % of the pass's ~620 ops (each position's heads, softmax, one-hot and the
        counter hash over the vocabulary), each op a kernel on a GPU (what that costs there is
        `benchmarks/dspark_cycle.py`'s to measure: not yet run)."""

    @torch.no_grad()
    def forward(self, slots: Tensor, anchors: Tensor, ends: Tensor, counts: Tensor, temperature: Tensor,
                seeds: Tensor, probs: Tensor) -> DraftOutputs:
        """Drafts after each row's anchor. `slots`, `anchors` (the token at `ends`), `ends` (the
        anchor's position), `counts` (vectors before it to attend, <= window; 0 on padding rows),
        `seeds`: long `[B]`; `temperature`: float32 `[B]` (<= 0: greedy). Writes q_k into `probs`
        (float32 `[B, k, vocab]`, the caller's static buffer)."""
        c, pools = self.config, self.pools
        k, batch = c.dspark_block_size, slots.shape[0]
        offsets = torch.arange(pools.window, device=self.device)
        valid = offsets < counts.unsqueeze(-1)  # [B, W]: the window first, padding after (as pad_sequence)
        ctx_positions = torch.where(valid, ends.unsqueeze(-1) - counts.unsqueeze(-1) + offsets, -1)  # [B, W]
        context = pools.vectors[slots.unsqueeze(-1), ctx_positions.remainder(pools.ring)]  # [B, W, hidden]
        context = torch.where(valid.unsqueeze(-1), context, torch.zeros((), dtype=context.dtype, device=self.device))
        noise = torch.full((batch, k - 1), c.dspark_noise_token_id, dtype=torch.long, device=self.device)
        block = torch.cat([anchors.unsqueeze(-1), noise], dim=1)  # [B, k]
        positions = ends.unsqueeze(-1) + torch.arange(k, device=self.device)  # [B, k]
        h = self._block_states(block, context, positions, ctx_positions)  # [B, k, hidden]
        base = self.model.lm_head(h).float()  # [B, k, V]: U_k
        return self.sample(h, base, anchors, ends, temperature, seeds, probs)

    def _block_states(self, block: Tensor, context: Tensor, positions: Tensor, ctx_positions: Tensor) -> Tensor:
        """`Drafter.block_states` with the device MoE."""
        x = self.model.embed(block)
        context = context.to(x.dtype)
        for layer, moe in zip(self.layers, self.moes):
            x = x + layer.attn(layer.attn_norm(x), context, self.rope, positions, ctx_positions)
            x = x + moe(layer.ffn_norm(x).flatten(0, 1), self.ops).view_as(x)
        h: Tensor = self.drafter.final_norm(x)
        return h

    def _sample(self, h: Tensor, base: Tensor, anchors: Tensor, ends: Tensor, temperature: Tensor, seeds: Tensor,
                probs: Tensor) -> DraftOutputs:
        """`Drafter._sample_batch` on the device: left to right, each token from the Markov-adjusted
        q_k given the one before (module docstring for the sampled rows' noise)."""
        batch, k, vocab = base.shape
        sampled = temperature > 0  # [B]
        scale = torch.where(sampled, temperature, torch.ones_like(temperature)).unsqueeze(-1)  # [B, 1]
        salted = seeds ^ DRAFT_SEED_SALT
        races = None
        if batch * k * vocab <= HOISTED_NOISE_ELEMENTS:  # every position's noise in one pass of the hash
            counters = ends.unsqueeze(-1) + 1 + torch.arange(k, device=ends.device)  # [B, k]
            races = -torch.log(uniform_noise(salted.unsqueeze(-1), counters, vocab))  # [B, k, V]: Exp(1)
        previous = anchors
        tokens, confidences = [], []
        for pos in range(k):
            logits, confidence = self.drafter.heads(h[:, pos], base[:, pos], previous)  # [B, V], [B, 1]
            greedy = logits.argmax(-1)
            one_hot = torch.zeros_like(logits).scatter_(1, greedy.unsqueeze(-1), 1.0)
            dist = torch.where(sampled.unsqueeze(-1), torch.softmax(logits / scale, dim=-1), one_hot)
            race = races[:, pos] if races is not None else -torch.log(uniform_noise(salted, ends + 1 + pos, vocab))
            previous = torch.where(sampled, (dist / race).argmax(-1), greedy)
            probs[:, pos].copy_(dist)
            tokens.append(previous)
            confidences.append(confidence[:, 0])
        token_rows, confidence_rows = torch.stack(tokens, 1), torch.stack(confidences, 1)  # [B, k]
        packed = torch.cat([token_rows.double(), confidence_rows.double()], dim=1)
        return DraftOutputs(token_rows, confidence_rows, packed)
