"""Shared pytest setup: markers by folder, and the location of the shared reference fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tls_pki import TLSFiles

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """Give each ATEN_CPU_CAPABILITY its own Inductor cache folder, unless TORCHINDUCTOR_CACHE_DIR is
    set. Inductor's CPU code is generated for the vector ISA that variable picks (unset: the
    machine's best, AVX-512 here; `avx2`; `default`: none), but its FX-graph cache key leaves the
    variable out: in one shared folder, a graph compiled unset and loaded under `avx2` returned NaN
    from test_fused.py::test_compiled_global_kv_writes_its_rings_as_written, and under `default` it
    failed to compile (`at::vec` undeclared). So unset and `default` must not share a folder. The
    thread count, which the generated code also depends on, is in Inductor's key already.
    MKL_ENABLE_INSTRUCTIONS only steers MKL's own kernels at run time, not Inductor's code."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    import getpass
    import re
    import tempfile

    isa = re.sub(r"[^A-Za-z0-9_.-]", "_", os.environ.get("ATEN_CPU_CAPABILITY", "unset"))
    folder = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}_isa-{isa}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)


def fixture_a_dir() -> Path:
    """The reference fixture folder (`../shared/fixtures/deepseek_v41_reference_A`), overridable by env."""
    env = os.environ.get("CEDSERVE_FIXTURE_A")
    return Path(env) if env else REPO.parent / "shared" / "fixtures" / "deepseek_v41_reference_A"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers = {"unit": pytest.mark.unit, "kernels": pytest.mark.kernels, "e2e": pytest.mark.e2e}
    for item in items:
        parts = Path(str(item.fspath)).parts
        for name, mark in tiers.items():
            if name in parts:
                item.add_marker(mark)


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    """Certificates for TLS/mTLS tests (needs `cryptography`, in the dev extra)."""
    return TLSFiles(tmp_path_factory.mktemp("pki"))
