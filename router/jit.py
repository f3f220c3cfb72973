"""The request path's loops in native code: plain Python functions compiled by numba on first use.

The index walk and the placement scores are loops over a prompt's blocks and over the workers; as
numpy they were a few dozen calls of a few microseconds each (more with the caches cold after a
thousand load reports), compiled they are one call each with no array made per request. A function
marked `@compiled` is ordinary, typed Python (mypy checks it, and it runs as written under
`NUMBA_DISABLE_JIT=1`); on its first call numba compiles it in nopython mode, and caches the
machine code beside the source (`__pycache__`, or numba's user-wide cache where that is read-only), so
a later process loads it in milliseconds instead of compiling it again (about a second a function).

numba is imported on first use, not when `cedserve.router` is: importing the package stays cheap.
`warm_up` compiles (or loads) every function of the request path before the router serves, so the
first request does not pay for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

_F = TypeVar("_F", bound=Callable[..., Any])
log = logging.getLogger(__name__)


def compiled(fn: _F) -> _F:
    """`fn` compiled by numba (nopython, no GIL held, cached on disk) on its first call. `fn` must be
    a module-level function that numba can compile: arrays and numbers in, numbers out. Division
    follows numpy (x / 0.0 is inf, with no check per division), not Python's ZeroDivisionError."""
    native: Callable[..., Any] | None = None

    def call(*args: Any) -> Any:
        nonlocal native
        if native is None:
            numba = _numba()
            native = fn if numba is None else numba.njit(cache=True, nogil=True, error_model="numpy")(fn)
        return native(*args)

    def signatures() -> int:
        return len(getattr(native, "signatures", ())) if native is not None else 0

    call.__doc__, call.__name__, call.__qualname__ = fn.__doc__, fn.__name__, fn.__qualname__
    call.__wrapped__ = fn  # type: ignore[attr-defined]
    _SIGNATURES[f"{fn.__module__}.{fn.__qualname__}"] = signatures
    return cast(_F, call)


_SIGNATURES: dict[str, Callable[[], int]] = {}
"""Every `compiled` function's name -> how many typed versions numba has made or loaded of it."""


def compiled_signatures() -> dict[str, int]:
    """How many typed versions of each `compiled` function exist in this process (0: not called yet,
    or numba missing). A request whose arguments have other types than `warm_up`'s compiles a new
    version on the request path (a second the first time on a machine): tests compare this before and
    after a request."""
    return {name: count() for name, count in _SIGNATURES.items()}


_NUMBA: list[Any] = []
"""The numba module once looked for (None where it is not installed)."""


def _numba() -> Any:
    """numba, or None where it is not installed: the functions then run as written, as Python (correct,
    but a 64K-token prompt's walk costs milliseconds instead of tens of microseconds); logged once. A
    dependency of the package, so only a host that installs without dependencies lacks it (the GPU
    recipe's `--no-deps` wheels: scripts/gpu.sh)."""
    if not _NUMBA:
        module: Any = None
        try:
            import numba

            module = numba
        except ImportError:
            log.warning("numba is not installed: the router's index walk and placement run as Python "
                        "(slower with large prompts and many workers; pip install numba)")
        _NUMBA.append(module)
    return _NUMBA[0]


def warm_up() -> None:
    """Compile (or load from the cache) the request path's functions with the argument types requests
    bring: an index walk, and placements through the compiled loops (whatever the pool's size: a
    small pool is placed in Python, a large one here) with either link model, with and without
    prefix holders, on the pair and the decode-only paths. A second or two the first time on a
    machine, then milliseconds."""
    from cedserve.model.cache.events import AllBlocksCleared, BlockStored, KVEventBatch, Tier
    from cedserve.router.index import GlobalPrefixIndex
    from cedserve.router.load_table import LoadTable, TierRun
    from cedserve.router.placement import DecodeLoad, LinkRates, MeasuredLinks, PrefillLoad, RequestShape

    index = GlobalPrefixIndex()
    hashes = [bytes([i]) * 32 for i in range(2)]
    index.apply(KVEventBatch("d0", 0, [AllBlocksCleared(), BlockStored(hashes, Tier.HOST)], epoch=1))
    index.apply(KVEventBatch("p0", 0, [AllBlocksCleared(), BlockStored(hashes[:1], Tier.DISK)], epoch=1))
    table = LoadTable()
    for k in range(2):
        table.set_prefill(PrefillLoad(f"p{k}", 0, 1e4))
        table.set_decode(DecodeLoad(f"d{k}", 0, 100, [0.01, 0.02], 1e4))
    tiers = {"host": 1e10, "disk": 1e9}
    measured = MeasuredLinks(1e9, 0.3, tiers)
    measured.observe("p0", "d0", 10**9, 1.0)
    held: Mapping[str, TierRun] = index.prefix_runs(hashes)
    for links in (LinkRates({}, tiers), LinkRates({("p1", "d1"): 2e9}, tiers), measured):
        for runs in (held, {}):
            # the decode worker holding the whole prompt scores the decode-only costs too
            for max_tokens in (64, 0):
                table.place_compiled(RequestShape(128, 50, 64, 1024), runs, links, max_tokens)
