"""Demo training: straight-through quantizers, the training pass against `prefill`, a few training
steps of the backbone and the drafter, the written checkpoint against the model in memory, the
corpus split and the tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from near_ties import assert_close_but_near_ties

from cedserve.kernels.reference import (
    pack_index_key,
    pack_main_kv,
    pack_swa,
    unpack_index_key,
    unpack_main_kv,
    unpack_swa,
)
from cedserve.kernels.weight_formats import (
    dequantize_fp4_weight,
    dequantize_fp8_weight,
    quantize_fp4_weight,
    quantize_fp8_weight,
)
from cedserve.model.checkpoint import load_model
from cedserve.model.checkpoint_writer import (
    fit_config_to_tokenizer,
    load_drafter,
    random_model,
    snap_to_stored_formats,
    write_checkpoint,
)
from cedserve.model.config import ModelConfig
from cedserve.model.dspark import Drafter, DraftState
from cedserve.model.engram import table_primes
from cedserve.model.kv_format import KVFormat, index_key_values, main_values, window_values
from cedserve.model.network import CEDModel
from cedserve.model.presets import preset
from cedserve.model.tokenizer import TextCodec, build_compressed_token_map, tiny_tokenizer_path
from cedserve.training.data import (
    SPECIAL_TOKENS,
    SourceFile,
    code_files,
    is_heldout,
    load_corpus,
    spread_rows,
    token_stream,
    train_tokenizer,
)
from cedserve.training.trainer import (
    PhaseConfig,
    draft_batch,
    draft_loss,
    fp4_weight_round_trip,
    fp8_weight_round_trip,
    init_for_training_,
    lm_loss,
    train_backbone,
    train_drafter,
)

TEXT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "class Router:\n    def place(self, request):\n        return min(self.workers, key=lambda w: w.load)\n"
)


TIGHT = 1e-4
"""Float noise between the batched training pass and a row's `prefill` (measured: <= 2e-7)."""
FLIP_MARGIN = 2.0
"""A row reached by a near-tie may differ by this many times what rounding it the other way moves it."""


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous().view(torch.int32)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_straight_through_values_are_the_record_round_trip_bit_for_bit(scale: float) -> None:
    gen = torch.Generator().manual_seed(int(scale * 1000))
    x = (torch.randn(3, 5, 64, generator=gen) * scale).requires_grad_()
    x.data[0, 0, :7] = 0.0  # zeros and a sign flip inside a block
    x.data[0, 1, 3] = -0.0
    cases = [(window_values, pack_swa, unpack_swa), (main_values, pack_main_kv, unpack_main_kv),
             (index_key_values, pack_index_key, unpack_index_key)]
    for values, pack, unpack in cases:
        out = values(x, KVFormat.RECORDS)
        assert torch.equal(_bits(out), _bits(unpack(pack(x.detach()))))
        upstream = torch.randn(out.shape, generator=gen)
        (grad,) = torch.autograd.grad(out, x, upstream)
        assert torch.equal(grad, upstream)  # straight through
    bf16 = window_values(x, KVFormat.BF16)
    assert torch.equal(bf16, x.detach().to(torch.bfloat16).float())


def test_batched_weight_round_trips_equal_the_checkpoint_codecs() -> None:
    gen = torch.Generator().manual_seed(0)
    for shape in [(3, 96, 64), (2, 200, 160)]:
        w = torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, 1, generator=gen)
        fp8, fp4 = fp8_weight_round_trip(w), fp4_weight_round_trip(w)
        for i in range(shape[0]):
            assert torch.equal(fp8[i], dequantize_fp8_weight(*quantize_fp8_weight(w[i])))
            assert torch.equal(fp4[i], dequantize_fp4_weight(*quantize_fp4_weight(w[i])))


def micro_config() -> ModelConfig:
    """Four layers with every mode of the plan: SWA, an m=2 encoder source, the m=1 decoder source
    (also the candidate pool's), a Reindex layer; Engram; one draft layer."""
    config = ModelConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, head_dim=32, q_lora_rank=32,
        qk_rope_head_dim=8, o_groups=1, o_lora_rank=32, sliding_window=4, compress_ratios=(0, 2, 1, 1),
        kv_source_layer_ids=(1, 2), index_source_layer_ids=(1, 2, 3), candidate_source_layer_id=2,
        candidate_topk_blocks=2, candidate_block_size=2, index_n_heads=2, index_head_dim=32, index_topk=3,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, engram_layer_ids=(0,),
        engram_vocab_size=50, engram_num_embeddings=(1,), engram_n_heads=2, engram_head_dim=32,
        num_nextn_predict_layers=1, dspark_noise_token_id=3, dspark_target_layer_ids=(1, 2, 3), dspark_markov_rank=8,
        dspark_n_routed_experts=4, dspark_num_experts_per_tok=2, max_position_embeddings=1024,
        rope_scaling={"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 64}, pad_token_id=2)
    rows = tuple(sum(sum(p) for p in layer) for layer in table_primes(config))
    return fit_config_to_tokenizer(config.replace(engram_num_embeddings=rows), tiny_tokenizer_path())


def micro_models(seed: int = 0) -> tuple[CEDModel, Drafter]:
    from tokenizers import Tokenizer

    config = micro_config()
    token_map, _ = build_compressed_token_map(Tokenizer.from_file(str(tiny_tokenizer_path())))
    model, drafter = CEDModel(config, token_map), Drafter(config)
    generator = torch.Generator().manual_seed(seed)
    init_for_training_(model, config.num_hidden_layers, generator)
    init_for_training_(drafter, config.num_nextn_predict_layers, generator)
    return model, drafter


def stream() -> torch.Tensor:
    codec = TextCodec.from_file(tiny_tokenizer_path(), 512)
    return torch.tensor(codec.encode(TEXT), dtype=torch.long)


@pytest.mark.parametrize("kv_format", list(KVFormat))
def test_training_pass_equals_prefill_of_each_row(kv_format: KVFormat) -> None:
    """Each row of the batched training pass gives the logits and taps `prefill` gives for it alone:
    within float noise (1e-4) wherever no cached value is quantized (records, or bf16) from a near-tie;
    where one is, the two passes may round it apart, and the row may differ by about as much as
    rounding it the other way moves `prefill`'s row (`near_ties`)."""
    config = fit_config_to_tokenizer(preset("tiny"), tiny_tokenizer_path())
    model, _ = random_model(config, tiny_tokenizer_path(), seed=3)
    tokens = torch.randint(3, 500, (2, 37), generator=torch.Generator().manual_seed(1))
    out = model.forward_train(tokens, kv_format=kv_format, taps=True)
    assert out.taps is not None
    for b in range(2):

        def run(b: int = b) -> torch.Tensor:
            reference = model.prefill_with_taps(tokens[b], model.new_state(kv_format))
            return torch.cat([reference.logits, reference.taps.flatten(1)], dim=-1)  # [S, vocab + taps]

        got = run()
        assert got.shape == (tokens.shape[1], out.logits.shape[-1] + out.taps[b].flatten(1).shape[-1])
        trained = torch.cat([out.logits[b].detach(), out.taps[b].detach().flatten(1)], dim=-1)
        assert_close_but_near_ties(got, trained, run, TIGHT, FLIP_MARGIN, f"{kv_format.value} row {b}")


def test_a_few_steps_reduce_the_loss_and_the_checkpoint_gives_the_trained_logits(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, drafter = micro_models()
    data = stream()[:49]  # one row of 48 + 1 tokens: every batch is this fixed batch
    fixed = torch.stack([data, data])
    cfg = PhaseConfig(max_steps=4, batch_size=2, seq_len=48, lr=1e-2, warmup_steps=4, probe_steps=1, eval_every=4,
                      eval_rows=1, anchors_per_row=8, qat_fraction=0.5, dense_fraction=0.5)
    with torch.no_grad():
        before, _ = lm_loss(model, fixed)
    records: list[dict[str, object]] = []
    report = train_backbone(model, data, data, cfg, records.append)
    with torch.no_grad():
        after, _ = lm_loss(model, fixed)
    assert report.steps == 4 and records[-1]["qat"] is True
    assert float(after) < float(before) - 0.1, (float(before), float(after))

    anchors = torch.tensor([[0, 10, 20, 30], [5, 15, 25, 40]])

    def drafter_loss() -> float:
        with torch.no_grad():
            out = model.forward_train(fixed[:, :48], taps=True)
            assert out.taps is not None
            return float(draft_loss(model, drafter, draft_batch(drafter, fixed[:, :48], out.logits, out.taps, anchors))[0])

    draft_before = drafter_loss()
    train_drafter(model, drafter, data, data, cfg, records.append)
    assert drafter_loss() < draft_before

    snap_to_stored_formats(model)
    snap_to_stored_formats(drafter)
    write_checkpoint(model, drafter, tmp_path, tiny_tokenizer_path(), half_floats=True)
    loaded = load_model(tmp_path)
    prompt = data[:30]
    torch.testing.assert_close(loaded.prefill(prompt, loaded.new_state()), model.prefill(prompt, model.new_state()),
                               atol=1e-5, rtol=0)
    loaded_drafter = load_drafter(tmp_path, loaded.config)
    state = model.new_state()
    taps = model.prefill_with_taps(prompt, state).taps
    drafts = []
    for d, m in ((drafter, model), (loaded_drafter, loaded)):
        memory = DraftState.new(m.config)
        memory.extend(d.context_vectors(taps))
        drafts.append(d.draft(int(prompt[-1]), memory, m.embed, m.lm_head))
    assert drafts[0].tokens == drafts[1].tokens
    torch.testing.assert_close(drafts[0].confidences, drafts[1].confidences, atol=1e-5, rtol=0)


def test_heldout_split_is_fixed_by_path(tmp_path: Path) -> None:
    for i in range(40):
        (tmp_path / f"mod{i}.py").write_text(f"x = {i}\n")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "vendored.py").write_text("y = 1\n")
    (tmp_path / "latin.py").write_bytes(b"# \xe9\n")
    corpus = load_corpus(tmp_path, heldout_every=7)
    names = {f.relative for f in corpus.train} | {f.relative for f in corpus.heldout}
    assert names == {f"mod{i}.py" for i in range(40)}
    assert {f.relative for f in corpus.heldout} == {n for n in names if is_heldout(n, 7)}
    assert [f.relative for f in corpus.train] == sorted(f.relative for f in corpus.train)
    assert load_corpus(tmp_path, heldout_every=7) == corpus


def test_spread_rows_cover_the_stream_evenly_and_code_files_drop_generated_tables() -> None:
    stream = torch.arange(1000)
    rows = spread_rows(stream, 100, 4)
    assert rows.shape == (4, 100)
    assert rows[:, 0].tolist() == [0, 300, 600, 900] and rows[-1, -1].item() == 999
    assert torch.equal(rows[1], torch.arange(300, 400))
    assert spread_rows(stream, 1000, 3).tolist() == [list(range(1000))] * 3  # a short stream: overlapping rows
    with pytest.raises(ValueError, match="fewer than one row"):
        spread_rows(stream[:50], 100, 2)
    files = [SourceFile("encodings/cp1256.py", "decoding_table = (\n    '\\x00'\n)"),
             SourceFile("encodings/utf_8.py", "import codecs\n"), SourceFile("pydoc_data/topics.py", "topics = {}"),
             SourceFile("glob.py", "import os\n")]
    assert [f.relative for f in code_files(files)] == ["encodings/utf_8.py", "glob.py"]


def test_tokenizer_has_the_special_ids_and_loads_through_the_codec(tmp_path: Path) -> None:
    tok = train_tokenizer([TEXT] * 4, vocab_size=300)
    tok.save(str(tmp_path / "tokenizer.json"))
    codec = TextCodec.from_file(tmp_path, 300)
    assert [codec.token_id(s) for s in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert codec.decode(codec.encode(TEXT)) == TEXT
    ids = token_stream(tok, (SourceFile("a.py", "x = 1\n"), SourceFile("b.py", "y = 2\n"))).tolist()
    assert ids.count(1) == 2 and ids[-1] == 1  # eos after every file
    assert codec.decode(ids) == "x = 1\ny = 2\n"
