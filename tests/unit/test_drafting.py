"""DSparkProposer: the batched draft pass and batched observe equal the per-sequence path, and the
cost check turns drafting down for a batch where it cannot pay (draft pass included)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from decode_support import Rig, greedy_rounds, greedy_ties, prompt, tiny

from cedserve.decode_workers.drafting import DSparkProposer, Observation
from cedserve.decode_workers.messages import Finished
from cedserve.decode_workers.profile import StepProfile
from cedserve.decode_workers.sequence import DecodeSequence, JoinKind, Lease
from cedserve.decode_workers.slot_drafting import SlotDSparkProposer
from cedserve.model.draft_runner import DraftRunner, DraftRunnerConfig
from cedserve.model.dspark import Draft, Drafter, DraftState
from cedserve.model.network import CEDModel
from cedserve.model.sampling import SamplingParams, make_generator


def _taps(model: CEDModel, n: int, gen: torch.Generator) -> torch.Tensor:
    c = model.config
    return torch.randn(n, len(c.dspark_target_layer_ids), c.hc_mult, c.hidden_size, generator=gen)


def _sequence(model: CEDModel, rid: str, num_tokens: int, temperature: float, seed: int) -> DecodeSequence:
    tokens = torch.randint(3, 500, (num_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    params = SamplingParams(temperature=temperature, seed=seed)
    lease = Lease(f"l-{rid}", rid, [], 0, float("inf"), False, num_tokens)
    seq = DecodeSequence(rid, lease, tokens, num_tokens, params, make_generator(params), frozenset(), (),
                         JoinKind.SHIPPED, 0, 0, max_drafts=model.config.dspark_block_size)
    seq.state = model.new_state()
    seq.state.position = num_tokens - 1  # the anchor is pending
    return seq


def _batch(model: CEDModel, drafter: Drafter, proposer: DSparkProposer, temps: list[float]) -> list[DecodeSequence]:
    """Sequences whose drafter memories were filled by `observe` (history lengths differ)."""
    gen = torch.Generator().manual_seed(len(temps))
    seqs = []
    for i, t in enumerate(temps):
        n = 3 + 7 * i
        seq = _sequence(model, f"r{i}", n, t, seed=40 + i)
        proposer.observe(seq, 0, _taps(model, n - 1, gen), n - 1)
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("temps", [[0.0, 0.0, 0.0, 0.0], [0.8, 0.0, 1.2, 1.0]], ids=["greedy", "mixed"])
def test_propose_equals_drafting_each_sequence_alone(temps: list[float]) -> None:
    model, drafter = tiny()
    proposer = DSparkProposer(drafter, model, num_tokens=4)
    seqs = _batch(model, drafter, proposer, temps)
    late = _sequence(model, "late", 6, 0.0, seed=9)  # no drafter memory yet: no drafts
    expected = []
    for seq, t in zip(seqs, temps):
        alone = make_generator(seq.params)
        expected.append(drafter.draft(seq.anchor, seq.draft, model.embed, model.lm_head, t, alone))  # type: ignore[arg-type]
    drafts = proposer.propose([*seqs[:2], late, *seqs[2:]])
    assert drafts[2] is None
    for want, got in zip(expected, [d for d in drafts if d is not None]):
        assert got.tokens == want.tokens[:4]
        torch.testing.assert_close(got.probs, want.probs[:4], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.confidences, want.confidences[:4], atol=1e-6, rtol=1e-5)


def test_observe_many_equals_observe_each() -> None:
    model, drafter = tiny()
    proposer = DSparkProposer(drafter, model)
    gen = torch.Generator().manual_seed(3)
    one, many = _batch(model, drafter, proposer, [0.0] * 3), _batch(model, drafter, proposer, [0.0] * 3)
    # The next pass: a carry + verify chunk per sequence, some drafts rejected (keep_end short),
    # and one sequence whose memory is too far behind (rebuilt from this pass alone).
    passes = [(s.draft.end_position, 6, s.draft.end_position + 3) for s in one]  # type: ignore[union-attr]
    passes[2] = (passes[2][0] + 20, 6, passes[2][0] + 25)
    taps = [_taps(model, n, gen) for _, n, _ in passes]
    for seq, (first, _, keep), t in zip(one, passes, taps):
        proposer.observe(seq, first, t, keep)
    proposer.observe_many([Observation(seq, first, t, keep) for seq, (first, _, keep), t in zip(many, passes, taps)])
    for a, b in zip(one, many):
        assert a.draft is not None and b.draft is not None
        assert (a.draft.end_position, a.draft.vectors.shape) == (b.draft.end_position, b.draft.vectors.shape)
        torch.testing.assert_close(b.draft.vectors, a.draft.vectors, atol=1e-5, rtol=1e-5)
    assert one[2].draft is not None and one[2].draft.vectors.shape[0] == 5  # rebuilt: only this pass's kept rows
    proposer.observe_many([])


def _profile(draft_s: float | None) -> StepProfile:
    """A pass costs 50 ms + 1 ms per row; a draft pass `draft_s` (measured), or nothing measured."""
    profile = StepProfile(0.05, 0.001)
    for _ in range(8 if draft_s is not None else 0):
        profile.record_draft(4, draft_s or 0.0)
    return profile


@pytest.mark.parametrize("verify_all", [False, True])
def test_drafting_is_turned_down_where_the_draft_pass_cannot_pay(verify_all: bool) -> None:
    model, drafter = tiny()
    costly = DSparkProposer(drafter, model, profile=_profile(draft_s=1.0), probe_every=3, verify_all=verify_all)
    seqs = _batch(model, drafter, costly, [0.0] * 4)
    assert all(d is not None for d in costly.propose(seqs))  # no history yet: draft to learn the confidences
    for seq in seqs:
        assert seq.draft is not None and seq.draft.last_confidences is not None
        seq.draft.last_confidences = torch.full((5,), 0.9)  # a good drafter: 4.1 tokens per verify
    # 4 x 4.1 tokens in 0.05 + 24 rows x 1 ms + 1 s draft, against 4 tokens in 0.054 s: it cannot pay.
    assert costly.propose(seqs) == [None] * 4 and costly.declined_steps == 1
    assert costly.propose(seqs) == [None] * 4 and costly.declined_steps == 2
    assert all(d is not None for d in costly.propose(seqs))  # every probe_every-th step drafts anyway

    cheap = DSparkProposer(drafter, model, profile=_profile(draft_s=0.002), verify_all=verify_all)
    seqs = _batch(model, drafter, cheap, [0.0] * 4)
    cheap.propose(seqs)
    for seq in seqs:
        assert seq.draft is not None
        seq.draft.last_confidences = torch.full((5,), 0.9)
    assert all(d is not None for d in cheap.propose(seqs)) and cheap.declined_steps == 0
    for seq in seqs:
        assert seq.draft is not None
        seq.draft.last_confidences = torch.full((5,), 0.01)  # drafts that never survive: not worth rows
    assert cheap.propose(seqs) == [None] * 4 and cheap.declined_steps == 1


def test_draft_pass_is_measured_into_the_profile() -> None:
    model, drafter = tiny()
    profile = StepProfile(0.05, 0.001)
    proposer = DSparkProposer(drafter, model, profile=profile)
    assert profile.draft_seconds(3) == 0.0
    proposer.propose(_batch(model, drafter, proposer, [0.0] * 3))
    assert profile.draft_seconds(3) > 0.0 and profile.draft_line()[1] == 0.0  # one size seen: flat


def test_bad_settings_name_the_field() -> None:
    model, drafter = tiny()
    with pytest.raises(ValueError, match="draft_tokens"):
        DSparkProposer(drafter, model, num_tokens=9)
    with pytest.raises(ValueError, match="probe_every"):
        DSparkProposer(drafter, model, probe_every=0)
    state = DraftState.new(model.config)
    assert state.last_confidences is None


def test_engine_with_the_cost_check_declines_and_stays_lossless() -> None:
    model, drafter = tiny()
    proposer = DSparkProposer(drafter, model)
    rig = Rig(model, drafter, proposer=proposer, dspark=True)  # the engine attaches its profile
    for _ in range(8):
        rig.engine.profile.record_draft(2, 10.0)  # a draft pass that no acceptance can pay for
    prompts = [prompt(37, 1), prompt(21, 2)]
    got = greedy_rounds(rig, prompts, 12)
    assert proposer.declined_steps > 0

    def decisions(label: str) -> float:
        return rig.engine.metrics.registry.get_sample_value("cedserve_decode_draft_decisions_total",
                                                            {"decision": label}) or 0.0

    # every declined step on the metric; the steps that drafted (no history yet, the probes) too
    assert decisions("declined") == proposer.declined_steps
    assert decisions("drafted") >= 1 and decisions("plain_probe") == proposer.plain_probes == 0
    # the engine measured whole steady steps of both kinds (the check's second opinion)
    assert any(key[1] for key in rig.engine.profile._cycles) and any(not key[1] for key in rig.engine.profile._cycles)
    # Tokens as without drafting, up to numerical ties (tests/unit/test_decode_engine.py)
    assert sum(len(greedy_ties(model, p, out)) for p, out in zip(prompts, got.values())) <= 1
    for rid in got:
        done = rig.finished(rid)
        assert isinstance(done, Finished) and done.output_tokens == 12
    rig.assert_all_free()


class _Forwarding:
    """A proposer that wraps another, as `benchmarks/demo_eval.py`'s `TimedProposer` does: not a
    `DSparkProposer`, so only the `Proposer` contract can reach the one inside."""

    def __init__(self, inner: DSparkProposer) -> None:
        self.inner = inner

    @property
    def max_tokens(self) -> int:
        return self.inner.max_tokens

    def attach_profile(self, profile: StepProfile, verify_all: bool) -> None:
        self.inner.attach_profile(profile, verify_all)

    def propose(self, seqs: Sequence[DecodeSequence]) -> list[Draft | None]:
        return self.inner.propose(seqs)

    def observe(self, seq: DecodeSequence, first_position: int, taps: torch.Tensor, keep_end: int) -> None:
        self.inner.observe(seq, first_position, taps, keep_end)

    def observe_many(self, observations: Sequence[Observation]) -> None:
        self.inner.observe_many(observations)

    def release(self, seq: DecodeSequence, keep: bool) -> None:
        self.inner.release(seq, keep)


@pytest.mark.parametrize("wrapped", [False, True])
@pytest.mark.parametrize("adaptive_verify", [True, False])
def test_engine_hands_its_profile_to_the_proposer(adaptive_verify: bool, wrapped: bool) -> None:
    """`DecodeEngine.__init__` attaches its `StepProfile` through the `Proposer` contract (to any
    proposer, a wrapper included); the proposer's timed draft passes then land in the engine's profile."""
    model, drafter = tiny()
    proposer = DSparkProposer(drafter, model)
    assert proposer.profile is None
    rig = Rig(model, drafter, proposer=_Forwarding(proposer) if wrapped else proposer, dspark=True,
              adaptive_verify=adaptive_verify)
    assert proposer.profile is rig.engine.profile
    assert proposer.verify_all is (not adaptive_verify)
    assert rig.engine.profile.draft_seconds(2) == 0.0
    greedy_rounds(rig, [prompt(19, 3), prompt(23, 4)], 3)
    assert rig.engine.profile.draft_seconds(2) > 0.0


def _run_steps(proposer: DSparkProposer, seqs: list[DecodeSequence], steps: int, plain_s: float, verify_s: float,
               confidence: float, step_tokens: float | None = None) -> list[bool]:
    """`steps` engine steps as the proposer sees them: each drafting step's pass over 1 + K rows per
    sequence costs `verify_s`, a plain pass over the anchors `plain_s` (recorded as the engine does),
    and every draft's confidences are `confidence`. `step_tokens`: each drafting step is also recorded
    as a whole steady step of that many tokens per sequence (a plain one, one each), as the engine
    records them. Returns whether each step drafted."""
    profile = proposer.profile
    assert profile is not None
    drafted = []
    for _ in range(steps):
        drafts = proposer.propose(seqs)
        did = any(d is not None for d in drafts)
        drafted.append(did)
        if did:
            profile.record_pass(len(seqs) * (1 + proposer.max_tokens), verify_s)
            for seq in seqs:
                assert seq.draft is not None
                seq.draft.last_confidences = torch.full((proposer.max_tokens,), confidence)
        else:
            profile.record_pass(len(seqs), plain_s)
        if step_tokens is not None:
            tokens = round(step_tokens * len(seqs)) if did else len(seqs)
            profile.record_cycle(len(seqs), verify_s if did else plain_s, tokens, drafted=did)
    return drafted


def test_a_batch_that_always_drafts_measures_a_plain_pass_and_then_stops_drafting() -> None:
    """The GPU case (gpu-2026-12-07c): a verify pass costs several plain ones, but a batch that drafts
    every step never measured a plain pass, so against the prior (50 ms a pass) drafting always
    looked worth it. The plain probe measures one; the check then turns drafting down, and its own
    probes back off while drafting keeps not paying."""
    model, drafter = tiny()
    proposer = DSparkProposer(drafter, model, profile=StepProfile(0.05, 0.002), plain_probe_every=16)
    seqs = _batch(model, drafter, proposer, [0.0])
    # ~2 tokens per verification (c = 0.5) for a 10 ms pass, against 1 token per 1 ms plain pass
    drafted = _run_steps(proposer, seqs, 120, plain_s=1e-3, verify_s=1e-2, confidence=0.5)
    # the first plain probe after four drafting steps (`FIRST_PLAIN_EVERY`: no whole steps known yet)
    assert all(drafted[:4]) and not drafted[4] and proposer.plain_probes >= 1
    later = drafted[20:]
    assert sum(later) <= 4, f"drafted {sum(later)} of the last {len(later)} steps"  # probes 8, 16, 32, 64 apart
    assert proposer.declined_steps >= len(later) - sum(later) - proposer.plain_probes


@pytest.mark.parametrize("whole_steps", [True, False], ids=["whole-steps-recorded", "passes-only"])
def test_drafting_that_pays_keeps_drafting_with_a_plain_probe_now_and_then(whole_steps: bool) -> None:
    """The first three plain probes every 4 drafting steps while whole steps are unknown (the veto needs
    three of each kind), then every 16 until they are known, then further apart while drafting keeps
    paying (32, then 64 drafting steps)."""
    model, drafter = tiny()
    proposer = DSparkProposer(drafter, model, profile=StepProfile(0.05, 0.002), plain_probe_every=16)
    seqs = _batch(model, drafter, proposer, [0.0])
    # ~4.4 tokens per verification (c = 0.9) for 1.2 ms, against 1 token per 1 ms; drafting costs
    # this CPU's real draft pass, which the check also weighs: give it room
    drafted = _run_steps(proposer, seqs, 100, plain_s=1e-3, verify_s=1.2e-3, confidence=0.9,
                         step_tokens=4.0 if whole_steps else None)
    if proposer.profile is not None and proposer.profile.draft_seconds(1) > 3e-3:
        pytest.skip("this machine's draft pass alone costs more than the plain passes drafting saves")
    probes = [i + 1 for i, d in enumerate(drafted) if not d]
    if whole_steps:  # the third plain step (15) made them known: the next probe 32 drafting steps later
        assert probes == [5, 10, 15, 48] and proposer.plain_probes == 4
    else:  # never known: no back-off (the veto could never catch a loss the passes miss)
        assert probes == [5, 10, 15, 32, 49, 66, 83, 100] and proposer.plain_probes == 8
    assert proposer.declined_steps == 0


def test_whole_steps_that_yield_clearly_less_turn_drafting_down_whatever_the_passes_predict() -> None:
    """The passes leave out part of what a drafting step costs (observe, acceptance, syncs): on an H100
    the verify pass measured 0.4 ms above a plain one while the drafting step took 6.1 ms against 1.7.
    Whole steady steps measured per kind (`StepProfile.cycle_rates`) veto drafting that clearly loses
    (below `VETO_BELOW` of the plain rate), and only that: a step's tokens are noisy."""
    model, drafter = tiny()
    profile = StepProfile(0.05, 0.002)
    proposer = DSparkProposer(drafter, model, profile=profile)
    seqs = _batch(model, drafter, proposer, [0.0])
    assert all(d is not None for d in proposer.propose(seqs))  # no history: drafts
    for rows, seconds in ((1, 1.6e-3), (6, 1.7e-3)):  # the passes: a verify barely above a plain pass
        for _ in range(8):
            profile.record_pass(rows, seconds)
    for _ in range(400):  # a 0.1 ms draft pass (this CPU's real one, measured above, weighs 1/401)
        profile.record_draft(1, 1e-4)

    def predicted() -> list[DecodeSequence]:  # ~2 tokens a verification (each draft remembers its own)
        for seq in seqs:
            assert seq.draft is not None
            seq.draft.last_confidences = torch.full((proposer.max_tokens,), 0.5)
        return seqs

    assert all(d is not None for d in proposer.propose(predicted()))  # the passes alone: drafting pays
    for _ in range(2):
        profile.record_cycle(1, 6.1e-3, 2, drafted=True)  # what whole steps measured
        profile.record_cycle(1, 1.7e-3, 1, drafted=False)
    assert profile.cycle_rates(1) is None  # fewer than MIN_CYCLES of each kind: no veto yet
    assert all(d is not None for d in proposer.propose(predicted()))
    profile.record_cycle(1, 6.1e-3, 2, drafted=True)
    profile.record_cycle(1, 1.7e-3, 1, drafted=False)
    assert profile.cycle_rates(1) == pytest.approx((2 / 6.1e-3, 1 / 1.7e-3))  # 0.56 of plain
    assert proposer.propose(predicted()) == [None] and proposer.declined_steps == 1
    for _ in range(30):  # drafting steps now yield 0.9 of plain: noise, not a clear loss; no veto
        profile.record_cycle(1, 3.78e-3, 2, drafted=True)
    assert all(d is not None for d in proposer.propose(predicted()))


def test_a_kind_not_seen_for_a_while_starts_its_average_afresh() -> None:
    """After a veto, drafting steps come only as probes, far apart: the drafting average starts again
    from the first one after `STALE_CYCLES` steady steps, so one noisy spell does not keep drafting
    vetoed until many probes have outweighed it. Within that many steps, the average moves by
    `CYCLE_EMA` a step as before."""
    from cedserve.decode_workers.profile import CYCLE_EMA, MIN_CYCLES, STALE_CYCLES

    profile = StepProfile(0.05, 0.002)
    for _ in range(MIN_CYCLES):  # a noisy spell: drafting steps at a third of their usual rate
        profile.record_cycle(1, 6e-3, 2, drafted=True)
        profile.record_cycle(1, 1e-3, 1, drafted=False)
    rates = profile.cycle_rates(1)
    assert rates is not None and rates[0] < 0.8 * rates[1]  # vetoed
    profile.record_cycle(1, 2e-3, 2, drafted=True)  # a prompt fast one: one EMA step, still vetoed
    rates = profile.cycle_rates(1)
    assert rates is not None and rates[0] == pytest.approx(2 / ((1 - CYCLE_EMA) * 6e-3 + CYCLE_EMA * 2e-3))
    for _ in range(STALE_CYCLES + 1):  # declined steps: plain only
        profile.record_cycle(1, 1e-3, 1, drafted=False)
    profile.record_cycle(1, 2e-3, 2, drafted=True)  # the next probe, on a quiet machine
    rates = profile.cycle_rates(1)
    assert rates == pytest.approx((2 / 2e-3, 1 / 1e-3))  # drafting pays again: no veto
    assert profile._cycles[(1, True)][2] == MIN_CYCLES + 2  # the count goes on


def _plain_step(proposer: DSparkProposer, seqs: list[DecodeSequence], rows: list[torch.Tensor]) -> None:
    """A plain pass as the engine shows it: each sequence's anchor row, one new token each."""
    observations = []
    for seq, row in zip(seqs, rows):
        anchor = len(seq.tokens) - 1
        seq.tokens.append(7)
        observations.append(Observation(seq, anchor, row, anchor + 1))
    proposer.observe_many(observations)


def _memory(proposer: DSparkProposer, seq: DecodeSequence) -> tuple[int, torch.Tensor]:
    """(end position, vectors) of `seq`'s drafter memory, wherever the proposer keeps it."""
    if isinstance(proposer, SlotDSparkProposer):
        slot = proposer._slot[seq.request_id]
        _, end = proposer.runner.extent(slot) or (0, 0)
        return end, proposer.runner.export(slot).vectors
    assert seq.draft is not None
    return seq.draft.end_position, seq.draft.vectors


@pytest.mark.parametrize("slots", [False, True], ids=["eager", "slots"])
def test_declined_steps_defer_their_observes_until_a_draft_pass(slots: bool) -> None:
    """While the check declines, a plain step's observe waits (the drafter's context vectors cost a
    declined step ~0.6 ms of host on an H100); the probe's draft pass first applies every waiting row,
    and the memories are those of observing each step at once (to float rounding: one context-vector
    GEMM over three rows instead of three over one)."""
    model, drafter = tiny()

    def proposer(defer: int) -> DSparkProposer:
        if not slots:
            return DSparkProposer(drafter, model, profile=_profile(draft_s=1.0), probe_every=4, defer_observes=defer)
        runner = DraftRunner(drafter, model, DraftRunnerConfig(4))
        slotted = SlotDSparkProposer(drafter, model, runner, probe_every=4, defer_observes=defer)
        slotted.attach_profile(_profile(draft_s=1.0), verify_all=False)
        return slotted

    lazy, eager = proposer(16), proposer(0)
    seqs = {p: _batch(model, drafter, p, [0.0, 0.0]) for p in (lazy, eager)}
    gen = torch.Generator().manual_seed(5)
    for p in (lazy, eager):
        assert all(d is not None for d in p.propose(seqs[p]))  # no history: drafts
        for seq in seqs[p]:
            p._remember(seq, torch.full((5,), 0.9))
    for _ in range(3):  # three declined steps
        rows = [_taps(model, 1, gen) for _ in range(2)]
        for p in (lazy, eager):
            assert p.propose(seqs[p]) == [None, None]
            _plain_step(p, seqs[p], rows)
    assert len(lazy._deferred) == 3 and not eager._deferred
    for a, b in zip(seqs[lazy], seqs[eager]):
        assert _memory(lazy, a)[0] == _memory(eager, b)[0] - 3  # the lazy memory waits 3 rows behind
    assert all(d is not None for d in lazy.propose(seqs[lazy]))  # the probe: applied, then drafted
    assert not lazy._deferred
    for a, b in zip(seqs[lazy], seqs[eager]):
        end_a, vectors_a = _memory(lazy, a)
        end_b, vectors_b = _memory(eager, b)
        assert end_a == end_b == len(a.tokens) - 1
        torch.testing.assert_close(vectors_a, vectors_b, atol=1e-5, rtol=0)  # normed vectors, O(1)



def test_deferred_rows_are_applied_every_few_steps_and_settled_on_release() -> None:
    """At most `defer_observes` steps wait; a preempted sequence (`release(keep=True)`) carries its
    rows applied, a finished one drops them; a step with a multi-row observation (a verify pass)
    applies everything first."""
    model, drafter = tiny()
    proposer = DSparkProposer(drafter, model, profile=_profile(draft_s=1.0), probe_every=64, defer_observes=2)
    seqs = _batch(model, drafter, proposer, [0.0, 0.0, 0.0])
    proposer.propose(seqs)
    for seq in seqs:
        proposer._remember(seq, torch.full((5,), 0.9))
    gen = torch.Generator().manual_seed(3)

    def declined_step() -> None:
        assert proposer.propose(seqs) == [None] * 3
        _plain_step(proposer, seqs, [_taps(model, 1, gen) for _ in seqs])

    declined_step()
    assert len(proposer._deferred) == 1
    declined_step()  # the second waiting step: both applied
    assert not proposer._deferred and all(_memory(proposer, s)[0] == len(s.tokens) - 1 for s in seqs)
    declined_step()
    kept, done = seqs[0], seqs[1]
    proposer.release(kept, keep=True)  # preempted: its memory must hold every row
    assert _memory(proposer, kept)[0] == len(kept.tokens) - 1
    proposer.release(done, keep=False)  # finished: its rows are dropped
    assert [o.seq for step in proposer._deferred for o in step] == [seqs[2]]
    anchor = len(seqs[2].tokens) - 1
    seqs[2].tokens += [7, 7]  # a verify pass: two rows kept
    proposer.observe_many([Observation(seqs[2], anchor, _taps(model, 2, gen), anchor + 2)])
    assert not proposer._deferred and _memory(proposer, seqs[2])[0] == len(seqs[2].tokens) - 1
    with pytest.raises(ValueError, match="defer_observes"):
        DSparkProposer(drafter, model, defer_observes=-1)


@pytest.mark.parametrize("slots", [False, True], ids=["eager", "slots"])
def test_a_new_sequence_whose_first_rows_wait_drafts_at_its_next_step(slots: bool) -> None:
    """A request joining while the check declines: its first observation (one plain row) waits like
    the others', so it has no memory yet; with no draft behind it, its next step drafts (as any new
    sequence's), applying the waiting rows first. (The HTTP API's system crashed here: the eager
    proposer asked a memory-less sequence for its last confidences.)"""
    model, drafter = tiny()
    if slots:
        proposer: DSparkProposer = SlotDSparkProposer(drafter, model, DraftRunner(drafter, model, DraftRunnerConfig(4)),
                                                      probe_every=64)
        proposer.attach_profile(_profile(draft_s=1.0), verify_all=False)
    else:
        proposer = DSparkProposer(drafter, model, profile=_profile(draft_s=1.0), probe_every=64)
    old = _batch(model, drafter, proposer, [0.0])
    proposer.propose(old)
    proposer._remember(old[0], torch.full((5,), 0.9))
    gen = torch.Generator().manual_seed(4)
    assert proposer.propose(old) == [None]  # declined
    new = _sequence(model, "new", 9, 0.0, seed=77)
    _plain_step(proposer, [*old, new], [_taps(model, 1, gen), _taps(model, 1, gen)])
    assert proposer._deferred and new.draft is None  # its one row waits
    drafts = proposer.propose([*old, new])
    assert drafts[1] is not None and not proposer._deferred  # a new sequence drafts: the rows applied first
    assert _memory(proposer, new)[0] == len(new.tokens) - 1


def test_deferred_taps_are_applied_once_they_hold_too_many_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The byte budget bounds what waits whatever the step count (a large model's taps are big)."""
    import cedserve.decode_workers.drafting as drafting

    model, drafter = tiny()
    proposer = DSparkProposer(drafter, model, profile=_profile(draft_s=1.0), probe_every=64, defer_observes=16)
    seqs = _batch(model, drafter, proposer, [0.0, 0.0])
    proposer.propose(seqs)
    for seq in seqs:
        proposer._remember(seq, torch.full((5,), 0.9))
    gen = torch.Generator().manual_seed(6)
    row_bytes = _taps(model, 1, gen).numel() * 4
    monkeypatch.setattr(drafting, "DEFER_MAX_BYTES", 5 * row_bytes)  # two steps of two rows wait, the third applies
    waiting = []
    for _ in range(3):
        assert proposer.propose(seqs) == [None, None]
        _plain_step(proposer, seqs, [_taps(model, 1, gen) for _ in seqs])
        waiting.append(len(proposer._deferred))
    assert waiting == [1, 2, 0] and all(_memory(proposer, s)[0] == len(s.tokens) - 1 for s in seqs)


def test_the_batch_prediction_equals_calibrating_each_sequence_alone() -> None:
    """`_prediction` calibrates the batch's histories in one call (zero-padded to K): each row must
    equal that sequence's own history calibrated alone, with its cap, and nothing for the rest."""
    model, drafter = tiny()
    proposer = DSparkProposer(drafter, model, num_tokens=4)
    profile = StepProfile(0.05, 0.001)
    gen = torch.Generator().manual_seed(11)
    for _ in range(40):  # a calibration that is not the identity: survival measured below prediction
        c = torch.rand(4, generator=gen) ** 0.3
        profile.survival.record(torch.cumprod(c.double(), 0).tolist(), int(torch.randint(0, 5, (1,), generator=gen)))
    seqs = [_sequence(model, f"r{i}", 5 + i, 0.0, seed=i) for i in range(5)]
    seqs[3].max_drafts = 2
    ready = [0, 1, 3, 4]
    history: list[torch.Tensor | None] = [torch.rand(n, generator=gen) for n in (4, 2, 4, 3)]
    predicted, caps = proposer._prediction(seqs, ready, history, profile)
    assert predicted.shape == (5, 4) and predicted[2].abs().sum() == 0 and caps[2] == 0
    for i, confidences in zip(ready, history):
        assert confidences is not None
        alone = profile.survival.calibrated(confidences.float())
        n = alone.shape[0]
        torch.testing.assert_close(predicted[i, :n], alone, rtol=1e-6, atol=1e-7)
        assert predicted[i, n:].abs().sum() == 0
        assert int(caps[i]) == min(seqs[i].max_drafts, n)


def test_ragged_rows_are_padded_in_order() -> None:
    """The engine's one-store padding of a batch's confidences (verify lengths, calibration)."""
    import numpy as np

    from cedserve.decode_workers.engine import _padded

    values = np.arange(1, 7, dtype=np.float32)  # rows of 3, 1, 2
    out = _padded(values, np.array([3, 1, 2]), -1.0)
    assert out.dtype == np.float32
    assert out.tolist() == [[1, 2, 3], [4, -1, -1], [5, 6, -1]]
