"""Serving the weights in bfloat16 (`[model] dtype`, docs/model.md "Weights dtype").

What stays float32; bf16 against float32 on fresh random inputs, with an explicit tolerance per output
(on the trained demo checkpoint: the random tiny model's logits are too flat for a tolerance to mean
anything, see `test_tiny_bf16_logits_stay_near_float32`); every worker path with bf16 weights on a CPU:
the runner's step against the eager bf16 step, the records bit-exact for the same input values, the
decode and prefill engines end to end against a bf16 reference model (tokens equal where the margin is
clear); and the agreement that prefill and decode workers of one system must keep.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from decode_support import Rig, greedy_rounds, greedy_ties, prompt, tiny, tiny_bf16
from near_ties import assert_close_but_near_ties

from cedserve.kernels.paged import PagedRecords
from cedserve.kernels.records import write_index_key, write_main_kv, write_swa
from cedserve.kv_transfer.errors import CompatibilityError
from cedserve.kv_transfer.loopback import LoopbackAgent, LoopbackHub
from cedserve.kv_transfer.region import KVLayout, KVRegion
from cedserve.model.checkpoint import cast_weights, is_float32_parameter, load_model
from cedserve.model.checkpoint_writer import write_random_checkpoint
from cedserve.model.kv_format import KVFormat, encode_index_key, encode_main, encode_window
from cedserve.model.network import BatchItem, CEDModel
from cedserve.model.presets import preset
from cedserve.model.runner import ModelRunner, RunnerConfig
from cedserve.model.state import SequenceState
from cedserve.model.state_format import (
    BoundedState,
    StateFormatError,
    decode_state,
    encode_state,
    max_state_bytes,
)
from cedserve.serving.config import ModelSource, ServeConfig
from cedserve.serving.worker import WorkerOptions, model_source
from cedserve.serving.worker_model import load_worker_model

pytestmark = pytest.mark.unit

DEMO = Path(__file__).parents[2] / "cedserve/assets/demo"

# bf16 against float32 on the trained demo checkpoint, three prompts of 96 fresh random tokens:
HIDDEN_RTOL = 0.1
"""Relative (Frobenius) error of the encoder's output streams, the state a prefill worker hands to
the decoder (seen 0.033-0.056: the residual streams are held in bf16)."""
LOGITS_RTOL = 0.1
"""Relative error of the decoder replay's logits over all rows (seen 0.026-0.050; a row on its own
reaches 0.3 where an index top-k pick or an FP4/FP8 record rounds the other way)."""
DECODE_RTOL = 0.06
"""Relative error of a decode step's logits after the replay (seen 0.008-0.018)."""
CLEAR_MARGIN = 1.0
"""Logit gap between float32's best and second token above which bf16 must pick the same (the
disagreements seen had gaps up to 0.07 on these prompts, 0.5 on others)."""

RUNNER_ATOL = 0.02
"""The runner's bf16 step against `forward_batch`'s on the same paged reference path, a row's largest
logit error: the same bf16 values in other float32 groupings (concatenated weights, the MoE's sums),
which now and then round an activation one bf16 step the other way (a row then moves <= 1e-2; these
logits lie within +-0.85, where a bf16 step is <= 2**-8)."""
RUNNER_FLIP_MARGIN = 2.0
"""Where a near-tie reaches (`near_ties`, per slot), a row may differ by this many times what nudging
the reference's steps moved that slot's rows so far."""
RUNNER_FLIPPED_SHARE = 0.25
"""At most this share of the rows may be off by more than RUNNER_ATOL: float noise moves a row further
only where it crosses a near-tie (seen: 1 of the 14, under ATen `default` with MKL SSE4_2 kernels: a
bf16 step in slot 2's stream rounded an FP4 index query the other way, layers 8 and 10 picked other
entries, 0.14). A float32 parameter held in bf16 moves every row, 6-10 of the 14 past RUNNER_ATOL."""
RUNNER_STEPS = 4

ENGINE_MARGIN = 0.1
"""`greedy_ties` margin for the bf16 engines against the bf16 dense reference: another computation
of the same bf16 model (the paged path's float32 attention logits, chunked encoding) moves a flat
tiny-model logit this much (gaps seen <= 0.04, each also the argmax of another chunking)."""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ------------------------------------------------------------------ what stays float32


def test_cast_weights_keeps_the_reference_float32_parameters() -> None:
    model, drafter = tiny_bf16()
    for module in (model, drafter):
        for name, param in module.named_parameters():
            assert param.dtype == (torch.float32 if is_float32_parameter(name) else torch.bfloat16), name
    kept = {name.split(".")[-1] for name, p in model.named_parameters() if p.dtype == torch.float32}
    assert kept == {
        "hc_attn_fn",
        "hc_attn_base",
        "hc_attn_scale",
        "hc_ffn_fn",
        "hc_ffn_base",
        "hc_ffn_scale",
        "attn_sink",
        "bias",
        "bias_vl",
    }
    assert drafter.confidence.bias.dtype == torch.bfloat16  # a plain linear's bias follows its weight
    assert drafter.layers[0].ffn.gate.bias.dtype == torch.float32  # a router's stays float32


def test_bf16_load_equals_the_cast_float32_load(tmp_path: Path) -> None:
    """Loading a checkpoint in bf16 rounds each dequantized tensor once: the same bits as loading it in
    float32 and casting. The decode worker's drafter follows the model's dtype (checkpoint or preset).
    The memory-mapped Engram tables give the in-memory tables' logits bit for bit."""
    write_random_checkpoint(preset("tiny"), tmp_path, seed=3)
    direct = load_model(tmp_path, dtype=torch.bfloat16)
    cast = cast_weights(load_model(tmp_path), torch.bfloat16)
    for (name, a), (_, b) in zip(direct.state_dict().items(), cast.state_dict().items(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    from cedserve.decode_workers.main import load_drafter

    for loaded in (
        load_worker_model(str(tmp_path), None, dtype="bfloat16"),
        load_worker_model(None, "tiny", dtype="bfloat16"),
    ):  # checkpoint, preset
        drafter = load_drafter(
            loaded, loaded.source if loaded.source == str(tmp_path) else None, "tiny", 0, "cpu"
        )
        assert drafter is not None and drafter.fc.weight.dtype == torch.bfloat16
        assert drafter.layers[0].attn.attn_sink.dtype == torch.float32
    mapped = load_model(tmp_path, dtype=torch.bfloat16, engram="mmap")
    try:
        tokens = prompt(40, 5)
        assert torch.equal(
            direct.prefill(tokens, direct.new_state()), mapped.prefill(tokens, mapped.new_state())
        )
    finally:
        mapped.close()


# ------------------------------------------------------------------ bf16 against float32


@pytest.fixture(scope="module")
def demo() -> tuple[CEDModel, CEDModel]:
    return load_model(DEMO), load_model(DEMO, dtype=torch.bfloat16)


@pytest.mark.parametrize("seed", [100, 101, 102])
def test_bf16_follows_float32_on_the_trained_demo(demo: tuple[CEDModel, CEDModel], seed: int) -> None:
    """The prefill worker's path (encoder, then the decoder replay) and a decode step, bf16 against
    float32 from the same checkpoint, on fresh random tokens: each output within its tolerance, and
    the same greedy token wherever float32's margin is clear."""
    m32, m16 = demo
    tokens = torch.randint(
        4, m32.config.vocab_size, (96,), generator=torch.Generator().manual_seed(seed)
    ).tolist()
    s32, s16 = m32.new_state(), m16.new_state()
    e32, e16 = m32.encode_chunk(tokens, s32), m16.encode_chunk(tokens, s16)
    assert e16.boundary.streams.dtype == torch.bfloat16
    assert rel(e16.boundary.streams, e32.boundary.streams) < HIDDEN_RTOL
    l32, l16 = m32.replay_decoder(e32.boundary, s32), m16.replay_decoder(e16.boundary, s16)
    assert l16.dtype == torch.float32 and rel(l16, l32) < LOGITS_RTOL
    top2 = l32.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > CLEAR_MARGIN
    assert int(clear.sum()) > 25  # the trained model is confident on many rows (seen 36-40 of 96)
    assert torch.equal(l16.argmax(-1)[clear], l32.argmax(-1)[clear])
    token = int(l32[-1].argmax())
    d32, d16 = m32.decode_step([token], [s32])[0], m16.decode_step([token], [s16])[0]
    assert rel(d16, d32) < DECODE_RTOL


def test_tiny_bf16_logits_stay_near_float32() -> None:
    """The random tiny model: its logits are flat and its index top-k and FP4/FP8 records sit on near
    ties, so bf16 moves single rows by up to ~0.4 (relative) and a tolerance only bounds the whole."""
    m32, _ = tiny()
    m16, _ = tiny_bf16()
    tokens = prompt(64, 9)
    l32, l16 = m32.prefill(tokens, m32.new_state()), m16.prefill(tokens, m16.new_state())
    assert rel(l16, l32) < 0.3  # seen 0.14-0.17
    assert rel(l16[:4], l32[:4]) < 0.15  # before the window fills and most picks exist (seen < 0.06)


# ------------------------------------------------------------------ records


@pytest.mark.parametrize("dim", [64, 512])
def test_records_are_bit_exact_for_the_same_values_in_bf16(dim: int) -> None:
    """The record writers (the state's encoders and the runner's paged writers) give the same bytes for
    bf16 inputs as for the same values in float32."""
    gen = torch.Generator().manual_seed(dim)
    x = (torch.randn(33, dim, generator=gen) * torch.logspace(-3, 2, 33).unsqueeze(-1)).to(torch.bfloat16)
    for encode in (encode_window, encode_main, encode_index_key):
        assert torch.equal(encode(x, KVFormat.RECORDS), encode(x.float(), KVFormat.RECORDS)), encode.__name__
    for writer, encode in (
        (write_swa, encode_window),
        (write_main_kv, encode_main),
        (write_index_key, encode_index_key),
    ):
        record_bytes = int(encode(x[:1].float(), KVFormat.RECORDS).shape[1])
        tables = []
        for values in (x, x.float()):
            table = torch.zeros(40, record_bytes, dtype=torch.uint8)
            writer(values, torch.arange(33) + 4, PagedRecords.flat(table, record_bytes), impl="torch")
            tables.append(table)
        assert torch.equal(tables[0], tables[1]), writer.__name__
        assert torch.equal(tables[0][4:37], encode(x, KVFormat.RECORDS)), writer.__name__


# ------------------------------------------------------------------ the runner


def _eager_steps(
    model: CEDModel,
    starts: dict[int, tuple[SequenceState, int]],
    joins: dict[int, int],
    fed: dict[tuple[int, int], int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[tuple[int, int], int]]:
    """`forward_batch` over RUNNER_STEPS steps from copies of the prefilled `starts` (slot: state, its
    first token), slot s taking part from step `joins[s]` on, each step fed the reference's own greedy
    tokens (or `fed`'s). Returns the logits `[rows, vocab]` step by step in slot order, each row's
    slot `[rows]` and the tokens fed by (slot, step)."""
    states: dict[int, SequenceState] = {}
    greedy: dict[int, int] = {}
    rows, row_slots, tokens = [], [], {}
    for step in range(RUNNER_STEPS):
        for slot in (s for s, at in joins.items() if at == step):
            states[slot], greedy[slot] = copy.deepcopy(starts[slot][0]), starts[slot][1]
        slots = sorted(states)
        for slot in slots:
            tokens[slot, step] = fed[slot, step] if fed is not None else greedy[slot]
        outs = model.forward_batch([BatchItem([tokens[s, step]], states[s], taps=True) for s in slots])
        for slot, out in zip(slots, outs):
            rows.append(out.logits[0])
            row_slots.append(slot)
            greedy[slot] = int(out.logits[0].argmax())
    return torch.stack(rows), torch.tensor(row_slots), tokens


def test_runner_step_equals_the_eager_bf16_step() -> None:
    """The model runner's slot step (eager on a CPU) with bf16 weights against `forward_batch` on the
    paged reference path, over four steps with a join, both fed the reference's greedy tokens: each
    row's logits within RUNNER_ATOL, but for the few (RUNNER_FLIPPED_SHARE) a near-tie reaches, which
    stay within RUNNER_FLIP_MARGIN times how far nudges to the reference's steps move them; the greedy
    token wherever the reference's best leads by more than twice RUNNER_ATOL; taps in the model's dtype."""
    model, _ = tiny_bf16()
    model.use_paged_attention("reference")
    try:
        gen = torch.Generator().manual_seed(2)
        prompts = {slot: torch.randint(3, 500, (length,), generator=gen).tolist()
                   for slot, length in enumerate([3, 40, 101])}
        prompts[3] = prompt(30, 4)
        joins = {0: 0, 1: 0, 2: 0, 3: 2}
        starts = {}
        for slot, tokens in prompts.items():
            state = model.new_state()
            starts[slot] = (state, int(model.prefill(tokens, state)[-1].argmax()))
        want, slots, fed = _eager_steps(model, starts, joins)
        runner = ModelRunner(model, RunnerConfig(max_slots=4, max_context=256))
        steps = []
        for step in range(RUNNER_STEPS):
            for slot in (s for s, at in joins.items() if at == step):
                runner.load(slot, copy.deepcopy(starts[slot][0]))
            step_slots = [s for s, at in sorted(joins.items()) if at <= step]
            logits, taps = runner.step_outputs(step_slots, [fed[s, step] for s in step_slots])
            assert taps.dtype == torch.bfloat16
            steps.append(logits.clone())  # the runner's outputs are views into its next step
        got = torch.cat(steps)
        error = (got - want).abs().amax(-1)
        assert float((error > RUNNER_ATOL).float().mean()) <= RUNNER_FLIPPED_SHARE, (
            f"rows off by more than {RUNNER_ATOL}: {(error > RUNNER_ATOL).nonzero().flatten().tolist()}"
            f" of {len(error)} (errors {[round(e, 3) for e in error.tolist()]})"
        )
        assert_close_but_near_ties(got, want, lambda: _eager_steps(model, starts, joins, fed)[0],
                                   RUNNER_ATOL, RUNNER_FLIP_MARGIN, "runner step", sequences=slots)
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1] > 2 * RUNNER_ATOL) & (error <= RUNNER_ATOL)
        assert int(clear.sum()) >= 5  # seen 9 of 14
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    finally:
        model.use_paged_attention(None)


# ------------------------------------------------------------------ the engines


@pytest.mark.parametrize(("runner", "ship_state"), [("off", False), ("on", True)])
def test_decode_engine_in_bf16_follows_the_bf16_reference(runner: str, ship_state: bool) -> None:
    """The decode engine end to end with bf16 weights and the DSpark drafter (the prefill side encodes,
    sends records and, with `ship_state`, the bounded state with bf16 taps): every token is the bf16
    dense reference's where its margin is clear (`greedy_ties` with ENGINE_MARGIN)."""
    model, drafter = tiny_bf16()
    prompts = [prompt(37, 1), prompt(81, 3)]
    rig = Rig(model, drafter, runner=runner, ship_state=ship_state)
    outputs = greedy_rounds(rig, prompts, 8)
    for tokens, out in zip(prompts, outputs.values()):
        assert len(out) == 9  # the prefill side's first token, then 8
        greedy_ties(model, tokens, out, margin=ENGINE_MARGIN)
    assert rig.engine.drafted_tokens > 0
    if runner == "on":
        assert rig.engine.slots is not None and rig.engine.slots.runner.steps > 0
    rig.assert_all_free()


@pytest.mark.parametrize("paged_attention", ["off", "reference"])
def test_prefill_engine_in_bf16_sends_what_a_bf16_decode_continues(paged_attention: str) -> None:
    """The prefill worker's engine with bf16 weights (dense, and on the paged path's references): its
    first token is the bf16 reference's where the margin is clear; the records it sends and the
    bounded state it ships (DSpark taps in bf16) continue, installed on the decode side, as the bf16
    model's own state does (the next token within ENGINE_MARGIN of the reference's best)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_prefill_engine import ROUTED, kinds, make_rig

    from cedserve.kv_transfer.wire import reservation_to_pb
    from cedserve.model.paged_kv import load_bytes, load_state
    from cedserve.model.state_format import STATE_FORMAT_VERSION
    from cedserve.prefill_workers.validation import validate_prefill
    from cedserve.proto import worker_pb2 as wpb

    loaded = load_worker_model(None, "tiny", seed=0, dtype="bfloat16")
    assert loaded.model.embed.weight.dtype == torch.bfloat16 and loaded.weights_dtype == "bfloat16"
    rig = next(make_rig(loaded, paged_attention))
    model, config = rig.model, rig.model.config
    assert rig.limits.max_state_bytes_with_taps == max_state_bytes(config, torch.bfloat16)
    tokens = prompt(131, 21)  # odd: layer 2's compressor holds a partial group
    kv_blocks, room = [0, 1, 2], -(-rig.limits.max_state_bytes_with_taps // rig.layout.block_bytes)
    state_blocks = list(range(40, 40 + room))
    res = rig.decode.receiver().reserve("lease-s", kv_blocks + state_blocks, sender="p0")
    target = wpb.DecodeTarget(
        agent_name="d0",
        lease_id="lease-s",
        reservation=reservation_to_pb(res),
        state_room=wpb.StateRoom(num_blocks=room, format_version=STATE_FORMAT_VERSION, dspark_taps=True),
    )
    request = wpb.PrefillRequest(request_id="s", token_ids=tokens, target=target, **ROUTED)  # type: ignore[arg-type]
    events = rig.run(rig.engine.submit(validate_prefill(request, rig.limits)))
    assert kinds(events) == ["first_token", "done"]
    first = events[0].first_token.token_id
    greedy_ties(model, tokens, [first], margin=ENGINE_MARGIN)
    shipped = decode_state(load_bytes(rig.decode_pool, state_blocks), config, torch.bfloat16)
    assert shipped.taps is not None and shipped.taps.dtype == torch.bfloat16
    state = model.new_state()
    load_state(rig.layout, rig.decode_pool, kv_blocks, len(tokens), state)
    shipped.install(state)
    own = model.new_state()
    model.prefill(tokens, own)
    got, want = model.decode_step([first], [state])[0], model.decode_step([first], [own])[0]
    assert float(want.max() - want[int(got.argmax())]) <= ENGINE_MARGIN
    rig.assert_all_free()
    rig.cache.close()
    model.use_paged_attention(None)


def test_shipped_state_format_follows_the_weights_dtype() -> None:
    """The DSpark taps travel in the model's dtype: a bf16 state is smaller, and a reader expecting
    float32 taps refuses bf16 ones by name (a mixed system is refused before, at the handshake)."""
    model, _ = tiny_bf16()
    config = model.config
    assert max_state_bytes(config, torch.bfloat16) < max_state_bytes(config, torch.float32)
    state = model.new_state()
    out = model.prefill_with_taps(prompt(20, 6), state)
    taps = out.taps[-config.sliding_window :].mean(dim=2)
    assert taps.dtype == torch.bfloat16
    data = encode_state(BoundedState.capture(state, taps), config)
    back = decode_state(data, config, torch.bfloat16)
    assert back.taps is not None and torch.equal(back.taps, taps)
    with pytest.raises(StateFormatError, match="bfloat16"):
        decode_state(data, config, torch.float32)


# ------------------------------------------------------------------ config and agreement


def test_model_dtype_field_and_auto() -> None:
    assert ModelSource().dtype == "float32"  # the default stays float32 until bf16 is measured on a GPU
    with pytest.raises(ValueError, match=r"model\.dtype"):
        ModelSource(dtype="float16")
    auto = ModelSource(dtype="auto")
    assert auto.weights_dtype("cuda:0") == "bfloat16" and auto.weights_dtype("cpu") == "float32"
    serve = ServeConfig(model=ModelSource(preset="tiny", dtype="bfloat16"))
    assert model_source(WorkerOptions(role="decode"), serve).dtype == "bfloat16"
    assert (
        model_source(WorkerOptions(role="decode", dtype="float32"), serve).dtype == "float32"
    )  # the flag wins


def test_toml_model_dtype(tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text('[model]\npreset = "tiny"\ndtype = "auto"\n')
    assert ServeConfig.load(path).model.dtype == "auto"
    path.write_text('[model]\npreset = "tiny"\ndtype = "half"\n')
    with pytest.raises(ValueError, match="dtype"):
        ServeConfig.load(path)


def test_prefill_and_decode_of_different_dtypes_refuse_each_other() -> None:
    """The weights' dtype is part of the KV compatibility: the handshake between a float32 and a bf16
    worker fails, naming the field and both values."""
    config = tiny()[0].config
    layouts = {
        d: KVLayout.from_config(config, 32, model_id="preset:tiny:seed0", weights_dtype=d)
        for d in ("float32", "bfloat16")
    }
    assert layouts["float32"].compatibility().compat_hash != layouts["bfloat16"].compatibility().compat_hash
    hub = LoopbackHub()

    def agent(name: str, dtype: str) -> LoopbackAgent:
        layout = layouts[dtype]
        pool = torch.zeros(4, layout.block_bytes, dtype=torch.uint8)
        return LoopbackAgent(hub, KVRegion(pool, layout.block_bytes), layout, name)

    agent("decode", "bfloat16")
    agent("decode32", "float32")
    prefill = agent("prefill", "float32")
    with pytest.raises(CompatibilityError, match="weights: float32 vs bfloat16"):
        prefill.handshake("decode")
    prefill.handshake("decode32")  # the same dtype agrees


def test_one_dtype_reaches_every_worker_of_cedserve_serve(tmp_path: Path) -> None:
    """`cedserve serve --dtype` / `[model] dtype` lands in the one `[model]` table every worker's file
    holds; `cedserve worker --dtype` is a flag of its own."""
    from cedserve.cli import build_parser
    from cedserve.launcher import write_worker_config

    files = write_worker_config(tmp_path, config={"model": {"preset": "tiny", "dtype": "bfloat16"}})
    tables = ("prefill", "decode", "kv_transfer", "router")
    dtypes = {ServeConfig.load_with_sections(files[role], tables)[0].model.dtype for role in files}
    assert set(files) == {"prefill", "decode", "router"} and dtypes == {"bfloat16"}
    args = build_parser().parse_args(["worker", "--role", "decode", "--dtype", "auto"])
    assert args.dtype == "auto"
    assert build_parser().parse_args(["serve", "--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--role", "decode", "--dtype", "float16"])


def test_runner_with_staged_engram_rows_in_bf16(tmp_path: Path) -> None:
    """The runner over memory-mapped FP8 Engram tables (rows staged on the host, dequantized into bf16
    with the loader's arithmetic) gives the logits of the runner over the tables loaded in bf16, bit
    for bit."""
    from decode_support import store_tables_as_fp8

    config = write_random_checkpoint(preset("tiny"), tmp_path, seed=5)
    store_tables_as_fp8(tmp_path, config)
    memory = load_model(tmp_path, dtype=torch.bfloat16)
    mapped = load_model(tmp_path, dtype=torch.bfloat16, engram="mmap")
    try:
        runner_config = RunnerConfig(max_slots=2, max_context=128)
        loaded, staged = ModelRunner(memory, runner_config), ModelRunner(mapped, runner_config)
        assert staged.engram is not None and loaded.engram is None
        tokens = {}
        for slot, length in enumerate([9, 40]):
            state = memory.new_state()
            tokens[slot] = int(memory.prefill(prompt(length, 30 + slot), state)[-1].argmax())
            loaded.load(slot, copy.deepcopy(state))
            staged.load(slot, state)
        for _ in range(3):
            want = loaded.step_logits([0, 1], [tokens[0], tokens[1]])
            assert torch.equal(staged.step_logits([0, 1], [tokens[0], tokens[1]]), want)
            tokens = dict(enumerate(want.argmax(-1).tolist()))
    finally:
        mapped.close()
