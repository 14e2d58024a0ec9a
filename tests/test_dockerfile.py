"""Static checks of docker/Dockerfile: no Docker engine runs here, so the build file is parsed.

What is guarded: base images pinned by tag (a moving tag rebuilds a different image), a numeric
non-root USER (the kubelet can only verify `runAsNonRoot` for a numeric uid), an entry point that
the package really installs, a build context that keeps every file pip needs, and image names and
torch versions that agree with the chart, pyproject and CI.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import tomllib
from pathlib import Path

import yaml

import tandem
from tandem_operator.spec import default_worker_image

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / "docker" / "Dockerfile.dockerignore"
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


def test_runs_as_numeric_non_root_user() -> None:
    users = [rest for keyword, rest in instructions(DOCKERFILE.read_text()) if keyword == "USER"]
    assert users, "the image must set USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, users[-1]
    assert not gid or (gid.isdigit() and int(gid) != 0), users[-1]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == int(uid)
    assert values["podSecurityContext"]["runAsGroup"] == int(gid or uid)


def test_entrypoint_is_an_installed_console_script() -> None:
    entrypoints = [rest for keyword, rest in instructions(DOCKERFILE.read_text())
                   if keyword == "ENTRYPOINT"]
    assert entrypoints, "the image must set ENTRYPOINT"
    program = yaml.safe_load(entrypoints[-1])[0]  # exec form is a JSON (YAML) list
    assert program in PYPROJECT["project"]["scripts"]


def test_build_context_keeps_what_pip_needs() -> None:
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    setuptools = PYPROJECT["tool"]["setuptools"]
    package_dirs = setuptools.get("package-dir", {})
    needed = ["pyproject.toml", PYPROJECT["project"]["readme"]]
    for package in setuptools["packages"]:
        top = package.split(".")[0]
        needed.append(package_dirs.get(top, top) + "/__init__.py")
    for path in needed:
        parts = Path(path).parts
        excluded = [p for p in patterns for i in range(1, len(parts) + 1)
                    if fnmatch.fnmatch("/".join(parts[:i]), p.removeprefix("**/"))]
        assert not excluded, f"{path} is excluded from the build context by {excluded}"


def test_documented_tags_are_the_chart_defaults() -> None:
    """`helm install` with default values pulls exactly what the documented builds produce: the
    chart's image for the operator and schedulers, the operator's CUDA variant for GPU workers."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    image = yaml.safe_load((CHART / "values.yaml").read_text())["image"]
    assert chart["appVersion"] == tandem.__version__ == PYPROJECT["project"]["version"]
    image = {"repository": image["repository"], "tag": image["tag"] or chart["appVersion"]}
    tags = {tag for argv in documented_builds() for tag in option_values(argv, "-t")}
    assert tags == {default_worker_image(image, "cpu", 0), default_worker_image(image, "cuda", 1)}
    for argv in documented_builds():
        assert option_values(argv, "-f") == ["docker/Dockerfile"] and argv[-1] == "."


def test_torch_matches_the_ci_pin() -> None:
    steps = instructions(DOCKERFILE.read_text())
    ci_pin = re.search(r"torch==([\w.]+)", (REPO / ".ci" / "run").read_text())
    assert ci_pin is not None
    assert build_args(steps, {})["TORCH_VERSION"] == ci_pin.group(1)
    assert build_args(steps, {})["TORCH_INDEX_URL"].endswith("/cpu"), "CPU torch by default"
