"""Static checks of docker/Dockerfile: no Docker engine runs here, so the build file is parsed.

What is guarded: base images pinned by tag (a moving tag rebuilds a different image), a numeric
non-root USER (the kubelet can only verify `runAsNonRoot` for a numeric uid), an entry point that
the package really installs, a build context that keeps every file pip needs, and image names and
torch versions that agree with the chart, pyproject and CI.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import yaml

import tandem
from tandem_operator.spec import default_worker_image

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
REQUIREMENTS = REPO / "docker" / "requirements.py"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CHART = REPO / "charts" / "tandem"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and continuation lines joined."""
    joined = re.sub(r"\\\n", " ", "\n".join(
        line for line in text.splitlines() if not line.lstrip().startswith("#")))
    result = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def build_args(steps: list[tuple[str, str]], overrides: dict[str, str]) -> dict[str, str]:
    """ARG defaults declared anywhere in the file, replaced by `--build-arg` overrides."""
    args = {}
    for keyword, rest in steps:
        if keyword == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name] = default
    return args | overrides


def base_images(steps: list[tuple[str, str]], args: dict[str, str]) -> list[str]:
    """Every FROM image with ARG references substituted; stage names are not images."""
    stages: set[str] = set()
    images = []
    for keyword, rest in steps:
        if keyword != "FROM":
            continue
        words = [w for w in rest.split() if not w.startswith("--")]
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], words[0])
        if image not in stages:
            images.append(image)
        if len(words) == 3 and words[1].upper() == "AS":
            stages.add(words[2])
    return images


def documented_builds() -> list[list[str]]:
    """The `docker build` commands of docs/helm.md, as argument lists."""
    text = (REPO / "docs" / "helm.md").read_text()
    commands = re.findall(r"^docker build .*?(?<!\\)$", text, flags=re.M | re.S)
    return [shlex.split(command.replace("\\\n", " ")) for command in commands]


def option_values(argv: list[str], option: str) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv) if word == option]


def is_pinned(image: str) -> bool:
    """A tag that names a release (not `latest`, not absent), or a digest."""
    if "@sha256:" in image:
        return True
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag not in ("", "latest") and any(
        c.isdigit() for c in tag)


def test_base_images_are_pinned_for_every_documented_build() -> None:
    steps = instructions(DOCKERFILE.read_text())
    builds = documented_builds()
    assert len(builds) >= 2, "docs/helm.md documents the CPU and the CUDA build"
    for argv in builds:
        overrides = dict(v.split("=", 1) for v in option_values(argv, "--build-arg"))
        for image in base_images(steps, build_args(steps, overrides)):
            assert is_pinned(image), f"{image} is not pinned to a release tag ({argv})"


def stages(steps: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Each stage's instructions by stage name (its FROM ... AS name), in file order."""
    result: dict[str, list[tuple[str, str]]] = {}
    for keyword, rest in steps:
        if keyword == "FROM":
            current = result.setdefault(rest.split()[-1], [])
        elif result:
            current.append((keyword, rest))
    return result


def targets() -> dict[str, list[tuple[str, str]]]:
    """The images the file builds: the `operator` target and the default (last) stage."""
    by_name = stages(instructions(DOCKERFILE.read_text()))
    return {"operator": by_name["operator"], "default": list(by_name.values())[-1]}


def test_runs_as_numeric_non_root_user() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for target, steps in targets().items():
        users = [rest for keyword, rest in steps if keyword == "USER"]
        assert users, f"the {target} image must set USER"
        uid, _, gid = users[-1].partition(":")
        assert uid.isdigit() and int(uid) != 0, users[-1]
        assert not gid or (gid.isdigit() and int(gid) != 0), users[-1]
        assert values["podSecurityContext"]["runAsUser"] == int(uid)
        assert values["podSecurityContext"]["runAsGroup"] == int(gid or uid)


def test_entrypoint_is_an_installed_console_script() -> None:
    entrypoints = [rest for keyword, rest in instructions(DOCKERFILE.read_text())
                   if keyword == "ENTRYPOINT"]
    assert entrypoints, "the image must set ENTRYPOINT"
    program = yaml.safe_load(entrypoints[-1])[0]  # exec form is a JSON (YAML) list
    assert program in PYPROJECT["project"]["scripts"]


def context_files() -> list[str]:
    """The files of the checkout (tracked or not ignored) that .dockerignore lets into the build
    context; a pattern excludes a path when it matches the path or one of its parent folders."""
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [f for f in files if (REPO / f).is_file() and not any(
        fnmatch.fnmatch("/".join(Path(f).parts[:i]), p.removeprefix("**/"))
        for p in patterns for i in range(1, len(Path(f).parts) + 1))]


def test_one_ignore_file_for_every_builder() -> None:
    """BuildKit prefers docker/Dockerfile.dockerignore, which podman and buildah never read:
    only the root .dockerignore, which all of them read, may exist."""
    assert DOCKERIGNORE.is_file()
    assert not (REPO / "docker" / "Dockerfile.dockerignore").exists()
    assert not (REPO / ".containerignore").exists()


def test_no_build_step_writes_into_the_context() -> None:
    """podman writes a read-write bind mount of the context through to the checkout."""
    for keyword, rest in instructions(DOCKERFILE.read_text()):
        mounts = re.findall(r"--mount=(\S+)", rest) if keyword == "RUN" else []
        for mount in mounts:
            options = set(mount.split(","))
            assert not options & {"rw", "readwrite", "rw=true", "readwrite=true"}, mount


def test_image_wheel_has_every_package_but_test_support(tmp_path: Path) -> None:
    """The wheel the image installs, built as the Dockerfile's `wheel` stage builds it from what
    the context holds: every package of the checkout except tandem_testing."""
    source = tmp_path / "src"
    for name in context_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(tmp_path / "wheels"), str(source)],
                   check=True, capture_output=True, env=os.environ | {"PYTHONPATH": ""})
    (wheel,) = (tmp_path / "wheels").glob("*.whl")
    packaged = {str(Path(n).parent) for n in zipfile.ZipFile(wheel).namelist()
                if n.endswith("/__init__.py")}
    in_checkout = {str(Path(f).parent).removeprefix("operator/") for f in subprocess.run(
        ["git", "ls-files", "*__init__.py"], cwd=REPO, capture_output=True, text=True,
        check=True).stdout.split() if not f.startswith(("tests/", "bench/"))}
    assert "tandem_testing" in in_checkout and "tandem_operator" in in_checkout
    assert packaged == in_checkout - {"tandem_testing"}


def test_documented_tags_are_the_chart_defaults() -> None:
    """`helm install` with default values pulls exactly what the documented builds produce: the
    chart's image for schedulers, its CUDA variant for GPU workers (the operator's naming), and
    the `operator` target's image for the operator."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["appVersion"] == tandem.__version__ == PYPROJECT["project"]["version"]
    image = {"repository": values["image"]["repository"],
             "tag": values["image"]["tag"] or chart["appVersion"]}
    operator = values["operator"]["image"]
    tags: dict[str, set[str]] = {}
    for argv in documented_builds():
        assert option_values(argv, "-f") == ["docker/Dockerfile"] and argv[-1] == "."
        target = (option_values(argv, "--target") or ["default"])[-1]
        tags.setdefault(target, set()).update(option_values(argv, "-t"))
    assert tags == {
        "default": {default_worker_image(image, "cpu", 0), default_worker_image(image, "cuda", 1)},
        "operator": {f"{operator['repository']}:{operator['tag'] or chart['appVersion']}"},
    }
    assert set(tags) <= {"default", *stages(instructions(DOCKERFILE.read_text()))}


def operator_requirements() -> list[str]:
    """What the operator image installs: docker/requirements.py's output, as the build runs it."""
    return subprocess.run(
        [sys.executable, str(REQUIREMENTS), "--operator", str(REPO / "pyproject.toml")],
        capture_output=True, text=True, check=True).stdout.splitlines()


def test_operator_image_installs_pinned_entries_of_the_dependencies() -> None:
    chosen = operator_requirements()
    assert set(chosen) <= set(PYPROJECT["project"]["dependencies"])
    assert len(chosen) == len(PYPROJECT["tool"]["tandem"]["operator-dependencies"])
    assert not [r for r in chosen if r.startswith(("torch", "numpy", "fastapi"))], chosen


def requirement_closure(requirements: list[str]) -> set[str]:
    """Installed distributions (normalized names) these requirements pull in, transitively."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        todo += [Requirement(r) for r in metadata.requires(req.name) or []]
    return seen


def test_operator_starts_with_only_its_image_dependencies() -> None:
    """`tandem operator` (its CLI path and every tandem_operator module) imports, and answers
    --help, with every module outside the operator image's dependencies unimportable: no torch,
    no engine code's libraries."""
    from importlib import metadata

    from packaging.utils import canonicalize_name

    allowed = requirement_closure(operator_requirements())
    blocked = sorted(module for module, dists in metadata.packages_distributions().items()
                     if not {canonicalize_name(d) for d in dists} & allowed
                     and module.isidentifier() and module not in sys.stdlib_module_names
                     and canonicalize_name(dists[0]) != "tandem")
    assert "torch" in blocked and "numpy" in blocked and "kopf" not in blocked
    script = f"""
import importlib, pkgutil, sys
for name in {blocked!r}:
    sys.modules[name] = None  # import raises ImportError
import tandem_operator
for module in pkgutil.iter_modules(tandem_operator.__path__):
    importlib.import_module("tandem_operator." + module.name)
from tandem_cli.cli import main
main(["operator", "--help"])
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "usage: tandem operator" in proc.stdout, proc.stderr


def test_torch_matches_the_ci_pin() -> None:
    steps = instructions(DOCKERFILE.read_text())
    ci_pin = re.search(r"torch==([\w.]+)", (REPO / ".ci" / "run").read_text())
    assert ci_pin is not None
    assert build_args(steps, {})["TORCH_VERSION"] == ci_pin.group(1)
    assert build_args(steps, {})["TORCH_INDEX_URL"].endswith("/cpu"), "CPU torch by default"
