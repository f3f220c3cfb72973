"""The generated protobuf code in proto/ is what scripts/gen_proto.sh makes from the .proto sources."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_generated_proto_code_is_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    out = tmp_path / "gen"
    subprocess.run(["bash", str(REPO / "scripts" / "gen_proto.sh"), str(out)], check=True, cwd=REPO,
                   env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    generated = sorted(p.name for p in out.iterdir() if p.is_file())
    checked_in = sorted(p.name for p in (REPO / "proto").iterdir()
                        if p.is_file() and (p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))))
    assert generated == checked_in, "run scripts/gen_proto.sh: the set of generated files differs"
    stale = [name for name in generated
             if (out / name).read_text() != (REPO / "proto" / name).read_text()]
    assert not stale, f"stale generated code (run scripts/gen_proto.sh): {stale}"


def test_generated_modules_import_through_the_namespace() -> None:
    from cedserve.proto import kv_transfer_pb2, kv_transfer_pb2_grpc

    assert kv_transfer_pb2.DESCRIPTOR.package == "cedserve.v1"
    assert hasattr(kv_transfer_pb2_grpc, "KVTransferControlStub")
