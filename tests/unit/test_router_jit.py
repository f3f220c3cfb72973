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
