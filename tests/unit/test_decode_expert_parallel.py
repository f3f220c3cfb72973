"""Expert parallelism: routed experts sharded across ranks, dispatch and combine over torch.distributed
(gloo here, NCCL on GPUs), give the logits of one process holding every expert.

Two real processes form a gloo group; each holds half of every layer's routed experts and runs its
own sequences' attention (data parallel); tokens travel to the expert's owner and back at every MoE
layer. A rank with nothing to run still takes part in every exchange (the engine runs an empty pass).
"""

from __future__ import annotations

import contextlib
import copy
import queue
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from decode_support import greedy_ties, group_items, tiny

from cedserve.decode_workers.expert_parallel import (
    SingleRank,
    ep_moe,
    experts_of,
    shard_experts,
    slot_positions,
)

pytestmark = pytest.mark.unit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


EVERY_RANK_REPORTS = ("ep_forward_worker", "fixed_capacity_worker", "exchange_worker", "runner_ep_worker",
                      "group_engine_worker")


def run_group(target: object, world: int = 2, timeout_s: float = 240.0, *extra: object) -> list[object]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, world, port, out, *extra)) for rank in range(world)]
    for p in procs:
        p.start()
    results: list[object] = []
    expected = world if target.__name__ in EVERY_RANK_REPORTS else 1  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < expected:
            assert time.monotonic() < deadline, "the group did not finish in time"
            assert not any(p.exitcode for p in procs), [p.exitcode for p in procs]  # a rank crashed
            with contextlib.suppress(queue.Empty):
                results.append(out.get(timeout=1.0))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results


def test_single_rank_dispatch_and_combine_are_bit_exact() -> None:
    model, _ = tiny()
    ffn = model.layers[7].ffn
    x = torch.randn(37, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ep_moe(SingleRank(model.config.n_routed_experts), ffn, x), ffn(x))
    assert ep_moe(SingleRank(model.config.n_routed_experts), ffn, x[:0]).shape == (0, model.config.hidden_size)


def test_sharding_keeps_only_owned_experts() -> None:
    model, _ = tiny()
    assert list(experts_of(1, 2, 8)) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="group_size"):
        experts_of(0, 3, 8)
    sharded, _ = tiny(seed=8)
    dropped = shard_experts(sharded, 0, 2)
    assert dropped == 4 * model.config.num_hidden_layers
    with pytest.raises(RuntimeError, match="owned by another rank"):
        sharded.layers[0].ffn.experts[5](torch.zeros(1, model.config.hidden_size))


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_two_ranks_give_the_logits_of_one_rank(device: str) -> None:
    """gloo on CPU; NCCL with one GPU per rank (runs where two GPUs are present)."""
    from decode_support import ep_forward_worker

    if device == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    results = {rank: (logits, extra) for rank, logits, extra in run_group(ep_forward_worker, 2, 240.0, device)}
    model, _ = tiny(seed=7)
    if device == "cuda":
        model = copy.deepcopy(model).to("cuda:0")
    items = group_items(model, 0) + group_items(model, 1)
    single = [o.logits.cpu() for o in model.forward_batch(items)]  # one process, every expert, same row order
    distributed = [torch.tensor(t) for t in results[0][0] + results[1][0]]
    for one, two in zip(single, distributed):
        # The routed experts see the same rows in the same order; only the router's matmul runs over
        # fewer rows per rank, which rounds differently (~1e-7) and can move an FP8 window record.
        assert torch.allclose(one, two, atol=1e-4, rtol=0), (one - two).abs().max()
        assert torch.equal(one.argmax(-1), two.argmax(-1))
    alone = model.forward_batch(group_items(model, 0)[:1])[0].logits.cpu()
    assert torch.allclose(torch.tensor(results[0][1][0]), alone, atol=1e-4, rtol=0)  # rank 1 ran an empty pass
    assert results[1][1] == []


@pytest.mark.slow
def test_two_rank_decode_group_runs_in_step() -> None:
    """The real engine loop on two ranks: requests on both, one rank idle at the end (empty passes)."""
    from decode_support import GROUP_JOBS, group_engine_worker

    reports = {rank: (tokens, passes) for rank, tokens, passes, _ in run_group(group_engine_worker)}
    tokens, passes = reports[0]
    model, _ = tiny()
    for i, (_, prompt_ids, n) in enumerate(GROUP_JOBS):
        assert len(tokens[f"g{i}"]) == n
        assert len(greedy_ties(model, prompt_ids, tokens[f"g{i}"])) <= 1
    assert passes >= 7 and reports[1][1] == passes  # the same passes on both ranks


def test_slot_positions_pack_each_destination_in_send_order() -> None:
    owner = torch.tensor([1, 0, 1, 1, 0, 2])
    assert slot_positions(owner, 3, 4).tolist() == [4, 0, 5, 6, 1, 8]
    assert slot_positions(owner[:0], 3, 4).tolist() == []
    every = torch.zeros(8, dtype=torch.long)  # the worst case the capacity is sized for: all to one rank
    assert slot_positions(every, 2, 8).tolist() == list(range(8))


@pytest.mark.slow
def test_fixed_capacity_exchange_equals_the_counted_one() -> None:
    """Two gloo ranks: the fixed-shape dispatch/combine (equal splits, no read-back) gives each rank
    the MoE output of the counted exchange, for a full batch, a padded one and an empty one. The
    experts see their rows in larger batches (every received row, unrouted ones weighted 0), so
    their matmuls may round differently: 1e-5."""
    from decode_support import fixed_capacity_worker

    for rank, results in run_group(fixed_capacity_worker, 2, 240.0):
        assert [n for n, _, _ in results] == [16, 16, 5, 5] + ([0, 0] if rank == 1 else [3, 3])
        for n, fixed, counted in results:
            got, want = torch.tensor(fixed).flatten(), torch.tensor(counted).flatten()
            assert want.abs().max() > 0 if n else want.numel() == 0
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
