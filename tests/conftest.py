"""Shared pytest setup: markers by folder, and the location of the shared reference fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tls_pki import TLSFiles

REPO = Path(__file__).resolve().parents[1]


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
