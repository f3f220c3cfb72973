"""The serving base layer, shared by the prefill and decode workers and the router.

Below the processes, above `kv_transfer` and the model. By concern:

* `config.py`: the serve config (`ServeConfig`: `[model]`, `[cache]`, TLS, the worker-plane token);
* `errors.py`: the engines' domain errors (`cedserve.common.errors`) mapped to `ErrorDetail` and gRPC
  statuses, the one place they meet the wire;
* `server.py`: the gRPC server with health, the worker-plane token check, the metrics endpoint;
* `drain.py`: the drain state of a process and the loopback-only `Lifecycle.Drain` servicer;
* `kv_events.py`: the fan-out of a worker's KV event batches to `StreamKVEvents` calls;
* `load.py`: the measured rate and sequence numbers of load reports;
* `ready.py`: the ready line launchers wait for;
* `worker_model.py`: the model a worker serves and its identity;
* `gpu_memory.py`: a worker's share of its GPU (the allocator cap, the start-up check that the
  model and its caches fit, the memory gauges);
* `worker.py`: the worker process skeleton both worker mains are built from (options, settings,
  cache, registry, NIXL agent, server, signals, the drain loop).

The router imports `server` and `drain` only (the CLI also `config`); they, `config`, `load`,
`ready`, `kv_events` and `worker_model` import no torch; `errors` (through the transfer layer's typed
errors), `gpu_memory` and `worker` do.
"""
