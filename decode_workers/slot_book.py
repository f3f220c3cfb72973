"""The decode engine's side of the model runner: which running request holds which slot.

A request whose next row is plain (one token, no drafts, no join or replay pass) decodes through
`cedserve.model.runner.ModelRunner`: at its first such step its `SequenceState` is loaded into a free
slot (`slot_in`) over the worker's own block pool (the records stay in the request's blocks; the
slot gets its block table) and the state object keeps only the position: the windows, partial
groups and Engram history live in the slot from then on. Every path that needs the full state again
(a step with drafts or a replay for it, preemption, offload) first takes it back out (`slot_out`:
windows and partial groups exported, global KV read from the blocks); a finished request just
gives its slot back (`release`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import Tensor

from cedserve.decode_workers.sequence import DecodeSequence, JoinKind
from cedserve.model.cache.layout import BlockLayout
from cedserve.model.config import AttentionMode
from cedserve.model.network import BatchOutput, CEDModel
from cedserve.model.runner import CaptureReport, ModelRunner, RunnerConfig
from cedserve.model.state import SequenceState

log = logging.getLogger(__name__)


def runner_unavailable(model: CEDModel, mode: str, world_size: int, drafting: bool) -> str | None:
    """Why `DecodeConfig.runner = mode` leaves the runner off (None: it runs)."""
    if mode == "off":
        return "decode.runner = off"
    if mode == "auto" and drafting:
        return ("DSpark drafts: verify rows are not on the runner yet, and a request moving between the "
                "runner and forward_batch at every draft would copy its state each time (decode.runner = on "
                "forces it)")
    if world_size > 1:
        return "expert parallelism (the runner's MoE is one rank's)"
    if model.engram_store is not None:
        return "Engram tables served by an EngramStore"
    if mode == "auto" and model.embed.weight.device.type != "cuda":
        return "not a CUDA device (decode.runner = on runs its step eagerly)"
    return None


@dataclass
class SlotBook:
    """The runner and the requests in its slots (module docstring)."""

    runner: ModelRunner
    _free: list[int] = field(default_factory=list)
    _slot: dict[str, int] = field(default_factory=dict)  # request id -> slot
    _blocks: dict[str, int] = field(default_factory=dict)  # request id -> blocks in the slot's table

    def __post_init__(self) -> None:
        self._free = list(range(self.runner.config.max_slots - 1, -1, -1))
        self._ratios = {spec.layer_id: spec.compress_ratio for spec in self.runner.model.config.layer_plan
                        if spec.mode is AttentionMode.FULL}

    @staticmethod
    def create(model: CEDModel, storage: Tensor, layout: BlockLayout, max_slots: int, max_context: int,
               cuda_graphs: bool) -> SlotBook:
        config = RunnerConfig(max_slots=max_slots, max_context=max_context, cuda_graphs=cuda_graphs)
        return SlotBook(ModelRunner(model, config, storage=storage, layout=layout))

    def capture(self) -> CaptureReport:
        report = self.runner.capture(lambda done, total: log.info("runner: captured %d of %d buckets", done, total))
        if report.buckets:
            log.info("runner: CUDA graphs for batch buckets %s in %.1f s", report.buckets, report.seconds)
        return report

    def holds(self, seq: DecodeSequence) -> bool:
        return seq.request_id in self._slot

    @property
    def num_free(self) -> int:
        return len(self._free)

    def plain(self, seq: DecodeSequence) -> bool:
        """Whether `seq`'s next row can go through the runner (a draft is the caller's to rule out)."""
        if seq.state is None or seq.join in (JoinKind.REPLAY, JoinKind.PREFILL) or seq.needs_pass_to_join():
            return False
        if len(seq.pending) != 1:
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
        seq.state.release_paged()
        seq.state = SequenceState(seq.state.position, {}, {}, seq.state.engram_tail[:0],
                                  window_keep=seq.state.window_keep)

    def slot_out(self, seq: DecodeSequence) -> None:
        """Take `seq`'s full state back from its slot (records read from its blocks)."""
        slot = self._slot.pop(seq.request_id)
        self._blocks.pop(seq.request_id, None)
        state = self.runner.export(slot)
        self._free.append(slot)
        seq.state = state
        seq.stored_entries = {layer: kv.num_entries for layer, kv in state.global_kv.items()}

    def release(self, seq: DecodeSequence) -> None:
        """A finished (or dropped) request's slot back, its state discarded."""
        slot = self._slot.pop(seq.request_id, None)
        self._blocks.pop(seq.request_id, None)
        if slot is not None:
            self._free.append(slot)

    def stored_entries(self, seq: DecodeSequence) -> dict[int, int]:
        """Entries in the blocks of a slotted request (the step wrote them there)."""
        assert seq.state is not None
        return {layer: seq.state.position // ratio for layer, ratio in self._ratios.items()}

    def step(self, seqs: list[DecodeSequence], tables: list[list[int]]) -> list[BatchOutput]:
        """One runner step over `seqs` (each plain, `tables` its block ids): one `BatchOutput` each
        (logits `[1, vocab]`, taps `[1, n_taps, hc, hidden]`, copies), states advanced."""
        for seq, table in zip(seqs, tables):
            if not self.holds(seq):
                self.slot_in(seq, table)
            elif len(table) != self._blocks[seq.request_id]:
                self.runner.set_blocks(self._slot[seq.request_id], table)
                self._blocks[seq.request_id] = len(table)
        slots = [self._slot[seq.request_id] for seq in seqs]
        logits, taps = self.runner.step_outputs(slots, [seq.pending[-1] for seq in seqs])
        logits, taps = logits.clone(), taps.clone()  # the graph's outputs are rewritten by the next step
        out = []
        for i, seq in enumerate(seqs):
            assert seq.state is not None
            seq.state.position += 1
            out.append(BatchOutput(logits[i : i + 1], taps[i : i + 1] if taps.dim() > 2 else logits[i : i + 1, :0],
                                   None))
        return out

