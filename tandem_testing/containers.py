"""Build Tandem's images and run the operator's rendered pods in real containers (podman).

What the kubelet would do with a pod, done with rootful podman: each container in its own PID,
network and IPC namespace on one bridge network, with the rendered user, read-only root,
capabilities, no-new-privileges, environment, command and volumes (a hostPath is a host
directory, an emptyDir a directory of the pod or a tmpfs). No registry is needed: the base image
is a `debootstrap --variant=minbase` of the distribution the machine's apt uses, imported
once and cached under `.cache/containers/`.

Two findings on these machines are handled by the `containers.conf` every call uses: crun
fails on their cgroup v1/v2 hybrid (runc works), and podman's default ulimits exceed the VM's
hard nofile limit (capped here at what the machine allows).
"""

from __future__ import annotations

import configparser
import functools
import hashlib
import json
import os
import resource
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem_testing import pods

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "containers"
LABEL = "dev.tandem.check"  # on every container the check starts, so one call removes them all
# The Python the image's venv needs and the C compiler its CPU workers build their kernels
# with, so the build never runs apt (debootstrap caches them).
BASE_PACKAGES = ("python3", "python3-venv", "gcc", "libc6-dev")
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def available() -> str:
    """Why containers cannot run here ("" when they can): podman, runc and debootstrap
    installed, and root (the check runs rootful, as the kubelet's runtime does)."""
    missing = [tool for tool in ("podman", "runc", "debootstrap") if shutil.which(tool) is None]
    if missing:
        return (f"not installed: {', '.join(missing)} "
                "(apt-get install podman buildah runc debootstrap)")
    if os.geteuid() != 0:
        return "the container check runs rootful podman: run it as root"
    return ""


@functools.cache
def containers_conf() -> Path:
    """The `containers.conf` of every podman call: runc, and ulimits within the hard limits."""
    def cap(kind: int, want: int) -> int:
        hard = resource.getrlimit(kind)[1]
        return want if hard == resource.RLIM_INFINITY else min(hard, want)

    nofile, nproc = cap(resource.RLIMIT_NOFILE, 1 << 20), cap(resource.RLIMIT_NPROC, 32768)
    CACHE.mkdir(parents=True, exist_ok=True)
    conf = CACHE / "containers.conf"
    conf.write_text(
        "[containers]\n"
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
        "[engine]\n"
        'runtime = "runc"\n')
    return conf


def podman(*args: str, check: bool = True, timeout: float = 600,
           ) -> subprocess.CompletedProcess[str]:
    """Run ``podman args``; a failure raises with podman's own message."""
    env = {**os.environ, "CONTAINERS_CONF": str(containers_conf())}
    done = subprocess.run(["podman", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])} ... failed ({done.returncode}):\n"
                           f"{done.stderr[-4000:]}")
    return done


def apt_source() -> tuple[str, str]:
    """(suite, mirror) of the machine's first Debian source: deb822 `.sources` or the
    one-line `sources.list` format."""
    suite = ""
    for line in Path("/etc/os-release").read_text().splitlines():
        if line.startswith("VERSION_CODENAME="):
            suite = line.split("=", 1)[1].strip('"')
    files = sorted(Path("/etc/apt/sources.list.d").glob("*.sources"))
    for path in files:
        for line in path.read_text().splitlines():
            if line.startswith("URIs:"):
                return suite, line.split()[1]
    for line in Path("/etc/apt/sources.list").read_text().splitlines():
        words = line.split()
        if words[:1] == ["deb"]:
            uri = next(w for w in words[1:] if not w.startswith("["))
            return suite, uri
    raise RuntimeError("no Debian source in /etc/apt: cannot debootstrap a base image")


def base_image() -> str:
    """The base image's tag, imported from the cached minbase tarball (made once)."""
    suite, mirror = apt_source()
    # The packages name the image: a base cached with fewer is not taken for this one.
    flavour = f"{suite}-minbase-{hashlib.sha256(' '.join(BASE_PACKAGES).encode()).hexdigest()[:8]}"
    tag = f"localhost/tandem-base:{flavour}"
    if podman("image", "exists", tag, check=False).returncode == 0:
        return tag
    tarball = CACHE / f"{flavour}.tar"
    if not tarball.exists():
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            root = Path(tmp) / "root"
            subprocess.run(["debootstrap", "--variant=minbase",
                            f"--include={','.join(BASE_PACKAGES)}", suite, str(root), mirror],
                           check=True, capture_output=True, timeout=900)
            partial = Path(tmp) / "base.tar"
            subprocess.run(["tar", "-C", str(root), "-cf", str(partial), "."], check=True)
            partial.replace(tarball)
    podman("import", "--change", f"ENV PATH={BASE_PATH}", str(tarball), tag)
    return tag


def pip_build_mounts(workdir: Path) -> tuple[list[str], str]:
    """The build's view of the host's pip: one pip.conf with the host's effective settings
    (its files and PIP_* variables), and every path those name mounted read-only at the same
    place (CA bundle, constraints, wheel directories, file:// indexes). Returns the
    ``--volume`` arguments and the index to give as TORCH_INDEX_URL."""
    listed = subprocess.run(["python3", "-m", "pip", "config", "list"], capture_output=True,
                            text=True, check=True).stdout
    settings: dict[str, str] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        settings[key.split(".", 1)[1]] = value.strip().strip("'\"")
    conf = configparser.ConfigParser()
    conf["global"] = settings
    with open(workdir / "pip.conf", "w") as out:
        conf.write(out)
    mounts = ["--volume", f"{workdir / 'pip.conf'}:/etc/pip.conf:ro"]
    paths = set()
    for value in settings.values():
        for word in value.split():
            path = word.removeprefix("file://")
            if path.startswith("/") and Path(path).exists():
                # An index directory is mounted whole (its pages link to files beside it).
                paths.add(str(Path(path).parent) if path.endswith("/simple") else path)
    for path in sorted(paths):
        mounts += ["--volume", f"{path}:{path}:ro"]
    return mounts, settings.get("index-url", "https://pypi.org/simple")


def build_image(target: str, tag: str, base: str, workdir: Path) -> str:
    """``docker/Dockerfile``'s ``target``, built unchanged from the repository root, with the
    base image and torch index as build arguments. The build uses the host's network, as
    `docker build` does by default, so pip reaches what the host's pip reaches."""
    mounts, index = pip_build_mounts(workdir)
    podman("build", "--network", "host", "--file", str(REPO / "docker" / "Dockerfile"),
           "--target", target, "--build-arg", f"BASE_IMAGE={base}",
           "--build-arg", f"TORCH_INDEX_URL={index}", *mounts, "--tag", tag, str(REPO),
           timeout=1200)
    return tag


@dataclass
class Node:
    """One machine's worth of pods: a bridge network with an address per pod, host names for
    what cluster DNS would resolve, and the directory emptyDir volumes live in."""

    network: str
    subnet_prefix: str  # "10.89.7." : pods get .2, .3, ...
    scratch: Path
    images: Mapping[str, str]  # rendered image reference -> local tag
    hosts: dict[str, str] = field(default_factory=dict)  # DNS name -> pod address
    addresses: dict[str, str] = field(default_factory=dict)  # pod name -> address

    def address(self, pod: str) -> str:
        if pod not in self.addresses:
            self.addresses[pod] = f"{self.subnet_prefix}{len(self.addresses) + 2}"
        return self.addresses[pod]


def create_node(name: str, octet: int, scratch: Path, images: Mapping[str, str]) -> Node:
    """A fresh bridge network ``name`` on 10.89.<octet>.0/24 (replacing a leftover one)."""
    podman("network", "rm", "--force", name, check=False)
    podman("network", "create", "--subnet", f"10.89.{octet}.0/24", name)
    return Node(name, f"10.89.{octet}.", scratch, images)


def remove_node(node: Node) -> None:
    """Every container of the check on ``node``, then its network."""
    ids = podman("ps", "--all", "--quiet", "--filter", f"label={LABEL}={node.network}").stdout
    if ids.split():
        podman("rm", "--force", "--time", "0", *ids.split(), check=False)
    podman("network", "rm", "--force", node.network, check=False)


def _volume_args(node: Node, pod_name: str, volumes: Mapping[str, Mapping[str, Any]],
                 mount: Mapping[str, Any]) -> list[str]:
    volume = volumes[mount["name"]]
    read_only = ":ro" if mount.get("readOnly") else ""
    if "hostPath" in volume:
        source = Path(volume["hostPath"]["path"], mount.get("subPath", ""))
        if volume["hostPath"].get("type") == "DirectoryOrCreate":
            source.mkdir(parents=True, exist_ok=True)  # as the kubelet: root, 0755
        return ["--volume", f"{source}:{mount['mountPath']}{read_only}"]
    if "emptyDir" in volume:
        if volume["emptyDir"].get("medium") == "Memory":
            size = volume["emptyDir"].get("sizeLimit", "")
            return ["--mount", f"type=tmpfs,destination={mount['mountPath']},tmpfs-mode=1777"
                    + (f",tmpfs-size={size}" if size else "")]
        source = node.scratch / pod_name / mount["name"]
        if not source.exists():
            source.mkdir(parents=True)
            source.chmod(0o1777)  # the kubelet's emptyDir is world-writable
        return ["--volume", f"{source}:{mount['mountPath']}{read_only}"]
    raise ValueError(f"volume {mount['name']}: only hostPath and emptyDir are run here")


def run_args(node: Node, pod_name: str, pod: Mapping[str, Any], container: Mapping[str, Any],
             config_maps: Mapping[str, Mapping[str, str]]) -> list[str]:
    """``podman run`` arguments for one container of a rendered pod (image and args last),
    its environment as the kubelet builds it from ``config_maps`` (:func:`pods.pod_env`)."""
    spec = pod["spec"]
    security = {**spec.get("securityContext", {}), **container.get("securityContext", {})}
    user, group = security.get("runAsUser"), security.get("runAsGroup")
    if security.get("runAsNonRoot") and not user:
        raise ValueError(f"{container['name']}: runAsNonRoot without a numeric non-root user")
    seccomp = security.get("seccompProfile", {}).get("type", "RuntimeDefault")
    if seccomp != "RuntimeDefault":  # podman's default profile is the runtime's default
        raise ValueError(f"{container['name']}: seccomp profile {seccomp} is not run here")
    args = ["--name", f"{pod_name}-{container['name']}", "--label", f"{LABEL}={node.network}",
            "--hostname", pod_name, "--network", node.network, "--ip", node.address(pod_name),
            "--pid", "private", "--ipc", "private",
            "--stop-timeout", str(spec.get("terminationGracePeriodSeconds", 30))]
    for name, address in node.hosts.items():
        args += ["--add-host", f"{name}:{address}"]
    if user is not None:
        args += ["--user", f"{user}:{group if group is not None else user}"]
    if security.get("readOnlyRootFilesystem"):
        args += ["--read-only", "--read-only-tmpfs=false"]
    if security.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    caps = security.get("capabilities", {})
    args += [f"--cap-drop={c}" for c in caps.get("drop", ())]
    args += [f"--cap-add={c}" for c in caps.get("add", ())]
    limit = container.get("resources", {}).get("limits", {}).get("memory")
    if limit:
        args += ["--memory", str(limit).replace("Mi", "m").replace("Gi", "g")]
    volumes = {v["name"]: v for v in spec.get("volumes", ())}
    for mount in container.get("volumeMounts", ()):
        args += _volume_args(node, pod_name, volumes, mount)
    for key, value in pods.pod_env(container, config_maps, pod, pod_name, node.network).items():
        args += ["--env", f"{key}={value}"]
    if "command" in container:
        args += ["--entrypoint", json.dumps(container["command"])]
    return [*args, node.images[container["image"]], *container.get("args", ())]


@dataclass
class PodRun:
    """A pod started on a node: its serving containers' names, by container name."""

    name: str
    address: str
    containers: dict[str, str]
    rendered: Mapping[str, Any]


def _run_to_exit(node: Node, pod_name: str, pod: Mapping[str, Any],
                 container: Mapping[str, Any], config_maps: Mapping[str, Mapping[str, str]],
                 timeout: float) -> subprocess.CompletedProcess[str]:
    """One container of the pod in the foreground, removed once it exits."""
    return podman("run", "--rm", *run_args(node, pod_name, pod, container, config_maps),
                  check=False, timeout=timeout)


def run_pod(node: Node, pod_name: str, pod: Mapping[str, Any],
            config_maps: Mapping[str, Mapping[str, str]]) -> PodRun:
    """Start a rendered pod as the kubelet would: each init container to completion, in
    order (a failure raises with its output), then the containers, detached."""
    spec = pod["spec"]
    for init in spec.get("initContainers", ()):
        done = _run_to_exit(node, pod_name, pod, init, config_maps, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"init container {init['name']} of {pod_name} failed "
                               f"({done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}")
    started = {}
    for container in spec["containers"]:
        podman("run", "--detach", *run_args(node, pod_name, pod, container, config_maps))
        started[container["name"]] = f"{pod_name}-{container['name']}"
    return PodRun(pod_name, node.address(pod_name), started, pod)


def run_to_end(node: Node, pod_name: str, pod: Mapping[str, Any],
               config_maps: Mapping[str, Mapping[str, str]] | None = None,
               timeout: float = 600) -> dict[str, subprocess.CompletedProcess[str]]:
    """Run a pod whose containers end (a `helm test` pod): its init containers, then its
    containers, one after the other in the foreground (the kubelet runs the containers side
    by side; each of these stands alone). Returns each one's result, by name, up to the
    first that failed."""
    spec = pod["spec"]
    results = {}
    for container in [*spec.get("initContainers", ()), *spec["containers"]]:
        result = _run_to_exit(node, pod_name, pod, container, config_maps or {}, timeout)
        results[container["name"]] = result
        if result.returncode != 0:
            break
    return results


def logs(name: str) -> str:
    done = podman("logs", name, check=False)
    return done.stdout + done.stderr


def state(name: str) -> dict[str, Any]:
    """The container's ``State`` as podman inspects it (Status, ExitCode, ...)."""
    out = podman("inspect", "--format", "{{json .State}}", name).stdout
    return json.loads(out)


def stop(name: str, timeout: float) -> None:
    """SIGTERM to the container's PID 1, SIGKILL after ``timeout`` seconds."""
    podman("stop", "--time", str(int(timeout)), name, timeout=timeout + 60)


def start(name: str) -> None:
    podman("start", name)
