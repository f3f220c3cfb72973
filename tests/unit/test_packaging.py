"""The wheel installs only `cedserve`, and importing it needs nothing GPU-only."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_holds_only_the_cedserve_namespace(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(REPO)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("cedserve-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"cedserve", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    names = zipfile.ZipFile(wheel).namelist()
    for pkg in ("model", "kernels", "kv_transfer", "prefill_workers", "decode_workers", "router", "proto", "training"):
        assert f"cedserve/{pkg}/__init__.py" in names, pkg
    for asset in ("config.json", "tokenizer.json", "generation_config.json", "model.safetensors"):
        assert f"cedserve/assets/demo/{asset}" in names, asset  # the embedded default's trained checkpoint


def test_import_without_gpu_packages() -> None:
    # Block the optional GPU/cluster packages; importing the package and its config must still work.
    code = (
        "import sys\n"
        "for m in ('nixl_cu12', 'nixl_cu13', 'ray', 'kubernetes', 'triton'):\n"
        "    sys.modules[m] = None\n"
        "import cedserve, cedserve.serving.config, cedserve.cli, cedserve.model.config, cedserve.model.kv_accounting\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "ok"
