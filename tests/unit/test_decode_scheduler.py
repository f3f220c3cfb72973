"""The decode scheduler's decisions alone: growth room, preemption order, resumption before new joins,
the batch and pass-size limits. The block pool is a small bookkeeping double (a dict of table sizes)."""

from __future__ import annotations

import math

import pytest

from cedserve.decode_workers.config import DecodeConfig, PreemptionPolicy
from cedserve.decode_workers.scheduler import BlockBudget, DecodeScheduler
from cedserve.decode_workers.sequence import DecodeSequence, JoinKind, Lease, Status
from cedserve.model.sampling import SamplingParams

pytestmark = pytest.mark.unit

BLOCK = 16


class Pool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.tables: dict[str, int] = {}

    def available(self) -> int:
        return self.num_blocks - sum(self.tables.values())

    def hold(self, seq: DecodeSequence) -> None:
        self.tables[seq.request_id] = math.ceil(len(seq.tokens) / BLOCK)


def seq(rid: str, num_tokens: int, arrival: int, join: JoinKind = JoinKind.REPLAY) -> DecodeSequence:
    lease = Lease(f"l-{rid}", rid, [], 0, float("inf"), True, num_tokens)
    return DecodeSequence(rid, lease, [3] * num_tokens, num_tokens, SamplingParams(max_tokens=100), None,
                          frozenset(), (), join, 8, arrival)


def scheduler(pool: Pool, lookahead: int = 1, offload_fits: bool = True, **config: object) -> DecodeScheduler:
    cfg = DecodeConfig(**config)  # type: ignore[arg-type]
    budget = BlockBudget(pool.available, lambda rid: pool.tables.get(rid, 0))
    return DecodeScheduler(cfg, BLOCK, budget, lookahead, lambda s: offload_fits)


def test_joins_in_order_within_the_batch_limit() -> None:
    pool = Pool(100)
    sched = scheduler(pool, max_running_requests=2)
    seqs = [seq(f"r{i}", 10, i) for i in range(3)]
    for s in seqs:
        pool.hold(s)
        sched.add(s)
    out = sched.schedule()
    assert out.running == ("r0", "r1") and [j.request_id for j in out.joins] == ["r0", "r1"]
    assert out.num_join_rows == 16 and not out.preemptions  # replay span 8 each
    assert seqs[2].status is Status.WAITING
    sched.remove("r0")
    assert sched.schedule().joins[0].request_id == "r2"


def test_growth_preempts_the_latest_and_it_resumes_first() -> None:
    pool = Pool(4)
    sched = scheduler(pool, lookahead=2)
    a, b = seq("a", 15, 0), seq("b", 15, 1)
    for s in (a, b):
        pool.hold(s)  # one block each
        sched.add(s)
    assert sched.schedule().running == ("a", "b")  # 15 + 2 tokens: a second block each, two are free
    for s in (a, b):
        s.tokens += [3] * 16
        pool.hold(s)  # 31 tokens: two blocks each, the pool is full
    out = sched.schedule()  # 31 + 2 tokens need a third block each: b goes, its two blocks cover a
    assert out.running == ("a",)
    assert [(p.request_id, p.policy) for p in out.preemptions] == [("b", PreemptionPolicy.OFFLOAD)]
    assert b.status is Status.PREEMPTED and b.join is JoinKind.ONLOAD
    del pool.tables["b"]  # the engine offloads it and frees its blocks
    pool.tables["a"] = 3
    c = seq("c", 5, 2)
    pool.hold(c)
    sched.add(c)
    out = sched.schedule()  # b needs 3 blocks to return, none are free: c waits behind it
    assert not out.joins and out.running == ("a",)
    sched.remove("a")
    del pool.tables["a"]
    out = sched.schedule()
    assert [j.request_id for j in out.joins] == ["b", "c"] and out.joins[0].resumed


def test_offload_falls_back_to_recompute_when_the_host_budget_is_spent() -> None:
    pool = Pool(4)
    sched = scheduler(pool, offload_fits=False)
    a, b = seq("a", 15, 0), seq("b", 15, 1)
    for s in (a, b):
        pool.hold(s)
        sched.add(s)
    sched.schedule()
    for s in (a, b):
        s.tokens += [3] * 17
        pool.hold(s)
    out = sched.schedule()
    assert [p.policy for p in out.preemptions] == [PreemptionPolicy.RECOMPUTE] and b.join is JoinKind.RECOMPUTE


def test_pass_row_limit_lets_one_oversized_join_run_alone() -> None:
    pool = Pool(100)
    sched = scheduler(pool, max_pass_tokens=20)
    big, small = seq("big", 40, 0, JoinKind.PREFILL), seq("small", 10, 1, JoinKind.PREFILL)
    for s in (big, small):
        pool.hold(s)
        sched.add(s)
    assert [j.request_id for j in sched.schedule().joins] == ["big"]
    assert [j.request_id for j in sched.schedule().joins] == ["small"]


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match=r"decode\.preemption"):
        DecodeConfig(preemption="swap")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"decode\.max_running_requests"):
        DecodeConfig(max_running_requests=0)



def test_config_table_refuses_unknown_and_mistyped_fields() -> None:
    with pytest.raises(ValueError, match=r"decode\.max_runing_requests.*unknown field"):
        DecodeConfig.from_mapping({"max_runing_requests": 8})
    with pytest.raises(ValueError, match=r"decode"):
        DecodeConfig.from_mapping({"max_running_requests": "eight"})
    with pytest.raises(ValueError, match=r"decode\.effort_queue_slack_s"):
        DecodeConfig.from_mapping({"effort_queue_slack_s": -1})
    config = DecodeConfig.from_mapping({"preemption": "recompute", "effort_queue_slack_s": 1, "device": "cuda:0"})
    assert config.preemption is PreemptionPolicy.RECOMPUTE and config.effort_queue_slack_s == 1.0


def test_joins_take_the_earliest_due_first() -> None:
    pool = Pool(100)
    sched = scheduler(pool, max_running_requests=2)
    for i, (rid, due) in enumerate([("max", 2.0), ("high", 1.5), ("low", 1.0)]):  # arrival order
        s = seq(rid, 10, i)
        s.due_s = due
        pool.hold(s)
        sched.add(s)
    out = sched.schedule()
    assert [j.request_id for j in out.joins] == ["low", "high"] and out.running == ("low", "high")


def test_preemption_takes_the_latest_due_and_it_still_returns_before_new_joins() -> None:
    pool = Pool(4)
    sched = scheduler(pool, lookahead=2)
    early_max, late_low = seq("early-max", 15, 0), seq("late-low", 15, 1)
    early_max.due_s, late_low.due_s = 2.0, 1.0
    for s in (early_max, late_low):
        pool.hold(s)
        sched.add(s)
    assert sched.schedule().running == ("late-low", "early-max")
    for s in (early_max, late_low):
        s.tokens += [3] * 16
        pool.hold(s)  # two blocks each, the pool is full; a third each is needed
    out = sched.schedule()
    assert [p.request_id for p in out.preemptions] == ["early-max"] and out.running == ("late-low",)
    del pool.tables["early-max"]  # offloaded: its blocks are free
    newcomer = seq("new", 5, 2)
    newcomer.due_s = 0.0
    pool.hold(newcomer)
    sched.add(newcomer)
    sched.remove("late-low")
    del pool.tables["late-low"]
    assert [j.request_id for j in sched.schedule().joins] == ["early-max", "new"]


def test_steady_means_the_next_schedule_keeps_the_batch() -> None:
    """`steady()` (the overlapped steps' condition): no one can join and every running request's growth
    fits; each time it says so, `schedule` indeed neither joins nor preempts."""
    pool = Pool(4)
    sched = scheduler(pool, lookahead=1, max_running_requests=2)
    a, b = seq("a", 15, 0), seq("b", 14, 1)
    assert sched.steady()  # nothing runs or waits: nothing would change (the engine also asks for a batch)
    for s in (a, b):
        pool.hold(s)
        sched.add(s)
    assert not sched.steady()  # two wait and there is room: they would join
    sched.schedule()
    assert sched.steady()  # 15 + 1 and 14 + 1 tokens fit their one block each
    out = sched.schedule()
    assert not out.joins and not out.preemptions
    c = seq("c", 5, 2)
    pool.hold(c)
    sched.add(c)
    assert sched.steady()  # c waits, but the batch is full: it cannot join
    a.tokens += [3]  # 16 tokens + 1: a needs a second block; one of the pool's four is free
    assert sched.steady()
    b.tokens += [3, 3]  # 16 + 1 as well: two more blocks needed, one is free: a preemption would follow
    assert not sched.steady()
    out = sched.schedule()
    assert out.preemptions
