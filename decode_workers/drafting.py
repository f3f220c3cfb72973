"""Where drafts come from: the `Proposer` contract and its DSpark implementation.

A proposer owns each sequence's drafter memory (`DecodeSequence.draft`). The engine, when it is
built, hands it its `StepProfile` (`attach_profile`; a proposer without a cost check ignores it).
Per step the engine asks it for drafts after every running sequence's anchor (`propose`), verifies
them in the target pass, and then shows it the pass's taps (`observe`, or `observe_many` for the
whole batch at once) so it can extend its memory with the kept positions and roll the rejected ones
back. A sequence whose drafter memory is not at its anchor yet (it joined in this step) gets no
drafts. Before it drops a sequence's `seq.draft` (finish, preemption, a fresh prefill) the engine
tells the proposer (`release`).

`DSparkProposer` drafts for the whole batch in one draft pass (`Drafter.draft_batch`), and, given
the engine's `StepProfile` (`attach_profile`, or `profile=` outside an engine), first asks whether
drafting pays for this batch at all: each sequence's confidences from its previous draft predict
what verifying would gain, and `choose_verify_lengths` with the draft pass's measured cost
(`StepProfile.draft_seconds`) added to the step must choose something. When it does not, nobody
drafts; every `probe_every`-th such step drafts anyway, so the prediction follows a changing batch,
and each such probe that is turned down again doubles the interval (up to 8x `probe_every`), so a
drafter that does not pay costs a probe every 64 steps, not every 8. A sequence with no previous
draft makes the step draft.

The check compares passes the engine measured, so it needs both kinds: after `plain_probe_every`
drafting steps in a row it turns one step down (a plain pass over the anchors alone); where drafting
still pays right after such a probe the interval doubles (up to 8x), so a drafter that pays loses one
step in ~130 to them, not one in 17; the interval stays put until whole steps of both kinds are
known (below), else the third plain step, and with it the veto, came after ~110 drafting steps
(gpu-2026-12-07d: 79 of 104 steps drafted at 0.63x of plain). The first three plain probes come
`FIRST_PLAIN_EVERY` (4) drafting steps apart while whole plain steps are unknown at the batch size,
so the veto can act after ~15 steps, not ~50. Without them a batch that always drafts never measures a plain
pass, and the pass-cost line stays at its prior (50 ms fixed: a CPU's figure), against which any
draft pass looks cheap: on an H100 the demo checkpoint drafted every step at 6.4 ms a step for 2.0
tokens where a plain step took 1.3 ms (gpu-2026-12-07c). `probe_every = 1` drafts every step (no
check, no plain probes).

The passes are not all a drafting step costs (the observe of its taps, acceptance, the syncs), so
the check also asks what whole steady steps yielded (`StepProfile.cycle_rates`, fed by the engine
with every steady step, once each kind was seen a few times at this batch size): where drafting steps
yielded less than `VETO_BELOW` (0.8) of the tokens a second of plain ones, it turns drafting down
whatever the passes predict. (With the plain probe alone the H100 run above still drafted nearly
every step: its verify pass measured 0.4 ms above a plain one, the other ~2 ms of the drafting step
in no pass; drafting steps there yield ~0.6 of plain ones. Whole steps deciding alone, or vetoing at
any shortfall, declined most steps on a CPU where drafting paid 1.6x: a step's tokens are noisy and
the confidences there predicted 1.1-1.2 tokens a verification where verification accepted 2.2.)
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from cedserve.decode_workers.profile import MIN_CYCLES, StepProfile
from cedserve.decode_workers.sequence import DecodeSequence
from cedserve.decode_workers.speculative import choose_verify_lengths, expected_tokens
from cedserve.model.dspark import Draft, Drafter, DraftRequest, DraftState
from cedserve.model.network import CEDModel

FIRST_PLAIN_EVERY = 4
"""The proposer's first `MIN_CYCLES` plain probes come this many drafting steps apart (not
`plain_probe_every`) while whole plain steps at the batch size are not yet known: the veto needs them,
and until it can act a drafter that loses keeps losing (one H100, the demo checkpoint, overlap on:
87 of 104 steps drafted at 0.61x of plain, gpu-2026-12-08, the probes 16 steps apart)."""

DEFER_MAX_BYTES = 64 << 20
"""Most bytes of taps the deferred observations hold before they are applied, whatever their step
count: the released model's taps are 0.25 MB a row (3 taps x 4 streams x 5,120 float32), so 16
steps of 256 requests would hold ~1 GB of GPU memory outside every budget."""

VETO_BELOW = 0.8
"""Drafting is turned down where whole drafting steps yielded less than this fraction of the tokens a
second of plain steps at the same batch size (`StepProfile.cycle_rates`), whatever the passes predict."""


@dataclass(frozen=True)
class Observation:
    """One sequence's share of a pass, for `Proposer.observe_many`."""

    seq: DecodeSequence
    first_position: int  # position of the first row of `taps`
    taps: Tensor  # [n, n_taps, hc, hidden]
    keep_end: int  # the new anchor's position: rows at or after it are dropped


class Proposer(Protocol):
    """Drafts for the running batch (see the module docstring)."""

    @property
    def max_tokens(self) -> int:
        """Drafts one call proposes per sequence (K)."""
        ...

    def attach_profile(self, profile: StepProfile, verify_all: bool) -> None:
        """The engine's measured pass and draft-pass costs, which the proposer may read (to decline
        drafting) and add its draft passes to, and whether the engine verifies every draft
        (`DecodeConfig.adaptive_verify` off). Called once by `DecodeEngine.__init__`; a proposer
        without a cost check does nothing."""
        ...

    def propose(self, seqs: Sequence[DecodeSequence]) -> list[Draft | None]:
        """K drafts after each sequence's anchor (None: none this step). Reads the sequences and
        their target state, mutates neither (a proposer may run and roll back the target)."""
        ...

    def observe(self, seq: DecodeSequence, first_position: int, taps: Tensor, keep_end: int) -> None:
        """A pass computed `taps [n, n_taps, hc, hidden]` for positions `first_position ...`; only
        positions before `keep_end` (the new anchor's) stay. Mutates `seq.draft`."""
        ...

    def observe_many(self, observations: Sequence[Observation]) -> None:
        """`observe` for several sequences (each at most once) in one call."""
        ...

    def release(self, seq: DecodeSequence, keep: bool) -> None:
        """The engine is about to drop `seq.draft`: the sequence finished or restarts from a prefill
        (`keep` False), or it is preempted (`keep` True: `seq.draft` must then hold the whole memory,
        which the offloaded sequence carries back). A proposer that keeps drafter memory outside
        `seq.draft` (`cedserve.decode_workers.slot_drafting`) moves it there or frees it here."""
        ...


class DSparkProposer:
    """The checkpoint's DSpark drafter: one batched draft pass per step from the sequences' context
    vectors; with a `profile`, only when drafting pays (module docstring)."""

    def __init__(self, drafter: Drafter, model: CEDModel, num_tokens: int = 0, profile: StepProfile | None = None,
                 probe_every: int = 8, verify_all: bool = False, plain_probe_every: int = 16,
                 defer_observes: int = 16) -> None:
        block = drafter.config.dspark_block_size
        if not 0 <= num_tokens <= block:
            raise ValueError(f"config field `decode.draft_tokens`: must be in [0, {block}], got {num_tokens}")
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        if plain_probe_every < 1:
            raise ValueError(f"plain_probe_every must be >= 1, got {plain_probe_every}")
        if defer_observes < 0:
            raise ValueError(f"defer_observes must be >= 0, got {defer_observes}")
        self.drafter = drafter
        self.model = model
        self.profile = profile
        """The engine's measured costs; None: always draft (and measure nothing)."""
        self.probe_every = probe_every
        self.plain_probe_every = plain_probe_every
        """Drafting steps in a row after which one step is turned down to measure a plain pass."""
        self._probe_interval = probe_every  # declined steps before a drafting probe (backs off)
        self._probing = False  # the last drafting step was a probe after declines
        self._drafted_run = 0  # drafting steps in a row since the last plain pass
        self._plain_interval = plain_probe_every  # drafting steps before a plain probe (backs off)
        self._plain_probed = False  # the last step was a plain probe
        self.plain_probes = 0
        """Steps turned down only to measure a plain pass (cumulative)."""
        self.defer_observes = defer_observes
        """While the check declines, plain steps' observations wait and are applied together, up to this
        many steps (and `DEFER_MAX_BYTES` of taps) at a time, or at once before a draft pass (0: every
        step's at once)."""
        self._deferred: list[list[Observation]] = []  # declined steps' observations, oldest first
        self.verify_all = verify_all
        """The engine verifies every draft (`DecodeConfig.adaptive_verify` off): the check then weighs
        verifying all against none."""
        self._k = num_tokens or block
        self._declined = 0  # steps in a row the cost check turned drafting down
        self.declined_steps = 0
        """Steps whose drafting the cost check turned down (cumulative)."""

    @property
    def max_tokens(self) -> int:
        return self._k

    def attach_profile(self, profile: StepProfile, verify_all: bool) -> None:
        self.profile = profile
        self.verify_all = verify_all

    def propose(self, seqs: Sequence[DecodeSequence]) -> list[Draft | None]:
        deferred = self._deferred_ends()
        ready = [i for i, seq in enumerate(seqs)
                 if deferred.get(seq.request_id) == len(seq.tokens) - 1 or self._at_anchor(seq)]
        out: list[Draft | None] = [None] * len(seqs)
        if not ready or not self._worth_drafting(seqs, ready):
            return out
        start = time.perf_counter()
        self._flush()  # the memories reach their anchors before the draft pass reads them
        drafts = self._draft_pass([seqs[i] for i in ready])
        k = self._k
        confidences = torch.stack([d.confidences[:k] for d in drafts]).cpu()  # [ready, K]
        if self.profile is not None:
            self.profile.record_draft(len(ready), time.perf_counter() - start)
        for row, (i, draft) in enumerate(zip(ready, drafts)):
            self._remember(seqs[i], confidences[row])
            # the host copy: what reads a draft's confidences (verify lengths, calibration) reads them
            # on the host, so that copy is made once, here
            out[i] = Draft(draft.tokens[:k], draft.probs[:k], confidences[row])
        return out

    # The drafter memory's hooks: here it lives in `seq.draft`; `SlotDSparkProposer` keeps it in slots.

    def _at_anchor(self, seq: DecodeSequence) -> bool:
        """The drafter memory ends at the anchor (the last token), with at least one vector."""
        state = seq.draft
        return state is not None and state.end_position == len(seq.tokens) - 1 and state.vectors.shape[0] > 0

    def _draft_pass(self, seqs: list[DecodeSequence]) -> list[Draft]:
        """One draft pass (every sequence at its anchor): block-size drafts each."""
        requests = [DraftRequest(seq.anchor, _draft_state(seq), seq.params.temperature, seq.generator)
                    for seq in seqs]
        return self.drafter.draft_batch(requests, self.model.embed, self.model.lm_head)

    def _last_confidences(self, seq: DecodeSequence) -> Tensor | None:
        """float32 `[K]` on the host: the confidences of the sequence's latest draft (None: none yet,
        or no memory yet: its first rows may still wait among the deferred observations)."""
        return None if seq.draft is None else seq.draft.last_confidences

    def _remember(self, seq: DecodeSequence, confidences: Tensor) -> None:
        _draft_state(seq).last_confidences = confidences

    def release(self, seq: DecodeSequence, keep: bool) -> None:
        self._settle(seq, keep)  # otherwise the memory is `seq.draft` itself

    def _settle(self, seq: DecodeSequence, keep: bool) -> None:
        """Before `seq`'s memory leaves: its deferred rows applied (`keep`: it must hold them all)
        or dropped."""
        if keep:
            self._flush(only=seq)
        else:
            self._drop_deferred(seq)

    def _worth_drafting(self, seqs: Sequence[DecodeSequence], ready: list[int]) -> bool:
        """Whether the expected gain of verifying pays for the draft pass plus the verified rows."""
        profile = self.profile
        if profile is None or self.probe_every == 1:
            return True
        if self._drafted_run >= self._plain_interval or (
                self._drafted_run >= FIRST_PLAIN_EVERY and self.plain_probes < MIN_CYCLES
                and profile.cycle_rates(len(seqs)) is None):
            self._drafted_run = 0
            self._plain_probed = True
            self.plain_probes += 1
            return False
        probed, self._plain_probed = self._plain_probed, False
        history = [self._last_confidences(seqs[i]) for i in ready]
        if any(c is None for c in history):
            return self._draft()
        if self._declined + 1 >= self._probe_interval:
            self._declined = 0
            self._probing = True
            return self._draft()
        measured = profile.cycle_rates(len(seqs))
        # whole drafting steps yielded clearly fewer tokens a second than plain ones: a veto, whatever
        # the passes predict (checked first: a vetoed step skips the prediction's host work)
        pays = not (measured is not None and measured[0] < VETO_BELOW * measured[1])
        if pays:
            pays = self._passes_pay(seqs, ready, history, profile)
        if pays:
            self._declined = 0
            self._probe_interval = self.probe_every
            if probed and measured is not None:
                # drafting still pays with a fresh plain pass, and whole steps of both kinds are known
                # (the veto can act): measure plain steps less often
                self._plain_interval = min(2 * self._plain_interval, 8 * self.plain_probe_every)
            return self._draft()
        self._plain_interval = self.plain_probe_every
        if self._probing:  # a probe, and drafting still does not pay: probe less often
            self._probe_interval = min(2 * self._probe_interval, 8 * self.probe_every)
        self._probing = False
        self._drafted_run = 0
        self._declined += 1
        self.declined_steps += 1
        return False

    def _passes_pay(self, seqs: Sequence[DecodeSequence], ready: list[int], history: list[Tensor | None],
                    profile: StepProfile) -> bool:
        """Whether the measured passes predict a gain: `ready`'s calibrated confidences against the
        draft pass plus the verified rows (module docstring)."""
        predicted, caps = self._prediction(seqs, ready, history, profile)
        rows = sum(len(s.pending) for s in seqs)  # anchors and carries
        if self.verify_all:
            draft_s = profile.draft_seconds(len(ready))
            tokens = float(expected_tokens(predicted, caps).sum())
            return tokens / (profile.seconds(rows + int(caps.sum())) + draft_s) > len(seqs) / profile.seconds(rows)
        lengths = choose_verify_lengths(predicted, lambda n: profile.steps_per_s_many(n - len(seqs) + rows), caps,
                                        draft_s=profile.draft_seconds(len(ready)))
        return int(lengths.sum()) > 0

    def _prediction(self, seqs: Sequence[DecodeSequence], ready: list[int], history: list[Tensor | None],
                    profile: StepProfile) -> tuple[Tensor, Tensor]:
        """`(predicted [batch, K], caps [batch])`: each ready sequence's calibrated confidences of its
        last draft (zero past its length) and its draft cap; the others take part with no drafts."""
        # [batch, K]: the sequences that cannot draft take part with no drafts (one token each). One
        # `calibrated` call for the batch (a call per sequence cost ~1 ms of host a step at batch 32):
        # it works along K by prefix, so a shorter history's zero padding leaves its own values alone.
        k = self._k
        known = np.zeros((len(ready), k), dtype=np.float32)
        known_lengths = np.zeros(len(ready), dtype=np.int64)
        for row, confidences in enumerate(history):
            assert confidences is not None
            values = confidences[:k].float().cpu().numpy()
            known[row, : values.shape[0]] = values
            known_lengths[row] = values.shape[0]
        calibrated = profile.survival.calibrated(torch.from_numpy(known)).numpy()
        calibrated[np.arange(k)[None, :] >= known_lengths[:, None]] = 0.0
        predicted_np = np.zeros((len(seqs), k), dtype=np.float32)
        predicted_np[ready] = calibrated
        caps_np = np.zeros(len(seqs), dtype=np.int64)
        caps_np[ready] = np.minimum([seqs[i].max_drafts for i in ready], known_lengths)
        return torch.from_numpy(predicted_np), torch.from_numpy(caps_np)

    def _draft(self) -> bool:
        self._drafted_run += 1
        return True

    def plain_steps_ahead(self) -> int:
        """After a step this check declined: how many steps after it the check declines as well while
        nothing new is measured and no one joins (until its next drafting probe). The engine runs those
        overlapped (`decode.overlap`), measuring nothing, and counts them with `take_plain_steps`.
        0 after a drafting step, a plain probe, or without a cost check."""
        if self.profile is None or self.probe_every == 1 or self._declined == 0 or self._drafted_run:
            return 0
        return max(0, self._probe_interval - self._declined - 1)

    def take_plain_steps(self, n: int) -> None:
        """`n` steps declined without asking the check (`plain_steps_ahead` promised them)."""
        self._declined += n
        self.declined_steps += n

    def observe(self, seq: DecodeSequence, first_position: int, taps: Tensor, keep_end: int) -> None:
        self.observe_many([Observation(seq, first_position, taps, keep_end)])

    def observe_many(self, observations: Sequence[Observation]) -> None:
        """`_apply` the observations, or, where the check declined this step and every observation is
        one plain row, keep them for later (`defer_observes`): a declined step's observe cost a plain
        step ~0.6 ms of host time on an H100 (the drafter's context vectors and the memory write, ~12
        launches; gpu-2026-12-07d), and a batch the check keeps declining drafts only at its probes.
        Deferred rows are applied together (one call for up to `defer_observes` steps), before any
        draft pass, and before a sequence's memory leaves (`release`)."""
        if not observations:
            return
        if (self.defer_observes and self.profile is not None and self._declined > 0
                and all(o.taps.shape[0] == 1 and o.keep_end == o.first_position + 1 for o in observations)):
            self._deferred.append(list(observations))
            held = sum(o.taps.numel() * o.taps.element_size() for step in self._deferred for o in step)
            if len(self._deferred) >= self.defer_observes or held >= DEFER_MAX_BYTES:
                self._flush()
            return
        self._flush()
        self._apply(observations)

    def _deferred_ends(self) -> dict[str, int]:
        """Each sequence with deferred rows: where its memory will end once they are applied."""
        ends: dict[str, int] = {}
        for step in self._deferred:
            for o in step:
                ends[o.seq.request_id] = o.keep_end
        return ends

    def _flush(self, only: DecodeSequence | None = None) -> None:
        """Apply the deferred rows (of `only`, or of every sequence) as one observation per sequence
        (its consecutive rows joined), in one `_apply` call."""
        if not self._deferred:
            return
        runs: dict[str, list[Observation]] = {}
        kept: list[list[Observation]] = []
        for step in self._deferred:
            rest = []
            for o in step:
                if only is None or o.seq is only:
                    runs.setdefault(o.seq.request_id, []).append(o)
                else:
                    rest.append(o)
            if rest:
                kept.append(rest)
        self._deferred = kept
        joined = []
        for rows in runs.values():
            first = rows[0]
            for a, b in itertools.pairwise(rows):  # each step's row follows the last: one contiguous run
                assert b.first_position == a.keep_end, "deferred observations of a sequence are not consecutive"
            joined.append(Observation(first.seq, first.first_position, torch.cat([o.taps for o in rows]),
                                      rows[-1].keep_end))
        self._apply(joined)

    def _drop_deferred(self, seq: DecodeSequence) -> None:
        self._deferred = [kept for kept in ([o for o in step if o.seq is not seq] for step in self._deferred) if kept]

    # The drafter's weights require grad: without no_grad each step's vectors would keep an autograd
    # graph chaining every earlier step's taps alive.
    @torch.no_grad()
    def _apply(self, observations: Sequence[Observation]) -> None:
        """Context vectors of every sequence's taps in one `context_vectors` call, then each
        sequence's memory rolled back to `first_position`, extended and cut at `keep_end`."""
        if not observations:
            return
        vectors = self.drafter.context_vectors(torch.cat([o.taps for o in observations]))  # [sum n, hidden]
        rows = torch.split(vectors, [o.taps.shape[0] for o in observations])
        for o, new in zip(observations, rows):
            state = o.seq.draft
            if (state is None or state.end_position < o.first_position
                    or state.end_position - o.first_position > state.rollback):
                state = DraftState.new(self.drafter.config, o.taps.device)
                state.end_position = o.first_position
            else:
                state.truncate(o.first_position)
            state.extend(new)
            state.truncate(o.keep_end)
            o.seq.draft = state


def _draft_state(seq: DecodeSequence) -> DraftState:
    assert seq.draft is not None
    return seq.draft
