"""Compile the kernels' variants before a worker serves, instead of on a request's first launch.

Triton compiles a kernel variant the first time it is launched: the sparse attention has one per
split count (which follows the rows of a pass), the index scan and the top-k one per power of two of
the context, and integer arguments are specialised on divisibility by 16. On the H200 each compile
stalls the engine for 0.5-5 s, and a decode worker meets them one by one as its batches and contexts
grow (`docs/benchmarks/decode-paged-*.json`, `warmup_ms_each`: up to 11 s in one step).

A warm-up runs the model's real paged path, so it meets the variants serving will, over synthetic
sequences whose records are zeros: no prompt has to be prefilled to reach a long context, and the
outputs are thrown away. Compiled kernels land in Triton's cache (`TRITON_CACHE_DIR`; the Helm chart
keeps it in a volume of its own), so a restarted worker's warm-up mostly loads them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cedserve.model.block import MoEFn, local_moe
from cedserve.model.network import BatchItem, CEDModel
from cedserve.model.paged_attention import arena_block_size
from cedserve.model.state import SequenceState

log = logging.getLogger(__name__)

FIRST_CONTEXT = 4096
"""The shortest context visited: below it the picks are not yet top-k wide."""
WARMUP_TOKEN = 3


@dataclass
class WarmupReport:
    passes: int
    seconds: float
    contexts: list[int]
    rows: list[int]


def contexts_to_visit(model: CEDModel, max_context: int, first: int = FIRST_CONTEXT) -> list[int]:
    """Powers of two from `first` below `max_context` (the scan's and top-k's variants change per power
    of two of the context), then the longest context below `max_context`; each a multiple of the
    arena's block (so of every ratio), leaving room for the tokens a pass adds."""
    unit = arena_block_size(model.config)
    last = (max_context - 1) // unit * unit
    if last <= 0:
        raise ValueError(f"kernel warm-up: max_context {max_context} is below one block of {unit} tokens")
    out, context = [], first
    while context < last:
        out.append(context // unit * unit or unit)
        context *= 2
    return sorted({*out, last})


def synthetic_state(model: CEDModel, tokens: int) -> SequenceState:
    """A record state at position `tokens` holding zero records: every KV source's entries, every
    layer's window, no partial group (`tokens` a multiple of every ratio). Zero records decode to zeros."""
    state = model.new_state()
    for layer, kv in state.global_kv.items():
        if tokens % kv.ratio:
            raise ValueError(f"a synthetic state needs a multiple of every ratio: {tokens} tokens, layer {layer} "
                             f"has m = {kv.ratio}")
        entries = tokens // kv.ratio
        kv.set_records(kv.main.new_zeros(entries, kv.main.shape[1]),
                       kv.index_keys.new_zeros(entries, kv.index_keys.shape[1]))
    for layer, window in state.swa.items():
        state.swa[layer] = window.new_zeros(min(state.window_keep, tokens), window.shape[1])
    state.position = tokens
    return state


class _Progress:
    def __init__(self, what: str, total: int, report: Callable[[str], None] | None) -> None:
        self.what, self.total, self.done, self.started = what, total, 0, time.monotonic()
        self.report = report or log.info

    def step(self, detail: str) -> None:
        self.done += 1
        self.report(f"kernel warm-up ({self.what}): {self.done}/{self.total} passes, {detail}, "
                    f"{time.monotonic() - self.started:.1f} s")


def rows_to_visit(max_rows: int) -> list[int]:
    """Pass sizes whose attention may compile a variant of its own: every count up to 68 (past 66 rows
    one wave of programs needs no key splits at the released or mini-40 widths, so the split count
    stops changing), then one multiple of 16 and one other (integer arguments are specialised on
    divisibility by 16)."""
    return [n for n in (*range(1, 69), 80, 81) if n <= max_rows]


def warm_up_decode(model: CEDModel, max_context: int, max_rows: int, moe: MoEFn = local_moe,
                   report: Callable[[str], None] | None = None, first_context: int = FIRST_CONTEXT) -> WarmupReport:
    """Decode passes through `forward_batch` (one token per sequence; `moe` as the engine passes it, so
    expert-parallel ranks warm up in step): one row at each of `contexts_to_visit`, then each of
    `rows_to_visit(max_rows)` rows at the first context. Needs the paged path on."""
    if model.paged_arena is None:
        raise ValueError("kernel warm-up: the model is not on the paged attention path")
    started = time.monotonic()
    contexts = contexts_to_visit(model, max_context, first_context)
    rows = rows_to_visit(max_rows)
    progress = _Progress("decode", len(contexts) + len(rows), report)
    for context in contexts:
        state = synthetic_state(model, context)
        model.forward_batch([BatchItem([WARMUP_TOKEN], state)], moe)
        del state
        progress.step(f"context {context:,}")
    states = [synthetic_state(model, contexts[0]) for _ in range(max_rows)]
    for n in rows:
        model.forward_batch([BatchItem([WARMUP_TOKEN], s) for s in states[:n]], moe)
        progress.step(f"{n} rows")
    del states
    _settle(model)
    return WarmupReport(progress.done, time.monotonic() - started, contexts, rows)


def warm_up_prefill(model: CEDModel, max_context: int, chunk_tokens: int, replay_span: int,
                    report: Callable[[str], None] | None = None, first_context: int = FIRST_CONTEXT) -> WarmupReport:
    """What a prefill worker runs for a prompt, at each context of `contexts_to_visit`: one
    `encode_chunk` of `chunk_tokens` (the encoder's variants at that context), then the decoder replay
    over its last `replay_span` tokens. Needs the paged path on (chunks included)."""
    if model.paged_arena is None or not model.paged_chunks:
        raise ValueError("kernel warm-up: the model's chunks are not on the paged attention path")
    started = time.monotonic()
    room = max_context - chunk_tokens  # the longest context a whole chunk still fits after
    longer = contexts_to_visit(model, room, first_context) if room > arena_block_size(model.config) else []
    contexts = [0, *longer]
    progress = _Progress("prefill", len(contexts), report)
    tokens = [WARMUP_TOKEN] * chunk_tokens
    for context in contexts:
        state = synthetic_state(model, context)
        encoded = model.encode_chunk(tokens, state)
        model.replay_decoder(encoded.boundary.last(replay_span), state)
        del state, encoded
        progress.step(f"context {context:,} + {chunk_tokens:,}")
    _settle(model)
    return WarmupReport(progress.done, time.monotonic() - started, contexts, [chunk_tokens, replay_span])


def _settle(model: CEDModel) -> None:
    """Give back what the synthetic sequences took: their arena blocks and the memory they grew."""
    import gc

    gc.collect()
    if model.paged_arena is not None:
        model.paged_arena.trim()
    if torch.cuda.is_available() and model.embed.weight.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
