"""Sparse attention over the compact cache: selected FP4 main-KV entries plus the FP8 window.

Every query token `n` attends, with all `H` heads and one shared K = V latent of `D` channels, to

* its selected compressed entries: main-KV records (288 B at D = 512) at `topk_slots[n]`, and
* its sliding window: SWA records (528 B at D = 512) at `window_slots[n]`,

with -1 marking an unused slot in either list (padding for requests with fewer entries, or not yet
visible ones). Per head the softmax runs over the union plus one learned sink logit that only
enlarges the denominator (the reference's `attn_sink`), and the output's RoPE slice (its last
`2 * cos.shape[-1]` channels, interleaved pairs) is rotated back with the query's `cos`/`sin`
(`apply_rotary_pos_emb(..., inverse=True)` of the reference model: the cached K = V carries RoPE,
so the attention output does too)::

    logits[n, h, j] = softmax_scale * q[n, h] . key_j          (key_j decoded from its record)
    p[n, h, :]      = softmax([logits[n, h, :], sink[h]])[:-1]
    out[n, h]       = inverse_rope(sum_j p[n, h, j] * key_j, cos[n], sin[n])

Nothing assumes one token per request: decode (one token per request), speculative verification
(several) and chunked prefill (:func:`window_slots_for_chunk` builds the window lists of a chunk)
are the same call. Slot lists are built by the caller from its block tables
(:func:`cedserve.kernels.paged.entries_to_slots`) and the window ring.

Layers: `_sparse_decode_attention_kernel` (+ `_combine_splits_kernel` when one token's keys are
split over several programs) in `_sparse_attention_kernels.py`, and on Hopper (sm_90, 64 heads x
512, the default there) `_gl_sparse_attention_kernel` in `_sparse_attention_gluon.py` (v20; its
key splits are merged by `_combine_splits_kernel`); :func:`sparse_attention` here;
:func:`sparse_attention_reference` (float32 math on the decoded records).

Precision: keys are exact in bf16; logits and the accumulator are fp32; probabilities are rounded
to bf16 for the P.V product (flash-attention practice); the output is rounded once to `q.dtype`.
The reference keeps everything in fp32, so expect differences of a few bf16 ulps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from cedserve.kernels.paged import PagedRecords
from cedserve.kernels.records import RecordKind, read_records_reference, record_format
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

_SLOT_DTYPES = (torch.int32, torch.int64)
_GROUPED_MAX_ROWS = 64
"""The grouped kernel holds every head of a run's rows as the M rows of one tile, with a `[M, D]`
float32 accumulator in registers: at most 64 (heads and run length each padded to a power of two;
mini-40's 4 heads take runs of up to 16 rows). Larger products run row by row."""


def _merge_heads(splits: int, dim: int, cap: int = 16) -> int:
    """Heads per `_combine_splits_kernel` program: its split loops are unrolled (the partials'
    loads in flight together), so a thread holds splits x heads x dim / 128 values; at most ~160
    (ptxas, sm_90, 4 warps: no spills from 1 x 40 to 16 x 2 splits at dim 512)."""
    heads = max(1, min(cap, 20480 // max(1, splits * dim)))
    return 1 << (heads.bit_length() - 1)


@dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters of the sparse attention kernel (None = chosen by a heuristic)."""

    block_h: int | None = None
    """Heads per program (16, 32 or 64); the MMA's M dimension."""
    block_n: int | None = None
    """Keys per tile (>= 16)."""
    num_splits: int | None = None
    """Programs per (token, head block x value half), each over a contiguous run of the token's key
    tiles (main list, then window; split-KV); > 1 adds a combine pass over fp32 partials
    (`[N, splits, H, D]` accumulators + `[N, splits, H, 2]` (max, sum)). `dv_split=1` with 2 splits
    is the v6 candidate: the same 128 programs at batch 64 as `dv_split=2`, without computing the
    logits twice (kernels-notes.md, "v6")."""
    num_warps: int | None = None
    num_stages: int | None = None
    dv_split: int | None = None
    """1 or 2: programs per (token, head block) that each accumulate half of the value channels
    (both compute the full logits: 1.5x the MMA work and 2x the decoding, half the accumulator)."""
    prefetch: bool | None = None
    """Load the next key tile's records into registers before decoding the current one, instead of
    loading at the top of the loop body (where `num_stages > 1` lets the compiler pipeline them)."""
    hw_cvt: bool | None = None
    """Decode keys with the GPU's fp8 -> fp16 conversions (sm89+; default there) instead of integer
    and fp32 arithmetic (the interpreter's path). Both give the same, exact keys."""
    kernel: str | None = None
    """"triton" (`_sparse_attention_kernels.py`, every GPU and the interpreter) or "gluon" (v20,
    `_sparse_attention_gluon.py`: Hopper warpgroup MMAs with our own shared-memory layout; sm_90,
    64 heads, head_dim 512, 16-byte aligned records). None: "gluon" where it can run and no
    Triton-only field is set (`auto`), else "triton".
    For "gluon" only `num_splits` applies; the others are fixed (64 heads, 64-key tiles, 8 warps)."""

    @property
    def auto(self) -> bool:
        """No kernel and no Triton launch field chosen: `sparse_attention` picks the kernel."""
        return self.kernel is None and all(
            f is None for f in (self.block_h, self.block_n, self.num_warps, self.num_stages, self.dv_split,
                                self.prefetch, self.hw_cvt))

    def resolve(self, tokens: int, heads: int, keys: int, device: torch.device, dim: int = 512,
                lists: tuple[int, ...] = ()) -> AttentionConfig:
        """Fill every None for this problem size (`keys`: the longer of a token's key lists; `lists`:
        every list's length where known, for the Triton kernel's split count). GPU defaults
        (ptxas reports and H200 runs, docs/kernels.md): a 64-head block over 512 channels keeps a 64 x
        512 fp32 accumulator, 128 registers a thread at 8 warps, which spills once the decoded tile is
        added; two value halves (`dv_split=2`) fit without spills and give batch 64 its 128 programs.

        Key splits (Triton): at least 4 key tiles a program while that fills one wave; where even
        that leaves most SMs idle (a few tokens with few heads: mini-40 at batch 1 is one program
        over 3 tiles), one tile a program, up to the token's tiles."""
        gpu = device.type == "cuda" and not interpreting()
        kernel = self.kernel or "triton"
        if kernel not in ("triton", "gluon"):
            raise ValueError(f"sparse_attention: kernel must be 'triton' or 'gluon', got {kernel!r}")
        if kernel == "gluon":
            # one wave of CTAs (205 KB of shared memory: one per SM), as few key tiles per CTA as
            # that allows, spread evenly: at batches 1 and 8 one tile each (10 splits; run 38: 20.1
            # and 21.8 us against 22.8 and 23.8 at 5 splits), at 16 two (5), at 64 five (2)
            tiles = cdiv(keys, 64) + 2  # (the window's tiles: `keys` is the longer of the two lists)
            per_cta = cdiv(tiles, max(1, min(num_sms(device) // max(tokens, 1), tiles)))
            splits = self.num_splits or cdiv(tiles, per_cta)
            return AttentionConfig(block_h=64, block_n=64, num_splits=splits, num_warps=8, num_stages=1, dv_split=1,
                                   prefetch=False, hw_cvt=True, kernel="gluon")
        block_h = self.block_h or min(64, max(16, next_power_of_2(heads)))
        block_n = self.block_n or 64
        dv_split = self.dv_split or (2 if gpu and block_h * dim > 16384 else 1)
        num_splits = self.num_splits
        if num_splits is None:
            programs = tokens * cdiv(heads, block_h) * dv_split
            target = num_sms(device) if gpu else 1
            wave = target // max(programs, 1)
            num_splits = max(1, min(wave, cdiv(keys, 4 * block_n)))  # <= one wave
            if programs * num_splits < target // 2:  # most SMs idle: one tile a program
                tiles = sum(cdiv(n, block_n) for n in lists) if lists else cdiv(keys, block_n)
                num_splits = max(num_splits, min(wave, tiles))
        num_warps = self.num_warps or (8 if block_h >= 64 else 4)
        # 64-key tiles loaded at the top of the loop body and pipelined by the compiler (cp.async into
        # shared memory, 2 stages): the fastest config of run 3 (96 us at batch 64, kernels-notes.md)
        num_stages = self.num_stages or (2 if gpu else 1)
        prefetch = False if self.prefetch is None else self.prefetch
        hw_cvt = hardware_fp8(device) if self.hw_cvt is None else self.hw_cvt and hardware_fp8(device)
        return AttentionConfig(block_h=block_h, block_n=block_n, num_splits=num_splits, num_warps=num_warps,
                               num_stages=num_stages, dv_split=dv_split, prefetch=prefetch, hw_cvt=hw_cvt,
                               kernel="triton")


def _rotate_back(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Inverse interleaved RoPE of the last `2 * cos.shape[-1]` channels of `x [N, H, D]` in fp32,
    `cos`/`sin` `[N, R/2]`."""
    pairs = cos.shape[-1]
    if pairs == 0:
        return x
    nope, rot = x[..., : x.shape[-1] - 2 * pairs], x[..., x.shape[-1] - 2 * pairs:]
    even, odd = rot[..., 0::2], rot[..., 1::2]
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    rotated = torch.stack([even * c + odd * s, odd * c - even * s], dim=-1).flatten(-2)
    return torch.cat([nope, rotated], dim=-1)


def sparse_attention_reference(q: Tensor, sink: Tensor, main: PagedRecords | None, topk_slots: Tensor | None,
                               swa: PagedRecords | None, window_slots: Tensor | None, cos: Tensor, sin: Tensor,
                               softmax_scale: float | None = None) -> Tensor:
    """Torch reference of :func:`sparse_attention` (float32 throughout, output in `q.dtype`)."""
    tokens, heads, dim = q.shape
    keys, valid = [], []
    parts: tuple[tuple[RecordKind, PagedRecords | None, Tensor | None], ...] = (
        ("main", main, topk_slots), ("swa", swa, window_slots))
    for kind, records, slots in parts:
        if records is None or slots is None or slots.shape[1] == 0:
            continue
        keys.append(read_records_reference(kind, records, slots.flatten()).view(tokens, slots.shape[1], dim))
        valid.append(slots >= 0)
    scale = dim**-0.5 if softmax_scale is None else softmax_scale
    sink_col = sink.float().view(1, heads, 1).expand(tokens, heads, 1)
    if not keys:
        return _rotate_back(torch.zeros(tokens, heads, dim, device=q.device), cos, sin).to(q.dtype)
    k = torch.cat(keys, dim=1)  # [N, L, D]
    logits = torch.einsum("nhd,nld->nhl", q.float(), k) * scale
    logits = logits.masked_fill(~torch.cat(valid, dim=1).unsqueeze(1), float("-inf"))
    probs = torch.softmax(torch.cat([logits, sink_col], dim=-1), dim=-1)[..., :-1]
    out = torch.einsum("nhl,nld->nhd", probs, k)
    return _rotate_back(out, cos, sin).to(q.dtype)


def _check_slots(slots: Tensor, tokens: int, what: str) -> None:
    check_tensor(slots, what, dtypes=_SLOT_DTYPES, dim=2)
    if slots.shape[0] != tokens:
        raise ValueError(f"{what}: expected {tokens} rows, got {slots.shape[0]}")


def _check_inputs(q: Tensor, sink: Tensor, main: PagedRecords | None, topk_slots: Tensor | None,
                  swa: PagedRecords | None, window_slots: Tensor | None, cos: Tensor, sin: Tensor) -> None:
    op = "sparse_attention"
    check_tensor(q, f"{op}: q", dtypes=(torch.bfloat16,), dim=3)
    tokens, heads, dim = q.shape
    half = dim // 2
    if dim % 32 or half & (half - 1):
        raise ValueError(f"{op}: head_dim must be 2 * a power of two and a multiple of 32, got {dim}")
    check_tensor(sink, f"{op}: sink", dtypes=(torch.float32, torch.bfloat16, torch.float16), dim=1)
    if sink.shape[0] != heads:
        raise ValueError(f"{op}: sink must be [{heads}], got {list(sink.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(t, f"{op}: {name}", dtypes=(torch.float32,), dim=2)
        if t.shape[0] != tokens or 2 * t.shape[1] > dim:
            raise ValueError(f"{op}: {name} must be [{tokens}, rope_dim / 2 <= {half}], got {list(t.shape)}")
    if cos.shape != sin.shape or cos.stride() != sin.stride():
        raise ValueError(f"{op}: cos and sin must have one shape and strides")
    for kind, records, slots in (("main", main, topk_slots), ("swa", swa, window_slots)):
        if (records is None) != (slots is None):
            raise ValueError(f"{op}: give both the {kind} records and their slots, or neither")
        if records is None or slots is None:
            continue
        _check_slots(slots, tokens, f"{op}: {kind} slots")
        expected = record_format(kind).record_bytes(dim)
        if records.record_bytes != expected:
            raise ValueError(f"{op}: {kind} records must be {expected} B at head_dim {dim}, got {records.record_bytes}")


def sparse_attention(q: Tensor, sink: Tensor, main: PagedRecords | None, topk_slots: Tensor | None,
                     swa: PagedRecords | None, window_slots: Tensor | None, cos: Tensor, sin: Tensor, *,
                     softmax_scale: float | None = None, out: Tensor | None = None,
                     config: AttentionConfig | None = None, impl: Impl = "auto",
                     row_offsets: Tensor | None = None, max_rows: int = 1) -> Tensor:
    """Attention of `q [N, H, D]` (bf16, RoPE applied) over each token's selected main-KV
    records and window records (module docstring). `topk_slots [N, K]`, `window_slots [N, W]`:
    int32/int64 slots of `main` / `swa` (-1 = none); either pair may be None (SWA-only layers have
    no main KV). `sink [H]`; `cos`/`sin` float32 `[N, rope_dim / 2]` of the query positions;
    `softmax_scale` defaults to `D ** -0.5`. Returns `out [N, H, D]` in `q.dtype`.

    `row_offsets` (int `[N]`, with `max_rows` > 1): rows come in runs of one sequence's consecutive
    positions (a DSpark verify's 1 + K rows), each row's place in its run (0 starts a run, at most
    `max_rows` rows a run), and each row's window list is the W ring slots ending at its own
    position (as the slot step's `window_slots` builds them). Then a run is one program of the
    grouped kernel (`_grouped_attention_kernel`: the run's windows decoded once, not once per row)
    where it applies (the Triton kernel, heads x run length at most 64 once each is padded to a power
    of two); the result is the same either way."""
    _check_inputs(q, sink, main, topk_slots, swa, window_slots, cos, sin)
    tokens, heads, dim = q.shape
    if row_offsets is not None:
        check_tensor(row_offsets, "sparse_attention: row_offsets", dtypes=_SLOT_DTYPES, dim=1)
        if row_offsets.shape[0] != tokens or row_offsets.device != q.device:
            raise ValueError(f"sparse_attention: row_offsets must be [{tokens}] on {q.device}")
        if max_rows < 1:
            raise ValueError(f"sparse_attention: max_rows must be >= 1, got {max_rows}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"sparse_attention: out must be {list(q.shape)} {q.dtype} with contiguous rows")
    tensors = [q, sink, cos, sin, out] + [t for t in (topk_slots, window_slots) if t is not None]
    tensors += [r.storage for r in (main, swa) if r is not None]
    if resolve_impl(impl, "sparse_attention", *tensors) == "torch":
        out.copy_(sparse_attention_reference(q, sink, main, topk_slots, swa, window_slots, cos, sin, softmax_scale))
        return out
    if tokens == 0:
        return out
    num_topk = 0 if topk_slots is None else topk_slots.shape[1]
    num_win = 0 if window_slots is None else window_slots.shape[1]
    main_rec = main if main is not None else swa
    swa_rec = swa if swa is not None else main
    if main_rec is None or swa_rec is None:  # no keys at all: every row is the sink alone
        out.copy_(sparse_attention_reference(q, sink, None, None, None, None, cos, sin, softmax_scale))
        return out
    # a missing slot list becomes one the kernel never reads (its count is 0), made only then:
    # every tensor made here is one more kernel in the call
    def no_slots() -> Tensor:
        return torch.full((tokens, 1), -1, dtype=torch.int32, device=q.device)

    launch = _Launch(q, sink, main_rec, topk_slots if topk_slots is not None else no_slots(), num_topk,
                     swa_rec, window_slots if window_slots is not None else no_slots(), num_win, cos, sin, out,
                     dim**-0.5 if softmax_scale is None else softmax_scale)
    config = config or AttentionConfig()
    keys = max(num_topk, num_win)
    grouped = next_power_of_2(heads) * next_power_of_2(max_rows) <= _GROUPED_MAX_ROWS
    if row_offsets is not None and max_rows > 1 and grouped and config.kernel != "gluon":
        launch.run_grouped(config, row_offsets, max_rows)
        return out
    if not config.auto:
        launch.run(config.resolve(tokens, heads, keys, q.device, dim, lists=(num_topk, num_win)))
        return out
    if gluon_hopper_available() and launch.gluon_unsupported() is None:
        # v20 is the default where it runs (H200: 37.2-37.7 us against 89.8 us at batch 64, runs 46-51)
        launch.run(replace(config, kernel="gluon").resolve(tokens, heads, keys, q.device, dim))
        return out
    from triton.runtime.errors import OutOfResources

    cfg = config.resolve(tokens, heads, keys, q.device, dim, lists=(num_topk, num_win))

    try:
        launch.run(cfg)
    except OutOfResources:  # the default tile did not fit this GPU: halve the head block
        launch.run(AttentionConfig(block_h=max(16, (cfg.block_h or 32) // 2), block_n=cfg.block_n,
                                   num_splits=cfg.num_splits, num_warps=4, num_stages=1, dv_split=cfg.dv_split,
                                   prefetch=False, hw_cvt=cfg.hw_cvt))
    return out


@dataclass(frozen=True)
class _Launch:
    """The tensors of one `sparse_attention` call, launched with a given config."""

    q: Tensor
    sink: Tensor
    main: PagedRecords
    topk: Tensor
    num_topk: int
    swa: PagedRecords
    win: Tensor
    num_win: int
    cos: Tensor
    sin: Tensor
    out: Tensor
    scale: float

    def gluon_unsupported(self) -> str | None:
        """Why the Gluon kernel cannot take this call, or None."""
        q = self.q
        if q.device.type != "cuda" or interpreting():
            return "it needs a CUDA device (the interpreter cannot run Gluon)"
        if torch.cuda.get_device_capability(q.device) != (9, 0):
            return f"it needs sm_90 (Hopper warpgroup MMAs), this GPU is sm_{''.join(map(str, torch.cuda.get_device_capability(q.device)))}"
        if q.shape[1] != 64 or q.shape[2] != 512:
            return f"it takes 64 heads x 512 channels, got {q.shape[1]} x {q.shape[2]}"
        if q.stride(2) != 1 or q.stride(1) % 8 or q.stride(0) % 8 or q.data_ptr() % 16:
            return "q must have 16-byte aligned rows of contiguous channels"
        if self.main.alignment < 16 or self.swa.alignment < 16:
            return "records must be 16-byte aligned"
        return None

    def run_gluon(self, cfg: AttentionConfig) -> None:
        from cedserve.kernels import _sparse_attention_gluon as g
        from cedserve.kernels import _sparse_attention_kernels as k

        why = self.gluon_unsupported()
        if why is not None:
            raise ValueError(f"sparse_attention: the gluon kernel cannot run here: {why}")
        q, out, main, swa = self.q, self.out, self.main, self.swa
        tokens, heads, dim = q.shape
        splits = cfg.num_splits or 1
        part_acc = torch.empty(tokens, splits, heads, dim, dtype=torch.float16, device=q.device)
        part_ml = torch.empty(tokens, splits, heads, 2, dtype=torch.float32, device=q.device)
        g._gl_sparse_attention_kernel[(tokens, splits)](
            q, q.stride(0), q.stride(1),
            main.storage, self.topk, self.topk.stride(0), self.num_topk,
            main.num_slots, main.offset_bytes, main.slots_per_block, main.slot_stride_bytes, main.block_stride_bytes,
            swa.storage, self.win, self.win.stride(0), self.num_win,
            swa.num_slots, swa.offset_bytes, swa.slots_per_block, swa.slot_stride_bytes, swa.block_stride_bytes,
            part_acc, part_ml, self.scale * math.log2(math.e),
            H=heads, D=dim, BLOCK_N=64, NUM_SPLITS=splits, MAIN_SPB_LOG2=log2_if_power_of_2(main.slots_per_block),
            SWA_SPB_LOG2=log2_if_power_of_2(swa.slots_per_block), num_warps=8,
        )
        merge_h = _merge_heads(splits, dim)
        k._combine_splits_kernel[(tokens, cdiv(heads, merge_h))](
            part_acc, part_ml, self.sink, self.cos, self.sin, self.cos.stride(0), out, out.stride(0),
            out.stride(1), heads,
            D=dim, ROPE_PAIRS=self.cos.shape[1], BLOCK_H=merge_h, NUM_SPLITS=splits, NORMALIZED=True, num_warps=4, **pdl_launch(part_acc.device),
        )

    def run_grouped(self, config: AttentionConfig, offsets: Tensor, max_rows: int) -> None:
        """`_grouped_attention_kernel` (see `sparse_attention`'s `row_offsets`): one program per
        (run, key split); programs of rows that do not start a run exit at once. Of `config` it
        takes `block_n`, `num_splits` and `num_warps`; the split count is chosen for the runs the
        rows would make if every run were `max_rows` long."""
        from cedserve.kernels import _sparse_attention_kernels as k

        q, main, swa = self.q, self.main, self.swa
        tokens, heads, dim = q.shape
        gpu = q.device.type == "cuda" and not interpreting()
        hp, rp = next_power_of_2(heads), next_power_of_2(max_rows)
        block_m = max(16, hp * rp)
        block_n = config.block_n or 64
        splits = config.num_splits
        if splits is None:
            tiles = cdiv(max_rows * self.num_topk, block_n) + cdiv(self.num_win + max_rows - 1, block_n)
            runs = max(1, tokens // max_rows)
            splits = max(1, min(tiles, num_sms(q.device) // runs)) if gpu else 1
        part_acc, part_ml = self._partials(splits)
        k._grouped_attention_kernel[(tokens, 1, splits)](
            q, q.stride(0), q.stride(1), self.sink, offsets, tokens,
            *self._keys_and_output(), part_acc, part_ml,
            heads, self.scale * math.log2(math.e),
            D=dim, ROPE_PAIRS=self.cos.shape[1], HP=hp, RP=rp, BLOCK_M=block_m, BLOCK_N=block_n,
            NUM_SPLITS=splits, HAS_MAIN=self.num_topk > 0, HAS_SWA=self.num_win > 0,
            MAIN_ALIGN=main.alignment, SWA_ALIGN=swa.alignment, HW_CVT=hardware_fp8(q.device),
            DOT_F32=interpreting(),
            num_warps=config.num_warps or (8 if block_m * dim >= 16384 else 4), num_stages=1 if not gpu else 2, **pdl_launch(q.device),
        )
        self._combine(part_acc, part_ml, splits, min(16, hp))

    def _partials(self, splits: int) -> tuple[Tensor, Tensor]:
        """Split-KV partials: fp32 accumulators `[N, splits, H, D]` and (max, sum) `[N, splits, H, 2]`
        (with one split the kernel writes the output directly: stand-ins)."""
        if splits == 1:
            return self.out, self.out
        tokens, heads, dim = self.q.shape
        return (torch.empty(tokens, splits, heads, dim, dtype=torch.float32, device=self.q.device),
                torch.empty(tokens, splits, heads, 2, dtype=torch.float32, device=self.q.device))

    def _keys_and_output(self) -> tuple[object, ...]:
        """The Triton kernels' arguments from the main records to the output's strides."""
        main, swa, out = self.main, self.swa, self.out
        return (main.storage, self.topk, self.topk.stride(0), self.num_topk,
                main.num_slots, main.offset_bytes, main.slots_per_block, main.slot_stride_bytes,
                main.block_stride_bytes,
                swa.storage, self.win, self.win.stride(0), self.num_win,
                swa.num_slots, swa.offset_bytes, swa.slots_per_block, swa.slot_stride_bytes, swa.block_stride_bytes,
                self.cos, self.sin, self.cos.stride(0),
                out, out.stride(0), out.stride(1))

    def _combine(self, part_acc: Tensor, part_ml: Tensor, splits: int, max_heads: int) -> None:
        """`_combine_splits_kernel` over the partials (nothing with one split)."""
        from cedserve.kernels import _sparse_attention_kernels as k

        if splits == 1:
            return
        tokens, heads, dim = self.q.shape
        combine_h = _merge_heads(splits, dim, max_heads)
        k._combine_splits_kernel[(tokens, cdiv(heads, combine_h))](
            part_acc, part_ml, self.sink, self.cos, self.sin, self.cos.stride(0), self.out, self.out.stride(0),
            self.out.stride(1), heads,
            D=dim, ROPE_PAIRS=self.cos.shape[1], BLOCK_H=combine_h, NUM_SPLITS=splits, num_warps=4, **pdl_launch(part_acc.device),
        )

    def run(self, cfg: AttentionConfig) -> None:
        from cedserve.kernels import _sparse_attention_kernels as k

        if cfg.kernel == "gluon":
            self.run_gluon(cfg)
            return
        assert cfg.block_h and cfg.block_n and cfg.num_splits and cfg.num_warps and cfg.num_stages
        q, main, swa = self.q, self.main, self.swa
        tokens, heads, dim = q.shape
        splits = cfg.num_splits
        part_acc, part_ml = self._partials(splits)  # per split: unnormalised accumulator and (max, sum)
        dv_split = cfg.dv_split or 1
        if dv_split not in (1, 2):
            raise ValueError(f"sparse_attention: dv_split must be 1 or 2, got {dv_split}")
        k._sparse_decode_attention_kernel[(tokens, cdiv(heads, cfg.block_h) * dv_split, splits)](
            q, q.stride(0), q.stride(1), self.sink,
            *self._keys_and_output(), part_acc, part_ml,
            heads, self.scale * math.log2(math.e),
            D=dim, ROPE_PAIRS=self.cos.shape[1], BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
            NUM_SPLITS=splits, DV_SPLIT=dv_split, HAS_MAIN=self.num_topk > 0, HAS_SWA=self.num_win > 0,
            MAIN_ALIGN=main.alignment, SWA_ALIGN=swa.alignment, HW_CVT=bool(cfg.hw_cvt), PREFETCH=bool(cfg.prefetch),
            DOT_F32=interpreting(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(q.device),
        )
        self._combine(part_acc, part_ml, splits, min(16, cfg.block_h))


def window_slots_for_chunk(positions: Tensor, window: int, ring_slot_of: Tensor, first_position: int) -> Tensor:
    """Window slot lists of a chunk of query `positions [S]` (absolute, increasing) when the SWA
    records of positions `[first_position, positions[-1]]` sit at slots `ring_slot_of [P]`
    (`ring_slot_of[p - first_position]`; e.g. a staging table holding the previous window and the
    chunk): int32 `[S, window]`, slot of position `p - window + 1 + j` (or -1 before
    `first_position` / position 0)."""
    offsets = torch.arange(window, device=positions.device) - (window - 1)
    wanted = positions.long().unsqueeze(-1) + offsets  # [S, window]
    index = wanted - first_position
    valid = (wanted >= 0) & (index >= 0) & (index < ring_slot_of.shape[0])
    slots = ring_slot_of.long()[index.clamp(0, max(ring_slot_of.shape[0] - 1, 0))]
    return torch.where(valid, slots, torch.full_like(slots, -1)).to(torch.int32)
