"""CSA2 indexer: scores over FP4 index-key records and the two-level top-k.

Scoring (the reference's `DeepseekV41Indexer`): for query token `n` with indexer queries
`q [H, d]` (RoPE'd and FP4 fake-quantized by the caller, `fake_quant_fp4(q, 32, "ue8m0")`) and
head weights `w [H]` (`weights_proj(x) * H ** -0.5`), the score of compressed entry `t` is

    score[n, t] = sum_h relu(q[h] . key[t]) * softmax_scale * w[h]      (softmax_scale = d ** -0.5)

where `key[t]` is the decoded index-key record of entry `t` of the token's request, and `-inf`
when the entry is not visible yet (`t >= visible[n] = (position + 1) // m`).

Selection (`index_topk`), three modes matching the reference's layer roles:

* candidate source (`candidate_blocks=B`): blocks of `candidate_block_size` entries score their
  maximum; the block holding the newest visible entry is pinned in; the top `B` blocks form the
  token's candidate pool (returned); the layer's own top-k is over every visible entry (its
  top-k blocks are among the pool's best `B - 1`, so with `B > k` they are picked there);
* Reindex layer (`candidates=` a pool): top-k of the scores inside the pool;
* Full layer without a pool (neither): top-k over every visible entry.

At Full layers the kernel scores every entry once, for block maxima only (a full scan of the
index keys, the only part of decode that grows with context), then re-scores the entries of the
top-k blocks (k blocks of `candidate_block_size`) and takes the top-k among them. That is exact:
every entry of the top-k lies in a block whose maximum is at least the k-th score, and there are
at most k such blocks (ties may resolve differently, as between any two top-k implementations).

Layers: `_index_scores_kernel` (`_indexer_kernels.py`); :func:`index_scores`; the torch reference
:func:`index_scores_reference` and :func:`index_topk_reference` (dense scores, the reference
model's selection rules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from cedserve.kernels.paged import PagedRecords
from cedserve.kernels.records import read_records_reference, record_format
from cedserve.kernels.triton_support import (
    Impl,
    cdiv,
    check_tensor,
    gluon_hopper_available,
    hardware_fp8,
    interpreting,
    log2_if_power_of_2,
    next_power_of_2,
    num_sms,
    pdl_launch,
    resolve_impl,
)

_INTS = (torch.int32, torch.int64)


@dataclass(frozen=True)
class IndexKeys:
    """Where each query token's index keys live, and how many it may see."""

    records: PagedRecords
    """Index-key records (68 B at d = 128)."""
    block_table: Tensor
    """int32/int64 `[R, max_blocks]`: block ids of each request's compressed entries (-1 = none)."""
    token_req: Tensor
    """int32/int64 `[N]`: row of `block_table` of each query token."""
    visible: Tensor
    """int32/int64 `[N]`: entries visible to each token (`(position + 1) // m`)."""

    def __post_init__(self) -> None:
        check_tensor(self.block_table, "IndexKeys.block_table", dtypes=_INTS, dim=2)
        check_tensor(self.token_req, "IndexKeys.token_req", dtypes=_INTS, dim=1)
        check_tensor(self.visible, "IndexKeys.visible", dtypes=_INTS, dim=1)
        if self.token_req.shape != self.visible.shape:
            raise ValueError(f"IndexKeys: token_req {list(self.token_req.shape)} and visible "
                             f"{list(self.visible.shape)} must both be [N]")

    @property
    def dim(self) -> int:
        return record_format("index").dim(self.records.record_bytes)

    def slots(self, entries: Tensor) -> Tensor:
        """int32 slots of entries `[N, T]` (-1 for -1 entries, invisible ones or unmapped blocks)."""
        table = self.block_table.long()[self.token_req.long()]  # [N, max_blocks]
        spb = self.records.slots_per_block
        e = entries.long()
        ok = (e >= 0) & (e < self.visible.long().unsqueeze(-1)) & (e < table.shape[1] * spb)
        block_idx = e.clamp_min(0).div(spb, rounding_mode="floor").clamp_max(max(table.shape[1] - 1, 0))
        block = torch.gather(table, 1, block_idx)
        ok = ok & (block >= 0)
        return torch.where(ok, block * spb + e.clamp_min(0).remainder(spb), torch.full_like(e, -1)).to(torch.int32)


@dataclass(frozen=True)
class IndexConfig:
    """Launch parameters of the index-score kernel (None = default)."""

    block_t: int | None = None
    """Entries per tile (the MMA's M dimension), a power of two >= the candidate block size."""
    tiles: int | None = None
    """Tiles per program (the queries are loaded once per program)."""
    num_warps: int | None = None
    num_stages: int | None = None
    version: int | None = None
    """Key decode: 4 (word-wide integer decode into bf16 pairs, the default where d >= 64) or 3
    (per-byte decode, `kernels-notes.md` v3; also every d = 32). (v5, two tiles' loads in flight,
    and v9, E4M3 MMAs per scale block, were measured and removed: `kernels-notes.md` v5, v9.)"""
    prefetch: int | None = None
    """1 (the v4 default): the next tile's slots (list entries, block ids) are loaded a tile ahead,
    so a tile waits for one dependent load instead of two; 0: each tile loads its slots, then its
    records (v3 always: through the prefetch its byte loads lose their vectors)."""
    kernel: str | None = None
    """"triton" (`_indexer_kernels.py`) or "gluon" (v14, `_indexer_gluon.py`: a ring of cp.async
    stages and register-operand warpgroup MMAs; sm_90, range mode, one token per request, d = 128,
    <= 32 heads). None: "gluon" where it can run, else "triton". For "gluon" `tiles` (of 64 entries)
    and `num_stages` (the ring's depth) apply; the other fields are Triton's."""

    def resolve(self, cand_block: int, dim: int = 128) -> IndexConfig:
        block_t = max(cand_block, self.block_t or (64 if interpreting() else 128))
        version = self.version or 4
        if version not in (3, 4):
            raise ValueError(f"IndexConfig.version must be 3 or 4, got {version}")
        if dim < 64:  # v4's four MMAs have K = d / 4, and an MMA needs K >= 16
            version = 3
        # v3: 2 stages (the compiler pipelines the record loads, run 3); v4: 1 (sm_90 SASS: its
        # pipelined variant stages the words through shared memory, +10 % instructions per tile)
        stages = self.num_stages or (1 if interpreting() or version >= 4 else 2)
        if self.prefetch not in (None, 0, 1):
            raise ValueError(f"IndexConfig.prefetch must be 0 or 1, got {self.prefetch}")
        prefetch = (1 if self.prefetch is None else self.prefetch) if version == 4 else 0
        # tiles per program: 32 for the word decode (run 11, 3 interleaved rounds at 262K: x32 with
        # the prefetch 0.887 ms, x16 0.941, x32 without 0.946, x16 without 0.996); `index_scores`
        # halves it while the grid would have under two programs per SM
        return IndexConfig(block_t, self.tiles or (8 if version == 3 else 32), self.num_warps or 4, stages, version,
                           prefetch, self.kernel)


@dataclass(frozen=True)
class IndexSelection:
    """What an index source publishes."""

    entries: Tensor
    """int32 `[N, k]`: each token's selected entries (-1 = none), in no particular order."""
    candidates: Tensor | None
    """int32 `[N, B * candidate_block_size]`: the candidate pool (candidate source only; -1 = none)."""


# ------------------------------------------------------------------------------ scoring


def index_scores_reference(q: Tensor, weights: Tensor, keys: IndexKeys, entries: Tensor,
                           softmax_scale: float | None = None) -> Tensor:
    """Float32 scores `[N, T]` of the listed `entries [N, T]` (-inf where masked)."""
    tokens, _, dim = q.shape
    slots = keys.slots(entries)
    k = read_records_reference("index", keys.records, slots.flatten()).view(tokens, -1, dim)
    scale = dim**-0.5 if softmax_scale is None else softmax_scale
    per_head = torch.einsum("nhd,ntd->nht", q.float(), k).relu() * scale
    scores = (per_head * weights.float().unsqueeze(-1)).sum(dim=1)
    return scores.masked_fill(slots < 0, float("-inf"))


def range_scores_reference(q: Tensor, weights: Tensor, keys: IndexKeys, width: int,
                           softmax_scale: float | None = None) -> Tensor:
    """`index_scores_reference` of entries `[0, width)` for every token, `[N, width]`, with each
    request's keys read once and scored against all its tokens at once (a per-token gather of the
    same keys costs N times the memory: a prefill chunk's 2,048 tokens share one request)."""
    tokens, _, dim = q.shape
    scale = dim**-0.5 if softmax_scale is None else softmax_scale
    out = torch.full((tokens, width), float("-inf"), device=q.device)
    if tokens == 0 or width == 0:
        return out
    entries = torch.arange(width, device=q.device)
    req, visible = keys.token_req.long(), keys.visible.long()
    for r in torch.unique(req).tolist():
        rows = (req == r).nonzero().flatten()
        seen = visible[rows].max().view(1)
        slots = IndexKeys(keys.records, keys.block_table, req[rows[:1]], seen).slots(entries.unsqueeze(0))[0]
        k = read_records_reference("index", keys.records, slots)  # [width, d]
        per_head = torch.einsum("nhd,td->nht", q[rows].float(), k).relu() * scale
        scores = (per_head * weights[rows].float().unsqueeze(-1)).sum(dim=1)
        hidden = (entries.unsqueeze(0) >= visible[rows].unsqueeze(-1)) | (slots < 0).unsqueeze(0)
        out[rows] = scores.masked_fill(hidden, float("-inf"))
    return out


def _check_scores(q: Tensor, weights: Tensor, keys: IndexKeys) -> None:
    op = "index_scores"
    check_tensor(q, f"{op}: q", dtypes=(torch.bfloat16,), dim=3)
    check_tensor(weights, f"{op}: weights", dtypes=(torch.float32, torch.bfloat16), dim=2)
    tokens, heads, dim = q.shape
    if weights.shape != (tokens, heads):
        raise ValueError(f"{op}: weights must be [{tokens}, {heads}], got {list(weights.shape)}")
    if keys.token_req.shape[0] != tokens:
        raise ValueError(f"{op}: keys describe {keys.token_req.shape[0]} tokens, q has {tokens}")
    if keys.dim != dim:
        raise ValueError(f"{op}: index records hold d={keys.dim}, q has d={dim}")
    half = dim // 2
    if half & (half - 1) or half < 16:
        raise ValueError(f"{op}: the kernel needs d / 2 to be a power of two >= 16, got d={dim}")


def index_scores(q: Tensor, weights: Tensor, keys: IndexKeys, *, entries: Tensor | None = None,
                 width: int | None = None, block_max: int | None = None, write_scores: bool = True,
                 softmax_scale: float | None = None, out: Tensor | None = None, maxima_out: Tensor | None = None,
                 tokens_per_request: int = 1, config: IndexConfig | None = None,
                 impl: Impl = "auto", row_offsets: Tensor | None = None,
                 max_rows: int = 1) -> tuple[Tensor | None, Tensor | None]:
    """Index scores of `q [N, H, d]` (bf16) with head weights `weights [N, H]`.

    List mode (`entries [N, T]` int, -1 = none): scores `[N, T]`. Range mode (`width`): scores of
    entries `[0, width)`, `[N, width]`, and with `block_max=B` also the maxima of each block of `B`
    entries, `[N, cdiv(width, B)]` (`write_scores=False` skips the per-entry scores: level one of
    the top-k needs only the maxima). Returns `(scores or None, block maxima or None)`, float32,
    -inf where masked, written into `out` / `maxima_out` when given (float32, contiguous rows).

    `tokens_per_request=G` (range mode): the tokens come in consecutive groups of G that share one
    request (`token_req` equal within a group: a prefill chunk, speculative drafts); the kernel then
    decodes each key tile once per group and scores it against the G x H queries in one MMA.
    `row_offsets` (int `[N]`, with `max_rows` > 1; range mode): the same for groups of varying
    length, up to `max_rows`: each row's place in its run of one request's consecutive rows (0
    starts a run; a DSpark verify's rows, which a step mixes with single decode rows). The Triton
    kernel takes a run per program (while a run's rows x heads fit 256 query rows); the scores are
    the same either way."""
    _check_scores(q, weights, keys)
    # runs of rows share a program while their queries fit one tile (256 rows); else a program a row
    runs = (row_offsets is not None and max_rows > 1 and entries is None
            and next_power_of_2(max_rows) * max(8, next_power_of_2(q.shape[1])) <= 256)
    if row_offsets is not None:
        check_tensor(row_offsets, "index_scores: row_offsets", dtypes=_INTS, dim=1)
        if row_offsets.shape[0] != q.shape[0] or row_offsets.device != q.device:
            raise ValueError(f"index_scores: row_offsets must be [{q.shape[0]}] on {q.device}")
        if tokens_per_request != 1:
            raise ValueError("index_scores: give tokens_per_request or row_offsets, not both")
    if tokens_per_request < 1 or q.shape[0] % tokens_per_request:
        raise ValueError(f"index_scores: tokens_per_request must divide the {q.shape[0]} tokens, got "
                         f"{tokens_per_request}")
    if (entries is None) == (width is None):
        raise ValueError("index_scores: give exactly one of `entries` (list mode) or `width` (range mode)")
    if entries is not None:
        check_tensor(entries, "index_scores: entries", dtypes=_INTS, dim=2)
        if block_max is not None:
            raise ValueError("index_scores: block maxima are a range-mode output")
        tokens_per_request = 1  # every token has its own list
    tokens = q.shape[0]
    device = q.device
    num = entries.shape[1] if entries is not None else int(width or 0)
    layer = resolve_impl(impl, "index_scores", q, weights, keys.records.storage, keys.block_table, keys.token_req,
                         keys.visible, *([entries] if entries is not None else []))
    write = write_scores or entries is not None
    num_maxima = cdiv(num, block_max) if block_max else 0
    out = _output(out, (tokens, num), "out", device) if write else None
    maxima_out = _output(maxima_out, (tokens, num_maxima), "maxima_out", device) if block_max else None
    if layer == "torch":
        listed = entries if entries is not None else torch.arange(num, device=device).expand(tokens, num)
        scores = index_scores_reference(q, weights, keys, listed, softmax_scale)
        if block_max is not None and maxima_out is not None:
            padded = F.pad(scores, (0, -num % block_max), value=float("-inf"))
            maxima_out.copy_(padded.view(tokens, -1, block_max).amax(-1))
        if out is not None:
            out.copy_(scores)
        return out, maxima_out
    from cedserve.kernels import _indexer_kernels as k

    heads, dim = q.shape[1], q.shape[2]
    cand = block_max or 1
    if cand & (cand - 1):
        raise ValueError(f"index_scores: block_max must be a power of two, got {cand}")
    scores = out if out is not None else torch.empty(tokens, 1, dtype=torch.float32, device=device)
    maxima = maxima_out if maxima_out is not None else torch.empty(tokens, 1, dtype=torch.float32, device=device)
    if tokens == 0 or num == 0:
        return out, maxima_out
    why_not = _gluon_scan_unsupported(q, keys, entries, cand, tokens_per_request)
    if runs:
        why_not = "it takes one token per program (row_offsets: runs of rows)"
    kernel = config.kernel if config is not None else None
    if kernel is None:  # Gluon where it runs, unless Triton-only launch fields were given
        triton_fields = config is not None and any(
            f is not None for f in (config.block_t, config.num_warps, config.version, config.prefetch))
        # (the default where it runs: kernels-notes.md, v14)
        kernel = "gluon" if why_not is None and gluon_hopper_available() and not triton_fields else "triton"
    if kernel not in ("triton", "gluon"):
        raise ValueError(f"index_scores: IndexConfig.kernel must be 'triton' or 'gluon', got {kernel!r}")
    if kernel == "gluon":
        if why_not is not None:
            raise ValueError(f"index_scores: the gluon kernel cannot run here: {why_not}")
        _launch_gluon(q, weights, keys, num, cand, write, block_max is not None, scores, maxima, softmax_scale, config)
        return out, maxima_out
    cfg = (config or IndexConfig()).resolve(cand, q.shape[2])
    group = next_power_of_2(max_rows) if runs else tokens_per_request
    programs = tokens if runs else tokens // group  # (runs: a program per row, those not starting one idle)
    busy = tokens // max_rows if runs else programs  # the programs that scan when every run is max_rows long
    heads_p2 = max(16 if group == 1 else 8, next_power_of_2(heads))
    if group * heads_p2 > 256:
        raise ValueError(f"index_scores: rows per group x heads must be <= 256, got {group} x {heads_p2}")
    assert cfg.block_t and cfg.tiles and cfg.num_warps and cfg.num_stages
    block_t = cfg.block_t
    # tiles per program (the group's queries are loaded once per span), a power of two: TILES is a
    # compile-time constant and a decode step's width grows an entry at a time (see `_launch_gluon`)
    tiles = min(cfg.tiles, 1 << (cdiv(num, block_t).bit_length() - 1)) if num else 1
    if config is None or config.tiles is None:  # keep >= 2 programs per SM where the work allows (at
        # batch 1, a 4,096-entry list: 32 programs of one tile instead of 8 of 4)
        while tiles > 1 and max(1, busy) * cdiv(num, block_t * tiles) < 2 * num_sms(device):
            tiles //= 2
    entries_arg = entries if entries is not None else keys.visible
    rec = keys.records
    k._index_scores_kernel[(programs, cdiv(num, block_t * tiles))](
        q, q.stride(0), q.stride(1), weights, weights.stride(0),
        rec.storage, rec.num_blocks, rec.offset_bytes, rec.slots_per_block, rec.slot_stride_bytes,
        rec.block_stride_bytes,
        keys.block_table, keys.block_table.stride(0), keys.block_table.shape[1], keys.token_req, keys.visible,
        entries_arg, entries_arg.stride(0), num, tokens,
        scores, scores.stride(0), maxima, maxima.stride(0),
        heads, dim**-0.5 if softmax_scale is None else softmax_scale,
        HALF=dim // 2, HEADS_P2=heads_p2, TOKENS=group, BLOCK_T=block_t, TILES=tiles,
        LIST_MODE=entries is not None, CAND_BLOCK=cand, WRITE_SCORES=write, WRITE_BLOCK_MAX=block_max is not None,
        ALIGN=rec.alignment, HW_CVT=hardware_fp8(q.device), DOT_F32=interpreting(), VERSION=cfg.version,
        PREFETCH=cfg.prefetch or 0, offsets_ptr=row_offsets if runs else keys.visible, RUNS=runs,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(q.device),
    )
    return out, maxima_out


def _gluon_scan_unsupported(q: Tensor, keys: IndexKeys, entries: Tensor | None, cand: int,
                            tokens_per_request: int) -> str | None:
    """Why the Gluon scan (v14) cannot take this call, or None."""
    if q.device.type != "cuda" or interpreting():
        return "it needs a CUDA device (the interpreter cannot run Gluon)"
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return "it needs sm_90 (Hopper warpgroup MMAs)"
    if entries is not None or tokens_per_request != 1:
        return "it scores ranges (not entry lists) for one token per request"
    if q.shape[2] != 128 or q.shape[1] > 32:
        return f"it takes d = 128 and at most 32 heads, got d = {q.shape[2]}, {q.shape[1]} heads"
    if q.stride(2) != 1:
        return "q must have contiguous channels"
    if keys.records.alignment < 4:
        return "records must be 4-byte aligned (4-byte cp.async)"
    if 64 % cand:
        return f"block maxima of {cand} entries do not divide its 64-entry tiles"
    return None


def _launch_gluon(q: Tensor, weights: Tensor, keys: IndexKeys, num: int, cand: int, write_scores: bool,
                  write_block_max: bool, scores: Tensor, maxima: Tensor, softmax_scale: float | None,
                  config: IndexConfig | None) -> None:
    """`_gl_index_scan_kernel` (v14) over entries `[0, num)` of every token (checked by the caller:
    `_gluon_scan_unsupported`)."""
    from cedserve.kernels import _indexer_gluon as g

    tokens, heads, dim = q.shape
    tiles = (config.tiles if config is not None else None) or 32
    # the ring's depth: 2 (runs 22-23, 3 interleaved rounds each: 2 stages 633-638 us, 3 647-652, 4
    # 646-651, 6 669-675; a register cap of 80 or 72 for more CTAs per SM: 640-670 / 709): the kernel
    # is bound by its instruction issue, not by loads in flight (kernels-notes.md, v14)
    stages = (config.num_stages if config is not None else None) or 2
    if stages < 2 or tiles < 1:
        raise ValueError(f"index_scores: the gluon kernel needs num_stages >= 2 and tiles >= 1, got {stages}, {tiles}")
    # a power of two: TILES is a compile-time constant, and a decode step's width grows one entry at
    # a time, so min(tiles, cdiv(num, 64)) would compile a new variant every 64 entries up to 2,048
    tiles = min(tiles, 1 << (cdiv(num, 64).bit_length() - 1)) if num else 1
    if config is None or config.tiles is None:  # keep >= 2 programs per SM where the work allows
        while tiles > 4 and tokens * cdiv(num, 64 * tiles) < 2 * num_sms(q.device):
            tiles //= 2
    rec = keys.records
    spb = rec.slots_per_block
    g._gl_index_scan_kernel[(tokens, cdiv(num, 64 * tiles))](
        q, q.stride(0), q.stride(1), weights, weights.stride(0),
        rec.storage, rec.num_blocks, rec.offset_bytes, spb, rec.slot_stride_bytes, rec.block_stride_bytes,
        keys.block_table, keys.block_table.stride(0), keys.block_table.shape[1], keys.token_req, keys.visible, num,
        scores, scores.stride(0), maxima, maxima.stride(0),
        heads, dim**-0.5 if softmax_scale is None else softmax_scale,
        H=max(16, next_power_of_2(heads)), TILES=tiles, STAGES=stages, CAND_BLOCK=cand, WRITE_SCORES=write_scores,
        WRITE_BLOCK_MAX=write_block_max, SPB_LOG2=log2_if_power_of_2(spb),
        # blocks of >= 32 records back to back (the cache's index regions): two block ids per tile
        FAST_ROWS=log2_if_power_of_2(spb) >= 5 and rec.slot_stride_bytes == rec.record_bytes == 68, QSHIFT=64,
        num_warps=4,
    )


def _output(t: Tensor | None, shape: tuple[int, int], what: str, device: torch.device) -> Tensor:
    if t is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    if t.shape != shape or t.dtype != torch.float32 or (shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"index_scores: {what} must be float32 {list(shape)} with contiguous rows, got "
                         f"{t.dtype} {list(t.shape)}")
    return t


# ------------------------------------------------------------------------------ selection


TOPK_PROGRAM_MAX_WIDTH = 16384
"""The widest row (or part of a row) that one `_topk_select_kernel` program holds in registers."""

TOPK_KERNEL_MAX_WIDTH = 1 << 30
"""Rows up to this width take `topk_entries_triton` on the GPU, wider ones `torch.topk` (its
multi-block radix select). The benchmark sets it to 0 to time `torch.topk` side by side."""

TOPK_RADIX_BITS = 5
"""Bits a radix pass of the top-k kernel decides (a histogram of 2**bits bins per pass; run 45:
7 passes of 5 bits beat 4 of 8 at every shape, 14.7 against 17.8 us on a 4,096-wide row:
`tl.histogram` costs a ballot per bit and, per lane, an AND chain per bin it owns)."""

TOPK_KEYS_PER_THREAD = 8
"""Keys each thread of a top-k program holds (its warps: width / 32 / this, 4 to 32)."""

TOPK_EARLY_EXIT = True
"""Whether the top-k kernel's radix passes may stop once the k-th key's bin is kept whole: in
launches of at most one program per SM (run 48: a 4,096-wide row 13.4 against 14.7 us, the
batch-1 step's index calls 227 against 253 us at 4K), not in larger ones, where its registers
and branches cost more than the passes it skips (64 rows of 16,384: 34.3 against 32.1 us)."""

TOPK_CHUNK = 4096
"""The part width rows are cut into (see :func:`topk_chunk`)."""

BLOCKS_FROM_POOL = True
"""Candidate source: pick the layer's own top-k blocks among the pool's blocks (a select over
`candidate_blocks` columns) rather than among all block maxima, when the pool is larger than k
and the maxima are wider than `TOPK_CHUNK` (a select in parts). Run 50, batch 1: -11 us at 1M
(131K maxima), a tie at 64K, +9 us at 4K (512 maxima: one program either way, and the narrow
select has to wait for the pool's). The benchmark clears it to time the wide select beside it."""


def topk_entries(scores: Tensor, k: int, entries: Tensor | None = None) -> Tensor:
    """int32 `[N, min(k, T)]`: the k best of `scores [N, T]` (-1 where the score is -inf), as
    entry ids (`entries [N, T]` maps columns to ids; default the column index), in no particular
    order. On the GPU, rows of up to `TOPK_KERNEL_MAX_WIDTH` take `topk_entries_triton`;
    elsewhere `torch.topk`."""
    k = min(k, scores.shape[1])
    if k == 0:
        return torch.empty(scores.shape[0], 0, dtype=torch.int32, device=scores.device)
    width = scores.shape[1]
    if (scores.is_cuda and not interpreting() and width <= TOPK_KERNEL_MAX_WIDTH
            and (width <= TOPK_PROGRAM_MAX_WIDTH or topk_chunk(width, k))):
        return topk_entries_triton(scores, k, entries)
    top = scores.topk(k, dim=-1, sorted=False)
    ids = top.indices if entries is None else torch.gather(entries.long(), 1, top.indices)
    return torch.where(top.values > float("-inf"), ids, torch.full_like(ids, -1)).to(torch.int32)


def topk_chunk(width: int, k: int) -> int:
    """The part width `topk_entries_triton` cuts rows into by default (0: one program a row).
    One program's time grows with its width, and a row is one program: parts of `TOPK_CHUNK`
    that keep an eighth or less of their width each win at every shape measured, few rows or
    many (run 45, top-512: a 16,384-wide row 22.8 us against 46.7 whole, 64 such rows 32.3
    against 47.6; 131,072-wide rows 35.5 us against `torch.topk`'s 59.9). Keeping a quarter
    (top-2048 in parts of 8,192) lost to `torch.topk` (74 against 60 us at 131,072), so wider k
    are not cut."""
    return TOPK_CHUNK if width > TOPK_CHUNK and 8 * k <= TOPK_CHUNK else 0


def topk_entries_triton(scores: Tensor, k: int, entries: Tensor | None = None, *, chunk: int | None = None,
                        radix_bits: int | None = None, keys_per_thread: int | None = None,
                        early_exit: bool | None = None) -> Tensor:
    """`topk_entries` by `_topk_select_kernel` (any device Triton runs on, the interpreter
    included): fp32 `scores [N, T]`; ties at the k-th score are taken in column order
    (torch.topk's choice among ties is unspecified). Rows wider than `chunk` (default
    :func:`topk_chunk`; 0 = one program a row, which holds at most `TOPK_PROGRAM_MAX_WIDTH`)
    are cut into parts of `chunk` columns, one program each; each part keeps its k best as
    (score, id), and the concatenation, `k` per part, is selected again the same way until it
    fits one program. The result is the same set as one program's (the same order decides).
    `early_exit` forces the radix passes' early exit on or off (default: `TOPK_EARLY_EXIT`'s rule
    per launch)."""
    from cedserve.kernels import _indexer_kernels as kern

    tokens, width = scores.shape
    k = min(k, width)
    check_tensor(scores, "topk_entries_triton: scores", dtypes=(torch.float32,), dim=2, last_contiguous=False)
    if entries is not None and (entries.shape != scores.shape or entries.dtype not in _INTS):
        raise ValueError(f"topk_entries_triton: entries must be int32/int64 {tuple(scores.shape)}, got "
                         f"{entries.dtype} {tuple(entries.shape)}")
    bits = TOPK_RADIX_BITS if radix_bits is None else radix_bits
    if not 2 <= bits <= 8:
        raise ValueError(f"topk_entries_triton: radix_bits must be in 2..8, got {bits}")
    per_thread = TOPK_KEYS_PER_THREAD if keys_per_thread is None else keys_per_thread
    if per_thread < 1:
        raise ValueError(f"topk_entries_triton: keys_per_thread must be positive, got {per_thread}")
    if chunk is None:
        chunk = topk_chunk(width, k)
    if chunk and (chunk < 2 * k or chunk > TOPK_PROGRAM_MAX_WIDTH or chunk & (chunk - 1)):
        raise ValueError(f"topk_entries_triton: chunk must be a power of two from 2k = {2 * k} to "
                         f"{TOPK_PROGRAM_MAX_WIDTH}, got {chunk}")
    if not chunk and width > TOPK_PROGRAM_MAX_WIDTH:
        raise ValueError(f"topk_entries_triton: one program takes rows of at most {TOPK_PROGRAM_MAX_WIDTH} "
                         f"scores, got {width} (pass chunk=)")
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    if entries is not None and entries.stride(1) != 1:
        entries = entries.contiguous()
    out = torch.empty(tokens, k, dtype=torch.int32, device=scores.device)
    if tokens == 0 or k == 0:
        return out
    src = entries if entries is not None else scores
    while chunk and width > chunk:  # cut, keep k a part, select again
        parts = cdiv(width, chunk)
        values = torch.empty(tokens, parts * k, dtype=torch.float32, device=scores.device)
        ids = torch.empty(tokens, parts * k, dtype=torch.int32, device=scores.device)
        _launch_topk(kern, scores, src, entries is not None, ids, values, width, k, chunk, parts, bits, per_thread,
                     early_exit)
        scores, src, width = values, ids, parts * k
        entries = ids
    _launch_topk(kern, scores, src, entries is not None, out, out, width, k, width, 1, bits, per_thread,
                 early_exit)
    return out


def _launch_topk(kern: Any, scores: Tensor, src: Tensor, has_entries: bool, out: Tensor, values: Tensor, width: int,
                 k: int, chunk: int, parts: int, bits: int, per_thread: int, early_exit: bool | None) -> None:
    block_t = max(16, next_power_of_2(min(chunk, width)))
    early = early_exit if early_exit is not None else (
        TOPK_EARLY_EXIT and scores.shape[0] * parts <= num_sms(scores.device))
    # ptxas, sm_90, 5-bit digits: no spills at 8 keys a thread up to 4K (64-101 registers); a whole
    # 16K row (32 warps, 16 keys a thread) spills 116-676 bytes and still beat 8-bit digits (run 45)
    kern._topk_select_kernel[(scores.shape[0], parts)](
        scores, scores.stride(0), src, src.stride(0), out, out.stride(0), values, values.stride(0), width, k, chunk,
        BLOCK_T=block_t, HAS_ENTRIES=has_entries, CHUNKED=parts > 1, RADIX_BITS=bits, EARLY_EXIT=early,
        num_warps=min(32, max(4, block_t // (32 * per_thread))), **pdl_launch(scores.device),)


def candidate_pool(block_scores: Tensor, visible: Tensor, topk_blocks: int, block_size: int) -> Tensor:
    """Level one: entry ids `[N, min(topk_blocks, nb) * block_size]` (-1 = none) of each token's
    best `topk_blocks` blocks by block maximum, the block of its newest visible entry pinned in,
    blocks without a visible entry never kept."""
    return _pool_entries(_pool_blocks(block_scores, visible, topk_blocks, block_size), visible, block_size)


def _pool_blocks(block_scores: Tensor, visible: Tensor, topk_blocks: int, block_size: int) -> Tensor:
    """int64 block ids `[N, min(topk_blocks, nb)]` of :func:`candidate_pool` (-1 = none)."""
    num_blocks = block_scores.shape[1]
    newest = (visible.long() - 1).div(block_size, rounding_mode="floor").unsqueeze(-1)
    ids = torch.arange(num_blocks, device=block_scores.device).unsqueeze(0)
    pinned = block_scores.masked_fill((ids == newest) & (block_scores > float("-inf")), float("inf"))
    return topk_entries(pinned, topk_blocks).long()  # [N, B], -1 for empty picks


def _pool_entries(blocks: Tensor, visible: Tensor, block_size: int) -> Tensor:
    """The visible entry ids of `blocks [N, B]` (-1 = none), `[N, B * block_size]` int32."""
    offsets = torch.arange(block_size, device=blocks.device)
    entries = (blocks.unsqueeze(-1) * block_size + offsets).flatten(1)
    keep = (blocks >= 0).repeat_interleave(block_size, dim=1) & (entries < visible.long().unsqueeze(-1))
    return torch.where(keep, entries, torch.full_like(entries, -1)).to(torch.int32)


def index_topk(q: Tensor, weights: Tensor, keys: IndexKeys, *, topk: int, width: int,
               candidates: Tensor | None = None, candidate_blocks: int | None = None, candidate_block_size: int = 8,
               softmax_scale: float | None = None, tokens_per_request: int = 1, config: IndexConfig | None = None,
               impl: Impl = "auto", row_offsets: Tensor | None = None, max_rows: int = 1) -> IndexSelection:
    """Each token's top-`topk` entries among `[0, width)` (`width` >= every token's visible
    count; a host int so nothing syncs), in the mode the arguments select (module docstring).
    `tokens_per_request`, or `row_offsets` and `max_rows`, as in :func:`index_scores` (the full
    scan reads each key once per group); `config` launches every scoring pass (the benchmark times
    scan versions in the step)."""
    if candidates is not None:  # Reindex: inside the pool
        scores, _ = index_scores(q, weights, keys, entries=candidates, softmax_scale=softmax_scale, config=config,
                                 impl=impl)
        assert scores is not None
        return IndexSelection(topk_entries(scores, topk, candidates), None)
    _, maxima = index_scores(q, weights, keys, width=width, block_max=candidate_block_size, write_scores=False,
                             softmax_scale=softmax_scale, tokens_per_request=tokens_per_request, config=config,
                             impl=impl, row_offsets=row_offsets, max_rows=max_rows)
    assert maxima is not None
    # exact top-k through the top-k blocks (unpinned: this list is not the published pool)
    pool = None
    if candidate_blocks is not None and candidate_blocks > topk and maxima.shape[1] > TOPK_CHUNK and BLOCKS_FROM_POOL:
        # the pool (pinned) holds the best candidate_blocks - 1 blocks, so the best topk: select
        # them among its blocks rather than among all nb (one narrow select instead of a wide one)
        pool_blocks = _pool_blocks(maxima, keys.visible, candidate_blocks, candidate_block_size)
        inside = torch.where(pool_blocks >= 0, maxima.gather(1, pool_blocks.clamp(min=0)),
                             torch.full_like(pool_blocks, float("-inf"), dtype=maxima.dtype))
        blocks = topk_entries(inside, topk, pool_blocks).long()
        pool = _pool_entries(pool_blocks, keys.visible, candidate_block_size)
    else:
        blocks = topk_entries(maxima, topk).long()
    offsets = torch.arange(candidate_block_size, device=blocks.device)
    near = (blocks.unsqueeze(-1) * candidate_block_size + offsets).flatten(1)
    near = torch.where((blocks >= 0).repeat_interleave(candidate_block_size, dim=1), near, torch.full_like(near, -1))
    scores, _ = index_scores(q, weights, keys, entries=near, softmax_scale=softmax_scale, config=config, impl=impl)
    assert scores is not None
    if candidate_blocks is not None and pool is None:
        pool = candidate_pool(maxima, keys.visible, candidate_blocks, candidate_block_size)
    return IndexSelection(topk_entries(scores, topk, near), pool)


def pool_mask(candidates: Tensor, width: int) -> Tensor:
    """bool `[N, width]`: which entries the pool `candidates [N, C]` (-1 = none) holds."""
    column = torch.where(candidates.long() >= 0, candidates.long(), torch.full_like(candidates.long(), width))
    inside = torch.zeros(candidates.shape[0], width + 1, dtype=torch.bool, device=candidates.device)
    return inside.scatter_(1, column, True)[:, :width]


def index_topk_reference(q: Tensor, weights: Tensor, keys: IndexKeys, *, topk: int, width: int,
                         candidates: Tensor | None = None, candidate_blocks: int | None = None,
                         candidate_block_size: int = 8, softmax_scale: float | None = None
                         ) -> tuple[IndexSelection, Tensor]:
    """The reference model's rules on dense scores: (selection, dense scores `[N, width]`). The
    candidate source's own top-k is over all visible entries, its pool its top blocks (pinned
    newest); a Reindex layer's top-k is inside the given pool."""
    tokens = q.shape[0]
    dense = range_scores_reference(q, weights, keys, width, softmax_scale)
    if candidates is not None:
        return IndexSelection(topk_entries(dense.masked_fill(~pool_mask(candidates, width), float("-inf")), topk),
                              None), dense
    pool = None
    if candidate_blocks is not None:
        padded = F.pad(dense, (0, -width % candidate_block_size), value=float("-inf"))
        pool = candidate_pool(padded.view(tokens, -1, candidate_block_size).amax(-1), keys.visible,
                              candidate_blocks, candidate_block_size)
    return IndexSelection(topk_entries(dense, topk), pool), dense
