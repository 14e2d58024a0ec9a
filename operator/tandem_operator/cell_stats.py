"""Reading a cell's CacheStats over gRPC, as a client of its scheduler's public port.

The operator dials the scheduler pod's IP (what it knows from its pod index, and what
resolves without cluster DNS) on `scheduler.port`. Under `tls` it trusts the CA of the
cell's certificate (ca.crt of `tls.secretName`), presents that certificate too when the
cells require client certificates (as the endpoint picker does), and checks the name the
certificate carries for the cell: the Service's with one cell, the pod's headless name
with several.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from tandem.tls import pem_channel_credentials
from tandem.v1 import generate_pb2, generate_pb2_grpc
from tandem_operator.cache_sizing import Reading
from tandem_operator.manifests import child_name, pod_dns, service_name
from tandem_operator.spec import TandemSpec

STATS_TIMEOUT_S = 5.0


class CellUnreachable(Exception):
    """CacheStats did not answer; `str()` says why, for the CacheSized message."""


@dataclass(frozen=True)
class CellTarget:
    address: str  # host:port of the scheduler pod
    server_name: str  # the name its certificate must carry (TLS only)


def cell_target(spec: TandemSpec, index: int, pod_ip: str) -> CellTarget:
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    pod = f"{child_name(spec, index, 'scheduler')}-0"
    name = (f"{service_name(spec)}.{spec.namespace}.svc" if spec.cells == 1
            else pod_dns(spec, pod, service_name(spec, headless=True)))
    return CellTarget(f"{host}:{spec.scheduler.port}", name)


def tls_credentials(spec: TandemSpec, secret: Mapping[str, Any]) -> grpc.ChannelCredentials:
    """Credentials from the `tls.secretName` Secret (its `data`, base64 as the API has it)."""
    data = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
    if "ca.crt" not in data:
        raise CellUnreachable(f"Secret {spec.tls.secret_name} has no ca.crt: the operator "
                              "cannot verify the cells' certificate")
    mutual = bool(spec.tls.client_ca_secret_name)
    return pem_channel_credentials(data["ca.crt"], data.get("tls.key") if mutual else None,
                                   data.get("tls.crt") if mutual else None)


def to_reading(stats: generate_pb2.CacheStatsResponse) -> Reading:
    at_capacity = [p.hit_ratio for p in stats.mm_cache_curve
                   if p.capacity_bytes == stats.mm_cache_capacity_bytes]
    return Reading(
        capacity_bytes=stats.mm_cache_capacity_bytes,
        recommended_bytes=stats.mm_cache_recommended_bytes,
        references=stats.mm_cache_curve_references,
        achievable=stats.mm_cache_achievable_hit_ratio,
        hit_ratio=at_capacity[0] if at_capacity else None,
        unacked_refs=stats.shm_unacked_refs,
        requests_in_flight=stats.requests_in_flight)


async def read_cell(target: CellTarget, credentials: grpc.ChannelCredentials | None,
                    timeout: float = STATS_TIMEOUT_S) -> Reading:
    """One CacheStats call on a channel of its own (a read every few seconds per cell)."""
    if credentials is None:
        channel = grpc.aio.insecure_channel(target.address)
    else:
        channel = grpc.aio.secure_channel(
            target.address, credentials,
            options=[("grpc.ssl_target_name_override", target.server_name)])
    try:
        stats = await generate_pb2_grpc.GenerationStub(channel).CacheStats(
            generate_pb2.CacheStatsRequest(), timeout=timeout)
    except grpc.aio.AioRpcError as e:
        raise CellUnreachable(f"CacheStats of {target.address} failed: {e.code().name}: "
                              f"{e.details()}") from e
    finally:
        await channel.close()
    return to_reading(stats)
