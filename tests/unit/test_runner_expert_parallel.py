"""The model runner with expert parallelism: its MoE layers exchange rows through the fixed-capacity
all-to-all (`cedserve.model.expert_exchange`), whose shapes never depend on the routing, so the
step could be captured with its collectives. Two real processes form a gloo group (CPU: the runner
steps eagerly); each holds half of every layer's routed experts.

* the exchange: every pair's row comes back as sent, each rank receives exactly its experts' pairs,
  a rank may send nothing; the expert-parallel `DeviceMoE` (dense and grouped) equals one rank
  holding every expert on fresh random rows, the worst case (every pair to one rank's experts,
  which fills its capacity and leaves the other rank's empty) included;
* the runner's step with EP = 2 equals the runner's step with EP = 1 on the same weights, with
  several rows per slot and a rank feeding no rows in some steps (it runs the group's bucket);
* a decode engine with EP = 2 and the runner on emits the tokens of one rank (EP = 1) with it on.

The captured form needs NCCL: tests/unit/test_runner_gpu.py (`-k expert_parallel`).
"""

from __future__ import annotations

import pytest
import torch
from decode_support import (
    EXCHANGE_CASES,
    GROUP_JOBS,
    RUNNER_CONFIG,
    RUNNER_SCHEDULE,
    exchange_worker,
    group_engine_tokens,
    group_engine_worker,
    run_schedule,
    runner_ep_worker,
    runner_states,
    tiny,
)
from test_decode_expert_parallel import run_group

from cedserve.decode_workers.expert_parallel import SingleRank, experts_of
from cedserve.decode_workers.loop import LocalChannel
from cedserve.decode_workers.slot_book import runner_unavailable
from cedserve.model.runner import ModelRunner, RunnerConfig

pytestmark = pytest.mark.unit

MOE_ATOL = 1e-6
"""Expert-parallel MoE vs one rank, float32, outputs of scale ~0.02: the same expert GEMMs over other
batches of rows and the per-token sums in another order (seen <= 8e-9)."""
GROUPED_ATOL = 3e-4
"""The grouped (bf16) path vs its one-rank form, same scale: each pair's output is rounded to bf16, so
a float32 difference of one ulp in a row's GEMM can move it by a bf16 step (~1e-4 here; seen 6e-5)."""
RUNNER_ATOL = 2e-4
"""Runner logits EP = 2 vs EP = 1 (both float32 on the kernels' torch references): as the runner vs
`forward_batch` (tests/unit/test_runner.py); a record rounding the other way would show here."""


def test_exchange_and_expert_parallel_moe() -> None:
    model, _ = tiny()
    k, experts = model.config.num_experts_per_tok, model.config.n_routed_experts
    reports = {rank: (trip, results) for rank, trip, results in run_group(exchange_worker, 2, 240.0)}
    (ok0, got0, idx0, w0, sized), (ok1, got1, idx1, _, _) = reports[0][0], reports[1][0]
    assert ok0 and ok1 and idx1 == []  # rows came back as sent; rank 1 sent nothing
    assert sized  # buffer_bytes == fixed_capacity_bytes
    for rank, got in ((0, got0), (1, got1)):
        owned = experts_of(rank, 2, experts)
        sent = sorted((e, w) for row_e, row_w in zip(idx0, w0) for e, w in zip(row_e, row_w) if e in owned)
        assert [e for e, _ in got] == [e for e, _ in sent]
        torch.testing.assert_close(torch.tensor([w for _, w in got]), torch.tensor([w for _, w in sent]))
    for rank in (0, 1):
        results = reports[rank][1]
        assert [case for case, *_ in results] == [case for case, _, _ in EXCHANGE_CASES]
        for (case, seen, dense_err, grouped_err, scale), (_, rows, owner) in zip(results, EXCHANGE_CASES):
            assert scale > 1e-3, case
            assert dense_err <= MOE_ATOL, (rank, case, dense_err)
            assert grouped_err <= GROUPED_ATOL, (rank, case, grouped_err)
            if owner is not None:  # the worst case: all pairs of both ranks here, or none
                assert seen == (2 * rows * k if owner == rank else 0), (rank, case, seen)


def test_runner_step_with_two_ranks_equals_one_rank() -> None:
    reports = dict(run_group(runner_ep_worker, 2, 240.0))
    for rank, steps in reports.items():
        model, _ = tiny()
        model.use_paged_attention("reference")
        try:
            runner = ModelRunner(model, RunnerConfig(**RUNNER_CONFIG))
            want = run_schedule(runner, runner_states(model, rank), RUNNER_SCHEDULE[rank])
        finally:
            model.use_paged_attention(None)
        assert len(steps) == len(want)
        for step, ((tokens, logits), (want_tokens, want_logits)) in enumerate(zip(steps, want)):
            assert tokens == want_tokens, (rank, step)
            got = torch.tensor(logits).reshape(want_logits.shape)
            torch.testing.assert_close(
                got, want_logits, atol=RUNNER_ATOL, rtol=0, msg=f"rank {rank} step {step}"
            )


def test_decode_group_with_the_runner_emits_the_tokens_of_one_rank() -> None:
    """The real engine loop on two ranks with `runner = "on"` (every draft verified, the proposer
    always drafting: the rows do not depend on timing): the tokens of one rank running every request
    with the runner on. Rank 1's request finishes first; it then steps with no rows of its own."""
    reports = {
        rank: (tokens, passes, steps)
        for rank, tokens, passes, steps in run_group(group_engine_worker, 2, 240.0, "on")
    }
    single, engine = group_engine_tokens(
        0, LocalChannel(), SingleRank(tiny()[0].config.n_routed_experts), "on", 1
    )
    assert engine.slots is not None and engine.slots.runner.steps > 0
    tokens = reports[0][0]
    assert tokens == single
    assert [len(tokens[f"g{i}"]) for i in range(len(GROUP_JOBS))] == [n for _, _, n in GROUP_JOBS]
    steps0, steps1 = reports[0][2], reports[1][2]
    assert steps0 >= 5 and steps1 == steps0  # every runner step on both ranks, rank 1's idle ones too


def test_runner_mode_with_expert_parallelism() -> None:
    model, _ = tiny()
    assert runner_unavailable(model, "on", 2) is None
    assert "expert parallelism" in (runner_unavailable(model, "auto", 2) or "")


def test_engine_over_a_group_of_one_with_the_runner() -> None:
    """`TorchDistributedEP` over a one-rank gloo group in this process (what tests/unit/test_runner_gpu.py
    runs over NCCL on a one-GPU host, with graphs): the runner gets a one-rank exchange, steps
    collectively, and the engine emits the tokens of the engine without expert parallelism."""
    import torch.distributed as dist
    from decode_support import Rig, prompt
    from test_decode_expert_parallel import free_port

    from cedserve.decode_workers.expert_parallel import TorchDistributedEP

    model, _ = tiny()
    prompts = [prompt(37, 1), prompt(50, 3)]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    outs = []
    try:
        for ep in (None, TorchDistributedEP(model.config.n_routed_experts)):
            rig = Rig(model, None, dspark=False, runner="on", max_running_requests=4, ep=ep)
            rids = []
            for tokens in prompts:
                reserved = rig.reserve(tokens, sender=False)
                rig.attach(reserved, tokens, None, 6)
                rids.append(reserved.request_id)
            rig.run()
            outs.append([rig.tokens(rid) for rid in rids])
            rig.assert_all_free()
            assert rig.engine.slots is not None and rig.engine.slots.collective == (ep is not None)
            assert rig.engine.slots.runner.steps >= 4
    finally:
        dist.destroy_process_group()
    assert outs[0] == outs[1] and [len(o) for o in outs[0]] == [6, 6]


def test_expert_parallel_moe_is_the_same_graph_for_other_routings() -> None:
    """The runner's expert-parallel MoE layer (`DeviceMoE` with an exchange over a one-rank gloo group in
    this process), traced on two batches of other rows, so other routings: the same operations on the
    same buffers with the same arguments, its collectives included, and nothing read on the host
    (`cedserve.model.capture_trace`): what a CUDA graph of it replays. The whole step's trace on its
    CUDA branches is tests/kernels/test_capture_trace.py's (without an exchange)."""
    import copy

    import torch.distributed as dist
    from test_decode_expert_parallel import free_port

    from cedserve.model.capture_trace import compare, trace
    from cedserve.model.device_moe import DeviceMoE
    from cedserve.model.expert_exchange import FixedCapacityEP
    from cedserve.model.fused import FusedOps

    model, _ = tiny()
    c = model.config
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        exchange = FixedCapacityEP(c.n_routed_experts, 8, c.num_experts_per_tok, c.hidden_size)
        moe, ops = DeviceMoE(copy.deepcopy(model.layers[3].ffn), "dense", exchange), FusedOps(compiled=False)
        gen = torch.Generator().manual_seed(9)
        static = torch.zeros(6, c.hidden_size)  # a graph's input buffer, refilled between the traces
        traces = []
        for _ in range(2):
            static.copy_(torch.randn(6, c.hidden_size, generator=gen))
            with torch.no_grad():
                traces.append(trace(lambda: moe(static, ops))[0])
        first, second = traces
        assert not first.host_reads and not second.host_reads, [str(op) for op in first.host_reads]
        assert sum(op.name.startswith("c10d.") for op in first.ops) == 3  # dispatch rows, metadata; combine
        assert compare(first, second) is None, compare(first, second)
    finally:
        dist.destroy_process_group()
