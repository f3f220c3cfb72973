"""Drafter-only training (issue 13): the backbone's greedy continuations, the distillation cache,
the cached loss against the serving draft pass, the acceptance replay, and the drafter-only
checkpoint whose backbone tensors are the input's byte for byte."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_training import micro_models, stream

from cedserve.model.checkpoint import load_model
from cedserve.model.checkpoint_writer import load_drafter, snap_to_stored_formats, write_checkpoint
from cedserve.model.dspark import Drafter, DraftRequest, DraftState
from cedserve.model.network import CEDModel
from cedserve.model.tokenizer import tiny_tokenizer_path
from cedserve.training.trainer import (
    DistillSet,
    PhaseConfig,
    backbone_identical,
    cached_draft_batch,
    cached_draft_loss,
    distill_set,
    greedy_continuations,
    init_for_training_,
    speculative_acceptance,
    train_drafter_cached,
    write_drafter_checkpoint,
)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """The micro model's ops are too small for intra-op threads: one thread is faster on 2 cores,
    and much faster when other jobs share them (60 s against 10 s for this file)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_greedy_continuations_are_the_backbones_greedy_decode() -> None:
    model, _ = micro_models()
    model.eval()
    prompts = torch.stack([stream()[i : i + 10] for i in (0, 7, 19)])
    rows = greedy_continuations(model, prompts, 6, batch_size=2)
    assert rows.shape == (3, 16)
    for row in rows:
        state = model.new_state()
        logits = model.prefill(row[:10], state)[-1]
        expected = []
        for _ in range(6):
            expected.append(int(logits.argmax()))
            logits = model.prefill([expected[-1]], state)[-1]
        assert row[10:].tolist() == expected
    cut = greedy_continuations(model, prompts, 6, batch_size=2, seconds=1e-9)  # spent at once: the first group, cut
    assert cut.shape == (2, 11) and torch.equal(cut, rows[:2, :11])


def _data(model: CEDModel) -> DistillSet:
    """Four rows: 12 text tokens, then the backbone's 20 greedy ones."""
    prompts = torch.stack([stream()[i : i + 12] for i in (0, 9, 23, 31)])
    return distill_set(model, greedy_continuations(model, prompts, 20, batch_size=4), 12, topk=8)


def test_training_counts_and_the_serving_replay_count_the_same_accepted_drafts() -> None:
    """Plant the drafter's own drafts as the backbone's greedy tokens after each row's anchor, the
    first m of them (m = 0..k-1 by row, then a token it did not draft): the replay through
    `Drafter.draft_batch` and the training pass (`cached_draft_loss`, whose Markov head reads the
    greedy tokens) must both count exactly m."""
    model, drafter = micro_models()
    model.eval()
    drafter.eval()
    data = _data(model)
    anchors = torch.tensor([12, 15, 17, 20])
    vectors = drafter.context_vectors(data.taps.unsqueeze(-2))
    requests = []
    for i, a in enumerate(anchors.tolist()):
        state = DraftState.new(drafter.config)
        state.extend(vectors[i, :a])  # the memory of a decode worker at this anchor
        requests.append(DraftRequest(int(data.tokens[i, a]), state))
    drafts = drafter.draft_batch(requests, model.embed, model.lm_head)
    planted = data.top_ids.clone()
    wanted = [0, 1, 3, 4]
    for i, (a, m) in enumerate(zip(anchors.tolist(), wanted)):
        tokens = drafts[i].tokens
        planted[i, a : a + m, 0] = torch.tensor(tokens[:m], dtype=torch.long)
        planted[i, a + m, 0] = (tokens[m] + 1) % model.config.vocab_size  # the first one it gets wrong
    data = DistillSet(data.tokens, data.taps, planted, data.top_logp, anchors)
    replay = speculative_acceptance(model, drafter, data, max_verifications=1)
    assert replay["verifications"] == 4
    assert replay["accepted_per_verify"] == pytest.approx(sum(wanted) / 4)
    assert replay["share_0"] == 0.25 and replay["share_4"] == 0.25
    with torch.no_grad():
        _, stats = cached_draft_loss(model, drafter, cached_draft_batch(drafter, data, torch.arange(4), anchors[:, None]))
    assert stats["accepted"] == pytest.approx(sum(wanted) / 4)


def test_cached_training_lowers_the_loss_and_raises_the_replayed_acceptance() -> None:
    torch.manual_seed(0)
    model, drafter = micro_models()
    model.eval()
    data = _data(model)
    rows, anchors = torch.arange(4), torch.tensor([[12, 16, 20, 24, 27]] * 4)

    def measure() -> tuple[float, float]:
        with torch.no_grad():
            loss, _ = cached_draft_loss(model, drafter, cached_draft_batch(drafter, data, rows, anchors))
        return float(loss), speculative_acceptance(model, drafter, data)["accepted_per_verify"]

    loss_before, accepted_before = measure()
    cfg = PhaseConfig(max_steps=60, batch_size=4, seq_len=data.seq_len, lr=3e-3, warmup_steps=4, probe_steps=1,
                      eval_every=20, anchors_per_row=8, qat_fraction=0.3)
    records: list[dict[str, object]] = []
    report = train_drafter_cached(model, drafter, data, cfg, records.append,
                                  evaluate=lambda: speculative_acceptance(model, drafter, data))
    loss_after, accepted_after = measure()
    assert report.steps == 60 and [r["step"] for r in records] == [20, 40, 60] and records[-1]["qat"] is True
    assert records[-1]["heldout_accepted_per_verify"] == pytest.approx(accepted_after)
    assert loss_after < loss_before - 0.5, (loss_before, loss_after)
    assert accepted_after > accepted_before + 1.0, (accepted_before, accepted_after)  # 0.64 -> 2.3 of 5


def test_drafter_only_checkpoint_keeps_the_backbone_bytes(tmp_path: Path) -> None:
    model, drafter = micro_models()
    snap_to_stored_formats(model)
    snap_to_stored_formats(drafter)
    source, out = tmp_path / "source", tmp_path / "out"
    write_checkpoint(model, drafter, source, tiny_tokenizer_path(), half_floats=True)
    base = load_model(source)
    c = base.config
    bigger = c.replace(num_nextn_predict_layers=2, compress_ratios=c.compress_ratios[: c.num_hidden_layers])
    new = Drafter(bigger)
    init_for_training_(new, 2, torch.Generator().manual_seed(5))
    snap_to_stored_formats(new)
    write_drafter_checkpoint(source, new, out, {"note": "test"})

    same = backbone_identical(source, out)
    assert same["identical"] and same["differ"] == [] and same["tensors"] > 20
    with safe_open(str(source / "model.safetensors"), "pt") as a, safe_open(str(out / "model.safetensors"), "pt") as b:
        names = [n for n in a.keys() if not n.startswith("dspark.")]  # noqa: SIM118
        assert names and all(a.get_tensor(n).view(torch.uint8).equal(b.get_tensor(n).view(torch.uint8)) for n in names)
        assert any(n.startswith("dspark.layers.1.") for n in b.keys())  # noqa: SIM118
        assert b.metadata()["note"] == "test"
    loaded = load_model(out)
    assert loaded.config.num_nextn_predict_layers == 2 and loaded.config.num_hidden_layers == c.num_hidden_layers
    prompt = stream()[:20]
    assert torch.equal(loaded.prefill(prompt, loaded.new_state()), base.prefill(prompt, base.new_state()))
    loaded_drafter = load_drafter(out, loaded.config)
    for (name, p), q in zip(new.state_dict().items(), loaded_drafter.state_dict().values()):
        assert torch.equal(p, q), name

    (out / "model.safetensors").unlink()  # a changed backbone tensor is named
    write_checkpoint(model, drafter, out, tiny_tokenizer_path(), half_floats=False)
    assert not backbone_identical(source, out)["identical"]
    with pytest.raises(ValueError, match="backbone fields"):
        write_drafter_checkpoint(source, Drafter(c.replace(sliding_window=8)), tmp_path / "bad")


def test_drafter_only_trainer_writes_a_bigger_drafter_beside_the_same_backbone(tmp_path: Path) -> None:
    """`python -m cedserve.training.demo --init --drafter-only` end to end on the micro model: cache,
    training, replay, checkpoint; exit 0 needs the backbone byte-identical and the drafter loaded back
    exactly."""
    import json

    from cedserve.training import demo as train_demo

    model, drafter = micro_models()
    snap_to_stored_formats(model)
    snap_to_stored_formats(drafter)
    write_checkpoint(model, drafter, tmp_path / "in", tiny_tokenizer_path(), half_floats=True)
    report = tmp_path / "report.json"
    rc = train_demo.main(["--init", str(tmp_path / "in"), "--drafter-only", "--device", "cpu", "--out",
                          str(tmp_path / "out"), "--report", str(report), "--max-files", "60", "--heldout-every", "7", "--seq-len", "40",
                          "--greedy-prompt", "30", "--greedy-rows", "3", "--greedy-batch", "2", "--corpus-rows", "2",
                          "--eval-prompts", "2", "--eval-prompt-len", "24", "--eval-new", "10",
                          "--drafter-steps", "4", "--batch-size", "2", "--anchors-per-row", "4", "--evaluations", "2",
                          "--drafter-init", "fresh", "--draft-layers", "2", "--keep-last"])
    assert rc == 0
    out = json.loads(report.read_text())
    assert out["checkpoint"]["backbone"]["identical"] and out["checkpoint"]["max_abs_drafter_weight_gap_after_load"] == 0
    assert out["cache"]["greedy_rows"] == 3 and out["cache"]["corpus_rows"] == 2 and out["drafter"]["steps"] == 4
    assert out["drafter_config"]["layers"] == 2 and out["drafter"]["kept"] == "last"
    assert 0 <= out["acceptance_after"]["accepted_per_verify"] <= 5 and out["acceptance_after"]["verifications"] > 0
    assert load_model(tmp_path / "out").config.num_nextn_predict_layers == 2


def test_confidence_loss_counts_a_position_only_after_a_matched_prefix() -> None:
    from cedserve.training.trainer import confidence_loss

    match = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]])
    good = torch.tensor([[0.9, 0.1, 0.5, 0.5], [0.1, 0.5, 0.5, 0.5]]).unsqueeze(-1)
    # positions after the first miss do not count: changing them leaves the loss unchanged
    other = good.clone()
    other[0, 2:] = 0.01
    other[1, 1:] = 0.99
    assert torch.allclose(confidence_loss(good, match), confidence_loss(other, match))
    # the counted ones: row 0 positions 0-1, row 1 position 0 (mean BCE over those three)
    expected = -(torch.log(torch.tensor(0.9)) + torch.log(torch.tensor(0.9)) + torch.log(torch.tensor(0.9))) / 3
    assert torch.allclose(confidence_loss(good, match), expected, atol=1e-6)
