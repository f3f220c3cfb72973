"""One backbone layer: Engram (where present), then attention and MoE, each wrapped in mHC."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from cedserve.model.attention import Attention
from cedserve.model.batch import BatchPass
from cedserve.model.config import LayerSpec, ModelConfig
from cedserve.model.context import ForwardContext, TrainContext
from cedserve.model.engram import Engram
from cedserve.model.mhc import HcMix, hc_collapse, hc_expand, hc_mixes
from cedserve.model.moe import MoE
from cedserve.model.norm import RMSNorm
from cedserve.model.rope import RopeTable

MoEFn = Callable[[MoE, Tensor], Tensor]
"""Runs one layer's MoE (routed + shared experts) over `x [N, hidden]` -> `[N, hidden]`. The default
is `local_moe`; an expert-parallel engine passes its dispatch/compute/combine instead."""


class Block(nn.Module):
    """Checkpoint names under `layers.N.`: `attn.*`, `ffn.*`, `attn_norm`, `ffn_norm`,
    `engram.*`, and the raw mHC tensors `hc_{attn,ffn}_{fn,base,scale}` (float32)."""

    def __init__(self, config: ModelConfig, spec: LayerSpec, compress_rope: RopeTable, engram_table: bool = True) -> None:
        super().__init__()
        self.config, self.spec = config, spec
        hc, hidden = config.hc_mult, config.hidden_size
        self.attn = Attention(config, spec, compress_rope)
        self.ffn = MoE(config)
        self.attn_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.tapped = spec.layer_id in config.dspark_target_layer_ids
        engram_ids = list(config.engram_layer_ids)
        self.engram_index = engram_ids.index(spec.layer_id) if spec.layer_id in engram_ids else None
        self.engram = (
            Engram(config, config.engram_num_embeddings[self.engram_index], with_table=engram_table)
            if self.engram_index is not None
            else None
        )
        mix_width = (2 + hc) * hc
        self.hc_attn_fn = nn.Parameter(torch.zeros(mix_width, hc * hidden))
        self.hc_attn_base = nn.Parameter(torch.zeros(mix_width))
        self.hc_attn_scale = nn.Parameter(torch.ones(3))
        self.hc_ffn_fn = nn.Parameter(torch.zeros(mix_width, hc * hidden))
        self.hc_ffn_base = nn.Parameter(torch.zeros(mix_width))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3))

    def _mix(self, streams: Tensor, fn: Tensor, scale: Tensor, base: Tensor) -> HcMix:
        c = self.config
        return hc_mixes(streams, fn, scale, base, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)

    def apply_engram(self, streams: Tensor, ctx: ForwardContext) -> Tensor:
        """`streams [S, hc, D]` plus this layer's Engram value; waits for the chunk's rows
        (`ctx.engram_rows`, `[S, engram layers, columns, head_dim]`) only here."""
        if self.engram is None or self.engram_index is None:
            return streams
        if ctx.engram_rows is None:
            raise ValueError(f"layer {self.spec.layer_id} has an Engram table but no rows were looked up")
        rows = ctx.engram_rows.result()[:, self.engram_index]  # [S, columns, head_dim]
        mixed: Tensor = self.engram(streams, rows.to(streams.device))
        return mixed

    def attention_input(self, streams: Tensor, pre_mix: Tensor) -> Tensor:
        """The normed sublayer input the attention (and a KV source's compressor) sees: `[S, D]`."""
        normed: Tensor = self.attn_norm(hc_collapse(streams, pre_mix))
        return normed

    def forward(self, streams: Tensor, pre_mix: Tensor, ctx: ForwardContext) -> tuple[Tensor, Tensor]:
        """`streams [S, hc, D]`, `pre_mix [S, hc]` (the previous site's pre) -> new streams and
        this layer's FFN-site `pre`, which the next layer's attention collapses with. At a DSpark
        target layer, `ctx.taps` (when set) receives the streams entering the attention."""
        streams = self.apply_engram(streams, ctx)
        if self.tapped and ctx.taps is not None:
            ctx.taps[self.spec.layer_id] = streams
        attn_mix = self._mix(streams, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        attn_out = self.attn(self.attention_input(streams, pre_mix), ctx)
        streams = hc_expand(attn_out, streams, attn_mix.post, attn_mix.comb)
        ffn_mix = self._mix(streams, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base)
        ffn_out = self.ffn(self.ffn_norm(hc_collapse(streams, attn_mix.pre)))
        streams = hc_expand(ffn_out, streams, ffn_mix.post, ffn_mix.comb)
        return streams, ffn_mix.pre

    def forward_train(self, streams: Tensor, pre_mix: Tensor, ctx: TrainContext) -> tuple[Tensor, Tensor]:
        """`forward` over a batch of whole sequences (`CEDModel.forward_train`), differentiable:
        `streams [B, S, hc, D]`, `pre_mix [B, S, hc]`. Every step but attention runs on the
        flattened rows, exactly as `forward` runs on one sequence's."""
        batch, seq = streams.shape[:2]
        flat, pre = streams.flatten(0, 1), pre_mix.flatten(0, 1)
        if self.engram is not None and self.engram_index is not None:
            if ctx.engram_rows is None:
                raise ValueError(f"layer {self.spec.layer_id} has an Engram table but no rows were looked up")
            rows = ctx.engram_rows[:, :, self.engram_index].flatten(0, 1)  # [B * S, columns, head_dim]
            flat = self.engram(flat, rows)
        if self.tapped and ctx.taps is not None:
            ctx.taps[self.spec.layer_id] = flat.view(batch, seq, *flat.shape[1:])
        attn_mix = self._mix(flat, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        x = self.attention_input(flat, pre).view(batch, seq, -1)
        attn_out = self.attn.forward_train(x, ctx).flatten(0, 1)
        flat = hc_expand(attn_out, flat, attn_mix.post, attn_mix.comb)
        ffn_mix = self._mix(flat, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base)
        ffn_out = self.ffn(self.ffn_norm(hc_collapse(flat, attn_mix.pre)))
        flat = hc_expand(ffn_out, flat, ffn_mix.post, ffn_mix.comb)
        return flat.view(streams.shape), ffn_mix.pre.view(pre_mix.shape)

    def forward_batch(self, streams: Tensor, pre_mix: Tensor, batch: BatchPass, moe: MoEFn) -> tuple[Tensor, Tensor]:
        """`forward` over several sequences' chunks at once, concatenated in item order
        (`batch.sizes` rows each): everything runs over all rows together (Engram gating, mHC
        mixes, norms, projections, the MoE through `moe`) except attention's per-sequence part,
        which `Attention.forward_batch` batches across sequences. `moe` is called exactly once,
        even with no rows, so expert-parallel ranks stay in step."""
        if not batch.ctxs:
            moe(self.ffn, self.ffn_norm(streams[:, 0]))
            return streams, pre_mix
        if self.engram is not None and self.engram_index is not None:
            if batch.engram_rows is None:
                raise ValueError(f"layer {self.spec.layer_id} has an Engram table but no rows were looked up")
            rows = batch.engram_rows.result()[:, self.engram_index]  # [N, columns, head_dim]
            streams = self.engram(streams, rows.to(streams.device))
        if self.tapped:
            for part, ctx in zip(streams.split_with_sizes(batch.sizes), batch.ctxs):
                if ctx.taps is not None:
                    ctx.taps[self.spec.layer_id] = part
        attn_mix = self._mix(streams, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base)
        attn_out = self.attn.forward_batch(self.attention_input(streams, pre_mix), batch)
        streams = hc_expand(attn_out, streams, attn_mix.post, attn_mix.comb)
        ffn_mix = self._mix(streams, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base)
        ffn_out = moe(self.ffn, self.ffn_norm(hc_collapse(streams, attn_mix.pre)))
        streams = hc_expand(ffn_out, streams, ffn_mix.post, ffn_mix.comb)
        return streams, ffn_mix.pre


def local_moe(ffn: MoE, x: Tensor) -> Tensor:
    """The default `MoEFn`: every expert on this process."""
    out: Tensor = ffn(x)
    return out
