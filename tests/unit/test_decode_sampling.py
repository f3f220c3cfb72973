"""Speculative sampling is lossless: over many seeds, the engine's sampled tokens follow the target's own
distribution with and without drafts.

Every request continues the same prompt (a shipped state: the engine takes it over as is) with
temperature 1 and top-k 3, for two tokens, so each output is one of 9 pairs whose exact probability
comes from the reference model. The drafts come from a proposal distribution unlike the target's (the
target's own logits at temperature 1.5 and top-k 4: accepted sometimes, rejected sometimes, residual
resampling and bonus tokens all occur), and the emitted pairs must still follow the exact law:
a chi-square goodness-of-fit test at significance 0.001, for both modes.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from decode_support import Rig, TargetProposer, prompt, tiny

from cedserve.decode_workers.messages import AttachCommand, Sampling, Tokens
from cedserve.model.sampling import SamplingParams, probabilities

pytestmark = [pytest.mark.unit, pytest.mark.slow]

NUM_SEEDS = 120
SAMPLING = Sampling(temperature=1.0, top_k=3, max_tokens=2)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


def exact_pairs(prefix: list[int]) -> dict[tuple[int, int], float]:
    """P(t1, t2) of the target with `SAMPLING`'s processing, from the reference model."""
    model, _ = tiny()
    params = SamplingParams(temperature=1.0, top_k=3)
    state = model.new_state()
    p1 = probabilities(model.prefill(prefix, state)[-1], params)
    out = {}
    for t1 in p1.nonzero().flatten().tolist():
        branch = copy.deepcopy(state)
        p2 = probabilities(model.decode_step([t1], [branch])[0], params)
        for t2 in p2.nonzero().flatten().tolist():
            out[(t1, t2)] = float(p1[t1] * p2[t2])
    return out


def sample_pairs(dspark: bool, tokens: list[int], first: int) -> list[tuple[int, int]]:
    model, _ = tiny()
    proposer = TargetProposer(model, 2, q=SamplingParams(temperature=1.5, top_k=4)) if dspark else None
    rig = Rig(model, None, proposer=proposer, num_blocks=2 * NUM_SEEDS, dspark=dspark,
              max_running_requests=NUM_SEEDS, adaptive_verify=False)
    state = model.new_state()
    model.prefill(tokens, state)
    for seed in range(NUM_SEEDS):
        rid = f"s{seed}"
        cmd = AttachCommand(0, rid, f"lease-{rid}", tuple(tokens), first, 100,
                            Sampling(temperature=1.0, top_k=3, max_tokens=2, seed=1000 + seed))
        rig.engine.attach_state(rid, tokens, copy.deepcopy(state), first, cmd)
    rig.run()
    out = []
    for seed in range(NUM_SEEDS):
        got = rig.tokens(f"s{seed}")
        assert len(got) == 2
        out.append((got[0], got[1]))
    if dspark:
        accepted = sum(o.accepted_drafts for o in rig.outputs if isinstance(o, Tokens))
        assert 0 < accepted < 2 * NUM_SEEDS  # both acceptance and rejection happened
    rig.assert_all_free()
    return out


def chi_square(observed: list[tuple[int, int]], expected: dict[tuple[int, int], float]) -> tuple[float, int]:
    """Statistic and degrees of freedom; cells with an expected count below 5 are pooled."""
    n = len(observed)
    counts = {pair: 0 for pair in expected}
    for pair in observed:
        assert pair in counts, f"{pair} has probability 0 under the target"
        counts[pair] += 1
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for pair, p in expected.items():
        if n * p >= 5:
            cells.append((counts[pair], n * p))
        else:
            pooled_obs, pooled_exp = pooled_obs + counts[pair], pooled_exp + n * p
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    return sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1


@pytest.mark.parametrize("dspark", [False, True], ids=["plain", "dspark"])
def test_sampled_tokens_follow_the_target_distribution(dspark: bool) -> None:
    model, _ = tiny()
    tokens = prompt(12, 7)
    state = model.new_state()
    first = int(model.prefill(tokens, state)[-1].argmax())
    expected = exact_pairs([*tokens, first])
    observed = sample_pairs(dspark, tokens, first)
    stat, dof = chi_square(observed, expected)
    assert dof >= 2
    assert stat < CHI2_999[dof], (stat, dof, sorted(expected.items()), sorted(observed))


def test_the_test_detects_a_wrong_distribution() -> None:
    """The same chi-square rejects samples from a visibly different law (the statistic has power)."""
    gen = torch.Generator().manual_seed(0)
    expected = {pair: 1 / 9 for pair in itertools.product(range(3), range(3))}
    skewed = torch.tensor([0.25] + [0.75 / 8] * 8)
    pairs = list(expected)
    observed = [pairs[int(i)] for i in torch.multinomial(skewed, NUM_SEEDS, replacement=True, generator=gen)]
    stat, dof = chi_square(observed, expected)
    assert stat > CHI2_999[dof]
