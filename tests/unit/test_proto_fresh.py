"""The generated protobuf code in proto/ is what scripts/gen_proto.sh makes from the .proto sources."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

REPO = Path(__file__).resolve().parents[2]
GRPC_STAMP = re.compile(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", re.MULTILINE)
"""The `_pb2_grpc.py` files name the grpcio-tools release that made them, as the oldest grpcio they run
on. A newer grpcio-tools (1.85.4 appeared on 2026-12-06) changes only that line, so the comparison
below masks it, and checks instead that the installed grpcio is not older than the stamp."""


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".") if part.isdigit())


def _unstamped(text: str) -> str:
    return GRPC_STAMP.sub("GRPC_GENERATED_VERSION = <stamp>", text)


def test_generated_proto_code_is_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    out = tmp_path / "gen"
    subprocess.run(["bash", str(REPO / "scripts" / "gen_proto.sh"), str(out)], check=True, cwd=REPO,
                   env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    generated = sorted(p.name for p in out.iterdir() if p.is_file())
    checked_in = sorted(p.name for p in (REPO / "proto").iterdir()
                        if p.is_file() and (p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))))
    assert generated == checked_in, "run scripts/gen_proto.sh: the set of generated files differs"
    ours = {name: (REPO / "proto" / name).read_text() for name in checked_in}
    stale = [name for name in generated if _unstamped((out / name).read_text()) != _unstamped(ours[name])]
    assert not stale, f"stale generated code (run scripts/gen_proto.sh): {stale}"
    stamps = {name: stamp.group(1) for name, text in ours.items() if (stamp := GRPC_STAMP.search(text))}
    assert stamps, "no GRPC_GENERATED_VERSION line found: the stamp's pattern no longer matches the generated code"
    too_new = {name: v for name, v in stamps.items() if _version(v) > _version(grpc.__version__)}
    assert not too_new, f"generated for a newer grpcio than the installed {grpc.__version__}: {too_new}"


def test_generated_modules_import_through_the_namespace() -> None:
    from cedserve.proto import kv_transfer_pb2, kv_transfer_pb2_grpc

    assert kv_transfer_pb2.DESCRIPTOR.package == "cedserve.v1"
    assert hasattr(kv_transfer_pb2_grpc, "KVTransferControlStub")
