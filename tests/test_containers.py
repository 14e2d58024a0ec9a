"""The images and the operator's pods, run the way a node runs them: real containers (podman).

`docker/Dockerfile` is built unchanged (the `full` and `operator` targets) on a base image
debootstrapped from the machine's own apt source; the chart's default TandemService, rendered
by `helm template`, goes through the operator's pure builders, and the pods they render run as
containers (tandem_testing/containers.py): the prepare-segment init container, then the
scheduler and the workers, each in its own PID, network and IPC namespace, sharing only the
cell directory on the host, as the hostPath does. The chart's `helm test` pod then runs
against them. docs/helm.md says how to run it; CI runs it (`.ci/run` installs podman).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kube_emulator.fixtures import defaulted_spec
from test_chart_harness import render

from tandem.v1 import generate_pb2, generate_pb2_grpc
from tandem_operator.containers import HEALTH_PORT
from tandem_operator.manifests import (
    SCHEDULER_METRICS_PORT,
    WORKER_METRICS_PORT,
    build_configmap,
    cell_dir,
    child_name,
    generation_dir,
    pod_dns,
    service_name,
    workers_service_name,
)
from tandem_operator.placement import Cell
from tandem_operator.spec import TandemSpec, parse_spec
from tandem_operator.workloads import build_pod_template
from tandem_testing import containers
from tandem_testing.cells import png, request, stream
from tandem_testing.metrics import scrape

# The first test also builds the images (minutes on a fresh machine).
pytestmark = [pytest.mark.container, pytest.mark.timeout(1200)]

TAG = "check"  # the chart's image.tag; the images are built locally under these references
IMAGES = {"full": "ghcr.io/tandem-dev/tandem", "operator": "ghcr.io/tandem-dev/tandem-operator"}
POD_INDEX = "apps.kubernetes.io/pod-index"  # set on each pod by the StatefulSet controller
GENERATION = "tandem.v1.Generation"
SERVING = health_pb2.HealthCheckResponse.SERVING
CACHE_BYTES = 256 << 20


@pytest.fixture(scope="session")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Both targets of docker/Dockerfile, built (layers cached by podman between runs)."""
    why = containers.available()
    if why:
        if os.environ.get("TANDEM_CONTAINER_CHECK") == "required":  # .ci/run sets it
            pytest.fail(f"the container check is required here, and cannot run: {why}")
        pytest.skip(why)
    work = tmp_path_factory.mktemp("build")
    base = containers.base_image()
    return {f"{repo}:{TAG}": containers.build_image(target, f"localhost/tandem-{target}:{TAG}",
                                                    base, work)
            for target, repo in IMAGES.items()}


def _chart_values(host_root: Path, *sets: str) -> tuple[str, ...]:
    """The chart's values (`--set-json`) for a CPU cell on this machine: the images built here,
    no GPU, one cell (nothing in front: the Service reaches the scheduler), a small segment
    under `host_root`, a 10 s grace (a stopped worker serves its scheduler's stream for up
    to the grace)."""
    return (f'image.tag="{TAG}"', 'service.worker.device="cpu"', "service.worker.gpu.count=0",
            f'service.featureCache.hostPath.root="{host_root}"',
            'service.featureCache.size="256Mi"', "service.shutdownGraceSeconds=10", *sets)


def _chart_spec(values: tuple[str, ...]) -> TandemSpec:
    """The chart's TandemService, defaulted as the apiserver would, parsed as the operator."""
    (service,) = [o for o in render("helm3", sets=values) if o["kind"] == "TandemService"]
    meta = service["metadata"]
    return parse_spec(meta["name"], meta["namespace"], defaulted_spec(service["spec"]))


class RunningCell:
    """A cell's pods as containers on one node, and what a test asks of them."""

    def __init__(self, node: containers.Node, spec: TandemSpec, cell: Cell) -> None:
        self.node, self.spec, self.cell = node, spec, cell
        config = build_configmap(spec, cell)
        self.config_maps = {config["metadata"]["name"]: config["data"]}
        self.pods: dict[str, containers.PodRun] = {}
        self.host_dir = Path(cell_dir(spec, cell.index), generation_dir(cell.generation))

    def pod_name(self, component: str, ordinal: int = 0) -> str:
        kind = "workers" if component == "worker" else "scheduler"
        return f"{child_name(self.spec, self.cell.index, kind)}-{ordinal}"

    def start_pod(self, component: str, ordinal: int = 0) -> containers.PodRun:
        name = self.pod_name(component, ordinal)
        template = build_pod_template(self.spec, self.cell, component)
        template["metadata"]["labels"][POD_INDEX] = str(ordinal)
        self.pods[name] = containers.run_pod(self.node, name, template, self.config_maps)
        return self.pods[name]

    def start(self) -> None:
        workers = self.spec.worker.workers_per_cell
        # Cluster DNS: worker 0's name (the tensor-parallel rendezvous) and the Service's.
        master = self.pod_name("worker")
        self.node.hosts[pod_dns(self.spec, master, workers_service_name(self.spec))] = (
            self.node.address(master))
        self.node.hosts[f"{service_name(self.spec)}.{self.spec.namespace}.svc"] = (
            self.node.address(self.pod_name("scheduler")))
        for rank in range(workers):
            self.start_pod("worker", rank)
        self.start_pod("scheduler")
        self.wait_health(self.pod_name("scheduler"), GENERATION, SERVING)

    @property
    def scheduler(self) -> containers.PodRun:
        return self.pods[self.pod_name("scheduler")]

    def container(self, pod: str) -> str:
        (name,) = self.pods[pod].containers.values()
        return name

    def channel(self, pod: str, port: int) -> grpc.Channel:
        return grpc.insecure_channel(f"{self.node.address(pod)}:{port}")

    def health(self, pod: str, service: str) -> int:
        """The pod's grpc.health.v1 status at its probe port (UNKNOWN when unreachable)."""
        with self.channel(pod, HEALTH_PORT) as channel:
            try:
                return health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=5).status
            except grpc.RpcError:
                return health_pb2.HealthCheckResponse.UNKNOWN

    def wait_health(self, pod: str, service: str, want: int, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while (status := self.health(pod, service)) != want:
            state = containers.state(self.container(pod))
            if time.monotonic() > deadline or state["Status"] == "exited":
                raise AssertionError(
                    f"{pod} {service or 'overall'} health is {status}, not {want} "
                    f"({state['Status']}):\n{self.logs()}")
            time.sleep(0.5)

    def generate(self, msg: generate_pb2.GenerateRequest,
                 ) -> tuple[list[int], str, generate_pb2.GenerateResponse]:
        with self.channel(self.pod_name("scheduler"), self.spec.scheduler.port) as channel:
            return stream(generate_pb2_grpc.GenerationStub(channel), msg)

    def logs(self) -> str:
        return "\n".join(f"--- {pod}\n{containers.logs(self.container(pod))[-3000:]}"
                         for pod in self.pods)


@pytest.fixture(scope="module")
def node(images: dict[str, str], tmp_path_factory: pytest.TempPathFactory,
         ) -> Iterator[containers.Node]:
    node = containers.create_node("tandem-check", 77, tmp_path_factory.mktemp("node"), images)
    try:
        yield node
    finally:
        containers.remove_node(node)


@pytest.fixture(scope="module")
def host_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The node's segment root: tmpfs, as the chart's default /dev/shm/tandem."""
    root = Path(f"/dev/shm/tandem-check-{os.getpid()}")
    root.mkdir()
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _cell(node: containers.Node, host_root: Path, index: int, *sets: str) -> RunningCell:
    spec = _chart_spec(_chart_values(host_root, *sets))
    cell = RunningCell(node, spec, Cell(index=index, node=node.network, cache_bytes=CACHE_BYTES,
                                        requested_bytes=CACHE_BYTES, generation=1))
    try:
        cell.start()
    except BaseException:
        print(cell.logs())
        raise
    return cell


@pytest.fixture(scope="module")
def cell(node: containers.Node, host_root: Path) -> RunningCell:
    return _cell(node, host_root, 0)


@pytest.fixture(scope="module")
def tp_cell(node: containers.Node, host_root: Path) -> RunningCell:
    """Tensor parallelism across two worker containers (ranks from their pod index)."""
    return _cell(node, host_root, 1, "service.worker.workersPerCell=2",
                 "service.worker.tensorParallelSize=2")


def test_the_same_image_twice_hits_the_caches_over_the_segment(cell: RunningCell) -> None:
    image = png(24)
    first = cell.generate(request("Describe <image> please.", [image], max_tokens=6))
    second = cell.generate(request("Describe <image> please.", [image], max_tokens=6))
    assert first[0] == second[0]
    cold, warm = first[2].usage, second[2].usage
    assert (cold.mm_cache_hits, cold.encoder_runs) == (0, 1), cold
    assert (warm.mm_cache_hits, warm.encoder_runs) == (1, 0), warm
    assert warm.cached_prompt_tokens > 0, warm
    # The processed image lives in the segment on the host's directory, which both
    # containers mount (the scheduler wrote it, the worker read it).
    assert any(p.is_file() and p.stat().st_size > 0 for p in cell.host_dir.iterdir()), (
        list(cell.host_dir.iterdir()))


def test_the_cpu_worker_builds_its_kernels_in_the_image(cell: RunningCell) -> None:
    """The image carries a C compiler and the pod's /tmp lets the worker load what it
    compiles: no kernel falls back to torch's path (each fallback logs a warning)."""
    cell.generate(request("Hello", [], max_tokens=2))  # the worker has loaded the model
    log = containers.logs(cell.container(cell.pod_name("worker")))
    assert "ready: cpu" in log, log[-3000:]  # the worker's log, at INFO, on the CPU
    for fallback in ("attention gathers each context", "elementwise ops stay torch's",
                     "linear layers keep oneDNN's layout", "the decoder's layers run one by one"):
        assert fallback not in log, log[-3000:]


@pytest.mark.parametrize("component", ["scheduler", "worker"])
def test_metrics_are_served_on_the_port_each_container_declares(cell: RunningCell,
                                                                component: str) -> None:
    pod = cell.pods[cell.pod_name(component)]
    (container,) = pod.rendered["spec"]["containers"]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
    assert port == (SCHEDULER_METRICS_PORT if component == "scheduler" else WORKER_METRICS_PORT)
    samples = scrape(port, pod.address)
    family = "tandem_steps_total" if component == "worker" else "tandem_prompt_tokens_total"
    assert any(name.startswith(family) for name in samples), sorted(samples)[:40]


@pytest.mark.parametrize("component", ["scheduler", "worker"])
def test_grpc_health_answers_on_the_probe_port(cell: RunningCell, component: str) -> None:
    pod = cell.pods[cell.pod_name(component)]
    (container,) = pod.rendered["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc_probe: dict[str, Any] = container[probe]["grpc"]
        assert grpc_probe["port"] == HEALTH_PORT
        assert cell.health(pod.name, grpc_probe["service"]) == SERVING, probe


def test_a_restarted_worker_is_attached_again(cell: RunningCell) -> None:
    worker = cell.pod_name("worker")
    containers.stop(cell.container(worker), 60)
    assert containers.state(cell.container(worker))["ExitCode"] == 0, cell.logs()
    cell.wait_health(cell.scheduler.name, GENERATION,
                     health_pb2.HealthCheckResponse.NOT_SERVING, timeout=60)
    containers.start(cell.container(worker))  # the kubelet restarts the container in its pod
    cell.wait_health(cell.scheduler.name, GENERATION, SERVING)
    ids, _, last = cell.generate(request("After the worker's restart", max_tokens=4))
    assert len(ids) == 4 and last.usage.completion_tokens == 4


def test_a_recreated_scheduler_attaches_to_the_running_workers(cell: RunningCell) -> None:
    scheduler = cell.scheduler.name
    containers.stop(cell.container(scheduler), 60)
    assert containers.state(cell.container(scheduler))["ExitCode"] == 0, cell.logs()
    containers.podman("rm", cell.container(scheduler))
    cell.start_pod("scheduler")  # a new pod: its init container prepares the segment again
    cell.wait_health(scheduler, GENERATION, SERVING)
    image = png(25)
    cold = cell.generate(request("A new scheduler sees <image>.", [image], max_tokens=4))[2]
    assert (cold.usage.mm_cache_hits, cold.usage.encoder_runs) == (0, 1), cold.usage


def test_tensor_parallel_workers_in_two_containers_agree_with_one(
        cell: RunningCell, tp_cell: RunningCell) -> None:
    msg = request("Tensor parallel <image> check", [png(26)], max_tokens=6, temperature=0.0)
    assert tp_cell.generate(msg)[0] == cell.generate(msg)[0]


def test_the_charts_helm_test_passes_against_the_containers(
        cell: RunningCell, host_root: Path) -> None:
    """`helm test`'s pod (its health wait, `tandem generate`, an OpenAI completion), run in
    the image against the cell; the Service's DNS name resolves to the scheduler."""
    (pod,) = [o for o in render("helm3", sets=_chart_values(host_root))
              if o["kind"] == "Pod" and o["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    results = containers.run_to_end(cell.node, pod["metadata"]["name"], pod)
    failed = {name: r.stdout[-2000:] + r.stderr[-2000:] for name, r in results.items()
              if r.returncode != 0}
    assert not failed, failed
    assert list(results) == ["health", "generate", "openai"]
    assert "SERVING" in results["health"].stdout
    assert '"completion_tokens": 4' in results["openai"].stdout, results["openai"].stdout


def test_sigterm_ends_each_container_within_its_grace_and_cleans_the_segment(
        tp_cell: RunningCell) -> None:
    """What the kubelet does to a deleted pod: SIGTERM to PID 1, SIGKILL after the grace.
    Each container exits 0 before the grace, and leaves nothing in the cell directory."""
    before = sorted(p.name for p in tp_cell.host_dir.iterdir())
    assert before, "the running cell has nothing in its directory"
    for pod in [tp_cell.pod_name("scheduler"),
                *(tp_cell.pod_name("worker", r) for r in range(2))]:
        grace = tp_cell.pods[pod].rendered["spec"]["terminationGracePeriodSeconds"]
        began = time.monotonic()
        containers.stop(tp_cell.container(pod), grace)
        took = time.monotonic() - began
        state = containers.state(tp_cell.container(pod))
        assert state["ExitCode"] == 0 and took < grace, (pod, took, state, tp_cell.logs())
    assert sorted(p.name for p in tp_cell.host_dir.iterdir()) == [], before
