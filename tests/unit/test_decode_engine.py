"""The decode engine, request by request: what it emits equals the single-process reference model, and
every way a request ends (finished, cancelled, its lease expired, its prefill side died) gives back
every block.

Requests go through the real path: a lease on the engine, the prefill side's records (encode_chunk ->
store_records -> kv_transfer sender, a loopback agent standing in for NIXL) landing in the leased
blocks, a Decode attach with the first token, global KV loaded from the blocks and bounded state
replayed, then continuous batching.
"""

from __future__ import annotations

import threading
import time

import pytest
from decode_support import Rig, TargetProposer, greedy_rounds, greedy_ties, prompt, reference_greedy, tiny

from cedserve.common.errors import ErrorKind
from cedserve.decode_workers.config import DecodeConfig, PreemptionPolicy
from cedserve.decode_workers.loop import EngineLoop, LocalChannel
from cedserve.decode_workers.messages import CancelCommand, Failed, Finished, Output, Reserved, Tokens

pytestmark = pytest.mark.unit

PROMPTS = [prompt(37, 1), prompt(21, 2)]
NUM_TOKENS = 10


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    model, _ = tiny()
    return [reference_greedy(model, p, 24) for p in PROMPTS]


@pytest.mark.parametrize("dspark", [False, True], ids=["plain", "dspark"])
def test_greedy_equals_reference(reference: list[list[int]], dspark: bool) -> None:
    model, drafter = tiny()
    rig = Rig(model, drafter, dspark=dspark)
    got = greedy_rounds(rig, PROMPTS, NUM_TOKENS - 1)
    # Decode steps attend as one padded batch, which rounds differently from one sequence alone: the
    # second prompt's step 6 is a numerical tie (the reference's margin is 0.005), so allow one step
    # where another computation of the model (`greedy_ties`' witness) picks the engine's token.
    ties = [greedy_ties(model, p, out) for p, out in zip(PROMPTS, got.values())]
    assert sum(len(t) for t in ties) <= 1, ties
    assert [out[:6] for out in got.values()] == [r[:6] for r in reference]  # the steps before that tie
    for rid in got:
        done = rig.finished(rid)
        assert isinstance(done, Finished) and done.finish_reason == "length"
        assert done.output_tokens == NUM_TOKENS - 1
        if dspark:  # the random drafter proposes (and is almost always rejected)
            assert done.draft_tokens > 0
    rig.assert_all_free()


def test_drafter_equal_to_target_has_every_draft_accepted(reference: list[list[int]]) -> None:
    model, _ = tiny()
    k = model.config.dspark_block_size
    rig = Rig(model, None, proposer=TargetProposer(model, k))
    got = greedy_rounds(rig, PROMPTS[:1], 1 + 2 * (k + 1))
    assert list(got.values()) == [reference[0][: 2 + 2 * (k + 1)]]
    chunks = [o for o in rig.outputs if isinstance(o, Tokens)]
    # The joining step replays and decodes one token (no drafter memory yet); after it every pass
    # verifies K drafts, accepts them all and adds the bonus token.
    assert [len(c.token_ids) for c in chunks] == [1, k + 1, k + 1]
    assert [c.accepted_drafts for c in chunks] == [0, k, k]
    assert [c.draft_tokens for c in chunks] == [0, k, k]
    done = rig.finished(next(iter(got)))
    assert isinstance(done, Finished) and done.accepted_drafts == done.draft_tokens == 2 * k
    rig.assert_all_free()


def test_every_acceptance_length_is_lossless(reference: list[list[int]]) -> None:
    """Drafts = the target's continuation with one token wrong at a position cycling through 0..K
    (K: none wrong): every acceptance length happens, rejected drafts roll back (windows, partial
    groups, global KV), the accepted ones are consumed in front of the next anchor."""
    model, _ = tiny()
    k = 3
    rig = Rig(model, None, proposer=TargetProposer(model, k, corrupt=lambda step: step % (k + 1)),
              adaptive_verify=False)
    got = greedy_rounds(rig, PROMPTS[1:], 20)
    output = next(iter(got.values()))
    # Verification chunks of 2-4 rows round differently from one-token steps: a step or two here are
    # numerical ties (`greedy_ties` shows another computation of the model picks the same token).
    assert len(greedy_ties(model, PROMPTS[1], output)) <= 2
    accepted = [o.accepted_drafts for o in rig.outputs if isinstance(o, Tokens)]
    assert set(accepted[:-1]) == set(range(k + 1)), accepted  # the last chunk may be cut by max_tokens
    rig.assert_all_free()


@pytest.mark.parametrize("policy", ["offload", "recompute"])
def test_memory_pressure_preempts_instead_of_failing(reference: list[list[int]], policy: str) -> None:
    """Two requests whose prompts fill a block each, in a pool of three 32-token blocks: when both need
    a second block, the later one is preempted (offloaded or dropped) and comes back after the first
    finishes. Both still produce the reference tokens."""
    model, drafter = tiny()
    prompts = [prompt(30, 11), prompt(30, 12)]
    rig = Rig(model, drafter, num_blocks=3, dspark=False, preemption=PreemptionPolicy(policy))
    got = greedy_rounds(rig, prompts, 7)
    for tokens, output in zip(prompts, got.values()):
        assert len(greedy_ties(model, tokens, output)) <= 2  # (prompt 11 has two ties: 1 and 4)
    assert rig.engine.metrics.preemptions.labels(policy)._value.get() >= 1
    rig.assert_all_free()


def test_decode_only_prefill_then_prefix_reuse(reference: list[list[int]]) -> None:
    """A lease without a transfer, decoded with `prefill_locally`: the engine prefills and samples the
    first token itself. The next turn (prompt + answer + more) reuses this rank's cached blocks."""
    model, drafter = tiny()
    rig = Rig(model, drafter)
    first_turn = PROMPTS[0]
    reserved = rig.reserve(first_turn, sender=False)
    assert isinstance(reserved, Reserved) and not reserved.reservation
    rig.attach(reserved, first_turn, None, 6)
    rig.run()
    answer = rig.tokens(reserved.request_id)
    assert answer == reference[0][:6]

    second_turn = first_turn + answer + prompt(9, 3)
    again = rig.reserve(second_turn, sender=False)
    assert isinstance(again, Reserved) and again.num_cached_blocks >= 1
    rig.attach(again, second_turn, None, 4)
    rig.run()
    assert rig.tokens(again.request_id) == reference_greedy(model, second_turn, 4)
    rig.assert_all_free()


def test_cancel_frees_every_block() -> None:
    model, drafter = tiny()
    rig = Rig(model, drafter)
    tokens = PROMPTS[0]
    running = rig.reserve(tokens)
    assert isinstance(running, Reserved)
    rig.attach(running, tokens, rig.prefill(running, tokens), 50)
    for _ in range(3):
        rig.outputs += rig.engine.poll() + rig.engine.step()
    rig.outputs += rig.engine.handle(CancelCommand(0, running.request_id, running.lease_id))
    done = rig.finished(running.request_id)
    assert isinstance(done, Finished) and done.finish_reason == "cancelled"

    leased = rig.reserve(tokens)  # transfer reserved, nothing sent yet, no Decode call
    assert isinstance(leased, Reserved)
    rig.engine.handle(CancelCommand(0, leased.request_id, leased.lease_id))
    rig.assert_all_free()


def test_a_retry_waits_for_its_earlier_lease_to_be_released() -> None:
    """The router retries a failed attempt under the same request id, after cancelling the attempt's
    lease. While that lease's aborted transfer still holds its blocks (until `poll`), the retry's
    Reserve finds no room (retryable, the router waits), not a request that misuses its id."""
    model, drafter = tiny()
    rig = Rig(model, drafter)
    tokens = PROMPTS[0]
    first = rig.reserve(tokens, request_id="again")
    assert isinstance(first, Reserved)
    rig.prefill(first, tokens, last=False)  # the transfer is open
    rig.engine.handle(CancelCommand(0, "again", first.lease_id))
    retry = rig.reserve(tokens, request_id="again")
    assert isinstance(retry, Failed) and retry.kind is ErrorKind.RESOURCE_EXHAUSTED and retry.retry_after_ms > 0
    assert "still being released" in retry.message
    rig.engine.poll()  # the aborted transfer let go: the earlier lease is gone
    retry = rig.reserve(tokens, request_id="again")
    assert isinstance(retry, Reserved)
    rig.engine.handle(CancelCommand(0, "again", retry.lease_id))
    rig.assert_all_free()


def test_a_late_cancel_of_an_earlier_attempt_leaves_the_retry_decoding() -> None:
    """The router cancels a failed attempt's lease, then retries under the same request id; its
    Cancel may arrive after the retry is already decoding. Matched by request id alone it would end
    the retry; it names the old lease, so the retry runs on to its full length."""
    model, drafter = tiny()
    rig = Rig(model, drafter)
    tokens = PROMPTS[0]
    first = rig.reserve(tokens, request_id="twice")
    assert isinstance(first, Reserved)
    rig.engine.handle(CancelCommand(0, "twice", first.lease_id))
    rig.engine.poll()
    retry = rig.reserve(tokens, request_id="twice", lease_id="lease-twice-retry")
    assert isinstance(retry, Reserved) and retry.lease_id != first.lease_id
    rig.attach(retry, tokens, rig.prefill(retry, tokens), 12)
    for _ in range(2):
        rig.outputs += rig.engine.poll() + rig.engine.step()
    assert rig.engine.handle(CancelCommand(0, "twice", first.lease_id)) == []  # the stale one
    rig.run()
    done = rig.finished("twice")
    assert isinstance(done, Finished) and done.finish_reason != "cancelled"
    assert len(rig.tokens("twice")) == 12
    rig.assert_all_free()


def test_prefill_side_dying_mid_transfer_frees_every_block() -> None:
    model, drafter = tiny()
    rig = Rig(model, drafter)
    tokens = PROMPTS[0]
    reserved = rig.reserve(tokens)
    assert isinstance(reserved, Reserved)
    rig.prefill(reserved, tokens, last=False)  # bytes sent, transfer not closed
    rig.attach(reserved, tokens, 5, 10)
    rig.hub.kill("prefill")
    rig.outputs += rig.engine.poll()
    failed = rig.finished(reserved.request_id)
    assert isinstance(failed, Failed) and failed.kind is ErrorKind.TRANSFER_FAILED
    rig.assert_all_free()


def test_unused_lease_expires() -> None:
    model, drafter = tiny()
    rig = Rig(model, drafter)
    reserved = rig.reserve(PROMPTS[1], lease_ms=20)
    assert isinstance(reserved, Reserved)
    time.sleep(0.05)
    expired = rig.engine.poll()
    assert [o.kind for o in expired if isinstance(o, Failed)] == [ErrorKind.DEADLINE_EXCEEDED]
    rig.assert_all_free()


def test_block_gauges_follow_a_lease_on_an_idle_rank() -> None:
    """`cedserve_decode_held_blocks` is set on every tick (`publish_load`), so it falls back to 0 when a
    lease ends with no step run after it."""
    model, drafter = tiny()
    rig = Rig(model, drafter)
    held = rig.engine.metrics.held_blocks
    reserved = rig.reserve(PROMPTS[1], lease_ms=20)
    assert isinstance(reserved, Reserved)
    load = rig.engine.publish_load()
    assert load.held_blocks > 0 and held._value.get() == load.held_blocks
    time.sleep(0.05)
    rig.engine.poll()  # ticks as the loop runs them: the lease expires, then its blocks come back
    rig.assert_all_free()
    assert rig.engine.publish_load().held_blocks == 0 and held._value.get() == 0
    assert rig.engine.metrics.free_blocks._value.get() == load.total_blocks


def test_a_transfer_ending_wakes_the_idle_loop() -> None:
    """The Decode call came before its KV: the loop idles, and the transfer's end wakes it at once
    (`CommandInbox.wake`) instead of after `idle_wait_s` (an hour here: without the wake-up the tick
    below would not return in this test's lifetime)."""
    model, drafter = tiny()
    rig = Rig(model, drafter, idle_wait_s=3600.0)
    reports: list[Output] = []
    loop = EngineLoop(rig.engine, LocalChannel(),
                      on_report=lambda rs: reports.extend(o for r in rs for o in r.outputs))
    tokens = PROMPTS[1]
    reserved = rig.reserve(tokens)
    assert isinstance(reserved, Reserved)
    rig.attach(reserved, tokens, rig.engine.model.config.vocab_size - 1, 4)  # the transfer is still open
    assert not rig.engine.poll() and not rig.engine.has_work()  # no news yet: the next tick idles
    ticked = threading.Event()
    thread = threading.Thread(target=lambda: (loop.tick(), ticked.set()), daemon=True)
    thread.start()  # idles in `take` until something wakes it
    rig.prefill(reserved, tokens)  # its last write ends the transfer, whose `on_finish` wakes the loop
    assert ticked.wait(timeout=120.0), "the loop slept through the transfer's end"
    assert any(isinstance(o, Tokens) and o.request_id == reserved.request_id for o in reports)


def test_sampling_seed_logprobs_and_stop(reference: list[list[int]]) -> None:
    model, drafter = tiny()
    rig = Rig(model, drafter)
    tokens = PROMPTS[1]
    runs = []
    for _ in range(2):
        reserved = rig.reserve(tokens)
        assert isinstance(reserved, Reserved)
        rig.attach(reserved, tokens, rig.prefill(reserved, tokens), 5, temperature=1.0, seed=1234, logprobs=3)
        runs.append(reserved.request_id)
    rig.run()
    assert rig.tokens(runs[0]) == rig.tokens(runs[1])  # same seed, same tokens (batched together)
    chunks = [o for o in rig.outputs if isinstance(o, Tokens) and o.request_id == runs[0]]
    for chunk in chunks:
        assert len(chunk.logprobs) == len(chunk.token_ids) == len(chunk.top_logprobs)
        for top in chunk.top_logprobs:
            assert len(top) == 3 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)

    stop_at = reference[1][3]
    reserved = rig.reserve(tokens)
    assert isinstance(reserved, Reserved)
    rig.attach(reserved, tokens, rig.prefill(reserved, tokens), 20, stop_token_ids=(stop_at,))
    rig.run()
    out = rig.tokens(reserved.request_id)
    assert out == reference[1][1 : 1 + reference[1][1:].index(stop_at) + 1]
    done = rig.finished(reserved.request_id)
    assert isinstance(done, Finished) and done.finish_reason == "stop"
    rig.assert_all_free()


def test_bad_calls_get_precise_errors() -> None:
    model, drafter = tiny()
    rig = Rig(model, drafter)
    reserved = rig.reserve(PROMPTS[1])
    assert isinstance(reserved, Reserved)
    rig.attach(reserved, PROMPTS[1][:-1], 5, 4)  # not the leased prompt
    bad = rig.finished(reserved.request_id)
    assert isinstance(bad, Failed) and bad.kind is ErrorKind.INVALID_ARGUMENT and bad.field == "token_ids"
    again = rig.reserve(PROMPTS[0], request_id="dup")
    dup = rig.reserve(PROMPTS[0], request_id="dup")
    assert isinstance(again, Reserved) and isinstance(dup, Failed) and dup.field == "request_id"
    rig.engine.handle(CancelCommand(0, "dup", again.lease_id))
    huge = rig.reserve(prompt(200 * 32, 5))
    assert isinstance(huge, Failed) and huge.kind is ErrorKind.RESOURCE_EXHAUSTED and huge.retry_after_ms > 0
    rig.assert_all_free()


def test_effort_sets_the_draft_length(reference: list[list[int]]) -> None:
    """Effort e verifies at most ceil(K e / 100) drafts per pass: with a drafter equal to the target every
    draft is accepted, so each verify chunk is exactly the limit plus the bonus token."""
    assert [DecodeConfig.draft_limit(e, 5) for e in (1, 20, 21, 25, 50, 75, 100)] == [1, 1, 2, 2, 3, 4, 5]
    assert DecodeConfig.draft_limit(100, 0) == 0  # no drafter
    model, _ = tiny()
    tokens, k = PROMPTS[0], model.config.dspark_block_size
    for effort in (100, 50, 1):
        limit = DecodeConfig.draft_limit(effort, k)
        rig = Rig(model, None, proposer=TargetProposer(model, k))
        reserved = rig.reserve(tokens)
        assert isinstance(reserved, Reserved)
        rig.attach(reserved, tokens, rig.prefill(reserved, tokens), 1 + 2 * (limit + 1), effort=effort)
        rig.run()
        chunks = [len(o.token_ids) for o in rig.outputs if isinstance(o, Tokens)]
        assert chunks == [1, limit + 1, limit + 1], (effort, chunks)
        assert rig.engine.drafted_tokens == 2 * limit
        assert [reference[0][0], *rig.tokens(reserved.request_id)] == reference[0][: 2 + 2 * (limit + 1)]
        rig.assert_all_free()


@pytest.mark.parametrize("slack_s", [0.0, 2.0])
def test_effort_sets_the_join_order(slack_s: float) -> None:
    """One batch slot, three requests attached together (max, high, low): with slack the cheapest effort
    runs first, without it arrival order; every class's wait for its slot is measured."""
    model, _ = tiny()
    rig = Rig(model, None, max_running_requests=1, effort_queue_slack_s=slack_s)
    ids = {}
    ready = []
    for i, (name, effort) in enumerate([("max", 100), ("high", 75), ("low", 50)]):
        tokens = prompt(20, 30 + i)
        reserved = rig.reserve(tokens, request_id=name)
        assert isinstance(reserved, Reserved), reserved
        ready.append((reserved, tokens, rig.prefill(reserved, tokens), effort))
        ids[name] = reserved.request_id
    # Attached back to back, after every prefill: a request falls due at its attach time plus its slack,
    # so a prefill between two attaches on a slow host could outlast the slacks' difference.
    for reserved, tokens, prefilled, effort in ready:
        rig.attach(reserved, tokens, prefilled, 3, effort=effort)
    rig.run()
    finished = [o.request_id for o in rig.outputs if isinstance(o, Finished)]
    assert finished == (["low", "high", "max"] if slack_s else ["max", "high", "low"])
    registry = rig.engine.metrics.registry
    assert all(registry.get_sample_value("cedserve_decode_queue_seconds_count", {"effort_class": k}) == 1
               for k in ids)
    waits = {k: registry.get_sample_value("cedserve_decode_queue_seconds_sum", {"effort_class": k}) for k in ids}
    assert waits[finished[0]] < waits[finished[-1]]  # type: ignore[operator]
    rig.assert_all_free()
