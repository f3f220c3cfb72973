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
from collections.abc import Callable
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

    call.__doc__, call.__name__, call.__qualname__ = fn.__doc__, fn.__name__, fn.__qualname__
    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return cast(_F, call)


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
    """Compile (or load from the cache) the request path's functions: an index walk and a placement
    over a tiny table. A second or two the first time on a machine, then milliseconds."""
    from cedserve.model.cache.events import AllBlocksCleared, BlockStored, KVEventBatch, Tier
    from cedserve.router.index import GlobalPrefixIndex
    from cedserve.router.load_table import LoadTable
    from cedserve.router.placement import DecodeLoad, LinkRates, PrefillLoad, RequestShape

    index = GlobalPrefixIndex()
    hashes = [bytes([i]) * 32 for i in range(2)]
    index.apply(KVEventBatch("d", 0, [AllBlocksCleared(), BlockStored(hashes, Tier.HOST)], epoch=1))
    table = LoadTable()
    table.set_prefill(PrefillLoad("p", 0, 1e4))
    table.set_decode(DecodeLoad("d", 0, 100, [0.01, 0.02], 1e4))
    links = LinkRates({}, {"host": 1e10, "disk": 1e9})
    # Both the pair and the decode-only costs are scored (the decode worker holds the whole prompt).
    table.place(RequestShape(128, 50, 64, 1024), index.prefix_runs(hashes), links, 64)
