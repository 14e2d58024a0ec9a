"""Print the requirements one image of docker/Dockerfile installs, one per line.

    python3 requirements.py PYPROJECT             project.dependencies (the full image)
    python3 requirements.py --operator PYPROJECT  only those tool.tandem.operator-dependencies
                                                  names (the operator image: no torch)

Pins live once, in project.dependencies; the operator's list only names entries of it. Standard
library only: the build runs it before anything is installed.
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


def requirements(pyproject: dict, operator: bool) -> list[str]:
    """project.dependencies, or the operator's subset of them (every name must be there)."""
    dependencies = pyproject["project"]["dependencies"]
    if not operator:
        return dependencies
    names = pyproject["tool"]["tandem"]["operator-dependencies"]
    wanted = {requirement_name(name) for name in names}
    chosen = [r for r in dependencies if requirement_name(r) in wanted]
    missing = wanted - {requirement_name(r) for r in chosen}
    if missing:
        raise SystemExit(f"operator-dependencies not in project.dependencies: {sorted(missing)}")
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--operator", action="store_true", help="the operator image's subset")
    parser.add_argument("pyproject", type=Path)
    args = parser.parse_args()
    pyproject = tomllib.loads(args.pyproject.read_text())
    print("\n".join(requirements(pyproject, args.operator)))


if __name__ == "__main__":
    main()
