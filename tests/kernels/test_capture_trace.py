"""The model runner's and the drafter runner's steps are graph-safe: traced with two different staged
inputs in one bucket (other slots, tokens, positions, sampling), they run the same operations on
the same buffers with the same arguments and read nothing on the host
(`cedserve.model.capture_trace`), so a CUDA graph captured from one replays the other. The runner's
step is traced on its CUDA branches: on a GPU as it runs there, on a CPU with those branches forced
and the Triton kernels interpreted (each launch is one recorded operation with its arguments). The checker itself is shown to fail on the faults it exists for."""

from __future__ import annotations

import pytest
import torch

from cedserve.model.capture_trace import Trace, compare, trace
from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model
from cedserve.model.draft_runner import DraftRunner, DraftRunnerConfig
from cedserve.model.dspark import Drafter
from cedserve.model.expert_exchange import FixedCapacityEP
from cedserve.model.fused import FusedOps
from cedserve.model.network import CEDModel
from cedserve.model.prefill_runner import PrefillRunner, PrefillRunnerConfig
from cedserve.model.presets import preset
from cedserve.model.runner import ModelRunner, RunnerConfig, _offsets
from cedserve.model.sampling import SamplingParams
from cedserve.model.tokenizer import tiny_tokenizer_path

pytestmark = pytest.mark.kernels
CUDA = torch.cuda.is_available()


def tiny_on_device() -> tuple[CEDModel, Drafter]:
    # 4 Sinkhorn iterations instead of 20: the interpreter's time is in the mHC sites' tails
    config = fit_config_to_tokenizer(preset("tiny"), tiny_tokenizer_path()).replace(hc_sinkhorn_iters=4)
    model, drafter = random_model(config, tiny_tokenizer_path(), seed=7)
    if CUDA:
        model, drafter = model.cuda(), drafter.cuda()
    model.use_paged_attention("kernels" if CUDA else "reference")
    return model, drafter


def prefilled_runner(model: CEDModel, lengths: list[int], exchange: FixedCapacityEP | None = None) -> ModelRunner:
    gen = torch.Generator().manual_seed(7)
    runner = ModelRunner(model, RunnerConfig(max_slots=6, max_context=256, buckets=(1, 2, 4, 6)), exchange=exchange)
    for slot, length in enumerate(lengths):
        state = model.new_state()
        model.prefill(torch.randint(3, 500, (length,), generator=gen).tolist(), state)
        runner.load(slot, state)
    if not CUDA:  # the CUDA branches, the kernels interpreted
        cuda_branches(runner)
    return runner


def cuda_branches(runner: ModelRunner | PrefillRunner) -> None:
    """The slot step as it runs on CUDA (kernels, mHC sites and `wo_a` in Triton), on a CPU."""
    runner.slot_step.kernels, runner.slot_step.site_impl = True, "triton"
    runner.slot_step.ops = FusedOps(compiled=False, kernels=True)


def staged_step(runner: ModelRunner, slots: list[int], tokens: list[int], sampling: list[SamplingParams],
                bucket: int) -> Trace:
    runner._stage(slots, tokens, _offsets(slots), sampling, bucket)
    runner._upload()
    recorded, _ = trace(lambda: runner._forward(bucket))
    assert not recorded.host_reads, [str(op) for op in recorded.host_reads]
    return recorded


def test_runner_step_is_the_same_graph_for_other_inputs() -> None:
    model, _ = tiny_on_device()
    runner = prefilled_runner(model, [5, 37, 70, 101, 12])
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3)
    first = staged_step(runner, [0, 1, 2], [11, 12, 13], [greedy, hot, greedy], bucket=4)
    # other slots at other positions, a slot feeding two rows (a verify pass), other sampling
    second = staged_step(runner, [3, 4, 4], [40, 41, 42], [hot, greedy, greedy], bucket=4)
    assert len(first.ops) > 1000  # the whole step: every layer's operations were recorded
    assert any(op.name.startswith("triton.") for op in first.ops)  # and its kernels' launches
    assert any("_grouped_linear_kernel" in op.name for op in first.ops)  # wo_a's among them
    assert compare(first, second) is None, compare(first, second)
    third = staged_step(runner, [1], [9], [greedy], bucket=1)  # another bucket: another graph
    assert compare(first, third) is not None


@pytest.mark.slow
def test_expert_parallel_runner_step_is_the_same_graph_for_other_inputs() -> None:
    """The runner's step with a fixed-capacity exchange (expert parallelism; a one-rank group in this
    process: gloo on a CPU, NCCL on a GPU) on its CUDA branches: two staged inputs of one bucket, so
    other routings too, run the same operations on the same buffers, the exchange's collectives
    included, and read nothing on the host."""
    import socket

    import torch.distributed as dist

    from cedserve.decode_workers.expert_parallel import TorchDistributedEP

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if CUDA else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model, _ = tiny_on_device()
        c, device = model.config, model.embed.weight.device
        exchange = TorchDistributedEP(c.n_routed_experts).runner_exchange(6, c.num_experts_per_tok, c.hidden_size,
                                                                           torch.float32, device)
        runner = prefilled_runner(model, [5, 37, 70, 101, 12], exchange)
        greedy = SamplingParams(temperature=0.0)
        first = staged_step(runner, [0, 1, 2], [11, 12, 13], [greedy] * 3, bucket=4)
        second = staged_step(runner, [3, 4, 4], [40, 41, 42], [greedy] * 3, bucket=4)
        assert sum(op.name.startswith("c10d.") for op in first.ops) == 3 * c.num_hidden_layers
        assert compare(first, second) is None, compare(first, second)
    finally:
        dist.destroy_process_group()


def test_drafter_step_is_the_same_graph_for_other_inputs() -> None:
    model, drafter = tiny_on_device()
    runner = DraftRunner(drafter, model, DraftRunnerConfig(max_slots=4, buckets=(1, 2, 4)))
    c = model.config
    gen = torch.Generator().manual_seed(5)
    ends = [6, 30, 64, 17]
    taps = [torch.randn(e + 2, len(c.dspark_target_layer_ids), c.hc_mult, c.hidden_size, generator=gen).to(model.embed.weight.device)
            for e in ends]
    runner.observe(list(range(4)), [0] * 4, ends, taps)
    traces = []
    for slots, temperatures in (([0, 2], [0.0, 0.9]), ([3, 1], [1.1, 0.0])):
        runner._stage_draft(slots, [7 + s for s in slots], temperatures, [100 + s for s in slots], bucket=2)
        runner._inputs.copy_(runner._staging)
        recorded, _ = trace(lambda: runner._forward(2))
        assert not recorded.host_reads, [str(op) for op in recorded.host_reads]
        traces.append(recorded)
    assert len(traces[0].ops) > 50
    assert compare(traces[0], traces[1]) is None, compare(traces[0], traces[1])


def test_checker_finds_host_reads_baked_values_and_stray_buffers() -> None:
    """Each fault a captured graph would hide: the checker reports it."""
    buffer = torch.arange(8.0)

    def read_on_host() -> torch.Tensor:
        return buffer * float(buffer[0])  # .item(): a sync, and the value baked into the graph

    assert trace(read_on_host)[0].host_reads

    def from_host(values: list[int]) -> torch.Tensor:
        return buffer[torch.tensor(values)]  # a host copy per call

    assert compare(trace(lambda: from_host([1, 2]))[0], trace(lambda: from_host([3, 4]))[0]) is not None

    def scaled(by: float) -> torch.Tensor:
        return buffer * by  # a Python number: the capture's value is replayed

    assert compare(trace(lambda: scaled(2.0))[0], trace(lambda: scaled(3.0))[0]) is not None
    assert compare(trace(lambda: scaled(2.0))[0], trace(lambda: scaled(2.0))[0]) is None

    def add(other: torch.Tensor) -> torch.Tensor:
        return buffer + other  # a tensor made outside the static buffers: another address each time

    a, b = torch.ones(8), torch.ones(8)
    assert compare(trace(lambda: add(a))[0], trace(lambda: add(b))[0]) is not None
    assert compare(trace(lambda: add(a))[0], trace(lambda: add(a))[0]) is None


def test_prefill_runner_chunk_is_the_same_graph_for_other_inputs() -> None:
    """The prefill runner's chunk pass (`SlotStep.encode`) reads nothing on the host and is the same
    kernels on the same buffers for another chunk of the bucket (another length, slot and position,
    another state), so its captured graph replays right."""
    model, _ = tiny_on_device()
    runner = PrefillRunner(model, PrefillRunnerConfig(max_context=128, buckets=(8, 16), max_slots=2))
    gen = torch.Generator().manual_seed(3)
    for slot, length in enumerate((0, 37)):
        state = model.new_state()
        if length:
            model.prefill(torch.randint(3, 500, (length,), generator=gen).tolist(), state)
        runner.load(slot, state)
    if not CUDA:  # the CUDA branches, the kernels interpreted
        cuda_branches(runner)
    traces = []
    for slot, rows in ((0, 16), (1, 11)):
        runner._stage(slot, torch.randint(3, 500, (rows,), generator=gen).numpy(), 16)
        recorded, _ = trace(lambda: runner._forward(16))
        assert not recorded.host_reads, [str(op) for op in recorded.host_reads]
        traces.append(recorded)
    assert len(traces[0].ops) > 500 and any(op.name.startswith("triton.") for op in traces[0].ops)
    assert compare(traces[0], traces[1]) is None, compare(traces[0], traces[1])


@pytest.mark.slow
def test_grouped_rows_step_equals_per_row_and_is_graph_safe() -> None:
    """`RunnerConfig.grouped_attention` on the runner's CUDA branches (on a CPU: forced, the kernels
    interpreted): a verify step whose slots feed runs of 6, 1, 3 and 2 rows gives the per-row
    step's logits (the grouped sparse attention and index scan sum in another order: bf16 outputs
    that may differ by an ulp), and two staged inputs of one bucket with other runs trace the same
    graph."""
    model, _ = tiny_on_device()
    gen = torch.Generator().manual_seed(5)
    config = RunnerConfig(max_slots=4, max_context=512, max_rows_per_slot=6, buckets=(8, 16))
    grouped = ModelRunner(model, RunnerConfig(**{**config.__dict__, "grouped_attention": True}))
    per_row = ModelRunner(model, config)
    assert grouped.slot_step.group_rows == 6 and per_row.slot_step.group_rows == 1
    for slot, length in enumerate([9, 40, 130, 200]):
        state = model.new_state()
        model.prefill(torch.randint(3, 500, (length,), generator=gen).tolist(), state)
        grouped.load(slot, state)
        per_row.load(slot, state)
    if not CUDA:
        for runner in (grouped, per_row):
            cuda_branches(runner)
    slots = [s for s, rows in enumerate([6, 1, 3, 2]) for _ in range(rows)]
    feed = torch.randint(3, 500, (len(slots),), generator=gen).tolist()
    start = {s: grouped.position(s) for s in set(slots)}
    got, want = grouped.step_logits(slots, feed), per_row.step_logits(slots, feed)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
    for slot, position in start.items():
        grouped.rewind(slot, position)
    greedy = [SamplingParams(temperature=0.0)]
    first = staged_step(grouped, slots, feed, greedy * len(slots), bucket=16)
    second = staged_step(grouped, [0, 1, 1, 1, 1, 1, 2, 3, 3], feed[:9], greedy * 9, bucket=16)
    assert compare(first, second) is None, compare(first, second)
