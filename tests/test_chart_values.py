"""values.yaml is small, fully documented, enforced by values.schema.json, and every value in it
does something: each leaf is changed to another valid value and the render must change.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest
import yaml
from test_chart_harness import (
    ALL_ON,
    ALL_ON_SETS,
    CHART,
    CI_VALUES,
    MAJORS,
    NAMESPACE,
    RenderError,
    helm_fixture,  # noqa: F401 (registers the session fixture `helm`)
    render_text,
    run_helm,
)

VALUES_TEXT = (CHART / "values.yaml").read_text()
VALUES = yaml.safe_load(VALUES_TEXT)
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
Path_ = tuple[str, ...]


def leaves(node: Any, path: Path_ = ()) -> Iterator[tuple[Path_, Any]]:
    """Scalars, lists and empty maps, with their key paths (non-empty maps are descended)."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from leaves(value, (*path, key))
    else:
        yield path, node


def with_value(path: Path_, value: Any) -> dict:
    values = json.loads(json.dumps(VALUES))
    node = values
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return values


def _digits_bumped(text: str) -> list[str]:
    """`text` with its first, then its last, run of digits incremented."""
    runs = list(re.finditer(r"\d+", text))
    return [text[:m.start()] + str(int(m.group()) + 1) + text[m.end():]
            for m in runs[:1] + runs[-1:]]


def candidates(value: Any) -> list[Any]:
    if value is None:  # unset: the operator's default applies
        return [1, "x"]
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int | float):
        return [value + 1, value - 1]
    if isinstance(value, str):
        enums = [e for s in _all_enums() for e in s if value in s and e != value]
        return [*enums, *_digits_bumped(value), f"/x{value}", f"x{value}", f"{value}x"]
    if isinstance(value, list):
        return [[], value[:-1]] if value else [["x"], [{"name": "x"}],
                                               [{"name": "X", "value": "y"}]]
    return [{"x": "y"}]


def _all_enums() -> list[list[Any]]:
    found = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "enum" in node:
                found.append(node["enum"])
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)
    walk(SCHEMA)
    return found


def valid_mutation(path: Path_, value: Any) -> Any:
    """The first candidate the schema accepts, so a render failure is never the schema's."""
    validator = jsonschema.Draft7Validator(SCHEMA)
    for candidate in candidates(value):
        if candidate != value and validator.is_valid(with_value(path, candidate)):
            return candidate
    raise AssertionError(f"no valid alternative for {'.'.join(path)}={value!r}")


BASES = [(ALL_ON, ALL_ON_SETS), ((), ()), *(((v,), ()) for v in CI_VALUES)]


def changes_render(path: Path_, value: Any, bases: list = BASES) -> bool:
    setting = f"{'.'.join(path)}={json.dumps(value)}"
    for values, sets in bases:
        try:
            if render_text("helm4", values, (*sets, setting)) != render_text("helm4", values, sets):
                return True
        except RenderError:
            return True  # a `required`/`fail` in a template reads the value
    return False


def test_every_value_is_used_by_a_template(helm: dict) -> None:
    mutations = [(path, valid_mutation(path, value)) for path, value in leaves(VALUES)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        used = list(pool.map(lambda m: changes_render(*m), mutations))
    unused = [".".join(path) for (path, _), ok in zip(mutations, used, strict=True) if not ok]
    assert not unused, f"values no template reads: {unused}"


def test_unused_value_detection_works(helm: dict) -> None:
    """The check above can fail: a value no template reads leaves the render unchanged (the
    collector's image, while the collector is off)."""
    path = ("tracing", "collector", "image")
    assert not changes_render(path, valid_mutation(path, "x:1"), bases=[((), ())])


BAD_VALUES = [
    "service.featureCache.type=\"disk\"",
    "service.featureCache.size=\"4GB\"",
    "service.worker.device=\"gpu\"",
    "service.cells=-1",
    "service.name=\"Tandem_Demo\"",
    f"service.name=\"{'a' * 40}\"",  # the CRD's limit is 39
    "service.name=\"1tandem\"",  # must start with a letter
    "operator.watchNamespaces=[\"Team_A\"]",
    "image.pullPolicy=\"Sometimes\"",
    "tracing.ratio=\"1.5\"",
    "tracing.sampler=\"sometimes\"",
    "service.scheduler.env=[{\"name\":\"X\"}]",
    "operator.resources={\"requests\":{\"cpu\":\"lots\"}}",
    "unknownTopLevel=true",
    "service.featureCache.sise=\"4Gi\"",
    "service.worker.tensorParallelSize=3",
    "service.routing.loadFactor=0.5",
    "service.model.claimName=\"Models\"",
    "service.model.subPath=\"/Qwen2-VL-2B-Instruct\"",
    "service.model.hostPath=\"var/lib/models\"",
]


@pytest.mark.parametrize("setting", BAD_VALUES)
def test_schema_rejects_bad_values(helm: dict, setting: str) -> None:
    for major in MAJORS:
        with pytest.raises(RenderError) as error:
            render_text(major, (), (setting,))
        message = str(error.value)
        assert setting.split("=")[0].split(".")[-1] in message or "additional" in message.lower()


@pytest.mark.parametrize("major", MAJORS)
@pytest.mark.parametrize("setting", BAD_VALUES[:2])
def test_lint_fails_on_bad_values(helm: dict, major: str, setting: str) -> None:
    lint = run_helm(major, "lint", "--strict", str(CHART), "--namespace", NAMESPACE,
                    "--set-json", setting)
    assert lint.returncode != 0 and "featureCache" in lint.stdout + lint.stderr


def test_defaults_pass_the_schema() -> None:
    jsonschema.Draft7Validator(SCHEMA).validate(VALUES)
    for ci in CI_VALUES:
        overlay = yaml.safe_load((CHART / ci).read_text())
        jsonschema.Draft7Validator(SCHEMA).validate(_merged(VALUES, overlay))


def _merged(base: Any, overlay: Any) -> Any:
    if isinstance(base, dict) and isinstance(overlay, dict):
        return {k: _merged(base.get(k), overlay[k]) if k in overlay else base[k]
                for k in base.keys() | overlay.keys()}
    return overlay


def documented_keys() -> dict[str, str]:
    """Dotted path -> description of the keys with a `# --` comment. Fails on a key that has
    none and is not inside a documented key or a section whose keys are all documented."""
    documented, stack, comment = {}, [], []
    lines = VALUES_TEXT.splitlines()
    for number, line in enumerate(lines):
        stripped = line.strip()
        if stripped.startswith("#"):
            if stripped.startswith("# --"):
                comment = [stripped.removeprefix("# --").strip()]
            elif comment:
                comment.append(stripped.removeprefix("#").strip())
            continue
        match = re.match(r"^( *)([\w.-]+):(.*)$", line)
        if not match:
            comment = []
            continue
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3).strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        inherited = any(doc for _, _, doc in stack)
        following = next((x for x in lines[number + 1:] if x.strip()
                          and not x.strip().startswith("#")), "")
        is_section = not rest and len(following) - len(following.lstrip()) > indent
        assert inherited or comment or is_section, f"values.yaml:{number + 1}: {key} undocumented"
        if comment and not inherited:
            documented[".".join([k for _, k, _ in stack] + [key])] = " ".join(comment)
        stack.append((indent, key, bool(comment) or inherited))
        comment = []
    return documented


def values_table() -> str:
    """The README's values table, generated from values.yaml: print it with
    `python -c 'import sys; sys.path[:0] = ["tests"]; import test_chart_values as t;
    print(t.values_table())'`."""
    rows = ["| key | default | description |", "|---|---|---|"]
    for key, description in documented_keys().items():
        node: Any = VALUES
        for part in key.split("."):
            node = node[part]
        cell = description.replace("|", "\\|")
        rows.append(f"| `{key}` | `{json.dumps(node)}` | {cell} |")
    return "\n".join(rows) + "\n"


def test_values_file_is_small_and_documented() -> None:
    assert len(VALUES_TEXT.splitlines()) < 300
    keys = documented_keys()
    assert len(keys) > 50 and "service.featureCache.size" in keys


def test_readme_lists_every_documented_value() -> None:
    readme = (CHART / "README.md").read_text()
    assert values_table() in readme, "regenerate the table (see values_table)"
