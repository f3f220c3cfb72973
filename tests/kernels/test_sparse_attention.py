"""Sparse attention over FP4 main-KV and FP8 window records (`cedserve.kernels.sparse_attention`):
the Triton kernel against the float32 torch reference.

Tolerance: the kernel's keys are exact, its logits and accumulator fp32; it rounds the softmax
probabilities to bf16 for the P.V product and the output once to bf16, the reference only the
output. So |kernel - reference| <= 2e-2 * max|reference| + 1e-2 * |reference| (a few bf16 ulps).
Outputs are NaN-poisoned before each launch.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from cedserve.kernels.paged import PagedRecords
from cedserve.kernels.records import record_format, write_records_reference
from cedserve.kernels.sparse_attention import (
    AttentionConfig,
    sparse_attention,
    sparse_attention_reference,
    window_slots_for_chunk,
)

pytestmark = pytest.mark.kernels
CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _records(kind: str, slots: int, dim: int, gen: torch.Generator, device: torch.device,
             entries_per_block: int = 16) -> PagedRecords:
    """A pool of blocks with a region of `entries_per_block` records after a 48-byte header,
    filled with records of random vectors (scaled like post-norm latents)."""
    rb = record_format(kind).record_bytes(dim)
    blocks = -(-slots // entries_per_block)
    pool = torch.randint(0, 256, (blocks, 48 + entries_per_block * rb + 16), generator=gen, device=device,
                         dtype=torch.uint8)
    rec = PagedRecords.region(pool, 48, entries_per_block, rb)
    x = torch.randn(rec.num_slots, dim, generator=gen, device=device) * 2
    write_records_reference(kind, x, torch.arange(rec.num_slots, device=device), rec)
    return rec


def _slot_lists(tokens: int, width: int, num_slots: int, gen: torch.Generator, device: torch.device,
                lengths: Tensor) -> Tensor:
    """Per token `lengths[n]` distinct random slots, -1 padded to `width`."""
    slots = torch.stack([torch.randperm(num_slots, generator=gen, device=device)[:width] for _ in range(tokens)])
    cols = torch.arange(width, device=device).unsqueeze(0)
    return torch.where(cols < lengths.unsqueeze(1), slots, torch.full_like(slots, -1)).to(torch.int32)


def _rope_tables(tokens: int, pairs: int, gen: torch.Generator, device: torch.device) -> tuple[Tensor, Tensor]:
    angle = torch.rand(tokens, pairs, generator=gen, device=device) * 20
    return angle.cos() * 1.2, angle.sin() * 1.2  # YaRN scales cos/sin by its attention factor


def _check(out: Tensor, ref: Tensor) -> None:
    assert not out.isnan().any(), "unwritten (NaN-poisoned) output elements"
    err = (out.float() - ref.float()).abs()
    bound = 2e-2 * ref.float().abs().max() + 1e-2 * ref.float().abs()
    assert bool((err <= bound).all()), f"max error {err.max().item():.4g} vs max |ref| {ref.float().abs().max():.4g}"


def _case(tokens: int, heads: int, dim: int, topk: int, window: int, rope: int, splits: int | None,
          block_n: int | None, gen: torch.Generator, device: torch.device, use_main: bool = True,
          use_swa: bool = True, block_h: int | None = None, dv_split: int | None = None,
          prefetch: bool | None = None, num_warps: int | None = None, num_stages: int | None = None,
          kernel: str | None = None, slot_dtype: torch.dtype = torch.int32, repeat: int = 1,
          entries_per_block: int = 16) -> None:
    main = _records("main", 3 * topk + 5, dim, gen, device, entries_per_block) if use_main else None
    swa = _records("swa", 2 * window + 3, dim, gen, device, entries_per_block) if use_swa else None
    # lengths: full, empty, partial (a request shorter than top-k, a window not yet full)
    lengths_k = torch.randint(0, topk + 1, (tokens,), generator=gen, device=device)
    lengths_k[0], lengths_k[-1] = topk, 0
    lengths_w = torch.randint(1, window + 1, (tokens,), generator=gen, device=device)
    lengths_w[0] = window
    topk_slots = _slot_lists(tokens, topk, main.num_slots, gen, device, lengths_k).to(slot_dtype) if main else None
    win_slots = _slot_lists(tokens, window, swa.num_slots, gen, device, lengths_w).to(slot_dtype) if swa else None
    if win_slots is not None and tokens > 2:
        win_slots[-1] = -1  # one token with no key at all but (maybe) the window: sink only
        if topk_slots is not None:
            topk_slots[-1] = -1
    q = (torch.randn(tokens, heads, dim, generator=gen, device=device) * 0.5).bfloat16()
    sink = torch.randn(heads, generator=gen, device=device)
    cos, sin = _rope_tables(tokens, rope // 2, gen, device)
    out = torch.full_like(q, float("nan"))
    config = AttentionConfig(num_splits=splits, block_n=block_n, block_h=block_h, dv_split=dv_split, prefetch=prefetch,
                             num_warps=num_warps, num_stages=num_stages, kernel=kernel)
    ref = sparse_attention_reference(q, sink, main, topk_slots, swa, win_slots, cos, sin)
    for _ in range(repeat):  # (repeats: reused buffers, launch after launch)
        out.fill_(float("nan"))
        sparse_attention(q, sink, main, topk_slots, swa, win_slots, cos, sin, out=out, config=config, impl="triton")
        _check(out, ref)


@pytest.mark.parametrize(("splits", "dv_split", "prefetch"), [(1, 1, True), (3, 1, False), (1, 2, False), (3, 2, True)])
def test_decode_small_head_dim(splits: int, dv_split: int, prefetch: bool, gen: torch.Generator,
                               device: torch.device) -> None:
    # fixture-like geometry: 4 heads (padded to a 16-row tile), head_dim 64, rope 16; 37 selected
    # entries and a window of 9 cross 16-key tiles and split boundaries; the value halves split
    # the rope pairs' half from the other
    _case(tokens=4, heads=4, dim=64, topk=37, window=9, rope=16, splits=splits, block_n=16, gen=gen, device=device,
          dv_split=dv_split, prefetch=prefetch)


@pytest.mark.parametrize(("splits", "dv_split"), [(2, 1), (3, 1), (5, 1), (3, 2)])
def test_decode_key_splits(splits: int, dv_split: int, gen: torch.Generator, device: torch.device) -> None:
    # split-KV ("flash-decoding"): 37 selected entries (3 tiles of 16, the last ragged) and a window
    # of 9 (1 tile) are 4 tiles dealt out in contiguous runs: 3 splits take tiles {0}, {1}, {2, w0}
    # (a split ending in the main list continues in the window), 5 splits leave one split empty;
    # the combine pass adds the sink and rotates back
    _case(tokens=5, heads=4, dim=64, topk=37, window=9, rope=16, splits=splits, block_n=16, gen=gen, device=device,
          dv_split=dv_split)


def test_decode_released_head_dim_key_split(gen: torch.Generator, device: torch.device) -> None:
    # D = 512 with the whole value width per program (dv_split 1) and keys split in 3: tiles of 16
    # over 24 + 20 keys (2 + 2 tiles) put the main / window boundary inside the middle split
    _case(tokens=2, heads=20, dim=512, topk=24, window=20, rope=64, splits=3, block_n=16, gen=gen, device=device,
          block_h=16, dv_split=1)


def test_decode_released_head_dim(gen: torch.Generator, device: torch.device) -> None:
    # 20 heads in blocks of 16: a full head block and a ragged one
    _case(tokens=2, heads=20, dim=512, topk=24, window=20, rope=64, splits=2, block_n=16, gen=gen, device=device,
          block_h=16, dv_split=2)


@pytest.mark.parametrize(("use_main", "use_swa"), [(False, True), (True, False)])
def test_decode_one_source(use_main: bool, use_swa: bool, gen: torch.Generator, device: torch.device) -> None:
    _case(tokens=3, heads=8, dim=64, topk=20, window=12, rope=16, splits=1, block_n=16, gen=gen, device=device,
          use_main=use_main, use_swa=use_swa)


def test_window_slots_for_chunk(device: torch.device) -> None:
    ring = torch.arange(100, 110, device=device)  # records of positions 5..14
    slots = window_slots_for_chunk(torch.tensor([7, 8], device=device), 4, ring, first_position=5)
    assert slots.tolist() == [[-1, 100, 101, 102], [100, 101, 102, 103]]


def test_chunked_prefill_equals_decode(gen: torch.Generator, device: torch.device) -> None:
    """A chunk of 6 query tokens over a staging table of window records (the previous window
    plus the chunk) gives, token by token, what single-token decode calls give."""
    dim, heads, window = 64, 4, 4
    staging = _records("swa", 10, dim, gen, device)  # positions 10..19 at slots 0..9
    main = _records("main", 30, dim, gen, device)
    positions = torch.arange(14, 20, device=device)
    win = window_slots_for_chunk(positions, window, torch.arange(10, device=device), first_position=10)
    topk = _slot_lists(6, 8, main.num_slots, gen, device, torch.tensor([8, 3, 0, 8, 5, 8], device=device))
    q = torch.randn(6, heads, dim, generator=gen, device=device).bfloat16()
    sink = torch.randn(heads, generator=gen, device=device)
    cos, sin = _rope_tables(6, 8, gen, device)
    chunk = sparse_attention(q, sink, main, topk, staging, win, cos, sin, impl="triton")
    for n in range(6):
        one = sparse_attention(q[n : n + 1], sink, main, topk[n : n + 1], staging, win[n : n + 1], cos[n : n + 1],
                               sin[n : n + 1], impl="triton")
        assert torch.equal(one, chunk[n : n + 1])
    _check(chunk, sparse_attention_reference(q, sink, main, topk, staging, win, cos, sin))


def _verify_rows(runs: list[int], starts: list[int], window: int, ring: int, first: list[int],
                 device: torch.device) -> tuple[Tensor, Tensor]:
    """A verify step's rows: run i is `runs[i]` consecutive positions from `starts[i]` of slot i
    (rings of `ring` records, position p at ring row p % ring, records before `first[i]` gone).
    Returns (row offsets long [N], window slot lists int32 [N, window]) laid out as the slot step's
    `window_slots` lays them out: each row's W slots ending at its own position."""
    offsets, lists = [], []
    for slot, (rows, start, lo) in enumerate(zip(runs, starts, first, strict=True)):
        for r in range(rows):
            keys = torch.arange(start + r - window + 1, start + r + 1)
            inside = (keys >= 0) & (keys >= lo)
            lists.append(torch.where(inside, slot * ring + keys.remainder(ring), -1))
            offsets.append(r)
    return (torch.tensor(offsets, device=device),
            torch.stack(lists).to(device=device, dtype=torch.int32))


@pytest.mark.parametrize(("splits", "block_n", "heads"), [(1, 16, 4), (3, 16, 4), (None, 32, 3), (2, 16, 8),
                                                          (1, 16, 16)])
def test_grouped_rows_equal_row_by_row(splits: int | None, block_n: int, heads: int, gen: torch.Generator,
                                       device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """A DSpark verify's runs of rows through the grouped kernel (each run's union window decoded
    once, every row masked to its own W keys; each row's own selected entries) equal the float32
    reference row by row: runs of 1 to 6 rows (a plain decode row among them), a window not yet
    full, a ring that dropped its oldest records, rows with few or no selected entries. 16 heads x
    runs of 6 (8) exceed the grouped tile's 64 rows: those go row by row, with the same result."""
    import cedserve.kernels.sparse_attention as sa

    launches: list[int] = []
    grouped_run = sa._Launch.run_grouped
    monkeypatch.setattr(sa._Launch, "run_grouped", lambda self, *a: launches.append(1) or grouped_run(self, *a))
    dim, window, ring, topk = 64, 9, 16, 20
    runs, starts, first = [3, 1, 6, 2, 5], [40, 7, 3, 100, 12], [0, 0, 0, 95, 10]
    offsets, win = _verify_rows(runs, starts, window, ring, first, device)
    tokens = offsets.shape[0]
    swa = _records("swa", len(runs) * ring, dim, gen, device)
    main = _records("main", 3 * topk + 5, dim, gen, device)
    lengths = torch.randint(0, topk + 1, (tokens,), generator=gen, device=device)
    lengths[0], lengths[4] = topk, 0
    topk_slots = _slot_lists(tokens, topk, main.num_slots, gen, device, lengths)
    q = (torch.randn(tokens, heads, dim, generator=gen, device=device) * 0.5).bfloat16()
    sink = torch.randn(heads, generator=gen, device=device)
    cos, sin = _rope_tables(tokens, 8, gen, device)
    ref = sparse_attention_reference(q, sink, main, topk_slots, swa, win, cos, sin)
    config = AttentionConfig(num_splits=splits, block_n=block_n)
    out = torch.full_like(q, float("nan"))
    sparse_attention(q, sink, main, topk_slots, swa, win, cos, sin, out=out, config=config, impl="triton",
                     row_offsets=offsets, max_rows=6)
    _check(out, ref)
    assert len(launches) == (0 if heads > 8 else 1)
    # the window alone (an SWA-only layer), and the per-row kernel on the same rows
    alone = torch.full_like(q, float("nan"))
    sparse_attention(q, sink, None, None, swa, win, cos, sin, out=alone, config=config, impl="triton",
                     row_offsets=offsets, max_rows=6)
    _check(alone, sparse_attention_reference(q, sink, None, None, swa, win, cos, sin))
    per_row = sparse_attention(q, sink, main, topk_slots, swa, win, cos, sin, config=AttentionConfig(block_n=block_n),
                               impl="triton")
    _check(per_row, ref)


def test_grouped_rows_checks(gen: torch.Generator, device: torch.device) -> None:
    swa = _records("swa", 4, 64, gen, device)
    q = torch.zeros(2, 4, 64, dtype=torch.bfloat16, device=device)
    cos = sin = torch.zeros(2, 8, device=device)
    win = torch.zeros(2, 3, dtype=torch.int32, device=device)
    sink = torch.zeros(4, device=device)
    with pytest.raises(ValueError, match="row_offsets must be"):
        sparse_attention(q, sink, None, None, swa, win, cos, sin, row_offsets=torch.zeros(3, dtype=torch.long,
                                                                                          device=device), max_rows=2)
    with pytest.raises(ValueError, match="max_rows"):
        sparse_attention(q, sink, None, None, swa, win, cos, sin, row_offsets=torch.zeros(2, dtype=torch.long,
                                                                                          device=device), max_rows=0)


def test_launcher_checks(gen: torch.Generator, device: torch.device) -> None:
    swa = _records("swa", 4, 64, gen, device)
    q = torch.zeros(2, 4, 64, dtype=torch.bfloat16, device=device)
    cos = sin = torch.zeros(2, 8, device=device)
    win = torch.zeros(2, 3, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="both"):
        sparse_attention(q, torch.zeros(4, device=device), None, win, swa, win, cos, sin)
    with pytest.raises(ValueError, match="sink"):
        sparse_attention(q, torch.zeros(5, device=device), None, None, swa, win, cos, sin)
    with pytest.raises(ValueError, match="66 B"):
        sparse_attention(q, torch.zeros(4, device=device), None, None, _records("swa", 4, 128, gen, device), win,
                         cos, sin)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(("splits", "dv_split", "prefetch", "block_n", "num_warps"),
                         [(None, None, None, None, None), (1, 1, False, None, None), (4, 2, True, None, None),
                          (2, 1, False, 32, 8), (2, 2, False, 32, 4)])
def test_gpu_decode_released_shapes(splits: int | None, dv_split: int | None, prefetch: bool | None,
                                    block_n: int | None, num_warps: int | None,
                                    gen: torch.Generator, device: torch.device) -> None:
    # batch 64, 64 heads x 512, top-512 + window 128, rope 64; the last two rows are the split-KV
    # candidates of v6 (kernels-notes.md): keys split in 2 with whole value rows, and in 2 with value
    # halves at 4 warps (two programs per SM)
    _case(tokens=64, heads=64, dim=512, topk=512, window=128, rope=64, splits=splits, block_n=block_n, gen=gen,
          device=device, dv_split=dv_split, prefetch=prefetch, num_warps=num_warps)


def test_gluon_kernel_refuses_what_it_cannot_run(gen: torch.Generator, device: torch.device) -> None:
    # the Gluon kernel (v11) runs on sm_90 at 64 heads x 512 only; asked for elsewhere it says why
    main, swa = _records("main", 8, 128, gen, device), _records("swa", 8, 128, gen, device)
    q = torch.zeros(2, 4, 128, device=device, dtype=torch.bfloat16)
    slots = torch.zeros(2, 4, dtype=torch.int32, device=device)
    cos = sin = torch.zeros(2, 8, device=device)
    reason = "CUDA device" if device.type != "cuda" else "(sm_90|64 heads)"
    with pytest.raises(ValueError, match=f"gluon kernel cannot run here: .*{reason}"):
        sparse_attention(q, torch.zeros(4, device=device), main, slots, swa, slots, cos, sin,
                         config=AttentionConfig(kernel="gluon"), impl="triton")
    with pytest.raises(ValueError, match="kernel must be"):
        AttentionConfig(kernel="cuda").resolve(2, 4, 4, device, 128)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() != (9, 0), reason="the Gluon kernel needs sm_90")
@pytest.mark.parametrize(("tokens", "splits", "use_main", "use_swa", "slot_dtype", "epb"),
                         [(64, None, True, True, torch.int32, 16),
                          (5, 1, True, True, torch.int64, 16),
                          (7, 3, True, True, torch.int32, 16),
                          (9, 4, True, False, torch.int32, 16),
                          (3, 2, False, True, torch.int32, 16),
                          (64, 2, True, True, torch.int32, 16),
                          (64, 1, True, True, torch.int32, 16),
                          (130, 3, True, True, torch.int32, 16),
                          (9, 5, True, True, torch.int64, 12),
                          (64, None, True, True, torch.int32, 12),
                          (17, 5, True, True, torch.int64, 12),
                          (1, None, True, True, torch.int32, 16),
                          (8, None, True, True, torch.int64, 12),
                          (33, 7, True, True, torch.int32, 16),
                          (130, 3, True, False, torch.int32, 16)])
def test_gpu_gluon_decode(tokens: int, splits: int | None, use_main: bool, use_swa: bool, slot_dtype: torch.dtype,
                          epb: int, gen: torch.Generator, device: torch.device) -> None:
    # the Gluon kernel (v20; kernels-notes.md) at the released shape: ragged top-k lengths, partial
    # windows, a token with no key, one source only, more splits than some tokens have tiles (empty
    # splits), 390 CTAs in three waves, blocks of 12 records (slot -> block by division)
    _case(tokens=tokens, heads=64, dim=512, topk=512, window=128, rope=64, splits=splits, block_n=None, gen=gen,
          device=device, use_main=use_main, use_swa=use_swa, kernel="gluon", slot_dtype=slot_dtype, repeat=5,
          entries_per_block=epb)


@pytest.mark.parametrize(("tokens", "splits", "per_cta"), [(1, 10, 1), (8, 10, 1), (13, 10, 1), (14, 5, 2), (16, 5, 2),
                                                          (33, 4, 3), (64, 2, 5), (66, 2, 5), (67, 1, 10), (500, 1, 10)])
def test_gluon_split_heuristic(tokens: int, splits: int, per_cta: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # the Gluon kernel's key splits on a 132-SM H200, top-512 + a 128-key window (10 tiles): one wave
    # of CTAs with as few tiles each as it allows, the tiles spread evenly (run 38: one tile per CTA
    # at batches 1 and 8 is 8-12 % faster than two; a second wave at batch 16 is 29 % slower)
    import cedserve.kernels.sparse_attention as sa

    monkeypatch.setattr(sa, "num_sms", lambda device: 132)
    cfg = AttentionConfig(kernel="gluon").resolve(tokens, 64, 512, torch.device("cpu"))
    assert cfg.num_splits == splits
    assert tokens * splits <= 132 or splits == 1
    tiles = 10
    assert max((s + 1) * tiles // splits - s * tiles // splits for s in range(splits)) == per_cta
    assert AttentionConfig(kernel="gluon", num_splits=7).resolve(tokens, 64, 512, torch.device("cpu")).num_splits == 7


@pytest.mark.parametrize(("tokens", "heads", "lists", "splits"), [
    (1, 4, (64, 128), 3),  # mini-40 at batch 1: one program over 3 tiles before, now one tile each
    (32, 4, (64, 128), 3),  # 32 programs: still under half a wave, one tile each
    (64, 4, (64, 128), 2),  # 64 programs: two splits fill the wave
    (1, 64, (512, 128), 10),  # released heads, Triton kernel, batch 1: the token's 10 tiles
    (64, 64, (512, 128), 1),  # released heads at batch 64: 128 programs already fill the wave
])
def test_triton_splits_fill_an_idle_gpu(monkeypatch: pytest.MonkeyPatch, tokens: int, heads: int,
                                        lists: tuple[int, int], splits: int) -> None:
    # the Triton kernel's key splits on a 132-SM GPU: at least 4 tiles a program while that fills a
    # wave, one tile a program where it would leave most SMs idle (never past one wave)
    import cedserve.kernels.sparse_attention as sa

    monkeypatch.setattr(sa, "num_sms", lambda device: 132)
    monkeypatch.setattr(sa, "interpreting", lambda: False)
    monkeypatch.setattr(sa, "hardware_fp8", lambda device: True)
    cfg = AttentionConfig(kernel="triton").resolve(tokens, heads, max(lists), torch.device("cuda"), 512, lists=lists)
    assert cfg.num_splits == splits
    programs = tokens * -(-heads // (cfg.block_h or 1)) * (cfg.dv_split or 1)
    assert programs * splits <= 132 or splits == 1


def test_combine_normalized_fp16_partials(gen: torch.Generator, device: torch.device) -> None:
    # the merge pass over fp16 partials divided by their row sums (the Gluon kernel's) against the same merge over the fp32 partials, and both against a float64
    # merge: empty splits (sum 0, max -1e30) included, values up to the format's 2688
    from cedserve.kernels import _sparse_attention_kernels as k

    tokens, splits, heads, dim, pairs = 3, 4, 16, 64, 8
    m = torch.rand(tokens, splits, heads, generator=gen, device=device) * 20 - 10
    l_sum = torch.rand(tokens, splits, heads, generator=gen, device=device) * 50 + 0.5
    m[1, 2], l_sum[1, 2] = -1.0e30, 0.0  # an empty split
    mean = (torch.rand(tokens, splits, heads, dim, generator=gen, device=device) * 2 - 1) * 2688
    acc = mean * l_sum.unsqueeze(-1)  # unnormalised accumulators
    ml = torch.stack([m, l_sum], dim=-1).contiguous()
    sink = torch.randn(heads, generator=gen, device=device)
    cos, sin = _rope_tables(tokens, pairs, gen, device)
    outs = []
    for normalized in (False, True):
        part = (acc / l_sum.clamp_min(1e-30).unsqueeze(-1)).half() if normalized else acc.contiguous()
        out = torch.full((tokens, heads, dim), float("nan"), device=device, dtype=torch.bfloat16)
        k._combine_splits_kernel[(tokens, heads // 16)](part, ml, sink, cos, sin, cos.stride(0), out, out.stride(0),
                                                        out.stride(1), heads, D=dim, ROPE_PAIRS=pairs, BLOCK_H=16,
                                                        NUM_SPLITS=splits, NORMALIZED=normalized)
        outs.append(out.float())
    # float64 merge, then the inverse rotation of the last `pairs` (even, odd) channel pairs
    mx = torch.maximum(m.double().amax(1), sink.double().mul(1.4426950408889634).unsqueeze(0))
    w = torch.exp2(m.double() - mx.unsqueeze(1))
    total = torch.exp2(sink.double() * 1.4426950408889634 - mx) + (w * l_sum.double()).sum(1)
    o = (w.unsqueeze(-1) * acc.double()).sum(1) / total.unsqueeze(-1)
    lo, hi = o[..., 0::2].clone(), o[..., 1::2].clone()
    c, s = cos.double().unsqueeze(1), sin.double().unsqueeze(1)
    r_lo = lo[..., -pairs:] * c + hi[..., -pairs:] * s
    r_hi = hi[..., -pairs:] * c - lo[..., -pairs:] * s
    lo[..., -pairs:], hi[..., -pairs:] = r_lo, r_hi
    ref = torch.stack([lo, hi], dim=-1).flatten(-2)
    for out in outs:
        err = (out.double() - ref).abs()
        assert bool((err <= 4e-3 * ref.abs() + 2e-3 * ref.abs().amax()).all()), err.max().item()
    # the two merges agree to one bf16 step (2**-7 relative) beside fp16's rounding of the partials
    excess = (outs[1] - outs[0]).abs() - 2.0**-7 * outs[0].abs() - 1e-3 * outs[0].abs().amax()
    assert bool((excess <= 0).all()), excess.max().item()


def test_merge_heads_bound_registers() -> None:
    # heads per merge program: splits x heads x dim within ~160 values a thread, a power of two
    from cedserve.kernels.sparse_attention import _merge_heads

    assert [_merge_heads(s, 512) for s in (1, 2, 5, 7, 10, 20, 40, 80)] == [16, 16, 8, 4, 4, 2, 1, 1]
    assert _merge_heads(3, 128) == 16 and _merge_heads(3, 128, cap=8) == 8


@pytest.mark.gpu
@requires_cuda
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() != (9, 0), reason="the Gluon kernel needs sm_90")
def test_gpu_default_is_gluon(gen: torch.Generator, device: torch.device) -> None:
    # what the model passes (`AttentionConfig()`, or no config) runs the Gluon kernel where it can:
    # the same bits as asking for it by name
    main = _records("main", 1029, 512, gen, device, 16)
    swa = _records("swa", 259, 512, gen, device, 16)
    topk = _slot_lists(8, 512, main.num_slots, gen, device, torch.full((8,), 512, device=device))
    win = _slot_lists(8, 128, swa.num_slots, gen, device, torch.full((8,), 128, device=device))
    q = (torch.randn(8, 64, 512, generator=gen, device=device) * 0.5).bfloat16()
    sink = torch.randn(64, generator=gen, device=device)
    cos, sin = _rope_tables(8, 32, gen, device)
    outs = [sparse_attention(q, sink, main, topk, swa, win, cos, sin, config=c, impl="triton")
            for c in (AttentionConfig(kernel="gluon"), AttentionConfig(), None)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
