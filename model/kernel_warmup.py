"""Compile the kernels' variants before a worker serves, instead of on a request's first launch.

Triton compiles a kernel variant the first time it is launched: the sparse attention has one per
split count (which follows the rows of a call), the index scan's tiles and the top-k's early exit
follow rows x context, the top-k's block width the power of two of the context, and integer
arguments are specialised on divisibility by 16. On the H200 each compile stalls the engine for
0.5-5 s, and a worker meets them one by one as its batches and contexts grow (without a warm-up,
five decode cells stalled 40.5 s in all: `docs/benchmarks/kernel-warmup-h200-cold.json`; after this
warm-up 0.34 s).

The warm-up makes the paged path's own kernel calls (`PagedPass.select` for every index source in
layer order, `PagedPass.attend` for every layer) over synthetic sequences whose records are zeros,
for a grid of cells (context x rows): no prompt is prefilled to reach a long context, no projection
or MoE runs, and a cell whose kernels are already compiled costs milliseconds. Compiled kernels land
in Triton's cache (`TRITON_CACHE_DIR`; the Helm chart keeps it in a volume of its own), so a
restarted worker's warm-up mostly loads them.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cedserve.model.attention import Attention
from cedserve.model.config import AttentionMode
from cedserve.model.network import CEDModel
from cedserve.model.paged_attention import PagedPass, arena_block_size
from cedserve.model.state import SequenceState

log = logging.getLogger(__name__)

FIRST_CONTEXT = 4096
"""The shortest context visited: below it the picks are not yet top-k wide."""


@dataclass
class WarmupReport:
    """What a warm-up ran: how many cells, how long, which contexts and pass sizes (rows)."""

    cells: int
    seconds: float
    contexts: list[int]
    rows: list[int]


def wanted(model: CEDModel, paged_attention: str) -> bool:
    """Whether a worker on this path has kernels to compile: the Triton kernels on a CUDA device (the
    references and the dense path compile nothing; the interpreter compiles nothing either)."""
    return paged_attention == "kernels" and model.embed.weight.device.type == "cuda"


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
    """Log lines for a long warm-up: about every 5 % of its cells, with the time so far."""

    def __init__(self, what: str, total: int, report: Callable[[str], None] | None) -> None:
        self.what, self.total, self.done, self.started = what, total, 0, time.monotonic()
        self.report = report or log.info
        self.every = max(1, total // 20)

    def step(self, detail: str) -> None:
        self.done += 1
        if self.done % self.every == 0 or self.done == self.total:
            self.report(f"kernel warm-up ({self.what}): {self.done}/{self.total} cells, {detail}, "
                        f"{time.monotonic() - self.started:.1f} s")


@dataclass(frozen=True)
class Cell:
    """One warm-up call set: `items` sequences at `context` tokens, each adding `rows` rows."""

    context: int
    items: int
    rows: int


def run_cell(model: CEDModel, cell: Cell, state: SequenceState) -> None:
    """The paged path's kernel calls for one pass of `cell` (every item a view of `state`), layer by
    layer as the model makes them: an index source's picks, then the layer's attention; zero queries."""
    arena = model.paged_arena
    assert arena is not None
    config, device, dtype = model.config, model.embed.weight.device, model.embed.weight.dtype
    states = [state] * cell.items
    sizes, starts = [cell.rows] * cell.items, [cell.context] * cell.items
    offsets = [i * cell.rows for i in range(cell.items)]
    total = cell.items * cell.rows
    pass_ = PagedPass.build(arena, states, sizes, starts, offsets, total, device)
    window = [torch.cat([state.swa[0], state.swa[0].new_zeros(cell.rows, state.swa[0].shape[1])])] * cell.items
    index_q = torch.zeros(total, config.index_n_heads, config.index_head_dim, device=device, dtype=dtype)
    weights = torch.zeros(total, config.index_n_heads, device=device)
    q = torch.zeros(total, config.num_attention_heads, config.head_dim, device=device, dtype=dtype)
    scale = config.head_dim**-0.5
    for spec in config.layer_plan:  # in layer order, as the model: the candidate pool before Reindex layers
        if spec.mode in (AttentionMode.FULL, AttentionMode.REINDEX) and spec.kv_layer is not None:
            pass_.select(spec.layer_id, spec.kv_layer, spec.compress_ratio, index_q, weights)
        attn = model.layers[spec.layer_id].attn
        assert isinstance(attn, Attention)
        sink = attn.attn_sink
        kv_layer = spec.kv_layer if spec.compress_ratio else None
        index_layer = spec.index_layer if spec.compress_ratio else None
        pass_.attend(q, sink, window, config.sliding_window, kv_layer, index_layer, scale)


def warm_up(model: CEDModel, cells: list[Cell], what: str,
            report: Callable[[str], None] | None = None) -> WarmupReport:
    """Run `cells` (one synthetic sequence per context, shared by the cell's items). Needs the paged
    path on (`use_paged_attention`)."""
    if model.paged_arena is None:
        raise ValueError("kernel warm-up: the model is not on the paged attention path")
    started = time.monotonic()
    progress = _Progress(what, len(cells), report)
    contexts = sorted({c.context for c in cells})
    with torch.no_grad():
        for context in contexts:
            state = synthetic_state(model, context)
            for cell in (c for c in cells if c.context == context):
                run_cell(model, cell, state)
                progress.step(f"context {context:,}, {cell.items} x {cell.rows} rows")
            del state
    _settle(model)
    rows = sorted({c.items * c.rows for c in cells})
    return WarmupReport(len(cells), time.monotonic() - started, contexts, rows)


def rows_to_visit(max_rows: int) -> list[int]:
    """Pass sizes whose calls may compile variants of their own: every count up to 68 (past 66 rows
    one wave of attention programs needs no key splits at the released or mini-40 widths), then one
    multiple of 16 and one other (integer arguments are specialised on divisibility by 16)."""
    return [n for n in (*range(1, 69), 80, 81) if n <= max_rows]


def warm_up_decode(model: CEDModel, max_context: int, max_rows: int,
                   report: Callable[[str], None] | None = None, first_context: int = FIRST_CONTEXT) -> WarmupReport:
    """Decode passes: every pass size of `rows_to_visit(max_rows)` (one row per sequence) at every
    context of `contexts_to_visit` (the index scan's tiles and the top-k's early exit follow rows x
    context)."""
    cells = [Cell(c, n, 1) for c in contexts_to_visit(model, max_context, first_context)
             for n in rows_to_visit(max_rows)]
    return warm_up(model, cells, "decode", report)


def warm_up_prefill(model: CEDModel, max_context: int, chunk_tokens: int, replay_span: int,
                    report: Callable[[str], None] | None = None, first_context: int = FIRST_CONTEXT) -> WarmupReport:
    """A prompt's calls at each context of `contexts_to_visit` (from an empty sequence): a chunk of
    `chunk_tokens` rows, and the decoder replay's `replay_span`."""
    room = max_context - chunk_tokens  # the longest context a whole chunk still fits after
    longer = contexts_to_visit(model, room, first_context) if room > arena_block_size(model.config) else []
    cells = [Cell(c, 1, n) for c in (0, *longer) for n in sorted({chunk_tokens, replay_span})]
    return warm_up(model, cells, "prefill", report)


def _settle(model: CEDModel) -> None:
    """Give back what the synthetic sequences took: their arena blocks and the memory they grew."""
    gc.collect()
    if model.paged_arena is not None:
        model.paged_arena.trim()
    if torch.cuda.is_available() and model.embed.weight.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
