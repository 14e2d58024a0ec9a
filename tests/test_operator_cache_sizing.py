"""The operator's cache sizing without a cluster: the verdict and its hysteresis, the bound
by the node, autoSize's one resize, the leak watch, status.cache, placement with per-cell
sizes, the spec's autoSize, a cell's CacheStats reduced to a reading, and reading it from a
real mutual-TLS server."""

from __future__ import annotations

import asyncio
import base64
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from kube_emulator.fixtures import node, pod, tandem_spec
from pki import make_pki

from tandem.tls import TlsFiles, server_credentials
from tandem.v1 import generate_pb2 as pb
from tandem.v1 import generate_pb2_grpc as pb_grpc
from tandem_operator.cache_sizing import (
    OVERSIZED,
    RIGHT,
    UNDERSIZED,
    UNKNOWN,
    CellCache,
    Reading,
    SizingPolicy,
    cache_sized_verdict,
    judge,
    judge_cells,
    leak_verdict,
    leaks,
    next_resize,
    observe_leak,
    quantity,
    status_cache,
)
from tandem_operator.cell_stats import (
    CellTarget,
    CellUnreachable,
    cell_target,
    read_cell,
    tls_credentials,
    to_reading,
)
from tandem_operator.placement import Cell, cache_room, node_info, place_cells, pod_load
from tandem_operator.spec import AutoSize, SpecError

GI, MI = 1 << 30, 1 << 20
POLICY = SizingPolicy(min_references=100, leak_seconds=60)


def reading(recommended: int, references: int = 5000, unacked: int = 0, in_flight: int = 0,
            capacity: int = GI) -> Reading:
    return Reading(capacity, recommended, references, 0.8, 0.4, unacked, in_flight)


# -- the verdict ----------------------------------------------------------------------------------

def test_judge_needs_evidence_and_bands_around_the_current_size() -> None:
    assert judge(GI, 10 * GI, 99, RIGHT, POLICY) == UNKNOWN  # too few references
    assert judge(GI, int(1.25 * GI), 100, RIGHT, POLICY) == RIGHT  # not above 25% more
    assert judge(GI, int(1.26 * GI), 100, RIGHT, POLICY) == UNDERSIZED
    assert judge(GI, GI // 2, 100, RIGHT, POLICY) == RIGHT  # not below half
    assert judge(GI, GI // 2 - 1, 100, RIGHT, POLICY) == OVERSIZED
    assert judge(0, GI, 100, RIGHT, POLICY) == UNDERSIZED  # type none: any reuse says so


def test_hysteresis_holds_a_verdict_until_the_estimate_moved_back_well_inside() -> None:
    """An estimate wandering around the threshold does not flap the condition."""
    previous = RIGHT
    seen = []
    for rec in (1.26, 1.2, 1.15, 1.12, 1.09, 1.2, 1.24, 1.26):
        previous = judge(GI, int(rec * GI), 500, previous, POLICY)
        seen.append(previous)
    assert seen == [UNDERSIZED] * 4 + [RIGHT] * 3 + [UNDERSIZED]
    assert judge(GI, int(0.55 * GI), 500, OVERSIZED, POLICY) == OVERSIZED  # until 60%
    assert judge(GI, int(0.61 * GI), 500, OVERSIZED, POLICY) == RIGHT


def cells(*sizes: int, node_name: str = "a") -> list[Cell]:
    return [Cell(i, node_name, size, size, 1) for i, size in enumerate(sizes)]


def test_judge_cells_bounds_by_the_room_and_autosize_by_its_bounds() -> None:
    caches = {0: CellCache(reading(6 * GI)), 1: CellCache(reading(6 * GI)),
              2: CellCache(reading(GI)), 3: CellCache(error="its scheduler pod is not ready")}
    rooms = {0: 4 * GI, 1: 100 * GI, 2: 100 * GI, 3: 100 * GI}
    judged = judge_cells(cells(GI, GI, GI, GI), rooms, caches, POLICY, None)
    assert [(j.recommended, j.verdict, j.target) for j in judged] == [
        (4 * GI, UNDERSIZED, None), (6 * GI, UNDERSIZED, None), (GI, RIGHT, None),
        (0, UNKNOWN, None)]
    auto = AutoSize(512 * MI, 5 * GI)
    judged = judge_cells(cells(GI, GI, GI, GI), rooms, caches, POLICY, auto)
    assert [j.target for j in judged] == [4 * GI, 5 * GI, None, None]
    assert next_resize(judged, all_ready=True) is judged[0]  # one cell, the lowest
    assert next_resize(judged, all_ready=False) is None  # a cell still rolls
    at_bound = judge_cells(cells(5 * GI), {0: 100 * GI}, {0: CellCache(reading(9 * GI))},
                           POLICY, auto)
    assert (at_bound[0].verdict, at_bound[0].target) == (UNDERSIZED, None)  # nothing to do
    unplaced = [Cell(0, "", 0, GI, 0, "no node fits")]
    assert judge_cells(unplaced, {}, {}, POLICY, auto) == []


def test_autosize_resizes_a_stable_curve_once() -> None:
    """After the resize the same recommendation judges the new size right: no second one,
    whatever the cell keeps reporting."""
    auto = AutoSize(512 * MI, 8 * GI)
    before = judge_cells(cells(GI), {0: 100 * GI}, {0: CellCache(reading(3 * GI))}, POLICY, auto)
    assert before[0].target == 3 * GI
    after = judge_cells(cells(3 * GI), {0: 100 * GI},
                        {0: CellCache(reading(3 * GI), verdict=UNDERSIZED)}, POLICY, auto)
    assert (after[0].verdict, after[0].target) == (RIGHT, None)
    shrink = judge_cells(cells(8 * GI), {0: 100 * GI}, {0: CellCache(reading(GI))}, POLICY, auto)
    assert (shrink[0].verdict, shrink[0].target) == (OVERSIZED, GI)


def test_the_condition_says_what_to_do() -> None:
    judged = judge_cells(cells(GI), {0: 100 * GI}, {0: CellCache(reading(3 * GI))}, POLICY, None)
    status, reason, message = cache_sized_verdict(judged, None, POLICY)
    assert (status, reason) == ("False", UNDERSIZED)
    assert message.startswith("cell 0 (1Gi cache on a) is undersized: over 5000 image "
                              "references the estimated hit ratio is 0.40, an unbounded cache "
                              "would reach 0.80, and 3Gi reaches the target fraction of that")
    assert message.endswith("set spec.featureCache.size to 3Gi (or set featureCache.autoSize "
                            "to let the operator size it)")
    bounded = judge_cells(cells(GI), {0: 2 * GI}, {0: CellCache(reading(3 * GI))}, POLICY, None)
    assert "the node has room for 2Gi: raise maxNodeMemoryPercent" in \
        cache_sized_verdict(bounded, None, POLICY)[2]
    right = judge_cells(cells(3 * GI), {0: 100 * GI}, {0: CellCache(reading(3 * GI))}, POLICY,
                        None)
    assert cache_sized_verdict(right, None, POLICY)[:2] == ("True", RIGHT)
    early = judge_cells(cells(GI), {0: 100 * GI}, {0: CellCache(reading(3 * GI, 12))}, POLICY,
                        None)
    assert cache_sized_verdict(early, None, POLICY) == (
        "Unknown", "NotEnoughReferences", "cell 0 (1Gi cache on a): its scheduler has seen 12 "
        "image references since it started; sizing waits for 100")
    auto = AutoSize(512 * MI, 8 * GI)
    judged = judge_cells(cells(GI), {0: 100 * GI}, {0: CellCache(reading(3 * GI))}, POLICY, auto)
    assert cache_sized_verdict(judged, auto, POLICY)[2].endswith(
        "autoSize (512Mi..8Gi) resizes it to 3Gi")
    off = judge_cells(cells(0), {0: 100 * GI}, {0: CellCache(reading(3 * GI))}, POLICY, None)
    assert cache_sized_verdict(off, None, POLICY)[2].endswith(
        "turn the cache on: set spec.featureCache.type to shm and size to 3Gi")


def test_status_cache_reports_the_largest_bounded_recommendation() -> None:
    judged = judge_cells(cells(GI, GI), {0: 100 * GI, 1: 2 * GI},
                         {0: CellCache(reading(3 * GI + 1)), 1: CellCache(reading(5 * GI))},
                         POLICY, None)
    status = status_cache(judged)
    assert status["recommendedSize"] == "3.1Gi"  # at least the recommendation
    assert status["cells"][1] == {
        "index": 1, "sizeBytes": GI, "verdict": UNDERSIZED, "recommendedBytes": 2 * GI,
        "unboundedBytes": 5 * GI, "achievableHitRatio": 0.8, "references": 5000,
        "unackedRefs": 0, "hitRatio": 0.4}
    assert status_cache([])["recommendedSize"] == ""
    assert [quantity(n) for n in (512, 1536, 3 * GI, int(1023.95 * MI))] == [
        "512", "1.5Ki", "3Gi", "1024Mi"]


# -- the leak watch -------------------------------------------------------------------------------

def test_references_unacknowledged_while_idle_for_long_leak() -> None:
    placed = cells(GI)
    cache = CellCache(reading(GI, unacked=3))
    observe_leak(cache, now=100.0)
    assert leaks(placed, {0: cache}, 159.0, POLICY) == {}
    assert leak_verdict(placed, {0: cache}, 159.0, POLICY)[:2] == ("False", "NoLeak")
    status, reason, message = leak_verdict(placed, {0: cache}, 160.0, POLICY)
    assert (status, reason) == ("True", "UnacknowledgedWhileIdle")
    assert message.startswith("cell 0: 3 segment references unacknowledged while the cell "
                              "handled no request for more than 60 s")
    cache.leak_reported = True
    cache.reading = reading(GI, unacked=3, in_flight=1)  # busy: references may be in flight
    observe_leak(cache, now=170.0)
    assert cache.idle_since is None and not cache.leak_reported
    cache.reading = reading(GI, unacked=3)
    observe_leak(cache, now=180.0)
    assert leaks(placed, {0: cache}, 200.0, POLICY) == {}  # the clock started again
    assert leak_verdict(placed, {}, 200.0, POLICY)[:2] == ("Unknown", "NoStats")


# -- placement with per-cell sizes, the spec, the cell's stats -----------------------------------

def test_autosize_sizes_cells_one_by_one_within_the_node() -> None:
    spec = tandem_spec({"cells": 2, "placement": {"maxCellsPerNode": 2},
                        "featureCache": {"size": "2Gi", "autoSize": {"min": "1Gi",
                                                                     "max": "8Gi"}}})
    nodes = {"a": node_info(node("a", memory="64Gi"))}
    loads = [pod_load(pod("x", "a", {"memory": "10Gi"}))]
    first = place_cells(spec, nodes, loads, [])
    assert [(c.cache_bytes, c.requested_bytes, c.generation) for c in first] == [
        (2 * GI, 2 * GI, 1)] * 2
    # 50% of 64Gi, minus 10Gi of others, 2 x 5Gi of the cells and the other's 2Gi cache
    assert cache_room(spec, nodes, loads, first, 0) == 32 * GI - 10 * GI - 10 * GI - 2 * GI
    resized = place_cells(spec, nodes, loads, first, resize={1: 6 * GI})
    assert resized[0] == first[0]  # untouched
    assert (resized[1].node, resized[1].cache_bytes, resized[1].generation) == ("a", 6 * GI, 2)
    assert place_cells(spec, nodes, loads, resized) == resized  # the choice is kept
    narrower = tandem_spec({"cells": 2, "placement": {"maxCellsPerNode": 2},
                            "featureCache": {"size": "2Gi", "autoSize": {"min": "1Gi",
                                                                         "max": "4Gi"}}})
    clamped = place_cells(narrower, nodes, loads, resized)
    assert [c.requested_bytes for c in clamped] == [2 * GI, 4 * GI]  # new bounds hold


def test_the_spec_refuses_an_autosize_it_cannot_honour() -> None:
    spec = tandem_spec({"featureCache": {"autoSize": {"min": "512Mi", "max": "8Gi"}}})
    assert spec.cache.auto_size == AutoSize(512 * MI, 8 * GI)
    assert tandem_spec({}).cache.auto_size is None
    with pytest.raises(SpecError, match=r"autoSize\.min .* is above autoSize\.max"):
        tandem_spec({"featureCache": {"autoSize": {"min": "8Gi", "max": "1Gi"}}})
    with pytest.raises(SpecError, match=r"autoSize\.min must be above 0"):
        tandem_spec({"featureCache": {"autoSize": {"min": 0, "max": "1Gi"}}})


def test_a_cells_stats_become_a_reading_and_its_address_a_target() -> None:
    stats = pb.CacheStatsResponse(
        mm_cache_capacity_bytes=GI, mm_cache_recommended_bytes=3 * GI,
        mm_cache_curve_references=42, mm_cache_achievable_hit_ratio=0.9, shm_unacked_refs=2,
        requests_in_flight=1, mm_cache_curve=[pb.CurvePoint(capacity_bytes=GI // 2, hit_ratio=0.2),
                                              pb.CurvePoint(capacity_bytes=GI, hit_ratio=0.5)])
    assert to_reading(stats) == Reading(GI, 3 * GI, 42, 0.9, 0.5, 2, 1)
    assert to_reading(pb.CacheStatsResponse()).hit_ratio is None
    one = tandem_spec({}, name="svc", namespace="ns")
    assert cell_target(one, 0, "10.0.0.7") == CellTarget("10.0.0.7:50051", "svc.ns.svc")
    many = tandem_spec({"cells": 2}, name="svc", namespace="ns")
    assert cell_target(many, 1, "fd00::7") == CellTarget(
        "[fd00::7]:50051", "svc-1-scheduler-0.svc-headless.ns.svc")


def test_the_operator_reads_a_tls_cell_with_the_services_secret(tmp_path: Path) -> None:
    """Against a real mutual-TLS server: the Secret's CA verifies the cell, its certificate
    is presented as the client's (as the endpoint picker does); a name the certificate does not
    carry, or no client certificate, is refused with a reason."""
    pki = make_pki(tmp_path)
    server = grpc.server(ThreadPoolExecutor(max_workers=2))

    class Cell(pb_grpc.GenerationServicer):
        def CacheStats(self, request: pb.CacheStatsRequest,
                       context: grpc.ServicerContext) -> pb.CacheStatsResponse:
            return pb.CacheStatsResponse(mm_cache_curve_references=7)

    pb_grpc.add_GenerationServicer_to_server(Cell(), server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(
        TlsFiles(str(pki.server_cert), str(pki.server_key), str(pki.ca))))
    server.start()
    secret = {"data": {name: base64.b64encode(path.read_bytes()).decode() for name, path in (
        ("ca.crt", pki.ca), ("tls.crt", pki.server_cert), ("tls.key", pki.server_key))}}
    mutual = tandem_spec({"tls": {"secretName": "cells", "clientCASecretName": "clients"}})
    try:
        target = CellTarget(f"127.0.0.1:{port}", "localhost")
        got = asyncio.run(read_cell(target, tls_credentials(mutual, secret), timeout=10))
        assert got.references == 7
        with pytest.raises(CellUnreachable, match="UNAVAILABLE"):
            asyncio.run(read_cell(CellTarget(target.address, "svc.serving.svc"),
                                  tls_credentials(mutual, secret), timeout=10))
        one_way = tandem_spec({"tls": {"secretName": "cells"}})
        with pytest.raises(CellUnreachable, match="UNAVAILABLE"):
            asyncio.run(read_cell(target, tls_credentials(one_way, secret), timeout=10))
        with pytest.raises(CellUnreachable, match=r"has no ca\.crt"):
            tls_credentials(mutual, {"data": {}})
    finally:
        server.stop(0)
