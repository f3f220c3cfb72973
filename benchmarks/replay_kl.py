"""Bounded replay error: KL divergence of the next-token distribution, exact state vs replay spans.

The decoder's sliding-window state is rebuilt by running the decoder layers over the last `span`
tokens' encoder outputs (the global KV is complete either way). Exact rebuild needs
decoder_layers x (sliding_window - 1) tokens; the report replays 128 and calls the error negligible.
This measures it on random-weight models: for each seed, a random prompt is prefilled through every
layer (the exact state) and, separately, encoded and replayed over each span; the next-token
distributions are compared by KL(exact || replay), top-1 agreement and max |logit difference|.

    python benchmarks/replay_kl.py --preset mini-40 --context 2700 --seeds 3

Prints a table and writes JSON (date, machine, command) to --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model
from cedserve.model.presets import preset
from cedserve.model.tokenizer import tiny_tokenizer_path


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def run_seed(preset_name: str, context: int, spans: list[int], seed: int, weight_std: float) -> list[dict[str, float]]:
    config = fit_config_to_tokenizer(preset(preset_name), tiny_tokenizer_path())
    config = config.replace(initializer_range=weight_std)
    model, _ = random_model(config, tiny_tokenizer_path(), seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    tokens = torch.randint(3, min(config.vocab_size, 512), (context,), generator=gen)
    exact = model.prefill(tokens, model.new_state())[-1]
    encoded_state = model.new_state()
    boundary = model.encode_chunk(tokens, encoded_state).boundary
    rows = []
    for span in spans:
        state = copy.deepcopy(encoded_state)
        replayed = model.replay_decoder(boundary.last(span), state)[-1]
        rows.append({
            "span": span, "seed": seed, "kl": kl(exact, replayed),
            "top1_agree": float(exact.argmax() == replayed.argmax()),
            "max_abs_logit_diff": float((exact - replayed).abs().max()),
            "entropy_exact": float(-(torch.softmax(exact.double(), -1) * torch.log_softmax(exact.double(), -1)).sum()),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="mini-40")
    parser.add_argument("--context", type=int, default=2700)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--spans", default="1,32,128,256,exact")
    parser.add_argument("--weight-std", type=float, default=0.02)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/replay-kl-cpu.json"))
    args = parser.parse_args()
    config = preset(args.preset)
    decoder_layers = config.num_hidden_layers - config.num_encoder_layers
    exact_span = decoder_layers * (config.sliding_window - 1)
    spans = [exact_span if s == "exact" else int(s) for s in args.spans.split(",")]
    if args.context < exact_span:
        print(f"note: context {args.context} < exact span {exact_span}: the exact span replays everything")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    start = time.time()
    rows = [r for seed in range(args.seeds) for r in run_seed(args.preset, args.context, spans, seed, args.weight_std)]
    summary = []
    print(f"{'span':>6} {'mean KL':>12} {'max KL':>12} {'top-1 agree':>12} {'max |dlogit|':>13}")
    for span in spans:
        sel = [r for r in rows if r["span"] == span]
        entry = {"span": span, "mean_kl": sum(r["kl"] for r in sel) / len(sel), "max_kl": max(r["kl"] for r in sel),
                 "top1_agreement": sum(r["top1_agree"] for r in sel) / len(sel),
                 "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in sel)}
        summary.append(entry)
        label = f"{span}{' (exact)' if span == exact_span else ''}"
        print(f"{label:>6} {entry['mean_kl']:12.3e} {entry['max_kl']:12.3e} {entry['top1_agreement']:12.2f} "
              f"{entry['max_abs_logit_diff']:13.3e}")
    report = {
        "benchmark": "replay_kl", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {platform.processor() or ''} "
                   f"{torch.get_num_threads()} threads, torch {torch.__version__}, CPU",
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "preset": args.preset, "context": args.context, "weight_std": args.weight_std,
        "exact_span": exact_span, "seconds": round(time.time() - start, 1), "summary": summary, "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} ({report['seconds']} s)")


if __name__ == "__main__":
    main()
