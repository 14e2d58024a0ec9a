"""The operator's rendered pods, run as local processes: what a pod declares is what the
process in it serves (issue 22, item 16: workers served /metrics one port above the one
their pod declares, so the PodMonitor scraped no worker)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kube_emulator.fixtures import tandem_spec

from tandem_operator.manifests import SHM_MOUNT, build_configmap
from tandem_operator.placement import Cell
from tandem_operator.workloads import build_pod_template
from tandem_testing import pods
from tandem_testing.cells import stop_process

CELL = Cell(index=0, node="node-a", cache_bytes=64 << 20, requested_bytes=64 << 20,
            generation=1)
POD_INDEX = "apps.kubernetes.io/pod-index"  # set on each pod by the StatefulSet controller


def _render(component: str, shm: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The cell's scheduler or worker-0 container, localized, and its environment."""
    spec = tandem_spec({})
    config = build_configmap(spec, CELL)
    template = build_pod_template(spec, CELL, component)
    template["metadata"]["labels"][POD_INDEX] = "0"
    container = template["spec"]["containers"][0]
    env = pods.pod_env(container, {config["metadata"]["name"]: config["data"]}, template,
                       f"demo-0-{component}-0", CELL.node)
    return pods.localize(container, env, {SHM_MOUNT: shm})


@pytest.fixture(scope="module")
def cell_pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    """The scheduler and worker pods of one cell, started from their rendered specs."""
    tmp = tmp_path_factory.mktemp("pods")
    shm = tmp / "segment"  # the pods' cell directory (the init container makes it 0700)
    shm.mkdir(mode=0o700)
    started: list = []
    rendered = {}
    try:
        for component in ("worker", "scheduler"):
            container, env = _render(component, shm)
            started.append(pods.start(container, env, tmp / f"{component}.log"))
            rendered[component] = container
        _wait_http(f"http://127.0.0.1:{pods.declared_port(rendered['scheduler'], 'http')}"
                   "/v1/models", started, tmp)
        yield rendered
    finally:
        for proc in reversed(started):  # the scheduler first, as its workers outlive it
            stop_process(proc, 30)


def _wait_http(url: str, procs: list, tmp: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            break
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in tmp.glob("*.log"))
    raise TimeoutError(f"the cell's pods did not serve {url}:\n{logs}")


@pytest.mark.parametrize("component", ["worker", "scheduler"])
def test_metrics_are_served_on_the_port_the_pod_declares(
        cell_pods: dict[str, dict[str, Any]], component: str) -> None:
    port = pods.declared_port(cell_pods[component], "metrics")
    try:
        reply = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    except httpx.ConnectError:
        pytest.fail(f"the {component} pod declares metrics port {port}; nothing serves it")
    assert reply.status_code == 200
    family = "tandem_steps_total" if component == "worker" else "tandem_prompt_tokens_total"
    assert family in reply.text, reply.text[:2000]
