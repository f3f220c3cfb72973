"""Fixtures for the model tests: the tiny reference checkpoint A, loaded once per session."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from cedserve.model.checkpoint import load_model
from cedserve.model.network import CEDModel


def reference_a_dir() -> Path:
    """`../shared/fixtures/deepseek_v41_reference_A` beside the repo, or $CEDSERVE_FIXTURE_A."""
    env = os.environ.get("CEDSERVE_FIXTURE_A")
    return Path(env) if env else Path(__file__).parents[2].parent / "shared/fixtures/deepseek_v41_reference_A"


@dataclass(frozen=True)
class ReferenceA:
    """The fixture's model (loaded by our loader) and the reference's recorded outputs."""

    folder: Path
    model: CEDModel
    prompts: list[list[int]]
    results: list[dict[str, Any]]

    def tensor(self, file_stem: str) -> torch.Tensor:
        """`logits` of `<file_stem>.safetensors`, e.g. `logits_0` or `decode_logits_2`."""
        return load_file(str(self.folder / f"{file_stem}.safetensors"))["logits"]


@pytest.fixture(scope="session")
def reference_a() -> Iterator[ReferenceA]:
    folder = reference_a_dir()
    if not (folder / "model.safetensors").is_file():
        pytest.skip(f"reference fixture A not found at {folder} (set CEDSERVE_FIXTURE_A)")
    prompts = json.loads((folder / "inputs.json").read_text())["sequences"]
    results = json.loads((folder / "outputs.json").read_text())["results"]
    # The tiny model's ops are too small for intra-op threads: one thread is faster on 2 cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield ReferenceA(folder, load_model(folder), prompts, results)
    torch.set_num_threads(threads)
