"""The serving base layer, shared by the prefill and decode workers and the router.

Below the processes, above `kv_transfer` and the model. By concern:

* `errors.py`: the request-level errors and their gRPC status mapping (`ErrorDetail` trailers);
* `server.py`: the gRPC server with health, the worker-plane token check, the metrics endpoint;
* `drain.py`: the drain state of a process and the loopback-only `Lifecycle.Drain` servicer;
* `kv_events.py`: the fan-out of a worker's KV event batches to `StreamKVEvents` calls;
* `load.py`: the measured rate and sequence numbers of load reports;
* `ready.py`: the ready line launchers wait for;
* `worker_model.py`: the model a worker serves and its identity, checked against the serve config;
* `worker.py`: the worker process skeleton both worker mains are built from (options, settings,
  cache, registry, NIXL agent, server, signals, the drain loop).

The router imports `server` and `drain` only; they, `load`, `ready`, `kv_events` and `worker_model`
import no torch. `errors` (through the transfer layer's typed errors) and `worker` do.
"""
