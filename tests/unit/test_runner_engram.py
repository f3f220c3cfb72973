"""The model runner with its Engram tables in an `EngramStore` (`load_model(..., engram="mmap")`):
the step's rows staged on the host (`cedserve.model.engram_staging`) give the logits of the runner
over the same checkpoint with the tables loaded, bit for bit, in every bucket, with rows joining and
leaving and DSpark verify rows rolled back, for F32 tables (the writer's) and FP8 tables with
scales (the released model's); the staging's hash ids are the reference's, its rows the tables'
(first and last row too), its padding rows cannot reach real rows, and ids outside a table are
refused; a decode engine with the runner on emits the same tokens with either kind of table."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from decode_support import Rig, greedy_rounds, prompt, store_tables_as_fp8

from cedserve.decode_workers.config import DecodeConfig
from cedserve.decode_workers.drafting import DSparkProposer
from cedserve.decode_workers.sequence import DecodeSequence
from cedserve.decode_workers.slot_book import runner_unavailable
from cedserve.decode_workers.slot_drafting import SlotDSparkProposer
from cedserve.model.checkpoint import load_model
from cedserve.model.checkpoint_writer import load_drafter, write_random_checkpoint
from cedserve.model.dspark import Draft, Drafter
from cedserve.model.engram_staging import EngramStaging, staged_row_bytes
from cedserve.model.network import CEDModel
from cedserve.model.presets import preset
from cedserve.model.runner import ModelRunner, RunnerConfig
from cedserve.model.slot_step import SlotStep
from cedserve.model.state import SequenceState

pytestmark = pytest.mark.unit

ATOL = 0.0
"""Runner with staged rows vs runner with loaded tables: the step dequantizes a staged row with the
loader's arithmetic (`dequantize_engram_rows`, one float32 product per value), and every other op is
the same on the same values: exact."""


@dataclass
class Tables:
    """One random tiny checkpoint, loaded twice: tables in memory and tables memory-mapped."""

    folder: Path
    memory: CEDModel
    mapped: CEDModel


@pytest.fixture(scope="module", params=["F32", "F8_E4M3"])
def tables(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tables]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's ops are too small for intra-op threads
    folder = tmp_path_factory.mktemp(f"engram-checkpoint-{request.param}")
    config = write_random_checkpoint(preset("tiny"), folder, seed=5)
    if request.param == "F8_E4M3":
        store_tables_as_fp8(folder, config)
    memory, mapped = load_model(folder), load_model(folder, engram="mmap")
    assert mapped.engram_store is not None and memory.engram_store is None
    assert {table.weight_dtype for table in mapped.engram_store.tables} == {request.param}
    yield Tables(folder, memory, mapped)
    mapped.close()
    torch.set_num_threads(threads)


def prefilled(model: CEDModel, lengths: Sequence[int], seed: int) -> list[tuple[SequenceState, int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        state = model.new_state()
        logits = model.prefill(torch.randint(3, 500, (length,), generator=gen).tolist(), state)
        out.append((state, int(logits[-1].argmax())))
    return out


def runners(t: Tables, config: RunnerConfig) -> tuple[ModelRunner, ModelRunner]:
    loaded, staged = ModelRunner(t.memory, config), ModelRunner(t.mapped, config)
    assert loaded.engram is None and staged.engram is not None
    return loaded, staged


def test_staged_rows_give_the_loaded_tables_logits_every_bucket(tables: Tables) -> None:
    """Six slots, rows 1..6 over buckets 1, 2, 4, 6 (full and padded), a slot leaving and one joining
    between steps: logits equal, and so the greedy tokens."""
    loaded, staged = runners(tables, RunnerConfig(max_slots=6, max_context=256))
    assert staged.buckets == (1, 2, 4, 6)
    seqs = prefilled(tables.memory, [3, 17, 40, 101, 9, 64], seed=2)
    tokens = {}
    for slot, (state, token) in enumerate(seqs[:5]):
        loaded.load(slot, copy.deepcopy(state))
        staged.load(slot, state)
        tokens[slot] = token
    for rows in (1, 2, 3, 5, 4, 6):
        if rows == 4 and 1 in tokens:  # slot 1 leaves, slot 5 joins in its place among the rows
            tokens.pop(1)
            loaded.load(5, copy.deepcopy(seqs[5][0]))
            staged.load(5, seqs[5][0])
            tokens[5] = seqs[5][1]
        slots = sorted(tokens)[:rows]
        want = loaded.step_logits(slots, [tokens[s] for s in slots])
        got = staged.step_logits(slots, [tokens[s] for s in slots])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        for slot, token in zip(slots, want.argmax(-1).tolist()):
            tokens[slot] = token
    for slot in tokens:  # the device rings (which export reads) hold what the loaded runner's hold
        assert torch.equal(staged.export(slot).engram_tail, loaded.export(slot).engram_tail)


def test_verify_rows_and_rollback(tables: Tables) -> None:
    """Chunks of 1-4 rows per slot (an anchor and drafts, or carried tokens) and half of them
    rolled back by a rewind: the staged history follows the rewinds as the device ring does."""
    gen = torch.Generator().manual_seed(6)
    config = RunnerConfig(max_slots=3, max_context=256, max_rows_per_slot=4)
    loaded, staged = runners(tables, config)
    for slot, (state, _) in enumerate(prefilled(tables.memory, [6, 33, 90], seed=3)):
        loaded.load(slot, copy.deepcopy(state))
        staged.load(slot, state)
    for _ in range(6):
        chunks = {
            s: torch.randint(3, 500, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist()
            for s in range(3)
        }
        starts = {s: loaded.position(s) for s in chunks}
        slots = [s for s in chunks for _ in chunks[s]]
        feed = [t for s in chunks for t in chunks[s]]
        want, want_taps = (x.clone() for x in loaded.step_outputs(slots, feed))
        got, taps = staged.step_outputs(slots, feed)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        torch.testing.assert_close(taps, want_taps, atol=ATOL, rtol=0)
        for s in chunks:
            if bool(torch.rand(1, generator=gen) < 0.5):  # rejected drafts: back to before the chunk
                loaded.rewind(s, starts[s])
                staged.rewind(s, starts[s])


def test_hash_ids_are_the_references(tables: Tables) -> None:
    """The staging hashes a row as `CEDModel` does (`hash_ids` over the sequence's tail): for a full
    tail, a short one (a join after a replay that kept two ids), and several rows of one slot."""
    model = tables.mapped
    assert model.hasher is not None and model.engram_store is not None
    staging = EngramStaging(
        model.engram_store,
        model.hasher,
        model.config,
        max_slots=2,
        max_rows_per_slot=3,
        width=6,
        device=torch.device("cpu"),
    )
    ((state, _),) = prefilled(tables.memory, [20], seed=4)
    short = copy.deepcopy(state)
    short.engram_tail = short.engram_tail[-2:]
    staging.load(0, state.engram_tail, state.position)
    staging.load(1, short.engram_tail, short.position)
    rows = [11, 12, 13]
    got = staging.hash_ids(
        [0, 0, 0, 1], [*rows, 14], [state.position + i for i in range(3)] + [short.position]
    )
    for i, (source, tokens) in enumerate(((state, rows), (short, [14]))):
        compressed = model.hasher.compress(torch.tensor(tokens))
        want = model.hasher.hash_ids(source.engram_tail, compressed, source.position)
        # a short tail: positions before it read the pad id, as `hash_rows` with its known count
        assert torch.equal(got[:3] if i == 0 else got[3:], want), i


def test_padding_rows_cannot_reach_real_rows(tables: Tables) -> None:
    """Three rows in the bucket of 4: only three rows are copied, and whatever the fourth row of the
    static buffer holds (here: bytes that are no table's row) leaves the real rows' logits alone."""
    loaded, staged = runners(tables, RunnerConfig(max_slots=4, max_context=128))
    assert staged.engram is not None
    for slot, (state, _) in enumerate(prefilled(tables.memory, [20, 21, 22], seed=5)):
        loaded.load(slot, copy.deepcopy(state))
        staged.load(slot, state)
    staged.engram.buffer.fill_(0x3C)  # FP8 1.5, F32 scales and values ~0.0115: no table row
    got = staged.step_logits([0, 1, 2], [5, 6, 7])
    torch.testing.assert_close(got, loaded.step_logits([0, 1, 2], [5, 6, 7]), atol=ATOL, rtol=0)
    assert bool((staged.engram.buffer[3] == 0x3C).all())  # not staged, not copied
    assert not bool((staged.engram.buffer[:3] == 0x3C).all(dim=-1).any())


def test_staged_rows_are_the_tables_rows_and_bounds(tables: Tables) -> None:
    """Staged ids read the loaded tables' rows, the first and the last row of each table included,
    in every column; an id outside a table, or more rows than the buffers hold, is a ValueError
    (numpy would wrap -1 to the last row); a staged row's bytes are `staged_row_bytes`."""
    store = tables.mapped.engram_store
    assert store is not None and tables.mapped.hasher is not None
    config = tables.mapped.config
    columns = (config.engram_max_ngram_size - 1) * config.engram_n_heads
    sizes = config.engram_num_embeddings
    gen = torch.Generator().manual_seed(8)
    ids = torch.stack([torch.randint(0, rows, (3, columns), generator=gen) for rows in sizes], dim=1)
    ids[0, :, 0] = 0
    ids[1] = torch.tensor(sizes).unsqueeze(-1) - 1  # every column of row 1: each table's last row
    staging = EngramStaging(store, tables.mapped.hasher, config, 2, 1, width=3, device=torch.device("cpu"))
    staging.upload(staging.stage_ids(ids))
    rows = staging.device_rows(3)
    assert rows.shape == (3, len(sizes), columns, config.engram_head_dim) and rows.dtype == torch.float32
    for i, layer_id in enumerate(config.engram_layer_ids):
        table = tables.memory.layers[layer_id].engram.embed.weight  # type: ignore[union-attr]
        assert torch.equal(rows[:, i], table[ids[:, i]]), layer_id
    assert torch.equal(rows, store.gather(ids))
    for bad in (-1, sizes[0]):
        with pytest.raises(ValueError, match="row ids"):
            staging.stage_ids(torch.full((1, len(sizes), columns), bad))
    with pytest.raises(ValueError, match="exceed"):
        staging.stage([0, 1, 0, 1], [1, 2, 3, 4], [0, 0, 1, 1])
    values, scales = columns * config.engram_head_dim, columns * config.engram_head_dim // 32
    per_layer = values + scales * 4 if store.tables[0].scale is not None else values * 4  # F32 scales, values
    assert staging.row_bytes == staged_row_bytes(store, config) == len(sizes) * per_layer
    assert staging.nbytes == 3 * staging.row_bytes


def test_slot_step_needs_the_staged_rows(tables: Tables) -> None:
    runner = ModelRunner(tables.mapped, RunnerConfig(max_slots=1, max_context=64))
    with pytest.raises(ValueError, match="EngramStore"):
        SlotStep(tables.mapped, runner.pools)
    assert runner_unavailable(tables.mapped, "on", 1) is None


class EveryOtherStep(DSparkProposer):
    """The checkpoint's drafter, drafting only on even calls (deterministic, where the real
    proposer's choice depends on measured step times)."""

    calls = 0

    def propose(self, seqs: Sequence[DecodeSequence]) -> list[Draft | None]:
        self.calls += 1
        drafts = super().propose(seqs)
        return drafts if self.calls % 2 == 0 else [None] * len(drafts)


@pytest.mark.parametrize("tables", ["F8_E4M3"], indirect=True)  # the released format (both above)
@pytest.mark.parametrize("drafting", ["none", "dspark", "drafter-on-slots"])
def test_decode_engine_with_mapped_tables(tables: Tables, drafting: str) -> None:
    """`decode.runner = on` over the mapped tables: the runner is on, its steps run, and the tokens
    are those of the engine over the loaded tables (runner on too): plain rows, DSpark verify rows,
    and with the drafter's pass on slots too (`runner_drafter = on`: it reads no Engram rows)."""
    prompts = [prompt(37, 1), prompt(21, 2)]
    drafter: Drafter | None = (
        load_drafter(tables.folder, tables.memory.config) if drafting != "none" else None
    )
    outs = []
    for model in (tables.memory, tables.mapped):
        proposer: DSparkProposer | None = None
        if drafting == "dspark":
            assert drafter is not None
            proposer = EveryOtherStep(drafter, model, DecodeConfig().draft_tokens)
        elif drafting == "drafter-on-slots":
            assert drafter is not None
            proposer = DSparkProposer(drafter, model, probe_every=1)  # drafts every step
        rig = Rig(
            model,
            None,
            proposer=proposer,
            dspark=drafter is not None,
            runner="on",
            adaptive_verify=False,
            runner_drafter="on" if drafting == "drafter-on-slots" else "off",
        )
        outs.append(greedy_rounds(rig, prompts, 8))
        assert rig.engine.slots is not None and rig.engine.slots.runner.steps >= 5
        assert (rig.engine.slots.runner.engram is not None) == (model is tables.mapped)
        if (
            drafter is not None
        ):  # verify rows went through the runner: more rows than one per request and step
            assert rig.engine.metrics.runner_rows._value.get() > len(prompts) * rig.engine.slots.runner.steps
        assert isinstance(rig.engine.proposer, SlotDSparkProposer) == (drafting == "drafter-on-slots")
        rig.assert_all_free()
    assert list(outs[0].values()) == list(outs[1].values())
