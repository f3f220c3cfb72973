"""The CED text backbone with serving entry points over explicit per-sequence state.

Entry points (all take and mutate a `SequenceState`; none keeps per-sequence data on the model):

* `prefill(token_ids, state)`: run all layers over the next tokens of one sequence; chunked
  calls compose (two halves equal one whole, up to float rounding).
* `decode_step(token_ids, states)`: one new token for each of a batch of sequences.
* `encode_chunk(token_ids, state)`: the CED prefill path: only the encoder layers, plus the
  decoder KV source's compressor and index keys. Returns the new global-KV records and the
  residual state at the encoder/decoder boundary.
* `replay_decoder(span, state)`: rebuild the decoder layers' windows by running them over the
  last tokens' boundary states (the global KV is already complete); returns their logits
  (`replay_decoder_with_taps` also returns DSpark's taps, for a shipped state).
* `prefill_with_taps(token_ids, state)`: `prefill` that also returns DSpark's taps.
* `verify(token_ids, state)` / `commit(state, snapshot, num_tokens_kept)`: score an anchor and its
  drafts in one pass, then keep only the accepted prefix (see `commit` for how).
* `forward_batch(items, moe)`: one pass over chunks of several sequences (prefill, decode, verify
  or replay chunks, mixed): everything row-wise over all rows at once, decode and verify chunks
  attending as one padded batch (`cedserve.model.batch`), replays and long chunks one by one; the
  MoE goes through `moe` (expert parallelism plugs in there).
* `forward_train(token_ids [B, S])`: the training pass: whole sequences from position 0, batched,
  with autograd; each row equals a `prefill` of it (cached values through the KV format's round trip
  with straight-through gradients, see `kv_format.py`).

Engram rows are looked up by token ids only, so every entry point starts the lookup (on the
`EngramStore`'s thread when the tables are memory-mapped) before layer 0 runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from cedserve.model.batch import BatchPass, device_ints
from cedserve.model.block import Block, MoEFn, local_moe
from cedserve.model.config import AttentionMode, LayerRole, ModelConfig
from cedserve.model.context import ForwardContext, TrainContext
from cedserve.model.engram import Engram, EngramHasher, check_table_sizes
from cedserve.model.engram_store import EngramStore
from cedserve.model.kv_format import KVFormat, check_finite
from cedserve.model.mhc import hc_collapse
from cedserve.model.norm import RMSNorm
from cedserve.model.paged_attention import Backend, PagedArena, PagedPass
from cedserve.model.rope import RopeTable
from cedserve.model.state import SequenceState, StateSnapshot


@dataclass(frozen=True)
class BoundaryHidden:
    """Residual state entering the first decoder layer, for consecutive tokens."""

    positions: Tensor  # int64 [n]
    streams: Tensor  # [n, hc, hidden]
    pre_mix: Tensor  # float32 [n, hc]: the last encoder layer's FFN-site pre
    hash_ids: Tensor | None  # int64 [n, engram layers, columns], None without Engram
    start: int
    """`positions[0]` (the span's first position), known on the host."""

    @property
    def end(self) -> int:
        """The position after the span's last token."""
        return self.start + int(self.positions.shape[0])

    def last(self, count: int) -> BoundaryHidden:
        """The last `count` tokens."""
        start = max(0, self.positions.shape[0] - count)
        hash_ids = None if self.hash_ids is None else self.hash_ids[start:]
        return BoundaryHidden(self.positions[start:], self.streams[start:], self.pre_mix[start:], hash_ids,
                              self.start + start)

    @staticmethod
    def concat(parts: Sequence[BoundaryHidden]) -> BoundaryHidden:
        """Join spans of consecutive chunks, in order."""
        hash_parts = [p.hash_ids for p in parts]
        hash_ids = None if any(h is None for h in hash_parts) else torch.cat([h for h in hash_parts if h is not None])
        return BoundaryHidden(
            torch.cat([p.positions for p in parts]),
            torch.cat([p.streams for p in parts]),
            torch.cat([p.pre_mix for p in parts]),
            hash_ids,
            parts[0].start,
        )


@dataclass(frozen=True)
class GlobalKVRecords:
    """Records one chunk appended to a KV source's global KV (entries `first_entry ..`)."""

    layer_id: int
    first_entry: int
    main: Tensor  # uint8 [G, main_kv_record_bytes]
    index_keys: Tensor  # uint8 [G, index_key_record_bytes]


@dataclass(frozen=True)
class EncodedChunk:
    """What `encode_chunk` hands to the KV transfer and to the decoder replay."""

    global_kv: dict[int, GlobalKVRecords]
    boundary: BoundaryHidden


@dataclass(frozen=True)
class TargetOutput:
    """A target pass over S tokens, with what DSpark reads from it."""

    logits: Tensor  # float32 [S, vocab]
    taps: Tensor  # [S, n_taps, hc, hidden]: streams entering each `dspark_target_layer_ids` attention


@dataclass(frozen=True)
class VerifySnapshot:
    """What `commit` needs to undo or keep a verification pass."""

    before: StateSnapshot  # the sequence before the pass
    token_ids: Tensor  # int64 [K + 1]: the anchor and the drafts that were scored


@dataclass(frozen=True)
class Verification:
    """One verification pass: row k of `logits` scores the token after `token_ids[k]`."""

    logits: Tensor  # float32 [K + 1, vocab]
    taps: Tensor
    """[K + 1, n_taps, hc, hidden]: the drafter's context for the pass's positions. Extend the
    `DraftState` with all rows and `truncate` it to the kept ones after `commit`: the kept rows
    equal the committed state's up to float rounding (bit-equal when all or none are kept)."""
    snapshot: VerifySnapshot


@dataclass(frozen=True)
class BatchItem:
    """One sequence's chunk in a `forward_batch` pass."""

    token_ids: Tensor | Sequence[int]
    state: SequenceState
    taps: bool = False
    """Also return the chunk's DSpark taps (as `prefill_with_taps`)."""
    replay: bool = False
    """Rebuild the bounded state from these last tokens instead of consuming new ones (as `replay`):
    the state must already hold the tokens' global KV and be at the chunk's end position."""
    snapshot: bool = False
    """Also return the state as it was before this chunk (for rolling rejected drafts back). A
    sequence may have several consecutive chunks in one pass (e.g. tokens accepted last step, then
    a new anchor and its drafts): they run in order inside every layer, and the snapshot of a later
    chunk includes the earlier ones."""


@dataclass(frozen=True)
class BatchOutput:
    """One item's share of a `forward_batch` pass."""

    logits: Tensor  # float32 [S, vocab]
    taps: Tensor  # [S, n_taps, hc, hidden] when asked for, else [0]
    snapshot: StateSnapshot | None  # the state before the chunk, when asked for
    argmax: list[int] | None = None  # each row's argmax, when the pass copied them to the host at once


@dataclass(frozen=True)
class TrainOutput:
    """A `forward_train` pass."""

    logits: Tensor  # float32 [B, S, vocab]
    taps: Tensor | None  # [B, S, n_taps, hc, hidden] when asked for
    indexer_loss: Tensor  # float32 scalar: mean over index sources (0 when not asked for)


class CEDModel(nn.Module):
    """Checkpoint names: `embed.weight`, `layers.N.*`, `norm.weight`, `lm_head.weight` (the
    loader also accepts them under a `model.` prefix). With an `engram_store` the Engram tables
    are served by the store (and closed by `close`), not held as parameters."""

    def __init__(
        self,
        config: ModelConfig,
        engram_token_map: Sequence[int] | None = None,
        engram_store: EngramStore | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        params = config.rope_parameters or {}
        self.ropes = {
            kind: RopeTable(params[kind], config.head_dim, config.max_position_embeddings) for kind in ("main", "compress")
        }
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        in_memory = engram_store is None
        self.layers = nn.ModuleList([Block(config, spec, self.ropes["compress"], in_memory) for spec in config.layer_plan])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        check_table_sizes(config)
        self.hasher = EngramHasher(config, engram_token_map) if engram_token_map is not None else None
        if config.engram_layer_ids and self.hasher is None:
            raise ValueError("this config has Engram layers: pass engram_token_map (see load_compressed_token_map)")
        self.engram_store = engram_store
        self.paged_arena: PagedArena | None = None
        """Set by `use_paged_attention`: record states attend through the kernels."""
        self.paged_chunks = True
        """With `paged_arena`: chunks outside the padded group take the paged path too."""

    def use_paged_attention(self, backend: Backend | None = "kernels", *, chunks: bool = True) -> PagedArena | None:
        """Route attention through the compact-cache kernels over a paged copy of the records
        (`cedserve.model.paged_attention`): the padded group of `forward_batch` (decode and verify
        chunks) in one pass and, with `chunks`, every other chunk (prefill, `encode_chunk`, replays)
        on its own. None goes back to the dense path. `ValueError` when the kernels cannot run this
        model."""
        self.paged_arena = None if backend is None else PagedArena(self.config, self.embed.weight.device, backend)
        self.paged_chunks = chunks
        return self.paged_arena

    def close(self) -> None:
        """Release host resources: the Engram store's thread and memory maps, if any."""
        if self.engram_store is not None:
            self.engram_store.close()

    # ------------------------------------------------------------------ entry points

    def new_state(self, kv_format: KVFormat = KVFormat.RECORDS) -> SequenceState:
        return SequenceState.new(self.config, self.embed.weight.device, kv_format)

    @torch.no_grad()
    def prefill(self, token_ids: Tensor | Sequence[int], state: SequenceState) -> Tensor:
        """Logits `[S, vocab]` (float32) for the next `S` tokens of the sequence."""
        return self._forward(token_ids, state, None)

    @torch.no_grad()
    def prefill_with_taps(self, token_ids: Tensor | Sequence[int], state: SequenceState) -> TargetOutput:
        """`prefill`, plus the DSpark taps of every token: for each `dspark_target_layer_ids`
        layer, the mHC streams entering its attention (after Engram, before the attention's
        collapse), `[S, n_taps, hc, hidden]`; `Drafter.context_vectors` averages the streams."""
        taps: dict[int, Tensor] = {}
        logits = self._forward(token_ids, state, taps)
        return TargetOutput(logits, torch.stack([taps[i] for i in self.config.dspark_target_layer_ids], dim=1))

    def verify(self, token_ids: Tensor | Sequence[int], state: SequenceState) -> Verification:
        """Score the anchor and K drafts (`token_ids [K + 1]`) in one target pass. The state then
        holds all K + 1 tokens until `commit` keeps the accepted prefix."""
        before = state.snapshot()
        tokens = self._token_tensor(token_ids)
        out = self.prefill_with_taps(tokens, state)
        return Verification(out.logits, out.taps, VerifySnapshot(before, tokens))

    def commit(self, state: SequenceState, snapshot: VerifySnapshot, num_tokens_kept: int) -> None:
        """Leave `state` exactly, bit for bit, as if only the first `num_tokens_kept` tokens of the
        verified chunk had been consumed (by one `prefill` of them).

        Strategy: snapshot + re-run. The snapshot costs nothing (it holds references; state updates
        never write in place) and restores every window, the compressors' partial groups and global
        KV entries, the Engram tail and the position at once. Keeping all K + 1 tokens needs
        nothing, keeping none only the restore; otherwise the kept tokens run again (one more
        target pass over at most K tokens).

        Why not truncate in place (keep window records past the window, cut global KV entries and
        partial groups back): the kept tokens' records would come from a (K + 1)-row pass, whose
        matmul and softmax shapes differ from an n-row pass, so the state would equal a
        non-speculative run's only up to float rounding (about 1e-6 in the tiny model's logits,
        as for chunked prefill) and later logits would drift from it. That is the trade a GPU
        engine may take for speed; this model keeps speculation bit-exact."""
        total = int(snapshot.token_ids.shape[0])
        if state.position != snapshot.before.position + total:
            raise ValueError(f"commit: the sequence is at position {state.position}, not at the end of the "
                             f"verified chunk ({snapshot.before.position} + {total}); commit each verify once")
        if not 0 <= num_tokens_kept <= total:
            raise ValueError(f"commit: num_tokens_kept must be in [0, {total}], got {num_tokens_kept}")
        if num_tokens_kept == total:
            return
        state.restore(snapshot.before)
        if num_tokens_kept:
            self.prefill(snapshot.token_ids[:num_tokens_kept], state)

    def decode_step(self, token_ids: Sequence[int], states: Sequence[SequenceState]) -> Tensor:
        """One token per sequence -> logits `[batch, vocab]`."""
        if len(token_ids) != len(states):
            raise ValueError(f"decode_step got {len(token_ids)} tokens for {len(states)} sequences")
        if not states:
            return torch.zeros(0, self.config.vocab_size, device=self.embed.weight.device)
        return torch.cat([self.prefill([token], state)[-1:] for token, state in zip(token_ids, states)])

    @torch.no_grad()
    def forward_batch(self, items: Sequence[BatchItem], moe: MoEFn = local_moe) -> list[BatchOutput]:
        """One pass over every item's chunk (see `BatchItem`). Each state ends as `prefill` (or
        `replay`) of its chunks in order would leave it, up to float rounding: row-wise results do
        not depend on the other rows, but matmuls over more rows (and attention over padded keys)
        may round differently. Decode and verify chunks attend as one padded batch
        (`cedserve.model.batch`). `moe` is called once per layer even for an empty batch, so
        expert-parallel ranks with nothing to run stay in step."""
        batch, tokens = self._begin_batch(items)
        x, pre = self._embed(tokens)
        for layer_id in range(self.config.num_hidden_layers):
            x, pre = self._block(layer_id).forward_batch(x, pre, batch, moe)
        logits = self._logits(x, pre).split_with_sizes(batch.sizes) if items else ()
        return [BatchOutput(rows, self._stack_taps(ctx.taps, rows), ctx.boundary)
                for rows, ctx in zip(logits, batch.ctxs)]

    def forward_train(self, token_ids: Tensor, kv_format: KVFormat = KVFormat.RECORDS, taps: bool = False,
                      dense_selection: bool = False, indexer_loss: bool = False) -> TrainOutput:
        """Logits of whole sequences `token_ids [B, S]`, each starting at position 0, with autograd:
        the training pass through the same layers. Row b equals `prefill(token_ids[b],
        SequenceState.new(config, kv_format=kv_format))` up to float rounding. `taps`: also the
        DSpark taps; `dense_selection`: attend to every visible compressed entry instead of the
        top-k (the indexer's warm-up); `indexer_loss`: the indexers' distillation loss."""
        if self.engram_store is not None:
            raise ValueError("forward_train needs the Engram tables in memory: load with engram='memory'")
        tokens = self._token_tensor(token_ids).view(token_ids.shape)
        if tokens.dim() != 2:
            raise ValueError(f"forward_train takes token ids [batch, seq], got shape {tuple(token_ids.shape)}")
        batch, seq = tokens.shape
        positions = torch.arange(seq, device=tokens.device)
        rows = None
        if self.hasher is not None:
            compressed = self.hasher.compress(tokens)
            hash_ids = self.hasher.hash_ids(compressed[:, :0], compressed, 0)  # [B, S, layers, columns]
            tables = [self._engram(layer_id) for layer_id in self.config.engram_layer_ids]
            rows = torch.stack([t.lookup(hash_ids[:, :, i]) for i, t in enumerate(tables)], dim=2)
        rope = {kind: table.cos_sin(positions) for kind, table in self.ropes.items()}
        ctx = TrainContext(positions, rope, kv_format, rows, dense_selection, indexer_loss, {} if taps else None)
        streams, pre_mix = self._embed(tokens.flatten())
        streams, pre_mix = streams.view(batch, seq, *streams.shape[1:]), pre_mix.view(batch, seq, -1)
        for layer_id in range(self.config.num_hidden_layers):
            streams, pre_mix = self._block(layer_id).forward_train(streams, pre_mix, ctx)
        logits = self._logits(streams, pre_mix)
        tapped = None
        if ctx.taps is not None:
            tapped = torch.stack([ctx.taps[i] for i in self.config.dspark_target_layer_ids], dim=2)
        losses = ctx.indexer_losses
        aux = torch.stack(losses).mean() if losses else logits.new_zeros(())
        return TrainOutput(logits, tapped, aux)

    def _stack_taps(self, taps: dict[int, Tensor] | None, rows: Tensor) -> Tensor:
        if taps is None:
            return rows[:0]
        return torch.stack([taps[i] for i in self.config.dspark_target_layer_ids], dim=1)

    @torch.no_grad()
    def encode_chunk(self, token_ids: Tensor | Sequence[int] | np.ndarray, state: SequenceState) -> EncodedChunk:
        """Run the encoder layers over the next tokens and write every KV source's global KV,
        the decoder's included. Decoder windows are left untouched (rebuild with
        `replay_decoder`)."""
        boundary_layer = self._decoder_source()
        before = {layer: kv.num_entries for layer, kv in state.global_kv.items()}
        streams, pre_mix, hash_ids, ctx = self._begin(token_ids, state, write_global_kv=True)
        streams, pre_mix = self._run(range(boundary_layer), streams, pre_mix, ctx)
        block = self._block(boundary_layer)
        x = block.attention_input(block.apply_engram(streams, ctx), pre_mix)
        block.attn.write_global_kv(x, ctx)
        state.position += int(ctx.positions.shape[0])
        self._end(ctx, "encode_chunk")
        boundary = BoundaryHidden(ctx.positions, streams, pre_mix, hash_ids, ctx.start)
        return EncodedChunk(self._new_records(state, before), boundary)

    @torch.no_grad()
    def replay_decoder(self, span: BoundaryHidden, state: SequenceState) -> Tensor:
        """Clear the decoder layers' windows and rebuild them from `span` (the boundary states
        of the sequence's last tokens). Returns the span's logits `[n, vocab]`; the last row
        predicts the next token. Exact when the span covers the decoder's receptive field
        (`num_decoder_layers * (sliding_window - 1)` tokens, or the whole sequence)."""
        return self._replay_decoder(span, state, None)

    @torch.no_grad()
    def replay_decoder_with_taps(self, span: BoundaryHidden, state: SequenceState) -> TargetOutput:
        """`replay_decoder`, plus the span's DSpark taps `[n, n_taps, hc, hidden]` (as
        `prefill_with_taps`). Every tapped layer must be a decoder layer (`ValueError` otherwise)."""
        first = self._decoder_source()
        encoder_taps = [i for i in self.config.dspark_target_layer_ids if i < first]
        if encoder_taps:
            raise ValueError(f"DSpark taps layers {encoder_taps}, which are encoder layers: the decoder replay "
                             "does not run them")
        taps: dict[int, Tensor] = {}
        logits = self._replay_decoder(span, state, taps)
        return TargetOutput(logits, torch.stack([taps[i] for i in self.config.dspark_target_layer_ids], dim=1))

    def _replay_decoder(self, span: BoundaryHidden, state: SequenceState, taps: dict[int, Tensor] | None) -> Tensor:
        end = span.end
        if end != state.position:
            raise ValueError(f"replay span ends at position {end}, but the sequence is at {state.position}")
        first = self._decoder_source()
        for layer in range(first, self.config.num_hidden_layers):
            state.swa[layer] = state.swa[layer][:0]
        ctx = self._context(span.positions, span.start, state, False, span.hash_ids)
        ctx.taps = taps
        layers = range(first, self.config.num_hidden_layers)
        streams, pre_mix = self._run(layers, span.streams, span.pre_mix, ctx)
        self._end(ctx, "replay_decoder")
        return self._logits(streams, pre_mix)

    @torch.no_grad()
    def replay(self, token_ids: Tensor | Sequence[int], state: SequenceState) -> Tensor:
        """Rebuild all bounded state (every layer's window, the compressors' partial groups, the
        Engram history) from the sequence's last tokens, given complete global KV (e.g. received
        from a prefill worker). Returns their logits `[n, vocab]`. Exact when the tokens cover
        the receptive field (`num_hidden_layers * (sliding_window - 1) + engram_max_ngram_size - 1`
        tokens, or the whole sequence); shorter spans are the bounded-replay approximation."""
        streams, pre_mix, _, ctx = self._begin_replay(token_ids, state)
        streams, pre_mix = self._run(range(self.config.num_hidden_layers), streams, pre_mix, ctx)
        self._end(ctx, "replay")
        return self._logits(streams, pre_mix)

    # ------------------------------------------------------------------ internals

    def _block(self, layer_id: int) -> Block:
        block = self.layers[layer_id]
        assert isinstance(block, Block)
        return block

    def _decoder_source(self) -> int:
        """First decoder layer, which must be the decoder's only KV source."""
        first: int = self.config.num_encoder_layers
        for spec in self.config.layer_plan:
            if spec.role is LayerRole.DECODER and spec.mode is AttentionMode.FULL and spec.layer_id != first:
                raise ValueError(f"encoder-only prefill cannot fill decoder KV source {spec.layer_id}")
        return first

    def _token_tensor(self, token_ids: Tensor | Sequence[int] | np.ndarray) -> Tensor:
        """The ids as an int64 device tensor `[S]`, checked against the vocabulary where they are:
        ids given on the host (a list, an array, a CPU tensor: the engines' case) are checked there
        before one copy to the device, so the check reads nothing back from it."""
        device = self.embed.weight.device
        on_device = isinstance(token_ids, Tensor) and token_ids.device.type != "cpu"
        if on_device:
            tokens = torch.as_tensor(token_ids, dtype=torch.long, device=device).flatten()
            low, high = (int(v) for v in torch.aminmax(tokens)) if tokens.numel() else (0, 0)
        else:
            host = token_ids.numpy() if isinstance(token_ids, Tensor) else token_ids  # numpy: no dispatched op
            ids = np.asarray(host, dtype=np.int64).ravel()
            low, high = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
            tokens = torch.from_numpy(ids)
            if device.type == "cuda":
                tokens = tokens.pin_memory().to(device, non_blocking=True)
        if tokens.numel() == 0:
            raise ValueError("no tokens given")
        if low < 0 or high >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got {tokens.tolist()[:16]}...")
        return tokens

    def _context(
        self, positions: Tensor, start: int, state: SequenceState, write_global_kv: bool, hash_ids: Tensor | None
    ) -> ForwardContext:
        """The pass's shared values; starts the Engram row lookup (before any layer runs). The records'
        NaN/inf checks wait for the pass's end (`_end`)."""
        rows = self._engram_rows(hash_ids)
        rope = {kind: table.cos_sin(positions) for kind, table in self.ropes.items()}
        ctx = ForwardContext(positions, rope, state, start, write_global_kv=write_global_kv, engram_rows=rows,
                             finite=[])
        ctx.paged = self._paged_chunk(state, start, int(positions.shape[0]))
        return ctx

    def _paged_chunk(self, state: SequenceState, start: int, size: int) -> PagedPass | None:
        """A one-item paged pass for a chunk at positions `start .. start + size` when the model
        attends through the kernels (`use_paged_attention`); None on the dense path."""
        if self.paged_arena is None or not self.paged_chunks or state.kv_format is not KVFormat.RECORDS:
            return None
        return PagedPass.build(self.paged_arena, [state], [size], [start], [0], size, self.embed.weight.device)

    def _engram_rows(self, hash_ids: Tensor | None) -> Future[Tensor] | None:
        """Rows `[S, engram layers, columns, head_dim]` for `hash_ids [S, engram layers, columns]`:
        prefetched on the store's thread, or gathered now from the in-memory tables."""
        if hash_ids is None:
            return None
        if self.engram_store is not None:
            return self.engram_store.prefetch(hash_ids)
        tables = [self._engram(layer_id) for layer_id in self.config.engram_layer_ids]
        done: Future[Tensor] = Future()
        done.set_result(torch.stack([t.lookup(hash_ids[:, i]) for i, t in enumerate(tables)], dim=1))
        return done

    def _engram(self, layer_id: int) -> Engram:
        engram = self._block(layer_id).engram
        assert engram is not None
        return engram

    def _hash_ids(self, tokens: Tensor, state: SequenceState) -> Tensor | None:
        """Engram row ids for the chunk; advances the sequence's n-gram history."""
        if self.hasher is None:
            return None
        compressed = self.hasher.compress(tokens)
        hash_ids: Tensor = self.hasher.hash_ids(state.engram_tail, compressed, state.position)
        keep = self.config.engram_max_ngram_size - 1
        history = torch.cat([state.engram_tail, compressed])
        state.engram_tail = history[max(0, history.shape[0] - keep) :]
        return hash_ids

    def _begin(
        self, token_ids: Tensor | Sequence[int] | np.ndarray, state: SequenceState, write_global_kv: bool
    ) -> tuple[Tensor, Tensor, Tensor | None, ForwardContext]:
        tokens = self._token_tensor(token_ids)
        positions = torch.arange(state.position, state.position + tokens.shape[0], device=tokens.device)
        hash_ids = self._hash_ids(tokens, state)
        ctx = self._context(positions, state.position, state, write_global_kv, hash_ids)
        streams, pre_mix = self._embed(tokens)
        return streams, pre_mix, hash_ids, ctx

    def _begin_batch(self, items: Sequence[BatchItem]) -> tuple[BatchPass, Tensor]:
        """`forward_batch`'s start: each item's bookkeeping in item order (as `_begin` or
        `_begin_replay` would do it), and what the pass's layers share: positions, RoPE and Engram
        rows of all rows, computed once. Token ids given as lists are checked on the host."""
        device = self.embed.weight.device
        sizes: list[int] = []
        starts: list[int] = []
        at: dict[int, int] = {}  # id(state) -> its position after the items so far
        for item in items:  # host ints only: where each item starts
            n = int(item.token_ids.numel()) if isinstance(item.token_ids, Tensor) else len(item.token_ids)
            if n == 0:
                raise ValueError("no tokens given")
            position = at.get(id(item.state), item.state.position)
            start = position - n if item.replay else position
            if start < 0:
                raise ValueError(f"replay of {n} tokens, but the sequence holds {position}")
            sizes.append(n)
            starts.append(start)
            at[id(item.state)] = start + n
        positions_host = [start + j for start, n in zip(starts, sizes) for j in range(n)]
        if any(isinstance(item.token_ids, Tensor) for item in items):
            tokens = torch.cat([self._token_tensor(item.token_ids) for item in items])
            (positions,) = device_ints([positions_host], device)
        else:
            flat = [int(t) for item in items for t in item.token_ids]
            if any(not 0 <= t < self.config.vocab_size for t in flat):
                raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got {flat[:16]}...")
            tokens, positions = device_ints([flat, positions_host], device)
        rope = {kind: table.cos_sin(positions) for kind, table in self.ropes.items()}
        ctxs, hashes, offset = [], [], 0
        for item, n, start in zip(items, sizes, starts):
            state, rows = item.state, slice(offset, offset + n)
            offset += n
            before = (state.position, state.engram_tail)
            if item.replay:  # as `_begin_replay`: the bounded state restarts at the span
                for layer in state.swa:
                    state.swa[layer] = state.swa[layer][:0]
                state.engram_tail = state.engram_tail[:0]
                state.position = start
            hashes.append(self._hash_ids(tokens[rows], state))
            state.position = start + n  # a later chunk of this sequence starts here
            chunk_rope = {kind: (cos[rows], sin[rows]) for kind, (cos, sin) in rope.items()}
            ctx = ForwardContext(positions[rows], chunk_rope, state, start, write_global_kv=not item.replay)
            ctx.taps = {} if item.taps else None
            ctx.boundary = StateSnapshot(before[0], {}, {}, before[1]) if item.snapshot else None
            ctxs.append(ctx)
        hash_ids = [h for h in hashes if h is not None]
        rows_future = self._engram_rows(torch.cat(hash_ids)) if hash_ids else None
        replay = [item.replay for item in items]
        batch = BatchPass.build(ctxs, sizes, starts, replay, rope, rows_future, device)
        for i in batch.alone:  # replays and long chunks: one paged pass each (`attend_one`)
            ctxs[i].paged = self._paged_chunk(ctxs[i].state, starts[i], sizes[i])
        if self.paged_arena is not None and batch.padded and batch.kv_format is KVFormat.RECORDS:
            p = batch.padded
            batch.paged = PagedPass.build(self.paged_arena, [ctxs[i].state for i in p], [sizes[i] for i in p],
                                          [starts[i] for i in p], [batch.offsets[i] for i in p], batch.num_rows,
                                          device)
        return batch, tokens

    def _begin_replay(
        self, token_ids: Tensor | Sequence[int], state: SequenceState
    ) -> tuple[Tensor, Tensor, Tensor | None, ForwardContext]:
        """`replay`'s start: clear the bounded state and set up a pass over the last tokens."""
        tokens = self._token_tensor(token_ids)
        start = state.position - int(tokens.shape[0])
        if start < 0:
            raise ValueError(f"replay of {tokens.shape[0]} tokens, but the sequence holds {state.position}")
        for layer in state.swa:
            state.swa[layer] = state.swa[layer][:0]
        state.engram_tail = state.engram_tail[:0]
        state.position = start  # the Engram history restarts at the span (n-grams cut at its start)
        hash_ids = self._hash_ids(tokens, state)
        state.position += int(tokens.shape[0])
        ctx = self._context(torch.arange(start, state.position, device=tokens.device), start, state, False, hash_ids)
        streams, pre_mix = self._embed(tokens)
        return streams, pre_mix, hash_ids, ctx

    def _embed(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Initial streams `[S, hc, D]` (the embedding in every stream) and pre mix `[S, hc]`."""
        embedded = self.embed(tokens)
        streams = embedded.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        pre_mix = torch.zeros(tokens.shape[0], self.config.hc_mult, device=tokens.device)
        pre_mix[:, 0] = 1.0  # the first site reads stream 0 only
        return streams, pre_mix

    def _forward(self, token_ids: Tensor | Sequence[int], state: SequenceState, taps: dict[int, Tensor] | None) -> Tensor:
        """All layers over the next tokens; logits `[S, vocab]`; fills `taps` if given."""
        streams, pre_mix, _, ctx = self._begin(token_ids, state, write_global_kv=True)
        ctx.taps = taps
        streams, pre_mix = self._run(range(self.config.num_hidden_layers), streams, pre_mix, ctx)
        state.position += int(ctx.positions.shape[0])
        self._end(ctx, "prefill")
        return self._logits(streams, pre_mix)

    @staticmethod
    def _end(ctx: ForwardContext, what: str) -> None:
        """A pass's one host read: its records' deferred NaN/inf checks (`ValueError`)."""
        if ctx.finite is not None:
            check_finite(ctx.finite, what)

    def _run(self, layers: range, streams: Tensor, pre_mix: Tensor, ctx: ForwardContext) -> tuple[Tensor, Tensor]:
        for layer_id in layers:
            streams, pre_mix = self._block(layer_id)(streams, pre_mix, ctx)
        return streams, pre_mix

    def _logits(self, streams: Tensor, pre_mix: Tensor) -> Tensor:
        logits: Tensor = self.lm_head(self.norm(hc_collapse(streams, pre_mix)))
        return logits.float()

    def _new_records(self, state: SequenceState, before: dict[int, int]) -> dict[int, GlobalKVRecords]:
        out = {}
        for layer, kv in state.global_kv.items():
            first = before[layer]
            out[layer] = GlobalKVRecords(layer, first, kv.main[first:], kv.index_keys[first:])
        return out
