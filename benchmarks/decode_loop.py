"""What the decode engine loop costs beside the model pass: `cedserve_decode_loop_phase_seconds` per
tick, for trees side by side (the old code beside the new, in one run).

Each round starts one child process per tree (`--tree NAME=PYTHON`: that tree's virtual environment,
so `cedserve` is its code; this file is only the driver), in alternating order. A child builds the
preset with random weights (the tiny preset by default: its pass is short, as a GPU's is, so what
is around it shows), hands `--batch` shipped states to a `DecodeEngine`, and runs `--ticks` ticks of
the worker's `EngineLoop` (a group of one; the outputs go to a real `OutputRouter` with an open
stream per request, drained as the loop goes) after `--warmup` ticks; it reports the phase seconds
of those ticks. The table gives each phase's mean per tick in microseconds, the median over rounds,
and `not model`: every tick phase but the model pass and the drafter's (`propose`, `observe`),
the loop's own overhead in series with the pass.

    python benchmarks/decode_loop.py --tree before=../before/.venv/bin/python --tree after=.venv/bin/python \\
        --batch 1 4 --rounds 5 --out docs/benchmarks/decode-loop-cpu.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

PHASES = ("commands", "poll", "report", "schedule", "join", "propose", "plan", "model", "accept", "persist",
          "observe", "account")
DRAFTER = ("propose", "observe")


def child(preset_name: str, batch: int, dspark: bool, ticks: int, warmup: int, seed: int) -> dict[str, Any]:
    """One tree's run (in that tree's interpreter): phase seconds and counts over `ticks` ticks."""
    import torch

    from cedserve.decode_workers.config import DecodeConfig
    from cedserve.decode_workers.drafting import DSparkProposer
    from cedserve.decode_workers.engine import DecodeEngine
    from cedserve.decode_workers.loop import EngineLoop, LocalChannel
    from cedserve.decode_workers.messages import AttachCommand, Sampling
    from cedserve.decode_workers.service import OutputRouter
    from cedserve.model.cache.config import KVCacheConfig
    from cedserve.model.cache.layout import BlockLayout
    from cedserve.model.cache.manager import KVCacheManager
    from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model
    from cedserve.model.presets import preset
    from cedserve.model.tokenizer import tiny_tokenizer_path

    torch.manual_seed(seed)
    config = fit_config_to_tokenizer(preset(preset_name), tiny_tokenizer_path())
    model, drafter = random_model(config, tiny_tokenizer_path(), seed)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, min(config.vocab_size, 512), (96,), generator=gen).tolist()
    state = model.new_state()
    first = int(model.prefill(tokens, state)[-1].argmax())
    block = 64
    cache = KVCacheManager(BlockLayout.from_config(model.config, block), KVCacheConfig(block_size=block,
                           num_blocks=batch * 16 + 8), "loop-bench", "cpu")
    proposer = DSparkProposer(drafter, model, 4) if dspark else None
    engine = DecodeEngine(DecodeConfig(max_running_requests=batch, dspark=dspark, kernel_warmup=False), model,
                          cache, proposer=proposer)
    router = OutputRouter(1)
    loop = EngineLoop(engine, LocalChannel(), on_report=router.on_report)
    streams = []
    for i in range(batch):
        cmd = AttachCommand(0, f"r{i}", f"l{i}", tuple(tokens), first, 100,
                            Sampling(max_tokens=100_000, ignore_eos=True))
        streams.append(router.open_stream(f"r{i}"))
        engine.attach_state(f"r{i}", tokens, copy.deepcopy(state), first, cmd)

    def sums() -> dict[str, float]:
        registry = engine.metrics.registry
        return {p: registry.get_sample_value("cedserve_decode_loop_phase_seconds_sum", {"phase": p}) or 0.0
                for p in PHASES}

    for _ in range(warmup):
        loop.tick()
    before = sums()
    for _ in range(ticks):
        loop.tick()
        for stream in streams:  # the streams' threads take what the loop reported
            while not stream.empty():
                stream.get_nowait()
    after = sums()
    return {p: (after[p] - before[p]) / ticks for p in PHASES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", default=[], help="NAME=PYTHON (repeat; default: this one)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--dspark", choices=("off", "on", "both"), default="both")
    ap.add_argument("--ticks", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # PRESET,BATCH,DSPARK,TICKS,WARMUP,SEED
    args = ap.parse_args()
    if args.child:
        name, batch, dspark, ticks, warmup, seed = args.child.split(",")
        print(json.dumps(child(name, int(batch), dspark == "1", int(ticks), int(warmup), int(seed))))
        return
    trees = dict(spec.split("=", 1) for spec in args.tree) or {"this": sys.executable}
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.dspark]
    load_before = os.getloadavg()
    cells: dict[str, dict[str, Any]] = {}
    for batch in args.batch:
        for dspark in modes:
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
            for r in range(args.rounds):
                for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
                    spec = f"{args.preset},{batch},{int(dspark)},{args.ticks},{args.warmup},{args.seed + r}"
                    out = subprocess.run([trees[name], __file__, "--child", spec], check=True, capture_output=True,
                                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
                    runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            case = f"batch {batch}, dspark {'on' if dspark else 'off'}"
            cells[case] = {name: {"median_us": _median(rows), "runs": rows} for name, rows in runs.items()}
    print(_table(cells))
    report = {"benchmark": "decode_loop", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", *sys.argv]),
              "machine": {"hostname": platform.node(), "cores": os.cpu_count(), "python": platform.python_version(),
                          "loadavg_before": [round(x, 2) for x in load_before],
                          "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
              "preset": args.preset, "ticks": args.ticks, "rounds": args.rounds, "trees": trees, "note": args.note,
              "results": cells}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"# wrote {args.out}")


def _median(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per phase and for `not_model`: the median over rounds of the mean per tick, in microseconds."""
    out = {p: 1e6 * statistics.median(r[p] for r in rows) for p in PHASES}
    out["not_model"] = 1e6 * statistics.median(sum(r[p] for p in PHASES if p != "model" and p not in DRAFTER)
                                               for r in rows)
    return out


def _table(cells: dict[str, dict[str, Any]]) -> str:
    keys = [*PHASES, "not_model"]
    head = f"{'case':<22} {'tree':<8} " + " ".join(f"{k[:8]:>8}" for k in keys)
    lines = [head, "-" * len(head)]
    for case, by_tree in cells.items():
        for name, cell in by_tree.items():
            lines.append(f"{case:<22} {name:<8} " + " ".join(f"{cell['median_us'][k]:>8.1f}" for k in keys))
    lines.append("us per tick, median over rounds of each run's mean; not_model: every phase but the model pass and "
                 "the drafter's (propose, observe)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
