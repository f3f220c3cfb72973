"""The DSpark drafter's runner: its memory in slots, its pass captured per batch bucket.

The drafter's counterpart of `cedserve.model.runner.ModelRunner`. A proposer gives each drafting
request a slot (`cedserve.decode_workers.slot_drafting`) and then, per engine step:

* `draft(slots, anchors, temperatures, seeds)`: fills a pinned staging tensor (slots, anchors, each
  slot's anchor position and window length from the host's mirror, sampling), issues one
  host-to-device copy, replays the bucket's graph of `DraftStep` (on a CPU, or with graphs off: runs
  it eagerly), and copies the drafts' tokens and confidences back in one copy; the drafts'
  distributions stay on the device (`SlotDrafts.probs`);
* `observe(slots, first_positions, keep_ends, taps)`: the pass's taps of each slot's rows into
  context vectors, written into the slot's ring up to the new anchor (rejected rows are never
  written, so the ring always holds exactly what a `DraftState` would), in a handful of kernels
  with no host sync (not captured: its row count is the pass's).

Joins load a `DraftState` into a slot, leaves export one or just free the slot, and a rollback is
only the host mirror's `end` moving back: no tensor moves on the step's path.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from cedserve.model.device_moe import MoeMode
from cedserve.model.draft_step import DraftOutputs, DraftPools, DraftStep
from cedserve.model.dspark import Drafter, DraftState
from cedserve.model.network import CEDModel
from cedserve.model.runner import CaptureReport, batch_buckets, capture_buckets

_ROWS = 6  # staging rows: slots, anchors, ends, counts, temperature (float64 bits), seeds
_SLOTS, _ANCHORS, _ENDS, _COUNTS, _TEMPERATURE, _SEEDS = range(_ROWS)
_SEED_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class DraftRunnerConfig:
    """How the drafter's runner sizes its pools and which path it takes."""

    max_slots: int = 64
    """Requests with drafter memory at once (the largest bucket)."""
    buckets: tuple[int, ...] = ()
    """Row counts with a graph each; empty: `batch_buckets(max_slots)`."""
    cuda_graphs: bool = True
    """Replay captured graphs on CUDA (False: run the same step eagerly)."""
    moe: MoeMode = "auto"
    """The draft layers' MoE (`cedserve.model.device_moe`)."""
    compile_fused: bool = False
    """On CUDA, compile the pass's sampling loop and its dense MoE with Inductor before capture
    (`DraftStep.sample`; the decode worker's `decode.compile_fused`)."""

    def __post_init__(self) -> None:
        if self.max_slots < 1:
            raise ValueError(f"draft runner field `max_slots`: must be >= 1, got {self.max_slots}")
        if self.buckets and (sorted(set(self.buckets)) != list(self.buckets) or self.buckets[0] < 1):
            raise ValueError(f"draft runner field `buckets`: must be increasing positive sizes, got {list(self.buckets)}")
        if self.buckets and self.buckets[-1] < self.max_slots:
            raise ValueError(f"draft runner field `buckets`: the largest ({self.buckets[-1]}) must hold max_slots "
                             f"({self.max_slots})")
        if self.moe not in ("auto", "dense", "grouped"):
            raise ValueError(f"draft runner field `moe`: must be auto, dense or grouped, got {self.moe!r}")

    @property
    def bucket_sizes(self) -> tuple[int, ...]:
        return self.buckets or batch_buckets(self.max_slots)


@dataclass(frozen=True)
class SlotDrafts:
    """One draft pass's results, one row per requested slot."""

    tokens: list[list[int]]  # [rows][k]
    probs: Tensor
    """float32 `[rows, k, vocab]` on the device: q_k of each draft, a view of the runner's buffer
    that its next `draft` overwrites."""
    confidences: Tensor  # float32 [rows, k] on the host


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    outputs: DraftOutputs


@dataclass
class _Extent:
    """The positions a slot's ring holds: `first .. end - 1` (`end`: the anchor's position)."""

    first: int
    end: int


class DraftRunner:
    """Draft passes over slots (module docstring)."""

    def __init__(self, drafter: Drafter, model: CEDModel, config: DraftRunnerConfig | None = None) -> None:
        self.drafter, self.model = drafter, model
        self.config = config or DraftRunnerConfig()
        self.device = drafter.fc.weight.device
        self.pools = DraftPools(drafter, self.config.max_slots, self.device)
        self.step_fn = DraftStep(drafter, model, self.pools, self.config.moe,
                                 compiled=self.config.compile_fused and self.device.type == "cuda")
        self.block_size = drafter.config.dspark_block_size
        self.buckets = self.config.bucket_sizes
        width, pin = self.buckets[-1], self.device.type == "cuda"
        self._staging = torch.zeros(_ROWS, width, dtype=torch.long, pin_memory=pin)
        self._staging_np = self._staging.numpy()
        """The staging's memory as numpy: filled with numpy stores (a torch op per field costs several
        microseconds of the pass's host time, as in `ModelRunner`)."""
        self._inputs = torch.zeros(_ROWS, width, dtype=torch.long, device=self.device)
        self._probs = torch.zeros(width, self.block_size, model.config.vocab_size, device=self.device)
        self._host = torch.zeros(width, 2 * self.block_size, dtype=torch.float64, pin_memory=pin)
        rows = self.config.max_slots * self.pools.ring  # the most rows one observe writes
        self._observe_staging = torch.zeros(3, rows, dtype=torch.long, pin_memory=pin)
        self._extents: list[_Extent | None] = [None] * self.config.max_slots  # host mirror
        self._graphs: dict[int, _Graph] = {}
        self._seeds = random.Random()
        self._copied = torch.cuda.Event() if pin else None  # type: ignore[no-untyped-call]
        """Recorded after each staging copy: the host waits for it before refilling a staging tensor."""
        self.steps = 0

    @property
    def graphs_captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    # ------------------------------------------------------------------ slots

    def extent(self, slot: int) -> tuple[int, int] | None:
        """`(first, end)`: the slot holds the vectors of positions `first .. end - 1` (None: nothing)."""
        self._check_slot(slot)
        held = self._extents[slot]
        return None if held is None else (held.first, held.end)

    def clear(self, slot: int) -> None:
        """Forget the slot's memory (its request left)."""
        self._check_slot(slot)
        self._extents[slot] = None

    def load(self, slot: int, state: DraftState) -> None:
        """Copy `state`'s newest vectors (up to the ring) into `slot` (a join, a return from offload)."""
        self._check_slot(slot)
        n = min(int(state.vectors.shape[0]), self.pools.ring)
        end = state.end_position
        if n:
            positions = torch.arange(end - n, end, device=self.device)
            self.pools.write(torch.full_like(positions, slot), positions, state.vectors[-n:].to(self.device))
        self._extents[slot] = _Extent(end - n, end)

    def export(self, slot: int) -> DraftState:
        """The slot's memory as a `DraftState` (copies), which `load` takes back unchanged."""
        state = DraftState.new(self.drafter.config, self.device)
        held = self._extents[slot]
        if held is not None:
            state.vectors = self.pools.read(slot, held.first, held.end)
            state.end_position = held.end
        return state

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.config.max_slots:
            raise ValueError(f"draft runner: slot {slot} outside [0, {self.config.max_slots})")

    # ------------------------------------------------------------------ observe

    @torch.no_grad()
    def observe(self, slots: Sequence[int], first_positions: Sequence[int], keep_ends: Sequence[int],
                taps: Sequence[Tensor]) -> None:
        """Each slot's pass computed `taps[i] [n, n_taps, hc, hidden]` for positions
        `first_positions[i] ...`; those before `keep_ends[i]` (the new anchor's) become its memory,
        as `DSparkProposer.observe_many` keeps them: after what it held before `first_positions[i]`
        unless that is not adjacent (a gap, or more than `rollback` behind its end), when the slot
        starts again from this pass. Each slot at most once. `ValueError` for a `keep_end` outside
        the pass's rows."""
        if not slots:
            return
        index: list[int] = []  # rows of the concatenated taps to keep
        where: list[int] = []  # their slots
        at: list[int] = []  # their positions
        row0 = 0
        for slot, first_position, keep_end, rows in zip(slots, first_positions, keep_ends, taps):
            self._check_slot(slot)
            n = int(rows.shape[0])
            if not first_position <= keep_end <= first_position + n:
                raise ValueError(f"draft runner: slot {slot}'s pass covers positions {first_position} .. "
                                 f"{first_position + n - 1}, it cannot keep up to {keep_end}")
            held = self._extents[slot]
            fresh = held is None or held.end < first_position or held.end - first_position > self.pools.rollback
            first = first_position if fresh or held is None else min(held.first, first_position)
            # a `DraftState` keeps the newest `ring` of the rows it extends by, then cuts at keep_end
            first = min(max(first, first_position + n - self.pools.ring), keep_end)
            lo = max(first_position, first)
            index += range(row0 + lo - first_position, row0 + keep_end - first_position)
            where += [slot] * (keep_end - lo)
            at += range(lo, keep_end)
            self._extents[slot] = _Extent(first, keep_end)
            row0 += n
        if not index:
            return
        shapes = {t.shape[1:] for t in taps}
        # shipped taps hold one "stream" (the mean): average each pass's streams first when they differ
        if len(taps) == 1:  # one sequence (batch 1): its own taps, no copy
            joined = taps[0]
        else:
            joined = torch.cat(list(taps) if len(shapes) == 1 else [t.mean(dim=-2, keepdim=True) for t in taps])
        staged = self._stage_rows([index, where, at]).to(self.device, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        vectors = self.drafter.context_vectors(joined[staged[0]])  # [N, hidden]
        self.pools.write(staged[1], staged[2], vectors)

    def _stage_rows(self, rows: list[list[int]]) -> Tensor:
        if self._copied is not None:
            self._copied.synchronize()  # the previous copy has left the staging
        n = len(rows[0])
        staging = self._observe_staging[:, :n]
        staging.copy_(torch.tensor(rows, dtype=torch.long))
        return staging

    # ------------------------------------------------------------------ draft

    def bucket_for(self, rows: int) -> int:
        for size in self.buckets:
            if size >= rows:
                return size
        raise ValueError(f"draft runner: {rows} rows exceed the largest bucket ({self.buckets[-1]})")

    def draft(self, slots: Sequence[int], anchors: Sequence[int], temperatures: Sequence[float],
              seeds: Sequence[int | None]) -> SlotDrafts:
        """`dspark_block_size` drafts after each slot's anchor (`anchors[i]`, the token at the slot's
        end), attending to the newest window of its memory. `ValueError` for a slot without memory,
        a slot twice, or an anchor outside the vocabulary, checked before anything runs."""
        rows = len(slots)
        if not rows == len(anchors) == len(temperatures) == len(seeds):
            raise ValueError(f"draft runner: {rows} slots, {len(anchors)} anchors, {len(temperatures)} "
                             f"temperatures, {len(seeds)} seeds")
        if rows == 0:
            return SlotDrafts([], self._probs[:0], torch.zeros(0, self.block_size))
        self._check_draft(slots, anchors)
        bucket = self.bucket_for(rows)
        self._stage_draft(slots, anchors, temperatures, seeds, bucket)
        self._inputs.copy_(self._staging, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph.graph.replay()
            outputs = graph.outputs
        else:
            outputs = self._forward(bucket)
        host = self._host[:rows]
        host.copy_(outputs.packed[:rows], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.steps += 1
        k = self.block_size
        return SlotDrafts(host[:, :k].long().tolist(), self._probs[:rows], host[:, k:].float())

    def _check_draft(self, slots: Sequence[int], anchors: Sequence[int]) -> None:
        if len(set(slots)) != len(slots):
            raise ValueError(f"draft runner: a slot twice in {list(slots)}")
        vocab = self.model.config.vocab_size
        for slot, anchor in zip(slots, anchors):
            held = self.extent(slot)
            if held is None or held[1] <= held[0]:
                raise ValueError(f"draft runner: slot {slot} holds no drafter memory")
            if not 0 <= anchor < vocab:
                raise ValueError(f"draft runner: anchor {anchor} outside [0, {vocab})")

    def _stage_draft(self, slots: Sequence[int], anchors: Sequence[int], temperatures: Sequence[float],
                     seeds: Sequence[int | None], bucket: int) -> None:
        staging, rows = self._staging_np, len(slots)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the staging
        staging[:, rows:bucket] = 0
        staging[_SLOTS, rows:bucket] = self.pools.scratch_slot
        window = self.pools.window
        extents = [self._extents[s] for s in slots]  # each holds memory (`_check_draft`)
        staging[_SLOTS, :rows] = slots
        staging[_ANCHORS, :rows] = anchors
        staging[_ENDS, :rows] = [e.end for e in extents if e is not None]
        staging[_COUNTS, :rows] = [min(e.end - e.first, window) for e in extents if e is not None]
        staging[_TEMPERATURE, :rows] = np.asarray(temperatures, dtype=np.float64).view(np.int64)
        staging[_SEEDS, :rows] = [(s if s is not None else self._seeds.getrandbits(63)) & _SEED_MASK for s in seeds]

    def _forward(self, bucket: int) -> DraftOutputs:
        """The step over the first `bucket` staged rows."""
        inputs = self._inputs[:, :bucket]
        temperature = inputs[_TEMPERATURE].view(torch.float64).float()
        return self.step_fn.forward(inputs[_SLOTS], inputs[_ANCHORS], inputs[_ENDS], inputs[_COUNTS], temperature,
                                    inputs[_SEEDS], self._probs[:bucket])

    # ------------------------------------------------------------------ graphs

    def capture(self, progress: Callable[[int, int], None] | None = None) -> CaptureReport:
        """Capture one graph per bucket (CUDA with `cuda_graphs` only; else nothing to do), largest
        first into one memory pool, addressing only the scratch slot. `progress(done, total)`."""
        start = time.perf_counter()
        if self.device.type != "cuda" or not self.config.cuda_graphs:
            return CaptureReport((), 0.0, 0)
        before = torch.cuda.memory_reserved(self.device)
        captured = capture_buckets(self.device, self.buckets, lambda bucket: self._stage_scratch(), self._forward,
                                   progress)
        self._graphs.update({bucket: _Graph(graph, outputs) for bucket, (graph, outputs) in captured.items()})
        return CaptureReport(tuple(sorted(self._graphs)), time.perf_counter() - start,
                             torch.cuda.memory_reserved(self.device) - before)

    def _stage_scratch(self) -> None:
        """Inputs whose every row is padding (the scratch slot, no context)."""
        self._staging.zero_()
        self._staging[_SLOTS] = self.pools.scratch_slot
        self._inputs.copy_(self._staging)
