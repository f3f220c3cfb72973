"""The decode step's two batched float32 GEMMs a layer at verify row counts, and the forms that could
replace them.

A DSpark verify step (1 + 5 rows) on an H100 spent 1.6 ms in one cuBLAS kernel
(`sm80_xmma_gemm_f32f32..._tilesize32x32x8`, 80 calls a step: two a layer, 20 us each) where the
plain step ran `gemv2T` at 2.8 us (docs/benchmarks/gpu-2026-12-06d/call1/decode-step-h100.json). The
step's only two batched GEMMs a layer are `wo_a`'s groups (`fused.output`'s `bmm`) and
the dense MoE's down projections (`fused.dense_experts`' `bmm`), so they are the first suspects; this
times each at a preset's shapes (mini-40 by default), beside:

* `wo_a`: the Triton kernel the step now runs (`cedserve.kernels.grouped_linear`, which these
  timings motivated), one `F.linear` per group, and one `F.linear` over a block-diagonal weight
  (G x the work);
* the MoE down projections: one `F.linear` over the experts' concatenated weights, which sums the
  experts inside the GEMM (the step sums their outputs after: the same float32 result up to the
  order of the sum), and `einsum`;
* both in TF32 and bfloat16 (other numerics: for scale).

Each form is 40 calls (40 layers' weights) captured as one CUDA graph and replayed
(`benchmarks/kernels.py`'s `_graph_time_s`; microseconds per call), and checked against a float64 reference of the same math (max relative error).

    python -P benchmarks/batched_gemm.py --out /tmp/batched-gemm.json

Prints a table and writes JSON. Needs a CUDA device."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cedserve.kernels.grouped_linear import grouped_linear
from cedserve.model.presets import preset
from kernels import Bench, _graph_time_s

CALLS = 40


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def wo_a_forms(x: torch.Tensor, weight: torch.Tensor, groups: int) -> dict[str, Callable[[], torch.Tensor]]:
    """`x [B, G, K]`, `weight [G * N, K]` (the checkpoint's `wo_a`): `[B, G * N]` each way."""
    w = weight.view(groups, -1, x.shape[-1]).transpose(1, 2)  # [G, K, N], as GroupedOutput reads it
    rows = weight.shape[0] // groups
    blocks = torch.block_diag(*[weight[g * rows:(g + 1) * rows] for g in range(groups)])  # [G N, G K]
    return {
        "bmm (cuBLAS)": lambda: torch.bmm(x.transpose(0, 1), w).transpose(0, 1).flatten(1),
        "grouped_linear (Triton)": lambda: grouped_linear(x, weight, "triton"),  # at any row count, 1 too
        "linear per group": lambda: torch.cat([F.linear(x[:, g], weight[g * rows:(g + 1) * rows])
                                               for g in range(groups)], dim=1),
        "linear block-diagonal": lambda: F.linear(x.flatten(1), blocks),
    }


def down_forms(y: torch.Tensor, w2: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """`y [B, E', I]` (routing-weighted activations), `w2 [E', D, I]`: the experts' summed down
    projections `[B, D]` each way."""
    cat = w2.permute(1, 0, 2).reshape(w2.shape[1], -1)  # [D, E' I]
    return {
        "bmm + sum (the step)": lambda: torch.bmm(y.transpose(0, 1), w2.transpose(1, 2)).sum(dim=0),
        "linear over concatenated": lambda: F.linear(y.flatten(1), cat),
        "einsum": lambda: torch.einsum("bei,edi->bd", y, w2),
    }


def linear_forms(x: torch.Tensor, weight: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """`x [B, K]`, `weight [N, K]` (a plain projection of the step): `[B, N]` by cuBLAS, and by the
    grouped kernel as one group (whether it also beats cuBLAS's picks at verify rows)."""
    return {
        "F.linear (cuBLAS)": lambda: F.linear(x, weight),
        "grouped_linear G=1 (Triton)": lambda: grouped_linear(x.unsqueeze(1), weight, "triton"),
        # one launch: K not split across programs (no second launch adding the splits)
        "grouped_linear G=1, one launch (Triton)": lambda: grouped_linear(x.unsqueeze(1), weight, "triton", splits=1),
    }


Forms = dict[str, Callable[[], torch.Tensor]]


def measure(bench: Bench, name: str, rows: int, layers: Callable[[torch.dtype], list[Forms]], want: torch.Tensor,
            tf32: bool) -> list[dict[str, Any]]:
    """Each form's us per call over the layers' weights (float32; the step's form also in TF32 and
    bfloat16), and its error against `want` (the first layer's float64 result)."""
    out = []

    def row(form: str, numerics: str, per_layer: list[Forms]) -> dict[str, Any]:
        us = _graph_time_s(bench, [forms[form] for forms in per_layer], f"{name} {form}") * 1e6 / len(per_layer)
        return {"gemm": name, "rows": rows, "form": form, "numerics": numerics, "us": round(us, 2),
                "rel_err": rel_err(per_layer[0][form]().float(), want)}

    float32 = layers(torch.float32)
    step_form = next(iter(float32[0]))
    for form in float32[0]:
        out.append(row(form, "float32", float32))
    if tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            out.append(row(step_form, "tf32", float32))
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False
    bf16 = layers(torch.bfloat16)
    for form in (step_form, *(f for f in bf16[0] if "Triton" in f)):
        out.append(row(form, "bfloat16", bf16))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mini-40")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 6, 12, 16, 32, 192])
    p.add_argument("--gemms", nargs="+", choices=("wo_a", "down", "linear"), default=["wo_a", "down", "linear"],
                   help="linear: the step's plain projections (--linears)")
    p.add_argument("--linears", nargs="+", default=["wa", "wq_b", "wo_b"],
                   choices=("wa", "wq_b", "wo_b", "gate", "w13", "compress", "head"),
                   help="which plain projections --gemms linear times")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("batched_gemm.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    c = preset(args.preset)
    device = torch.device("cuda")
    bench = Bench(device, smoke=False)
    gen = torch.Generator(device=device).manual_seed(0)
    groups = c.o_groups
    k_group, n_group = c.num_attention_heads * c.head_dim // groups, c.o_lora_rank
    experts, inter, dim = c.n_routed_experts + 1, c.moe_intermediate_size, c.hidden_size  # the shared one last
    # one weight per layer (40 calls read 40 weights, as the step does, not one cached in L2)
    wo_a = [torch.randn(groups * n_group, k_group, device=device, generator=gen) * k_group**-0.5 for _ in range(CALLS)]
    w2 = [torch.randn(experts, dim, inter, device=device, generator=gen) * inter**-0.5 for _ in range(CALLS)]
    shapes = {"wa": (c.q_lora_rank + c.head_dim, dim),
              "wq_b": (c.num_attention_heads * c.head_dim, c.q_lora_rank),
              "wo_b": (dim, groups * n_group),
              # the rest of a float32 model's projections: the router, the experts' gate and up (all
              # experts and the shared one, `dense_experts`), a ratio > 1 compressor's [wkv; wgate], the head
              "gate": (c.n_routed_experts, dim),
              "w13": (experts * 2 * inter, dim),
              "compress": (2 * c.head_dim, dim),
              "head": (c.vocab_size, dim)}
    linears = {name: [torch.randn(n, k, device=device, generator=gen) * k**-0.5 for _ in range(CALLS)]
               for name, (n, k) in shapes.items() if name in args.linears} if "linear" in args.gemms else {}
    rows_out: list[dict[str, Any]] = []
    print(f"{'gemm':<6} {'rows':>4}  {'form':<26} {'numerics':<9} {'us/call':>8} {'rel err':>9}")
    for rows in args.rows:
        x = torch.randn(rows, groups, k_group, device=device, generator=gen)
        y = torch.randn(rows, experts, inter, device=device, generator=gen) * (torch.rand(
            rows, experts, 1, device=device, generator=gen) < 0.3)  # most experts weighted 0, as routed
        want_a = torch.bmm(x.double().transpose(0, 1), wo_a[0].double().view(groups, -1, k_group).transpose(1, 2))
        want_d = torch.einsum("bei,edi->bd", y.double(), w2[0].double())

        def a_layers(dtype: torch.dtype, x: torch.Tensor = x) -> list[Forms]:
            return [wo_a_forms(x.to(dtype), w.to(dtype), groups) for w in wo_a]

        def d_layers(dtype: torch.dtype, y: torch.Tensor = y) -> list[Forms]:
            return [down_forms(y.to(dtype), w.to(dtype)) for w in w2]

        cases: list[tuple[str, Callable[[torch.dtype], list[Forms]], torch.Tensor]] = []
        if "wo_a" in args.gemms:
            cases.append(("wo_a", a_layers, want_a.transpose(0, 1).flatten(1)))
        if "down" in args.gemms:
            cases.append(("down", d_layers, want_d))
        if "linear" in args.gemms:
            for lname, ws in linears.items():
                xl = torch.randn(rows, ws[0].shape[1], device=device, generator=gen)

                def l_layers(dtype: torch.dtype, x: torch.Tensor = xl, ws: list[torch.Tensor] = ws) -> list[Forms]:
                    return [linear_forms(x.to(dtype), w.to(dtype)) for w in ws]

                cases.append((lname, l_layers, xl.double() @ ws[0].double().T))
        for name, layers, want in cases:
            for r in measure(bench, name, rows, layers, want, tf32=True):
                rows_out.append(r)
                print(f"{r['gemm']:<6} {r['rows']:>4}  {r['form']:<26} {r['numerics']:<9} {r['us']:>8.2f} "
                      f"{r['rel_err']:>9.2e}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": "python -P benchmarks/batched_gemm.py " + " ".join(argv),
            "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                        "python": platform.python_version()},
            "preset": args.preset, "shapes": {"wo_a": [groups, k_group, n_group], "down": [experts, inter, dim],
                                                  **{n: list(ws[0].shape) for n, ws in linears.items()}},
            "notes": "us per call: 40 calls (40 layers' weights) in one CUDA graph, do_bench's median replay; "
                     "rel_err: max |got - float64| / max |float64| on the first layer's weights",
            "rows": rows_out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
