"""`cedserve bench kv-transfer` (docs/kv_transfer.md).

Reading order: `harness.py` (worker processes driven over pipes: loopback, network namespaces,
ssh hosts), `link_meter.py` (raw NIXL requests and probe arrivals: the references),
`loadtest.py` (the matrix and its report), `link_bench.py` (the probe between running workers).
"""
