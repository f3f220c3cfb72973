"""Kernel benchmarks on one GPU: correctness at realistic shapes first, then time, bytes,
bandwidth against the HBM copy bandwidth measured in the same run, and FLOP rates.

    python benchmarks/kernels.py                        # H200: table + docs/benchmarks/kernels-h200.json
    python benchmarks/kernels.py --out /tmp/k.json
    TRITON_INTERPRET=1 python benchmarks/kernels.py --smoke --out /tmp/k.json   # CPU: tiny shapes, code paths only
    python benchmarks/kernels.py --sections correctness,moe --out /tmp/moe.json   # a subset (copy always runs)

Needs only torch and triton (the `cedserve.kernels` package is found through a symlink tree if the
project is not installed). Sections, each wrapped so one failure does not stop the others:

1. HBM copy bandwidth: `dst.copy_(src)` of 1 GiB, counted as bytes read + bytes written.
2. Correctness (PASS/FAIL) of every kernel at realistic shapes, fresh random inputs, poisoned
   outputs: record writers/readers bit-exact, the rest within the tolerances of tests/kernels.
3. Record writers / readers, compressor, index-key writer: >= 256 MiB of input; bytes = input read
   + records written (+ slot mapping); target >= 70 % of copy bandwidth.
4. Sparse decode attention, batch 64, top-512 + 128 window, 64 heads x 512: a small config sweep;
   bytes = records it must read + q + out + slot lists; FLOPs = 4 * H * keys * D per token; the
   split-KV rows (s2, s3: keys split over programs + a combine pass) beside the one-program rows;
   against torch SDPA over a dense bf16 cache of 4K..256K tokens (32K / 64K / 128K under --quick
   with --sdpa, or ATTN_SDPA=1 in the environment).
5. Indexer + attention per decode step, 4K..1M context (batch 64): Full sources scan every index
   key (block maxima), Reindex layers score inside the 16K-entry pool; the step model sums the
   released schedule (40 attention layers; index sources: layer 20 m=1 candidate source, layers
   2/8/14 m=2 Full, layers 24/28/32/36 Reindex).
6. MoE experts: decode (64 tokens x top-6) and prefill (4096 tokens) over 48 local experts at the
   released widths, FP4 Triton (W4A16) vs bf16 Triton vs torch grouped_mm.

Timing is triton.testing.do_bench's median (L2 flushed before every run).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _ensure_importable() -> None:
    """Make `cedserve.kernels` importable from a plain checkout (symlink tree like typecheck.sh)."""
    try:
        import cedserve.kernels  # noqa: F401
        return
    except ImportError:
        pass
    tree = REPO / "build" / "bench_pkg"
    pkg = tree / "cedserve"
    pkg.mkdir(parents=True, exist_ok=True)
    for src in [*(REPO / "cedserve").iterdir(), REPO / "kernels"]:
        link = pkg / src.name
        if not link.exists():
            link.symlink_to(src)
    sys.path.insert(0, str(tree))


_ensure_importable()

from cedserve.kernels import indexer as indexer_mod  # noqa: E402
from cedserve.kernels import records as rec_ops  # noqa: E402
from cedserve.kernels.compressor import (  # noqa: E402
    compress_error_bound,
    compress_reference,
    compress_write_main_kv,
    norm_rope_reference,
    norm_rope_write_index_key,
    rope_reference,
)
from cedserve.kernels.indexer import (  # noqa: E402
    IndexConfig,
    IndexKeys,
    index_scores,
    index_topk,
    index_topk_reference,
    topk_entries_triton,
)
from cedserve.kernels.moe import ExpertWeights, MoeConfig, moe_experts, moe_experts_reference  # noqa: E402
from cedserve.kernels.paged import PagedRecords  # noqa: E402
from cedserve.kernels.reference import fake_quant_fp4  # noqa: E402
from cedserve.kernels.sparse_attention import (  # noqa: E402
    AttentionConfig,
    sparse_attention,
    sparse_attention_reference,
)

# ---------------------------------------------------------------------------- plumbing


@dataclass
class Row:
    """One timed measurement."""

    kernel: str
    shape: str
    time_us: float
    bytes: int
    gbps: float
    frac_copy: float
    tflops: float | None = None
    config: str = ""
    note: str = ""


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


class Bench:
    def __init__(self, device: torch.device, smoke: bool, quick: bool = False, sdpa: bool = False) -> None:
        self.device = device
        self.smoke = smoke
        self.quick = quick
        self.sdpa = sdpa  # time dense SDPA even under --quick (32K..128K)
        self.rows: list[Row] = []
        self.checks: list[Check] = []
        self.errors: list[str] = []
        self.targets: list[dict[str, Any]] = []
        self.curves: dict[str, Any] = {}
        self.copy_gbps = float("nan")
        self.start = time.time()

    def time_s(self, fn: Callable[[], object]) -> float:
        """Median seconds of `fn` (do_bench on GPU; one timed call in smoke mode)."""
        if self.device.type == "cuda":
            import triton.testing

            ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
            return float(ms) / 1e3
        fn()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def record(self, kernel: str, shape: str, seconds: float, nbytes: int, flops: float | None = None,
               config: str = "", note: str = "") -> Row:
        gbps = nbytes / seconds / 1e9
        row = Row(kernel, shape, seconds * 1e6, nbytes, gbps, gbps / self.copy_gbps,
                  None if flops is None else flops / seconds / 1e12, config, note)
        self.rows.append(row)
        tf = f"{row.tflops:7.1f}" if row.tflops is not None else "      -"
        print(f"  {kernel:<28} {shape:<34} {row.time_us:10.1f} us {row.gbps:8.0f} GB/s {row.frac_copy:6.0%} "
              f"{tf} TF/s  {config} {note}", flush=True)
        return row

    def check(self, name: str, passed: bool, detail: str = "") -> None:
        self.checks.append(Check(name, bool(passed), detail))
        print(f"  [{'PASS' if passed else 'FAIL'}] {name} {detail}", flush=True)

    def target(self, name: str, value: float, goal: str, met: bool) -> None:
        self.targets.append({"target": name, "value": value, "goal": goal, "met": bool(met)})
        print(f"  target {name}: {value:.3g} (goal {goal}) -> {'MET' if met else 'NOT MET'}", flush=True)

    def gpu_state(self) -> str:
        """SM / memory clocks, power, temperature and utilisation now (nvidia-smi): the device is
        shared, and runs 9-10 moved the same kernel by up to 1.8x within one run."""
        if self.device.type != "cuda":
            return ""
        import subprocess

        try:
            return subprocess.run(
                ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,"
                 "clocks_throttle_reasons.active", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            return f"nvidia-smi: {exc}"

    def section(self, name: str, fn: Callable[[], None]) -> None:
        state = self.gpu_state()
        self.curves.setdefault("gpu_state", {})[name] = state
        print(f"\n== {name} ({time.time() - self.start:.0f} s){'  [' + state + ']' if state else ''}", flush=True)
        try:
            fn()
        except Exception as exc:  # report and go on: one broken section must not hide the others
            msg = f"{name}: {type(exc).__name__}: {exc}"
            self.errors.append(msg + "\n" + traceback.format_exc(limit=6))
            print(f"  ERROR {msg}", flush=True)
            traceback.print_exc(limit=6)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def late(self) -> bool:
        """Past the soft time budget: sections shrink their sweeps."""
        return time.time() - self.start > 240


def _pool(kind: rec_ops.RecordKind, dim: int, slots: int, entries: int, device: torch.device,
          fill: bool = False) -> PagedRecords:
    """A pool of 64-token-like blocks: a 16-aligned region of `entries` records after a 64-byte
    header (other regions' bytes), random bytes (valid-ish records when `fill`)."""
    rb = rec_ops.record_format(kind).record_bytes(dim)
    blocks = -(-slots // entries)
    pool = torch.randint(0, 256, (blocks, 64 + entries * rb + 64), dtype=torch.uint8, device=device)
    region = PagedRecords.region(pool, 64, entries, rb)
    if fill:  # scale bytes in a sane range so decoded values are finite and moderate
        view = region.storage.view(blocks, -1)[:, 64 : 64 + entries * rb].view(blocks, entries, rb)
        code_bytes = dim * rec_ops.record_format(kind).elem_bits // 8
        view[..., code_bytes:] = {"main": 0x38, "index": 125, "swa": 127}[kind]
        if kind == "swa":
            view[..., :code_bytes] &= 0xB7  # keep E4M3 bytes finite and moderate
    return region


def _block_slots(tokens: int, entries: int, num_blocks: int, device: torch.device) -> torch.Tensor:
    """Slots of consecutive tokens placed in randomly chosen blocks (what a prefill writes)."""
    blocks = torch.randperm(num_blocks, device=device)[: -(-tokens // entries)]
    t = torch.arange(tokens, device=device)
    return blocks[t // entries] * entries + t % entries


# ---------------------------------------------------------------------------- sections


def _index_queries(tokens: int, dev: torch.device) -> torch.Tensor:
    """Indexer queries as the model passes them: FP4 (E2M1, a UE8M0 scale per 32 channels) in bf16."""
    queries: torch.Tensor = fake_quant_fp4(torch.randn(tokens, 32, 128, device=dev), 32, "ue8m0").bfloat16()
    return queries


def copy_bandwidth(b: Bench) -> None:
    n = (8 if b.smoke else 1024) * MiB
    src = torch.empty(n, dtype=torch.uint8, device=b.device).random_(0, 255)
    dst = torch.empty_like(src)
    seconds = b.time_s(lambda: dst.copy_(src))
    b.copy_gbps = 2 * n / seconds / 1e9
    print(f"  copy {n // MiB} MiB: {seconds * 1e6:.0f} us, {b.copy_gbps:.0f} GB/s (read + write)")


def correctness(b: Bench) -> None:
    dev, smoke = b.device, b.smoke
    # record writers and readers: bit-exact against the reference
    for kind, dim in (("main", 512), ("index", 128), ("swa", 512)):
        tokens = 64 if smoke else 65536
        x = torch.randn(tokens, dim, device=dev) * torch.exp2(torch.randint(-20, 20, (tokens, 1), device=dev).float())
        x = x.bfloat16()
        dest = _pool(kind, dim, 2 * tokens, 32, dev)
        twin = PagedRecords(dest.storage.clone(), dest.record_bytes, dest.slots_per_block, dest.slot_stride_bytes,
                            dest.block_stride_bytes, dest.offset_bytes)
        slots = torch.randperm(dest.num_slots, device=dev)[:tokens]
        slots[::7] = -1
        rec_ops.write_records(kind, x, slots, dest, impl="triton")
        rec_ops.write_records_reference(kind, x, slots, twin)
        bad = int((dest.storage != twin.storage).sum())
        b.check(f"write_records[{kind}] {tokens}x{dim}", bad == 0, f"{bad} bytes differ")
        if kind != "swa":  # v5 (prefetching tiles, approximate reciprocal for main): same bytes
            fresh = PagedRecords(dest.storage.clone(), dest.record_bytes, dest.slots_per_block,
                                 dest.slot_stride_bytes, dest.block_stride_bytes, dest.offset_bytes)
            fresh.storage.random_(0, 256)
            rec_ops.write_records(kind, x, slots, fresh, version=5, impl="triton")
            written = slots >= 0
            same = torch.equal(fresh.gather(slots[written]), twin.gather(slots[written]))
            b.check(f"write_records[{kind}] v5 {tokens}x{dim}", same, "bit-exact" if same else "records differ")
        out = torch.full((tokens, dim), float("nan"), device=dev)
        rec_ops.read_records(kind, dest, slots, out=out, impl="triton")
        want = rec_ops.read_records_reference(kind, twin, slots)
        same = torch.equal(out.view(torch.int32), want.view(torch.int32))
        b.check(f"read_records[{kind}] {tokens}x{dim}", same, "bit-exact" if same else "mismatch")

    # sparse attention, released decode shape
    n, heads, dim, topk, window = (4, 16, 512, 32, 16) if smoke else (64, 64, 512, 512, 128)
    main = _pool("main", dim, n * topk * 2, 32, dev, fill=True)
    swa = _pool("swa", dim, n * window * 2, 128, dev, fill=True)
    topk_slots = torch.stack([torch.randperm(main.num_slots, device=dev)[:topk] for _ in range(n)]).int()
    win_slots = torch.stack([torch.randperm(swa.num_slots, device=dev)[:window] for _ in range(n)]).int()
    topk_slots[1, topk // 3 :] = -1
    win_slots[2, window // 2 :] = -1
    q = (torch.randn(n, heads, dim, device=dev) * 0.05).bfloat16()
    sink = torch.randn(heads, device=dev)
    ang = torch.rand(n, 32, device=dev) * 20
    cos, sin = ang.cos(), ang.sin()
    out = torch.full_like(q, float("nan"))
    sparse_attention(q, sink, main, topk_slots, swa, win_slots, cos, sin, out=out, impl="triton")
    ref = sparse_attention_reference(q, sink, main, topk_slots, swa, win_slots, cos, sin)
    err = (out.float() - ref.float()).abs()
    ok = bool((err <= 2e-2 * ref.float().abs().max() + 1e-2 * ref.float().abs()).all()) and not out.isnan().any()
    b.check(f"sparse_attention {n}x{heads}x{dim} top{topk}+{window}", ok, f"max err {err.max().item():.3g}")

    # compressor (m = 2) and index-key writer
    groups = 64 if smoke else 16384
    kv = torch.randn(2 * groups, 512, device=dev)
    gate = torch.randn(2 * groups, 512, device=dev)
    weight = (1 + 0.2 * torch.randn(512, device=dev)).bfloat16()
    ang = torch.rand(groups, 32, device=dev) * 50
    dest = _pool("main", 512, groups, 32, dev)
    twin = PagedRecords(dest.storage.clone(), dest.record_bytes, dest.slots_per_block, dest.slot_stride_bytes,
                        dest.block_stride_bytes, dest.offset_bytes)
    slots = torch.randperm(dest.num_slots, device=dev)[:groups]
    latent = compress_write_main_kv(kv, gate, weight, 1e-20, ang.cos(), ang.sin(), slots, dest, ratio=2,
                                    impl="triton")
    ref_latent, rotated = compress_reference(kv, gate, weight, 1e-20, ang.cos(), ang.sin(), 2, torch.bfloat16)
    # latent: within the float64-derived bound (compress_error_bound), as the fp32 reference is
    exact, bound = compress_error_bound(kv, gate, weight, 1e-20, 2, torch.bfloat16)
    lat_err = float(((latent.double() - exact).abs() / bound).max())
    ref_err = float(((ref_latent.double() - exact).abs() / bound).max())
    ulps = (latent.float() - ref_latent.float()).abs() / ref_latent.float().abs().clamp_min(1e-30) * 128
    # records: bit for bit those of the kernel's own latent
    own = PagedRecords(dest.storage.clone(), dest.record_bytes, dest.slots_per_block, dest.slot_stride_bytes,
                       dest.block_stride_bytes, dest.offset_bytes)
    rec_ops.write_records_reference("main", rope_reference(latent, ang.cos(), ang.sin()), slots, own)
    bad = int((own.storage != dest.storage).sum())
    rec_ops.write_records_reference("main", rotated, slots, twin)
    differ = (rec_ops.read_records_reference("main", dest, slots) != rec_ops.read_records_reference("main", twin, slots))
    frac = differ.float().mean().item()
    b.check(f"compress_write_main_kv m=2 {groups}x512", lat_err <= 1 and bad == 0 and frac <= 5e-3,
            f"latent err {lat_err:.2f} x bound (fp32 reference {ref_err:.2f}), {int((latent != ref_latent).sum())} "
            f"latent values differ from the reference (max ~{float(ulps.max()):.1f} ulp); records of own latent: "
            f"{bad} bytes differ; vs reference records {frac:.2e} of values differ")
    k = (torch.randn(groups, 128, device=dev) * 4).bfloat16()
    kdest = _pool("index", 128, groups, 64, dev)
    ktwin = PagedRecords(kdest.storage.clone(), kdest.record_bytes, kdest.slots_per_block, kdest.slot_stride_bytes,
                         kdest.block_stride_bytes, kdest.offset_bytes)
    kslots = torch.randperm(kdest.num_slots, device=dev)[:groups]
    norm_rope_write_index_key(k, weight[:128], 1e-20, ang.cos(), ang.sin(), kslots, kdest, impl="triton")
    rec_ops.write_records_reference("index", norm_rope_reference(k, weight[:128], 1e-20, ang.cos(), ang.sin()),
                                    kslots, ktwin)
    differ = (rec_ops.read_records_reference("index", kdest, kslots)
              != rec_ops.read_records_reference("index", ktwin, kslots))
    b.check(f"norm_rope_write_index_key {groups}x128", differ.float().mean().item() <= 5e-3,
            f"{differ.float().mean().item():.2e} of record values differ")

    # indexer: scores and the two-level top-k
    tokens, width = (4, 512) if smoke else (16, 32768)
    entries = 64
    idx = _pool("index", 128, tokens * width, entries, dev, fill=True)
    per_req = -(-width // entries)
    table = torch.randperm(idx.num_blocks, device=dev)[: tokens * per_req].view(tokens, per_req).int()
    visible = torch.randint(width // 2, width + 1, (tokens,), device=dev).int()
    keys = IndexKeys(idx, table, torch.arange(tokens, device=dev).int(), visible)
    qi = _index_queries(tokens, dev)
    wi = torch.randn(tokens, 32, device=dev) * 32**-0.5
    sel = index_topk(qi, wi, keys, topk=512, width=width, candidate_blocks=2048 if not smoke else 16,
                     impl="triton")
    ref_sel, dense = index_topk_reference(qi, wi, keys, topk=512, width=width,
                                          candidate_blocks=2048 if not smoke else 16)
    ok = True
    for t in range(tokens):
        mine = sel.entries[t][sel.entries[t] >= 0].long()
        theirs = ref_sel.entries[t][ref_sel.entries[t] >= 0].long()
        kth = dense[t, theirs].min()
        ok &= mine.numel() == theirs.numel() and bool((dense[t, mine] >= kth - 1e-5 * (1 + kth.abs())).all())
    scores, _ = index_scores(qi, wi, keys, width=width, impl="triton")
    assert scores is not None
    finite = dense.isfinite()
    score_ok = torch.equal(scores.isneginf(), dense.isneginf()) and bool(
        ((scores[finite] - dense[finite]).abs() <= 1e-5 * (1 + dense[finite].abs())).all())
    b.check(f"index_topk {tokens} tokens x {width} entries", ok and score_ok,
            f"selection {'ok' if ok else 'OFF'}, scores {'ok' if score_ok else 'OFF'}")

    # MoE, FP4 weights at the released widths
    experts, hidden, inter, tokens = (4, 256, 128, 16) if smoke else (8, 5120, 2304, 256)
    x = torch.randn(tokens, hidden, device=dev).bfloat16()
    ids = torch.rand(tokens, experts, device=dev).topk(min(6, experts), dim=-1).indices
    rw = torch.rand(tokens, ids.shape[1], device=dev)
    w13, w2 = _fp4_experts(experts, 2 * inter, hidden, dev), _fp4_experts(experts, hidden, inter, dev)
    got = moe_experts(x, ids, rw, w13, w2, swiglu_limit=10.0, impl="triton")
    want = moe_experts_reference(x, ids, rw, w13, w2, swiglu_limit=10.0)
    err = (got.float() - want.float()).abs()
    ok = bool((err <= 1e-2 * want.float().abs().max() + 1e-2 * want.float().abs()).all())
    b.check(f"moe_experts fp4 {tokens}x{hidden} E={experts}", ok, f"max err {err.max().item():.3g}")


def _fp4_experts(experts: int, out: int, inp: int, device: torch.device) -> ExpertWeights:
    """Random FP4 expert weights in the checkpoint layout (codes and UE8M0 scales ~ 1/sqrt(in))."""
    codes = torch.randint(0, 256, (experts, out, inp // 2), dtype=torch.uint8, device=device)
    exp = 127 + round(math.log2(inp**-0.5 / 3))
    scales = torch.full((experts, out, inp // 32), exp, dtype=torch.uint8, device=device)
    return ExpertWeights(codes, scales)


def _bench_records(b: Bench, kind: rec_ops.RecordKind, dim: int) -> None:
    dev = b.device
    tokens = (2 * 1024 if b.smoke else 256 * MiB) // (2 * dim)  # >= 256 MiB of bf16 input
    record_bytes = rec_ops.record_format(kind).record_bytes(dim)
    entries = 64  # records per block region (64-token blocks; m = 1)
    dest = _pool(kind, dim, tokens, entries, dev)
    x = torch.randn(tokens, dim, device=dev).bfloat16()
    slots = _block_slots(tokens, entries, dest.num_blocks, dev)
    moved = tokens * (2 * dim + record_bytes + 8)
    # launch configs (rows per program, warps, 32-bit word stores, version): the launcher's default
    # first (v5 for main since run 5, v4 for SWA, v13 for the index keys on sm_90, else v3), then the
    # other versions of the E2M1 kinds
    gluon_ok = dev.type == "cuda" and torch.cuda.get_device_capability(dev) == (9, 0)
    default_version = {"main": 5, "index": 13 if gluon_ok else 3}.get(kind, 4)
    # v5 (E2M1 kinds): `_write_words_v5_kernel` at its defaults and a tiles / rows sweep (tiles last)
    sweep: list[tuple[int | None, int | None, bool | None, int, int | None]] = [
        (None, None, None, default_version, None)]
    if kind != "swa":
        sweep += [(None, None, None, v, None) for v in (3, 4, 5) if v != default_version]
    if not b.smoke:
        extra: dict[str, list[tuple[int | None, int | None, bool | None, int, int | None]]] = {
            "main": [(4, 4, True, 4, None), (8, 4, None, 5, 2), (8, 4, None, 5, 8), (4, 4, None, 5, 8)],
            "index": [(32, 4, True, 4, None), (32, 4, None, 5, 2), (32, 4, None, 5, 8), (64, 4, None, 5, 4)],
            "swa": [(16, 4, False, 4, None)]}
        sweep += extra[kind]
    if kind == "index" and gluon_ok:  # v13, the Gluon writer (16 lanes per row): rows / tiles / warps
        sweep += [(16, 4, None, 13, 4), (64, 4, None, 13, 4), (64, 4, None, 13, 2),
                  (32, 4, None, 13, 8), (32, 4, None, 13, 2), (32, 8, None, 13, 4), (64, 8, None, 13, 4)]
    best: Row | None = None
    for block_t, warps, words, version, tiles in sweep:
        try:
            t = b.time_s(partial(rec_ops.write_records, kind, x, slots, dest, block_t=block_t, num_warps=warps,
                                 word_stores=words, version=version, tiles=tiles, impl="triton"))
        except Exception as exc:  # a failing variant is reported, the default's failure is fatal
            if best is None:
                raise
            print(f"  write_records[{kind}] v{version} t{block_t}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        label = "default" if block_t is None else f"t{block_t} w{warps} {'words' if words in (True, None) else 'bytes'}"
        label += f" x{tiles}" if tiles else ""
        row = b.record(f"write_records[{kind}]", f"{tokens}x{dim} bf16 -> {record_bytes} B", t, moved,
                       config=f"{label} v{version}")
        if best is None:
            b.target(f"write_records[{kind}] >= 70% copy (default launch)", row.frac_copy, ">= 0.70",
                     row.frac_copy >= 0.70)
        if best is None or row.time_us < best.time_us:
            best = row
    assert best is not None
    b.curves[f"write_records_{kind}_best"] = asdict(best)
    if b.quick:
        return
    out = torch.empty(tokens, dim, dtype=torch.bfloat16, device=dev)
    t = b.time_s(lambda: rec_ops.read_records(kind, dest, slots, out=out, impl="triton"))
    b.record(f"read_records[{kind}]", f"{tokens}x{dim} -> bf16", t, moved)


def record_writers(b: Bench) -> None:
    dev = b.device
    _bench_records(b, "main", 512)
    _bench_records(b, "index", 128)
    _bench_records(b, "swa", 512)
    # fused compressor (m = 2: two fp32 projections per group) and the index-key writer
    groups = (64 if b.smoke else 256 * MiB // (2 * 2 * 512 * 4))
    kv = torch.randn(2 * groups, 512, device=dev)
    gate = torch.randn(2 * groups, 512, device=dev)
    weight = torch.ones(512, device=dev).bfloat16()
    ang = torch.rand(groups, 32, device=dev)
    cos, sin = ang.cos(), ang.sin()
    dest = _pool("main", 512, groups, 32, dev)
    slots = _block_slots(groups, 32, dest.num_blocks, dev)
    latent = torch.empty(groups, 512, dtype=torch.bfloat16, device=dev)
    moved = groups * (2 * 2 * 512 * 4 + 32 * 4 * 2 + 288 + 512 * 2 + 8)
    t = b.time_s(lambda: compress_write_main_kv(kv, gate, weight, 1e-20, cos, sin, slots, dest, ratio=2,
                                                latent_out=latent, impl="triton"))
    b.record("compress_write_main_kv m=2", f"{groups} groups x 512 fp32", t, moved)
    k = torch.randn(groups, 128, device=dev).bfloat16()
    kdest = _pool("index", 128, groups, 64, dev)
    kslots = _block_slots(groups, 64, kdest.num_blocks, dev)
    t = b.time_s(lambda: norm_rope_write_index_key(k, weight[:128], 1e-20, cos, sin, kslots, kdest, impl="triton"))
    b.record("norm_rope_write_index_key", f"{groups} x 128 bf16", t, groups * (256 + 256 + 68 + 8))


@dataclass
class AttentionProblem:
    """Decode attention inputs: batch `n`, the released 64 heads x 512 with top-512 + a 128-token
    window (tiny shapes in smoke mode), records in a 1M-entry main pool and a window ring."""

    main: PagedRecords
    swa: PagedRecords
    topk_slots: torch.Tensor
    win_slots: torch.Tensor
    q: torch.Tensor
    sink: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def make(cls, dev: torch.device, smoke: bool = False) -> AttentionProblem:
        n, heads, dim, topk, window = (4, 16, 512, 32, 16) if smoke else (64, 64, 512, 512, 128)
        main = _pool("main", dim, 1 << (10 if smoke else 20), 32, dev, fill=True)  # 1M entries: 302 MB
        swa = _pool("swa", dim, n * window, window, dev, fill=True)
        topk_slots = torch.randint(0, main.num_slots, (n, topk), device=dev).int()
        win_slots = (torch.arange(n, device=dev).unsqueeze(1) * window + torch.arange(window, device=dev)).int()
        ang = torch.rand(n, 32, device=dev)
        return cls(main, swa, topk_slots, win_slots, (torch.randn(n, heads, dim, device=dev) * 0.05).bfloat16(),
                   torch.randn(heads, device=dev), ang.cos(), ang.sin())

    def first(self, n: int) -> AttentionProblem:
        """The same problem for its first `n` tokens (1 <= n <= its batch)."""
        n = max(1, min(n, self.q.shape[0]))
        return AttentionProblem(self.main, self.swa, self.topk_slots[:n], self.win_slots[:n], self.q[:n], self.sink,
                                self.cos[:n], self.sin[:n])

    def layers(self, count: int) -> list[AttentionProblem]:
        """`count` problems like this one, as the layers of one decode step: fresh top-k slots in
        the shared 1M-entry main pool (random records, far more than L2 holds) and a window ring
        each, so that no layer reads what another left in L2."""
        out = []
        n, (topk, window) = self.q.shape[0], (self.topk_slots.shape[1], self.win_slots.shape[1])
        dev = self.q.device
        for _ in range(count):
            swa = _pool("swa", self.q.shape[2], n * window, window, dev, fill=True)
            slots = torch.randint(0, self.main.num_slots, (n, topk), device=dev).int()
            out.append(AttentionProblem(self.main, swa, slots, self.win_slots, self.q, self.sink, self.cos, self.sin))
        return out

    def call(self, out: torch.Tensor, config: AttentionConfig | None) -> Callable[[], object]:
        """`sparse_attention` over this problem into `out` with `config` (None: the default), as
        a no-argument call."""
        return partial(sparse_attention, self.q, self.sink, self.main, self.topk_slots, self.swa, self.win_slots,
                       self.cos, self.sin, out=out, config=config, impl="triton")


def profiling_device() -> torch.device | None:
    """The CUDA device a profiling script runs on (torch seeded), or None after saying why not."""
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return None
    torch.manual_seed(0)
    return torch.device("cuda")


def step_index_inputs(n: int, max_ctx: int, dev: torch.device
                      ) -> tuple[PagedRecords, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index keys for `n` requests of `max_ctx` entries each (blocks of 64, m = 1, every request's
    own blocks), their block table, the tokens' queries and head weights: `step_index_calls`' inputs."""
    entries = 64
    per_req = max_ctx // entries
    idx = _pool("index", 128, n * max_ctx, entries, dev, fill=True)
    table = torch.arange(n * per_req, device=dev).view(n, per_req).int()
    return idx, table, _index_queries(n, dev), torch.randn(n, 32, device=dev) * 32**-0.5


TRITON = AttentionConfig(kernel="triton")  # the Triton kernel's defaults (AttentionConfig() picks Gluon on sm_90)


def _triton(block_h: int, block_n: int, splits: int, warps: int, stages: int, dv_split: int, prefetch: bool,
            hw_cvt: bool | None = None) -> AttentionConfig:
    return AttentionConfig(block_h=block_h, block_n=block_n, num_splits=splits, num_warps=warps, num_stages=stages,
                           dv_split=dv_split, prefetch=prefetch, hw_cvt=hw_cvt, kernel="triton")


def decode_attention(b: Bench) -> None:
    dev = b.device
    prob = AttentionProblem.make(dev, b.smoke)
    main, swa, topk_slots, win_slots = prob.main, prob.swa, prob.topk_slots, prob.win_slots
    q, sink, cos, sin = prob.q, prob.sink, prob.cos, prob.sin
    (n, heads, dim), topk, window = q.shape, topk_slots.shape[1], win_slots.shape[1]
    out = torch.empty_like(q)
    keys = topk + window
    must_read = n * (topk * 288 + window * 528) + 2 * q.numel() * 2 + n * keys * 4
    flops = 4.0 * n * heads * keys * dim
    configs = [TRITON]
    if not b.smoke:  # (block_h, block_n, splits, warps, stages, dv_split, prefetch[, hw_cvt])
        configs += [_triton(*c) for c in (
            (64, 32, 1, 8, 1, 2, False), (64, 32, 1, 8, 3, 2, False), (64, 32, 1, 8, 1, 2, True),
            (64, 64, 1, 8, 2, 2, False), (64, 16, 1, 8, 3, 2, False), (64, 32, 2, 8, 2, 2, False),
            (64, 32, 1, 8, 2, 2, False, False),
            # v6 split-KV rows (kernels-notes.md "v6"): keys split in 2 with whole value rows (no
            # logits computed twice), st1 / st2; split in 3 (two waves); the default split in 2 (two
            # waves of one program per SM); value halves at 4 warps (two programs per SM)
            (64, 32, 2, 8, 1, 1, False), (64, 32, 2, 8, 2, 1, False), (64, 32, 3, 8, 1, 1, False),
            (64, 64, 2, 8, 2, 2, False), (64, 32, 2, 4, 1, 2, False))]
    if dev.type == "cuda":  # v20, the Gluon kernel (Hopper only; elsewhere its row reports why not)
        configs += [AttentionConfig(kernel="gluon", num_splits=s) for s in (None, 1, 3, 4)]
    ref = sparse_attention_reference(q, sink, main, topk_slots, swa, win_slots, cos, sin).float()
    bound = 2e-2 * ref.abs().max() + 1e-2 * ref.abs()
    best: Row | None = None
    for cfg in configs:
        if b.late and best is not None:
            break
        resolved = cfg.resolve(n, heads, topk, dev, dim)
        label = (f"h{resolved.block_h} n{resolved.block_n} s{resolved.num_splits} w{resolved.num_warps} "
                 f"st{resolved.num_stages} dv{resolved.dv_split} pf{int(bool(resolved.prefetch))}"
                 f"{'' if resolved.hw_cvt else ' alu'}")
        if resolved.kernel == "gluon":
            label = f"gluon v20 h64 n64 s{resolved.num_splits} w8"
        call = partial(sparse_attention, q, sink, main, topk_slots, swa, win_slots, cos, sin, out=out, config=cfg,
                       impl="triton")
        try:
            out.fill_(float("nan"))
            call()
            ok = bool(((out.float() - ref).abs() <= bound).all())
            t = b.time_s(call)
            # GPU time alone: do_bench also counts the host's launch work (checks, allocations, one
            # or two Triton launches: tens of us) where it outlasts the previous GPU work
            t_graph = _graph_time_s(b, [call], label)
        except Exception as exc:
            print(f"  config {label} failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        note = "" if ok else "WRONG OUTPUT"
        splits = resolved.num_splits or 1
        if splits > 1:
            programs = n * -(-heads // (resolved.block_h or heads)) * (resolved.dv_split or 1) * splits
            note = f"split-KV: {programs} programs + combine {note}".rstrip()
        row = b.record("sparse_attention decode", f"{n}x{heads}x{dim} top{topk}+{window}", t, must_read, flops,
                       label, note)
        if math.isfinite(t_graph):
            row = b.record("sparse_attention decode (graph)", f"{n}x{heads}x{dim} top{topk}+{window}", t_graph,
                           must_read, flops, label, "one call as a CUDA graph replay: GPU time")
        if not ok:
            b.check(f"sparse_attention config {label}", False, "output outside tolerance")
            continue
        if best is None or row.time_us < best.time_us:
            best = row
    if best is None:
        raise RuntimeError("no attention config ran")
    if not b.smoke:  # single rows moved by up to 2x between runs (runs 6-9): interleave the rivals 4
        # times in one run, as CUDA-graph replays (GPU time; do_bench where capture fails)
        repeats: dict[str, list[float]] = {}
        rivals = {"triton default": TRITON, "triton dv1 s2": _triton(64, 32, 2, 8, 1, 1, False)}
        if dev.type == "cuda" and torch.cuda.get_device_capability(dev) == (9, 0):
            # v20 (the default: direct bf16 decode, merge pass, early fill, fp16 partials); its
            # earlier variants were removed (docs/kernels.md)
            rivals["gluon v20 (default)"] = AttentionConfig(kernel="gluon")
        for _ in range(4):
            for name, cfg in rivals.items():
                call = partial(sparse_attention, q, sink, main, topk_slots, swa, win_slots, cos, sin, out=out,
                               config=cfg, impl="triton")
                try:
                    t = _graph_time_s(b, [call], name)
                    if not math.isfinite(t):
                        t = b.time_s(call)
                except Exception as exc:
                    print(f"  {name}: {type(exc).__name__}: {str(exc)[:160]}")
                    continue
                repeats.setdefault(name, []).append(t * 1e6)
        b.curves["attention_repeats_us"] = repeats
        print("  interleaved repeats (us, CUDA graph replays): " + "; ".join(f"{k} {', '.join(f'{v:.1f}' for v in vs)}"
                                                        for k, vs in repeats.items()))
    if dev.type == "cuda" and not b.smoke:  # small batches (decode latency): the defaults, GPU time
        small: dict[str, dict[str, float]] = {}
        for batch in (1, 8, 16):
            sub = prob.first(batch)
            out_b = out[:batch]
            for name, cfg in (("triton default", TRITON), ("gluon default", AttentionConfig(kernel="gluon")),
                              ("gluon s2", AttentionConfig(kernel="gluon", num_splits=2)),
                              # forced splits against the heuristic's
                              ("gluon s10", AttentionConfig(kernel="gluon", num_splits=10)),
                              ("gluon s5", AttentionConfig(kernel="gluon", num_splits=5))):
                try:
                    t = _graph_time_s(b, [sub.call(out_b, cfg)], f"{name} batch {batch}")
                except Exception as exc:
                    print(f"  {name} batch {batch}: {type(exc).__name__}: {str(exc)[:160]}")
                    continue
                if math.isfinite(t):
                    splits = cfg.resolve(batch, heads, topk, dev, dim).num_splits
                    b.record("sparse_attention decode (graph)", f"{batch}x{heads}x{dim} top{topk}+{window}", t,
                             must_read * batch // n, flops * batch / n, f"{name} s{splits}", "small batch")
                    small.setdefault(str(batch), {})[name] = t * 1e6
        b.curves["attention_small_batch_us"] = small
    b.curves["attention_best"] = asdict(best)
    b.target("sparse attention >= 50% copy on bytes read", best.frac_copy, ">= 0.50", best.frac_copy >= 0.5)
    roofline_us = flops / 989e12 * 1e6
    print(f"  note: {flops / 1e9:.1f} GFLOP per call -> {roofline_us:.1f} us at the 989 TFLOP/s bf16 dense peak, "
          f"vs {must_read / b.copy_gbps / 1e3:.1f} us for the bytes at copy bandwidth")
    if b.quick and not b.sdpa:
        return
    # dense torch SDPA over a bf16 cache of the same context. One shared K = V head: the 64 heads
    # are 64 queries of one head (FlashMLA's view of MQA decode), so nothing is expanded.
    import torch.nn.functional as F

    sdpa: dict[int, float] = {}
    qd = q.unsqueeze(1)  # [n, 1, heads, dim]
    if b.smoke:
        contexts = [256, 1024]
    elif b.quick:  # the "faster than SDPA from 32K" target only, ~5 s
        contexts = [32768, 65536, 131072]
    else:
        contexts = [4096, 16384, 32768, 65536, 131072, 262144]
    for ctx in contexts:
        if b.late and ctx > 65536:
            break
        try:
            kd = torch.randn(n, 1, ctx, dim, device=dev, dtype=torch.bfloat16)
            t = b.time_s(partial(F.scaled_dot_product_attention, qd, kd, kd))
            del kd
        except Exception as exc:
            print(f"  SDPA at {ctx}: {type(exc).__name__}: {str(exc)[:160]}")
            break
        sdpa[ctx] = t
        b.record("torch SDPA dense bf16", f"{n}x{heads}x{dim} ctx {ctx}", t, n * ctx * dim * 2,
                 4.0 * n * heads * ctx * dim)
    b.curves["sdpa_dense_us"] = {str(c): s * 1e6 for c, s in sdpa.items()}
    wins = [c for c, s in sdpa.items() if c >= 32768 and best.time_us < s * 1e6]
    longer = [c for c in sdpa if c >= 32768]
    if longer:
        b.target("sparse attention faster than dense SDPA from 32K", float(len(wins)), f"== {len(longer)} contexts",
                 len(wins) == len(longer))


def step_index_calls(idx: PagedRecords, table: torch.Tensor, qi: torch.Tensor, wi: torch.Tensor, batch: int, ctx: int,
                     pool_blocks: int, topk: int, config: IndexConfig | None = None
                     ) -> tuple[Callable[[], object], Callable[[], object], Callable[[], object], torch.Tensor]:
    """The index calls of one decode step for the first `batch` tokens (one request each) at
    context `ctx`: (candidate source at m = 1, Full source at m = 2, Reindex inside the pool, the
    pool). A step makes 1 + 3 + 4 of them (the released layer plan)."""
    dev = qi.device
    visible = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    seqs = torch.arange(batch, device=dev).int()
    keys_m1 = IndexKeys(idx, table[:batch], seqs, visible)
    keys_m2 = IndexKeys(idx, table[:batch], seqs, visible // 2)
    q, w = qi[:batch], wi[:batch]
    cand_call = partial(index_topk, q, w, keys_m1, topk=topk, width=ctx, candidate_blocks=pool_blocks, config=config,
                        impl="triton")
    full_call = partial(index_topk, q, w, keys_m2, topk=topk, width=ctx // 2, config=config, impl="triton")
    pool = cand_call().candidates
    assert pool is not None
    reindex_call = partial(index_topk, q, w, keys_m1, topk=topk, width=ctx, candidates=pool, config=config,
                           impl="triton")
    return cand_call, full_call, reindex_call, pool


def decode_step_curve(b: Bench) -> None:
    """Index sources + attention per decode step of batch 64 at 4K..1M tokens of context."""
    dev = b.device
    n = 4 if b.smoke else 64
    contexts = [1024, 4096] if b.smoke else ([4096, 65536, 1 << 20] if b.quick else [4096, 16384, 65536, 262144,
                                                                                       1 << 20])
    max_ctx = contexts[-1]
    idx, table, qi, wi = step_index_inputs(n, max_ctx, dev)  # m = 1 keys of every request
    attn_us = b.curves.get("attention_best", {}).get("time_us")
    pool_blocks, topk = (16, 32) if b.smoke else (2048, 512)
    # 40 attention layers, each over its own records (the whole-step graphs; GPU only)
    layers = AttentionProblem.make(dev).layers(40) if dev.type == "cuda" and not b.smoke else []
    # the default scan (the Gluon v14 on sm_90 since run 21) and the Triton default (v4 x32 with
    # the slot prefetch, run 12), for the full scans and the list scoring alike
    for label, cfg in (("", None), (" triton v4", IndexConfig(kernel="triton"))):
        steps: dict[str, dict[str, float]] = {}
        for ctx in contexts:
            if b.late and ctx > 65536:
                break
            cand_call, full_call, reindex_call, pool = step_index_calls(idx, table, qi, wi, n, ctx, pool_blocks, topk,
                                                                        cfg)
            cand, full2, reindex = b.time_s(cand_call), b.time_s(full_call), b.time_s(reindex_call)
            b.record(f"index_topk candidate (m=1){label}", f"{n} tok x ctx {ctx}", cand, n * ctx * 68,
                     4.0 * n * 32 * 128 * ctx)
            b.record(f"index_topk full (m=2){label}", f"{n} tok x ctx {ctx}", full2, n * ctx // 2 * 68)
            b.record(f"index_topk reindex (pool){label}", f"{n} tok x pool {pool.shape[1]}", reindex,
                     n * pool.shape[1] * 68)
            attn = (attn_us or 0.0) / 1e6
            step = 40 * attn + cand + 3 * full2 + 4 * reindex
            # the same 8 index calls as one CUDA graph (as a serving step would replay them): GPU
            # time without the host's launch gaps, which dominate the short contexts
            graph_s = _graph_time_s(b, [cand_call] + 3 * [full_call] + 4 * [reindex_call], f"ctx {ctx}{label}")
            # one Reindex layer's pool scoring alone, as a graph too: launched call by call it is
            # host-bound (run 26 read 163 -> 364 us and 174 -> 234 us for the same kernel)
            reindex_graph = _graph_time_s(b, [reindex_call], f"reindex ctx {ctx}{label}")
            # the whole step (index calls and 40 attention layers over their own records) as one graph
            whole = (_step_graph_us(b, layers, n, {"candidate": cand_call, "full": full_call, "reindex": reindex_call},
                                    f"step ctx {ctx}{label}") if layers and not label else float("nan"))
            steps[str(ctx)] = {"whole_step_graph_us": whole, "step_us": step * 1e6, "attention_layer_us": attn * 1e6,
                               "candidate_us": cand * 1e6, "full_m2_us": full2 * 1e6, "reindex_us": reindex * 1e6,
                               "reindex_graph_us": reindex_graph * 1e6,
                               "reuse_layer_us": attn * 1e6, "reindex_layer_us": (attn + reindex) * 1e6,
                               "reindex_layer_graph_us": (attn + reindex_graph) * 1e6,
                               "index_graph_us": graph_s * 1e6, "step_graph_us": (40 * attn + graph_s) * 1e6}
            print(f"  ctx {ctx:>8}{label}: decode step attention+indexer {step * 1e6:9.1f} us "
                  f"(40 x attn {attn * 1e6:.1f}, candidate {cand * 1e6:.1f}, 3 x full {full2 * 1e6:.1f}, "
                  f"4 x reindex {reindex * 1e6:.1f}); index calls as one CUDA graph {graph_s * 1e6:.1f} us -> step "
                  f"{(40 * attn + graph_s) * 1e6:.1f} us; one reindex as a graph {reindex_graph * 1e6:.1f} us; "
                  f"the whole step as one graph {whole:.1f} us", flush=True)
        b.curves["decode_step" + label.replace(" ", "_")] = steps
        first, last = str(contexts[0]), max(steps, key=int)
        if first in steps and last != first:
            ratio = steps[last]["step_us"] / steps[first]["step_us"]
            graph_ratio = steps[last]["step_graph_us"] / steps[first]["step_graph_us"]
            whole_ratio = steps[last]["whole_step_graph_us"] / steps[first]["whole_step_graph_us"]
            if math.isfinite(whole_ratio):  # the step's GPU time as a serving step replays it (from run 47)
                b.target(f"decode step (attention + index calls, one CUDA graph) at {last} / at {first}",
                         whole_ratio, "<= 1.5", whole_ratio <= 1.5)
                print(f"  (info) index calls as a graph + 40 x one cold attention layer, {last} / {first}{label}: "
                      f"{graph_ratio:.3g} (runs 26-45's target figure)", flush=True)
            elif math.isfinite(graph_ratio):  # launched call by call, the short contexts are host-bound
                # (run 22: ~5 ms of launch work at 4K flattered the ratio)
                b.target(f"decode step, index calls as a CUDA graph, at {last} / at {first}{label}", graph_ratio,
                         "<= 1.5", graph_ratio <= 1.5)
            if math.isfinite(graph_ratio):
                b.curves["decode_step_eager_ratio" + label.replace(" ", "_")] = ratio
                print(f"  (info) decode step launched call by call, {last} / {first}{label}: {ratio:.3g} "
                      "(host launch work included: not a GPU figure)", flush=True)
            else:
                b.target(f"decode step attention+indexer at {last} / at {first}{label}", ratio, "<= 1.5",
                         ratio <= 1.5)
            layer = steps[last]["reindex_layer_graph_us"] / steps[first]["reindex_layer_graph_us"]
            if not math.isfinite(layer):  # (no graphs off the GPU)
                layer = steps[last]["reindex_layer_us"] / steps[first]["reindex_layer_us"]
            b.target(f"per Reindex layer (attention + pool scoring) {last} / {first}{label}", layer, "<= 1.5",
                     layer <= 1.5)
    step_small_batches(b, idx, table, qi, wi, contexts, pool_blocks, topk, layers)
    index_scan_sweep(b, idx, table, qi, wi, max_ctx)


@contextlib.contextmanager
def _topk_settings(max_width: int | None = None, chunks: bool = True, radix_bits: int | None = None,
                   keys_per_thread: int | None = None, early_exit: bool | None = None,
                   blocks_from_pool: bool | None = None) -> Iterator[None]:
    """`topk_entries` with other dispatch settings for the duration (the benchmark's variants)."""
    saved = (indexer_mod.TOPK_KERNEL_MAX_WIDTH, indexer_mod.topk_chunk, indexer_mod.TOPK_RADIX_BITS,
             indexer_mod.TOPK_KEYS_PER_THREAD, indexer_mod.TOPK_EARLY_EXIT, indexer_mod.BLOCKS_FROM_POOL)
    if max_width is not None:
        indexer_mod.TOPK_KERNEL_MAX_WIDTH = max_width
    if not chunks:
        indexer_mod.topk_chunk = lambda width, k: 0  # type: ignore[assignment]
    if radix_bits is not None:
        indexer_mod.TOPK_RADIX_BITS = radix_bits
    if keys_per_thread is not None:
        indexer_mod.TOPK_KEYS_PER_THREAD = keys_per_thread
    if early_exit is not None:
        indexer_mod.TOPK_EARLY_EXIT = early_exit
    if blocks_from_pool is not None:
        indexer_mod.BLOCKS_FROM_POOL = blocks_from_pool
    try:
        yield
    finally:
        (indexer_mod.TOPK_KERNEL_MAX_WIDTH, indexer_mod.topk_chunk, indexer_mod.TOPK_RADIX_BITS,
         indexer_mod.TOPK_KEYS_PER_THREAD, indexer_mod.TOPK_EARLY_EXIT, indexer_mod.BLOCKS_FROM_POOL) = saved


TOPK_VARIANTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "": _topk_settings,
    "wide_block_select_": partial(_topk_settings, blocks_from_pool=False),
    "no_early_exit_": partial(_topk_settings, early_exit=False, blocks_from_pool=False),
    "run44_topk_": partial(_topk_settings, max_width=indexer_mod.TOPK_PROGRAM_MAX_WIDTH, chunks=False, radix_bits=8,
                           keys_per_thread=16, early_exit=False, blocks_from_pool=False),
    "torch_topk_": partial(_topk_settings, max_width=0, blocks_from_pool=False),
}
"""Step rows' top-k variants: the default; the candidate source's top-k blocks among all block
maxima (run 49's default); without the early exit either (run 46's); runs 43-44's (one program a
row up to 16K, 8-bit digits, 16 keys a thread, `torch.topk` beyond); `torch.topk` alone (with
the wide block select, as before)."""


def topk_sweep(b: Bench) -> None:
    """`topk_entries` at the decode step's shapes (rows x width, k), each call as a CUDA graph:
    `torch.topk`, the default, and the kernel with explicit part widths and radix digits."""
    dev = b.device
    shapes = [(2, 300, 16), (1, 3000, 64)] if b.smoke else [
        (1, 4096, 512), (64, 4096, 512), (1, 16384, 512), (8, 16384, 512), (64, 16384, 512), (1, 65536, 512),
        (1, 131072, 512), (1, 131072, 2048), (8, 131072, 512), (64, 65536, 512), (64, 131072, 2048)]
    chunks = [0, 64, 128] if b.smoke else [0, 2048, 4096, 8192]
    # (radix bits, keys a thread): run 45 swept these; --quick times the default against runs
    # 43-44's one program a row (8 bits, 16 keys a thread) and torch.topk
    digits = [(8, 16, False)] if b.smoke else [(8, 16, False), (8, 8, False), (8, 4, False), (5, 16, False),
                                              (5, 8, False), (5, 4, False), (5, 8, True)]
    if b.quick:  # runs 43-44's one program a row; the default's parts without the early exit
        chunks, digits = [0, 4096], [(8, 16, False), (5, 8, False)]
    table: dict[str, dict[str, float]] = {}
    for rows, width, k in shapes:
        scores = torch.randn(rows, width, device=dev)
        scores[:, width // 2 :: 3] = float("-inf")  # invisible entries, as the scans leave them
        shape = f"{rows} x {width}, k {k}"
        times: dict[str, float] = {}
        calls: dict[str, Callable[[], object]] = {
            "torch.topk": partial(torch.topk, scores, k, dim=-1, sorted=False),
            "default": partial(indexer_mod.topk_entries, scores, k)}
        for chunk in chunks:
            if (chunk and (chunk < 2 * k or chunk >= width)) or (not chunk and width > 16384):
                continue
            for bits, per_thread, early in digits:
                if b.quick and ((chunk and bits == 8) or (not chunk and bits == 5 and width > 4096)):
                    continue
                name = f"chunk {chunk or 'row'}, {bits}-bit, {per_thread}/thread" + (", early exit" if early else "")
                calls[name] = partial(topk_entries_triton, scores, k, chunk=chunk, radix_bits=bits,
                                      keys_per_thread=per_thread, early_exit=early)
        want = scores.topk(k, dim=-1).values.sort(-1).values
        for name, call in calls.items():
            if name != "torch.topk":
                ids = call()
                assert isinstance(ids, torch.Tensor)
                got = torch.where(ids >= 0, scores.gather(1, ids.long().clamp(min=0)), float("-inf")).sort(-1).values
                b.check(f"topk_entries {name} {shape}", torch.equal(got, want))
            t = _graph_time_s(b, [call], f"topk {name} {shape}") if dev.type == "cuda" else b.time_s(call)
            times[name] = t * 1e6
            b.record("topk_entries", shape, t, rows * width * 4, config=name)
        table[shape] = times
    b.curves["topk"] = table


STEP_PLAN = {2: "full", 8: "full", 14: "full", 20: "candidate", 24: "reindex", 28: "reindex", 32: "reindex",
             36: "reindex"}
"""The released layer plan's index sources (the other layers attend with their source's picks)."""


def _step_graph_us(b: Bench, layers: Sequence[AttentionProblem], batch: int,
                   index_calls: dict[str, Callable[[], object]], what: str) -> float:
    """GPU microseconds of one decode step's attention and index calls captured as one CUDA graph,
    in layer order: each index source's call, then every layer's attention over its own records
    (`layers`, cut to `batch` tokens). The L2 is flushed before each replay, not between layers."""
    out = torch.empty_like(layers[0].q[:batch])
    calls: list[Callable[[], object]] = []
    for layer, prob in enumerate(layers):
        if layer in STEP_PLAN:
            calls.append(index_calls[STEP_PLAN[layer]])
        calls.append(prob.first(batch).call(out, None))
    return _graph_time_s(b, calls, what) * 1e6


def step_small_batches(b: Bench, idx: PagedRecords, table: torch.Tensor, qi: torch.Tensor, wi: torch.Tensor,
                       contexts: Sequence[int], pool_blocks: int, topk: int,
                       layers: Sequence[AttentionProblem] = ()) -> None:
    """The decode step's curve at batches 1 and 8 (one request per token, the default kernels):
    the 8 index calls as one CUDA graph plus 40 attention layers at that batch (the small-batch
    attention rows). Long-context agents decode at small batches, where the attention's fixed
    cost per CTA, not the Full-layer scans, sets the step."""
    small = b.curves.get("attention_small_batch_us", {})
    dev = b.device
    if dev.type != "cuda" or b.smoke:
        return
    out: dict[str, dict[str, dict[str, float]]] = {}
    for batch in (1, 8):
        attn_us = small.get(str(batch), {}).get("gluon default") or small.get(str(batch), {}).get("triton default")
        if attn_us is None:
            continue
        steps: dict[str, dict[str, float]] = {}
        for ctx in contexts:
            if b.late and ctx > 65536:
                break
            row: dict[str, float] = {"attention_layer_us": attn_us}
            # the default top-k, runs 43-44's and torch.topk alone, side by side
            for label, patch in TOPK_VARIANTS.items():
                with patch():
                    cand_call, full_call, reindex_call, _ = step_index_calls(idx, table, qi, wi, batch, ctx,
                                                                             pool_blocks, topk)
                    graph_s = _graph_time_s(b, [cand_call] + 3 * [full_call] + 4 * [reindex_call],
                                            f"batch {batch} ctx {ctx} {label}")
                row[label + "index_graph_us"] = graph_s * 1e6
                row[label + "step_graph_us"] = 40 * attn_us + graph_s * 1e6
                if layers and not label:  # the whole step as one graph (attention over 40 layers' records)
                    row["whole_step_graph_us"] = _step_graph_us(
                        b, layers, batch, {"candidate": cand_call, "full": full_call, "reindex": reindex_call},
                        f"step batch {batch} ctx {ctx}")
                    print(f"  batch {batch} ctx {ctx:>8} whole step as one CUDA graph: "
                          f"{row['whole_step_graph_us']:.1f} us", flush=True)
                print(f"  batch {batch} ctx {ctx:>8} {label or 'default top-k':<18}: index calls as one CUDA graph "
                      f"{graph_s * 1e6:.1f} us + 40 x attention {attn_us:.1f} us -> step "
                      f"{40 * attn_us + graph_s * 1e6:.1f} us", flush=True)
            steps[str(ctx)] = row
        if len(steps) > 1:
            first, last = str(contexts[0]), max(steps, key=int)
            ratio = steps[last]["step_graph_us"] / steps[first]["step_graph_us"]
            print(f"  (info) decode step at batch {batch}, {last} / {first}: {ratio:.3g} (index graph + 40 x one "
                  "cold attention layer)", flush=True)
            steps["ratio"] = {"last_over_first": ratio}
            if "whole_step_graph_us" in steps[first]:
                whole = steps[last]["whole_step_graph_us"] / steps[first]["whole_step_graph_us"]
                steps["ratio"]["whole_step_last_over_first"] = whole
                print(f"  (info) decode step at batch {batch} as one CUDA graph, {last} / {first}: {whole:.3g}",
                      flush=True)
        out[str(batch)] = steps
    b.curves["decode_step_small_batch"] = out


def _graph_time_s(b: Bench, calls: Sequence[Callable[[], object]], what: str) -> float:
    """Seconds per replay of `calls` captured as one CUDA graph (NaN off the GPU or when capture fails)."""
    if b.device.type != "cuda":
        return float("nan")
    try:
        for c in calls:  # compile and warm outside the capture
            c()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        return b.time_s(graph.replay)
    except Exception as exc:  # a capture failure is reported, not fatal
        print(f"  {what}: CUDA graph capture failed: {type(exc).__name__}: {str(exc)[:160]}")
        return float("nan")


def index_scan_sweep(b: Bench, idx: PagedRecords, table: torch.Tensor, qi: torch.Tensor, wi: torch.Tensor,
                     max_ctx: int) -> None:
    """The Full-source scan alone (block maxima over every key) at the longest context: launch
    configs, and tokens that share a request (a prefill chunk / drafts: one key tile per group)."""
    dev = b.device
    n = qi.shape[0]
    ctx = max_ctx if b.smoke else min(max_ctx, 1 << 18)
    visible = torch.full((n,), ctx, device=dev, dtype=torch.int32)
    keys = IndexKeys(idx, table, torch.arange(n, device=dev).int(), visible)
    maxima = torch.empty(n, ctx // 8, device=dev)
    # the default (Gluon v14 on sm_90), the Triton v4 default (x32 tiles, slot prefetch: run 12), v3
    # and neighbours, timed in 3 interleaved rounds (runs 9-10 moved some rows by 2x between runs:
    # only side-by-side rounds compare)
    gluon = dev.type == "cuda" and torch.cuda.get_device_capability(dev) == (9, 0)
    configs = [IndexConfig(), IndexConfig(kernel="triton"), IndexConfig(version=3)] + ([] if b.smoke else [
        IndexConfig(tiles=16, kernel="triton")])
    if gluon and not b.smoke:
        configs += [IndexConfig(kernel="gluon", tiles=tiles, num_stages=stages)
                    for tiles, stages in ((16, 2), (64, 2), (32, 3), (32, 4))]
    rounds = 1 if b.smoke else 3
    repeats: dict[str, list[float]] = {}
    for rnd in range(rounds):
        for cfg in configs:
            t = b.time_s(partial(index_scores, qi, wi, keys, width=ctx, block_max=8, write_scores=False,
                                 maxima_out=maxima, config=cfg, impl="triton"))
            r = cfg.resolve(8)
            label = (f"v{r.version} t{r.block_t} x{r.tiles} w{r.num_warps} st{r.num_stages}"
                     + (f" pf{r.prefetch}" if r.prefetch else ""))
            if cfg.kernel == "gluon" or (cfg == IndexConfig() and gluon):
                label = f"gluon v14 t64 x{cfg.tiles or 32} st{cfg.num_stages or 2}"
            repeats.setdefault(label, []).append(t * 1e6)
            b.record("index scan (block maxima)", f"{n} tok x ctx {ctx}", t, n * ctx * 68, 2.0 * n * 32 * 128 * ctx,
                     label, f"round {rnd + 1}")
    b.curves["index_scan_rounds_us"] = repeats
    medians = sorted((sorted(v)[len(v) // 2], k) for k, v in repeats.items())
    print("  index scan medians of the rounds (us): " + "; ".join(f"{k} {m:.0f}" for m, k in medians))
    group = 4 if not b.smoke else 2
    grouped = IndexKeys(idx, table, torch.arange(n, device=dev).int() // group, visible)
    for cfg in (IndexConfig(), IndexConfig(tiles=16, prefetch=0)):  # (a group of tokens: Triton)
        t = b.time_s(partial(index_scores, qi, wi, grouped, width=ctx, block_max=8, write_scores=False,
                             maxima_out=maxima, tokens_per_request=group, config=cfg, impl="triton"))
        b.record("index scan (block maxima)", f"{n} tok ({group}/request) x ctx {ctx}", t, n // group * ctx * 68,
                 2.0 * n * 32 * 128 * ctx, f"tokens_per_request {group} v{cfg.resolve(8).version} "
                 f"x{cfg.resolve(8).tiles} pf{cfg.resolve(8).prefetch}")


def moe(b: Bench) -> None:
    dev = b.device
    experts, hidden, inter, top_k = (4, 256, 128, 2) if b.smoke else (48, 5120, 2304, 6)
    w13, w2 = _fp4_experts(experts, 2 * inter, hidden, dev), _fp4_experts(experts, hidden, inter, dev)
    bf13 = ExpertWeights(w13.dequantize(torch.bfloat16).contiguous())
    bf2 = ExpertWeights(w2.dequantize(torch.bfloat16).contiguous())
    for tokens in ([8, 64] if b.smoke else [64, 4096]):
        x = torch.randn(tokens, hidden, device=dev).bfloat16()
        ids = torch.rand(tokens, experts, device=dev).topk(top_k, dim=-1).indices
        rw = torch.rand(tokens, top_k, device=dev)
        active = len(set(ids.flatten().tolist()))
        flops = 2.0 * tokens * top_k * 3 * hidden * inter
        act_bytes = tokens * hidden * 2 * 2 + tokens * top_k * (hidden + inter) * 2 * 2
        fp4_bytes = active * (w13.nbytes + w2.nbytes) // experts + act_bytes
        bf_bytes = active * (bf13.nbytes + bf2.nbytes) // experts + act_bytes
        shape = f"{tokens} tok x top{top_k} / E={experts} ({active} active)"
        configs = [MoeConfig()] + ([] if b.smoke else [MoeConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=nw)
                                                       for bm, bn, bk, nw in ((16, 64, 256, 4), (16, 128, 128, 4),
                                                                              (64, 128, 64, 4), (128, 128, 64, 8))])
        for cfg in configs:
            if b.late and cfg is not configs[0]:
                break
            try:
                t = b.time_s(partial(moe_experts, x, ids, rw, w13, w2, swiglu_limit=10.0, config=cfg,
                                     impl="triton"))
            except Exception as exc:
                print(f"  moe config {cfg} failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            r = cfg.resolve(tokens * top_k, experts)
            b.record("moe_experts triton fp4", shape, t, fp4_bytes, flops,
                     f"m{r.block_m} n{r.block_n} k{r.block_k} w{r.num_warps} st{r.num_stages}")
        t = b.time_s(partial(moe_experts, x, ids, rw, bf13, bf2, swiglu_limit=10.0, impl="triton"))
        b.record("moe_experts triton bf16", shape, t, bf_bytes, flops)
        try:
            t = b.time_s(partial(moe_experts, x, ids, rw, bf13, bf2, swiglu_limit=10.0, impl="grouped_mm"))
            b.record("moe_experts torch grouped_mm", shape, t, bf_bytes, flops)
        except Exception as exc:
            print(f"  grouped_mm: {type(exc).__name__}: {str(exc)[:200]}")


# ---------------------------------------------------------------------------- main


def machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"host": platform.node(), "python": platform.python_version()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    else:
        info.update(gpu=None, note="CPU smoke run (Triton interpreter): timings are meaningless")
    return info


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "docs" / "benchmarks" / "kernels-h200.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--quick", action="store_true",
                        help="time only the kernels changed in this round (no readers, SDPA, MoE timings)")
    parser.add_argument("--sections", default="",
                        help="comma-separated subset to run (copy, correctness, writers, attention, step, moe); "
                             "default: all (MoE not with --quick)")
    parser.add_argument("--sdpa", action="store_true", default=os.environ.get("ATTN_SDPA", "0") == "1",
                        help="time dense torch SDPA at 32K/64K/128K even with --quick (default: env ATTN_SDPA=1)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("no CUDA device: run with --smoke (and TRITON_INTERPRET=1) to exercise the code paths on CPU")
        return 2
    import triton

    torch.manual_seed(0)
    b = Bench(device, args.smoke, args.quick, args.sdpa)
    print(f"kernels benchmark on {machine(device)}; torch {torch.__version__}, triton {triton.__version__}")
    chosen = {name.strip() for name in args.sections.split(",") if name.strip()}
    sections: list[tuple[str, str, Callable[[], None]]] = [
        ("copy", "HBM copy bandwidth", lambda: copy_bandwidth(b)),
        ("correctness", "correctness at realistic shapes", lambda: correctness(b)),
        ("writers", "record writers, readers, compressor", lambda: record_writers(b)),
        ("attention", "sparse decode attention vs dense SDPA", lambda: decode_attention(b)),
        ("topk", "top-k selection at the index shapes", lambda: topk_sweep(b)),
        ("step", "decode step: indexer + attention, 4K..1M", lambda: decode_step_curve(b)),
        ("moe", "MoE experts", lambda: moe(b))]
    unknown = chosen - {key for key, _, _ in sections}
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")
    for key, title, fn in sections:
        if (key in chosen or key == "copy") if chosen else (key != "moe" or not args.quick):
            b.section(title, fn)  # copy always: every bandwidth figure is a fraction of it
    failed = [c.name for c in b.checks if not c.passed]
    report = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(device),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda},
        "smoke": args.smoke,
        "quick": args.quick,
        "sections": sorted(chosen) or "all",
        "sdpa": args.sdpa,
        "copy_gbps": b.copy_gbps,
        "checks": [asdict(c) for c in b.checks],
        "rows": [asdict(r) for r in b.rows],
        "targets": b.targets,
        "curves": b.curves,
        "errors": b.errors,
        "seconds": round(time.time() - b.start, 1),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=float) + "\n")
    print(f"\nchecks: {len(b.checks) - len(failed)} PASS, {len(failed)} FAIL {failed}; errors: {len(b.errors)}; "
          f"{report['seconds']} s; wrote {out}")
    return 1 if failed or b.errors else 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_PRINT_AUTOTUNING", "0")
    raise SystemExit(main())
