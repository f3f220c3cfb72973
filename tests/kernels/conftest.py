"""Kernel tests run the Triton kernels on the GPU when there is one, else in Triton's CPU
interpreter. The interpreter is chosen by `TRITON_INTERPRET=1`, which must be in the environment
before triton is imported (the kernel modules import it lazily, on their first launch), so it is
set here at import time, and only when CUDA is unavailable.

Shared fixtures: `device` (where the kernel tests put their tensors) and `gen` (a fresh torch
Generator per test, seeded from the test's id so a failure reproduces).
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if CUDA else "cpu")


@pytest.fixture
def gen(request: pytest.FixtureRequest, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g
