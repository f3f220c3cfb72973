"""Overlapped decode steps (`decode.overlap`): each plain step launched before the last one's tokens
are read, its rows fed on the device (`ModelRunner.remember`, `FED` rows). The tokens are the ones
the engine gives without overlap, requests that stop (a stop id, their budget, a cancel, a
deadline) have their blocks back once the row launched past their stop has run, a join or a
seeded sampled request ends the overlap and a later steady batch starts it again, an unseeded one
takes the runner's draw on the device. On a CPU the runner
runs its steps eagerly (`runner = "on"`): the same bookkeeping as on a GPU, without the overlap."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from decode_support import Rig, greedy_rounds, prompt, tiny

from cedserve.decode_workers.config import DecodeConfig
from cedserve.decode_workers.drafting import DSparkProposer
from cedserve.decode_workers.messages import CancelCommand, Finished, Reserved, Tokens
from cedserve.model.runner import FED, ModelRunner, RunnerConfig

pytestmark = pytest.mark.unit

PROMPTS = [prompt(37, 1), prompt(21, 2), prompt(50, 3), prompt(29, 4)]


def _start(rig: Rig, tokens: list[int], max_tokens: int, **sampling: Any) -> str:
    reserved = rig.reserve(tokens)
    assert isinstance(reserved, Reserved), reserved
    first = rig.prefill(reserved, tokens)
    rig.attach(reserved, tokens, first, max_tokens, **sampling)
    return reserved.request_id


def _decode(overlap: bool, plan: list[tuple[list[int], int, dict[str, Any]]], *,
            cancel_after: int | None = None, late: list[tuple[list[int], int]] = ()) -> tuple[Rig, list[list[int]]]:
    """Run `plan` (prompt, budget, sampling) together; `cancel_after`: cancel the second request after
    that many steps; `late`: requests attached after 5 steps (a join mid-run)."""
    model, _ = tiny()
    rig = Rig(model, None, dspark=False, runner="on", overlap=overlap)
    ids = [_start(rig, tokens, budget, **sampling) for tokens, budget, sampling in plan]
    for step in range(400):
        rig.outputs += rig.engine.poll()
        if not rig.engine.has_work():
            break
        if step == 5:
            ids += [_start(rig, tokens, budget) for tokens, budget in late]
        if cancel_after is not None and step == cancel_after:
            lease = rig.engine.sequences[ids[1]].lease.lease_id
            rig.outputs += rig.engine.handle(CancelCommand(0, ids[1], lease))
        rig.outputs += rig.engine.step()
    else:
        raise AssertionError("the engine did not finish")
    return rig, [rig.tokens(rid) for rid in ids]


def test_overlapped_steps_give_the_same_tokens_and_free_every_block() -> None:
    first = PROMPTS[0]
    # a stop id that the first request reaches mid-run: its next row is already launched when it stops
    _, probe = _decode(False, [(first, 30, {})])
    stop = probe[0][9]
    plan = [(first, 30, {"stop_token_ids": (stop,)}), (PROMPTS[1], 7, {}), (PROMPTS[2], 19, {}), (PROMPTS[3], 1, {})]
    off, want = _decode(False, plan)
    on, got = _decode(True, plan)
    assert got == want
    assert got[0][-1] == stop and len(got[0]) == probe[0].index(stop) + 1
    assert [len(t) for t in got[1:]] == [7, 19, 1]  # each its whole budget
    on.assert_all_free()
    off.assert_all_free()
    assert on.engine.metrics.overlapped_steps._value.get() >= 15  # most steps were launched ahead
    assert on.engine.slots is not None and on.engine.slots.num_free == on.config.max_running_requests
    assert off.engine.metrics.overlapped_steps._value.get() == 0
    assert all(isinstance(on.finished(rid), Finished) for rid in {o.request_id for o in on.outputs})


def test_a_cancel_and_a_join_mid_run() -> None:
    plan = [(PROMPTS[0], 24, {}), (PROMPTS[1], 24, {}), (PROMPTS[2], 12, {})]
    late = [(PROMPTS[3], 9)]
    _, want = _decode(False, plan, cancel_after=8, late=late)
    on, got = _decode(True, plan, cancel_after=8, late=late)
    assert got == want
    assert 0 < len(got[1]) < 23  # cancelled mid-run
    assert len(got[3]) == 9  # the late request decoded its whole budget
    on.assert_all_free()
    assert on.engine.metrics.overlapped_steps._value.get() >= 10


def test_seeded_sampled_requests_are_not_overlapped() -> None:
    """A seeded sampled request (its tokens drawn on the host from its own generator, the same on
    every run) keeps the steps in series; its tokens, and the greedy ones beside it, are those
    without overlap."""
    plan = [(PROMPTS[0], 10, {"temperature": 0.8, "seed": 3}), (PROMPTS[1], 10, {})]
    _, want = _decode(False, plan)
    on, got = _decode(True, plan)
    assert got == want
    assert on.engine.metrics.overlapped_steps._value.get() == 0
    on.assert_all_free()


def test_unseeded_sampled_requests_overlap_with_the_device_draw() -> None:
    """An unseeded sampled request overlaps: its overlapped tokens are the runner's draw on the device
    (`sample_rows`), under its own parameters. With top-k 1 the draw is the argmax, so the tokens are
    the greedy ones exactly; at temperature 0.8 they are valid tokens, the budget is kept and every
    block comes back."""
    greedy = [(PROMPTS[0], 12, {}), (PROMPTS[2], 9, {})]
    _, want = _decode(False, greedy)
    top1 = [(tokens, budget, {"temperature": 1.0, "top_k": 1}) for tokens, budget, _ in greedy]
    on, got = _decode(True, top1)
    assert got == want
    assert on.engine.metrics.overlapped_steps._value.get() >= 8
    on.assert_all_free()
    warm, sampled = _decode(True, [(PROMPTS[1], 15, {"temperature": 0.8}), (PROMPTS[3], 15, {"temperature": 0.8,
                                                                                              "top_p": 0.9})])
    assert [len(t) for t in sampled] == [15, 15]
    assert all(0 <= t < warm.model.config.vocab_size for t in sampled[0] + sampled[1])
    assert warm.engine.metrics.overlapped_steps._value.get() >= 10
    warm.assert_all_free()


def test_a_deadline_while_a_step_is_in_flight() -> None:
    """A request whose deadline passes while a step holding it is in flight: it fails at once, its
    blocks come back once that step has been collected."""
    model, _ = tiny()
    now = [0.0]
    rig = Rig(model, None, dspark=False, runner="on", overlap=True)
    rig.engine.clock = lambda: now[0]
    rid = _start(rig, PROMPTS[0], 40)
    other = _start(rig, PROMPTS[1], 40)
    for _ in range(6):
        rig.outputs += rig.engine.poll()
        rig.outputs += rig.engine.step()
    assert rig.engine._ahead is not None and rig.engine._ahead.holds(rig.engine.sequences[rid])
    rig.engine.sequences[rid].deadline_s = -1.0  # passed
    rig.outputs += rig.engine.poll()
    failed = rig.finished(rid)
    assert failed is not None and not isinstance(failed, Finished)
    assert rig.engine._ahead is not None and rig.engine._ahead.after  # its blocks wait for the step
    held_before = rig.cache.pool.num_blocks - rig.cache.pool.num_free
    rig.outputs += rig.engine.step()  # collects the step in flight: the blocks come back
    assert rig.cache.pool.num_blocks - rig.cache.pool.num_free < held_before
    rig.run()
    assert rig.finished(other) is not None
    rig.assert_all_free()


def test_fed_rows_take_the_remembered_tokens() -> None:
    """The runner alone: a step whose rows are `FED` gives the logits of the same step fed the same
    tokens from the host."""
    model, _ = tiny()
    config = RunnerConfig(max_slots=3, max_context=256)
    runners = [ModelRunner(model, config) for _ in range(2)]
    state = model.new_state()
    model.prefill(prompt(20, 5), state)
    for runner in runners:
        for slot in range(3):
            runner.load(slot, state)
    slots = [2, 0, 1]
    tokens = [5, 17, 300]
    a = runners[0].step_logits(slots, tokens)
    b = runners[1].step_logits(slots, tokens)
    assert torch.equal(a, b)
    picks = a.argmax(-1)
    runners[0].remember(3, picks)
    fed = runners[0].step_logits(slots, [FED, FED, FED])
    host = runners[1].step_logits(slots, picks.tolist())
    assert torch.equal(fed, host)
    mixed = runners[0].step_logits([0, 1], [FED, 9])  # FED beside a host token: slot 0 remembered row 1's pick
    assert torch.equal(mixed, runners[1].step_logits([0, 1], [int(picks[1]), 9]))
    with pytest.raises(ValueError, match="outside"):
        runners[0].step_logits([0], [-2])


class DeclinesAfterFirstDrafts(DSparkProposer):
    """The DSpark proposer whose cost check finds that drafting never pays once each request has
    drafted once (its probes aside): deterministic, where the real check weighs measured times."""

    def _passes_pay(self, *args: Any) -> bool:
        return False


def test_a_proposer_declining_lets_its_promised_plain_steps_overlap() -> None:
    """DSpark on: while its cost check declines, the steps it has promised to decline until its next
    probe (`plain_steps_ahead`) overlap, their taps still reach the drafter's memory (deferred, as a
    declined step's are), and the probes and any drafting step run in series. Greedy tokens are the
    engine's without overlap; every block and slot is free at the end."""
    outs, counts = [], []
    for overlap in (False, True):
        model, drafter = tiny()
        config = DecodeConfig(runner="on")
        proposer = DeclinesAfterFirstDrafts(drafter, model, config.draft_tokens)
        rig = Rig(model, None, proposer=proposer, runner="on", overlap=overlap)
        outs.append(list(greedy_rounds(rig, [PROMPTS[0], PROMPTS[1]], 60).values()))
        rig.assert_all_free()
        assert rig.engine.proposer is not None
        counts.append((rig.engine.metrics.overlapped_steps._value.get(), rig.engine.proposer.declined_steps,
                       rig.engine.verify_passes))
    assert outs[0] == outs[1] and [len(o) for o in outs[1]] == [61, 61]
    (off, declined_off, verify_off), (on, declined_on, verify_on) = counts
    assert off == 0 and on >= 20  # most declined steps overlapped
    # the check's schedule is the same: its probes verify at the same steps; the overlapped engine
    # counts one declined step more, launched past the requests' last token
    assert verify_on == verify_off and 0 <= declined_on - declined_off <= 1


def test_overlapped_plain_steps_feed_the_cost_checks_plain_rate() -> None:
    """The veto weighs whole drafting steps against plain steps as they run: overlapped ones too (launch
    to launch, with the tokens each concluded), not only the plain steps in series."""
    counts = []
    for overlap in (False, True):
        model, drafter = tiny()
        proposer = DeclinesAfterFirstDrafts(drafter, model, DecodeConfig(runner="on").draft_tokens)
        rig = Rig(model, None, proposer=proposer, runner="on", overlap=overlap)
        greedy_rounds(rig, [PROMPTS[0], PROMPTS[1]], 60)
        cycles = rig.engine.profile._cycles
        seconds, tokens, n = cycles[(2, False)]
        assert seconds > 0 and 1 <= tokens <= 2  # two requests, one token each (fewer as one stops)
        counts.append((n, rig.engine.metrics.overlapped_steps._value.get()))
    (series, _), (with_overlap, overlapped) = counts
    # every overlapped step but the first of each run of them adds a plain cycle (without them only the
    # few plain steps in series between the runs would count)
    assert overlapped >= 20 and with_overlap >= 3 * series // 4 and with_overlap > overlapped // 2


def test_logprobs_requests_overlap_with_the_same_logprobs() -> None:
    """A request asking for logprobs overlaps too: its step's logits are copied to the host behind the
    step, and its chunks (tokens, each token's logprob, the top-n) are those without overlap."""
    plan = [(PROMPTS[0], 10, {"logprobs": 3}), (PROMPTS[2], 10, {})]
    chunks = []
    for overlap in (False, True):
        rig, _ = _decode(overlap, plan)
        rid = next(o.request_id for o in rig.outputs if isinstance(o, Tokens) and o.logprobs)
        chunks.append([(o.token_ids, o.logprobs, o.top_logprobs) for o in rig.outputs
                       if isinstance(o, Tokens) and o.request_id == rid])
        assert (rig.engine.metrics.overlapped_steps._value.get() >= 6) is overlap
        rig.assert_all_free()
    flat = [[(t, lp, top) for ids, lps, tops in c for t, lp, top in zip(ids, lps, tops)] for c in chunks]
    assert flat[0] == flat[1] and len(flat[0]) == 10 and all(len(top) == 3 for _, _, top in flat[0])
