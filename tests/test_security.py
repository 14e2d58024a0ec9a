"""Security of a local cell, with real processes: mutual TLS on the public port (and the
plaintext health-only port for probes), private files in the shared directory, refusal of
an unsafe shared directory, tenant isolation by ``cache_salt`` in the prefix and processor
caches, and one client's reused image uuid not failing other clients' requests.

Certificates come from ``pki.make_pki``: a CA, a server certificate for localhost/127.0.0.1,
a client certificate from the same CA and one from a rogue CA.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pki import Pki, make_pki

from tandem.v1 import generate_pb2, generate_pb2_grpc
from tandem_testing.cells import Cell, _wait_serving, free_port, png, request

ENV = dict(os.environ, PYTHONUNBUFFERED="1", TANDEM_DEBUG_INVARIANTS="1")


@dataclass
class TlsCell:
    cell: Cell
    pki: Pki
    health_port: int
    http_port: int  # the OpenAI API, mutual TLS too
    tmp: Path


@pytest.fixture(scope="module")
def tls_cell(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsCell]:
    tmp = tmp_path_factory.mktemp("tls")
    pki = make_pki(tmp)
    port, health_port, http_port = free_port(), free_port(), free_port()
    cmd = [sys.executable, "-m", "tandem_cli.cli", "serve", "--listen", f"127.0.0.1:{port}",
           "--http-listen", f"127.0.0.1:{http_port}",
           "--shm-dir", str(tmp / "shm"), "--kv-cache-size", "16Mi", "--log-level", "INFO",
           "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
           "--tls-client-ca", str(pki.ca), "--health-listen", f"127.0.0.1:{health_port}"]
    with open(tmp / "cell.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV)
        channel = grpc.secure_channel(f"127.0.0.1:{port}",
                                      pki.client(pki.client_cert, pki.client_key))
        cell = Cell(f"127.0.0.1:{port}", tmp / "shm", proc, channel)
        try:
            _wait_serving(cell, 90, tmp / "cell.log")
            yield TlsCell(cell, pki, health_port, http_port, tmp)
        finally:
            channel.close()
            proc.terminate()
            proc.wait(30)


def _call(target: str, credentials: grpc.ChannelCredentials | None) -> str:
    """Status of one CacheStats call over a fresh channel ("OK" on success)."""
    with (grpc.secure_channel(target, credentials) if credentials
          else grpc.insecure_channel(target)) as channel:
        try:
            generate_pb2_grpc.GenerationStub(channel).CacheStats(
                generate_pb2.CacheStatsRequest(), timeout=10)
        except grpc.RpcError as exc:
            return exc.code().name
    return "OK"


def test_mutual_tls_admits_only_clients_of_the_ca(tls_cell: TlsCell) -> None:
    target, pki = tls_cell.cell.target, tls_cell.pki
    assert _call(target, pki.client(pki.client_cert, pki.client_key)) == "OK"
    assert _call(target, None) == "UNAVAILABLE", "plaintext is refused"
    assert _call(target, pki.client()) == "UNAVAILABLE", "TLS without a client certificate"
    assert _call(target, pki.client(pki.rogue_cert, pki.rogue_key)) == "UNAVAILABLE"
    assert _call(target, pki.client(pki.client_cert, pki.client_key,
                                    ca=pki.rogue_cert)) == "UNAVAILABLE", "server not trusted"
    log = (tls_cell.tmp / "cell.log").read_text()
    assert "mutual TLS" in log


def test_generate_cli_speaks_mutual_tls(tls_cell: TlsCell) -> None:
    pki = tls_cell.pki
    out = subprocess.run(
        [sys.executable, "-m", "tandem_cli.cli", "generate", "Hello there", "--max-tokens", "3",
         "--target", tls_cell.cell.target, "--tls-ca", str(pki.ca),
         "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)],
        capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 0, out.stderr
    assert "3 generated" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "tandem_cli.cli", "generate", "Hello", "--target",
         tls_cell.cell.target, "--tls-ca", str(pki.ca)],
        capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr


def test_health_port_serves_health_only_in_plaintext(tls_cell: TlsCell) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{tls_cell.health_port}") as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="tandem.v1.Generation"), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            generate_pb2_grpc.GenerationStub(channel).CacheStats(
                generate_pb2.CacheStatsRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_shared_directory_files_are_private(tls_cell: TlsCell) -> None:
    shm = tls_cell.cell.shm_dir
    tls_cell.cell.generate("<image> stored", [png(1)], max_tokens=1)
    modes = {p.name: os.stat(p) for p in [shm, shm / "features.seg", shm / "worker-0.sock"]}
    assert stat.S_IMODE(modes["shm"].st_mode) == 0o700
    assert stat.S_IMODE(modes["features.seg"].st_mode) == 0o600
    assert stat.S_ISSOCK(modes["worker-0.sock"].st_mode)
    assert stat.S_IMODE(modes["worker-0.sock"].st_mode) == 0o600
    assert {m.st_uid for m in modes.values()} == {os.geteuid()}


def test_cache_salt_isolates_tenants(tls_cell: TlsCell) -> None:
    """A salted request never hits another salt's prefix blocks or processed images."""
    cell = tls_cell.cell
    prompt = "Tenant prompt with a shared prefix long enough for blocks: <image> now."
    image = png(77)

    def usage(salt: str) -> generate_pb2.Usage:
        return cell.generate(prompt, [image], max_tokens=4, cache_salt=salt)[2].usage

    first = {salt: usage(salt) for salt in ("", "tenant-a", "tenant-b")}
    for u in first.values():
        assert (u.cached_prompt_tokens, u.mm_cache_hits, u.encoder_runs) == (0, 0, 1), u
    again = {salt: usage(salt) for salt in ("", "tenant-a", "tenant-b")}
    for u in again.values():  # each tenant hits only its own entries
        assert u.cached_prompt_tokens > 0 and u.mm_cache_hits == 1 and u.encoder_runs == 0, u
    assert cell.stats().mm_cache_misses_total >= 3


def test_reused_uuid_does_not_fail_other_clients(tls_cell: TlsCell) -> None:
    """One client names two images of different sizes with the same uuid; a concurrent
    client's request must finish normally (a step refused by the workers would fail it)."""
    cell = tls_cell.cell
    outcome: list[str] = []

    def innocent() -> None:
        msg = request("An innocent request that keeps running", max_tokens=200,
                      ignore_eos=True)
        try:
            n = sum(len(m.token_ids) for m in cell.stub.Generate(msg, timeout=120))
            outcome.append(f"OK {n}")
        except grpc.RpcError as exc:
            outcome.append(exc.code().name)

    thread = threading.Thread(target=innocent)
    thread.start()
    time.sleep(0.3)
    for size in ((112, 84), (224, 224)):
        msg = request("<image>", [png(5, *size)], max_tokens=2)
        msg.images[0].uuid = "same-name"
        assert list(cell.stub.Generate(msg, timeout=60))[-1].usage.mm_items == 1
    thread.join(120)
    assert outcome == ["OK 200"]


@pytest.mark.parametrize("unsafe", ["world-writable", "group-writable", "other-owner"])
def test_scheduler_refuses_an_unsafe_shared_directory(tmp_path: Path, unsafe: str) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    if unsafe == "world-writable":
        shm.chmod(0o777)
    elif unsafe == "group-writable":
        shm.chmod(0o770)
    elif os.geteuid() == 0:
        os.chown(shm, 65534, 65534)
    else:
        pytest.skip("changing the owner needs root")
    out = subprocess.run(
        [sys.executable, "-m", "tandem_cli.cli", "scheduler", "--shm-dir", str(shm),
         "--listen", f"127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 2, out.stderr
    assert f"refusing the shared directory {shm}" in out.stderr, out.stderr
    assert not list(shm.iterdir()), "nothing was created in it"


def test_bad_tls_settings_are_refused(tmp_path: Path) -> None:
    (tmp_path / "cert.pem").write_text("not a certificate")
    out = subprocess.run(
        [sys.executable, "-m", "tandem_cli.cli", "scheduler", "--shm-dir", str(tmp_path / "shm"),
         "--tls-cert", str(tmp_path / "cert.pem"), "--listen", f"127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 2 and "--tls-key" in out.stderr, out.stderr


@contextlib.contextmanager
def _command(tmp: Path, name: str, command: str, **settings: str) -> Iterator[None]:
    """``tandem COMMAND`` configured by TANDEM_* variables only, until the ``with`` ends
    (then SIGTERM, and a clean exit); entered once it says it is listening."""
    env = dict(ENV, **settings)
    log_path = tmp / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tandem_cli.cli", command], stdout=log,
                                stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 30
        while f"tandem {command} listening" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log_path.read_text()


def test_the_gateway_reaches_a_mutual_tls_cell(tls_cell: TlsCell) -> None:
    """``tandem gateway --cell-tls-*``: Envoy's own connections to the cells (both APIs)
    speak mutual TLS, as the picker's checks do."""
    pki, cell = tls_cell.pki, tls_cell.cell
    listen = f"127.0.0.1:{free_port()}"
    with _command(tls_cell.tmp, "gateway", "gateway", TANDEM_GATEWAY_LISTEN=listen,
                  TANDEM_EPP_CELLS=f"{cell.target}/{tls_cell.http_port}",
                  TANDEM_GATEWAY_ADMIN_PORT=str(free_port()),
                  TANDEM_EPP_CELL_TLS_CA=str(pki.ca),
                  TANDEM_EPP_CELL_TLS_CERT=str(pki.client_cert),
                  TANDEM_EPP_CELL_TLS_KEY=str(pki.client_key)):
        with grpc.insecure_channel(listen) as channel:
            call = generate_pb2_grpc.GenerationStub(channel).Generate(
                request("Through Envoy over TLS", max_tokens=2), timeout=60)
            assert sum(len(m.token_ids) for m in call) == 2
            assert dict(call.initial_metadata())["x-tandem-cell"] == cell.target
        reply = httpx.post(f"http://{listen}/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-tandem-cell"] == cell.target
