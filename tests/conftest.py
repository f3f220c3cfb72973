"""Shared pytest setup: markers by folder, and the location of the shared reference fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tls_pki import TLSFiles

REPO = Path(__file__).resolve().parents[1]


def _inductor_cache_per_kernel_set() -> None:
    """Give each CPU kernel setting its own Inductor cache folder. Inductor's FX-graph cache key
    leaves out ATEN_CPU_CAPABILITY, so a graph compiled under the default ISA (AVX-512) and loaded
    under ATEN_CPU_CAPABILITY=avx2 (same thread count) returned NaN from
    test_fused.py::test_compiled_global_kv_writes_its_rings_as_written; caches off or a fresh
    folder, it passes. An explicit TORCHINDUCTOR_CACHE_DIR is left alone."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return
    import getpass
    import tempfile

    kernels = "-".join(os.environ.get(v, "default") for v in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS"))
    folder = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}_{kernels}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)


_inductor_cache_per_kernel_set()


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
