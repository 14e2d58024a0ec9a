"""The committed generated code must be exactly what grpcio-tools makes from proto/."""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    protos = sorted((ROOT / "proto").rglob("*.proto"))
    assert protos, "no .proto sources found"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}",
         f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
         *map(str, protos)],
        check=True,
    )
    fresh = tmp_path / "tandem" / "v1"
    committed = ROOT / "tandem" / "v1"
    generated = sorted(p.name for p in fresh.iterdir())
    assert generated, "protoc generated nothing"
    mismatch = [n for n in generated if not filecmp.cmp(fresh / n, committed / n, shallow=False)]
    assert not mismatch, (
        f"generated code is stale: {mismatch}; regenerate with "
        "python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. "
        "proto/tandem/v1/*.proto"
    )
    stray = {p.name for p in committed.glob("*_pb2*")} - set(generated)
    assert not stray, f"generated files without a .proto source: {stray}"
    shutil.rmtree(tmp_path / "tandem")


def test_the_ext_proc_subset_matches_its_proto(tmp_path: Path) -> None:
    """router_svc/ext_proc.proto (Envoy's messages the endpoint picker speaks)."""
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT}", f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", str(ROOT / "router_svc" / "ext_proc.proto")],
        check=True,
    )
    for name in ("ext_proc_pb2.py", "ext_proc_pb2.pyi"):
        assert filecmp.cmp(tmp_path / "router_svc" / name, ROOT / "router_svc" / name,
                           shallow=False), (
            f"router_svc/{name} is stale; regenerate with python -m grpc_tools.protoc -I. "
            "--python_out=. --pyi_out=. router_svc/ext_proc.proto")
