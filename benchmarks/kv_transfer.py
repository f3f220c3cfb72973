"""KV transfer load test; the same as `cedserve bench kv-transfer` (see cedserve.bench.kv_transfer.loadtest).

    python benchmarks/kv_transfer.py --sizes 4K,32K,128K --reps 3
"""

from __future__ import annotations

import sys

from cedserve.bench.kv_transfer.loadtest import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
