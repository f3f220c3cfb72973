"""The model runner: static buffers, batch buckets and captured CUDA graphs of the decode step.

The seam between a decode engine (which schedules) and the model (which computes). The engine
loads each running request's state into a slot of the runner's `SlotPools` once, then asks for
steps: `step(slots, token_ids, sampling)` returns one sampled token per slot. Per step the host:

1. fills a pinned staging tensor (token ids, slots, sampling parameters, noise counters) for the
   rows, padded to the smallest bucket that holds them (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, ...);
2. issues one host-to-device copy of it;
3. replays the bucket's CUDA graph (on a CPU, or with graphs off: runs `SlotStep` eagerly), which
   runs every layer, writes the new records and windows into the pools, and samples on the device;
4. copies the sampled tokens back (the step's one device-to-host copy) and waits for them.

With the Engram tables in an `EngramStore` (memory-mapped on the host), step 1 is preceded by the
step's Engram rows: hashed on the host, their stored bytes gathered from the maps into a pinned
buffer and copied, before the staging copy, into a static device buffer that the step reads (and
dequantizes) instead of the tables (`cedserve.model.engram_staging`).

Graphs are captured by `capture` (the worker's warm-up), largest bucket first so that every graph
shares one memory pool; warm-up runs and captures address only the scratch slot.

With expert parallelism (`exchange`: each rank holds `E / R` routed experts, `cedserve.model.
expert_exchange`) every MoE layer of the step is a collective, so every rank of the group steps
together on the same bucket: the caller passes `group_rows`, the most rows any rank feeds this step
(the engine agrees on it before stepping), and a rank with fewer rows, or none, pads to that bucket
with scratch rows. The capture runs the same buckets in the same order on every rank, collectives
included.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

from cedserve.model.cache.layout import BlockLayout
from cedserve.model.engram_staging import EngramStaging
from cedserve.model.expert_exchange import FixedCapacityEP
from cedserve.model.network import CEDModel
from cedserve.model.sampling import SamplingParams
from cedserve.model.slot_step import MoeMode, SlotStep
from cedserve.model.slots import SlotPools, SlotShape
from cedserve.model.state import SequenceState

_ROWS = 8  # staging rows: tokens, slots, offsets, top_k, temperature, top_p (float64 bits), seeds, counters
_TOKENS, _SLOTS, _OFFSETS, _TOP_K, _TEMPERATURE, _TOP_P, _SEEDS, _COUNTERS = range(_ROWS)
GREEDY = SamplingParams()
FED = -1
"""A row's token id meaning "the token `remember` last left for this slot on the device": a step can
then be launched before the previous step's tokens reach the host (the decode engine's overlapped
steps, docs/decode.md)."""


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, then steps of a quarter of the next power of two (24, 32, 48, 64, 96, 128, 192,
    256, ...) up to `max_batch`
    (always included)."""
    if max_batch < 1:
        raise ValueError(f"runner: max batch must be >= 1, got {max_batch}")
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size = size * 2 if size < 16 else size + max(8, 1 << (size.bit_length() - 2))
    sizes.append(max_batch)
    return tuple(sizes)


@dataclass(frozen=True)
class RunnerConfig:
    """How the runner sizes its pools and which path it takes."""

    max_slots: int = 64
    """Sequences decoding at once (slots in the pools; the largest bucket)."""
    max_context: int = 8192
    """Tokens one slot holds: prompt plus output."""
    max_rows_per_slot: int = 1
    """Rows one slot may feed in one step: 1 for plain decode, 1 + drafts (+ carried tokens) for
    DSpark verification."""
    buckets: tuple[int, ...] = ()
    """Row counts with a graph each; empty: `batch_buckets(max_slots x max_rows_per_slot)`."""
    cuda_graphs: bool = True
    """Replay captured graphs on CUDA (False: run the same step eagerly)."""
    moe: MoeMode = "auto"
    """The step's MoE (`cedserve.model.slot_step`)."""
    compile_fused: bool = False
    """On CUDA, compile the step's chains of small ops with Inductor (`cedserve.model.fused`) to cut
    its kernels. Off here (a runner built in a test or a benchmark captures in seconds); the decode
    worker's `decode.compile_fused` turns it on by default (its docstring gives the figures)."""

    grouped_attention: bool = False
    """On CUDA, attend each slot's rows of a step together (`sparse_attention`'s `row_offsets`: a
    DSpark verify's windows decoded once per request, not once per row; heads x rows per slot <= 64)
    and scan its index keys once for them (`index_scores`' `row_offsets`).
    Off: no gain over the per-row kernels on an H100 (-4 % to +4 %, docs/benchmarks/gpu-2026-12-06e;
    `benchmarks/step.py --paths graph-fused-grouped`)."""

    def __post_init__(self) -> None:
        SlotShape(self.max_slots, self.max_context, self.max_rows_per_slot)
        if self.buckets and (sorted(set(self.buckets)) != list(self.buckets) or self.buckets[0] < 1):
            raise ValueError(f"runner field `buckets`: must be increasing positive sizes, got {list(self.buckets)}")
        if self.buckets and self.buckets[-1] < self.max_slots:
            raise ValueError(f"runner field `buckets`: the largest ({self.buckets[-1]}) must hold max_slots "
                             f"({self.max_slots})")
        if self.moe not in ("auto", "dense", "grouped"):
            raise ValueError(f"runner field `moe`: must be auto, dense or grouped, got {self.moe!r}")

    @property
    def bucket_sizes(self) -> tuple[int, ...]:
        return self.buckets or batch_buckets(self.max_slots * self.max_rows_per_slot)


@dataclass(frozen=True)
class CaptureReport:
    buckets: tuple[int, ...]
    seconds: float
    graph_pool_bytes: int


Out = TypeVar("Out")


def capture_buckets(device: torch.device, buckets: Sequence[int], stage: Callable[[int], None],
                    forward: Callable[[int], Out], progress: Callable[[int, int], None] | None = None
                    ) -> dict[int, tuple[torch.cuda.CUDAGraph, Out]]:
    """One CUDA graph of `forward(bucket)` per bucket, largest first into one memory pool: `stage(bucket)`
    fills the inputs (scratch rows only), two runs on a side stream compile the kernels' variants
    and fill the allocator, then the capture. `progress(done, total)` after each bucket. The model
    runner and the drafter's runner capture this way."""
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    ordered = sorted(buckets, reverse=True)
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, Out]] = {}
    for done, bucket in enumerate(ordered, 1):
        stage(bucket)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward(bucket)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs = forward(bucket)
        graphs[bucket] = (graph, outputs)
        if progress is not None:
            progress(done, len(ordered))
    torch.cuda.synchronize(device)
    return graphs


@dataclass
class _Outputs:
    """What one step leaves on the device (a graph's static outputs)."""

    tokens: Tensor  # long [bucket]: the sampled tokens
    logits: Tensor  # float32 [bucket, vocab]
    taps: Tensor  # [bucket, n_taps, hc, hidden]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    outputs: _Outputs


@dataclass
class ModelRunner:
    """Decode steps over slots (module docstring)."""

    model: CEDModel
    config: RunnerConfig = field(default_factory=RunnerConfig)
    storage: Tensor | None = None
    """A block pool to keep the global KV in (the decode worker's cache), with its `layout`."""
    layout: BlockLayout | None = None
    exchange: FixedCapacityEP | None = None
    """Expert parallelism: the group's fixed-capacity exchange, sized for the largest bucket (every
    step is then collective: module docstring). None: this rank holds every expert."""

    def __post_init__(self) -> None:
        self.device = self.model.embed.weight.device
        self.buckets = self.config.bucket_sizes
        if self.exchange is not None and self.exchange.max_tokens < self.buckets[-1]:
            raise ValueError(f"runner: the expert-parallel exchange holds {self.exchange.max_tokens} rows per rank, "
                             f"the largest bucket {self.buckets[-1]}")
        shape = SlotShape(self.config.max_slots, self.config.max_context, self.config.max_rows_per_slot)
        self.pools = SlotPools(self.model.config, shape, self.device, self.storage, self.layout)
        width = self.buckets[-1]
        self.engram = self._engram_staging(width)
        """The step's Engram rows when an `EngramStore` serves the tables (None: the step looks them up)."""
        self.slot_step = SlotStep(self.model, self.pools, self.config.moe, fused=self.config.compile_fused,
                                  engram=self.engram, exchange=self.exchange,
                                  group_rows=self.config.max_rows_per_slot if self.config.grouped_attention else 1)
        cuda = pin = self.device.type == "cuda"
        self._staging = torch.zeros(_ROWS, width, dtype=torch.long, pin_memory=pin)
        self._staging_np = self._staging.numpy()
        """The staging's memory as numpy: the host fills it with numpy stores (a torch op per field
        costs several microseconds of the step's host time; a numpy store well under one)."""
        self._inputs = torch.zeros(_ROWS, width, dtype=torch.long, device=self.device)
        self._tokens_host = torch.zeros(width, dtype=torch.long, pin_memory=pin)
        self._positions = [0] * self.config.max_slots  # host mirror: no step reads the device's
        self._fed = torch.zeros(self.config.max_slots + 1, dtype=torch.long, device=self.device)
        """Each slot's token for a `FED` row (`remember`); the last entry is the scratch slot's."""
        self._graphs: dict[int, _Graph] = {}
        self._seeds = random.Random()
        self._copied = torch.cuda.Event() if cuda else None  # type: ignore[no-untyped-call]
        """Recorded after each step's copies in: the host waits for it before refilling the staging."""
        self.steps = 0

    def _engram_staging(self, width: int) -> EngramStaging | None:
        store, hasher = self.model.engram_store, self.model.hasher
        if store is None:
            return None
        assert hasher is not None  # a model with Engram layers has one
        return EngramStaging(store, hasher, self.model.config, self.config.max_slots, self.config.max_rows_per_slot,
                             width, self.device)

    @property
    def graphs_captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    # ------------------------------------------------------------------ slots

    def load(self, slot: int, state: SequenceState, block_ids: list[int] | None = None) -> None:
        """Put a sequence's state into `slot` (a join, a re-admission after preemption); with a
        shared block pool, `block_ids` are the request's blocks (holding its records)."""
        self.pools.load(slot, state, block_ids)
        if self.engram is not None:
            self.engram.load(slot, state.engram_tail, state.position)
        self._positions[slot] = state.position

    def set_blocks(self, slot: int, block_ids: list[int]) -> None:
        """A shared-pool slot's blocks after its request grew."""
        self.pools.set_blocks(slot, block_ids)

    def export(self, slot: int) -> SequenceState:
        """The slot's state as a `SequenceState` (preemption, offload, a path the runner lacks)."""
        return self.pools.export(slot)

    def rewind(self, slot: int, position: int) -> None:
        """Forget the slot's tokens from `position` on (its rejected drafts): only the position moves
        (the rings are long enough, `SlotPools`); `ValueError` past its current position."""
        if not 0 <= position <= self.position(slot):
            raise ValueError(f"runner.rewind: slot {slot} is at {self._positions[slot]}, cannot go to {position}")
        self.pools.rewind(slot, position)
        self._positions[slot] = position

    def position(self, slot: int) -> int:
        self.pools.check_slot(slot)
        return self._positions[slot]

    def bucket_for(self, rows: int) -> int:
        return smallest_bucket(self.buckets, rows, f"runner: {rows} rows exceed")

    # ------------------------------------------------------------------ steps

    def step(self, slots: Sequence[int], token_ids: Sequence[int],
             sampling: Sequence[SamplingParams] | None = None, group_rows: int = 0) -> list[int]:
        """One sampled token per row (sampled on the device): row i feeds `token_ids[i]` to slot
        `slots[i]`; a slot's rows are adjacent and take its next positions in order, and it advances
        past its last row. `ValueError` for unknown slots, a slot's rows not adjacent or more than
        `max_rows_per_slot`, ids outside the vocabulary or a slot at its capacity, checked on the host
        before anything runs. `group_rows`: with an exchange, the most rows any rank of the group
        feeds this step (the same on every rank; this rank may feed none): the step runs that bucket."""
        if sampling is not None and len(sampling) != len(slots):
            raise ValueError(f"runner.step: {len(slots)} slots, {len(sampling)} sampling parameters")
        outputs = self._run(slots, token_ids, sampling, group_rows)
        rows = len(slots)
        if outputs is None or rows == 0:
            return []
        host = self._tokens_host[:rows]
        host.copy_(outputs.tokens[:rows], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return host.tolist()

    def step_outputs(self, slots: Sequence[int], token_ids: Sequence[int],
                     group_rows: int = 0) -> tuple[Tensor, Tensor]:
        """`step` for a caller that samples itself: the rows' logits `[rows, vocab]` and DSpark taps
        `[rows, n_taps, hc, hidden]` (views of the step's outputs, valid until the next step)."""
        outputs = self._run(slots, token_ids, None, group_rows)
        if outputs is None:
            vocab = self.model.config.vocab_size
            return torch.zeros(0, vocab, device=self.device), torch.zeros(0, 0, device=self.device)
        rows = len(slots)
        return outputs.logits[:rows], outputs.taps[:rows]

    def step_picks(self, slots: Sequence[int], token_ids: Sequence[int],
                   sampling: Sequence[SamplingParams]) -> tuple[Tensor, Tensor, Tensor]:
        """`step` without the wait: the rows' tokens sampled on the device, long `[rows]`, their
        logits `[rows, vocab]` and DSpark taps `[rows, n_taps, hc, hidden]` (views of the step's
        outputs, valid until the next step; `remember` the tokens, copy out what is kept)."""
        if len(sampling) != len(slots):
            raise ValueError(f"runner.step: {len(slots)} slots, {len(sampling)} sampling parameters")
        outputs = self._run(slots, token_ids, sampling, 0)
        if outputs is None:
            empty = torch.zeros(0, 0, device=self.device)
            return torch.zeros(0, dtype=torch.long, device=self.device), empty, empty
        rows = len(slots)
        return outputs.tokens[:rows], outputs.logits[:rows], outputs.taps[:rows]

    def step_logits(self, slots: Sequence[int], token_ids: Sequence[int], group_rows: int = 0) -> Tensor:
        """The rows' logits of a step, copied (tests, benchmarks)."""
        return self.step_outputs(slots, token_ids, group_rows)[0].clone()

    def _run(self, slots: Sequence[int], token_ids: Sequence[int],
             sampling: Sequence[SamplingParams] | None, group_rows: int) -> _Outputs | None:
        rows = len(slots)
        if rows != len(token_ids):
            raise ValueError(f"runner.step: {rows} slots, {len(token_ids)} tokens")
        if self.exchange is None:
            group_rows = 0  # alone, the step is this rank's rows only
        elif group_rows < rows:
            raise ValueError(f"runner.step: {rows} rows, more than the group's {group_rows}")
        if max(rows, group_rows) == 0:
            return None
        self._check(slots, token_ids)
        bucket = self.bucket_for(max(rows, group_rows))
        offsets = _offsets(slots)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have left the pinned buffers
        if self.engram is not None:  # issued first: the copy runs while the host fills the staging
            positions = [self._positions[slot] + offset for slot, offset in zip(slots, offsets)]
            self.engram.upload(self.engram.stage(slots, token_ids, positions))
        self._stage(slots, token_ids, offsets, sampling or [GREEDY] * rows, bucket)
        self._upload()
        if FED in token_ids:  # the rows' tokens from the device (`remember`), before the step reads them
            tokens, rows_slots = self._inputs[_TOKENS, :rows], self._inputs[_SLOTS, :rows]
            tokens.copy_(torch.where(tokens == FED, self._fed[rows_slots], tokens))
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph.graph.replay()
            outputs = graph.outputs
        else:
            outputs = self._forward(bucket)
        for slot in slots:  # a slot's rows each advance it by one
            self._positions[slot] += 1
        self.steps += 1
        return outputs

    def remember(self, rows: int, tokens: Tensor) -> None:
        """Keep `tokens [rows]` (on the device: the last step's picks, one row per slot) as the tokens
        of its rows' slots for a later step's `FED` rows; no host sync. Call it after the step that
        produced them and before the next one is launched."""
        self._fed.index_copy_(0, self._inputs[_SLOTS, :rows], tokens[:rows])

    def _upload(self) -> None:
        self._inputs.copy_(self._staging, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _check(self, slots: Sequence[int], token_ids: Sequence[int]) -> None:
        """A slot's rows must be adjacent (its consecutive tokens), at most `max_rows_per_slot`."""
        counts: dict[int, int] = {}
        previous = None
        for slot in slots:
            if slot != previous and slot in counts:
                raise ValueError(f"runner.step: the rows of slot {slot} are not adjacent in {list(slots)}")
            counts[slot] = counts.get(slot, 0) + 1
            previous = slot
        vocab = self.model.config.vocab_size
        for token in token_ids:
            if not 0 <= token < vocab and token != FED:
                raise ValueError(f"runner.step: token id {token} outside [0, {vocab})")
        if self.engram is not None and FED in token_ids:
            raise ValueError("runner.step: FED rows with an Engram store (its rows are hashed on the host)")
        for slot, count in counts.items():
            self.pools.check_slot(slot)
            if count > self.config.max_rows_per_slot:
                raise ValueError(f"runner.step: {count} rows for slot {slot}, more than max_rows_per_slot "
                                 f"({self.config.max_rows_per_slot})")
            if self._positions[slot] + count >= self.config.max_context:
                raise ValueError(f"runner.step: slot {slot} is full ({self.config.max_context} tokens)")

    def _stage(self, slots: Sequence[int], token_ids: Sequence[int], offsets: list[int],
               sampling: Sequence[SamplingParams], bucket: int) -> None:
        staging, rows = self._staging_np, len(slots)
        staging[:, rows:bucket] = 0
        staging[_SLOTS, rows:bucket] = self.pools.scratch_slot
        staging[_TOKENS, :rows] = token_ids
        staging[_SLOTS, :rows] = slots
        staging[_OFFSETS, :rows] = offsets
        staging[_TOP_K, :rows] = [p.top_k for p in sampling]
        staging[_TEMPERATURE].view(np.float64)[:rows] = [p.temperature for p in sampling]
        top_p = staging[_TOP_P].view(np.float64)
        top_p[rows:bucket] = 1.0
        top_p[:rows] = [p.top_p for p in sampling]
        staging[_SEEDS, :rows] = [p.seed if p.seed is not None else self._seeds.getrandbits(63) for p in sampling]
        positions = self._positions
        staging[_COUNTERS, :rows] = [positions[s] + o for s, o in zip(slots, offsets)]

    def _forward(self, bucket: int) -> _Outputs:
        """The step over the first `bucket` staged rows."""
        inputs = self._inputs[:, :bucket]
        logits, taps = self.slot_step.forward(inputs[_TOKENS], inputs[_SLOTS], inputs[_OFFSETS])
        temperature = inputs[_TEMPERATURE].view(torch.float64).float()
        top_p = inputs[_TOP_P].view(torch.float64).float()
        tokens = self.slot_step.ops.sample_rows(logits, temperature, inputs[_TOP_K], top_p, inputs[_SEEDS],
                                                inputs[_COUNTERS])
        return _Outputs(tokens, logits, taps)

    # ------------------------------------------------------------------ graphs

    def capture(self, progress: Callable[[int, int], None] | None = None) -> CaptureReport:
        """Capture one graph per bucket (CUDA with `cuda_graphs` only; else nothing to do).
        `progress(done, total)` is called after each bucket."""
        start = time.perf_counter()
        if self.device.type != "cuda" or not self.config.cuda_graphs:
            return CaptureReport((), 0.0, 0)
        before = torch.cuda.memory_reserved(self.device)
        captured = capture_buckets(self.device, self.buckets, self._stage_scratch, self._forward, progress)
        self._graphs.update({bucket: _Graph(graph, outputs) for bucket, (graph, outputs) in captured.items()})
        return CaptureReport(tuple(sorted(self._graphs)), time.perf_counter() - start,
                             torch.cuda.memory_reserved(self.device) - before)

    @contextlib.contextmanager
    def uncaptured(self) -> Iterator[None]:
        """Steps inside run the eager step of their bucket instead of its graph (the comparison that
        checks a replay: the same kernels in the same order, so top-k ties break alike)."""
        graphs, self._graphs = self._graphs, {}
        try:
            yield
        finally:
            self._graphs = graphs

    def _stage_scratch(self, bucket: int) -> None:
        """Inputs whose every row is padding: warm-ups and captures touch only the scratch slot."""
        self._staging.zero_()
        self._staging[_SLOTS] = self.pools.scratch_slot
        self._staging[_TOP_P] = torch.ones(self._staging.shape[1], dtype=torch.float64).view(torch.long)
        self._inputs.copy_(self._staging)


def smallest_bucket(buckets: Sequence[int], rows: int, what: str) -> int:
    """The smallest of the increasing `buckets` that holds `rows`; `ValueError` "{what} the largest bucket (N)" past it."""
    for size in buckets:
        if size >= rows:
            return size
    raise ValueError(f"{what} the largest bucket ({buckets[-1]})")


def _offsets(slots: Sequence[int]) -> list[int]:
    """Each row's place among its slot's rows (0, 1, ...: the slot's rows are adjacent)."""
    offsets: list[int] = []
    seen: dict[int, int] = {}
    for slot in slots:
        offsets.append(seen.get(slot, 0))
        seen[slot] = offsets[-1] + 1
    return offsets
