"""`router.jit.compiled` without numba: the function runs as written (the GPU recipe installs the
package's wheels without dependencies, and its router must still start and place)."""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest

from cedserve.router import jit


def _total(values: np.ndarray) -> float:
    out = 0.0
    for v in values:
        out += v
    return out


def test_without_numba_the_function_runs_as_python(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    monkeypatch.setattr(jit, "_NUMBA", [])
    total = jit.compiled(_total)
    with caplog.at_level(logging.WARNING, logger="cedserve.router.jit"):
        assert total(np.arange(5, dtype=np.float64)) == 10.0
    assert "numba is not installed" in caplog.text
    assert jit._NUMBA == [None]


_AFTER_WARM_UP = r"""
import json
from cedserve.model.cache.events import AllBlocksCleared, BlockStored, KVEventBatch, Tier
from cedserve.model.cache.hashing import hash_blocks
from cedserve.router import jit
from cedserve.router.index import GlobalPrefixIndex
from cedserve.router.load_table import LoadTable
from cedserve.router.placement import DecodeLoad, LinkRates, MeasuredLinks, PrefillLoad, RequestShape

jit.warm_up()
warm = jit.compiled_signatures()
index = GlobalPrefixIndex()
hashes = hash_blocks(list(range(64 * 6)), "t", 64)
index.apply(KVEventBatch("d3", 0, [AllBlocksCleared(), BlockStored(hashes, Tier.DEVICE)], epoch=1))
index.apply(KVEventBatch("p2", 0, [AllBlocksCleared(), BlockStored(hashes[:3], Tier.HOST)], epoch=1))
table = LoadTable()
for k in range(12):  # 144 pairs: above the pool size placed in Python
    table.set_prefill(PrefillLoad(f"p{k}", 1000 * k, 2e4))
    table.set_decode(DecodeLoad(f"d{k}", 0 if k == 3 else k, 500, [0.02, 0.021, 0.022], 5e3))
# Rates as a config file may give them: ints
ints = {"host": 20_000_000_000, "disk": 2_000_000_000}
measured = MeasuredLinks(50_000_000_000, 0.3, ints)
measured.observe("p1", "d2", 10**10, 1.0)
chosen = []
for links in (LinkRates({}, ints, default_transfer_bytes_per_s=50_000_000_000),
              LinkRates({("p0", "d1"): 9_000_000_000}, ints), measured):
    for prompt in (hashes, hashes[:5], [b"x" * 32]):
        for effort in (1, 50, 100):
            for max_tokens in (0, 64, 256):
                req = RequestShape(64 * len(prompt), effort, 64, 56_960)
                chosen.append(table.place(req, index.prefix_runs(prompt), links, max_tokens).decode_id)
print(json.dumps({"warm": warm, "after": jit.compiled_signatures(), "decode_only": "d3" in chosen}))
"""


def test_requests_after_the_warm_up_compile_nothing() -> None:
    """The router calls `warm_up` before it serves; a request must then find every compiled loop it
    calls already made for its argument types (a new type compiles on the request path: ~150 ms on a
    machine without numba's cache, 7-25 ms loading it), whatever the pool's size, link model, prefix
    holders, effort or the int or float type of configured rates."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, "-c", _AFTER_WARM_UP], capture_output=True, text=True, timeout=300,
                         check=True).stdout
    report = json.loads(out.strip().splitlines()[-1])
    warm, after = report["warm"], report["after"]
    assert report["decode_only"]  # the decode-only path ran too
    assert all(count >= 1 for name, count in warm.items() if name.startswith("cedserve.router.")), warm
    assert after == warm
