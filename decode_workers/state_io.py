"""Moving a sequence's state between its blocks, host memory and the model.

* `store_new_records`: after a step, write the global-KV entries the state gained into the blocks
  (so the blocks always hold every consumed token's records: prefix caching, offload and KV events
  see real bytes).
* `load_from_blocks`: a fresh state whose global KV comes from the blocks (received from a prefill
  worker, cached here, or onloaded), up to a token count.
* `offload` / `onload`: a preempted request's blocks and bounded state to host memory and back,
  byte for byte (resuming is exact).
* `replay_span` / `prefix_start`: how many tokens rebuild bounded state.
"""

from __future__ import annotations

import math

import torch

from cedserve.decode_workers.sequence import DecodeSequence, Offloaded
from cedserve.model.cache.block_pool import gather_rows, scatter_rows
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.config import AttentionMode, ModelConfig
from cedserve.model.network import CEDModel, GlobalKVRecords
from cedserve.model.paged_kv import load_state, store_records
from cedserve.model.state import SequenceState


def exact_replay_span(config: ModelConfig) -> int:
    """Tokens whose replay rebuilds bounded state exactly (the model's receptive field)."""
    return config.num_hidden_layers * (config.sliding_window - 1) + config.engram_max_ngram_size - 1


def replay_span(config: ModelConfig, requested: int, default: int, num_tokens: int) -> int:
    """The span a join replays: the request's, else the worker's, else exact; at least one group of
    every compressor (so each partial group is rebuilt), at most the whole prompt."""
    span = requested or default or exact_replay_span(config)
    return min(max(span, group_alignment(config)), num_tokens)


def group_alignment(config: ModelConfig) -> int:
    """Positions where every compressor starts a group (the lcm of the KV sources' ratios)."""
    ratios = [s.compress_ratio for s in config.layer_plan if s.mode is AttentionMode.FULL]
    return math.lcm(*ratios) if ratios else 1


def prefix_start(config: ModelConfig, cached_tokens: int, span: int) -> int:
    """Where a local prefill starts when `cached_tokens` tokens of records are already held: `span`
    tokens before them (bounded state), on a group boundary, so the earlier records load as is."""
    align = group_alignment(config)
    return max(0, cached_tokens - span) // align * align


def load_from_blocks(model: CEDModel, layout: BlockLayout, storage: torch.Tensor, block_ids: list[int],
                     num_tokens: int) -> SequenceState:
    """A fresh state holding the records of the first `num_tokens` tokens, positioned after them.
    Its bounded state is empty: replay or prefill rebuilds it."""
    state = model.new_state()
    load_state(layout, storage, block_ids, num_tokens, state)
    state.position = num_tokens
    return state


def entries(state: SequenceState) -> dict[int, int]:
    return {layer: kv.num_entries for layer, kv in state.global_kv.items()}


def store_new_records(seq: DecodeSequence, layout: BlockLayout, storage: torch.Tensor, block_ids: list[int]) -> None:
    """Write the entries `seq.state` gained since the last call into its blocks."""
    assert seq.state is not None
    records = {}
    for layer, kv in seq.state.global_kv.items():
        first = seq.stored_entries.get(layer, 0)
        if kv.num_entries > first:
            records[layer] = GlobalKVRecords(layer, first, kv.main[first:], kv.index_keys[first:])
    store_records(layout, storage, block_ids, records)
    seq.stored_entries = entries(seq.state)


def offload(seq: DecodeSequence, storage: torch.Tensor, block_ids: list[int]) -> Offloaded:
    """Copy the request's blocks to host memory and keep only the bounded part of its state."""
    assert seq.state is not None
    rows = gather_rows(storage, block_ids).cpu()
    state = seq.state
    for kv in state.global_kv.values():  # the records are in `rows`; keep the partial groups
        kv.set_records(kv.main[:0].clone(), kv.index_keys[:0].clone())
    state.release_paged()  # the paged attention's copy too: it is made again on onload
    return Offloaded(rows, state, seq.draft)


def onload(seq: DecodeSequence, off: Offloaded, layout: BlockLayout, storage: torch.Tensor, block_ids: list[int],
           num_shared_blocks: int) -> None:
    """Put an offloaded request back: its rows into its new blocks (blocks the prefix cache shared
    back already hold the same bytes), its records into its state."""
    n = min(len(block_ids), off.rows.shape[0])
    if n > num_shared_blocks:
        scatter_rows(storage, block_ids[num_shared_blocks:n], off.rows[num_shared_blocks:n])
    state = off.state
    load_state(layout, storage, block_ids, state.position, state)  # records only; partial groups stay
    seq.state, seq.draft = state, off.draft
    seq.stored_entries = entries(state)
