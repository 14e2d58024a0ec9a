"""Print the requirements one image of docker/Dockerfile installs, one per line.

    python3 requirements.py PYPROJECT              project.dependencies (the full image)
    python3 requirements.py --operator PYPROJECT   only those tool.tandem.operator-dependencies
                                                   names (the operator image: no torch)
    python3 requirements.py --gpu-check PYPROJECT  tool.tandem.gpu-check-dependencies: what
                                                   bench/gpu_check.sh installs from wheels

Pins live once, in project.dependencies and the optional extras; the subsets only name
entries of them. Standard library only: the build runs it before anything is installed.
"""

from __future__ import annotations

import argparse
import re
import tomllib
from pathlib import Path


def requirement_name(requirement: str) -> str:
    """The distribution name of a requirement string, normalized as PEP 503 does."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(pyproject: dict, subset: str | None = None) -> list[str]:
    """project.dependencies, or the subset ``tool.tandem.<subset>`` names, picked from
    project.dependencies and the optional extras (every name must be there)."""
    project = pyproject["project"]
    if subset is None:
        return project["dependencies"]
    pool = project["dependencies"] + [
        r for extra in project.get("optional-dependencies", {}).values() for r in extra]
    wanted = {requirement_name(name) for name in pyproject["tool"]["tandem"][subset]}
    chosen = [r for r in pool if requirement_name(r) in wanted]
    missing = wanted - {requirement_name(r) for r in chosen}
    if missing:
        raise SystemExit(f"{subset} not in the project's requirements: {sorted(missing)}")
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--operator", dest="subset", action="store_const",
                       const="operator-dependencies", help="the operator image's subset")
    which.add_argument("--gpu-check", dest="subset", action="store_const",
                       const="gpu-check-dependencies", help="bench/gpu_check.sh's subset")
    parser.add_argument("pyproject", type=Path)
    args = parser.parse_args()
    pyproject = tomllib.loads(args.pyproject.read_text())
    print("\n".join(requirements(pyproject, args.subset)))


if __name__ == "__main__":
    main()
