"""The decode engine's side of the model runner: which running request holds which slot.

A request whose next row is plain (one token, no drafts, no join or replay pass) decodes through
`cedserve.model.runner.ModelRunner`: at its first such step its `SequenceState` is loaded into a free
slot (`slot_in`) over the worker's own block pool (the records stay in the request's blocks; the
slot gets its block table) and the state object keeps only the position: the windows, partial
groups and Engram history live in the slot from then on. Every path that needs the full state again
(a step with drafts or a replay for it, preemption, offload) first takes it back out (`slot_out`:
windows and partial groups exported, global KV read from the blocks); a finished request just
gives its slot back (`release`).

With expert parallelism every rank's runner step is collective (its MoE layers exchange rows through
a fixed-capacity all-to-all): the engine agrees on the group's most runner rows each step, and every
rank steps with that bucket, a rank with no runner rows of its own included (`step(..., group_rows)`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cedserve.decode_workers.metrics import DecodeMetrics
from cedserve.decode_workers.sequence import DecodeSequence, JoinKind
from cedserve.decode_workers.step import SeqPlan
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.config import AttentionMode
from cedserve.model.dspark import Draft
from cedserve.model.expert_exchange import FixedCapacityEP
from cedserve.model.network import BatchOutput, CEDModel
from cedserve.model.runner import FED, CaptureReport, ModelRunner, RunnerConfig
from cedserve.model.state import SequenceState, StateSnapshot

log = logging.getLogger(__name__)


def runner_unavailable(model: CEDModel, mode: str, world_size: int) -> str | None:
    """Why `DecodeConfig.runner = mode` leaves the runner off (None: it runs)."""
    if mode == "off":
        return "decode.runner = off"
    if world_size > 1 and mode == "auto":
        return ("expert parallelism: the runner's captured all-to-all has not run on GPUs yet "
                "(decode.runner = on runs it; tests/unit/test_runner_gpu.py's expert-parallel tests first)")
    if mode == "auto" and model.embed.weight.device.type != "cuda":
        return "not a CUDA device (decode.runner = on runs its step eagerly)"
    return None


@dataclass
class AheadStep:
    """A step `SlotBook.launch`ed and not yet collected: its requests, each one's row position, its
    picks' pinned host buffer and the event after their copy (None on a CPU: the copy was done)."""

    seqs: list[DecodeSequence]
    positions: list[int]
    picks: Tensor
    done: torch.cuda.Event | None
    taps: Tensor | None = None
    """A copy of the rows' DSpark taps (`launch(..., taps=True)`), for the drafter's memory."""
    logits: Tensor | None = None
    """The rows' logits copied to the host, when a request asks for logprobs."""
    after: list[Callable[[], None]] = field(default_factory=list)
    """What waits for this step to finish (the blocks of a request that finished while it ran)."""

    def __post_init__(self) -> None:
        self.request_ids = frozenset(seq.request_id for seq in self.seqs)

    def holds(self, seq: DecodeSequence) -> bool:
        return seq.request_id in self.request_ids


@dataclass
class SlotBook:
    """The runner and the requests in its slots (module docstring)."""

    runner: ModelRunner
    metrics: DecodeMetrics | None = None
    _free: list[int] = field(default_factory=list)
    _slot: dict[str, int] = field(default_factory=dict)  # request id -> slot
    _blocks: dict[str, int] = field(default_factory=dict)  # request id -> blocks in the slot's table
    capture_report: CaptureReport | None = None
    """The last `capture`'s buckets and time (the worker's start-up report)."""

    def __post_init__(self) -> None:
        self._free = list(range(self.runner.config.max_slots - 1, -1, -1))
        pin = self.runner.device.type == "cuda"
        self._picks_host = [torch.zeros(self.runner.config.max_slots, dtype=torch.long, pin_memory=pin)
                            for _ in range(2)]  # two launched steps' picks may be in flight: one buffer each
        self._launches = 0
        self._ratios = {spec.layer_id: spec.compress_ratio for spec in self.runner.model.config.layer_plan
                        if spec.mode is AttentionMode.FULL}

    @staticmethod
    def create(model: CEDModel, storage: Tensor, layout: BlockLayout, max_slots: int, max_context: int,
               max_drafts: int, cuda_graphs: bool, compile_fused: bool = False,
               metrics: DecodeMetrics | None = None,
               exchange: Callable[[int], FixedCapacityEP | None] | None = None,
               grouped_attention: bool = False) -> SlotBook:
        """A runner whose slots take a step's carried tokens (up to `max_drafts` accepted last step),
        the anchor and `max_drafts` drafts: `2 x max_drafts + 1` rows. `exchange(max_rows)`: the
        group's fixed-capacity exchange for that many rows per rank (expert parallelism), or None.
        `grouped_attention`: `DecodeConfig.grouped_attention`."""
        config = RunnerConfig(max_slots=max_slots, max_context=max_context, max_rows_per_slot=2 * max_drafts + 1,
                              cuda_graphs=cuda_graphs, compile_fused=compile_fused and storage.is_cuda,
                              grouped_attention=grouped_attention and storage.is_cuda)
        group = exchange(config.bucket_sizes[-1]) if exchange is not None else None
        return SlotBook(ModelRunner(model, config, storage=storage, layout=layout, exchange=group), metrics)

    @property
    def collective(self) -> bool:
        """Whether every rank of a group must step together (expert parallelism)."""
        return self.runner.exchange is not None

    def capture(self) -> CaptureReport:
        report = self.runner.capture(lambda done, total: log.info("runner: captured %d of %d buckets", done, total))
        if report.buckets:
            log.info("runner: CUDA graphs for batch buckets %s in %.1f s", report.buckets, report.seconds)
        self.capture_report = report
        return report

    def holds(self, seq: DecodeSequence) -> bool:
        return seq.request_id in self._slot

    @property
    def num_free(self) -> int:
        return len(self._free)

    def fits(self, seq: DecodeSequence, draft: Draft | None, table: list[int]) -> bool:
        """Whether `seq`'s rows this step (carried tokens, its anchor and `draft`'s tokens) can go
        through the runner: its state is ready (no join or replay pass), the rows fit a slot's
        `max_rows_per_slot` and its blocks (`table`: the step writes every row's record into them;
        the engine grows it for the drafts first, `DecodeEngine._table_for_rows`, and drafts still
        past the last block, when the pool had none, take `forward_batch` for that step), and it
        holds a slot or one is free with its records all in its blocks."""
        if seq.state is None or seq.join in (JoinKind.REPLAY, JoinKind.PREFILL) or seq.needs_pass_to_join():
            return False
        rows = len(seq.pending) + (0 if draft is None else len(draft.tokens))
        if rows > self.runner.config.max_rows_per_slot:
            return False
        if seq.state.position + rows > len(table) * self.runner.pools.layout.block_size:
            return False
        if self.holds(seq):
            return True
        # a slot reads the records from the request's blocks: they must all be there (a state handed
        # over in process has none stored until its first `forward_batch` step persists them)
        stored = all(seq.stored_entries.get(layer, 0) == kv.num_entries for layer, kv in seq.state.global_kv.items())
        return stored and bool(self._free)

    def slot_in(self, seq: DecodeSequence, block_ids: list[int]) -> None:
        """Load `seq`'s state into a free slot; its state object keeps only the position."""
        assert seq.state is not None
        slot = self._free.pop()
        self.runner.load(slot, seq.state, block_ids)
        self._slot[seq.request_id] = slot
        self._blocks[seq.request_id] = len(block_ids)
        self._moved("in")
        seq.state.release_paged()
        seq.state = SequenceState(seq.state.position, {}, {}, seq.state.engram_tail[:0],
                                  window_keep=seq.state.window_keep)

    def slot_out(self, seq: DecodeSequence) -> None:
        """Take `seq`'s full state back from its slot (records read from its blocks)."""
        slot = self._slot.pop(seq.request_id)
        self._blocks.pop(seq.request_id, None)
        assert seq.state is not None
        if self.runner.position(slot) != seq.state.position:  # drafts rejected by the last step
            self.runner.rewind(slot, seq.state.position)
        state = self.runner.export(slot)
        self._free.append(slot)
        self._moved("out")
        seq.state = state
        seq.stored_entries = {layer: kv.num_entries for layer, kv in state.global_kv.items()}

    def release(self, seq: DecodeSequence) -> None:
        """A finished (or dropped) request's slot back, its state discarded."""
        slot = self._slot.pop(seq.request_id, None)
        self._blocks.pop(seq.request_id, None)
        if slot is not None:
            self._free.append(slot)
            self._moved(None)

    def _moved(self, direction: str | None) -> None:
        if self.metrics is not None:
            if direction is not None:
                self.metrics.runner_moves.labels(direction).inc()
            self.metrics.runner_slots.set(len(self._slot))

    def stored_entries(self, seq: DecodeSequence) -> dict[int, int]:
        """Entries in the blocks of a slotted request (the step wrote them there)."""
        assert seq.state is not None
        return {layer: seq.state.position // ratio for layer, ratio in self._ratios.items()}

    def launch(self, seqs: list[DecodeSequence], tables: list[list[int]], fed: bool, taps: bool = False) -> AheadStep:
        """Launch one plain row per request in `seqs` (each in its slot) without waiting for it: the
        row's token is the request's anchor, or with `fed` the token the step before picked for it,
        still on the device (`runner.FED`). Its picks (sampled on the device under each request's
        parameters: the argmax for a greedy one) are kept on the device for the next launch and
        copied to the host behind the step; `collect` waits for them. `taps`: keep a copy of the rows'
        DSpark taps for the drafter's memory (`collect` hands them out with the rows)."""
        rows: list[int] = []
        for seq, table in zip(seqs, tables):
            slot = self._slot[seq.request_id]
            if len(table) != self._blocks[seq.request_id]:
                self.runner.set_blocks(slot, table)
                self._blocks[seq.request_id] = len(table)
            rows.append(slot)
        tokens = [FED] * len(seqs) if fed else [seq.pending[-1] for seq in seqs]
        picks, logits, step_taps = self.runner.step_picks(rows, tokens, [seq.params for seq in seqs])
        self.runner.remember(len(rows), picks)
        kept_taps = step_taps.clone() if taps and step_taps.dim() > 2 else None  # the next replay rewrites them
        self._launches += 1
        host = self._picks_host[self._launches % 2][: len(rows)]
        host.copy_(picks, non_blocking=True)
        host_logits = None
        if any(seq.params.logprobs for seq in seqs):  # their logprobs are read from the logits on the host
            host_logits = torch.empty(logits.shape, dtype=logits.dtype, pin_memory=logits.is_cuda)
            host_logits.copy_(logits, non_blocking=True)
        done = None
        if picks.is_cuda:
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
        positions = []
        for seq in seqs:
            assert seq.state is not None
            positions.append(seq.state.position)
            seq.state.position += 1
        if self.metrics is not None:
            self.metrics.runner_rows.inc(len(rows))
        return AheadStep(list(seqs), positions, host, done, kept_taps, host_logits)

    def collect(self, step: AheadStep) -> tuple[list[SeqPlan], list[BatchOutput]]:
        """The plans and outputs of a `launch`ed step, once its picks are on the host: each plan is
        `picked` (its token is its pick, `decide` draws none); the logits are the host copy where a
        request asks for logprobs, else they stand in empty."""
        if step.done is not None:
            step.done.synchronize()
        picks = step.picks.tolist()
        plans: list[SeqPlan] = []
        outputs: list[BatchOutput] = []
        empty = step.picks.new_zeros(1, 0, dtype=torch.float32)  # read by no one: one for every row
        for i, (seq, position) in enumerate(zip(step.seqs, step.positions)):
            plans.append(SeqPlan(seq, i, 1, position, None, verify=True, picked=True))
            row_taps = step.taps[i : i + 1] if step.taps is not None else empty
            row_logits = step.logits[i : i + 1] if step.logits is not None else empty
            outputs.append(BatchOutput(row_logits, row_taps, None, picks[i : i + 1]))
        return plans, outputs

    @staticmethod
    def rows(seqs: list[DecodeSequence], drafts: list[Draft | None]) -> int:
        """Rows `step` feeds for `seqs`: each one's carried tokens and anchor, and its drafts."""
        return sum(len(seq.pending) + (0 if draft is None else len(draft.tokens)) for seq, draft in zip(seqs, drafts))

    def step(self, seqs: list[DecodeSequence], tables: list[list[int]], drafts: list[Draft | None],
             group_rows: int = 0) -> tuple[list[SeqPlan], list[BatchOutput]]:
        """One runner step over `seqs` (each `fits`; `tables` their block ids): the plans and outputs
        `forward_batch` would give (`step.plan_rows`: a carried chunk, then the anchor and its drafts
        with a snapshot of the position before them, which `decide` restores on a rejection and the
        next step turns into a rewind of the slot). Logits and taps are copies. `group_rows`: the
        group's most rows this step (expert parallelism; `seqs` may then be empty)."""
        rows: list[int] = []
        tokens: list[int] = []
        for seq, table, draft in zip(seqs, tables, drafts):
            assert seq.state is not None
            if not self.holds(seq):
                self.slot_in(seq, table)
            slot = self._slot[seq.request_id]
            if len(table) != self._blocks[seq.request_id]:
                self.runner.set_blocks(slot, table)
                self._blocks[seq.request_id] = len(table)
            if self.runner.position(slot) != seq.state.position:  # drafts rejected last step
                self.runner.rewind(slot, seq.state.position)
            feed = [*seq.pending, *([] if draft is None else draft.tokens)]
            rows += [slot] * len(feed)
            tokens += feed
        logits, taps = self.runner.step_outputs(rows, tokens, group_rows)
        if self.metrics is not None:
            self.metrics.runner_rows.inc(len(rows))
        logits, taps = logits.clone(), taps.clone()  # the graph's outputs are rewritten by the next step
        argmax = logits.argmax(dim=-1).tolist()  # every row's, in one copy: greedy requests need no sync of their own
        plans: list[SeqPlan] = []
        outputs: list[BatchOutput] = []
        at = 0
        for seq, draft in zip(seqs, drafts):
            assert seq.state is not None
            start, carried = seq.state.position, len(seq.pending) - 1
            chunks = ([carried] if carried else []) + [1 + (0 if draft is None else len(draft.tokens))]
            plans.append(SeqPlan(seq, len(outputs), len(chunks), start, draft, verify=True))
            for i, n in enumerate(chunks):
                last = i == len(chunks) - 1
                snapshot = StateSnapshot(start + carried, {}, {}, seq.state.engram_tail) if last and draft else None
                row_taps = taps[at : at + n] if taps.dim() > 2 else logits[at : at + n, :0]
                outputs.append(BatchOutput(logits[at : at + n], row_taps, snapshot, argmax[at : at + n]))
                at += n
            seq.state.position = start + sum(chunks)
        return plans, outputs
