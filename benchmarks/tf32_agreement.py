"""How far float32 matmuls on TF32 tensor cores move the model's outputs (`decode.matmul_tf32`).

Teacher-forced: the same token sequences go through `forward_train` twice on CUDA, once with
`torch.backends.cuda.matmul.allow_tf32` off (IEEE float32 products) and once on, and the logits are
compared position by position: the largest absolute difference, the mean KL divergence of the TF32
distribution from the float32 one, and how often the top-1 token agrees (and, where it does not,
how close the float32 top two were: a flip between near-ties is rounding, not damage). Models: the
shipped demo checkpoint on text from its own tokenizer, and mini-40 with random weights.

    python benchmarks/tf32_agreement.py --out docs/benchmarks/tf32-agreement-h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from cedserve.model.checkpoint import load_model
from cedserve.model.network import CEDModel

DEMO = Path(__file__).resolve().parents[1] / "cedserve" / "assets" / "demo"


def logits(model: CEDModel, tokens: torch.Tensor, tf32: bool) -> torch.Tensor:
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        with torch.no_grad():
            return model.forward_train(tokens).logits.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def compare(name: str, model: CEDModel, tokens: torch.Tensor) -> dict[str, Any]:
    ieee, tf32 = logits(model, tokens, False), logits(model, tokens, True)
    p_log, q_log = F.log_softmax(ieee, -1), F.log_softmax(tf32, -1)
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)  # KL(float32 || tf32) per position
    top2 = ieee.topk(2, dim=-1)
    agree = ieee.argmax(-1) == tf32.argmax(-1)
    margin = (top2.values[..., 0] - top2.values[..., 1])[~agree]
    return {"model": name, "positions": int(agree.numel()), "top1_agreement": float(agree.float().mean()),
            "flips": int((~agree).sum()), "flip_margin_max": float(margin.max()) if margin.numel() else 0.0,
            "max_abs_logit_diff": float((ieee - tf32).abs().max()), "logit_scale": float(ieee.abs().max()),
            "mean_kl": float(kl.mean()), "max_kl": float(kl.max())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/tf32_agreement.py compares CUDA matmul modes: no CUDA device here", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    demo = load_model(DEMO, device="cuda")
    vocab = demo.config.vocab_size
    tokens = torch.randint(3, vocab, (args.sequences, args.length), generator=gen).cuda()
    rows.append(compare("demo checkpoint (random token ids)", demo, tokens))
    del demo
    from cedserve.model import presets
    from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model
    from cedserve.model.tokenizer import tiny_tokenizer_path

    config = fit_config_to_tokenizer(presets.preset("mini-40"), tiny_tokenizer_path())
    for released in (False, True):
        c = presets.released_attention(config) if released else config
        model, _ = random_model(c, tiny_tokenizer_path(), args.seed)
        model = model.cuda()
        ids = torch.randint(3, c.vocab_size, (args.sequences, args.length), generator=gen).cuda()
        rows.append(compare("mini-40 random weights" + (" released attention" if released else ""), model, ids))
        del model
        torch.cuda.empty_cache()
    print(f"{'model':<44} {'positions':>9} {'top-1 agree':>11} {'flips':>5} {'flip margin':>11} "
          f"{'max |dlogit|':>12} {'mean KL':>9} {'max KL':>9}")
    for r in rows:
        print(f"{r['model']:<44} {r['positions']:>9} {r['top1_agreement']:>11.4f} {r['flips']:>5} "
              f"{r['flip_margin_max']:>11.2e} {r['max_abs_logit_diff']:>12.2e} {r['mean_kl']:>9.2e} {r['max_kl']:>9.2e}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.node()} {torch.cuda.get_device_name(0)}", "torch": torch.__version__,
            "command": "python benchmarks/tf32_agreement.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
