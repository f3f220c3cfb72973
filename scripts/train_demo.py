"""Train the demo checkpoint: a small CED model of the real layer plan (preset `demo`) and its DSpark
drafter, on the Python standard library of the running interpreter.

Steps (all seeded): corpus and held-out split by file (`model/train_data.py`), a byte-level BPE
tokenizer, the backbone (next-token prediction with FP4/FP8 KV records in the forward pass and, at
the end, FP8/FP4 weights, straight-through), the drafter (distillation from the frozen backbone),
rounding to the stored formats, and a real-format checkpoint (`model/training.py` says how). The
written checkpoint is loaded back through the normal loader and must give the in-memory model's
logits; the JSON report records losses, timings and that check.

    python scripts/train_demo.py --device cuda --out build/demo            # the shipped checkpoint (H200)
    python scripts/train_demo.py --device cpu --max-files 60 --vocab-size 1024 --backbone-steps 20 \\
        --drafter-steps 10 --batch-size 4 --seq-len 128 --out build/demo-cpu   # a quick CPU run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from cedserve.model.checkpoint import load_model
from cedserve.model.checkpoint_writer import (
    fit_config_to_tokenizer,
    load_drafter,
    snap_to_stored_formats,
    write_checkpoint,
)
from cedserve.model.dspark import Drafter
from cedserve.model.engram import build_compressed_token_map
from cedserve.model.network import CEDModel
from cedserve.model.presets import preset
from cedserve.model.train_data import consecutive_rows, load_corpus, token_stream, train_tokenizer
from cedserve.model.training import (
    PhaseConfig,
    heldout_acceptance,
    heldout_loss,
    init_for_training_,
    train_backbone,
    train_drafter,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    p.add_argument("--report", type=Path, help="JSON report (default: <out>/../train-demo.json)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--max-files", type=int, default=0, help="use only the first N files (0: all)")
    p.add_argument("--heldout-every", type=int, default=50, help="hold out files with crc32(path) %% N == 0")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--backbone-seconds", type=float, default=200.0)
    p.add_argument("--backbone-steps", type=int, default=0, help="exact step count (overrides the time budget)")
    p.add_argument("--drafter-seconds", type=float, default=80.0)
    p.add_argument("--drafter-steps", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--drafter-lr", type=float, default=2e-3)
    p.add_argument("--eval-rows", type=int, default=64, help="held-out rows of the final evaluation")
    return p.parse_args(argv)


def machine(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "torch": torch.__version__, "cpu_count": os.cpu_count()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def log_line(record: dict[str, Any]) -> None:
    from tqdm import tqdm

    tqdm.write(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}))


def logit_gap(model: CEDModel, folder: Path, rows: torch.Tensor, device: str) -> float:
    """Largest |logit difference| between the in-memory model and the checkpoint loaded back."""
    loaded = load_model(folder, device=device)
    with torch.no_grad():
        ours = model.forward_train(rows).logits
        theirs = loaded.forward_train(rows).logits
    return float((ours - theirs).abs().max())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    report_path = args.report or args.out.parent / "train-demo.json"

    corpus = load_corpus(heldout_every=args.heldout_every, max_files=args.max_files)
    tokenizer = train_tokenizer([f.text for f in corpus.train], args.vocab_size)
    tokenizer_json = args.out / "tokenizer.json"
    tokenizer.save(str(tokenizer_json))
    train = token_stream(tokenizer, corpus.train).to(args.device)
    heldout = token_stream(tokenizer, corpus.heldout).to(args.device)
    prepared_s = time.perf_counter() - started
    print(f"corpus {corpus.root}: {len(corpus.train)} training files ({train.shape[0]:,} tokens), "
          f"{len(corpus.heldout)} held out ({heldout.shape[0]:,} tokens); prepared in {prepared_s:.1f} s", flush=True)

    config = fit_config_to_tokenizer(preset("demo").replace(vocab_size=tokenizer.get_vocab_size()), tokenizer_json)
    token_map, _ = build_compressed_token_map(tokenizer)
    model = CEDModel(config, token_map)
    drafter = Drafter(config)
    generator = torch.Generator().manual_seed(args.seed)
    init_for_training_(model, config.num_hidden_layers, generator)
    init_for_training_(drafter, config.num_nextn_predict_layers, generator)
    model.to(args.device)
    drafter.to(args.device)
    print(f"backbone {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"drafter {sum(p.numel() for p in drafter.parameters()):,}", flush=True)

    backbone_cfg = PhaseConfig(seconds=args.backbone_seconds, max_steps=args.backbone_steps, batch_size=args.batch_size,
                               seq_len=args.seq_len, lr=args.lr, seed=args.seed)
    backbone = train_backbone(model, train, heldout, backbone_cfg, log_line)
    drafter_cfg = PhaseConfig(seconds=args.drafter_seconds, max_steps=args.drafter_steps, batch_size=args.batch_size,
                              seq_len=args.seq_len, lr=args.drafter_lr, dense_fraction=0.0, eval_every=50,
                              seed=args.seed)
    draft = train_drafter(model, drafter, train, heldout, drafter_cfg, log_line)

    before_snap = heldout_loss(model, heldout, args.seq_len, args.eval_rows)
    snap_to_stored_formats(model)
    snap_to_stored_formats(drafter)
    final_loss = heldout_loss(model, heldout, args.seq_len, args.eval_rows)
    acceptance = heldout_acceptance(model, drafter, heldout, args.seq_len, args.eval_rows, 64, args.seed)
    write_checkpoint(model, drafter, args.out, tokenizer_json, {"trainer": "scripts/train_demo.py", "seed": str(args.seed)},
                     half_floats=True)
    rows = consecutive_rows(heldout, args.seq_len, 4)
    gap = logit_gap(model, args.out, rows, args.device)
    loaded_drafter = load_drafter(args.out, config).to(args.device)
    drafter_gap = max(float((a - b).abs().max()) for a, b in zip(drafter.state_dict().values(),
                                                                   loaded_drafter.state_dict().values()))
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    report = {
        "benchmark": "train_demo", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "machine": machine(args.device),
        "corpus": {"root": str(corpus.root), "train_files": len(corpus.train), "heldout_files": len(corpus.heldout),
                   "train_tokens": int(train.shape[0]), "heldout_tokens": int(heldout.shape[0]),
                   "train_chars": corpus.train_chars, "heldout_every": args.heldout_every},
        "vocab_size": tokenizer.get_vocab_size(), "prepare_s": round(prepared_s, 1),
        "parameters": {"backbone": sum(p.numel() for p in model.parameters()),
                       "drafter": sum(p.numel() for p in drafter.parameters())},
        "backbone": {"steps": backbone.steps, "seconds": round(backbone.seconds, 1), "tokens": backbone.tokens,
                     "step_s": backbone.step_s, "config": asdict(backbone_cfg),
                     "history": backbone.history},
        "drafter": {"steps": draft.steps, "seconds": round(draft.seconds, 1), "tokens": draft.tokens,
                    "step_s": draft.step_s, "config": asdict(drafter_cfg), "history": draft.history},
        "heldout_loss_float_weights": before_snap, "heldout_loss": final_loss,
        "heldout_perplexity": float(torch.tensor(final_loss).exp()), "heldout_draft": acceptance,
        "checkpoint": {"folder": str(args.out), "bytes": size, "max_abs_logit_gap_after_load": gap,
                       "max_abs_drafter_weight_gap_after_load": drafter_gap},
        "total_s": round(time.perf_counter() - started, 1),
    }
    report_path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"held-out loss {final_loss:.4f} (float weights {before_snap:.4f}); drafter held-out accepted "
          f"{acceptance['accepted']:.2f} of {config.dspark_block_size}; checkpoint {size / 1e6:.2f} MB, "
          f"logit gap after load {gap:.2e}; {report['total_s']} s; report {report_path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
