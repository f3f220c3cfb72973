"""The `cedserve` command line: serve, generate, inspect, bench."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from cedserve.model.config import ModelConfig

_DESCRIPTION = """\
cedserve: disaggregated prefill/decode serving for DeepSeek-V4.1-Flash-class (CED) models.

verbs:
  serve     start the whole system (router, prefill and decode workers) on this machine,
            or on a Ray cluster with --ray
  generate  send a prompt to a running server and stream the answer
  inspect   print a model plan and its KV-cache byte accounting
  bench     load-test a running server (agentic sessions, rate sweeps, policy comparisons)
  worker    run one prefill or decode worker (what the Helm chart starts; docs/deploy.md)
  drain     ask a local process to drain (the pods' preStop hook)
"""


class NotBuiltError(RuntimeError):
    """A verb whose subsystem does not exist yet."""


def _load_model_config(args: argparse.Namespace) -> ModelConfig:
    from cedserve.model.presets import preset

    if args.config is not None:
        return ModelConfig.from_hf_json(args.config)
    return preset(args.preset)


def _inspect(args: argparse.Namespace) -> int:
    from cedserve.inspect import inspect_dict, render_inspect

    config = _load_model_config(args)
    if args.json:
        print(json.dumps(inspect_dict(config, args.block_size), indent=2))
    else:
        print(render_inspect(config, args.block_size, source=args.config or f"preset {args.preset}"))
    return 0


def _not_built(verb: str, issue: str) -> int:
    print(f"cedserve {verb}: not built yet ({issue}); nothing was started.", file=sys.stderr)
    return 2


def _add_worker_parser(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    w = verbs.add_parser("worker", help="run one prefill or decode worker",
                         description="Run one worker process (flags: docs/deploy.md). Prints a line "
                                     "`CEDSERVE_READY {json}` once serving; drains on SIGTERM.")
    w.add_argument("--role", required=True, choices=["prefill", "decode"])
    w.add_argument("--config", help="serve config file (.toml or .json)")
    w.add_argument("--checkpoint", help="checkpoint folder, read-only")
    w.add_argument("--preset", help="random weights of a preset (tiny, mini-40) instead of a checkpoint")
    w.add_argument("--seed", type=int, default=0, help="seed of the preset's random weights")
    w.add_argument("--host", default="127.0.0.1", help="bind address of every listener")
    w.add_argument("--grpc-port", "--port", dest="grpc_port", type=int, default=0, help="internal gRPC port")
    w.add_argument("--nixl-port", type=int, default=0, help="NIXL agent metadata (transfer control) port")
    w.add_argument("--metrics-port", type=int, default=-1, help="Prometheus /metrics port (-1: off, 0: any)")
    w.add_argument("--dist-port", type=int, default=29500, help="torch.distributed rendezvous port")
    w.add_argument("--advertise-host", help="address peers and the router use for this pod")
    w.add_argument("--group-size", type=int, default=1)
    w.add_argument("--rank", type=int, default=0)
    w.add_argument("--leader-address")
    w.add_argument("--worker-id", help="unique worker name (also the NIXL agent name)")
    d = verbs.add_parser("drain", help="drain a local process",
                         description="Ask the process at --address to drain; exits 0 when drained or timed out.")
    d.add_argument("--address", required=True)
    d.add_argument("--timeout-s", type=float, default=30.0)


def _worker(args: argparse.Namespace) -> int:
    import importlib

    from cedserve.serving import WorkerOptions

    fields = {k: v for k, v in vars(args).items() if k in WorkerOptions.__dataclass_fields__}
    opts = WorkerOptions(**fields)
    module = importlib.import_module(f"cedserve.{args.role}_workers.main")
    code: int = module.run(opts)
    return code


def _drain(args: argparse.Namespace) -> int:
    from cedserve.serving import request_drain

    reply = request_drain(args.address, args.timeout_s)
    print(json.dumps({"reached": reply is not None, "drained": bool(reply and reply.drained),
                      "in_flight": reply.in_flight if reply else None}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cedserve", description=_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")

    serve = verbs.add_parser("serve", help="start router + prefill + decode workers",
                             description="Start the whole system on this machine (the embedded default) "
                                         "or place pools on a Ray cluster.")
    serve.add_argument("--checkpoint", help="checkpoint folder (config.json, tokenizer.json, safetensors)")
    serve.add_argument("--config", help="serve config file (.toml or .json)")
    serve.add_argument("--ray", metavar="ADDRESS", help="Ray cluster address, or 'auto'")

    gen = verbs.add_parser("generate", help="stream an answer from a running server",
                           description="Send a prompt to a running cedserve over gRPC and stream tokens.")
    gen.add_argument("prompt")
    gen.add_argument("--address", default="127.0.0.1:50051")
    gen.add_argument("--effort", default="high", help="1-100 or low/high/max (50/75/100)")
    gen.add_argument("--max-tokens", type=int, default=64)

    insp = verbs.add_parser("inspect", help="print the layer plan and KV byte accounting",
                            description="Print a model plan (roles, CSA2 modes, borrowed layers) and its "
                                        "KV-cache accounting: global bytes per token by source layer, SWA "
                                        "bytes per request, paged block bytes.")
    src = insp.add_mutually_exclusive_group()
    src.add_argument("--preset", default="v4.1-flash", help="v4.1-flash, mini-40 or tiny")
    src.add_argument("--config", help="a Hugging Face config.json (or its folder)")
    insp.add_argument("--block-size", type=int, default=64, help="tokens per paged block")
    insp.add_argument("--json", action="store_true", help="print JSON instead of a table")

    bench = verbs.add_parser("bench", help="load-test a running server",
                             description="Drive a running server over its public gRPC API.")
    bench.add_argument("what", nargs="?", default="serve", choices=["serve", "kv-transfer"],
                       help="serve: the serving benchmark; kv-transfer: the KV transfer load test "
                            "(`cedserve bench kv-transfer --help`)")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    _add_worker_parser(verbs)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.verb == "inspect":
            return _inspect(args)
        if args.verb == "worker":
            return _worker(args)
        if args.verb == "drain":
            return _drain(args)
        if args.verb == "serve":
            return _not_built("serve", "the embedded launcher comes with the deployment issue")
        if args.verb == "generate":
            return _not_built("generate", "the public gRPC API comes with the router issue")
        if args.verb == "bench" and args.what == "kv-transfer":
            from cedserve.kv_transfer.loadtest import main as kv_transfer_bench

            return kv_transfer_bench(args.bench_args)
        if args.verb == "bench":
            return _not_built("bench", "the serving benchmark comes with its own issue")
    except ValueError as exc:
        print(f"cedserve: error: {exc}", file=sys.stderr)
        return 2
    parser.print_help()
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
