"""Benchmarks the `cedserve bench ...` commands run; developer scripts in `benchmarks/` import them.

- `serve/`: `cedserve bench serve` (agent sessions and Mooncake traces against the public API,
  docs/bench-serve.md) and `cedserve bench held` (held-stream flood against a running router).
- `kv_transfer/`: `cedserve bench kv-transfer`: the matrix load test over worker processes
  (`loadtest.py` over `harness.py`), the NIXL references it compares with (`link_meter.py`), and
  the link probe between running workers (`link_bench.py`, what `helm test` runs).

Nothing serving imports from here.
"""
