"""The paged decode path (`cedserve.model.paged_attention`): decode and verify chunks attending through
the kernels' paged addressing give what the dense path gives.

The "reference" backend runs the kernels' torch references in float32 through the same arena,
block tables, slot lists and two-level top-k, so against the dense path only summation order
differs: logits must agree to float noise, step after step, through rollbacks. The "kernels"
backend runs the Triton kernels under the interpreter (bf16 queries and probabilities: looser).
"""

from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from decode_support import tiny

from cedserve.decode_workers.config import PreemptionPolicy
from cedserve.kernels.triton_support import triton_available
from cedserve.model.context import ForwardContext
from cedserve.model.dspark import Drafter
from cedserve.model.kv_format import KVFormat
from cedserve.model.network import BatchItem, CEDModel
from cedserve.model.paged_attention import PagedArena, PagedPass, arena_block_size
from cedserve.model.state import SequenceState

pytestmark = pytest.mark.unit


@pytest.fixture
def pair() -> Iterator[tuple[CEDModel, Drafter]]:
    """The shared tiny model (`decode_support.tiny` is cached across tests): put back on the dense
    path afterwards, whatever a test switched on."""
    model, drafter = tiny()
    yield model, drafter
    model.use_paged_attention(None)

REFERENCE_ATOL = 2e-4
"""Dense vs paged reference logits (float32; seen ~1e-6: the same values summed in another order)."""
KERNEL_ATOL = 0.25
"""Dense float32 vs the interpreted kernels (bf16 queries, bf16 probabilities, bf16 output), on logits
of O(1..10): seen up to 0.11, the bf16 rounding carried through 12 layers of a random-weight model.
A bound against gross errors; the GPU test checks each kernel call on its own inputs."""


def prefilled(model: CEDModel, length: int, gen: torch.Generator, chunk: int = 2048) -> SequenceState:
    state = model.new_state()
    tokens = torch.randint(3, 500, (length,), generator=gen).tolist()
    for at in range(0, length, chunk):
        model.prefill(tokens[at : at + chunk], state)
    return state


def run_both(model: CEDModel, backend: str, lengths: list[int], steps: int, atol: float,
             seed: int = 5, rel_norm: float = 0.0) -> tuple[PagedArena, list[SequenceState], int]:
    """Decode `steps` passes of every sequence on the dense and the paged path from equal states;
    with verify chunks rolled back every other step. Returns the arena, the paged states and how
    many compressed picks differed from all-visible (so the test knows the top-k mattered)."""
    gen = torch.Generator().manual_seed(seed)
    dense = [prefilled(model, n, gen) for n in lengths]
    paged = [copy.deepcopy(s) for s in dense]
    arena = PagedArena(model.config, model.embed.weight.device, backend)  # type: ignore[arg-type]
    narrowed = 0
    for step in range(steps):
        plans = []
        for i in range(len(lengths)):
            if (step + i) % 2:
                plans.append((torch.randint(3, 500, (4,), generator=gen).tolist(), True))
            else:
                plans.append((torch.randint(3, 500, (1,), generator=gen).tolist(), False))
        results = []
        for states, use in ((dense, None), (paged, arena)):
            model.paged_arena = use
            items = [BatchItem(chunk, s, snapshot=verify) for (chunk, verify), s in zip(plans, states)]
            results.append(model.forward_batch(items))
        model.paged_arena = None
        for i, (want, got) in enumerate(zip(*results)):
            worst = float((got.logits - want.logits).abs().max())
            rel = float(torch.linalg.norm(got.logits - want.logits) / torch.linalg.norm(want.logits))
            print(f"step {step} seq {i}: worst logit difference {worst:.3g}, relative norm {rel:.3g}")
            if rel_norm:
                assert rel <= rel_norm, f"step {step}, seq {i}: relative error {rel:.3g} > {rel_norm}"
            else:
                torch.testing.assert_close(got.logits, want.logits, atol=atol, rtol=0, msg=f"step {step}, seq {i}")
            if plans[i][1]:  # reject the drafts: roll both back, then keep one token by a plain decode
                assert want.snapshot is not None and got.snapshot is not None
                dense[i].restore(want.snapshot)
                paged[i].restore(got.snapshot)
        for d, p in zip(dense, paged):
            assert d.position == p.position
            for layer, kv in d.global_kv.items():
                assert kv.num_entries == p.global_kv[layer].num_entries, layer
                if backend == "reference":  # the kernels' bf16 rounding may flip an FP4 code later on
                    assert torch.equal(kv.main, p.global_kv[layer].main), layer
    for s in paged:
        pages = s.paged
        assert pages is not None and len(pages.blocks) * arena.layout.block_size >= s.position
        for layer, kv in s.global_kv.items():  # the arena holds exactly the state's records
            region = arena.layout.pool_view(arena.storage, layer, "main")
            per_block = region.shape[1]
            entries = torch.arange(kv.num_entries)
            rows = torch.as_tensor(pages.blocks)[entries // per_block]
            assert torch.equal(region[rows, entries % per_block], kv.main), layer
    for s in paged:
        narrowed += sum(int(kv.num_entries > model.config.index_topk) for kv in s.global_kv.values())
    return arena, paged, narrowed


def test_reference_backend_equals_dense_path(pair: tuple[CEDModel, Drafter]) -> None:
    model, _ = pair
    # tiny: window 8, index_topk 8 inside a pool of 4 blocks x 2; m = 2 and m = 1 sources
    arena, states, narrowed = run_both(model, "reference", [5, 20, 47, 90], steps=6, atol=REFERENCE_ATOL)
    assert narrowed > 0  # some sources hold more entries than the top-k: the picks decided
    assert arena.copied_entries > 0
    used = arena.num_blocks - arena.num_free
    assert used == sum(len(s.paged.blocks) for s in states if s.paged is not None)
    del states
    gc.collect()
    assert arena.num_free == arena.num_blocks  # every block came back with its state


def test_arena_grows_and_rewinds(pair: tuple[CEDModel, Drafter]) -> None:
    model, _ = pair
    config = model.config
    arena = PagedArena(config, torch.device("cpu"), "reference", initial_blocks=1)
    block = arena_block_size(config)
    assert block % 2 == 0 and block >= 64
    gen = torch.Generator().manual_seed(3)
    state = prefilled(model, 3 * block + 3, gen)
    model.prefill([7, 8], state)  # the records buffer now has spare rows: appends stay in place
    arena.reserve(state, state.position)
    assert arena.num_blocks >= 4 and len(state.paged.blocks) == 4  # type: ignore[union-attr]
    layer = next(iter(state.global_kv))
    arena.sync([state], layer)
    first = arena.copied_entries
    assert first == state.global_kv[layer].num_entries
    arena.sync([state], layer)
    assert arena.copied_entries == first  # nothing new: nothing copied
    snap = state.snapshot()
    model.prefill(torch.randint(3, 500, (6,), generator=gen).tolist(), state)
    arena.reserve(state, state.position)
    arena.sync([state], layer)
    grown = arena.copied_entries - first
    assert grown == state.global_kv[layer].num_entries - snap.global_kv[layer][0].shape[0] > 0
    state.restore(snap)  # the rolled-back entries must be copied again once rewritten
    model.prefill(torch.randint(3, 500, (6,), generator=gen).tolist(), state)
    arena.sync([state], layer)
    assert arena.copied_entries - first == 2 * grown
    kv = state.global_kv[layer]
    before = arena.copied_entries
    kv.set_records(kv.main.clone(), kv.index_keys.clone())  # replaced (as a load from blocks does)
    arena.sync([state], layer)
    assert arena.copied_entries - before == kv.num_entries  # all copied again
    assert not arena.trim()  # blocks held: nothing to give back
    del state, kv, snap
    gc.collect()
    assert arena.trim() and arena.num_blocks == arena.num_free == 1  # idle: back to its first size


def test_arena_refuses_what_the_kernels_cannot_run(pair: tuple[CEDModel, Drafter]) -> None:
    model, _ = pair
    with pytest.raises(ValueError, match="backend"):
        PagedArena(model.config, torch.device("cpu"), "fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kernels cannot run this model: head_dim"):
        PagedArena(model.config.replace(head_dim=96), torch.device("cpu"))
    bf16_state = model.new_state(KVFormat.BF16)
    arena = PagedArena(model.config, torch.device("cpu"), "reference")
    with pytest.raises(ValueError, match="record states"):
        arena.pages(bf16_state)


def test_bf16_states_stay_on_the_dense_path(pair: tuple[CEDModel, Drafter],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = pair
    model.use_paged_attention("reference")
    state = model.new_state(KVFormat.BF16)
    model.prefill([5, 6, 7], state)
    seen: list[PagedPass | None] = []
    begin = model._begin_batch

    def spy(items: list[BatchItem]) -> object:
        batch, tokens = begin(items)
        seen.append(batch.paged)
        return batch, tokens

    monkeypatch.setattr(model, "_begin_batch", spy)
    model.forward_batch([BatchItem([8], state)])
    assert seen == [None] and state.paged is None


def test_global_kv_appends_in_place_and_snapshots_stay_exact(pair: tuple[CEDModel, Drafter]) -> None:
    model, _ = pair
    gen = torch.Generator().manual_seed(9)
    state = prefilled(model, 40, gen)
    model.prefill([7, 8], state)  # the first append after a prefill moves the rows to a roomier buffer
    layer = next(iter(state.global_kv))
    kv = state.global_kv[layer]
    snap = state.snapshot()
    kept = snap.global_kv[layer][0].clone()
    base = kv.main.data_ptr()
    model.prefill(torch.randint(3, 500, (2,), generator=gen).tolist(), state)
    assert kv.num_entries > kept.shape[0]
    assert kv.main.data_ptr() == base  # written past the view's end, no copy of the history
    assert torch.equal(snap.global_kv[layer][0], kept)
    state.restore(snap)
    model.prefill(torch.randint(3, 500, (2,), generator=gen).tolist(), state)
    assert torch.equal(kv.main[: kept.shape[0]], kept)


@pytest.mark.skipif(not triton_available(), reason="needs Triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the GPU test runs the kernels natively (switching "
                                                      "Triton to its interpreter mid-process breaks later launches)")
def test_kernels_backend_under_the_interpreter(pair: tuple[CEDModel, Drafter], request: pytest.FixtureRequest) -> None:
    """The kernels backend equals the reference with every kernel interpreted. It runs in a child
    pytest started with TRITON_INTERPRET=1: set mid-process, the interpreter fails once anything
    earlier in the process (an Inductor compile in another test) has touched Triton's launch path."""
    if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("CEDSERVE_TEST_CHILD") == "interpreter":
        model, _ = pair
        run_both(model, "kernels", [9, 70], steps=2, atol=KERNEL_ATOL)
        return
    env = {**os.environ, "TRITON_INTERPRET": "1", "CEDSERVE_TEST_CHILD": "interpreter"}
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                            f"{request.node.path}::{request.node.name}"], env=env, capture_output=True, text=True,
                           timeout=600)
    assert child.returncode == 0 and " passed" in child.stdout, child.stdout[-3000:] + child.stderr[-2000:]


@pytest.mark.parametrize("dspark", [False, True], ids=["plain", "dspark"])
def test_decode_engine_on_the_paged_path(dspark: bool, pair: tuple[CEDModel, Drafter]) -> None:
    """The engine with `paged_attention = "reference"`: the same tokens as the dense engine (joins by
    replay, continuous batching, DSpark verify chunks and their rollbacks), and every arena block
    back once the requests finish."""
    from decode_support import Rig, greedy_rounds, prompt

    prompts = [prompt(37, 1), prompt(21, 2), prompt(90, 3)]
    outputs = {}
    model, drafter = pair
    for mode in ("off", "reference"):
        rig = Rig(model, drafter, dspark=dspark, paged_attention=mode)
        assert rig.engine.paged_attention == mode
        outputs[mode] = list(greedy_rounds(rig, prompts, 12).values())
        rig.assert_all_free()
        arena = model.paged_arena
        if mode == "reference":
            assert arena is not None and arena.copied_entries > 0
            text = rig.engine.metrics.registry.get_sample_value("cedserve_decode_paged_attention_copied_entries")
            assert text == arena.copied_entries
            gc.collect()
            assert arena.num_free == arena.num_blocks
        else:
            assert arena is None
    assert outputs["reference"] == outputs["off"]


def test_engine_refuses_a_paged_path_the_model_cannot_take(pair: tuple[CEDModel, Drafter]) -> None:
    from decode_support import Rig

    from cedserve.decode_workers.config import DecodeConfig

    with pytest.raises(ValueError, match=r"decode\.paged_attention"):
        DecodeConfig(paged_attention="fast")
    model, _ = pair
    rig = Rig(model, None, paged_attention="auto")
    assert rig.engine.paged_attention == "reference"  # auto on a CPU: the kernels' torch references
    unsuited = copy.deepcopy(model)
    unsuited.config = unsuited.config.replace(head_dim=96)
    assert Rig(unsuited, None, paged_attention="auto").engine.paged_attention == "off"
    with pytest.raises(ValueError, match=r"decode\.paged_attention.*head_dim"):
        Rig(unsuited, None, paged_attention="kernels")


GPU_ATTENTION_REL = 1e-2
"""GPU: ||kernel - reference|| / ||reference|| of every layer's attention output, the reference being
`sparse_attention_reference` on the same bf16 queries and the same slots (the kernel also rounds the
probabilities to bf16 for P.V: a few bf16 ulps)."""
GPU_PICKS_AGREE = 0.99
"""GPU: fraction of picked entries the index kernels share with `index_topk_reference` (scores summed in
another order may swap two entries whose scores differ in the last fp32 bits)."""
GPU_LOGITS_REL = 0.5
"""GPU: ||paged - dense|| / ||dense|| of a step's logits. Only a sanity bound: the paged path rounds to
bf16 in each of 40 (12) layers where the dense path stays float32, and a random-weight model
amplifies such differences from layer to layer (on the CPU with the torch references and bf16
queries: up to 0.23 within three steps; on the H200, runs 3-5: up to 0.34, the same each run). It
catches gross errors only; the per-call checks are the test."""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("released", [False, True], ids=["tiny-32-index-heads", "mini40-released-attention"])
def test_gpu_kernels_on_the_model_path(released: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU the paged path runs the real kernels: the tiny model (4 heads x 64: the Triton
    attention kernel; d = 32 index keys: the Triton scan) and mini-40 with the released attention
    geometry (64 heads x 512, 32 index heads x 128, top-512 in a 2048-block pool: the Gluon attention
    and scan on sm_90), contexts past the top-k so the picks decide, verify chunks and rollbacks.
    Every index and attention call of every layer is checked against the kernels' references on its
    own inputs (the model's real queries, tables and slots); the logits only against a loose bound.
    Both models have 32 index heads: with the presets' 4, an entry scores exactly 0 whenever its four
    ReLUs are (1 in 16), and ties at the k-th score resolve differently in `torch.topk` and the
    top-k kernel (column order), which is allowed."""
    from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model
    from cedserve.model.presets import preset, released_attention
    from cedserve.model.tokenizer import tiny_tokenizer_path

    calls = KernelCalls(monkeypatch)
    if released:
        config = fit_config_to_tokenizer(preset("mini-40"), tiny_tokenizer_path())
        config = released_attention(config).replace(vocab_size=min(config.vocab_size, 512))
        lengths = [130, 2600]  # m = 2: 1,300 entries > top-512
    else:
        config = fit_config_to_tokenizer(preset("tiny"), tiny_tokenizer_path()).replace(index_n_heads=32)
        lengths = [9, 300, 1500]
    model, _ = random_model(config, tiny_tokenizer_path(), seed=3)
    run_both(model.cuda(), "kernels", lengths, steps=3, atol=0.0, rel_norm=GPU_LOGITS_REL)
    calls.check()


class KernelCalls:
    """Checks every index and attention call of the paged path against the kernels' references on
    the call's own inputs (the model's real queries, tables and slots)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from cedserve.kernels.indexer import index_topk_reference
        from cedserve.kernels.sparse_attention import sparse_attention_reference
        from cedserve.model import paged_attention

        self.picks = {"same": 0, "all": 0}
        self.attention_errors: list[float] = []
        self.rows: list[int] = []
        index_topk = paged_attention.index_topk
        attend = paged_attention.PagedPass.attend

        def checked_topk(q: torch.Tensor, weights: torch.Tensor, keys: object, **kw: object) -> object:
            got = index_topk(q, weights, keys, **kw)  # type: ignore[arg-type]
            ref_kw = {name: value for name, value in kw.items() if name != "impl"}
            want, _ = index_topk_reference(q, weights, keys, **ref_kw)  # type: ignore[arg-type]
            for g, w in zip(got.entries.tolist(), want.entries.tolist()):
                g_set, w_set = {e for e in g if e >= 0}, {e for e in w if e >= 0}
                self.picks["same"] += len(g_set & w_set)
                self.picks["all"] += len(w_set)
            return got

        def checked_attend(pass_: PagedPass, q: torch.Tensor, sink: torch.Tensor, records: list[torch.Tensor],
                           window: int, kv_layer: int | None, index_layer: int | None, scale: float) -> torch.Tensor:
            out = attend(pass_, q, sink, records, window, kv_layer, index_layer, scale)
            main, topk_slots, swa, window_slots = pass_.attention_keys(records, window, kv_layer, index_layer)
            none = torch.zeros(q.shape[0], 0, device=q.device)
            want = sparse_attention_reference(q.bfloat16(), sink, main, topk_slots, swa, window_slots, none, none,
                                              scale)
            error = torch.linalg.norm(out.float() - want.float()) / torch.linalg.norm(want.float())
            self.attention_errors.append(float(error))
            self.rows.append(int(q.shape[0]))
            return out

        monkeypatch.setattr(paged_attention, "index_topk", checked_topk)
        monkeypatch.setattr(paged_attention.PagedPass, "attend", checked_attend)

    def check(self) -> None:
        errors, picks = self.attention_errors, self.picks
        print(f"attention: worst relative error {max(errors):.3g} over {len(errors)} calls (rows up to "
              f"{max(self.rows)}); picks: {picks['same']} of {picks['all']} shared")
        assert errors and max(errors) <= GPU_ATTENTION_REL
        assert picks["all"] > 0 and picks["same"] >= GPU_PICKS_AGREE * picks["all"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_prefill_chunks_through_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill chunks of 2,048 and ragged rows, `encode_chunk` + `replay_decoder` and a replay run the
    real kernels on mini-40 with the released attention geometry (Gluon attention and scan on sm_90):
    every call checked against the references on its own inputs; the last logits against the dense
    path's only loosely (GPU_LOGITS_REL)."""
    from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model
    from cedserve.model.presets import preset, released_attention
    from cedserve.model.tokenizer import tiny_tokenizer_path

    config = fit_config_to_tokenizer(preset("mini-40"), tiny_tokenizer_path())
    config = released_attention(config).replace(vocab_size=min(config.vocab_size, 512))
    model, _ = random_model(config, tiny_tokenizer_path(), seed=4)
    model = model.cuda()
    tokens = torch.randint(3, 500, (5000,), generator=torch.Generator().manual_seed(8)).tolist()
    dense = model.new_state()
    chunks = [(0, 2048), (2048, 4096), (4096, 4999)]
    want = [model.prefill(tokens[a:b], dense) for a, b in chunks]
    calls = KernelCalls(monkeypatch)
    model.use_paged_attention("kernels")
    try:
        paged = model.new_state()
        got = [model.prefill(tokens[a:b], paged) for a, b in chunks]
        encoded = model.new_state()
        boundary = [model.encode_chunk(tokens[a:b], encoded).boundary for a, b in chunks]
        model.replay_decoder(boundary[-1].last(300), encoded)
        model.replay(tokens[4999 - 600 : 4999], paged)
    finally:
        model.use_paged_attention(None)
    for g, w in zip(got, want):
        rel = float(torch.linalg.norm(g - w) / torch.linalg.norm(w))
        print(f"prefill chunk of {g.shape[0]} rows: logits relative difference {rel:.3g}")
        assert rel <= GPU_LOGITS_REL
    calls.check()
    assert max(calls.rows) == 2048


def test_release_returns_blocks_and_set_records_drops_buffers(pair: tuple[CEDModel, Drafter]) -> None:
    """What an offload does (`state_io.offload`): the records' buffers and the arena's blocks go at
    once, not when the (kept) state object is freed; a later pass pages the state again."""
    model, _ = pair
    gen = torch.Generator().manual_seed(4)
    state = prefilled(model, 150, gen)
    model.prefill([9, 10], state)  # grown in place: the records live in a buffer with spare rows
    arena = PagedArena(model.config, torch.device("cpu"), "reference", initial_blocks=4)
    arena.reserve(state, state.position)
    assert arena.num_free < arena.num_blocks
    state.release_paged()
    assert arena.num_free == arena.num_blocks and state.paged is None
    kv = next(iter(state.global_kv.values()))
    assert kv._main_buf is not None
    kv.set_records(kv.main[:0].clone(), kv.index_keys[:0].clone())
    assert kv._main_buf is None and kv._keys_buf is None and kv.num_entries == 0
    arena.reserve(state, state.position)  # paged again from scratch
    assert state.paged is not None and arena.num_free < arena.num_blocks


@pytest.mark.parametrize("policy", ["offload", "recompute"])
def test_preemption_on_the_paged_path(policy: str, pair: tuple[CEDModel, Drafter]) -> None:
    """A pool too small for both requests: one is preempted (offloaded to host or dropped) and comes
    back; the tokens equal the dense engine's under the same pressure, and the arena ends empty."""
    from decode_support import Rig, greedy_rounds, prompt

    model, drafter = pair
    prompts = [prompt(30, 11), prompt(30, 12)]
    got = {}
    for mode in ("off", "reference"):
        rig = Rig(model, drafter, num_blocks=3, dspark=False, preemption=PreemptionPolicy(policy), paged_attention=mode)
        got[mode] = list(greedy_rounds(rig, prompts, 7).values())
        assert rig.engine.metrics.preemptions.labels(policy)._value.get() >= 1
        rig.assert_all_free()
    assert got["reference"] == got["off"]
    arena = model.paged_arena
    assert arena is not None
    gc.collect()
    assert arena.num_free == arena.num_blocks


# ---------------------------------------------------------------- chunks on their own (`attend_one`)

CHUNK_ATOL = 2e-5
"""Dense vs paged reference attention of one layer from the same inputs (float32, values of O(1);
seen ~1e-6: the same terms summed in another order)."""


class LayerTwins:
    """Runs every dense `Attention.attend_one` call a second time on the paged path, from the same
    inputs and the same layer state: a twin of the chunk's state is given the dense state's window and
    records before each layer. Layer by layer, so the FP4 rounding of records written from slightly
    different activations (which end-to-end comparisons of long chunks would amplify) cannot hide a
    wrong window slot, pick or row behind a loose bound."""

    def __init__(self, model: CEDModel, monkeypatch: pytest.MonkeyPatch) -> None:
        from cedserve.model.attention import Attention

        self.arena = PagedArena(model.config, torch.device("cpu"), "reference")
        self.twins: dict[int, tuple[object, SequenceState, PagedPass]] = {}
        self.calls: list[tuple[int, int, float]] = []  # (layer, rows, worst difference)
        dense = Attention.attend_one

        def checked(attn: Attention, x: torch.Tensor, q_residual: torch.Tensor, q: torch.Tensor,
                    kv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
            if ctx.paged is not None:  # a paged pass of the model itself
                return dense(attn, x, q_residual, q, kv, ctx)
            twin_ctx = self._twin(attn.spec.layer_id, ctx)
            want = dense(attn, x, q_residual, q, kv, ctx)
            got = dense(attn, x, q_residual, q, kv, twin_ctx)
            self._compare(attn.spec.layer_id, ctx.state, twin_ctx.state, want, got)
            return want

        monkeypatch.setattr(Attention, "attend_one", checked)

    def _twin(self, layer: int, ctx: ForwardContext) -> ForwardContext:
        known = self.twins.get(id(ctx))
        if known is None or known[0] is not ctx:
            twin = copy.deepcopy(ctx.state)
            rows = int(ctx.positions.shape[0])
            pass_ = PagedPass.build(self.arena, [twin], [rows], [ctx.start], [0], rows, torch.device("cpu"))
            known = self.twins[id(ctx)] = (ctx, twin, pass_)
        _, twin, pass_ = known
        dense = ctx.state
        twin.swa[layer] = dense.swa[layer]
        for source, kv in dense.global_kv.items():  # the dense state's records, copied to the arena again
            twin.global_kv[source].set_records(kv.main.clone(), kv.index_keys.clone())
            twin.global_kv[source].pending = kv.pending
            self.arena.sync([twin], source)
        return ForwardContext(ctx.positions, ctx.rope, twin, ctx.start, write_global_kv=ctx.write_global_kv, paged=pass_)

    def _compare(self, layer: int, dense: SequenceState, twin: SequenceState, want: torch.Tensor,
                 got: torch.Tensor) -> None:
        worst = float((got - want).abs().max()) if want.numel() else 0.0
        self.calls.append((layer, int(want.shape[0]), worst))
        torch.testing.assert_close(got, want, atol=CHUNK_ATOL, rtol=0, msg=f"layer {layer}, {want.shape[0]} rows")
        assert torch.equal(twin.swa[layer], dense.swa[layer]), layer
        kv = dense.global_kv.get(layer)
        if kv is not None:  # a KV source: appended (or, on a replay, its partial group rebuilt) alike
            mine = twin.global_kv[layer]
            assert torch.equal(mine.main, kv.main) and torch.equal(mine.index_keys, kv.index_keys), layer
            assert mine.pending.kv.shape == kv.pending.kv.shape, layer
            torch.testing.assert_close(mine.pending.kv, kv.pending.kv, atol=0, rtol=0)


def test_chunks_on_the_paged_path_attend_as_the_dense_path(pair: tuple[CEDModel, Drafter],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill chunks of many lengths (across the window of 8, m = 2 groups, 64-token arena blocks,
    the candidate blocks and top-8), `encode_chunk` + `replay_decoder` (the prefill worker), a replay
    (a decode worker's join) and the long chunk of a `forward_batch` (an alone item): each layer's
    paged attention equals the dense one from the same inputs."""
    model, _ = pair
    twins = LayerTwins(model, monkeypatch)
    gen = torch.Generator().manual_seed(21)
    tokens = torch.randint(3, 500, (700,), generator=gen).tolist()
    state = model.new_state()
    at = 0
    for n in (1, 7, 33, 100, 300):
        model.prefill(tokens[at : at + n], state)
        at += n
    encoded = model.new_state()
    boundary = [model.encode_chunk(tokens[i : i + 150], encoded).boundary for i in (0, 150)]
    model.replay_decoder(boundary[1], encoded)
    model.replay(tokens[at - 40 : at], state)
    other = model.new_state()
    model.prefill(tokens[:5], other)
    model.forward_batch([BatchItem(tokens[at : at + 45], state), BatchItem([9], other)])
    layers = {layer for layer, _, _ in twins.calls}
    assert layers == set(range(model.config.num_hidden_layers))
    assert {rows for _, rows, _ in twins.calls} >= {1, 7, 33, 100, 300, 150, 40, 45}
    assert twins.arena.copied_entries > 0
    print(f"{len(twins.calls)} layer calls, worst difference {max(w for _, _, w in twins.calls):.3g}")


# ---------------------------------------------------------------- kernel warm-up

def test_kernel_warmup_runs_the_paged_path_and_gives_everything_back(pair: tuple[CEDModel, Drafter]) -> None:
    """`warm_up_decode` / `warm_up_prefill` over synthetic sequences (zero records at each context):
    the paged path runs (entries copied into the arena), the reported grid is what was asked, and
    every arena block comes back. The compile savings are measured on the GPU
    (`benchmarks/kernel_warmup.py`); here the reference backend stands in for the kernels."""
    from cedserve.model.kernel_warmup import (
        contexts_to_visit,
        rows_to_visit,
        synthetic_state,
        warm_up_decode,
        warm_up_prefill,
    )

    model, _ = pair
    unit = arena_block_size(model.config)
    assert contexts_to_visit(model, 1000, first=256) == [256, 512, 1000 // unit * unit]
    assert rows_to_visit(3) == [1, 2, 3] and rows_to_visit(500)[-3:] == [68, 80, 81]
    state = synthetic_state(model, 512)
    assert state.position == 512 and all(kv.num_entries == 512 // kv.ratio for kv in state.global_kv.values())
    assert all(w.shape[0] == model.config.sliding_window - 1 for w in state.swa.values())
    with pytest.raises(ValueError, match="not on the paged attention path"):
        warm_up_decode(model, 1000, 2)
    arena = model.use_paged_attention("reference")
    assert arena is not None
    lines: list[str] = []
    report = warm_up_decode(model, 1000, 3, report=lines.append, first_context=256)
    assert report.cells == 3 * 3 == len(lines) and report.rows == [1, 2, 3]  # contexts x pass sizes
    assert "9/9 cells" in lines[-1]
    copied = arena.copied_entries
    assert copied > 0
    report = warm_up_prefill(model, 1000, 128, 32, report=lines.append, first_context=256)
    assert report.contexts[0] == 0 and report.contexts[-1] + 128 <= 1000
    assert arena.copied_entries > copied
    gc.collect()
    assert arena.num_free == arena.num_blocks  # the synthetic sequences are gone, their blocks back
    with pytest.raises(ValueError, match="multiple of every ratio"):
        synthetic_state(model, 513)


def test_engines_warm_up_before_serving(pair: tuple[CEDModel, Drafter], monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU there is nothing to compile, so no warm-up runs; where there is (here pretended, on
    the reference backend), the decode engine warms up every pass size it can run at the contexts its
    pool holds, the prefill engine its chunk and replay, both before taking work, and both give
    every arena block back."""
    from decode_support import Rig
    from test_prefill_engine import make_rig

    from cedserve.model import kernel_warmup
    from cedserve.serving.worker_model import LoadedModel

    model, _ = pair
    assert Rig(model, None, paged_attention="reference").engine.warmup is None
    monkeypatch.setattr(kernel_warmup, "wanted", lambda model, mode: mode != "off")
    rig = Rig(model, None, paged_attention="reference", num_blocks=24)
    report = rig.engine.warmup
    assert report is not None and report.rows[0] == 1 and max(report.rows) == min(81, rig.engine.config.max_running_requests)
    assert report.contexts[-1] < rig.cache.pool.num_blocks * rig.cache.block_size
    assert Rig(model, None, paged_attention="off").engine.warmup is None  # nothing to compile on the dense path
    assert Rig(model, None, paged_attention="reference", kernel_warmup=False).engine.warmup is None
    prefill = next(make_rig(LoadedModel(model, "tiny", "test"), "reference"))
    assert prefill.engine.warmup is not None and prefill.engine.warmup.contexts[0] == 0
    prefill.cache.close()
    arena = model.paged_arena
    assert arena is not None and arena.num_free == arena.num_blocks


def test_warmup_cell_makes_the_calls_of_a_real_pass(pair: tuple[CEDModel, Drafter],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm-up cell must launch what the model's pass of the same shape launches, or it compiles the
    wrong variants: the same index and attention calls, in order, with the same shapes and dtypes."""
    from cedserve.model import paged_attention
    from cedserve.model.kernel_warmup import Cell, run_cell, synthetic_state

    model, _ = pair
    model.use_paged_attention("reference")
    calls: list[tuple[object, ...]] = []
    select, attend = paged_attention.PagedPass.select, paged_attention.PagedPass.attend

    def seen_select(pass_: PagedPass, layer: int, kv_layer: int, ratio: int, q: torch.Tensor,
                    weights: torch.Tensor) -> None:
        calls.append(("select", layer, kv_layer, ratio, tuple(q.shape), q.dtype, tuple(weights.shape)))
        select(pass_, layer, kv_layer, ratio, q, weights)

    def seen_attend(pass_: PagedPass, q: torch.Tensor, sink: torch.Tensor, records: list[torch.Tensor], window: int,
                    kv_layer: int | None, index_layer: int | None, scale: float) -> torch.Tensor:
        calls.append(("attend", kv_layer, index_layer, tuple(q.shape), q.dtype, [tuple(r.shape) for r in records],
                      window, scale))
        return attend(pass_, q, sink, records, window, kv_layer, index_layer, scale)

    monkeypatch.setattr(paged_attention.PagedPass, "select", seen_select)
    monkeypatch.setattr(paged_attention.PagedPass, "attend", seen_attend)
    for items, rows in ((3, 1), (1, 40)):  # a decode pass; a prefill chunk on its own
        model.forward_batch([BatchItem([5] * rows, synthetic_state(model, 512)) for _ in range(items)])
        real, calls[:] = list(calls), []
        run_cell(model, Cell(512, items, rows), synthetic_state(model, 512))
        assert calls == real and len(real) > model.config.num_hidden_layers
        calls.clear()
