"""Why a 32K prompt served disaggregated on one GPU was slower than colocated, on a CPU: the paths.

Two parts, each exact on any machine (counts, not speeds; CPU times are printed for orientation):

* `paths`: which path every decode step of one request takes, by how it joined (the `tiny` preset,
  DSpark on with its random drafter, `decode.runner = on`, through `tests/unit/decode_support.Rig`):
  `replay` (KV received, the decode worker replays `replay_span` tokens: 0 = the exact receptive
  field), `shipped` (KV received with the prefill side's bounded state, `decode.ship_state`) and
  `local` (`prefill_locally`). Per step: rows through `forward_batch`, rows through the model runner.
* `chunks`: kernel launches (torch ops that compute, one kernel each on a GPU) and host syncs of
  the two prefill paths over one prompt, with mini-40 random weights (host syncs: the ops that read
  a device value on the host, `decode_profile.SYNC_OPS`, and `Tensor.tolist` calls): the prefill engine's
  (`encode_chunk` per chunk of `--chunk` tokens, then the decoder replay over the last 128
  boundary states) and the decode worker's local prefill (one `forward_batch` item over the whole
  prompt, all layers). Counted with `benchmarks/decode_profile.OpCounter`.

    python benchmarks/disagg_paths.py --prompt-tokens 256 --chunk-prompt-tokens 512 \\
        --chunks 64 128 256 512 --out docs/benchmarks/disagg-paths-cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "unit"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from decode_profile import SYNC_OPS, OpCounter  # noqa: E402
from decode_support import Rig, prompt, tiny  # noqa: E402

from cedserve.common.machine import describe_machine  # noqa: E402
from cedserve.decode_workers.messages import Reserved, Tokens  # noqa: E402
from cedserve.decode_workers.state_io import exact_replay_span  # noqa: E402
from cedserve.model.checkpoint_writer import fit_config_to_tokenizer, random_model  # noqa: E402
from cedserve.model.network import BatchItem, BoundaryHidden, CEDModel  # noqa: E402
from cedserve.model.paged_attention import enable_paged_attention  # noqa: E402
from cedserve.model.prefill_runner import PrefillRunner, PrefillRunnerConfig  # noqa: E402
from cedserve.model.presets import preset  # noqa: E402
from cedserve.model.tokenizer import tiny_tokenizer_path  # noqa: E402

ARMS = ("replay", "shipped", "local")


def decode_paths(arm: str, prompt_tokens: int, max_tokens: int) -> dict[str, Any]:
    """Every step of one request joined as `arm`: rows through forward_batch and through the runner."""
    model, drafter = tiny()
    rig = Rig(model, drafter, num_blocks=64, runner="on", ship_state=arm == "shipped")
    engine = rig.engine
    rows: dict[str, int] = {}
    run, run_slots = engine._run, engine._run_slots

    def counted_run(items: Any) -> Any:
        rows["forward_batch"] = sum(len(item.token_ids) for item in items)
        return run(items)

    def counted_slots(seqs: Any, drafts: Any) -> Any:
        plans, results = run_slots(seqs, drafts)
        rows["runner"] = sum(int(r.logits.shape[0]) for r in results)
        return plans, results

    engine._run, engine._run_slots = counted_run, counted_slots  # type: ignore[method-assign]
    tokens = prompt(prompt_tokens, 5)
    reserved = rig.reserve(tokens, sender=arm != "local")
    assert isinstance(reserved, Reserved), reserved
    first = None if arm == "local" else rig.prefill(reserved, tokens)
    rig.attach(reserved, tokens, first, max_tokens if arm == "local" else max_tokens - 1)
    steps = []
    while True:
        rig.outputs += engine.poll()
        if not engine.has_work():
            break
        rows.clear()
        start = time.process_time()
        out = engine.step()
        rig.outputs += out
        steps.append(
            {
                "forward_batch_rows": rows.get("forward_batch", 0),
                "runner_rows": rows.get("runner", 0),
                "tokens": sum(len(o.token_ids) for o in out if isinstance(o, Tokens)),
                "cpu_s": round(time.process_time() - start, 4),
            }
        )
    rig.assert_all_free()
    assert engine.slots is not None
    return {
        "arm": arm,
        "joins": {kind: int(m._value.get()) for (kind,), m in engine.metrics.joins._metrics.items()},
        "runner_steps": engine.slots.runner.steps,
        "drafted_tokens": engine.drafted_tokens,
        "declined_draft_steps": getattr(engine.proposer, "declined_steps", None),
        "steps": steps,
    }


@contextmanager
def _counting_tolist(counts: Counter[str]) -> Iterator[None]:
    """Count `Tensor.tolist` calls: a device-to-host copy on a GPU that does not dispatch through
    torch (so `OpCounter` misses it), e.g. `MoE.forward`'s rows per expert."""
    original = torch.Tensor.tolist

    def tolist(self: torch.Tensor) -> Any:
        counts["tolist"] += 1
        return original(self)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]


def _count(fn: Callable[[], None], counter: OpCounter | None = None) -> dict[str, Any]:
    counter, copies = counter or OpCounter(), Counter[str]()
    start = time.process_time()
    with torch.no_grad(), _counting_tolist(copies), counter:
        fn()
    syncs = {n: counter.by_name[n] for n in SYNC_OPS if counter.by_name[n]} | dict(copies)
    return {
        "launches": sum(counter.launches.values()),
        "host_syncs": sum(syncs.values()),
        "host_syncs_by_op": syncs,
        "cpu_s": round(time.process_time() - start, 2),
    }


def _as_graph_replays(runner: PrefillRunner, counter: OpCounter) -> None:
    """Count each of `runner`'s chunk passes as one launch (a graph replay), its ops uncounted."""
    forward = runner._forward

    def replay(bucket: int) -> Any:
        counter.paused = True
        try:
            return forward(bucket)
        finally:
            counter.paused = False
            counter.kernel("graph_replay")

    runner._forward = replay  # type: ignore[method-assign]


def prefill_launches(model: CEDModel, prompt_tokens: int, chunks: list[int]) -> dict[str, Any]:
    tokens = prompt(prompt_tokens, 1)
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "engine": {}}
    for chunk in chunks:

        def engine(chunk: int = chunk) -> None:
            state, spans = model.new_state(), []
            for start in range(0, prompt_tokens, chunk):
                spans.append(model.encode_chunk(tokens[start : start + chunk], state).boundary)
            model.replay_decoder(BoundaryHidden.concat(spans).last(128), state)
            state.release_paged()

        out["engine"][str(chunk)] = _count(engine)
        print(f"engine, chunks of {chunk}: {out['engine'][str(chunk)]}", flush=True)

    for chunk in chunks:
        # the prefill runner as a GPU runs it: each chunk's pass is one graph replay (counted as one
        # launch; its ops run uncounted here: `test_capture_trace` shows the pass's CUDA branches read
        # nothing on the host), around it the staging copy and the records' gathers; then the load and
        # export of the state (once per request) and the eager decoder replay
        built = PrefillRunner(model, PrefillRunnerConfig(max_context=prompt_tokens, buckets=(chunk,)))
        counter = OpCounter()
        _as_graph_replays(built, counter)

        def runner_pass(chunk: int = chunk, runner: PrefillRunner = built) -> None:
            slot = runner.acquire()
            assert slot is not None
            runner.load(slot, model.new_state())
            spans = [
                runner.encode(slot, tokens[at : at + chunk]).boundary for at in range(0, prompt_tokens, chunk)
            ]
            state = runner.export(slot)
            runner.release(slot)
            model.replay_decoder(BoundaryHidden.concat(spans).last(128), state)
            state.release_paged()

        out.setdefault("runner", {})[str(chunk)] = _count(runner_pass, counter)
        print(f"runner, chunks of {chunk}: {out['runner'][str(chunk)]}", flush=True)

    def local() -> None:
        state = model.new_state()
        model.forward_batch([BatchItem(tokens, state)])
        state.release_paged()

    out["local_prefill"] = _count(local)
    print(f"local prefill, one pass: {out['local_prefill']}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["paths", "chunks"], choices=["paths", "chunks"])
    p.add_argument("--prompt-tokens", type=int, default=256, help="paths: the prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--chunk-prompt-tokens", type=int, default=512, help="chunks: the prompt")
    p.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument(
        "--attention", default="off", help="chunks: prefill attention path (off: dense, as a CPU's auto)"
    )
    p.add_argument("--out")
    p.add_argument("--before", help="a report of this part from an earlier commit: kept as `chunks_before`")
    args = p.parse_args()
    torch.set_num_threads(1)
    report: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "machine": describe_machine("cpu"),
    }
    if "paths" in args.parts:
        model, _ = tiny()
        report["paths"] = {
            "preset": "tiny",
            "exact_replay_span": exact_replay_span(model.config),
            "arms": [decode_paths(arm, args.prompt_tokens, args.max_tokens) for arm in ARMS],
        }
        for arm in report["paths"]["arms"]:
            print(
                arm["arm"],
                arm["joins"],
                "drafted",
                arm["drafted_tokens"],
                "declined",
                arm["declined_draft_steps"],
                [(s["forward_batch_rows"], s["runner_rows"]) for s in arm["steps"]],
            )
    if "chunks" in args.parts:
        config = fit_config_to_tokenizer(preset("mini-40"), tiny_tokenizer_path())
        model, _ = random_model(config, tiny_tokenizer_path(), seed=0)
        enable_paged_attention(model, args.attention, "--attention", cpu_auto=args.attention)
        report["chunks"] = {
            "preset": "mini-40",
            "attention": args.attention,
            "exact_replay_span": exact_replay_span(model.config),
            **prefill_launches(model, args.chunk_prompt_tokens, args.chunks),
        }
    if args.before:
        before = json.loads(Path(args.before).read_text())
        report["chunks_before"] = {k: before[k] for k in ("date", "command", "commit")} | before["chunks"]
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
