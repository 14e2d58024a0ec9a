"""The layout's import rules (docs/architecture.md, "Parts and arrows"), read from the code.

Every ``import`` and ``from ... import`` of every production module counts, lazy ones inside
functions and ``TYPE_CHECKING`` blocks included: a lazy import is still an arrow.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# top-level package -> its folder
PACKAGES = {
    "tandem": ROOT / "tandem",
    "scheduler_svc": ROOT / "scheduler_svc",
    "worker_svc": ROOT / "worker_svc",
    "router_svc": ROOT / "router_svc",
    "tandem_operator": ROOT / "operator" / "tandem_operator",
    "tandem_cli": ROOT / "tandem_cli",
    "tandem_testing": ROOT / "tandem_testing",
}
SERVICES = {"scheduler_svc", "worker_svc", "router_svc", "tandem_operator"}
# (importing package, imported top-level module or package prefix): never
NEVER = [
    ("scheduler_svc", "worker_svc"),
    ("worker_svc", "scheduler_svc"),
    *(("tandem", target) for target in [*SERVICES, "tandem_cli", "tandem_testing"]),
    *((service, other) for service in SERVICES
      for other in [*(SERVICES - {service}), "tandem_cli", "tandem_testing"]
      if {service, other} != {"scheduler_svc", "worker_svc"}),
    ("tandem_operator", "torch"),
    ("tandem_cli", "tandem_testing"),
]
# The SHM store knows bytes: not torch, grpc, protobuf or the features built on it.
SHM_NEVER = ["torch", "grpc", "google.protobuf", "tandem.features", "tandem.v1"]


def modules(package: str) -> Iterator[tuple[str, Path]]:
    folder = PACKAGES[package]
    for path in sorted(folder.rglob("*.py")):
        if package == "tandem" and path.parts[len(folder.parts)] == "v1":
            continue  # generated code
        rel = path.relative_to(folder).with_suffix("")
        parts = [package, *rel.parts]
        if parts[-1] == "__init__":
            parts.pop()
        yield ".".join(parts), path


def imports(module: str, path: Path) -> set[str]:
    """Absolute names of what ``module`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def all_imports() -> dict[str, set[str]]:
    return {name: imports(name, path) for package in PACKAGES
            for name, path in modules(package)}


def hits(names: set[str], target: str) -> list[str]:
    return sorted(n for n in names if n == target or n.startswith(target + "."))


GRAPH = all_imports()


def test_the_walk_sees_every_package() -> None:
    """Guards the analysis: each package has modules, and known arrows are seen."""
    for package in PACKAGES:
        assert any(m.split(".")[0] == package for m in GRAPH), package
    assert "scheduler_svc.engine" in GRAPH["scheduler_svc.server"]
    assert hits(GRAPH["tandem_cli.cli"], "scheduler_svc"), "the CLI's lazy imports count"


@pytest.mark.parametrize(("source", "target"), NEVER, ids=lambda x: str(x))
def test_never_arrows(source: str, target: str) -> None:
    offenders = {m: hits(names, target) for m, names in GRAPH.items()
                 if m.split(".")[0] == source and hits(names, target)}
    assert not offenders, f"{source} must not import {target}: {offenders}"


def test_only_the_composition_root_imports_services() -> None:
    offenders = {}
    for module, names in GRAPH.items():
        package = module.split(".")[0]
        if package in ("tandem_cli", "tandem_testing"):
            continue
        used = {s for s in SERVICES - {package} if hits(names, s)}
        if used:
            offenders[module] = sorted(used)
    assert not offenders, offenders


def test_the_store_knows_bytes() -> None:
    offenders = {m: [t for t in SHM_NEVER if hits(names, t)]
                 for m, names in GRAPH.items() if m.startswith("tandem.shm")}
    assert not any(offenders.values()), offenders


def test_no_import_cycles() -> None:
    """Between the modules of our packages (``from pkg import module`` counts as importing
    that module)."""
    edges = {m: {t for n in names for t in _resolve(n)} - {m} for m, names in GRAPH.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _resolve(name: str) -> set[str]:
    """The module of ours an imported name refers to (a module, or a name in one)."""
    if name in GRAPH:
        return {name}
    parent = name.rpartition(".")[0]
    return {parent} if parent in GRAPH else set()


def test_tests_and_benchmarks_import_the_harness_without_path_edits() -> None:
    """What tests and benchmarks share lives in ``tandem_testing``: no ``sys.path`` edits."""
    offenders = []
    for folder in ("tests", "bench", "tandem_testing"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.Attribute) and node.attr == "path"
                        and isinstance(node.value, ast.Name) and node.value.id == "sys"):
                    offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"sys.path used in {sorted(set(offenders))}"
