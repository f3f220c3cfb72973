"""The `cedserve` command line: serve, generate, inspect, bench."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

# Heavy modules (torch, the model, workers, the router) are imported inside the verbs that need them:
# `cedserve drain` runs in a pod's preStop hook and must start fast (tests/unit/test_serving.py).
if TYPE_CHECKING:
    from cedserve.common.tls import TLSConfig
    from cedserve.model.config import ModelConfig
    from cedserve.router.config import DiscoveryConfig
    from cedserve.serving.config import ServeConfig

_DESCRIPTION = """\
cedserve: disaggregated prefill/decode serving for DeepSeek-V4.1-Flash-class (CED) models.

verbs:
  serve     start the whole system (router, prefill and decode workers) on this machine,
            or on a Ray cluster with --ray
  generate  send a prompt to a running server and stream the answer
  inspect   print a model plan and its KV-cache byte accounting
  bench     load-test a running server (agentic sessions, rate sweeps, policy comparisons)
  worker    run one prefill or decode worker (what the Helm chart starts; docs/deploy.md)
  router    run the router: the public gRPC API in front of the workers
  drain     ask a local process to drain (the pods' preStop hook)
"""


def _load_model_config(args: argparse.Namespace) -> ModelConfig:
    from cedserve.model.config import ModelConfig
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


def _add_worker_parser(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    w = verbs.add_parser("worker", help="run one prefill or decode worker",
                         description="Run one worker process (flags: docs/deploy.md). Prints a line "
                                     "`CEDSERVE_READY {json}` once serving; drains on SIGTERM.")
    w.add_argument("--role", required=True, choices=["prefill", "decode"])
    w.add_argument("--config", help="serve config file (.toml or .json)")
    w.add_argument("--checkpoint", help="checkpoint folder, read-only")
    w.add_argument("--preset", help="random weights of a preset (tiny, mini-40) instead of a checkpoint")
    w.add_argument("--seed", type=int, default=0, help="seed of the preset's random weights")
    w.add_argument("--dtype", choices=["float32", "bfloat16", "auto"],
                   help="dtype of the served weights (default: the config's [model] dtype, else float32; auto: "
                        "bfloat16 on a GPU, float32 on a CPU); prefill and decode workers must agree")
    w.add_argument("--host", default="127.0.0.1", help="bind address of every listener")
    w.add_argument("--grpc-port", "--port", dest="grpc_port", type=int, default=0, help="internal gRPC port")
    w.add_argument("--nixl-port", type=int, default=0, help="NIXL agent metadata (transfer control) port")
    w.add_argument("--metrics-port", type=int, default=-1, help="Prometheus /metrics port (-1: off, 0: any)")
    w.add_argument("--dist-port", type=int, default=29500, help="torch.distributed rendezvous port")
    w.add_argument("--advertise-host", help="address peers and the router use for this pod")
    w.add_argument("--group-size", type=int, default=1)
    w.add_argument("--rank", type=int, default=0)
    w.add_argument("--leader-address")
    w.add_argument("--local-ranks", type=int, default=1,
                   help="decode: run this many ranks here, one GPU each (the group has --group-size x N ranks; "
                        "cedserve/local_ranks.py)")
    w.add_argument("--worker-id", help="unique worker name (also the NIXL agent name)")
    w.add_argument("--health-port", type=int, default=-1,
                   help="plaintext gRPC health + Drain listener for probes when TLS is on (-1: off, 0: any)")
    _add_tls_flags(w, "", "internal plane (overrides the config's [internal_tls])", server=True)
    d = verbs.add_parser("drain", help="drain a local process",
                         description="Ask the process at --address to drain; exits 0 when drained or timed out.")
    d.add_argument("--address", required=True)
    d.add_argument("--timeout-s", type=float, default=30.0)


def _add_tls_flags(p: argparse.ArgumentParser, prefix: str, what: str, server: bool) -> None:
    """`--<prefix>tls-{cert,key,ca,...}`: one `TLSConfig` (cedserve.common.tls); None where not given."""
    g = p.add_argument_group(f"TLS of the {what}")
    g.add_argument(f"--{prefix}tls-cert", metavar="PEM", help="certificate chain (served; presented under mTLS)")
    g.add_argument(f"--{prefix}tls-key", metavar="PEM", help="private key of the certificate")
    g.add_argument(f"--{prefix}tls-ca", metavar="PEM", help="CA bundle that verifies the other side")
    if server:
        g.add_argument(f"--{prefix}tls-require-client-cert", action="store_const", const=True, default=None,
                       help="mTLS: refuse clients without a certificate signed by the CA")
    g.add_argument(f"--{prefix}tls-server-name", metavar="NAME",
                   help="name expected in servers' certificates instead of the dialed host")


def _tls(args: argparse.Namespace, prefix: str, base: TLSConfig) -> TLSConfig:
    def flag(name: str) -> object:
        return getattr(args, f"{prefix}tls_{name}", None)

    return base.override(cert=flag("cert"), key=flag("key"), ca=flag("ca"),
                         require_client_cert=flag("require_client_cert"), server_name=flag("server_name"))


def _worker(args: argparse.Namespace) -> int:
    import importlib

    from cedserve.serving.worker import WorkerOptions

    fields = {k: v for k, v in vars(args).items() if k in WorkerOptions.__dataclass_fields__}
    opts = WorkerOptions(**fields)
    if args.local_ranks < 1:
        raise ValueError(f"--local-ranks: must be >= 1, got {args.local_ranks}")
    if args.local_ranks > 1:
        from cedserve.local_ranks import run_local_ranks

        return run_local_ranks(opts, args.local_ranks)
    module = importlib.import_module(f"cedserve.{args.role}_workers.main")
    code: int = module.run(opts)
    return code


def _drain(args: argparse.Namespace) -> int:
    from cedserve.drain import request_drain

    reply = request_drain(args.address, args.timeout_s)
    print(json.dumps({"reached": reply is not None, "drained": bool(reply and reply.drained),
                      "in_flight": reply.in_flight if reply else None}))
    return 0


def _add_router_parser(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = verbs.add_parser("router", help="run the router (the public gRPC API)",
                         description="Run the router in front of prefill and decode workers. Prints "
                                     "`CEDSERVE_READY {json}` once serving; stops cleanly on SIGTERM.")
    r.add_argument("--checkpoint", help="checkpoint folder (its config.json and tokenizer.json); default: "
                                        "the --config file's [model] checkpoint, or its preset")
    r.add_argument("--prefill", action="append", default=[], metavar="ID=HOST:PORT", help="a prefill worker")
    r.add_argument("--decode", action="append", default=[], metavar="ID=HOST:PORT", help="a decode worker")
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=50051)
    r.add_argument("--http-port", type=int, default=-1,
                   help="OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) beside gRPC, with "
                        "the same API keys and TLS (-1: off, the default; 0: any free port)")
    r.add_argument("--policy", choices=["cache_aware", "least_loaded", "round_robin"],
                   help="placement policy (default: the --config file's [router] policy, else cache_aware)")
    r.add_argument("--block-size", type=int, help="tokens per KV block (default: the --config file's "
                                                   "[cache] block_size, else 64); must equal the workers'")
    r.add_argument("--api-key-file", help="file with one accepted API key per line")
    r.add_argument("--worker-token-file", help="file with the worker plane's shared token, sent to workers as "
                                               "`x-cedserve-token` (default: the --config file's internal_token_file)")
    r.add_argument("--metrics-port", type=int)
    r.add_argument("--max-retries", type=int, help="re-placements after a worker failure (default 2)")
    r.add_argument("--default-max-tokens", type=int, help="output budget of requests that give none "
                                                          "(default 0: the effort level's)")
    r.add_argument("--decode-only-max-tokens", type=int,
                   help="uncached suffixes up to this many tokens may be prefilled by a decode worker (default "
                        "256; with no --prefill worker: set it to the context length for colocated serving)")
    r.add_argument("--config", help="serve config file: its [model], [cache], [tls], [internal_tls] and [router] "
                                    "tables ([router]: admission limits per effort class and the settings below; "
                                    "a flag given wins; docs/routing.md)")
    r.add_argument("--health-port", type=int, default=-1,
                   help="plaintext gRPC health listener for probes when TLS is on (-1: off, 0: any)")
    _add_tls_flags(r, "", "public port (overrides the config's [tls])", server=True)
    r.add_argument("--tls-client-ca", metavar="PEM", help="same as --tls-ca PEM --tls-require-client-cert")
    _add_tls_flags(r, "internal-", "channels to workers (overrides the config's [internal_tls])", server=False)
    k = r.add_argument_group("Kubernetes discovery (router/discovery.py; the static --prefill/--decode stay)")
    k.add_argument("--namespace", help="watch this namespace's EndpointSlices (the chart: $(POD_NAMESPACE))")
    k.add_argument("--prefill-service", help="headless Service whose EndpointSlices list the prefill pods")
    k.add_argument("--decode-service", help="headless Service whose EndpointSlices list the decode pods")
    r.add_argument("--drain-timeout-s", type=float,
                   help="on SIGTERM without a prior `cedserve drain`: how long open streams may finish (default 30)")
    r.add_argument("--exit-when-drained", action="store_true",
                   help="exit (code 0) once a `cedserve drain` has finished, instead of refusing requests until "
                        "SIGTERM: what `cedserve serve` starts its router with, so a drain stops the whole system")


def _endpoints(specs: list[str], role: str) -> tuple[object, ...]:
    from cedserve.router.config import WorkerEndpoint

    out = []
    for i, spec in enumerate(specs):
        worker_id, sep, address = spec.partition("=")
        out.append(WorkerEndpoint(worker_id, address) if sep else WorkerEndpoint(f"{role}{i}", spec))
    return tuple(out)


def _serve(args: argparse.Namespace) -> int:
    from dataclasses import replace
    from pathlib import Path

    from cedserve.launcher import EmbeddedOptions, read_serve_config
    from cedserve.supervise import serve_supervised

    config = read_serve_config(Path(args.config)) if args.config else {}
    if args.dtype:  # every worker reads [model] dtype, so they agree
        config = {**config, "model": {**config.get("model", {}), "dtype": args.dtype}}
    model, router = config.get("model", {}), config.get("router", {})
    checkpoint = args.checkpoint or (None if args.preset else model.get("checkpoint"))
    preset = args.preset or (None if args.checkpoint else model.get("preset")) or "demo"
    gpus = tuple(int(g) for g in args.gpus.split(",")) if args.gpus else ()
    opts = EmbeddedOptions(checkpoint=Path(checkpoint) if checkpoint else None, preset=preset, host=args.host,
                           port=args.port, http_port=args.http_port,
                           api_key_file=Path(args.api_key_file).resolve() if args.api_key_file else None,
                           log_dir=Path(args.log_dir) if args.log_dir else None,
                           default_max_tokens=_first(args.default_max_tokens, router.get("default_max_tokens"), 64),
                           num_prefill=args.prefill_workers, num_decode=args.decode_workers,
                           decode_group_size=args.decode_group_size,
                           policy=_first(args.policy, router.get("policy"), "cache_aware"), gpus=gpus, config=config)
    if args.ray:
        from cedserve.ray_launcher import RayOptions, serve_ray

        return serve_ray(opts, RayOptions(address=args.ray, device=args.ray_device,
                                          cpus_per_worker=args.ray_cpus_per_worker,
                                          max_restarts=args.ray_max_restarts))
    device, gpus, why = embedded_device(args.device, opts.num_ranks, gpus, opts.decode_group_size)
    print(f"workers on {device} ({why})", flush=True)
    from cedserve.supervise import RestartPolicy

    policy = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window_s)
    return serve_supervised(replace(opts, device=device, gpus=gpus), policy)


def _first(*values: Any) -> Any:
    """The first value that is not None (a flag, then the config file, then the default)."""
    return next(v for v in values if v is not None)


def embedded_device(wanted: str, ranks: int, gpus: tuple[int, ...],
                    group_size: int = 1) -> tuple[str, tuple[int, ...], str]:
    """`cedserve serve --device`: (cpu or cuda, the GPU ids the ranks take round-robin, why). auto and
    cuda take the GPUs torch sees, one per rank while they last, ranks sharing them beyond (each
    worker then under a memory share); `--gpus` names them. A decode group of `group_size` ranks needs
    as many GPUs (NCCL); auto falls back to cpu without them, an explicit cuda is an error."""
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if wanted == "cpu":
        return "cpu", (), "--device cpu"
    if have == 0:
        problem = "no GPU"
    elif gpus and max(gpus) >= have:
        problem = f"--gpus {','.join(map(str, gpus))} but torch sees {have} GPUs"
    elif have < group_size:
        problem = f"a decode group of {group_size} ranks needs {group_size} GPUs, torch sees {have}"
    else:
        chosen = gpus or tuple(range(min(have, ranks)))
        shared = "" if len(set(chosen)) >= ranks else f", shared: {ranks} ranks round-robin"
        return "cuda", chosen, f"{ranks} worker ranks on GPUs {','.join(map(str, chosen))}{shared}"
    if wanted == "cuda":
        raise SystemExit(f"cedserve serve: --device cuda: {problem}")
    return "cpu", (), f"auto: {problem}"


ROUTER_FLAGS = ("policy", "max_retries", "default_max_tokens", "decode_only_max_tokens", "drain_timeout_s")
"""`cedserve router` flags that may also come from the config file's `[router]` table (a flag wins)."""


def router_settings(args: argparse.Namespace, table: dict[str, Any]) -> dict[str, Any]:
    """`RouterConfig` settings from the config file's `[router]` table (checked), with the flags given
    on top."""
    from cedserve.router.config import router_table

    settings = router_table(table)
    settings.update({name: getattr(args, name) for name in ROUTER_FLAGS if getattr(args, name) is not None})
    return settings


def _router(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from cedserve.router.config import RouterConfig
    from cedserve.router.server import serve_forever
    from cedserve.serving.config import ServeConfig

    keys = tuple(k.strip() for k in Path(args.api_key_file).read_text().splitlines() if k.strip()) \
        if args.api_key_file else ()
    serve, tables = ServeConfig.load_with_sections(args.config, ("router",)) if args.config else (ServeConfig(), {})
    settings = router_settings(args, tables.get("router", {}))
    if args.tls_client_ca:
        args.tls_ca, args.tls_require_client_cert = args.tls_client_ca, True
    model = _router_model(args, serve)
    config = RouterConfig(checkpoint=model[0], preset=model[1], prefill=_endpoints(args.prefill, "prefill"),  # type: ignore[arg-type]
                          decode=_endpoints(args.decode, "decode"), host=args.host, port=args.port,  # type: ignore[arg-type]
                          http_port=args.http_port,
                          block_size=args.block_size or serve.cache.block_size, api_keys=keys,
                          discovery=_discovery(args), metrics_port=args.metrics_port,
                          tls=_tls(args, "", serve.tls), internal_tls=_tls(args, "internal_", serve.internal_tls),
                          health_port=args.health_port, worker_token=_worker_token(args, serve),
                          **settings)
    asyncio.run(serve_forever(config, exit_when_drained=args.exit_when_drained))
    return 0


def _worker_token(args: argparse.Namespace, serve: ServeConfig) -> str:
    """`--worker-token-file`'s token, else the --config file's `internal_token_file` ("": none)."""
    from cedserve.common.credentials import read_secret_file

    if args.worker_token_file:
        return read_secret_file(args.worker_token_file, "--worker-token-file")
    return serve.internal_token()


def _router_model(args: argparse.Namespace, serve: ServeConfig) -> tuple[str, str | None]:
    """(checkpoint, preset): `--checkpoint`, else the --config file's [model] checkpoint or preset."""
    if args.checkpoint:
        return args.checkpoint, None
    if args.config is None:
        raise ValueError("cedserve router: give --checkpoint DIR, or --config FILE with a [model] table")
    if serve.model.checkpoint:
        return serve.model.checkpoint, None
    return "", serve.model.preset


def _discovery(args: argparse.Namespace) -> DiscoveryConfig | None:
    from cedserve.router.config import DiscoveryConfig

    services = {role: name for role, name in (("prefill", args.prefill_service), ("decode", args.decode_service))
                if name}
    if args.namespace is None and not services:
        return None
    if args.namespace is None:
        raise ValueError("--prefill-service/--decode-service need --namespace")
    return DiscoveryConfig(args.namespace, services)


def _generate(args: argparse.Namespace) -> int:
    from cedserve.client import CedserveError, Client
    from cedserve.common.credentials import api_key_from_env
    from cedserve.common.tls import TLSConfig

    key = args.api_key or api_key_from_env()
    try:
        tls = _tls(args, "", TLSConfig())
        with Client(args.address, api_key=key, timeout_s=args.timeout_s, tls=tls if tls.enabled else None) as client:
            for piece in client.stream(args.prompt, effort=args.effort, max_tokens=args.max_tokens,
                                       temperature=args.temperature, seed=args.seed):
                print(piece.text, end="", flush=True)
            print()
            if args.verbose and client.last is not None:
                print(json.dumps({"finish_reason": client.last.finish_reason, **client.last.usage}), file=sys.stderr)
    except CedserveError as exc:
        where = f" (field {exc.field})" if exc.field else ""
        print(f"cedserve generate: {exc.code.name}: {exc.message}{where}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cedserve", description=_DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")

    serve = verbs.add_parser("serve", help="start router + prefill + decode workers",
                             description="Start the whole system on this machine (the embedded default) "
                                         "or place pools on a Ray cluster.")
    serve.add_argument("--checkpoint", help="checkpoint folder (config.json, tokenizer.json, safetensors); "
                       "default: the config's [model], else the shipped demo checkpoint")
    serve.add_argument("--preset", help="without a checkpoint: random weights of a preset (tiny, mini-40)")
    serve.add_argument("--dtype", choices=["float32", "bfloat16", "auto"],
                       help="dtype every worker holds the weights in (default: the config's [model] dtype, else "
                            "float32; auto: bfloat16 on a GPU, float32 on a CPU)")
    serve.add_argument("--config", help="serve config file (.toml or .json): [model], [cache], [tls], "
                       "[internal_tls] for every process, [prefill] / [decode] / [kv_transfer] for the workers "
                       "(docs/deploy.md)")
    serve.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                       help="workers' device (auto: cuda when this machine has a GPU; with fewer GPUs than worker "
                            "ranks the ranks share them, each worker under a memory share: docs/deploy.md)")
    serve.add_argument("--gpus", help="with cuda: GPU ids for the ranks in start order, round-robin, e.g. 0,1,2 or 0 "
                       "(default: every GPU, one per rank while they last)")
    serve.add_argument("--prefill-workers", type=int, default=1, help="0: colocated (decode workers prefill)")
    serve.add_argument("--decode-workers", type=int, default=1)
    serve.add_argument("--decode-group-size", type=int, default=1, help="expert-parallel ranks per decode worker")
    serve.add_argument("--policy", choices=["cache_aware", "least_loaded", "round_robin"],
                       help="the router's placement policy (default: the config's [router] policy, else cache_aware)")
    serve.add_argument("--ray", metavar="ADDRESS",
                       help="place router and pools as Ray actors: a cluster address, 'auto' (the running "
                            "cluster) or 'local' (start one here); docs/deploy.md")
    serve.add_argument("--ray-device", default="auto", choices=["auto", "cpu", "cuda"],
                       help="with --ray: workers' device (auto: cuda when the cluster has a GPU per rank)")
    serve.add_argument("--ray-cpus-per-worker", type=float, default=1.0, help="with --ray: CPUs in a worker's bundle")
    serve.add_argument("--ray-max-restarts", type=int, default=3, help="with --ray: restarts of a failed actor")
    serve.add_argument("--host", default="127.0.0.1", help="bind address of every process")
    serve.add_argument("--port", type=int, default=50051, help="public gRPC port of the router")
    serve.add_argument("--http-port", type=int, default=8000,
                       help="the router's OpenAI-compatible HTTP API (default 8000; 0: any free port; -1: off)")
    serve.add_argument("--api-key-file", help="file with one accepted API key per line: the router's gRPC and HTTP "
                                              "APIs then require one (default: open, for loopback use)")
    serve.add_argument("--log-dir", help="where each process's log goes (default: ~/.cache/cedserve/logs)")
    serve.add_argument("--max-restarts", type=int, default=5,
                       help="restarts of one process (worker or router) within --restart-window-s before the "
                            "system stops (0: stop at the first death)")
    serve.add_argument("--restart-window-s", type=float, default=600.0)
    serve.add_argument("--default-max-tokens", type=int,
                       help="output budget of requests that give none (default: the config's [router] "
                            "default_max_tokens, else 64)")

    gen = verbs.add_parser("generate", help="stream an answer from a running server",
                           description="Send a prompt to a running cedserve over gRPC and stream tokens.")
    gen.add_argument("prompt")
    gen.add_argument("--address", default="127.0.0.1:50051")
    gen.add_argument("--effort", default="high", help="1-100 or low/high/max (50/75/100)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--api-key", help="API key (default: $CEDSERVE_API_KEY)")
    gen.add_argument("--timeout-s", type=float, default=300.0)
    gen.add_argument("-v", "--verbose", action="store_true", help="print usage (tokens, TTFT) to stderr")
    _add_tls_flags(gen, "", "connection (TLS when --tls-ca or --tls-cert is given)", server=False)

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
    bench.add_argument("what", nargs="?", default="serve", choices=["serve", "kv-transfer", "held"],
                       help="serve: the serving benchmark; kv-transfer: the KV transfer load test, or with "
                            "--prefill-address/--decode-address the link between two running workers "
                            "(`cedserve bench kv-transfer --help`); held: the load, abuse and loss a system holds "
                            "(`cedserve bench held --help`)")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    _add_worker_parser(verbs)
    _add_router_parser(verbs)
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
            return _serve(args)
        if args.verb == "generate":
            return _generate(args)
        if args.verb == "router":
            return _router(args)
        if args.verb == "bench" and args.what == "held":
            from cedserve.bench.serve.held import main as held_bench

            return held_bench(args.bench_args)
        if args.verb == "bench" and args.what == "kv-transfer":
            from cedserve.bench.kv_transfer.loadtest import main as kv_transfer_bench

            return kv_transfer_bench(args.bench_args)
        if args.verb == "bench":
            from cedserve.bench.serve.main import main as serve_bench

            return serve_bench(args.bench_args)
    except ValueError as exc:
        print(f"cedserve: error: {exc}", file=sys.stderr)
        return 2
    parser.print_help()
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
