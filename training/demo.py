"""Train the demo checkpoint: a small CED model of the real layer plan (preset `demo`) and its DSpark
drafter, on the Python standard library of the running interpreter.

Steps (all seeded): corpus and held-out split by file (`training/data.py`), a byte-level BPE
tokenizer, the backbone (next-token prediction with FP4/FP8 KV records in the forward pass and, at
the end, FP8/FP4 weights, straight-through), the drafter (distillation from the frozen backbone),
rounding to the stored formats, and a real-format checkpoint (`training/trainer.py` says how). The
written checkpoint is loaded back through the normal loader and must give the in-memory model's
logits; the JSON report records losses, timings and that check.

    python -m cedserve.training.demo --device cuda --out build/demo            # the shipped checkpoint (H200)
    python -m cedserve.training.demo --device cpu --max-files 60 --vocab-size 1024 --backbone-steps 20 \\
        --drafter-steps 10 --batch-size 4 --seq-len 128 --out build/demo-cpu   # a quick CPU run

Drafter only (`--init CHECKPOINT --drafter-only`): the backbone is loaded from a checkpoint and
frozen; the drafter (the checkpoint's, or a fresh one of the sizes given) is trained by
self-distillation over a cache of the backbone's work (`DistillSet`: greedy continuations of
training prompts, and corpus rows), evaluated by replaying greedy speculative decoding on held-out
prompts, and written into a copy of the checkpoint whose backbone tensors are the input's, byte for
byte (checked, and recorded in the report):

    python -m cedserve.training.demo --init cedserve/assets/demo --drafter-only --drafter-seconds 240 \\
        --out build/demo-drafter/demo
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
from cedserve.model.checkpoint_writer import load_drafter, snap_to_stored_formats, write_checkpoint
from cedserve.model.config import ModelConfig
from cedserve.model.dspark import Drafter
from cedserve.model.network import CEDModel
from cedserve.model.presets import preset
from cedserve.model.tokenizer import build_compressed_token_map, fit_config_to_tokenizer
from cedserve.training.data import (
    code_files,
    consecutive_rows,
    load_corpus,
    random_rows,
    read_tree,
    spread_rows,
    token_stream,
    train_tokenizer,
)
from cedserve.training.trainer import (
    DistillSet,
    DraftLossConfig,
    PhaseConfig,
    backbone_identical,
    distill_set,
    greedy_continuations,
    heldout_acceptance,
    heldout_loss,
    init_for_training_,
    speculative_acceptance,
    train_backbone,
    train_drafter,
    train_drafter_cached,
    write_drafter_checkpoint,
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
    d = p.add_argument_group("drafter only (--init CHECKPOINT --drafter-only)")
    d.add_argument("--init", type=Path, help="checkpoint folder to start from")
    d.add_argument("--drafter-only", action="store_true", help="freeze the --init backbone, train only the drafter")
    d.add_argument("--drafter-init", choices=("checkpoint", "fresh"), default="checkpoint",
                   help="start from the checkpoint's drafter (when its sizes are unchanged) or a fresh one")
    d.add_argument("--draft-layers", type=int, default=0, help="draft layers (0: the checkpoint's)")
    d.add_argument("--draft-experts", type=int, default=0, help="routed experts per draft layer (0: the checkpoint's)")
    d.add_argument("--draft-experts-per-tok", type=int, default=0)
    d.add_argument("--markov-rank", type=int, default=0, help="Markov head rank (0: the checkpoint's)")
    d.add_argument("--extra-code", type=Path, nargs="*", default=[],
                   help="more Python source trees for the drafter's training prompts and corpus rows (e.g. the "
                        "installed torch package): code the backbone never saw, as a served prompt is")
    d.add_argument("--extra-max-files", type=int, default=1500, help="files read per --extra-code tree")
    d.add_argument("--greedy-rows", type=int, default=1024, help="training prompts continued greedily by the backbone")
    d.add_argument("--greedy-prompt", type=int, default=256, help="their prompt tokens (the rest of --seq-len is greedy)")
    d.add_argument("--greedy-batch", type=int, default=512, help="rows decoded together")
    d.add_argument("--greedy-seconds", type=float, default=0.0, help="stop starting new groups after this (0: none)")
    d.add_argument("--corpus-rows", type=int, default=4096, help="corpus rows in the cache beside the greedy ones")
    d.add_argument("--greedy-share", type=float, default=0.5, help="share of each step's rows drawn from the greedy ones")
    d.add_argument("--distill-topk", type=int, default=16, help="teacher tokens cached per position")
    d.add_argument("--anchors-per-row", type=int, default=64)
    d.add_argument("--soft-weight", type=float, default=1.0, help="loss weight: cross-entropy to the top-K teacher")
    d.add_argument("--argmax-weight", type=float, default=1.0, help="loss weight: cross-entropy to the teacher's argmax")
    d.add_argument("--prefix-weighting", action="store_true", help="weight block positions by their reach")
    d.add_argument("--eval-prompts", type=int, default=32,
                   help="held-out prompts of the acceptance replay (32: demo_eval's decode prompts, the same rows)")
    d.add_argument("--eval-prompt-len", type=int, default=256, help="as benchmarks/demo_eval.py --prompt-len")
    d.add_argument("--eval-new", type=int, default=64, help="greedy tokens after each held-out prompt")
    d.add_argument("--eval-verifications", type=int, default=8,
                   help="verifications replayed per prompt (0: to the end; demo_eval's cells run 8 at batch 8 and 32)")
    d.add_argument("--train-only", choices=("all", "confidence"), default="all",
                   help="confidence: train only the confidence head (the drafts, hence the acceptance, stay "
                        "the same; implies --keep-last, no expert balancing)")
    d.add_argument("--keep-last", action="store_true", help="keep the last drafter, not the best replayed one")
    d.add_argument("--evaluations", type=int, default=10, help="acceptance replays over the run (besides the last)")
    d.add_argument("--deadline-seconds", type=float, default=0.0,
                   help="end the drafter's training early enough that the run ends within this many seconds of "
                        "its start (0: no deadline; the drafter's budget is then --drafter-seconds)")
    d.add_argument("--cache", type=Path, help="reuse the backbone's work from this file (written when missing)")
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


def drafter_config(base: ModelConfig, args: argparse.Namespace) -> ModelConfig:
    """`base` with the drafter sizes asked for (0: unchanged)."""
    changes = {name: value for name, value in (("num_nextn_predict_layers", args.draft_layers),
                                               ("dspark_n_routed_experts", args.draft_experts),
                                               ("dspark_num_experts_per_tok", args.draft_experts_per_tok),
                                               ("dspark_markov_rank", args.markov_rank)) if value}
    if "num_nextn_predict_layers" in changes:  # the stored schedule ends with one zero per draft layer
        changes["compress_ratios"] = base.compress_ratios[: base.num_hidden_layers]
    return base.replace(**changes) if changes else base


def drafter_only(args: argparse.Namespace) -> int:
    """Train only the drafter of `--init` (module docstring)."""
    started = time.perf_counter()
    if args.init is None:
        raise SystemExit("--drafter-only needs --init CHECKPOINT")
    torch.manual_seed(args.seed)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    args.out.mkdir(parents=True, exist_ok=True)
    report_path = args.report or args.out.parent / "train-drafter.json"
    if args.greedy_prompt >= args.seq_len:
        raise SystemExit(f"--greedy-prompt ({args.greedy_prompt}) must be below --seq-len ({args.seq_len})")
    model = load_model(args.init, device=args.device).requires_grad_(False)
    config = drafter_config(model.config, args)
    same_sizes = config == model.config
    generator = torch.Generator().manual_seed(args.seed)
    if args.drafter_init == "checkpoint" and same_sizes:
        drafter = load_drafter(args.init, config).to(args.device)
    else:
        drafter = Drafter(config)
        init_for_training_(drafter, config.num_nextn_predict_layers, generator)
        drafter.to(args.device)
    original = load_drafter(args.init, model.config).to(args.device)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.init / "tokenizer.json"))
    corpus = load_corpus(heldout_every=args.heldout_every, max_files=args.max_files)
    # code only: the generated charmap tables would teach the drafter tables and flatter its acceptance
    train = token_stream(tokenizer, code_files(corpus.train)).to(args.device)
    extra = [read_tree(root, args.extra_max_files) for root in args.extra_code]
    if extra:  # the backbone memorised much of its training text; served prompts are new to it
        train = torch.cat([train, token_stream(tokenizer, [f for tree in extra for f in tree]).to(args.device)])
    heldout = token_stream(tokenizer, code_files(corpus.heldout)).to(args.device)
    prepared_s = time.perf_counter() - started
    print(f"checkpoint {args.init}; corpus {corpus.root}: {train.shape[0]:,} training tokens of code, {heldout.shape[0]:,} "
          f"held out; drafter {sum(p.numel() for p in drafter.parameters()):,} parameters "
          f"({'from the checkpoint' if args.drafter_init == 'checkpoint' and same_sizes else 'fresh'}); "
          f"{prepared_s:.1f} s", flush=True)

    t = time.perf_counter()
    if args.cache is not None and args.cache.exists():
        saved = torch.load(args.cache, map_location=args.device)
        data, held, greedy_s = DistillSet(**saved["data"]), DistillSet(**saved["held"]), saved["greedy_s"]
    else:
        eval_prompts = spread_rows(heldout, args.eval_prompt_len, args.eval_prompts)  # demo_eval's decode prompts
        held = distill_set(model, greedy_continuations(model, eval_prompts, args.eval_new, args.greedy_batch),
                           args.eval_prompt_len, args.distill_topk)
        prompts = random_rows(train, args.greedy_rows, args.greedy_prompt, generator)
        greedy = greedy_continuations(model, prompts, args.seq_len - args.greedy_prompt, args.greedy_batch,
                                      args.greedy_seconds)
        greedy_s = time.perf_counter() - t
        parts = [distill_set(model, greedy, args.greedy_prompt, args.distill_topk)]
        if args.corpus_rows:  # as long as the greedy rows (a budget may have cut them)
            parts.append(distill_set(model, random_rows(train, args.corpus_rows, greedy.shape[1], generator), 1,
                                     args.distill_topk))
        data = DistillSet.cat(parts)
        if args.cache is not None:
            torch.save({"data": vars(data), "held": vars(held), "greedy_s": greedy_s}, args.cache)
    cache_s = time.perf_counter() - t
    greedy_rows = int((data.first_anchor > 1).sum())
    print(f"cache: {greedy_rows} greedy rows ({greedy_s:.1f} s) + {data.num_rows - greedy_rows} corpus rows of "
          f"{data.seq_len}, {data.nbytes / 1e6:.0f} MB; held-out replay {held.num_rows} x "
          f"({args.eval_prompt_len} + {held.seq_len - args.eval_prompt_len}); {cache_s:.1f} s", flush=True)

    before = speculative_acceptance(model, original, held, args.eval_verifications)
    print(f"held-out greedy acceptance of the checkpoint's drafter: {before['accepted_per_verify']:.3f} of "
          f"{config.dspark_block_size}", flush=True)
    seconds = args.drafter_seconds
    if args.deadline_seconds > 0:  # leave about 20 s for the replays, the checkpoint and its checks
        seconds = max(10.0, min(seconds, args.deadline_seconds - (time.perf_counter() - started) - 20))
        if seconds < args.drafter_seconds:
            print(f"drafter budget cut to {seconds:.0f} s by --deadline-seconds {args.deadline_seconds:.0f}", flush=True)
    only_confidence = args.train_only == "confidence"
    if only_confidence:  # the drafts stay bit for bit what they were: only c_k moves
        for name, param in drafter.named_parameters():
            param.requires_grad_(name.startswith("confidence."))
    cfg = PhaseConfig(seconds=seconds, max_steps=args.drafter_steps, batch_size=args.batch_size,
                      seq_len=args.seq_len, lr=args.drafter_lr, dense_fraction=0.0, anchors_per_row=args.anchors_per_row,
                      seed=args.seed, balance_rate=0.0 if only_confidence else PhaseConfig.balance_rate)
    weights = DraftLossConfig(soft=args.soft_weight, argmax=args.argmax_weight, prefix=args.prefix_weighting)
    run = train_drafter_cached(model, drafter, data, cfg, log_line, weights,
                               lambda: speculative_acceptance(model, drafter, held, args.eval_verifications), args.evaluations,
                               args.greedy_share, "" if args.keep_last or only_confidence else "accepted_per_verify")
    snap_to_stored_formats(drafter)
    after = speculative_acceptance(model, drafter, held, args.eval_verifications)
    write_drafter_checkpoint(args.init, drafter, args.out,
                             {"trainer": "cedserve.training.demo --drafter-only", "seed": str(args.seed)})
    identical = backbone_identical(args.init, args.out)
    loaded = load_drafter(args.out, ModelConfig.from_hf_json(args.out)).to(args.device)
    drafter_gap = max(float((a - b).abs().max()) for a, b in zip(drafter.state_dict().values(),
                                                                   loaded.state_dict().values()))
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    report = {
        "benchmark": "train_demo_drafter", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "machine": machine(args.device),
        "init": str(args.init), "corpus": {"root": str(corpus.root), "train_tokens": int(train.shape[0]),
                                           "extra_code": {str(r): len(t) for r, t in zip(args.extra_code, extra)},
                                           "heldout_tokens": int(heldout.shape[0])},
        "drafter_config": {"layers": config.num_nextn_predict_layers, "experts": config.dspark_n_routed_experts,
                           "experts_per_tok": config.dspark_num_experts_per_tok, "markov_rank": config.dspark_markov_rank,
                           "parameters": sum(p.numel() for p in drafter.parameters()),
                           "init": "checkpoint" if args.drafter_init == "checkpoint" and same_sizes else "fresh",
                           "train_only": args.train_only},
        "cache": {"greedy_rows": greedy_rows, "greedy_prompt": args.greedy_prompt,
                  "corpus_rows": data.num_rows - greedy_rows, "seq_len": data.seq_len, "topk": int(data.top_ids.shape[-1]),
                  "mbytes": data.nbytes / 1e6, "greedy_s": round(greedy_s, 1), "cache_s": round(cache_s, 1)},
        "loss": {"soft": weights.soft, "argmax": weights.argmax, "prefix": weights.prefix,
                 "greedy_share": args.greedy_share},
        "heldout_replay": {"prompts": held.num_rows, "prompt_len": args.eval_prompt_len,
                           "where": "spread evenly over the held-out code (training.data.spread_rows, code_files)",
                           "verifications_per_prompt": args.eval_verifications,
                           "new_tokens": held.seq_len - args.eval_prompt_len},
        "drafter": {"steps": run.steps, "seconds": round(run.seconds, 1), "anchors": run.tokens, "step_s": run.step_s,
                    "kept": run.final or "last",
                    "config": asdict(cfg), "history": run.history},
        "acceptance_before": before, "acceptance_after": after,
        "checkpoint": {"folder": str(args.out), "bytes": size, "backbone": identical,
                       "max_abs_drafter_weight_gap_after_load": drafter_gap},
        "total_s": round(time.perf_counter() - started, 1),
    }
    report_path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"held-out greedy acceptance {before['accepted_per_verify']:.3f} -> {after['accepted_per_verify']:.3f} of "
          f"{config.dspark_block_size} ({run.steps} steps, {run.seconds:.0f} s; kept the drafter of step "
          f"{int(run.final['best_step']) if run.final else run.steps}); backbone "
          f"{'identical' if identical['identical'] else 'CHANGED: ' + ', '.join(identical['differ'][:5])}; "
          f"checkpoint {size / 1e6:.2f} MB; {report['total_s']} s; report {report_path}", flush=True)
    return 0 if identical["identical"] and drafter_gap == 0.0 else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.drafter_only:
        return drafter_only(args)
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
    write_checkpoint(model, drafter, args.out, tokenizer_json, {"trainer": "cedserve.training.demo", "seed": str(args.seed)},
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
