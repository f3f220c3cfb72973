"""The model runner on a GPU: graph replays equal the eager slot step (every bucket, full and
padded, with rows joining and leaving, sampled with seeds), and the slot step equals
`forward_batch` on the paged kernels; the DSpark drafter's graphs equal its eager step, and the
engine with the drafter on slots emits the tokens it emits without, as do its overlapped steps; with the Engram tables in an
`EngramStore`, graph replays equal those over the loaded tables. Skipped without CUDA (`PART=runner bash scripts/gpu.sh` runs them)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from decode_support import tiny, tiny_bf16

from cedserve.model.draft_runner import DraftRunner, DraftRunnerConfig
from cedserve.model.dspark import Drafter
from cedserve.model.network import BatchItem, CEDModel
from cedserve.model.runner import ModelRunner, RunnerConfig
from cedserve.model.sampling import SamplingParams
from cedserve.model.state import SequenceState

pytestmark = [pytest.mark.unit, pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GRAPH_ATOL = 1e-5
"""Graph replay vs the same step run eagerly: the same kernels on the same values (seen: 0)."""
INDUCTOR_GRAPH_ATOL = 2e-3
"""The same with `compile_fused`: Inductor compiles each captured bucket's shapes on their own, so its
reductions may split differently from the eager step's compile (float32 rounding, amplified by the
FP8/FP4 records a step writes). Seen on one H200: 2.8e-4 on logits of scale ~1."""
KERNEL_ATOL = 0.25
"""Slot step vs `forward_batch`, both on the kernels (bf16 attention): as the paged path's CPU bound."""
BF16_INDUCTOR_GRAPH_ATOL = 0.05
"""`compile_fused` graphs against the eager step with bf16 weights (`[model] dtype`): Inductor's fused
chains round their bf16 outputs where the eager ops round theirs. Not measured on a GPU yet: a first
guess from the CPU runner's bf16 bound (tests/unit/test_weights_dtype.py, RUNNER_ATOL)."""
DTYPES = pytest.mark.parametrize("dtype", ["float32", "bfloat16"])


def cuda_model(dtype: str = "float32") -> CEDModel:
    model, _ = tiny() if dtype == "float32" else tiny_bf16()
    model = copy.deepcopy(model).cuda()
    model.use_paged_attention("kernels")
    return model


def states(model: CEDModel, lengths: list[int], seed: int) -> list[tuple[SequenceState, int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        state = model.new_state()
        tokens = torch.randint(3, 500, (length,), generator=gen).tolist()
        out.append((state, int(model.prefill(tokens, state)[-1].argmax())))
    return out


@DTYPES
@pytest.mark.parametrize("compile_fused", [False, True], ids=["plain", "inductor"])
def test_graph_replay_equals_eager_every_bucket(compile_fused: bool, dtype: str) -> None:
    model = cuda_model(dtype)
    inductor_atol = INDUCTOR_GRAPH_ATOL if dtype == "float32" else BF16_INDUCTOR_GRAPH_ATOL
    config = RunnerConfig(max_slots=8, max_context=512, buckets=(1, 2, 4, 8), compile_fused=compile_fused)
    graphs, eager = ModelRunner(model, config), ModelRunner(model, RunnerConfig(**{**config.__dict__,
                                                                                   "cuda_graphs": False}))
    assert graphs.capture().buckets == (1, 2, 4, 8)
    seqs = states(model, [5, 30, 64, 100, 7, 250, 33, 90], seed=1)
    for slot, (state, _) in enumerate(seqs):
        graphs.load(slot, state)
        eager.load(slot, state)
    tokens = {slot: token for slot, (_, token) in enumerate(seqs)}
    for rows in (1, 2, 3, 4, 5, 8, 7, 6):  # full and padded buckets; rows join and leave between steps
        slots = list(range(rows))
        got = graphs.step_logits(slots, [tokens[s] for s in slots])
        want = eager.step_logits(slots, [tokens[s] for s in slots])
        torch.testing.assert_close(got, want, atol=inductor_atol if compile_fused else GRAPH_ATOL, rtol=0)
        for s, t in zip(slots, want.argmax(-1).tolist()):
            tokens[s] = t
    sampling = [SamplingParams(temperature=0.8, top_p=0.9, seed=11 + s) for s in range(4)]
    slots = [0, 2, 4, 6]
    assert graphs.step(slots, [tokens[s] for s in slots], sampling) == \
        eager.step(slots, [tokens[s] for s in slots], sampling)


@DTYPES
def test_slot_step_equals_forward_batch_on_kernels(dtype: str) -> None:
    model = cuda_model(dtype)
    runner = ModelRunner(model, RunnerConfig(max_slots=4, max_context=512, buckets=(4,)))
    runner.capture()
    seqs = [list(pair) for pair in states(model, [9, 40, 130], seed=2)]
    for slot, (state, _) in enumerate(seqs):
        runner.load(slot, copy.deepcopy(state))
    for _ in range(4):
        items = [BatchItem([token], state) for state, token in seqs]
        want = torch.cat([out.logits for out in model.forward_batch(items)])
        got = runner.step_logits([0, 1, 2], [token for _, token in seqs])
        torch.testing.assert_close(got, want, atol=KERNEL_ATOL, rtol=0)
        for pair, token in zip(seqs, want.argmax(-1).tolist()):
            pair[1] = token


def test_grouped_attention_equals_row_by_row() -> None:
    """`RunnerConfig.grouped_attention`: verify steps (runs of 1 to 6 rows per slot, padded buckets)
    whose sparse attention takes each slot's rows together give the per-row kernel's logits (both
    bf16 attention with fp32 accumulation, summed in another order), captured or not."""
    model = cuda_model()
    config = RunnerConfig(max_slots=4, max_context=512, max_rows_per_slot=6, buckets=(8, 16, 24))
    grouped = ModelRunner(model, RunnerConfig(**{**config.__dict__, "grouped_attention": True}))
    per_row = ModelRunner(model, RunnerConfig(**{**config.__dict__, "cuda_graphs": False}))
    assert grouped.capture().buckets == (8, 16, 24)
    seqs = states(model, [9, 40, 130, 200], seed=3)
    for slot, (state, _) in enumerate(seqs):
        grouped.load(slot, state)
        per_row.load(slot, state)
    gen = torch.Generator().manual_seed(4)
    for runs in ([6, 1, 3, 2], [1, 1, 1, 1], [5, 6, 6, 6], [2, 0, 4, 1]):
        slots = [slot for slot, rows in enumerate(runs) for _ in range(rows)]
        feed = torch.randint(3, 500, (len(slots),), generator=gen).tolist()
        start = {slot: grouped.position(slot) for slot in set(slots)}
        got = grouped.step_logits(slots, feed)
        want = per_row.step_logits(slots, feed)
        torch.testing.assert_close(got, want, atol=KERNEL_ATOL, rtol=0)
        for slot, position in start.items():  # every draft rejected but the first row
            grouped.rewind(slot, position + 1)
            per_row.rewind(slot, position + 1)


@pytest.mark.parametrize("compile_fused", [False, True], ids=["plain", "inductor"])
def test_decode_engine_runner_on_cuda(compile_fused: bool) -> None:
    """The decode engine on CUDA with `runner = "auto"` (graphs captured at start) against `off`:
    decode-only requests (prefilled by the engine itself), greedy tokens that the model picks
    (ties aside), every block and slot free at the end."""
    from decode_support import Rig, greedy_ties, prompt

    model = cuda_model()
    prompts = [prompt(37, 1), prompt(21, 2), prompt(50, 3)]
    outs = []
    for runner in ("off", "auto"):
        rig = Rig(model, None, dspark=False, runner=runner, device="cuda", max_running_requests=4,
                  compile_fused=compile_fused)
        rids = []
        for tokens in prompts:
            reserved = rig.reserve(tokens, sender=False)
            rig.attach(reserved, tokens, None, 12)
            rids.append(reserved.request_id)
        rig.run()
        outs.append([rig.tokens(rid) for rid in rids])
        rig.assert_all_free()
        if runner == "auto":
            assert rig.engine.slots is not None and rig.engine.slots.runner.graphs_captured == (1, 2, 4)
            assert rig.engine.slots.runner.steps >= 10
    assert [len(o) for o in outs[1]] == [len(o) for o in outs[0]] == [12] * 3
    # bf16 attention on both paths, rounded differently: a few numerical ties, each one checked
    assert sum(len(greedy_ties(model, p, out)) for p, out in zip(prompts, outs[1])) <= 3


def test_decode_engine_overlap_on_cuda() -> None:
    """`decode.overlap` on CUDA (graphs captured, picks copied behind the step into pinned buffers):
    the tokens of the engine without it, requests of different budgets stopping while a step is in
    flight, most steps launched ahead, every block and slot free at the end."""
    from decode_support import Rig, prompt

    model = cuda_model()
    prompts = [prompt(37, 1), prompt(21, 2), prompt(50, 3)]
    budgets = [12, 5, 20]
    outs, launches = [], 0
    for overlap in (False, True):
        rig = Rig(model, None, dspark=False, runner="auto", device="cuda", max_running_requests=4,
                  overlap=overlap)
        rids = []
        for tokens, budget in zip(prompts, budgets):
            reserved = rig.reserve(tokens, sender=False)
            rig.attach(reserved, tokens, None, budget)
            rids.append(reserved.request_id)
        rig.run()
        outs.append([rig.tokens(rid) for rid in rids])
        rig.assert_all_free()
        assert rig.engine.slots is not None and rig.engine.slots.num_free == 4
        launches = rig.engine.metrics.overlapped_steps._value.get()
    assert outs[1] == outs[0] and [len(o) for o in outs[0]] == budgets
    assert launches >= 15


def test_decode_engine_overlap_with_dspark_declining_on_cuda() -> None:
    """`decode.overlap` on CUDA with DSpark on and its cost check declining (an eager proposer whose
    passes never pay: the steps it promises to decline overlap, their taps copied for the drafter's
    memory), beside a request asking for logprobs (its logits copied to the host behind the step) and
    an unseeded one at top-k 1 (the device's draw, the argmax): the tokens and logprobs of the engine
    without overlap, most steps overlapped, every block free at the end."""
    from decode_support import Rig, prompt

    from cedserve.decode_workers.drafting import DSparkProposer
    from cedserve.decode_workers.messages import Tokens

    class Declines(DSparkProposer):
        def _passes_pay(self, *args: object) -> bool:
            return False

    model = cuda_model()
    drafter = cuda_drafter(model)
    prompts = [prompt(37, 1), prompt(21, 2), prompt(50, 3)]
    sampling: list[dict[str, object]] = [{}, {"logprobs": 2}, {"temperature": 1.0, "top_k": 1}]
    tokens_by_run, logprobs_by_run, overlapped = [], [], []
    for overlap in (False, True):
        # graphs of the uncompiled step and no kernel warm-up: the overlap's bookkeeping is what is
        # checked here (the test above runs the compiled graphs); with both, two engines' Inductor
        # compiles and warm-ups ran past a 180 s test part (gpu-2026-12-08)
        rig = Rig(model, None, proposer=Declines(drafter, model), runner="auto", runner_drafter="off",
                  device="cuda", max_running_requests=4, overlap=overlap, compile_fused=False,
                  kernel_warmup=False)
        rids = []
        for tokens, extra in zip(prompts, sampling):
            reserved = rig.reserve(tokens, sender=False)
            rig.attach(reserved, tokens, None, 40, **extra)
            rids.append(reserved.request_id)
        rig.run()
        chunks = [[o for o in rig.outputs if isinstance(o, Tokens) and o.request_id == rid] for rid in rids]
        tokens_by_run.append([[t for c in cs for t in c.token_ids] for cs in chunks])
        logprobs_by_run.append([lp for c in chunks[1] for lp in c.logprobs])
        overlapped.append(rig.engine.metrics.overlapped_steps._value.get())
        rig.assert_all_free()
    assert tokens_by_run[0] == tokens_by_run[1] and [len(t) for t in tokens_by_run[1]] == [40] * 3
    assert len(logprobs_by_run[1]) == 40
    # the series step reads them on the GPU, the overlapped one from the host copy: float32 rounding
    assert max(abs(a - b) for a, b in zip(*logprobs_by_run)) < 1e-4
    assert overlapped[0] == 0 and overlapped[1] >= 20


# ---------------------------------------------------------------------- the DSpark drafter on slots


def cuda_drafter(model: CEDModel) -> Drafter:
    _, drafter = tiny()
    return copy.deepcopy(drafter).to(model.embed.weight.device)


@pytest.mark.parametrize("compiled", [False, True], ids=["as-written", "inductor"])
def test_drafter_graph_replay_equals_eager_every_bucket(compiled: bool) -> None:
    """`DraftRunner`'s graphs against its eager step on the same slots: every bucket, full and padded,
    rows joining and leaving between passes, memories rolled back, greedy and seeded sampled rows
    (the same counter-based noise: the same tokens). `inductor`: the graphs capture the compiled
    pass (`compile_fused`, the decode worker's default), the eager step stays as written."""
    model = cuda_model()
    drafter = cuda_drafter(model)
    config = DraftRunnerConfig(max_slots=8, buckets=(1, 2, 4, 8), compile_fused=compiled)
    graphs = DraftRunner(drafter, model, config)
    eager = DraftRunner(drafter, model, DraftRunnerConfig(**{**config.__dict__, "cuda_graphs": False,
                                                               "compile_fused": False}))
    atol = INDUCTOR_GRAPH_ATOL if compiled else GRAPH_ATOL
    assert graphs.capture().buckets == (1, 2, 4, 8)
    c = model.config
    gen = torch.Generator().manual_seed(4)

    def taps(n: int) -> torch.Tensor:
        shape = (n, len(c.dspark_target_layer_ids), c.hc_mult, c.hidden_size)
        return torch.randn(*shape, generator=gen).to(model.embed.weight.device)

    ends = [5, 30, 64, 100, 7, 250, 33, 90]
    for runner in (graphs, eager):
        gen.manual_seed(4)
        runner.observe(list(range(8)), [0] * 8, ends, [taps(e + 2) for e in ends])
    temperatures = [0.0, 0.9, 0.0, 1.3, 0.0, 0.7, 0.0, 1.0]
    for step, rows in enumerate((1, 2, 3, 4, 5, 8, 7, 6)):
        slots = list(range(8))[-rows:] if step % 2 else list(range(rows))
        anchors = [(37 * s + step) % 500 + 3 for s in slots]
        args = (slots, anchors, [temperatures[s] for s in slots], [100 + s for s in slots])
        got, want = graphs.draft(*args), eager.draft(*args)
        assert got.tokens == want.tokens
        torch.testing.assert_close(got.probs, want.probs, atol=atol, rtol=0)
        torch.testing.assert_close(got.confidences, want.confidences, atol=atol, rtol=0)
        # each drafting slot keeps 2 of its rows (a rollback of the rest) and moves on by 2
        firsts = [graphs.extent(s)[1] - 1 for s in slots]  # type: ignore[index]
        rows_taps = [taps(4) for _ in slots]
        for runner in (graphs, eager):
            runner.observe(slots, firsts, [f + 2 for f in firsts], rows_taps)
    assert graphs.steps == eager.steps == 8


def test_decode_engine_drafter_on_slots_on_cuda() -> None:
    """The decode engine on CUDA with DSpark, the runner on and `runner_drafter = "auto"` (the
    drafter's graphs captured at start) against `off`: the same greedy tokens (ties aside, as
    `test_decode_engine_runner_on_cuda`), the drafter's slots all free at the end."""
    from decode_support import Rig, greedy_ties, prompt

    from cedserve.decode_workers.drafting import DSparkProposer
    from cedserve.decode_workers.slot_drafting import SlotDSparkProposer

    model = cuda_model()
    drafter = cuda_drafter(model)
    prompts = [prompt(37, 1), prompt(21, 2), prompt(50, 3)]
    outs, drafted = [], []
    for mode in ("off", "auto"):
        proposer = DSparkProposer(drafter, model, probe_every=1)  # drafts every step
        rig = Rig(model, None, proposer=proposer, runner="auto", runner_drafter=mode, device="cuda",
                  max_running_requests=4, adaptive_verify=False)
        rids = []
        for tokens in prompts:
            reserved = rig.reserve(tokens, sender=False)
            rig.attach(reserved, tokens, None, 12)
            rids.append(reserved.request_id)
        rig.run()
        outs.append([rig.tokens(rid) for rid in rids])
        drafted.append(rig.engine.drafted_tokens)
        rig.assert_all_free()
        slotted = rig.engine.proposer
        assert isinstance(slotted, SlotDSparkProposer) == (mode == "auto")
        if isinstance(slotted, SlotDSparkProposer):
            assert slotted.runner.graphs_captured == (1, 2, 4) and slotted.runner.steps >= 5
            assert slotted.num_free == 4
    assert [len(o) for o in outs[1]] == [len(o) for o in outs[0]] == [12] * 3
    assert min(drafted) > 0
    assert sum(len(greedy_ties(model, p, out)) for p, out in zip(prompts, outs[1])) <= 3


# ---------------------------------------------------------------------- Engram tables in an EngramStore


@pytest.mark.parametrize("tables", ["F32", "F8_E4M3"])
def test_engram_store_graph_replays_equal_loaded_tables(tmp_path: Path, tables: str) -> None:
    """The runner over memory-mapped Engram tables (`engram="mmap"`, F32 or the released FP8 with
    scales) on CUDA: its captured step reads the rows staged before each replay (one pinned-host-to-
    device copy of the stored bytes, dequantized in the step, `model.engram_staging`) and gives the
    logits of the captured step over the same checkpoint's loaded tables, every bucket, full
    and padded, rows joining and leaving; a step's host-to-device copies are both from pinned memory.
    Then the decode engine with `runner = "auto"` over either model: the runner on (graphs captured)
    and the same tokens."""
    from decode_support import Rig, prompt, store_tables_as_fp8

    from cedserve.model.checkpoint import load_model
    from cedserve.model.checkpoint_writer import write_random_checkpoint
    from cedserve.model.presets import preset

    written = write_random_checkpoint(preset("tiny"), tmp_path, seed=5)
    if tables == "F8_E4M3":
        store_tables_as_fp8(tmp_path, written)
    memory, mapped = load_model(tmp_path, device="cuda"), load_model(tmp_path, device="cuda", engram="mmap")
    for model in (memory, mapped):
        model.use_paged_attention("kernels")
    config = RunnerConfig(max_slots=8, max_context=512, buckets=(1, 2, 4, 8))
    loaded, staged = ModelRunner(memory, config), ModelRunner(mapped, config)
    assert staged.engram is not None and staged.engram.host.is_pinned() and staged.engram.buffer.is_cuda
    assert mapped.engram_store is not None and {t.weight_dtype for t in mapped.engram_store.tables} == {tables}
    assert loaded.capture().buckets == staged.capture().buckets == (1, 2, 4, 8)
    seqs = states(memory, [5, 30, 64, 100, 7, 250, 33, 90], seed=1)
    for slot, (state, _) in enumerate(seqs):
        loaded.load(slot, copy.deepcopy(state))
        staged.load(slot, state)
    tokens = {slot: token for slot, (_, token) in enumerate(seqs)}
    for rows in (1, 2, 3, 4, 5, 8, 7, 6):
        slots = list(range(rows))
        want = loaded.step_logits(slots, [tokens[s] for s in slots])
        got = staged.step_logits(slots, [tokens[s] for s in slots])
        torch.testing.assert_close(got, want, atol=GRAPH_ATOL, rtol=0)
        for s, t in zip(slots, want.argmax(-1).tolist()):
            tokens[s] = t
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        staged.step(list(range(3)), [tokens[s] for s in range(3)])
    copies = [e.name for e in prof.events() if "Memcpy HtoD" in e.name]
    assert sum("Pinned" in name for name in copies) >= 2, copies  # the Engram rows, the staging
    assert not any("Pageable" in name for name in copies), copies
    outs = []
    for model in (memory, mapped):
        rig = Rig(model, None, dspark=False, runner="auto", device="cuda", max_running_requests=4)
        rids = []
        for feed in (prompt(37, 1), prompt(21, 2), prompt(50, 3)):
            reserved = rig.reserve(feed, sender=False)
            rig.attach(reserved, feed, None, 12)
            rids.append(reserved.request_id)
        rig.run()
        outs.append([rig.tokens(rid) for rid in rids])
        assert rig.engine.slots is not None and rig.engine.slots.runner.graphs_captured == (1, 2, 4)
        assert (rig.engine.slots.runner.engram is not None) == (model is mapped)
        rig.assert_all_free()
    assert outs[0] == outs[1]
    mapped.close()


# ---------------------------------------------------------------------- expert parallelism, captured

EP_ATOL = 1e-3
"""The expert-parallel step (the fixed-capacity exchange inside the graph) against the step without
one, both captured on the kernels: only the MoE's float32 sums differ in order (~1e-7), which a
window or KV record may round the other way (the CPU tests see <= 4e-7 without such a flip)."""


@pytest.fixture
def nccl_world_of_one() -> Iterator[None]:
    """A one-rank NCCL group in this process: the exchange's all-to-all is a real NCCL collective (a copy
    to itself), so a one-GPU host captures and replays it."""
    import torch.distributed as dist
    from test_decode_expert_parallel import free_port

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_expert_parallel_graph_replay_one_gpu(nccl_world_of_one: None) -> None:
    """The runner with a fixed-capacity exchange over a one-rank NCCL group: every bucket captured with
    the collectives inside; its replays equal the same step run eagerly (GRAPH_ATOL) and the captured
    step without an exchange (EP_ATOL, the same greedy tokens), full and padded buckets, several rows
    per slot."""
    from cedserve.decode_workers.expert_parallel import FixedCapacityEP, TorchDistributedEP

    model = cuda_model()
    config = RunnerConfig(max_slots=4, max_context=512, max_rows_per_slot=2, buckets=(1, 2, 4, 8))
    ep = TorchDistributedEP(model.config.n_routed_experts)

    def exchange() -> FixedCapacityEP | None:  # a group of its own for each runner
        return ep.runner_exchange(8, model.config.num_experts_per_tok, model.config.hidden_size,
                                  model.embed.weight.dtype, model.embed.weight.device)

    graphs = ModelRunner(model, config, exchange=exchange())
    eager = ModelRunner(model, RunnerConfig(**{**config.__dict__, "cuda_graphs": False}), exchange=exchange())
    alone = ModelRunner(model, config)
    assert graphs.capture().buckets == (1, 2, 4, 8) and alone.capture().buckets == (1, 2, 4, 8)
    seqs = states(model, [5, 30, 100, 250], seed=3)
    for runner in (graphs, eager, alone):
        for slot, (state, _) in enumerate(seqs):
            runner.load(slot, copy.deepcopy(state))
    tokens = {slot: token for slot, (_, token) in enumerate(seqs)}
    for feed in ([0], [0, 1], [0, 1, 2], [0, 0, 1, 2, 3], [3, 3], [0, 1, 1, 2, 2, 3, 3], [2]):
        ids = [tokens[s] if i == 0 or feed[i - 1] != s else (tokens[s] * 7 + i) % 500 for i, s in enumerate(feed)]
        got = graphs.step_logits(feed, ids, len(feed))
        torch.testing.assert_close(got, eager.step_logits(feed, ids, len(feed)), atol=GRAPH_ATOL, rtol=0)
        want = alone.step_logits(feed, ids)
        torch.testing.assert_close(got, want, atol=EP_ATOL, rtol=0)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        for s, t in zip(feed, want.argmax(-1).tolist()):
            tokens[s] = t


def test_decode_engine_expert_parallel_runner_on_cuda(nccl_world_of_one: None) -> None:
    """The decode engine with `runner = "on"` over a one-rank NCCL `TorchDistributedEP` (the runner's
    exchange captured in its graphs, the engine agreeing on buckets through the group) against the
    engine without expert parallelism: the same greedy tokens (ties aside, as above)."""
    from decode_support import Rig, greedy_ties, prompt

    from cedserve.decode_workers.expert_parallel import TorchDistributedEP

    model = cuda_model()
    prompts = [prompt(37, 1), prompt(21, 2), prompt(50, 3)]
    outs = []
    for ep in (None, TorchDistributedEP(model.config.n_routed_experts)):
        rig = Rig(model, None, dspark=False, runner="on", device="cuda", max_running_requests=4, ep=ep)
        rids = []
        for tokens in prompts:
            reserved = rig.reserve(tokens, sender=False)
            rig.attach(reserved, tokens, None, 12)
            rids.append(reserved.request_id)
        rig.run()
        outs.append([rig.tokens(rid) for rid in rids])
        rig.assert_all_free()
        slots = rig.engine.slots
        assert slots is not None and slots.runner.graphs_captured == (1, 2, 4) and slots.runner.steps >= 10
        assert slots.collective == (ep is not None)
    assert [len(o) for o in outs[1]] == [12] * 3
    assert sum(len(greedy_ties(model, p, out)) for p, out in zip(prompts, outs[1])) <= 3


def test_expert_parallel_runner_two_gpus() -> None:
    """Two ranks, NCCL, one GPU each: experts sharded, every bucket captured with the exchange inside,
    `RUNNER_SCHEDULE` stepped (rank 1 feeds no rows in some steps) against one GPU holding every
    expert with graphs: the same greedy tokens, logits within EP_ATOL."""
    from decode_support import RUNNER_CONFIG, RUNNER_SCHEDULE, run_schedule, runner_ep_worker, runner_states
    from test_decode_expert_parallel import run_group

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    reports = dict(run_group(runner_ep_worker, 2, 400.0, "cuda"))
    model = cuda_model()
    for rank, steps in reports.items():
        runner = ModelRunner(model, RunnerConfig(**RUNNER_CONFIG))
        runner.capture()
        want = run_schedule(runner, runner_states(model, rank), RUNNER_SCHEDULE[rank])
        for step, ((tokens, logits), (want_tokens, want_logits)) in enumerate(zip(steps, want)):
            assert tokens == want_tokens, (rank, step)
            got = torch.tensor(logits).reshape(want_logits.shape)
            torch.testing.assert_close(got, want_logits.cpu(), atol=EP_ATOL, rtol=0, msg=f"rank {rank} step {step}")
