"""DSpark drafting on slots: the `DSparkProposer` whose memory lives in a `DraftRunner`.

`SlotDSparkProposer` behaves as the eager proposer (the same cost check, the same drafts up to float
rounding, greedy tokens equal; sampled rows draw from the same q_k with another random stream:
`cedserve.model.draft_step`), but each drafting request's memory is a slot of preallocated device
rings instead of tensors of its own in `seq.draft`, and the draft pass is one graph replay with one
copy of the drafts to the host (`cedserve.model.draft_runner`). The engine swaps it in for the
eager proposer when `decode.runner_drafter` says so (`slot_drafting_unavailable`).

A request's slot is its own from its first observed pass until it leaves (`release`); a step whose
target rows take `forward_batch` instead of the model runner (a join, a verify crossing into an
unallocated block) keeps it, so no memory moves. While a request holds a slot its `seq.draft` is
None. A `DraftState` found in `seq.draft` (handed over with `attach_state`, or back from an offload)
is loaded into a slot before the request drafts or observes; a preempted request's memory goes back
into `seq.draft` as a `DraftState` (`release(seq, keep=True)`) for the offload to carry.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from cedserve.decode_workers.drafting import DSparkProposer, Observation, Proposer
from cedserve.decode_workers.sequence import DecodeSequence
from cedserve.model.draft_runner import DraftRunner, DraftRunnerConfig
from cedserve.model.dspark import Draft, Drafter
from cedserve.model.network import CEDModel

_MIX = 0x9E37_79B9_7F4A_7C15
_MASK63 = (1 << 63) - 1


def slot_drafting_unavailable(proposer: Proposer, device_type: str, mode: str, runner_on: bool,
                              world_size: int) -> str | None:
    """Why `decode.runner_drafter = mode` keeps `proposer` as it is (None: its pass goes on slots).
    `runner_on`: the model runner takes the target's rows."""
    if mode == "off":
        return "decode.runner_drafter = off"
    if type(proposer) is not DSparkProposer:
        return f"the proposer is a {type(proposer).__name__}, not the DSpark drafter's"
    if world_size > 1:
        return "expert parallelism (the eager drafter runs beside each rank's pass)"
    if mode == "auto" and not runner_on:
        return "the model runner is off (decode.runner)"
    if mode == "auto" and device_type != "cuda":
        return "not a CUDA device (decode.runner_drafter = on runs its pass eagerly)"
    return None


class SlotDSparkProposer(DSparkProposer):
    """The DSpark proposer over a `DraftRunner`'s slots (module docstring)."""

    def __init__(self, drafter: Drafter, model: CEDModel, runner: DraftRunner, num_tokens: int = 0,
                 probe_every: int = 8, verify_all: bool = False, plain_probe_every: int = 16,
                 defer_observes: int = 16) -> None:
        super().__init__(drafter, model, num_tokens, probe_every=probe_every, verify_all=verify_all,
                         plain_probe_every=plain_probe_every, defer_observes=defer_observes)
        self.runner = runner
        self._slot: dict[str, int] = {}  # request id -> slot
        self._free = list(range(runner.config.max_slots - 1, -1, -1))
        self._confidences: dict[int, Tensor | None] = {}  # slot -> its latest draft's confidences (host)
        self._passes: dict[str, int] = {}  # request id -> draft passes so far (a seeded request's stream)

    @staticmethod
    def replacing(eager: DSparkProposer, config: DraftRunnerConfig) -> SlotDSparkProposer:
        """A slot proposer with `eager`'s drafter, draft count and cost-check settings."""
        runner = DraftRunner(eager.drafter, eager.model, config)
        slotted = SlotDSparkProposer(eager.drafter, eager.model, runner, eager.max_tokens, eager.probe_every,
                                     eager.verify_all, eager.plain_probe_every, eager.defer_observes)
        slotted.profile = eager.profile
        return slotted

    @property
    def num_free(self) -> int:
        return len(self._free)

    # ------------------------------------------------------------------ the memory's hooks

    def _at_anchor(self, seq: DecodeSequence) -> bool:
        self._adopt(seq)
        slot = self._slot.get(seq.request_id)
        held = None if slot is None else self.runner.extent(slot)
        return held is not None and held[1] == len(seq.tokens) - 1 and held[1] > held[0]

    def _draft_pass(self, seqs: list[DecodeSequence]) -> list[Draft]:
        seeds: list[int | None] = []
        for seq in seqs:
            passes = self._passes.get(seq.request_id, 0)
            self._passes[seq.request_id] = passes + 1
            seed = seq.params.seed
            # a seeded request draws a fresh stream each pass, the same one on every run
            seeds.append(None if seed is None else (seed * _MIX + passes + 1) & _MASK63)
        slots = [self._slot[seq.request_id] for seq in seqs]
        drafts = self.runner.draft(slots, [seq.anchor for seq in seqs], [seq.params.temperature for seq in seqs],
                                   seeds)
        return [Draft(drafts.tokens[i], drafts.probs[i], drafts.confidences[i]) for i in range(len(seqs))]

    def _last_confidences(self, seq: DecodeSequence) -> Tensor | None:
        slot = self._slot.get(seq.request_id)
        return None if slot is None else self._confidences.get(slot)

    def _remember(self, seq: DecodeSequence, confidences: Tensor) -> None:
        self._confidences[self._slot[seq.request_id]] = confidences

    def _apply(self, observations: Sequence[Observation]) -> None:
        """Each sequence's kept taps into its slot (`DraftRunner.observe`); a sequence without one
        gets a free slot."""
        slots = []
        for o in observations:
            self._adopt(o.seq)
            slots.append(self._slot_for(o.seq))
        self.runner.observe(slots, [o.first_position for o in observations], [o.keep_end for o in observations],
                            [o.taps for o in observations])

    def release(self, seq: DecodeSequence, keep: bool) -> None:
        self._settle(seq, keep)
        slot = self._slot.pop(seq.request_id, None)
        if not keep:
            self._passes.pop(seq.request_id, None)
        if slot is None:
            return
        confidences = self._confidences.pop(slot, None)
        if keep:
            seq.draft = self.runner.export(slot)
            seq.draft.last_confidences = confidences
        self.runner.clear(slot)
        self._free.append(slot)

    # ------------------------------------------------------------------ slots

    def _adopt(self, seq: DecodeSequence) -> None:
        """Move a `DraftState` found in `seq.draft` into the request's slot."""
        state = seq.draft
        if state is None:
            return
        slot = self._slot_for(seq)
        self.runner.load(slot, state)
        self._confidences[slot] = state.last_confidences
        seq.draft = None

    def _slot_for(self, seq: DecodeSequence) -> int:
        slot = self._slot.get(seq.request_id)
        if slot is not None:
            return slot
        if not self._free:
            raise ValueError(f"request {seq.request_id!r}: all {self.runner.config.max_slots} drafter slots are "
                             "held (the draft runner's max_slots must be at least decode.max_running_requests)")
        slot = self._slot[seq.request_id] = self._free.pop()
        self.runner.clear(slot)
        self._confidences[slot] = None
        return slot
