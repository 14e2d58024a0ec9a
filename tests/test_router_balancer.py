"""The picking's pure parts (router_svc): ring, bounded-load balancer, routing key, stats
aggregation."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from router_svc.balancer import Balancer
from router_svc.metrics import BalancerCollector
from router_svc.ring import HashRing
from router_svc.routing_key import routing_key
from tandem.cell_stats import aggregate, format_per_cell, parse_per_cell, per_cell_metadata
from tandem.v1 import generate_pb2

CELLS = ("10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051")
KEYS = [f"key-{i}".encode() for i in range(3000)]


def _balancer(cells=CELLS, load_factor: float = 1.25) -> Balancer:
    b = Balancer(cells, load_factor)
    for c in cells:
        b.set_healthy(c, True)
    return b


def _place(b: Balancer, keys=KEYS) -> dict[bytes, str]:
    """Where each key goes on an idle cluster (routes, then releases)."""
    out = {}
    for k in keys:
        d = b.route(k)
        assert d is not None
        b.release(d.cell)
        out[k] = d.cell
    return out


def test_walk_is_a_stable_permutation_and_shares_are_even() -> None:
    # Any picker replica given the same cells, in any order, routes the same way.
    ring, again = HashRing(CELLS), HashRing(CELLS[::-1])
    ring.check_invariants()
    for k in KEYS[:200]:
        order = list(ring.walk(k))
        assert sorted(order) == sorted(CELLS) and order == list(again.walk(k))
    shares = Counter(ring.primary(k) for k in KEYS)
    assert all(0.25 < shares[c] / len(KEYS) < 0.42 for c in CELLS), shares


def test_a_down_cell_moves_only_its_keys_and_gets_them_back() -> None:
    cells = (*CELLS, "10.0.0.4:50051")
    b = _balancer(cells)
    before = _place(b)
    b.set_healthy(cells[3], False)
    during = _place(b)
    moved = {k for k in KEYS if before[k] != during[k]}
    assert moved == {k for k in KEYS if before[k] == cells[3]}
    # Virtual nodes spread the lost keys over every remaining cell.
    assert set(Counter(during[k] for k in moved)) == set(CELLS)
    assert b.decision_counts("failover")[cells[3]] == 0
    assert sum(b.decision_counts("failover").values()) == len(moved)
    b.set_healthy(cells[3], True)
    assert _place(b) == before
    b.check_invariants()


def test_single_hot_key_stays_within_the_load_bound() -> None:
    b = _balancer()
    hot = b"the hot image"
    primary = b.ring.primary(hot)
    for total in range(1, 61):
        d = b.route(hot)
        assert d is not None
        assert b.in_flight[d.cell] <= math.ceil(1.25 * total / 3), (total, b.in_flight)
        b.check_invariants()
    assert sum(b.in_flight.values()) == 60
    assert max(b.in_flight.values()) <= math.ceil(1.25 * 60 / 3)
    assert b.decisions[(primary, "affinity")] == b.in_flight[primary]
    assert sum(b.decision_counts("spill").values()) == 60 - b.in_flight[primary]
    assert sum(b.decision_counts("failover").values()) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans(), st.integers(0, 2)), max_size=150),
       st.sampled_from([1.0, 1.25, 2.0]))
def test_bound_holds_for_any_mix_of_routes_releases_and_outages(ops, load_factor) -> None:
    """Random routes (6 keys, one of them hot), releases and health flips: every
    acquisition respects the bound over the cells serving at that moment."""
    b = _balancer(load_factor=load_factor)
    rng = random.Random(len(ops))
    held: list[str] = []
    for key, release, flip in ops:
        if flip == 2:
            cell = CELLS[key % 3]
            b.set_healthy(cell, cell not in b.healthy)
        elif release and held:
            b.release(held.pop(rng.randrange(len(held))))
        else:
            serving = [c for c in CELLS if c in b.healthy]
            load = sum(b.in_flight[c] for c in serving)
            d = b.route(b"hot" if key < 3 else bytes([key]))
            if not serving:
                assert d is None
                continue
            assert d is not None and d.cell in serving
            assert b.in_flight[d.cell] <= math.ceil(load_factor * (load + 1) / len(serving))
            held.append(d.cell)
        b.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(0, 7),
                          st.integers(0, 3)), max_size=120))
def test_subsets_and_queue_bounds_narrow_the_pick_and_keep_the_bound(ops) -> None:
    """The picker's limits: random subsets (bit masks of the cells), reported queues
    against a bound of 2, health flips and releases. A pick lands in the subset, on a
    healthy cell under its queue bound, within the load bound over those cells; there is
    none exactly when no such cell exists."""
    b = Balancer(CELLS, 1.25, queue_bound=2)
    held: list[str] = []
    for key, action, mask, queued in ops:
        cell = CELLS[key % 3]
        if action == 0:
            b.set_healthy(cell, cell not in b.healthy)
        elif action == 1:
            b.set_queued(cell, queued)
        elif action == 2 and held:
            b.release(held.pop(key % len(held)))
        else:
            only = {c for i, c in enumerate(CELLS) if mask >> i & 1}
            eligible = [c for c in CELLS if c in b.healthy and c in only and b.queued[c] < 2]
            load = sum(b.in_flight[c] for c in eligible)
            d = b.route(bytes([key]), only=only)
            if not eligible:
                assert d is None
                continue
            assert d is not None and d.cell in eligible
            assert b.in_flight[d.cell] <= math.ceil(1.25 * (load + 1) / len(eligible))
            held.append(d.cell)
        b.check_invariants()


def test_reasons_exclusions_and_bad_settings() -> None:
    b = _balancer()
    key = b"some image"
    order = list(b.ring.walk(key))
    d = b.route(key)
    assert d is not None and (d.cell, d.reason) == (order[0], "affinity")
    assert d.span_attributes() == {"tandem.route.cell": order[0], "tandem.route.reason": "affinity"}
    b.release(d.cell)
    d = b.route(key, exclude=[order[0]])  # the first cell already failed this request
    assert d is not None and (d.cell, d.reason) == (order[1], "failover")
    b.release(d.cell)
    for c in CELLS:
        b.set_healthy(c, False)
    assert b.route(key) is None
    b.check_invariants()
    with pytest.raises(ValueError, match="load_factor"):
        Balancer(CELLS, 0.9)
    with pytest.raises(ValueError, match="duplicate"):
        Balancer((CELLS[0], CELLS[0]))
    with pytest.raises(KeyError):
        b.set_healthy("elsewhere:1", True)
    with pytest.raises(KeyError):
        b.set_queued("elsewhere:1", 1)
    with pytest.raises(ValueError, match="queue_bound"):
        Balancer(CELLS, queue_bound=-1)


def _req(prompt: str, images=(), salt: str = "") -> generate_pb2.GenerateRequest:
    msg = generate_pb2.GenerateRequest(prompt=prompt, cache_salt=salt)
    for item in images:
        msg.images.append(item)
    return msg


def test_routing_key_follows_what_the_cells_cache() -> None:
    img = generate_pb2.MediaItem(encoded=b"\x89PNG one")
    other = generate_pb2.MediaItem(encoded=b"\x89PNG two")
    named = generate_pb2.MediaItem(encoded=b"\x89PNG one", uuid="cat-1")
    renamed = generate_pb2.MediaItem(encoded=b"\x89PNG two", uuid="cat-1")
    key = routing_key(_req("Describe <image>.", [img]), 16)
    # The first image decides, whatever the text or later images.
    assert key == routing_key(_req("What is in <image> and <image>?", [img, other]), 16)
    assert key != routing_key(_req("Describe <image>.", [other]), 16)
    assert key != routing_key(_req("Describe <image>.", [img], salt="tenant-a"), 16)
    # A uuid names the image instead of its bytes, as in the processor cache.
    assert routing_key(_req("<image>", [named]), 16) == routing_key(_req("<image>", [renamed]), 16)
    assert routing_key(_req("<image>", [named]), 16) != key
    # Same bytes, different shape: different images.
    flat = generate_pb2.MediaItem(tensor={"dtype": "float32", "shape": [1, 4, 3],
                                          "data": bytes(48)})
    tall = generate_pb2.MediaItem(tensor={"dtype": "float32", "shape": [4, 1, 3],
                                          "data": bytes(48)})
    assert routing_key(_req("<image>", [flat]), 16) != routing_key(_req("<image>", [tall]), 16)
    # Text: only the first block_size bytes count (a shared first block shares them).
    system = "You are a careful assistant. "
    assert routing_key(_req(system + "Hi"), 16) == routing_key(_req(system + "Bye"), 16)
    assert routing_key(_req("Short one"), 16) != routing_key(_req("Short two"), 16)
    assert routing_key(_req(system + "Hi"), 16) != routing_key(_req(system + "Hi", salt="t"), 16)


def _chat(*turns: tuple[str, list[str | generate_pb2.MediaItem]],
          salt: str = "") -> generate_pb2.GenerateRequest:
    msg = generate_pb2.GenerateRequest(cache_salt=salt)
    for role, parts in turns:
        turn = msg.messages.add(role=role)
        for part in parts:
            if isinstance(part, str):
                turn.content.add(text=part)
            else:
                turn.content.add(image=part)
    return msg


def test_routing_key_of_chat_requests() -> None:
    img = generate_pb2.MediaItem(encoded=b"\x89PNG one")
    other = generate_pb2.MediaItem(encoded=b"\x89PNG two")
    # The first image of the conversation decides, as for a prompt with the same image.
    key = routing_key(_chat(("user", ["Describe ", img])), 16)
    assert key == routing_key(_req("Describe <image>.", [img]), 16)
    assert key == routing_key(_chat(("system", ["Be brief."]), ("user", [img, "and", other])), 16)
    assert key != routing_key(_chat(("user", [other, img])), 16)
    assert key != routing_key(_chat(("user", ["Describe ", img]), salt="t"), 16)
    # Text only: a shared system message (the rendered prompt's first block) shares the key.
    system = ("system", ["You are a careful assistant."])
    assert routing_key(_chat(system, ("user", ["Hi"])), 16) == \
        routing_key(_chat(system, ("user", ["Bye"])), 16)
    assert routing_key(_chat(("system", ["A"]), ("user", ["Hi"])), 16) != \
        routing_key(_chat(("system", ["B"]), ("user", ["Hi"])), 16)
    assert routing_key(_chat(("user", ["Hi"])), 16) != routing_key(_chat(("assistant", ["Hi"])), 16)


def test_stats_sum_and_per_cell_round_trip() -> None:
    a = generate_pb2.CacheStatsResponse(mm_cache_hits_total=3, kv_blocks_total=10,
                                        mm_cache_type="shm")
    b = generate_pb2.CacheStatsResponse(mm_cache_hits_total=4, kv_blocks_total=20,
                                        mm_cache_type="shm", shm_unacked_refs=1)
    total = aggregate([a, b])
    assert (total.mm_cache_hits_total, total.kv_blocks_total, total.shm_unacked_refs) == (7, 30, 1)
    assert total.mm_cache_type == "shm"
    assert aggregate([a, generate_pb2.CacheStatsResponse(mm_cache_type="lru")]).mm_cache_type \
        == "mixed"
    cells = {"h1:1": a, "h2:2": b, "h3:3": None}
    assert parse_per_cell(per_cell_metadata(cells)) == cells
    table = format_per_cell(total, cells).splitlines()
    assert table[0].split() == ["field", "total", "h1:1", "h2:2", "h3:3"]
    assert ["mm_cache_hits_total", "7", "3", "4", "-"] in [row.split() for row in table]


def test_stats_combine_curves_weighted_by_references() -> None:
    """Hit ratios do not add: the total weights each cell's curve point by its references,
    at the capacity of every cell at that factor; a cell without references counts for
    nothing but its counters."""
    def cell(capacity: int, refs: int, ratios: list[float], achievable: float):
        return generate_pb2.CacheStatsResponse(
            mm_cache_capacity_bytes=capacity, mm_cache_curve_references=refs,
            mm_cache_achievable_hit_ratio=achievable, mm_cache_recommended_bytes=capacity,
            mm_cache_curve=[generate_pb2.CurvePoint(capacity_bytes=int(capacity * f),
                                                    hit_ratio=r)
                            for f, r in zip((0.5, 1, 2), ratios, strict=True)])
    a = cell(100, 300, [0.1, 0.4, 0.7], 0.8)
    b = cell(200, 100, [0.5, 0.6, 0.9], 0.9)
    idle = generate_pb2.CacheStatsResponse(mm_cache_capacity_bytes=100, mm_cache_hits_total=2)
    total = aggregate([a, b, idle])
    assert [p.capacity_bytes for p in total.mm_cache_curve] == [150, 300, 600]
    assert [p.hit_ratio for p in total.mm_cache_curve] == pytest.approx([0.2, 0.45, 0.75])
    assert total.mm_cache_achievable_hit_ratio == pytest.approx(0.825)
    assert (total.mm_cache_curve_references, total.mm_cache_capacity_bytes,
            total.mm_cache_recommended_bytes, total.mm_cache_hits_total) == (400, 400, 300, 2)
    assert aggregate([idle]).mm_cache_achievable_hit_ratio == 0.0
    table = format_per_cell(total, {"h1:1": a}).splitlines()
    assert ["mm_cache_curve", "150:0.200,300:0.450,600:0.750", "50:0.100,100:0.400,200:0.700"] \
        in [row.split() for row in table]


def test_metrics_report_decisions_per_cell_and_reason() -> None:
    b = Balancer(["a:1", "b:2"], load_factor=1.0)
    for cell in b.cells:
        b.set_healthy(cell, True)
    routed = [b.route(f"key-{i}".encode()) for i in range(6)]
    b.set_healthy("b:2", False)
    registry = CollectorRegistry()
    registry.register(BalancerCollector(b))
    text = generate_latest(registry).decode()
    for cell in b.cells:
        for reason in ("affinity", "spill", "failover"):
            count = b.decisions[(cell, reason)]
            line = f'tandem_route_decisions_total{{cell="{cell}",reason="{reason}"}} {count}.0'
            assert line in text
        assert f'tandem_route_in_flight{{cell="{cell}"}} {b.in_flight[cell]}.0' in text
    assert sum(d is not None for d in routed) == 6 == sum(b.decisions.values())
    assert 'tandem_route_cell_serving{cell="b:2"} 0.0' in text
