"""Shared-KV latent attention with a sliding window and the CSA2 compressed branch.

Per layer: low-rank queries (`wq_a` -> `q_norm` -> `wq_b`, H heads of D), one K=V latent per
token (`wkv` -> `kv_norm`), interleaved RoPE on the last `qk_rope_head_dim` channels of both,
window KV stored as FP8 records. A query attends to (a) the last `sliding_window` tokens,
itself included, and (b) at compressed layers, the top-k entries of its KV source's compressed
KV that its index source picked. A learned per-head sink logit joins the softmax denominator.
The output's RoPE slice is rotated back, then the grouped low-rank projection (`wo_a` per group
of heads, `wo_b` across groups) maps it to the hidden size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from cedserve.kernels.grouped_linear import grouped_linear
from cedserve.model.batch import BatchPass, PaddedKV, device_ints, snapshot_layer
from cedserve.model.compressor import Compressor, PendingGroup
from cedserve.model.config import AttentionMode, LayerSpec, ModelConfig
from cedserve.model.context import ForwardContext, TrainContext
from cedserve.model.indexer import (
    Indexer,
    mask_invisible,
    select_candidate_blocks,
    select_topk,
    visible_entries,
)
from cedserve.model.kv_format import (
    encode_index_key,
    encode_main,
    encode_window,
    index_key_values,
    main_values,
    window_values,
)
from cedserve.model.norm import RMSNorm
from cedserve.model.rope import RopeTable, apply_rope

if TYPE_CHECKING:
    from cedserve.model.paged_attention import PagedPass


def sink_attention(q: Tensor, keys: Tensor, bias: Tensor, sink: Tensor, scale: float) -> Tensor:
    """Attention of `q [S, H, D]` over shared K=V `keys [K, D]` with additive `bias [S, K]`
    (0 or -inf) and per-head `sink [H]` logits that only enlarge the denominator -> `[S, H, D]`.
    Batched: `q [B, S, H, D]`, `keys [B, K, D]`, `bias [B, S, K]` (or `[S, K]`) -> `[B, S, H, D]`.
    The heads share the keys, so each batch element is two plain matmuls over its `S * H` query
    rows (no per-head copy of the keys)."""
    seq, heads = q.shape[-3], q.shape[-2]
    rows = q.flatten(-3, -2)  # [(B,) S * H, D]
    logits = torch.matmul(rows, keys.transpose(-1, -2))
    logits = logits.view(*logits.shape[:-2], seq, heads, logits.shape[-1])  # [(B,) S, H, K]
    logits = logits * scale + bias.unsqueeze(-2)
    sinks = sink.float().view(heads, 1).expand(*logits.shape[:-1], 1)
    combined = torch.cat([logits.float(), sinks], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(keys.dtype)
    out = torch.matmul(probs.flatten(-3, -2), keys)  # [(B,) S * H, D]
    return out.view(*out.shape[:-2], seq, heads, out.shape[-1])


def window_bias(query_positions: Tensor, key_start: int, num_keys: int, window: int) -> Tensor:
    """0 where key position k satisfies q - window < k <= q, else -inf: `[S, K]`."""
    keys = torch.arange(key_start, key_start + num_keys, device=query_positions.device).unsqueeze(0)
    queries = query_positions.unsqueeze(-1)
    visible = (keys <= queries) & (keys > queries - window)
    zero = torch.zeros((), device=query_positions.device)
    return torch.where(visible, zero, torch.full_like(zero, float("-inf")))


class GroupedOutput(nn.Module):
    """Block-diagonal `wo_a` (`[groups * rank, heads * D / groups]`): each group of heads is
    projected to `o_lora_rank` on its own."""

    def __init__(self, in_per_group: int, groups: int, rank: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * rank, in_per_group))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)  # nn.Linear's default: defined before a checkpoint lands

    def forward(self, x: Tensor) -> Tensor:
        """`[..., S, groups, in_per_group]` -> `[..., S, groups * rank]`."""
        lead = x.shape[:-2]
        # the Triton kernel on CUDA only: CPU tensors keep the `bmm` even under TRITON_INTERPRET=1
        return grouped_linear(x.reshape(-1, *x.shape[-2:]), self.weight, "auto" if x.is_cuda else "torch").view(*lead, -1)


class Attention(nn.Module):
    """One layer's attention; checkpoint names under `layers.N.attn.`."""

    def __init__(self, config: ModelConfig, spec: LayerSpec, compress_rope: RopeTable) -> None:
        super().__init__()
        self.config, self.spec = config, spec
        heads, dim = config.num_attention_heads, config.head_dim
        self.rope_kind = "compress" if spec.compress_ratio else "main"
        self.compress_rope = compress_rope
        self.wq_a = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, heads * dim, bias=False)
        self.wkv = nn.Linear(config.hidden_size, dim, bias=False)
        self.kv_norm = RMSNorm(dim, config.rms_norm_eps)
        self.wo_a = GroupedOutput(heads * dim // config.o_groups, config.o_groups, config.o_lora_rank)
        self.wo_b = nn.Linear(config.o_groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(heads))
        owns_kv = spec.mode is AttentionMode.FULL
        scores = spec.mode in (AttentionMode.FULL, AttentionMode.REINDEX)
        self.compressor = Compressor(config, spec.compress_ratio) if owns_kv else None
        self.indexer = Indexer(config, owns_keys=owns_kv) if scores else None

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        """`x [S, hidden]` (the normed attention input) -> `[S, hidden]`; updates the window and,
        at a KV source, the global KV of `ctx.state`."""
        cos, sin = ctx.rope[self.rope_kind]
        q_residual, q, kv = self._project(x, cos, sin)
        return self._output(self.attend_one(x, q_residual, q, kv, ctx), cos, sin)

    def forward_batch(self, x: Tensor, batch: BatchPass) -> Tensor:
        """`forward` over the rows of every item of a pass, `x [N, hidden]` -> `[N, hidden]`:
        projections over all rows, attention for the padded group at once and for alone items one
        at a time (see `cedserve.model.batch`). Every state is updated as `forward` of its chunks in
        item order would."""
        cos, sin = batch.rope[self.rope_kind]
        q_residual, q, kv = self._project(x, cos, sin)
        grouped = self._attend_padded(x, q_residual, q, kv, batch) if batch.padded else None
        if not batch.alone:
            assert grouped is not None
            return self._output(grouped, cos, sin)
        parts = []
        for i in range(len(batch.ctxs)):
            rows = batch.rows(i)
            if i in batch.group_offsets:
                assert grouped is not None
                first = batch.group_offsets[i]
                parts.append(grouped[first : first + batch.sizes[i]])
            else:
                parts.append(self.attend_one(x[rows], q_residual[rows], q[rows], kv[rows], batch.ctxs[i]))
        return self._output(torch.cat(parts), cos, sin)

    def _project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Row-wise: the query residual `[S, q_lora_rank]`, RoPE'd queries `[S, H, D]` and window KV `[S, D]`."""
        q_residual = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_residual).view(x.shape[0], self.config.num_attention_heads, self.config.head_dim)
        q = apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        return q_residual, q, kv

    def _output(self, out: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Row-wise: attention output `[S, H, D]` -> `[S, hidden]` (inverse RoPE, grouped projection)."""
        out = apply_rope(out, cos.unsqueeze(-2), sin.unsqueeze(-2), inverse=True)
        projected: Tensor = self.wo_b(self.wo_a(out.reshape(out.shape[0], self.config.o_groups, -1)))
        return projected

    def attend_one(self, x: Tensor, q_residual: Tensor, q: Tensor, kv: Tensor, ctx: ForwardContext) -> Tensor:
        """One chunk's attention `[S, H, D]` from its projections; updates its state first (and
        records the layer in the chunk's boundary snapshot when it asks for one)."""
        snapshot_layer(ctx, self.spec.layer_id, ctx.state)
        if ctx.paged is not None:
            return self._attend_one_paged(x, q_residual, q, kv, ctx)
        keys, bias = self._window_keys(kv, ctx)
        if self.spec.compress_ratio:
            if self.compressor is not None and ctx.write_global_kv:
                self.write_global_kv(x, ctx)
            elif self.compressor is not None:
                self._restore_pending(x, ctx)
            if self.indexer is not None:
                self._select(x, q_residual, ctx)
            keys, bias = self._add_compressed(keys, bias, ctx)
        return sink_attention(q, keys.to(q.dtype), bias, self.attn_sink, self.config.head_dim**-0.5)

    def _attend_one_paged(self, x: Tensor, q_residual: Tensor, q: Tensor, kv: Tensor, ctx: ForwardContext) -> Tensor:
        """`attend_one` through the kernels (`ctx.paged`, one item): the same state updates, then
        the chunk's picks and attention over slots instead of dense masks."""
        assert ctx.paged is not None
        layer = self.spec.layer_id
        records = torch.cat([ctx.state.swa[layer], ctx.state.encode_window(kv, ctx.finite)])
        ctx.state.keep_window(layer, records)
        if self.spec.compress_ratio and self.compressor is not None:
            if ctx.write_global_kv:
                self.write_global_kv(x, ctx)
            else:
                self._restore_pending(x, ctx)
        return self._attend_paged(ctx.paged, x, q_residual, q, [records], ctx.rope["compress"])

    def _attend_padded(self, x: Tensor, q_residual: Tensor, q: Tensor, kv: Tensor, batch: BatchPass) -> Tensor:
        """The padded group's attention, its rows `[rows, H, D]` in item order: state updates item
        by item (windows, partial groups; completed groups encoded together), then one attention."""
        records = self._update_padded(x, kv, batch)
        if batch.paged is not None:
            return self._attend_paged(batch.paged, x, q_residual, q, records, batch.rope["compress"])
        keys, bias = batch.window(records, self.config.sliding_window)  # [B, K, D], [B, S_max, K]
        if self.spec.compress_ratio:
            assert self.spec.kv_layer is not None and self.spec.index_layer is not None
            compressed = batch.compressed(self.spec.kv_layer)
            if self.indexer is not None:
                self._select_padded(x, q_residual, compressed, batch)
            picked = batch.selections.get(self.spec.index_layer)
            if compressed.width and picked is not None:  # nothing picked adds only exp(-inf) = 0 terms
                keys = torch.cat([keys, compressed.main.to(keys.dtype)], dim=1)
                compressed_bias = torch.zeros(picked.shape, device=bias.device).masked_fill_(~picked, float("-inf"))
                bias = torch.cat([bias, compressed_bias], dim=-1)
        out = sink_attention(batch.pad(q), keys.to(q.dtype), bias, self.attn_sink, self.config.head_dim**-0.5)
        return batch.unpad(out)

    def _attend_paged(self, paged: PagedPass, x: Tensor, q_residual: Tensor, q: Tensor, records: list[Tensor],
                      compress_rope: tuple[Tensor, Tensor]) -> Tensor:
        """Attention of `paged`'s rows on the paged path (`cedserve.model.paged_attention`), after
        the state updates (`records[b]`: item b's window records as its attention sees them): the
        records of this pass's appends are copied to the arena, index sources pick with the
        two-level top-k kernel, and one sparse-attention call covers the rows."""
        spec = self.spec
        kv_layer = index_layer = None
        if spec.compress_ratio:
            kv_layer, index_layer = spec.kv_layer, spec.index_layer
            assert kv_layer is not None and index_layer is not None
            if self.compressor is not None:
                paged.sync(spec.layer_id)  # the entries this pass appended
            if self.indexer is not None:
                cos, sin = compress_rope
                index_q = self.indexer.query(paged.take(q_residual), paged.take(cos), paged.take(sin))
                paged.select(spec.layer_id, kv_layer, spec.compress_ratio, index_q,
                             self.indexer.head_weights(paged.take(x)))
        return paged.attend(paged.take(q), self.attn_sink, records, self.config.sliding_window, kv_layer,
                            index_layer, self.config.head_dim**-0.5)

    def _update_padded(self, x: Tensor, kv: Tensor, batch: BatchPass) -> list[Tensor]:
        """Windows and (at a KV source) partial groups of the padded group's items, in item order;
        then every completed group of the pass encoded at once and appended. Returns each item's
        window records (stored, then the chunk's) as its attention sees them."""
        layer = self.spec.layer_id
        encoded = encode_window(kv, batch.kv_format)  # row-wise: all rows at once
        groups = _PendingAppends(self, x, batch) if self.compressor is not None else None
        records = []
        for i in batch.padded:
            ctx, rows = batch.ctxs[i], batch.rows(i)
            state = ctx.state
            snapshot_layer(ctx, layer, state)
            if groups is not None:
                groups.add(i, rows)
            window = torch.cat([state.swa[layer], encoded[rows]])
            state.keep_window(layer, window)
            records.append(window)
        if groups is not None:
            groups.append()
            batch.global_kv_changed(layer)
        return records

    def _select_padded(self, x: Tensor, q_residual: Tensor, compressed: PaddedKV, batch: BatchPass) -> None:
        """`_select` for the padded group: scores `[B, S_max, T_max]`, picks into `batch.selections`."""
        assert self.indexer is not None
        layer, ratio = self.spec.layer_id, self.spec.compress_ratio
        if compressed.width == 0:
            batch.selections[layer] = None
            return
        cos, sin = batch.rope["compress"]
        q = batch.pad(self.indexer.query(q_residual, cos, sin))  # [B, S_max, H, d]
        weights = batch.pad(self.indexer.head_weights(x))  # [B, S_max, H]
        scores = mask_invisible(self.indexer.score(q, weights, compressed.index_keys), batch.positions, ratio)
        candidate_layer = self.config.candidate_source_layer_id
        if layer == candidate_layer:
            batch.candidates = select_candidate_blocks(scores, visible_entries(batch.positions, ratio),
                                                       self.config.candidate_topk_blocks,
                                                       self.config.candidate_block_size)
        elif candidate_layer is not None and 0 <= candidate_layer < layer and batch.candidates is not None:
            scores = scores.masked_fill(~batch.candidates, float("-inf"))
        batch.selections[layer] = select_topk(scores, self.config.index_topk)

    def forward_train(self, x: Tensor, ctx: TrainContext) -> Tensor:
        """`forward` over whole sequences from position 0, batched and differentiable:
        `x [B, S, hidden]` -> `[B, S, hidden]`. The window and global KV are this pass's own values
        after `ctx.kv_format`'s round trip (straight-through), so each row sees exactly what a
        `prefill` of its sequence would. Index sources also add their indexer loss to `ctx`."""
        c = self.config
        cos, sin = ctx.rope[self.rope_kind]
        q_residual = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_residual).unflatten(-1, (c.num_attention_heads, c.head_dim))  # [B, S, H, D]
        q = apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        keys = window_values(kv, ctx.kv_format).to(kv.dtype)  # [B, S, D]
        bias = window_bias(ctx.positions, 0, x.shape[1], c.sliding_window).expand(x.shape[0], -1, -1)
        if self.spec.compress_ratio:
            assert self.spec.kv_layer is not None and self.spec.index_layer is not None
            if self.compressor is not None:
                self._train_global_kv(x, ctx)
            main = ctx.global_kv[self.spec.kv_layer][0]  # [B, T, D]
            if self.indexer is not None:
                self._train_select(x, q_residual, q, main, ctx)
            picked = ctx.selections[self.spec.index_layer]
            zero = torch.zeros((), device=x.device)
            compressed_bias = torch.where(picked, zero, torch.full_like(zero, float("-inf")))
            keys = torch.cat([keys, main.to(keys.dtype)], dim=1)
            bias = torch.cat([bias, compressed_bias.expand(x.shape[0], -1, -1)], dim=-1)
        out = sink_attention(q, keys.to(q.dtype), bias, self.attn_sink, c.head_dim**-0.5)
        out = apply_rope(out, cos.unsqueeze(-2), sin.unsqueeze(-2), inverse=True)
        projected: Tensor = self.wo_b(self.wo_a(out.reshape(*out.shape[:-2], c.o_groups, -1)))
        return projected

    def _train_global_kv(self, x: Tensor, ctx: TrainContext) -> None:
        """`write_global_kv` for whole sequences: main KV and index keys of every complete group."""
        assert self.compressor is not None and self.indexer is not None
        latent = self.compressor.forward_full(x)  # [B, G, D], pre-RoPE
        positions = self.spec.compress_ratio * torch.arange(latent.shape[1], device=x.device)
        cos, sin = self.compress_rope.cos_sin(positions)
        main = main_values(apply_rope(latent, cos, sin), ctx.kv_format)
        # The indexer learns from its own loss only (as the main model's input, the latent is detached).
        keys = index_key_values(self.indexer.keys(latent.detach(), cos, sin), ctx.kv_format)
        ctx.global_kv[self.spec.layer_id] = (main, keys)

    def _train_select(self, x: Tensor, q_residual: Tensor, q: Tensor, main: Tensor, ctx: TrainContext) -> None:
        """`_select` for whole sequences (or every visible entry while `ctx.dense_selection`)."""
        assert self.indexer is not None and self.spec.kv_layer is not None
        layer, ratio = self.spec.layer_id, self.spec.compress_ratio
        cos, sin = ctx.rope["compress"]
        keys = ctx.global_kv[self.spec.kv_layer][1]
        scores = mask_invisible(self.indexer.scores(x.detach(), q_residual.detach(), cos, sin, keys),
                                ctx.positions, ratio)  # [B, S, T]
        if ctx.indexer_loss:
            ctx.indexer_losses.append(self._indexer_kl(scores, q, main, ratio))
        visible = torch.isfinite(scores)
        if ctx.dense_selection:
            ctx.selections[layer] = visible
            return
        candidate_layer = self.config.candidate_source_layer_id
        if layer == candidate_layer:
            ctx.candidates = select_candidate_blocks(scores, visible_entries(ctx.positions, ratio),
                                                     self.config.candidate_topk_blocks, self.config.candidate_block_size)
        elif candidate_layer is not None and 0 <= candidate_layer < layer and ctx.candidates is not None:
            scores = scores.masked_fill(~ctx.candidates, float("-inf"))
        ctx.selections[layer] = select_topk(scores, self.config.index_topk)

    def _indexer_kl(self, scores: Tensor, q: Tensor, main: Tensor, ratio: int) -> Tensor:
        """KL(attention || indexer) over the visible compressed entries, mean over the queries that
        see any: the target is this layer's attention distribution over all of them (head mean,
        no gradient), as DeepSeek's sparse attention trains its indexer."""
        scores, q = scores[:, ratio - 1 :], q[:, ratio - 1 :]  # earlier queries see no entry
        visible = torch.isfinite(scores)
        with torch.no_grad():
            logits = torch.einsum("bshd,btd->bhst", q.float(), main.float()) * self.config.head_dim**-0.5
            target = torch.softmax(logits.masked_fill(~visible.unsqueeze(1), float("-inf")), dim=-1).mean(dim=1)
            entropy = torch.special.xlogy(target, target).sum(dim=-1)
        log_probs = torch.log_softmax(scores, dim=-1).masked_fill(~visible, 0.0)
        kl: Tensor = (entropy - (target * log_probs).sum(dim=-1)).mean()
        return kl

    def _window_keys(self, kv: Tensor, ctx: ForwardContext) -> tuple[Tensor, Tensor]:
        """Window keys `[P + S, D]` (stored records + this chunk, FP8) and their bias `[S, P + S]`."""
        layer = self.spec.layer_id
        records = torch.cat([ctx.state.swa[layer], ctx.state.encode_window(kv, ctx.finite)])
        ctx.state.keep_window(layer, records)
        key_start = ctx.start - (records.shape[0] - kv.shape[0])
        bias = window_bias(ctx.positions, key_start, records.shape[0], self.config.sliding_window)
        return ctx.state.decode_window(records).to(kv.dtype), bias

    def write_global_kv(self, x: Tensor, ctx: ForwardContext) -> int:
        """Run the compressor on this chunk and append completed groups (main KV and index keys)
        to the layer's global KV. Returns the number of entries appended."""
        assert self.compressor is not None and self.indexer is not None
        source = ctx.state.global_kv[self.spec.layer_id]
        latent, source.pending = self.compressor(x, source.pending)
        if latent.shape[0] == 0:
            return 0
        ratio = self.spec.compress_ratio
        group_positions = source.next_group_position + ratio * torch.arange(latent.shape[0], device=x.device)
        cos, sin = self.compress_rope.cos_sin(group_positions)
        source.append(apply_rope(latent, cos, sin), self.indexer.keys(latent, cos, sin), ctx.finite)
        ctx.global_kv_changed(self.spec.layer_id)
        return int(latent.shape[0])

    def _restore_pending(self, x: Tensor, ctx: ForwardContext) -> None:
        """Replay: the global KV already holds this span's complete groups; rebuild the partial
        group from the span's tokens at or after the next group's first position."""
        assert self.compressor is not None
        source = ctx.state.global_kv[self.spec.layer_id]
        if self.spec.compress_ratio == 1:
            return
        offset = source.next_group_position - ctx.start
        if offset < 0:
            raise ValueError(
                f"replay starts at position {ctx.start}, after the first pending token "
                f"{source.next_group_position} of layer {self.spec.layer_id}'s compressor: replay more tokens"
            )
        projected = self.compressor.project(x)  # whole span: same matmul shape as the prefill's
        source.pending = PendingGroup(projected.kv[offset:], projected.gate[offset:])

    def _select(self, x: Tensor, q_residual: Tensor, ctx: ForwardContext) -> None:
        """Score this chunk's queries against the KV source's index keys and publish the picks."""
        assert self.indexer is not None and self.spec.kv_layer is not None
        keys = ctx.index_keys(self.spec.kv_layer)
        layer, ratio = self.spec.layer_id, self.spec.compress_ratio
        if keys.shape[0] == 0:
            ctx.selections[layer] = None
            return
        cos, sin = ctx.rope["compress"]
        scores = mask_invisible(self.indexer.scores(x, q_residual, cos, sin, keys), ctx.positions, ratio)
        candidate_layer = self.config.candidate_source_layer_id
        if layer == candidate_layer:
            ctx.candidates = select_candidate_blocks(
                scores,
                visible_entries(ctx.positions, ratio),
                self.config.candidate_topk_blocks,
                self.config.candidate_block_size,
            )
        elif candidate_layer is not None and 0 <= candidate_layer < layer and ctx.candidates is not None:
            scores = scores.masked_fill(~ctx.candidates, float("-inf"))
        ctx.selections[layer] = select_topk(scores, self.config.index_topk)

    def _add_compressed(self, keys: Tensor, bias: Tensor, ctx: ForwardContext) -> tuple[Tensor, Tensor]:
        """Append the KV source's compressed entries; only the index source's picks are unmasked."""
        assert self.spec.kv_layer is not None and self.spec.index_layer is not None
        compressed = ctx.main_kv(self.spec.kv_layer)
        if compressed.shape[0] == 0:
            return keys, bias
        picked = ctx.selections.get(self.spec.index_layer)
        if picked is None:
            picked = torch.zeros(bias.shape[0], compressed.shape[0], dtype=torch.bool, device=bias.device)
        zero = torch.zeros((), device=bias.device)
        compressed_bias = torch.where(picked, zero, torch.full_like(zero, float("-inf")))
        return torch.cat([keys, compressed.to(keys.dtype)]), torch.cat([bias, compressed_bias], dim=-1)


class _PendingAppends:
    """A KV source's compressor over the padded group's items: partial groups advance item by item
    (as `Compressor.forward` would), completed groups are pooled, RoPE'd, keyed and encoded once for
    the whole pass, then appended to each item's global KV in item order. Boundary snapshots taken
    between items of one sequence get the entries of its earlier items."""

    def __init__(self, attn: Attention, x: Tensor, batch: BatchPass) -> None:
        assert attn.compressor is not None
        self.attn, self.batch, self.x = attn, batch, x
        self.ratio = attn.spec.compress_ratio
        compressor = attn.compressor
        # ratio 1: every token is a group; else per-token float32 projections, pooled by whole groups
        self.projected = compressor.project(x) if self.ratio > 1 else None
        self.kv_parts: list[Tensor] = []
        self.gate_parts: list[Tensor] = []
        self.rows: list[slice] = []
        self.positions: list[int] = []
        self.counts: list[tuple[int, int]] = []  # (item, groups completed)
        self.entries: dict[int, int] = {}  # id(state) -> entries including those not appended yet
        self.boundaries: list[tuple[int, int]] = []  # (item, entries before it) for snapshots to fix

    def add(self, item: int, rows: slice) -> None:
        layer = self.attn.spec.layer_id
        ctx = self.batch.ctxs[item]
        source = ctx.state.global_kv[layer]
        entries = self.entries.get(id(ctx.state), source.num_entries)
        if ctx.boundary is not None and entries != source.num_entries:
            self.boundaries.append((item, entries))
        if self.projected is None:
            count = rows.stop - rows.start
            self.rows.append(rows)
        else:
            kv = torch.cat([source.pending.kv, self.projected.kv[rows]])
            gate = torch.cat([source.pending.gate, self.projected.gate[rows]])
            usable = (kv.shape[0] // self.ratio) * self.ratio
            source.pending = PendingGroup(kv[usable:], gate[usable:])
            count = usable // self.ratio
            if count:
                self.kv_parts.append(kv[:usable])
                self.gate_parts.append(gate[:usable])
        self.positions += [(entries + j) * self.ratio for j in range(count)]
        self.counts.append((item, count))
        self.entries[id(ctx.state)] = entries + count

    def append(self) -> None:
        if not self.positions:
            return
        compressor, indexer = self.attn.compressor, self.attn.indexer
        assert compressor is not None and indexer is not None
        if self.projected is None:
            latent: Tensor = compressor.norm(compressor.wkv(self.x))  # row-wise: every row is a group
            if self.batch.alone:
                latent = torch.cat([latent[r] for r in self.rows])
        else:
            latent = compressor.pool(torch.cat(self.kv_parts), torch.cat(self.gate_parts), self.x.dtype)
        (positions,) = device_ints([self.positions], self.x.device)
        cos, sin = self.attn.compress_rope.cos_sin(positions)
        fmt = self.batch.kv_format
        counts = [n for _, n in self.counts]
        main = encode_main(apply_rope(latent, cos, sin), fmt).split_with_sizes(counts)
        keys = encode_index_key(indexer.keys(latent, cos, sin), fmt).split_with_sizes(counts)
        layer = self.attn.spec.layer_id
        for (item, count), main_rows, key_rows in zip(self.counts, main, keys):
            if count:
                self.batch.ctxs[item].state.global_kv[layer].append_records(main_rows, key_rows)
        for item, entries in self.boundaries:
            boundary = self.batch.ctxs[item].boundary
            assert boundary is not None
            source = self.batch.ctxs[item].state.global_kv[layer]
            pending = boundary.global_kv[layer][2]
            boundary.global_kv[layer] = (source.main[:entries], source.index_keys[:entries], pending)
