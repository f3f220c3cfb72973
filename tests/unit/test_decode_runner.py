"""The decode engine with the model runner on (`decode.runner`): plain rows decode through slots
over the worker's own block pool and give `forward_batch`'s tokens, with requests joining,
finishing, preempted (offloaded or recomputed) and drafting beside them; every block and slot is
free at the end. On a CPU the runner runs its step eagerly (`runner = "on"`)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from decode_support import Rig, greedy_rounds, greedy_ties, prompt, tiny

from cedserve.decode_workers.config import DecodeConfig, PreemptionPolicy
from cedserve.decode_workers.drafting import DSparkProposer
from cedserve.decode_workers.messages import Reserved
from cedserve.decode_workers.sequence import DecodeSequence
from cedserve.model.dspark import Draft

pytestmark = pytest.mark.unit

PROMPTS = [prompt(37, 1), prompt(21, 2), prompt(50, 3)]


def test_runner_rows_give_forward_batch_tokens() -> None:
    model, _ = tiny()
    off = Rig(model, None, dspark=False, runner="off")
    want = list(greedy_rounds(off, PROMPTS, 12).values())
    on = Rig(model, None, dspark=False, runner="on", overlap=False)  # (the row counts below: steps in series)
    got = list(greedy_rounds(on, PROMPTS, 12).values())
    # prompt 1's step 6 is a numerical tie (margin 0.005, test_decode_engine.py): there the two paths
    # may pick differently and go on from different tokens; every other step must agree, and every
    # token of the runner's must be what some computation of the model picks (`greedy_ties`)
    assert [got[0], got[2]] == [want[0], want[2]] and got[1][:6] == want[1][:6]
    assert sum(len(greedy_ties(model, p, out)) for p, out in zip(PROMPTS, got)) <= 1
    assert on.engine.slots is not None and on.engine.slots.runner.steps >= 10
    assert on.engine.slots.num_free == on.config.max_running_requests
    metrics = on.engine.metrics
    assert metrics.runner_rows._value.get() == 3 * 11  # every step after the joins' replays
    assert metrics.runner_moves.labels("in")._value.get() == 3 and metrics.runner_slots._value.get() == 0
    on.assert_all_free()
    assert off.engine.slots is None


@pytest.mark.parametrize("policy", ["offload", "recompute"])
def test_preemption_takes_the_state_out_of_its_slot(policy: str) -> None:
    model, _ = tiny()
    prompts = [prompt(30, 11), prompt(30, 12)]
    outs = []
    for runner in ("off", "on"):
        rig = Rig(model, None, num_blocks=3, dspark=False, preemption=PreemptionPolicy(policy), runner=runner)
        outs.append(list(greedy_rounds(rig, prompts, 7).values()))
        assert rig.engine.metrics.preemptions.labels(policy)._value.get() >= 1
        rig.assert_all_free()
    assert outs[0] == outs[1]


class EveryOtherStep(DSparkProposer):
    """The DSpark proposer (the random drafter) that drafts only on even calls: deterministic, where
    the real proposer's choice to draft depends on measured step times."""

    calls = 0

    def propose(self, seqs: Sequence[DecodeSequence]) -> list[Draft | None]:
        self.calls += 1
        drafts = super().propose(seqs)
        return drafts if self.calls % 2 == 0 else [None] * len(drafts)


def test_dspark_verify_rows_on_the_runner() -> None:
    """DSpark on (`runner = "on"`): verify steps (carried tokens, the anchor and its drafts) run
    through the runner too, rejected drafts rolled back by rewinding the slot; a verify whose drafts
    cross into the next block gets that block first (`reserve_tokens`) and stays in its slot: each
    request slots in once and never out (before, here, one crossing verify slotted out and back).
    The tokens are those of the engine without the runner (the random drafter's drafts are checked
    losslessly)."""
    outs, steps, moves = [], 0, (0.0, 0.0)
    for runner in ("off", "on"):
        model, drafter = tiny()
        config = DecodeConfig(runner=runner, adaptive_verify=False)
        proposer = EveryOtherStep(drafter, model, config.draft_tokens)
        rig = Rig(model, None, proposer=proposer, runner=runner, adaptive_verify=False)
        outs.append(list(greedy_rounds(rig, PROMPTS[:2], 14).values()))
        rig.assert_all_free()
        if rig.engine.slots is not None:
            steps = rig.engine.slots.runner.steps
            moved = rig.engine.metrics.runner_moves
            moves = (moved.labels("in")._value.get(), moved.labels("out")._value.get())
    assert outs[0][0] == outs[1][0] and outs[0][1][:6] == outs[1][1][:6]  # (prompt 1's step 6: a tie)
    assert steps >= 10  # of 27 passes here (13 seen): the rest are the joins' passes
    assert moves == (2, 0)


def test_runner_config_is_checked() -> None:
    with pytest.raises(ValueError, match="runner"):
        DecodeConfig(runner="sometimes")


def test_state_handed_over_in_process_waits_for_its_records() -> None:
    """`attach_state` (a colocated prefill, the benchmarks) gives a state whose records are not in the
    blocks yet: its first step runs through `forward_batch` (which stores them), the rest through
    the runner, with the tokens of the engine without it."""
    from decode_support import reference_greedy

    from cedserve.decode_workers.messages import AttachCommand, Sampling

    model, _ = tiny()
    tokens = prompt(45, 9)
    want = reference_greedy(model, tokens, 8)
    rig = Rig(model, None, dspark=False, runner="on", overlap=False)  # (the step count below: in series)
    state = model.new_state()
    first = int(model.prefill(tokens, state)[-1].argmax())
    assert first == want[0]
    cmd = AttachCommand(0, "handed", "lease-handed", tuple(tokens), first, 100, Sampling(max_tokens=7))
    rig.engine.attach_state("handed", tokens, state, first, cmd)
    rig.run()
    got = [first, *rig.tokens("handed")]
    assert len(greedy_ties(model, tokens, got)) <= 1
    assert rig.engine.slots is not None and rig.engine.slots.runner.steps == 6
    rig.assert_all_free()


def test_a_transferred_request_takes_the_runner_from_its_first_step_by_default() -> None:
    """The worker's default (`decode.ship_state` on): a request whose KV arrives joins with the prefill
    side's bounded state, so every one of its steps, the first too, runs through the runner (no replay
    pass between its first token and its second); with `ship_state = false` its first step is the
    replay pass through `forward_batch`, and the rest take the runner too."""
    assert DecodeConfig().ship_state
    model, drafter = tiny()
    tokens = prompt(70, 3)  # 71 tokens with the first: 3 blocks of 32, room for every verify of 8 steps
    passes = {}
    for ship in (True, False):
        rig = Rig(model, drafter, runner="on", ship_state=ship)
        reserved = rig.reserve(tokens)
        assert isinstance(reserved, Reserved)
        rig.attach(reserved, tokens, rig.prefill(reserved, tokens), 8)
        rig.run()
        engine = rig.engine
        assert engine.slots is not None and len(rig.tokens(reserved.request_id)) == 8
        passes[ship] = (engine.passes, engine.slots.runner.steps)
        assert engine.metrics.joins.labels("shipped" if ship else "replay")._value.get() == 1
        rig.assert_all_free()
    shipped, replayed = passes[True], passes[False]
    assert shipped[0] == shipped[1]  # every pass was a runner step
    assert replayed[0] == replayed[1] + 1  # the replay join's forward_batch pass, then the runner
