"""The DSpark drafter on slots (`SlotDSparkProposer` over a `DraftRunner`, run eagerly on a CPU)
against the eager `DSparkProposer`, driven through the same passes: requests joining and leaving,
drafts rejected (the memory rolled back), a memory too far behind (rebuilt), a preemption that
carries the memory out and back. Greedy drafts are the eager proposer's tokens, their distributions
and confidences equal to `ATOL`; sampled drafts come with the eager drafter's q_k for the tokens
drawn. The engine with `decode.runner_drafter = "on"` emits the tokens it emits with it off."""

from __future__ import annotations

import pytest
import torch
from decode_support import Rig, greedy_rounds, prompt, tiny

from cedserve.decode_workers.config import DecodeConfig, PreemptionPolicy
from cedserve.decode_workers.drafting import DSparkProposer, Observation
from cedserve.decode_workers.metrics import DECODE_PATHS
from cedserve.decode_workers.sequence import DecodeSequence, JoinKind, Lease
from cedserve.decode_workers.slot_drafting import SlotDSparkProposer
from cedserve.model.draft_runner import DraftRunner, DraftRunnerConfig
from cedserve.model.dspark import Draft, DraftState
from cedserve.model.network import CEDModel
from cedserve.model.sampling import SamplingParams, make_generator

pytestmark = pytest.mark.unit

ATOL = 1e-5
"""Slot vs eager drafter, float32 on a CPU: the context padded to the window instead of the batch's
longest and the MoE run dense (every expert, weighted) instead of per expert: rounding only."""


def _taps(model: CEDModel, n: int, gen: torch.Generator) -> torch.Tensor:
    c = model.config
    return torch.randn(n, len(c.dspark_target_layer_ids), c.hc_mult, c.hidden_size, generator=gen)


def _sequence(model: CEDModel, rid: str, num_tokens: int, temperature: float) -> DecodeSequence:
    tokens = torch.randint(3, 500, (num_tokens,), generator=torch.Generator().manual_seed(num_tokens)).tolist()
    params = SamplingParams(temperature=temperature, seed=num_tokens)
    lease = Lease(f"l-{rid}", rid, [], 0, float("inf"), False, num_tokens)
    seq = DecodeSequence(rid, lease, tokens, num_tokens, params, make_generator(params), frozenset(), (),
                         JoinKind.SHIPPED, 0, 0, max_drafts=model.config.dspark_block_size)
    seq.state = model.new_state()
    seq.state.position = num_tokens - 1  # the anchor is pending
    return seq


class Twins:
    """The same requests under both proposers; every pass shown to both with the same taps."""

    def __init__(self, model: CEDModel, max_slots: int = 3) -> None:
        _, drafter = tiny()
        self.model = model
        self.eager = DSparkProposer(drafter, model, probe_every=1)
        self.slot = SlotDSparkProposer(drafter, model, DraftRunner(drafter, model, DraftRunnerConfig(max_slots)),
                                       probe_every=1)
        self.seqs: dict[str, tuple[DecodeSequence, DecodeSequence]] = {}
        self.gen = torch.Generator().manual_seed(5)

    def join(self, rid: str, num_tokens: int, temperature: float = 0.0) -> None:
        """A request whose first pass (all but its anchor) fills its memory."""
        pair = (_sequence(self.model, rid, num_tokens, temperature), _sequence(self.model, rid, num_tokens, temperature))
        taps = _taps(self.model, num_tokens - 1, self.gen)
        for proposer, seq in zip((self.eager, self.slot), pair):
            proposer.observe(seq, 0, taps, num_tokens - 1)
        self.seqs[rid] = pair

    def leave(self, rid: str, keep: bool = False) -> None:
        """The request finishes, or (`keep`) is preempted with an offload and comes straight back."""
        pair = self.seqs[rid] if keep else self.seqs.pop(rid)
        for proposer, seq in zip((self.eager, self.slot), pair):
            proposer.release(seq, keep)
            if not keep:
                seq.draft = None

    def propose(self) -> list[tuple[Draft | None, Draft | None]]:
        eager = self.eager.propose([a for a, _ in self.seqs.values()])
        slot = self.slot.propose([b for _, b in self.seqs.values()])
        return list(zip(eager, slot))

    def verify(self, drafts: list[Draft | None], accepted: list[int], jump: dict[str, int] | None = None) -> None:
        """One target pass per request over its pending tokens and drafts: `accepted[i]` drafts kept
        plus a bonus token, the rest rolled back. `jump[rid]`: that many tokens were consumed by a
        pass the proposer did not see (its memory falls behind and is rebuilt from this pass)."""
        observations: tuple[list[Observation], list[Observation]] = ([], [])
        for (rid, pair), draft, kept in zip(self.seqs.items(), drafts, accepted):
            tokens = [] if draft is None else draft.tokens
            skipped = torch.randint(3, 500, ((jump or {}).get(rid, 0),), generator=self.gen).tolist()
            bonus = int(torch.randint(3, 500, (1,), generator=self.gen))
            state = pair[0].state
            assert state is not None
            pending = len(pair[0].tokens) - state.position
            taps = _taps(self.model, pending + len(tokens), self.gen)
            for seq, out in zip(pair, observations):
                assert seq.state is not None
                first = seq.state.position + len(skipped)
                seq.tokens += [*skipped, *tokens[:kept], bonus]
                seq.state.position = first + (pending + len(tokens) if kept == len(tokens) else pending - 1)
                out.append(Observation(seq, first, taps, len(seq.tokens) - 1))
        self.eager.observe_many(observations[0])
        self.slot.observe_many(observations[1])


def _assert_same_greedy(pairs: list[tuple[Draft | None, Draft | None]]) -> None:
    for want, got in pairs:
        assert (want is None) == (got is None)
        if want is not None and got is not None:
            assert got.tokens == want.tokens
            torch.testing.assert_close(got.probs, want.probs, atol=ATOL, rtol=0)
            torch.testing.assert_close(got.confidences, want.confidences.cpu(), atol=ATOL, rtol=0)


def test_slot_drafts_equal_eager_through_joins_leaves_and_rollbacks() -> None:
    model, _ = tiny()
    twins = Twins(model)
    twins.join("a", 5)
    twins.join("b", 30)  # more history than the ring (window 8 + rollback 6): it wrapped
    twins.join("c", 2)  # one vector
    k = model.config.dspark_block_size
    plan = [[0, 2, k], [k, 1, 0], [3, 0, 2], [0, 0, 0]]  # step 2: b's memory rebuilt from one kept row
    for step, accepted in enumerate(plan):
        pairs = twins.propose()
        assert all(d is not None for pair in pairs for d in pair)
        _assert_same_greedy(pairs)
        twins.verify([d for d, _ in pairs], accepted, jump={"b": 20} if step == 2 else None)
    twins.leave("a")  # a slot freed and taken again
    twins.join("d", 17)
    twins.leave("c", keep=True)  # preempted with offload: the memory travels in seq.draft
    _, c = twins.seqs["c"]
    assert isinstance(c.draft, DraftState) and c.draft.last_confidences is not None
    assert twins.slot.num_free == 1
    for accepted in [[1, 0, k], [k, 3, 2], [2, 2, 0]]:
        pairs = twins.propose()
        _assert_same_greedy(pairs)
        twins.verify([d for d, _ in pairs], accepted)
    assert c.draft is None and twins.slot.num_free == 0  # back in a slot
    for rid in list(twins.seqs):
        twins.leave(rid)
    assert twins.slot.num_free == 3


def test_sampled_slot_drafts_come_with_their_distributions() -> None:
    """Sampled rows draw from another stream than the eager drafter's generator: each draft must come
    with the eager drafter's q_k given the tokens before it (greedy rows beside them stay exact)."""
    model, drafter = tiny()
    twins = Twins(model)
    twins.join("hot", 12, temperature=1.3)
    twins.join("greedy", 9)
    twins.join("warm", 20, temperature=0.7)
    for accepted in [[1, 0, 2], [0, 3, 1]]:
        pairs = twins.propose()
        _assert_same_greedy([pairs[1]])
        for (seq, _), (_, got) in zip(twins.seqs.values(), pairs):
            assert got is not None and seq.draft is not None
            if seq.params.greedy:
                continue
            want = _eager_distributions(drafter, model, seq.draft, seq.anchor, got.tokens, seq.params.temperature)
            torch.testing.assert_close(got.probs, want, atol=ATOL, rtol=0)
            assert all(float(got.probs[i, t]) > 0 for i, t in enumerate(got.tokens))
        twins.verify([d for d, _ in pairs], accepted)


def _eager_distributions(drafter: torch.nn.Module, model: CEDModel, state: DraftState, anchor: int,
                         tokens: list[int], temperature: float) -> torch.Tensor:
    """q_k of `Drafter` for a block drafted after `anchor` whose tokens were `tokens`."""
    c = model.config
    window = state.window_vectors.unsqueeze(0)
    n = window.shape[1]
    ctx_positions = (state.end_position - n + torch.arange(n)).unsqueeze(0)
    block = torch.tensor([[anchor] + [c.dspark_noise_token_id] * (c.dspark_block_size - 1)])
    positions = state.end_position + torch.arange(c.dspark_block_size).unsqueeze(0)
    with torch.no_grad():
        h = drafter.block_states(block, window, positions, ctx_positions, model.embed)[0]
        base = model.lm_head(h).float()
        previous = torch.tensor([anchor, *tokens[:-1]])
        logits, _ = drafter.heads(h, base, previous)
    return torch.softmax(logits / temperature, dim=-1)


def test_observe_keeps_what_a_draft_state_keeps() -> None:
    """Random passes, some rolling the memory back below its end by up to `rollback` positions, some
    after a gap: the slot's window is the eager `DraftState`'s after each."""
    model, drafter = tiny()
    eager = DSparkProposer(drafter, model)
    runner = DraftRunner(drafter, model, DraftRunnerConfig(max_slots=1))
    seq = _sequence(model, "r", 4, 0.0)
    rng = torch.Generator().manual_seed(11)
    end = 0
    for step in range(40):
        state = seq.draft
        held = 0 if state is None else int(state.vectors.shape[0])
        back = int(torch.randint(0, min(held, state.rollback if state else 0) + 1, (1,), generator=rng))
        first = end + 3 if step % 9 == 8 else end - back
        n = int(torch.randint(1, 9, (1,), generator=rng))
        keep = first + n - int(torch.randint(0, n, (1,), generator=rng))
        taps = _taps(model, n, rng)
        eager.observe(seq, first, taps, keep)
        runner.observe([0], [first], [keep], [taps])
        assert seq.draft is not None
        got = runner.export(0)
        assert got.end_position == seq.draft.end_position == keep
        torch.testing.assert_close(got.window_vectors, seq.draft.window_vectors, atol=ATOL, rtol=0)
        end = keep


def test_runner_checks_its_inputs() -> None:
    model, drafter = tiny()
    runner = DraftRunner(drafter, model, DraftRunnerConfig(max_slots=2))
    with pytest.raises(ValueError, match="no drafter memory"):
        runner.draft([0], [5], [0.0], [None])
    runner.observe([0], [0], [4], [_taps(model, 6, torch.Generator().manual_seed(1))])
    assert runner.extent(0) == (0, 4)
    with pytest.raises(ValueError, match="cannot keep"):
        runner.observe([1], [3], [10], [_taps(model, 2, torch.Generator().manual_seed(1))])
    with pytest.raises(ValueError, match="outside"):
        runner.draft([0], [model.config.vocab_size], [0.0], [None])
    with pytest.raises(ValueError, match="slot 2 outside"):
        runner.extent(2)
    with pytest.raises(ValueError, match="buckets"):
        DraftRunnerConfig(max_slots=4, buckets=(1, 2))
    assert runner.draft([0, 0][:1], [5], [0.0], [None]).probs.shape == (1, model.config.dspark_block_size,
                                                                         model.config.vocab_size)


# ---------------------------------------------------------------------- the engine


PROMPTS = [prompt(37, 1), prompt(21, 2), prompt(50, 3)]


def _engine_tokens(drafter_mode: str, num_blocks: int = 128, **config: object) -> tuple[list[list[int]], Rig]:
    model, drafter = tiny()
    proposer = DSparkProposer(drafter, model, probe_every=1)  # drafts every step
    rig = Rig(model, None, proposer=proposer, num_blocks=num_blocks, runner="on", runner_drafter=drafter_mode,
              adaptive_verify=False, **config)
    out = list(greedy_rounds(rig, PROMPTS[:2] if num_blocks < 128 else PROMPTS, 12).values())
    rig.assert_all_free()
    return out, rig


def test_engine_with_the_drafter_on_slots_emits_the_same_tokens() -> None:
    want, off = _engine_tokens("off")
    got, on = _engine_tokens("on")
    assert got == want
    assert type(off.engine.proposer) is DSparkProposer
    proposer = on.engine.proposer
    assert isinstance(proposer, SlotDSparkProposer)
    assert proposer.runner.steps >= 8 and proposer.num_free == on.config.max_running_requests
    assert on.engine.drafted_tokens == off.engine.drafted_tokens > 0


@pytest.mark.parametrize("policy", ["offload", "recompute"])
def test_engine_preemption_with_the_drafter_on_slots(policy: str) -> None:
    outs = []
    for mode in ("off", "on"):
        out, rig = _engine_tokens(mode, num_blocks=3, preemption=PreemptionPolicy(policy))
        assert rig.engine.metrics.preemptions.labels(policy)._value.get() >= 1
        outs.append(out)
    assert outs[0] == outs[1]


def test_runner_drafter_config() -> None:
    with pytest.raises(ValueError, match="runner_drafter"):
        DecodeConfig(runner_drafter="sometimes")
    model, drafter = tiny()
    with pytest.raises(ValueError, match="runner_drafter"):  # "on" with a proposer it cannot put on slots
        from decode_support import TargetProposer

        Rig(model, None, proposer=TargetProposer(model, 3), dspark=True, runner_drafter="on")
    auto = Rig(model, drafter, dspark=True, runner="on", runner_drafter="auto")  # a CPU: eager
    assert type(auto.engine.proposer) is DSparkProposer
    on = Rig(model, drafter, dspark=True, runner="on", runner_drafter="on")
    off = Rig(model, drafter, dspark=True, runner="off")
    # the paths each engine took, on `cedserve_decode_path_on` (a CPU captures and compiles nothing)
    want = {"auto": {"runner": 1, "drafter_slots": 0}, "on": {"runner": 1, "drafter_slots": 1},
            "off": {"runner": 0, "drafter_slots": 0}}
    for name, rig in (("auto", auto), ("on", on), ("off", off)):
        got = {p: rig.engine.metrics.registry.get_sample_value("cedserve_decode_path_on", {"path": p})
               for p in DECODE_PATHS}
        assert got == {**want[name], "runner_graphs": 0, "drafter_graphs": 0, "compiled": 0}, name


def test_compiled_draft_step_equals_the_step_as_written() -> None:
    """`DraftStep(compiled=True)` (Inductor over the sampling loop and the dense MoE; a decode worker
    on CUDA compiles it with `decode.compile_fused`) against the step as written, on fresh random
    memory: greedy rows draft the same tokens and both kinds of row the same q_k and confidences
    (float32 rounding: `ATOL`); sampled rows draw the same tokens (the counter hash is integer math)."""
    from cedserve.model.draft_step import DraftPools, DraftStep

    model, drafter = tiny()
    gen = torch.Generator().manual_seed(23)
    pools = DraftPools(drafter, max_slots=4, device=torch.device("cpu"))
    pools.vectors.copy_(torch.randn(pools.vectors.shape, generator=gen))
    plain = DraftStep(drafter, model, pools)
    compiled = DraftStep(drafter, model, pools, compiled=True)
    k, vocab = drafter.config.dspark_block_size, model.config.vocab_size
    for batch in (3,):  # a greedy row and two sampled ones (one batch size: each more recompiles)
        slots = torch.arange(batch)
        anchors = torch.randint(3, vocab, (batch,), generator=gen)
        ends = torch.randint(pools.window, 4 * pools.window, (batch,), generator=gen)
        counts = torch.randint(1, pools.window + 1, (batch,), generator=gen)
        temperature = torch.tensor([0.0, 0.8, 1.3][:batch])
        seeds = torch.randint(0, 1 << 62, (batch,), generator=gen)
        outs = []
        for step in (plain, compiled):
            probs = torch.zeros(batch, k, vocab)
            outs.append((step.forward(slots, anchors, ends, counts, temperature, seeds, probs), probs))
        (want, want_probs), (got, got_probs) = outs
        assert torch.equal(got.tokens, want.tokens)
        torch.testing.assert_close(got_probs, want_probs, atol=ATOL, rtol=0)
        torch.testing.assert_close(got.confidences, want.confidences, atol=ATOL, rtol=0)
        assert float(want_probs.sum(-1).sub(1).abs().max()) < 1e-4  # distributions, not zeros


def test_hoisted_draft_noise_is_the_per_position_noise() -> None:
    """The pass hashes all drafted positions' noise at once below `HOISTED_NOISE_ELEMENTS`: the same
    values `uniform_noise` gives per position, so sampled drafts draw the same tokens either way."""
    from cedserve.model import draft_step
    from cedserve.model.device_sampling import uniform_noise
    from cedserve.model.draft_step import DraftPools, DraftStep

    gen = torch.Generator().manual_seed(31)
    seeds = torch.randint(0, 1 << 62, (5,), generator=gen)
    counters = torch.randint(0, 1 << 20, (5,), generator=gen)
    together = uniform_noise(seeds.unsqueeze(-1), counters.unsqueeze(-1) + torch.arange(4), 64)  # [5, 4, 64]
    for pos in range(4):
        assert torch.equal(together[:, pos], uniform_noise(seeds, counters + pos, 64))
    model, drafter = tiny()
    pools = DraftPools(drafter, max_slots=3, device=torch.device("cpu"))
    pools.vectors.copy_(torch.randn(pools.vectors.shape, generator=gen))
    step = DraftStep(drafter, model, pools)
    k, vocab = drafter.config.dspark_block_size, model.config.vocab_size
    args = (torch.arange(3), torch.tensor([5, 77, 301]), torch.tensor([40, 90, 160]), torch.tensor([9, 32, 17]),
            torch.tensor([0.0, 0.8, 1.3]), torch.tensor([11, 12, 13]))
    outs = []
    for limit in (1 << 30, 0):  # hoisted, then per position
        old, draft_step.HOISTED_NOISE_ELEMENTS = draft_step.HOISTED_NOISE_ELEMENTS, limit
        try:
            probs = torch.zeros(3, k, vocab)
            outs.append((step.forward(*args, probs), probs))
        finally:
            draft_step.HOISTED_NOISE_ELEMENTS = old
    (hoisted, p1), (per_position, p2) = outs
    assert torch.equal(hoisted.tokens, per_position.tokens) and torch.equal(p1, p2)
