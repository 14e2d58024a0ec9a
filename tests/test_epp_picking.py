"""The endpoint picker's pure parts: cell entries, reading a buffered request into
the routing key, the gateway's subset hint, and the balancer's subset and queue
bound (router_svc/epp.py, router_svc/balancer.py)."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json

import pytest
from google.protobuf import struct_pb2

from router_svc import ext_proc_pb2 as ext_proc
from router_svc.balancer import Balancer
from router_svc.epp import (
    GENERATE_PATH,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
    CellEndpoint,
    Picker,
    parse_cells,
    request_key,
    subset_hint,
)
from router_svc.routing_key import routing_key
from tandem.errors import ResourceExhausted, Unavailable
from tandem.v1 import generate_pb2

BLOCK = 16


def test_cell_entries() -> None:
    cells = parse_cells("a.svc:50051, 10.0.0.2:50051/8001,[fd00::1]:7/9", 8000)
    assert cells == (CellEndpoint("a.svc", 50051, 8000), CellEndpoint("10.0.0.2", 50051, 8001),
                     CellEndpoint("fd00::1", 7, 9))
    assert [c.name for c in cells] == ["a.svc:50051", "10.0.0.2:50051", "[fd00::1]:7"]
    v6 = CellEndpoint("fd00::1", 7, 9, "fd00::1")
    assert (v6.destination(True), v6.destination(False)) == ("[fd00::1]:7", "[fd00::1]:9")
    assert parse_cells(" , ", 8000) == ()
    for bad in ("a.svc", "a.svc:x", "a.svc:0", "a.svc:1/70000", ":5", "a:1,a:1/2"):
        with pytest.raises(ValueError, match=r"cell|twice"):
            parse_cells(bad, 8000)


def _framed(msg: generate_pb2.GenerateRequest, compressed: bool = False) -> bytes:
    data = msg.SerializeToString()
    return bytes([compressed]) + len(data).to_bytes(4, "big") + data


def test_grpc_and_openai_bodies_get_the_routers_key() -> None:
    image = b"\x89PNG fake image bytes"
    grpc_msg = generate_pb2.GenerateRequest(prompt="<image> what?", cache_salt="t")
    grpc_msg.images.add(encoded=image)
    key = routing_key(grpc_msg, BLOCK)
    assert request_key(GENERATE_PATH, "application/grpc", _framed(grpc_msg), BLOCK) == key
    # The same image in an OpenAI chat: the same key, so both APIs share the image's cell.
    chat = {"model": "m", "cache_salt": "t", "messages": [{"role": "user", "content": [
        {"type": "image_url",
         "image_url": {"url": "data:image/png;base64," + base64.b64encode(image).decode()}},
        {"type": "text", "text": "what?"}]}]}
    assert request_key("/v1/chat/completions", "application/json",
                       json.dumps(chat).encode(), BLOCK) == key
    text = {"model": "m", "prompt": "a prompt longer than one block of bytes"}
    assert request_key("/v1/completions?x=1", "application/json", json.dumps(text).encode(),
                       BLOCK) == routing_key(generate_pb2.GenerateRequest(
                           prompt=text["prompt"]), BLOCK)
    # What the picker cannot read goes by the empty request's key; the cell answers it.
    empty = routing_key(generate_pb2.GenerateRequest(), BLOCK)
    for path, content_type, body in (
            (GENERATE_PATH, "application/grpc", _framed(grpc_msg, compressed=True)),
            (GENERATE_PATH, "application/grpc", b"\0\0\0\0\x09garbage!!"),
            ("/tandem.v1.Generation/GetModelInfo", "application/grpc", b"\0\0\0\0\0"),
            ("/v1/chat/completions", "application/json", b"{not json"),
            ("/v1/chat/completions", "application/json", b'{"model": "m", "n": 2, '
                                                          b'"messages": []}'),
            ("/v1/models", "", b"")):
        assert request_key(path, content_type, body, BLOCK) == empty, (path, body)


def test_remote_image_urls_are_keyed_by_the_url() -> None:
    def chat(url: str) -> bytes:
        return json.dumps({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}]}).encode()
    a = request_key("/v1/chat/completions", "application/json", chat("https://x/a.png"), BLOCK)
    b = request_key("/v1/chat/completions", "application/json", chat("https://x/b.png"), BLOCK)
    assert a != b
    assert a == request_key("/v1/chat/completions", "application/json",
                            chat("https://x/a.png"), BLOCK)


def test_subset_hint_forms() -> None:
    metadata = ext_proc.Metadata()
    assert subset_hint(metadata) is None
    hint = struct_pb2.Struct()
    hint.get_or_create_list(SUBSET_KEY).extend(["10.0.0.1:50051", " 10.0.0.2:8000 "])
    metadata.filter_metadata[SUBSET_NAMESPACE].CopyFrom(hint)
    assert subset_hint(metadata) == {"10.0.0.1:50051", "10.0.0.2:8000"}
    hint = struct_pb2.Struct()
    hint[SUBSET_KEY] = "10.0.0.1:50051,10.0.0.3:1"
    metadata.filter_metadata[SUBSET_NAMESPACE].CopyFrom(hint)
    assert subset_hint(metadata) == {"10.0.0.1:50051", "10.0.0.3:1"}
    hint = struct_pb2.Struct()
    hint.get_or_create_list(SUBSET_KEY)
    metadata.filter_metadata[SUBSET_NAMESPACE].CopyFrom(hint)
    assert subset_hint(metadata) == frozenset()  # a hint naming nothing: nothing eligible


def test_the_picker_keeps_to_the_hint_and_the_queue_bound() -> None:
    cells = [CellEndpoint(f"10.0.0.{i}", 50051, 8000, f"10.0.0.{i}") for i in (1, 2, 3)]
    balancer = Balancer([c.name for c in cells], queue_bound=4)
    picker = Picker(balancer, cells)
    with pytest.raises(Unavailable, match="no cell is serving"):
        picker.pick(b"k", None)
    for c in cells:
        balancer.set_healthy(c.name, True)
    assert picker.in_subset({"10.0.0.2:8000", "10.0.0.3", "10.0.0.9:1"}) == {
        "10.0.0.2:50051", "10.0.0.3:50051"}
    for i in range(30):
        decision = picker.pick(bytes([i]), {"10.0.0.2:50051"})
        assert decision.cell == "10.0.0.2:50051"
        balancer.release(decision.cell)
    with pytest.raises(Unavailable, match="subset hint"):
        picker.pick(b"k", {"10.0.0.9:50051"})
    balancer.set_queued("10.0.0.1:50051", 4)
    balancer.set_queued("10.0.0.2:50051", 9)
    for i in range(30):  # full cells are skipped, whatever the key prefers
        decision = picker.pick(bytes([i]), None)
        assert decision.cell == "10.0.0.3:50051"
        balancer.release(decision.cell)
    with pytest.raises(ResourceExhausted, match="queue"):
        picker.pick(b"k", {"10.0.0.1", "10.0.0.2"})
    balancer.set_queued("10.0.0.1:50051", 3)  # drained below the bound: eligible again
    assert picker.pick(b"k", {"10.0.0.1"}).cell == "10.0.0.1:50051"
    balancer.check_invariants()


def test_a_cell_whose_host_does_not_resolve_yet_is_left_out_until_it_does() -> None:
    """On Kubernetes a scheduler pod that is not ready has no DNS record yet: the picker
    must start and route to the others, and take the cell once its name resolves."""
    ready = CellEndpoint("127.0.0.1", 50051, 8000)
    pending = CellEndpoint("cell-1.not-ready.invalid", 50051, 8000)
    balancer = Balancer([ready.name, pending.name])
    picker = Picker(balancer, [ready, pending])
    # No OSError: the unresolved cell just has no address. A change is reported (the
    # gateway then rewrites its Envoy's cells), no change is not.
    assert asyncio.run(picker.resolve()) is True
    assert asyncio.run(picker.resolve()) is False
    assert (picker.cells[ready.name].ip, picker.cells[pending.name].ip) == ("127.0.0.1", "")
    for c in (ready, pending):
        balancer.set_healthy(c.name, True)  # healthy by its gRPC check, even so
    for i in range(40):
        decision = picker.pick(bytes([i]), None)
        assert decision.cell == ready.name
        balancer.release(decision.cell)
    # the name resolves now (as the next resolve() finds it)
    picker.cells[pending.name] = dataclasses.replace(pending, ip="10.0.0.7")
    picked = {picker.pick(bytes([i]), None).cell for i in range(40)}
    assert picked == {ready.name, pending.name}


def test_the_fallbacks_are_the_next_eligible_cells_in_ring_order() -> None:
    """Where Envoy retries a request whose cell failed before answering: the cells the
    router would have failed over to (its ring order past the picked cell), eligible ones
    only."""
    names = [f"10.0.0.{i}:50051" for i in (1, 2, 3, 4)]
    balancer = Balancer(names, queue_bound=4)
    for name in names:
        balancer.set_healthy(name, True)
    for i in range(20):
        key = bytes([i])
        order = list(balancer.ring.walk(key))
        decision = balancer.route(key)
        assert decision is not None
        assert balancer.fallbacks(key, decision.cell) == [c for c in order
                                                          if c != decision.cell]
        balancer.release(decision.cell)
    key = b"k"
    first, second, third, fourth = balancer.ring.walk(key)
    balancer.set_healthy(second, False)  # down
    balancer.set_queued(third, 4)  # over its queue bound
    assert balancer.fallbacks(key, first) == [fourth]
    assert balancer.fallbacks(key, first, only={first, second, third}) == []
    balancer.check_invariants()
