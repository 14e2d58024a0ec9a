"""Run a serving container of an operator-rendered pod as a local process.

What a pod declares (its ports, its settings) and what the process in it does must agree;
this runs the container's command with the environment the kubelet would give it, so a
test can check the process against the declaration. Only what cannot be the same on one
machine is adapted: the pod's paths point into a temporary directory, and every declared
``containerPort`` moves to a free port, the same in the port list and in every setting that
names it. The command runs from this checkout (``python -m tandem_cli.cli``).
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tandem_testing.cells import free_port

_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_LABEL = re.compile(r"metadata\.labels\['([^']+)'\]")


def pod_env(container: Mapping[str, Any], config_maps: Mapping[str, Mapping[str, str]],
            pod: Mapping[str, Any], pod_name: str, node: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it: ``envFrom`` ConfigMaps, then
    ``env`` (values, Downward API fields, ``$(VAR)`` references to earlier variables)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", ()):
        env.update(config_maps[source["configMapRef"]["name"]])
    fields = {"metadata.name": pod_name, "spec.nodeName": node}
    for item in container.get("env", ()):
        if "value" in item:
            env[item["name"]] = _VAR.sub(lambda m: env.get(m[1], m[0]), item["value"])
            continue
        path = item["valueFrom"]["fieldRef"]["fieldPath"]
        label = _LABEL.fullmatch(path)
        env[item["name"]] = (pod["metadata"]["labels"][label[1]] if label else fields[path])
    return env


def localize(container: Mapping[str, Any], env: Mapping[str, str],
             paths: Mapping[str, Path]) -> tuple[dict[str, Any], dict[str, str]]:
    """The container and its environment with each declared port moved to a free one and
    each of ``paths`` (pod path -> local directory) moved, in every setting that names it."""
    moved = copy.deepcopy(dict(container))
    ports = {p["containerPort"]: free_port() for p in moved.get("ports", ())}
    for p in moved.get("ports", ()):
        p["containerPort"] = ports[p["containerPort"]]

    def adapt(value: str) -> str:
        for old, new in ports.items():
            value = re.sub(rf"(?<![0-9]){old}(?![0-9])", str(new), value)
        for pod_path, local in paths.items():
            value = re.sub(rf"{re.escape(pod_path)}(?=/|$|,)", str(local), value)
        return value

    return moved, {k: adapt(v) for k, v in env.items()}


def declared_port(container: Mapping[str, Any], name: str) -> int:
    """The ``containerPort`` the container declares under ``name``."""
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def start(container: Mapping[str, Any], env: Mapping[str, str], log: Path) -> subprocess.Popen:
    """``command`` (``tandem <role>``) + ``args`` with exactly ``env`` (plus what runs
    Python from this checkout), output to ``log``."""
    command = [*container["command"], *container.get("args", ())]
    if command[0] != "tandem":
        raise ValueError(f"not a Tandem serving container: {command}")
    keep = {k: os.environ[k] for k in ("PATH", "PYTHONPATH") if k in os.environ}
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "tandem_cli.cli", *command[1:]],
                                env={**keep, **env, "PYTHONUNBUFFERED": "1"}, stdout=out,
                                stderr=subprocess.STDOUT)
