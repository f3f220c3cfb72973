"""Chunked-prefill scheduling: budget, chunk cap, block-aligned chunks, FIFO admission."""

from __future__ import annotations

import pytest

from cedserve.prefill_workers.scheduler import PrefillScheduler


def make(chunk: int = 128, budget: int = 256, block: int = 64, running: int = 4) -> PrefillScheduler:
    return PrefillScheduler(chunk, budget, block, running)


def admit_all(s: PrefillScheduler, start: int = 0) -> None:
    s.admit_waiting(lambda rid: start)


def test_long_prompt_does_not_block_short_one() -> None:
    s = make()
    s.add("long", 10_000)
    s.add("short", 50)
    admit_all(s)
    plan = s.schedule()
    assert [(c.request_id, c.start, c.end, c.last) for c in plan] == [("long", 0, 128, False), ("short", 0, 50, True)]
    s.finish("short")
    assert s.num_running == 1


def test_chunks_end_on_block_boundaries_except_the_last() -> None:
    s = make(chunk=128, budget=200)
    s.add("a", 300)
    admit_all(s)
    ends = []
    while s.num_running:
        for c in s.schedule():
            ends.append(c.end)
            if c.last:
                s.finish(c.request_id)
    assert ends == [128, 256, 300]


def test_budget_is_shared_in_arrival_order() -> None:
    s = make(chunk=128, budget=256)
    for rid in "abc":
        s.add(rid, 1000)
    admit_all(s)
    assert [c.request_id for c in s.schedule()] == ["a", "b"]
    assert s.queued_tokens() == 3000 - 256


def test_budget_remainder_below_a_block_skips_unfinishable_chunk() -> None:
    s = make(chunk=128, budget=160)
    s.add("a", 1000)
    s.add("b", 1000)
    s.add("c", 20)
    admit_all(s)
    plan = s.schedule()
    # a takes 128, 32 left: b would need a whole block; c (20 tokens, its last chunk) fits.
    assert [(c.request_id, c.num_tokens) for c in plan] == [("a", 128), ("c", 20)]


def test_admission_is_fifo_and_stops_when_blocks_run_out() -> None:
    s = make(running=8)
    for rid in ("a", "b", "c"):
        s.add(rid, 100)
    room = {"a": 0, "b": None, "c": 0}
    s.admit_waiting(lambda rid: room[rid])
    assert s.num_running == 1 and s.num_waiting == 2  # c does not overtake b


def test_admission_starts_after_cached_prefix_and_respects_max_running() -> None:
    s = make(running=1)
    s.add("a", 200)
    s.add("b", 200)
    s.admit_waiting(lambda rid: 128)
    plan = s.schedule()
    assert [(c.request_id, c.start, c.end) for c in plan] == [("a", 128, 200)]
    assert s.num_waiting == 1


def test_failed_admission_removes_the_request() -> None:
    s = make()
    s.add("a", 100)
    s.add("b", 100)

    def admit(rid: str) -> int | None:
        if rid == "a":
            s.remove("a")
            return None
        return 0

    s.admit_waiting(admit)
    assert "a" not in s and s.num_running == 1


def test_rejects_unaligned_chunks_and_duplicates() -> None:
    with pytest.raises(ValueError, match="multiple of block_size"):
        make(chunk=100)
    s = make()
    s.add("a", 10)
    with pytest.raises(ValueError, match="already scheduled"):
        s.add("a", 10)


def test_waiting_requests_are_admitted_earliest_due_first_and_ties_keep_arrival_order() -> None:
    s = make(running=1)
    for rid, due in [("a", 5.0), ("b", 1.0), ("c", 5.0), ("d", 3.0)]:
        s.add(rid, 64, due)
    order = []
    while s.num_waiting or s.num_running:
        admit_all(s)
        for c in s.schedule():
            order.append(c.request_id)
            s.finish(c.request_id)
    assert order == ["b", "d", "a", "c"]


def test_a_blocked_head_is_not_overtaken_by_later_due_requests() -> None:
    s = make(running=4)
    s.add("big", 4096, due=1.0)
    s.add("small", 64, due=2.0)
    asked = []
    s.admit_waiting(lambda rid: asked.append(rid) or None)  # no blocks for the head yet
    assert asked == ["big"] and s.num_waiting == 2 and s.num_running == 0


def test_running_requests_take_the_step_budget_in_due_order() -> None:
    s = make(chunk=128, budget=128)
    s.add("late", 1000, due=9.0)
    admit_all(s)
    s.add("early", 1000, due=1.0)  # admitted second, due first
    admit_all(s)
    assert [c.request_id for c in s.schedule()] == ["early"]
