"""The decode step over slots, with fixed shapes and no host synchronisation.

`SlotStep.forward(token_ids [B], slots [B], offsets [B])` runs every layer of the CED backbone for B
rows over the state in `SlotPools` (a slot may feed several consecutive rows: carried tokens, an
anchor and its drafts), updates that state in place, and returns the logits `[B, vocab]` and DSpark
taps. Nothing in it reads a device value on the host or copies host memory to the device, and every
shape depends only on B and the pools, so `cedserve.model.runner` captures it as one CUDA graph per
row bucket and replays it; on a CPU it runs as is (the runner's eager path).

What differs from `CEDModel.forward_batch` (which it equals up to float rounding, tests/unit/
test_runner.py), and why:

* windows are rings (`SlotPools.swa`, `ring` rows per slot): each row's record is written at
  `p % ring` before attention, and the row attends to ring slots of positions `p - W + 1 .. p` at or
  after the ring's first position;
* a ratio-m compressor writes each row's projection into the slot's pending ring and pools the m
  positions of the row's group; the pooled entry is written only where `p % m == m - 1` (the group
  completes), through a slot mapping of -1 elsewhere, so no step branches on the host;
* index sources pick over a fixed width (a slot's whole capacity): entries past a row's visible
  count are never scored (`IndexKeys.visible`), so the picks equal the dynamic width's;
* the MoE runs on the device without counting rows per expert on the host: "dense" runs every
  expert over every row and weights unrouted pairs by zero (exact, and cheap while experts are few
  and rows many), "grouped" sorts pairs into fixed tiles (`kernels.moe.moe_experts`, bf16);
* rows of a padded bucket carry `SlotPools.scratch_slot`: their window writes land in scratch
  memory and they write no global-KV record;
* with the Engram tables in an `EngramStore` (host memory), the rows' table rows are not looked up
  but read from a static buffer the runner fills before each step (`cedserve.model.engram_staging`).
* with expert parallelism (`exchange`) each MoE layer's pairs travel to their experts' ranks and
  back through a fixed-capacity all-to-all (`cedserve.model.expert_exchange`): every rank of the
  group runs the step with the same bucket, and a captured step holds the collectives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cedserve.kernels.indexer import IndexKeys
from cedserve.kernels.mhc import Expansion, HcSite, hc_site
from cedserve.kernels.paged import PagedRecords
from cedserve.kernels.records import write_index_key, write_main_kv, write_swa
from cedserve.kernels.sparse_attention import sparse_attention, sparse_attention_reference
from cedserve.kernels.triton_support import Impl
from cedserve.model.attention import Attention
from cedserve.model.block import Block
from cedserve.model.compressor import Compressor
from cedserve.model.device_moe import DENSE_MAX_EXPERTS, DeviceMoE, MoeMode, resolve_moe_mode
from cedserve.model.engram import Engram
from cedserve.model.engram_staging import EngramStaging
from cedserve.model.expert_exchange import FixedCapacityEP
from cedserve.model.fused import FusedOps
from cedserve.model.indexer import INDEX_QUANT_BLOCK
from cedserve.model.network import CEDModel
from cedserve.model.paged_attention import layer_topk
from cedserve.model.rope import device_rope
from cedserve.model.slots import SlotPools
from cedserve.model.weight_views import concat_rows

__all__ = ["DENSE_MAX_EXPERTS", "MoeMode", "SlotStep"]  # the mode names runner.py imports from here


@dataclass
class _Pass:
    """Values the layers of one step share."""

    slots: Tensor  # long [B]
    offsets: Tensor  # long [B]: each row's place among its slot's rows
    positions: Tensor  # long [B]
    rope: dict[str, tuple[Tensor, Tensor]]  # kind -> cos, sin [B, rope_dim / 2]
    block_table: Tensor  # int32 [B, blocks_per_slot]: each row's slot's blocks
    engram_rows: Tensor | None  # [B, engram layers, columns, head_dim]
    ring_slot: Tensor  # long [B]: each row's window record's ring slot (the same in every layer)
    windows: Tensor  # int32 [layers, B, W]: each layer's window ring slots of each row (-1: none)
    no_rope: Tensor  # [B, 0]: the attention's (absent) separate RoPE part
    selections: dict[int, Tensor] = field(default_factory=dict)  # index source -> int32 [B, topk]
    pool: Tensor | None = None  # int32 [B, C]: the candidate source's pool
    visible: dict[int, Tensor] = field(default_factory=dict)  # ratio -> long [B]: entries each row sees
    topk_slots: dict[int, Tensor] = field(default_factory=dict)  # index source -> int32 [B, topk]: main slots
    taps: dict[int, Tensor] = field(default_factory=dict)  # DSpark target layer -> streams [B, hc, D]


class SlotStep:
    """The captured decode step's computation (module docstring)."""

    def __init__(self, model: CEDModel, pools: SlotPools, moe: MoeMode = "auto", fused: bool = True,
                 engram: EngramStaging | None = None, exchange: FixedCapacityEP | None = None,
                 group_rows: int = 1) -> None:
        """`engram`: the static buffer of each step's Engram rows, row b for step row b, filled before
        each step (`cedserve.model.engram_staging`), which the step reads instead of looking rows up
        in the model's tables: required when an `EngramStore` serves them. `exchange`: expert
        parallelism's fixed-capacity all-to-all (module docstring). `group_rows` > 1: the sparse
        attention and the index scan take each slot's rows (at most that many) together
        (`RunnerConfig.grouped_attention`)."""
        config = model.config
        if model.engram_store is not None and engram is None:
            raise ValueError("the model's Engram tables are served by an EngramStore: the slot step needs the "
                             "staged rows (an EngramStaging, as the model runner keeps)")
        self.model, self.pools, self.config = model, pools, config
        self.staged_engram = engram
        self.device = pools.device
        self.kernels = self.device.type == "cuda"
        self.ropes = {kind: device_rope(table, self.device) for kind, table in model.ropes.items()}
        self.hasher = model.hasher.to(self.device) if model.hasher is not None else None
        self.moe_mode = resolve_moe_mode(moe, config.n_routed_experts, self.kernels)
        self.ops = FusedOps(compiled=self.kernels and fused, kernels=self.kernels)
        self.site_impl: Impl = "triton" if self.kernels else "torch"
        """Where the mHC sites run (`kernels.mhc.hc_site`): its two kernels on CUDA, the torch
        reference (the modules' composition) elsewhere; "triton" on CPU under `TRITON_INTERPRET=1`
        (tests/kernels/test_mhc_site.py)."""
        self.group_rows = group_rows
        self.annotate = False
        """Mark each part of a layer as a profiler range `slot:<part>` (benchmarks/step.py counts the
        kernels each part launches; off in serving: a range costs host time)."""
        layers = [self._block(layer_id) for layer_id in range(config.num_hidden_layers)]
        self.exchange = exchange
        """The group's fixed-capacity exchange (expert parallelism), or None: this rank holds every expert."""
        self._moes = [DeviceMoE(block.ffn, self.moe_mode, exchange) for block in layers]
        # Weights that read the same input, concatenated once (one GEMM each instead of two or three):
        # the attention's `wq_a`, `wkv` and an index source's `weights_proj`; a compressor's float32
        # `wkv`, `wgate` (ratio > 1; its `wkv` at ratio 1). Copies: the modules keep their own.
        self._project_w = [_concat([b.attn.wq_a.weight, b.attn.wkv.weight]
                                     + ([b.attn.indexer.weights_proj.weight] if b.attn.indexer is not None else []))
                           for b in layers]
        self._compress_w = {b.attn.spec.layer_id: _compressor_weight(b.attn.compressor)
                            for b in layers if b.attn.compressor is not None}

    def _block(self, layer_id: int) -> Block:
        block = self.model.layers[layer_id]
        assert isinstance(block, Block)
        return block

    @contextlib.contextmanager
    def _part(self, name: str) -> Iterator[None]:
        if not self.annotate:
            yield
            return
        with torch.profiler.record_function(f"slot:{name}"):
            yield

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def forward(self, token_ids: Tensor, slots: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
        """Logits float32 `[B, vocab]` of the rows (`token_ids`, `slots`, `offsets`: long `[B]`; row
        b is token `token_ids[b]` at position `position[slots[b]] + offsets[b]`: a slot's rows are
        consecutive tokens, offsets 0, 1, ...; padding rows at the scratch slot) and the rows' DSpark
        taps `[B, n_taps, hc, hidden]` (the streams entering each `dspark_target_layer_ids`
        attention, as `prefill_with_taps`; `[B, 0]` without DSpark layers). Each slot advances past
        its last row."""
        pools = self.pools
        with self._part("embed"):
            positions = pools.position[slots] + offsets
            rope = {kind: table.cos_sin(positions) for kind, table in self.ropes.items()}
            ring_slot, windows = self.ops.window_slots(positions, slots, pools.swa_first, pools.window, pools.ring)
            step = _Pass(slots, offsets, positions, rope, pools.block_table[slots],
                         self._engram_rows(token_ids, slots, positions), ring_slot, windows,
                         torch.zeros(token_ids.shape[0], 0, device=self.device))
            streams, pre = self.model._embed(token_ids)
        pending: Expansion | None = None
        for layer_id in range(self.config.num_hidden_layers):
            streams, pre, pending = self._layer(layer_id, streams, pre, pending, step)
        with self._part("mix"):
            streams = self._expand(streams, pending)
        with self._part("logits"):
            logits = self.model._logits(streams, pre)
            pools.position.scatter_reduce_(0, slots, positions + 1, "amax")
            pools.position.narrow(0, pools.scratch_slot, 1).zero_()  # a kernel: no host value in a graph
        tapped = self.config.dspark_target_layer_ids
        taps = torch.stack([step.taps[i] for i in tapped], dim=1) if tapped else logits[:, :0]
        return logits, taps

    @torch.no_grad()
    def encode(self, token_ids: Tensor, slots: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
        """`CEDModel.encode_chunk` over slots (rows as `forward`'s): the encoder layers, then the
        decoder KV source's compressor and index keys (its records written into the pools); decoder
        windows are not touched. Returns the rows' boundary state: the streams entering the first
        decoder layer `[B, hc, hidden]` and the last encoder layer's FFN-site pre `[B, hc]` float32.
        Each slot advances past its last row."""
        pools, boundary_layer = self.pools, self.model._decoder_source()
        positions = pools.position[slots] + offsets
        rope = {kind: table.cos_sin(positions) for kind, table in self.ropes.items()}
        ring_slot, windows = self.ops.window_slots(positions, slots, pools.swa_first, pools.window, pools.ring)
        step = _Pass(slots, offsets, positions, rope, pools.block_table[slots], self._engram_rows(token_ids, slots, positions),
                     ring_slot, windows, torch.zeros(token_ids.shape[0], 0, device=self.device))
        streams, pre = self.model._embed(token_ids)
        pending: Expansion | None = None
        for layer_id in range(boundary_layer):
            streams, pre, pending = self._layer(layer_id, streams, pre, pending, step)
        streams = self._expand(streams, pending)
        block = self._block(boundary_layer)
        entering = streams
        if block.engram is not None and block.engram_index is not None:
            assert step.engram_rows is not None
            entering = self._engram(block.engram, streams, step.engram_rows[:, block.engram_index])
        site = self._site(entering, pre, None, block.hc_attn_fn, block.hc_attn_scale, block.hc_attn_base,
                          block.attn_norm.weight)
        self._write_global_kv(block.attn, site.x, step)
        pools.position.scatter_reduce_(0, slots, positions + 1, "amax")
        pools.position.narrow(0, pools.scratch_slot, 1).zero_()
        return streams, pre

    def _engram(self, engram: Engram, streams: Tensor, rows: Tensor) -> Tensor:
        """`Engram.forward` through the fused ops (`engram_mix`, compiled with `compile_fused`)."""
        mixed: Tensor = self.ops.engram(streams, rows, engram.wkv.weight, engram.q_weight, engram.k_weight, engram.eps)
        return mixed

    def _engram_rows(self, token_ids: Tensor, slots: Tensor, positions: Tensor) -> Tensor | None:
        """Write the rows' compressed ids into the slots' rings, then hash each row's n-grams and
        look their rows up (or read the rows staged for this step)."""
        if self.hasher is None:
            return None
        pools = self.pools
        ring, keep = pools.engram_ring, pools.engram_keep
        compressed = self.hasher.compress(token_ids)
        pools.engram_ids[slots, positions % ring] = compressed
        if self.staged_engram is not None:
            return self.staged_engram.device_rows(token_ids.shape[0])
        hasher = self.hasher
        hash_ids = self.ops.engram_hashes(compressed, slots, positions, pools.engram_ids, pools.engram_first, keep,
                                          hasher.multipliers, hasher.primes, hasher.offsets, hasher.pad_id)
        tables = [self.model._engram(layer_id) for layer_id in self.config.engram_layer_ids]
        return torch.stack([t.lookup(hash_ids[:, i]) for i, t in enumerate(tables)], dim=1)

    def _layer(self, layer_id: int, streams: Tensor, pre: Tensor, pending: Expansion | None,
               step: _Pass) -> tuple[Tensor, Tensor, Expansion]:
        """`Block.forward` with the slot attention, the device MoE and the fused chains. `pending`:
        the previous layer's MoE output, not yet expanded into `streams`; the layer's own is
        returned pending, for the next layer's attention site (or the logits) to expand."""
        block = self._block(layer_id)
        if block.engram is not None and block.engram_index is not None:
            assert step.engram_rows is not None
            with self._part("mix"):
                streams = self._expand(streams, pending)
            pending = None
            with self._part("engram"):
                streams = self._engram(block.engram, streams, step.engram_rows[:, block.engram_index])
        with self._part("mix"):
            attn = self._site(streams, pre, pending, block.hc_attn_fn, block.hc_attn_scale, block.hc_attn_base,
                              block.attn_norm.weight)
        if block.tapped:
            step.taps[layer_id] = attn.streams
        attended = self._attention(block.attn, attn.x, step)
        with self._part("mix"):
            ffn = self._site(attn.streams, attn.pre, (attended, attn.post, attn.comb), block.hc_ffn_fn,
                             block.hc_ffn_scale, block.hc_ffn_base, block.ffn_norm.weight)
        with self._part("moe"):
            moe_out = self._moe(layer_id, ffn.x)
        return ffn.streams, ffn.pre, (moe_out, ffn.post, ffn.comb)

    def _site(self, streams: Tensor, pre: Tensor, pending: Expansion | None, fn: Tensor, scale: Tensor,
              base: Tensor, norm_weight: Tensor) -> HcSite:
        """One mHC site (`pending` expanded first): two launches on CUDA (`kernels.mhc.hc_site`)."""
        c = self.config
        return hc_site(streams, pre, fn, scale.float().contiguous(), base.float().contiguous(), norm_weight,
                       c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, expand=pending, impl=self.site_impl)

    def _expand(self, streams: Tensor, pending: Expansion | None) -> Tensor:
        """`streams` with the pending sublayer output expanded into them (`hc_expand`)."""
        if pending is None:
            return streams
        out, post, comb = pending
        expanded: Tensor = self.ops.expand(out, streams, post, comb)
        return expanded

    # ------------------------------------------------------------------ attention

    def _attention(self, attn: Attention, x: Tensor, step: _Pass) -> Tensor:
        spec = attn.spec
        cos, sin = step.rope[attn.rope_kind]
        eps = self.config.rms_norm_eps
        with self._part("project"):
            q_dtype = torch.bfloat16 if self.kernels else x.dtype  # the attention kernels' queries
            q_residual, q, kv, head_logits = self.ops.project(
                x, self._project_w[spec.layer_id], self.config.q_lora_rank, attn.q_norm.weight, attn.wq_b.weight,
                attn.kv_norm.weight, cos, sin, self.config.num_attention_heads, eps, q_dtype)
        with self._part("window"):
            self._write("swa", kv, step.ring_slot, self.pools.window_records(spec.layer_id))
        kv_layer = index_layer = None
        if spec.compress_ratio:
            kv_layer, index_layer = spec.kv_layer, spec.index_layer
            assert kv_layer is not None and index_layer is not None
            if attn.compressor is not None:
                with self._part("compressor"):
                    self._write_global_kv(attn, x, step)
            if attn.indexer is not None:
                c_cos, c_sin = step.rope["compress"]
                with self._part("select"):
                    index_q, weights = self.ops.index_query(q_residual, attn.indexer.wq_b.weight, head_logits,
                                                            c_cos, c_sin, attn.indexer.num_heads, INDEX_QUANT_BLOCK)
                    self._select(spec.layer_id, kv_layer, spec.compress_ratio, index_q, weights, step)
        with self._part("attend"):
            out = self._attend(spec.layer_id, q, attn.attn_sink, kv_layer, index_layer, step)
        with self._part("output"):
            projected: Tensor = self.ops.output(out, cos, sin, attn.wo_a.weight, self.config.o_groups,
                                                attn.wo_b.weight)
        return projected

    def _write_global_kv(self, attn: Attention, x: Tensor, step: _Pass) -> None:
        """The compressor's step: the row's projection into its pending group, the group's entry
        (written only where it completes) as main KV and index keys (`FusedOps.global_kv`)."""
        compressor, indexer = attn.compressor, attn.indexer
        assert compressor is not None and indexer is not None and indexer.wk is not None
        assert indexer.k_norm is not None
        layer, ratio, pools = attn.spec.layer_id, attn.spec.compress_ratio, self.pools
        rope = self.ropes["compress"]
        main, keys, slot_map = self.ops.global_kv(
            x, self._compress_w[layer], compressor.norm.weight, indexer.wk.weight, indexer.k_norm.weight,
            pools.pending_kv.get(layer), pools.pending_gate.get(layer), step.slots, step.positions,
            step.block_table, pools.scratch_slot, rope.inv_freq, rope.scaling, ratio, pools.entries_per_block(layer),
            self.config.rms_norm_eps)
        self._write("main", main, slot_map, pools.records(layer, "main"))
        self._write("index", keys, slot_map, pools.records(layer, "index"))

    def _write(self, kind: str, x: Tensor, slot_map: Tensor, dest: PagedRecords) -> None:
        writer = {"swa": write_swa, "main": write_main_kv, "index": write_index_key}[kind]
        writer(x, slot_map, dest, impl="auto" if self.kernels else "torch")

    def _select(self, layer_id: int, kv_layer: int, ratio: int, q: Tensor, weights: Tensor, step: _Pass) -> None:
        """`PagedPass.select` over the slots: the two-level top-k at a fixed width."""
        config, pools = self.config, self.pools
        if ratio not in step.visible:  # the index sources of one ratio share it
            step.visible[ratio] = (step.positions + 1) // ratio
        keys = IndexKeys(pools.records(kv_layer, "index"), pools.block_table, step.slots, step.visible[ratio])
        width = pools.max_entries(kv_layer)
        impl: Impl = "auto" if self.kernels else "torch"
        runs = step.offsets if self.group_rows > 1 else None
        selection = layer_topk(config, layer_id, q, weights, keys, width, step.pool, impl, runs, self.group_rows)
        if selection.candidates is not None:
            step.pool = selection.candidates
        step.selections[layer_id] = selection.entries

    def _attend(self, layer_id: int, q: Tensor, sink: Tensor, kv_layer: int | None, index_layer: int | None,
                step: _Pass) -> Tensor:
        """`PagedPass.attend` over the slots: the picks' main-KV records and the ring's window. On the
        kernels `q` is bf16 already and the output stays bf16 (`FusedOps.output` casts it)."""
        pools = self.pools
        swa = pools.window_records(layer_id)
        main = topk_slots = None
        picked = step.selections.get(index_layer) if index_layer is not None else None
        if kv_layer is not None and index_layer is not None and picked is not None:
            main = pools.records(kv_layer, "main")
            if index_layer not in step.topk_slots:  # once per index source: its Reuse layers read the same
                step.topk_slots[index_layer] = self.ops.entries_to_slots(picked, step.block_table,
                                                                         main.slots_per_block)
            topk_slots = step.topk_slots[index_layer]
        window, no_rope = step.windows[layer_id], step.no_rope
        scale = self.config.head_dim**-0.5
        if not self.kernels:
            return sparse_attention_reference(q, sink, main, topk_slots, swa, window, no_rope, no_rope, scale)
        if self.group_rows > 1:
            return sparse_attention(q, sink, main, topk_slots, swa, window, no_rope, no_rope, softmax_scale=scale,
                                    row_offsets=step.offsets, max_rows=self.group_rows)
        return sparse_attention(q, sink, main, topk_slots, swa, window, no_rope, no_rope, softmax_scale=scale)

    # ------------------------------------------------------------------ MoE

    def _moe(self, layer_id: int, x: Tensor) -> Tensor:
        """`MoE.forward` without a host sync (`cedserve.model.device_moe`)."""
        return self._moes[layer_id](x, self.ops)


def _compressor_weight(compressor: Compressor) -> Tensor:
    """The weight of a compressor's one GEMM: ratio 1, `wkv`; else float32 `[wkv; wgate]` `[2D, hidden]`."""
    if compressor.wgate is None:
        return compressor.wkv.weight
    return _concat([compressor.wkv.weight, compressor.wgate.weight]).float()


def _concat(weights: list[Tensor]) -> Tensor:
    """`weights` `[out_i, in]` as one `[sum out_i, in]` weight, the modules' weights its row blocks
    (`cedserve.model.weight_views.concat_rows`: held once)."""
    return concat_rows(weights)
