"""The committed gRPC stubs are exactly what scripts/gen_protos.sh produces from protos/."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_committed_stubs_match_the_protos(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is not installed (pip install -e .[dev])")
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos").rglob("*.proto"))
    # The same command as scripts/gen_protos.sh, writing into a temporary directory.
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iprotos", f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", *protos], cwd=ROOT, check=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py"))
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "ravnest" / "v1").glob("*_pb2*.py"))
    assert generated == committed, "stub files differ: run scripts/gen_protos.sh"
    for path in generated:
        assert (tmp_path / path).read_bytes() == (ROOT / path).read_bytes(), \
            f"{path} is stale: run scripts/gen_protos.sh"
