"""Indexer scores over FP4 index keys and the two-level top-k (`cedserve.kernels.indexer`): the
Triton kernel against the dense torch reference.

Scores: keys and queries are exact in bf16, products exact in fp32, so only the summation order
differs: |kernel - reference| <= 1e-5 * (1 + |reference|), and the -inf pattern (visibility,
unmapped blocks, -1 entries) must be identical. Selections are compared tie-aware: the kernel's
picks must be as many as the reference's, all visible, and each scored (by the reference) at
least the reference's k-th best score minus that tolerance. Score outputs are NaN-poisoned
before the launch; masked entries must come back -inf.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from cedserve.kernels.indexer import (
    IndexConfig,
    IndexKeys,
    index_scores,
    index_scores_reference,
    index_topk,
    index_topk_reference,
    pool_mask,
    range_scores_reference,
    topk_chunk,
    topk_entries,
    topk_entries_triton,
)
from cedserve.kernels.paged import PagedRecords
from cedserve.kernels.records import record_format, write_records_reference
from cedserve.kernels.reference import fake_quant_fp4

pytestmark = pytest.mark.kernels
CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _keys(requests: int, tokens: int, dim: int, entries_per_block: int, blocks_per_req: int, max_visible: int,
          gen: torch.Generator, device: torch.device) -> IndexKeys:
    rb = record_format("index").record_bytes(dim)
    num_blocks = requests * blocks_per_req + 3
    pool = torch.randint(0, 256, (num_blocks, 32 + entries_per_block * rb), generator=gen, device=device,
                         dtype=torch.uint8)
    records = PagedRecords.region(pool, 32, entries_per_block, rb)
    x = torch.randn(records.num_slots, dim, generator=gen, device=device)
    write_records_reference("index", x, torch.arange(records.num_slots, device=device), records)
    table = torch.randperm(num_blocks, generator=gen, device=device)[: requests * blocks_per_req]
    table = table.view(requests, blocks_per_req).int()
    table[-1, -1] = -1  # the last request's last block is not mapped yet
    token_req = torch.randint(0, requests, (tokens,), generator=gen, device=device).int()
    visible = torch.randint(0, max_visible + 1, (tokens,), generator=gen, device=device).int()
    visible[0], visible[-1] = max_visible, 0
    return IndexKeys(records, table, token_req, visible)


def _queries(tokens: int, heads: int, dim: int, gen: torch.Generator, device: torch.device) -> tuple[Tensor, Tensor]:
    q = fake_quant_fp4(torch.randn(tokens, heads, dim, generator=gen, device=device), 32, "ue8m0").bfloat16()
    w = torch.randn(tokens, heads, generator=gen, device=device) * heads**-0.5
    return q, w


def _assert_scores(got: Tensor, want: Tensor, magnitude: Tensor | None = None, rel: float = 1e-5) -> None:
    """`magnitude` (default |want|): the sum of the terms' magnitudes, the scale of the rounding
    error where head terms of opposite signs cancel."""
    assert torch.equal(got.isneginf(), want.isneginf()), "masked entries differ"
    finite = want.isfinite()
    err = (got[finite] - want[finite]).abs()
    scale = (want if magnitude is None else magnitude)[finite].abs()
    assert bool((err <= rel * (1 + scale)).all()), f"max score error {err.max().item():.3g}"


def _assert_selection(picked: Tensor, want: Tensor, dense: Tensor) -> None:
    for n in range(dense.shape[0]):
        mine = picked[n][picked[n] >= 0].long()
        theirs = want[n][want[n] >= 0].long()
        assert mine.numel() == theirs.numel() and len(set(mine.tolist())) == mine.numel()
        if theirs.numel():
            kth = dense[n, theirs].min()
            assert bool((dense[n, mine] >= kth - 1e-5 * (1 + kth.abs())).all()), f"token {n}: a worse entry picked"


@pytest.mark.parametrize(("heads", "dim", "version", "prefetch"), [(32, 128, 4, 0), (32, 128, 4, 1), (16, 32, 4, 1)])
def test_scores_range_and_list(heads: int, dim: int, version: int, prefetch: int, gen: torch.Generator,
                               device: torch.device) -> None:
    # 600 entries: 10 tiles of 64 (ragged last) over three programs of 4 tiles, blocks of 16
    # entries, the last request's last block unmapped; d = 32 runs v3; with `prefetch` the next
    # tile's slots are loaded a tile ahead, past the program's last tile too
    config = IndexConfig(tiles=4, version=version, prefetch=prefetch)
    width = 600
    keys = _keys(requests=3, tokens=7, dim=dim, entries_per_block=16, blocks_per_req=38, max_visible=width,
                 gen=gen, device=device)
    q, w = _queries(7, heads, dim, gen, device)
    scores = torch.full((7, width), float("nan"), device=device)
    maxima = torch.full((7, -(-width // 8)), float("nan"), device=device)
    index_scores(q, w, keys, width=width, block_max=8, out=scores, maxima_out=maxima, config=config, impl="triton")
    ref_scores, ref_maxima = index_scores(q, w, keys, width=width, block_max=8, impl="torch")
    assert ref_scores is not None and ref_maxima is not None
    _assert_scores(scores, ref_scores)
    _assert_scores(maxima, ref_maxima)
    entries = torch.randint(-1, 620, (7, 45), generator=gen, device=device).int()  # some past `visible`
    listed = torch.full((7, 45), float("nan"), device=device)
    index_scores(q, w, keys, entries=entries, out=listed, config=config, impl="triton")
    ref_listed, _ = index_scores(q, w, keys, entries=entries, impl="torch")
    assert ref_listed is not None
    _assert_scores(listed, ref_listed)


def test_range_scores_reference_reads_each_request_once(gen: torch.Generator) -> None:
    """The per-request form of the reference (what the model's CPU path and `index_topk_reference`
    use) against the per-token gather, on three requests with ragged visibility and an unmapped block."""
    cpu = torch.device("cpu")
    keys = _keys(requests=3, tokens=40, dim=32, entries_per_block=16, blocks_per_req=12, max_visible=190,
                 gen=gen, device=cpu)
    q, w = _queries(40, 8, 32, gen, cpu)
    for width in (190, 150, 1):
        got = range_scores_reference(q, w, keys, width)
        want = index_scores_reference(q, w, keys, torch.arange(width).expand(40, width))
        _assert_scores(got, want)
        assert bool(got.isneginf().any()) and bool(got.isfinite().any())


@pytest.mark.parametrize("version", [3, 4])
def test_scores_key_scale_range(version: int, gen: torch.Generator, device: torch.device) -> None:
    # keys of magnitudes 2**-60..2**60 (UE8M0 bytes ~66..188, inside v4's exact range 59..192)
    # and 4-byte aligned records (v4's word loads), both decoders against the reference
    tokens, heads, dim, width = 3, 16, 128, 160
    keys = _keys(requests=2, tokens=tokens, dim=dim, entries_per_block=32, blocks_per_req=5, max_visible=width,
                 gen=gen, device=device)
    n = keys.records.num_slots
    x = torch.randn(n, dim, generator=gen, device=device)
    x = x * torch.exp2(torch.randint(-60, 61, (n, 1), generator=gen, device=device).float())
    write_records_reference("index", x, torch.arange(n, device=device), keys.records)
    q, w = _queries(tokens, heads, dim, gen, device)
    scores = torch.full((tokens, width), float("nan"), device=device)
    index_scores(q, w, keys, width=width, out=scores, config=IndexConfig(version=version), impl="triton")
    ref, _ = index_scores(q, w, keys, width=width, impl="torch")
    magnitude, _ = index_scores(q, w.abs(), keys, width=width, impl="torch")  # keys up to 2**60: heads cancel
    assert ref is not None and magnitude is not None
    _assert_scores(scores, ref, magnitude)


@pytest.mark.parametrize(("group", "heads"), [(2, 32), (4, 4)])
def test_scores_tokens_per_request(group: int, heads: int, gen: torch.Generator, device: torch.device) -> None:
    # 3 requests x `group` tokens (a prefill chunk or drafts): one key tile per group, scored
    # against the group's queries in one MMA; each token keeps its own visible count
    width, dim = 300, 64
    tokens = 3 * group
    keys = _keys(requests=3, tokens=tokens, dim=dim, entries_per_block=16, blocks_per_req=19, max_visible=width,
                 gen=gen, device=device)
    keys = IndexKeys(keys.records, keys.block_table, torch.arange(tokens, device=device).int() // group, keys.visible)
    q, w = _queries(tokens, heads, dim, gen, device)
    scores = torch.full((tokens, width), float("nan"), device=device)
    maxima = torch.full((tokens, -(-width // 8)), float("nan"), device=device)
    index_scores(q, w, keys, width=width, block_max=8, out=scores, maxima_out=maxima, tokens_per_request=group,
                 config=IndexConfig(tiles=2), impl="triton")
    ref_scores, ref_maxima = index_scores(q, w, keys, width=width, block_max=8, impl="torch")
    assert ref_scores is not None and ref_maxima is not None
    _assert_scores(scores, ref_scores)
    _assert_scores(maxima, ref_maxima)


@pytest.mark.parametrize(("heads", "max_rows", "tiles"), [(4, 6, 2), (32, 3, 1)])
def test_scores_runs_of_rows(heads: int, max_rows: int, tiles: int, gen: torch.Generator,
                             device: torch.device) -> None:
    # a verify step's rows: runs of 1 .. max_rows consecutive rows of one request (a plain decode
    # row among them), each run scanned by one program; every row keeps its own visible count
    width, dim = 300, 64
    runs = [r for r in (max_rows, 1, 2, max_rows, 1) if r <= max_rows]
    tokens = sum(runs)
    keys = _keys(requests=len(runs), tokens=tokens, dim=dim, entries_per_block=16, blocks_per_req=19,
                 max_visible=width, gen=gen, device=device)
    req = torch.tensor([i for i, r in enumerate(runs) for _ in range(r)], device=device).int()
    offsets = torch.tensor([o for r in runs for o in range(r)], device=device)
    keys = IndexKeys(keys.records, keys.block_table, req, keys.visible)
    q, w = _queries(tokens, heads, dim, gen, device)
    scores = torch.full((tokens, width), float("nan"), device=device)
    maxima = torch.full((tokens, -(-width // 8)), float("nan"), device=device)
    index_scores(q, w, keys, width=width, block_max=8, out=scores, maxima_out=maxima, row_offsets=offsets,
                 max_rows=max_rows, config=IndexConfig(tiles=tiles), impl="triton")
    ref_scores, ref_maxima = index_scores(q, w, keys, width=width, block_max=8, impl="torch")
    magnitude, _ = index_scores(q, w.abs(), keys, width=width, impl="torch")
    assert ref_scores is not None and ref_maxima is not None and magnitude is not None
    _assert_scores(scores, ref_scores, magnitude)
    _assert_scores(maxima, ref_maxima)
    # the two-level top-k through the runs: the same picks as the reference
    sel = index_topk(q, w, keys, topk=12, width=width, candidate_blocks=5, row_offsets=offsets, max_rows=max_rows,
                     impl="triton")
    ref, dense = index_topk_reference(q, w, keys, topk=12, width=width, candidate_blocks=5)
    _assert_selection(sel.entries, ref.entries, dense)
    with pytest.raises(ValueError, match="not both"):
        index_scores(q, w, keys, width=width, row_offsets=offsets, max_rows=max_rows, tokens_per_request=2)


@pytest.mark.parametrize("mode", ["full", "candidate", "candidate wide pool", "reindex"])
def test_two_level_topk(mode: str, gen: torch.Generator, device: torch.device,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    # ("candidate wide pool": a pool of more blocks than top-k, where the top-k blocks are picked
    # among the pool's, here from 25 block maxima: the rule's width lowered to take that path)
    import cedserve.kernels.indexer as ix

    monkeypatch.setattr(ix, "TOPK_CHUNK", 16 if mode == "candidate wide pool" else ix.TOPK_CHUNK)
    tokens, heads, dim, width = 6, 32, 64, 200
    keys = _keys(requests=2, tokens=tokens, dim=dim, entries_per_block=32, blocks_per_req=7, max_visible=width,
                 gen=gen, device=device)
    q, w = _queries(tokens, heads, dim, gen, device)
    kwargs: dict[str, object] = {"topk": 12, "width": width}
    pool = None
    if mode.startswith("candidate"):
        kwargs["candidate_blocks"] = 5 if mode == "candidate" else 20
    if mode == "reindex":
        pool = index_topk_reference(q, w, keys, topk=12, width=width, candidate_blocks=5)[0].candidates
        kwargs["candidates"] = pool
    sel = index_topk(q, w, keys, impl="triton", **kwargs)
    ref, dense = index_topk_reference(q, w, keys, **kwargs)
    if mode == "reindex":  # the reference ranks inside the pool only
        assert isinstance(pool, Tensor)
        dense = dense.masked_fill(~pool_mask(pool, width), float("-inf"))
    _assert_selection(sel.entries, ref.entries, dense)
    if mode.startswith("candidate"):
        assert sel.candidates is not None and ref.candidates is not None
        for n in range(tokens):  # the pool: same blocks (block maxima have no ties here)
            assert set(sel.candidates[n].tolist()) == set(ref.candidates[n].tolist())
        newest = keys.visible.long() - 1
        for n in range(tokens):
            if newest[n] >= 0 and keys.slots(newest[n].view(1, 1).int())[0, 0] >= 0:
                assert int(newest[n]) in sel.candidates[n].tolist(), "the newest entry's block must be pinned"


@pytest.mark.gpu
@requires_cuda
def test_gpu_realistic(gen: torch.Generator, device: torch.device) -> None:
    # 16 decode tokens over up to 40,000 entries of 64-entry blocks: 32 heads x 128, top-512,
    # a 2048-block candidate pool of blocks of 8
    tokens, heads, dim, width = 16, 32, 128, 40_000
    keys = _keys(requests=4, tokens=tokens, dim=dim, entries_per_block=64, blocks_per_req=640, max_visible=width,
                 gen=gen, device=device)
    q, w = _queries(tokens, heads, dim, gen, device)
    sel = index_topk(q, w, keys, topk=512, width=width, candidate_blocks=2048, impl="triton")
    ref, dense = index_topk_reference(q, w, keys, topk=512, width=width, candidate_blocks=2048)
    _assert_selection(sel.entries, ref.entries, dense)
    scores, _ = index_scores(q, w, keys, width=width, impl="triton")  # v14 (Gluon) on sm_90
    assert scores is not None
    _assert_scores(scores, dense)
    scores, _ = index_scores(q, w, keys, width=width, config=IndexConfig(kernel="triton"), impl="triton")
    assert scores is not None
    _assert_scores(scores, dense)
    # the same keys read once per group of 4 tokens of one request
    grouped = IndexKeys(keys.records, keys.block_table, torch.arange(tokens, device=device).int() // 4, keys.visible)
    scores, _ = index_scores(q, w, grouped, width=width, tokens_per_request=4, impl="triton")
    ref, _ = index_scores(q, w, grouped, width=width, impl="torch")
    assert scores is not None and ref is not None
    _assert_scores(scores, ref)



def test_gluon_scan_refuses_what_it_cannot_run(gen: torch.Generator, device: torch.device) -> None:
    # v14 (Gluon) runs range scans of one token per request, d = 128, <= 32 heads, on sm_90 only
    keys = _keys(requests=2, tokens=3, dim=64, entries_per_block=16, blocks_per_req=4, max_visible=60, gen=gen,
                 device=device)
    q, w = _queries(3, 8, 64, gen, device)
    with pytest.raises(ValueError, match=r"gluon kernel cannot run here: .*(d = 128|CUDA|sm_90)"):
        index_scores(q, w, keys, width=60, config=IndexConfig(kernel="gluon"), impl="triton")
    with pytest.raises(ValueError, match="must be 'triton' or 'gluon'"):
        index_scores(q, w, keys, width=60, config=IndexConfig(kernel="cuda"), impl="triton")
    if device.type != "cuda":  # the default quietly takes the Triton kernel where Gluon cannot run
        scores, _ = index_scores(q, w, keys, width=60, impl="triton")
        ref, _ = index_scores(q, w, keys, width=60, impl="torch")
        assert scores is not None and ref is not None
        _assert_scores(scores, ref)


SM90 = CUDA and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.skipif(not SM90, reason="v14 is Gluon for sm_90")
@pytest.mark.parametrize(("heads", "per_block", "tiles", "stages"),
                         [(32, 64, None, None), (32, 32, 4, 2), (20, 16, 1, 3), (16, 24, 32, 4), (32, 64, 3, 5)])
def test_gpu_gluon_scan(heads: int, per_block: int, tiles: int | None, stages: int | None, gen: torch.Generator,
                        device: torch.device) -> None:
    # the Gluon scan against the reference: ragged widths (tiles and programs cut short), blocks of
    # 64 / 32 / 16 entries (slot -> block by a shift) and of 24 (a division), an unmapped block,
    # visible counts from 0 to all, padded heads, keys of magnitudes 2**-60..2**60, scores and maxima
    # NaN-poisoned; each config launched twice in a row (the second reuses the compiled kernel)
    tokens, dim = 9, 128
    for width in (1000, 4099):
        keys = _keys(requests=3, tokens=tokens, dim=dim, entries_per_block=per_block,
                     blocks_per_req=-(-width // per_block) + 1, max_visible=width, gen=gen, device=device)
        n = keys.records.num_slots
        x = torch.randn(n, dim, generator=gen, device=device)
        x = x * torch.exp2(torch.randint(-60, 61, (n, 1), generator=gen, device=device).float())
        write_records_reference("index", x, torch.arange(n, device=device), keys.records)
        q, w = _queries(tokens, heads, dim, gen, device)
        ref, ref_max = index_scores(q, w, keys, width=width, block_max=8, impl="torch")
        magnitude, _ = index_scores(q, w.abs(), keys, width=width, impl="torch")
        assert ref is not None and ref_max is not None and magnitude is not None
        config = IndexConfig(kernel="gluon", tiles=tiles, num_stages=stages)
        for _ in range(2):
            scores = torch.full((tokens, width), float("nan"), device=device)
            maxima = torch.full((tokens, -(-width // 8)), float("nan"), device=device)
            index_scores(q, w, keys, width=width, block_max=8, out=scores, maxima_out=maxima, config=config,
                         impl="triton")
            _assert_scores(scores, ref, magnitude)
            mag_max = torch.nn.functional.pad(magnitude, (0, -width % 8)).view(tokens, -1, 8).amax(-1)
            _assert_scores(maxima, ref_max, mag_max)
            only_max = torch.full((tokens, -(-width // 8)), float("nan"), device=device)
            index_scores(q, w, keys, width=width, block_max=8, write_scores=False, maxima_out=only_max, config=config,
                         impl="triton")
            assert torch.equal(only_max, maxima)


def _check_topk(ids: Tensor, scores: Tensor, k: int, entries: Tensor | None) -> None:
    """ids hold the k best scores of each row (as a multiset: ties may pick any), each column
    at most once, mapped through `entries`, -1 exactly where the picked score is -inf."""
    kk = min(k, scores.shape[1])
    assert ids.shape == (scores.shape[0], kk) and ids.dtype == torch.int32
    scores, ids = scores.cpu(), ids.cpu()
    want = scores.topk(kk, dim=-1).values.sort(-1).values
    for n in range(scores.shape[0]):
        column_of = {int(e): c for c, e in enumerate(entries[n].tolist())} if entries is not None else None
        cols = []
        for i in ids[n].tolist():  # back to columns
            if i < 0:
                continue
            assert column_of is None or i in column_of, f"id {i} is not one of the row's entries"
            cols.append(column_of[i] if column_of is not None else i)
        assert len(set(cols)) == len(cols), "a column picked twice"
        finite = want[n][want[n] > float("-inf")]
        assert len(cols) == finite.numel(), (len(cols), finite.numel())
        assert torch.equal(scores[n, torch.tensor(cols, dtype=torch.long)].sort().values, finite)


@pytest.mark.parametrize(("tokens", "width", "k"), [(3, 700, 64), (2, 50, 64), (2, 2048, 512), (1, 16384, 512),
                                                    (4, 33, 1)])
def test_topk_kernel(tokens: int, width: int, k: int, gen: torch.Generator, device: torch.device) -> None:
    # the one-program radix select against torch.topk: random scores with ties at and around the
    # k-th, rows partly or wholly -inf, negative and positive zeros, an id map (int64) or none
    scores = torch.randn(tokens, width, generator=gen, device=device)
    scores[0, : width // 3] = float("-inf")
    if tokens > 1:
        kth = scores[1].sort(descending=True).values[min(k, width) - 1]
        scores[1, torch.randperm(width, generator=gen, device=device)[: max(1, width // 4)]] = kth  # many ties
        scores[-1] = float("-inf") if width < k else scores[-1]
    if tokens > 2:
        scores[2, ::2] = 0.0
        scores[2, 1::4] = -0.0
    entries = torch.randperm(10 * width, generator=gen, device=device)[:width].repeat(tokens, 1)
    for ids_map in (None, entries):
        ids = topk_entries_triton(scores, k, ids_map)
        _check_topk(ids, scores, k, ids_map)
    # non-contiguous scores (a column slice) and the dispatching front door
    wide = torch.randn(tokens, width + 3, generator=gen, device=device)
    _check_topk(topk_entries_triton(wide[:, 3:], k), wide[:, 3:].contiguous(), k, None)
    _check_topk(topk_entries(scores, k), scores, k, None)
    # ties at the k-th score are taken in column order
    flat = torch.zeros(1, 40, device=device)
    assert sorted(topk_entries_triton(flat, 10)[0].tolist()) == list(range(10))


def test_topk_kernel_refuses_what_it_cannot_take(device: torch.device) -> None:
    with pytest.raises(ValueError, match="at most 16384"):
        topk_entries_triton(torch.zeros(1, 16385, device=device), 4, chunk=0)
    with pytest.raises(ValueError, match="chunk must be a power of two"):
        topk_entries_triton(torch.zeros(1, 100, device=device), 8, chunk=12)
    with pytest.raises(ValueError, match="chunk must be a power of two"):
        topk_entries_triton(torch.zeros(1, 100, device=device), 8, chunk=8)  # keeps as many as it reads
    with pytest.raises(ValueError, match="radix_bits"):
        topk_entries_triton(torch.zeros(1, 100, device=device), 8, radix_bits=0)
    with pytest.raises(ValueError, match="keys_per_thread"):
        topk_entries_triton(torch.zeros(1, 100, device=device), 8, keys_per_thread=0)
    with pytest.raises(TypeError, match="dtype"):
        topk_entries_triton(torch.zeros(1, 8, device=device, dtype=torch.float16), 4)
    with pytest.raises(ValueError, match="entries"):
        topk_entries_triton(torch.zeros(2, 8, device=device), 4, torch.zeros(2, 7, dtype=torch.int32, device=device))


@pytest.mark.parametrize(("tokens", "width", "k", "chunk", "bits"),
                         [(3, 1000, 16, 64, 8), (2, 777, 40, 128, 5), (2, 300, 64, 128, 4), (1, 600, 8, 16, 6),
                          (4, 70, 33, 128, 8)])
def test_topk_kernel_parts(tokens: int, width: int, k: int, chunk: int, bits: int, gen: torch.Generator,
                           device: torch.device) -> None:
    # rows cut into parts (a last part narrower than k, several rounds of selection) and radix
    # passes of other widths pick exactly the set one program with 8-bit passes picks: the same
    # order (score, then column) decides, ties at the k-th included
    scores = torch.randn(tokens, width, generator=gen, device=device).mul(4).round()  # many ties
    scores[0, : width // 2] = float("-inf")
    if tokens > 1:
        scores[1, width // 3 :] = float("-inf")  # fewer finite scores than some parts need
    if tokens > 2:
        scores[2, ::3] = -0.0
    entries = torch.randperm(10 * width, generator=gen, device=device)[:width].repeat(tokens, 1)
    for ids_map, early in ((None, True), (entries, False)):
        parts = topk_entries_triton(scores, k, ids_map, chunk=chunk, radix_bits=bits, early_exit=early)
        _check_topk(parts, scores, k, ids_map)
        if width <= 16384:
            whole = topk_entries_triton(scores, k, ids_map, chunk=0, radix_bits=8, early_exit=not early)
            assert torch.equal(parts.sort(-1).values, whole.sort(-1).values)
    flat = torch.zeros(1, 40, device=device)  # ties across parts: still column order
    assert sorted(topk_entries_triton(flat, 10, chunk=32, radix_bits=bits)[0].tolist()) == list(range(10))


def test_topk_chunk_rule() -> None:
    assert topk_chunk(4096, 512) == 0  # one part's width already
    assert topk_chunk(16384, 512) == 4096
    assert topk_chunk(1 << 20, 512) == 4096
    assert topk_chunk(131072, 2048) == 0  # keeps too much of each part: torch.topk's job past 16K


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(("tokens", "width", "k"), [(1, 4096, 512), (64, 16384, 512), (8, 16384, 512),
                                                    (64, 4096, 512), (3, 9000, 512), (1, 131072, 512),
                                                    (1, 131072, 2048), (2, 65536, 512), (140, 20000, 512)])
def test_gpu_topk_kernel(tokens: int, width: int, k: int, gen: torch.Generator, device: torch.device) -> None:
    # the GPU path of topk_entries at the index shapes (top-512 of a 4,096-entry candidate list,
    # of a 16,384-entry pool, of the block maxima at 512K / 1M; the top-2048 blocks of the pool)
    # against torch.topk, with -inf tails and ties; rows in parts and other radix digits too
    scores = torch.randn(tokens, width, generator=gen, device=device)
    scores[0, width // 2 :] = float("-inf")
    scores[-1, ::7] = scores[-1, 3]
    _check_topk(topk_entries(scores, k), scores, k, None)
    entries = torch.argsort(torch.rand(tokens, width, generator=gen, device=device), dim=1) + 1000
    ids = topk_entries(scores, k, entries)
    _check_topk(ids, scores, k, entries)
    chunk = max(4096, 4 * k)
    if width > chunk:
        for bits, per_thread, early in ((8, 16, False), (5, 8, False), (4, 4, True)):
            ids = topk_entries_triton(scores, k, entries, chunk=chunk, radix_bits=bits, keys_per_thread=per_thread,
                                      early_exit=early)
            _check_topk(ids, scores, k, entries)
