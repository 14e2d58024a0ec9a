"""The delivery ledger against a real segment with two reader slots: steps that succeed,
fail in doubt, are acknowledged late or never, and a reader replaced; the whole-cell check
against the writer's own counters, including the faults it must catch."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from scheduler_svc.delivery import DeliveryLedger
from scheduler_svc.output_text import OutputText
from scheduler_svc.request import Request, Sampling
from tandem.features import FieldElem, MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from tandem.processor_cache import ShmProcessorCache
from tandem.shm import ShmDescriptor, ShmReader
from tandem.text import ByteTokenizer
from tandem.v1 import generate_pb2

KiB = 1024


def _request(rid: str, keys: list[str]) -> Request:
    features = [MultiModalFeatureSpec(k, "image", PlaceholderRange(i * 10, 4), None)
                for i, k in enumerate(keys)]
    sampling = Sampling(1, 0.0, 1.0, 0, None, frozenset(), False, frozenset())
    return Request(rid, [0] * 40, 40, features, sampling,
                   text=OutputText(ByteTokenizer().incremental_decoder()),
                   cache_salt="", media=[generate_pb2.MediaItem(uuid=k) for k in keys],
                   media_bytes=[0] * len(keys))


def _process(media: generate_pb2.MediaItem) -> MultiModalKwargsItem:
    seed = sum(media.uuid.encode())
    return MultiModalKwargsItem({"pixel_values": FieldElem(torch.full((256,), float(seed)))})


async def _inline(fn: Callable[[], MultiModalKwargsItem]) -> MultiModalKwargsItem:
    return fn()


class Cell:
    """A ledger over a two-reader segment; ``readers[s]`` plays the worker on slot s."""

    def __init__(self, path: Path) -> None:
        self.cache = ShmProcessorCache(path, 64 * KiB, n_readers=2, max_object_size=16 * KiB)
        self.readers = [ShmReader(self.cache.writer.path, s) for s in range(2)]
        self.redelivered: list[Request] = []
        self.ledger = DeliveryLedger(self.cache, _process, _inline,
                                     lambda r, e: self.redelivered.append(r))
        self.step_id = 0

    def acquire(self, *keys: str) -> Request:
        request = _request("-".join(keys), list(keys))
        asyncio.run(self.ledger.acquire(request))
        return request

    def send(self, *requests: Request) -> int:
        self.step_id += 1
        self.ledger.sent(self.step_id, requests)
        return self.step_id

    def ack(self, slot: int, request: Request) -> None:
        for f in request.features:
            if isinstance(f.data, ShmDescriptor):
                self.readers[slot].ack(f.data)

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
        self.cache.close()


@pytest.fixture
def cell(tmp_path: Path) -> Iterator[Cell]:
    c = Cell(tmp_path)
    yield c
    c.close()


def test_a_delivered_step_leaves_nothing(cell: Cell) -> None:
    r = cell.acquire("A", "B", "A")
    assert cell.ledger.stats().held == 3
    cell.ledger.check_invariants()
    step = cell.send(r)
    assert cell.ledger.stats().in_flight == 3
    for slot in (0, 1):
        cell.ack(slot, r)
    cell.ledger.step_done(step)
    assert cell.ledger.stats().refs == 0 == cell.cache.writer.stats().unacked_refs
    cell.ledger.check_invariants()
    with pytest.raises(RuntimeError):
        cell.send(r)  # its references were spent: sending again needs a re-delivery


def test_a_step_one_live_worker_never_ran_stays_held_for_it(cell: Cell) -> None:
    """Slot 1 timed out and (as it turns out) dropped the step: its references are in
    doubt until slot 1 completes a later step; slot 0 did acknowledge them, so they cannot
    be released, and slot 1 is alive, so they are not forgiven: they stay held."""
    r = cell.acquire("A")
    step = cell.send(r)
    cell.ack(0, r)
    cell.ledger.step_done(step, failed_slots=[1])
    assert cell.ledger.stats().in_doubt == 1
    cell.ledger.check_invariants()
    cell.ledger.step_done(cell.send())  # a later step both slots complete
    assert cell.ledger.stats().in_doubt == 1, "acknowledged on slot 0: held until slot 1 is gone"
    assert cell.cache.writer.stats().unacked_refs == 1
    cell.ledger.check_invariants()


def test_a_step_no_slot_acknowledged_is_released(cell: Cell) -> None:
    r = cell.acquire("A")
    step = cell.send(r)
    cell.ledger.step_done(step, failed_slots=[0, 1])  # both timed out; neither ran it
    cell.ledger.check_invariants()
    cell.ledger.step_done(cell.send())
    stats = cell.ledger.stats()
    assert (stats.in_doubt, stats.released_in_doubt) == (0, 1)
    assert cell.cache.writer.stats().unacked_refs == 0
    cell.ledger.check_invariants()


def test_a_late_acknowledgement_settles_the_doubt(cell: Cell) -> None:
    """The timed-out worker finished the step after all: its acknowledgement counts, and
    the writer never wrote its slot (a newer reference is not consumed by the late ack)."""
    r = cell.acquire("A")
    step = cell.send(r)
    cell.ack(0, r)
    cell.ledger.step_done(step, failed_slots=[1])
    newer = cell.acquire("A")  # another request hits A meanwhile
    cell.ledger.check_invariants()
    cell.ack(1, r)  # slot 1's step thread acknowledges late
    cell.ledger.check_invariants()
    cell.ledger.step_done(cell.send())
    assert cell.ledger.stats().in_doubt == 0 and cell.ledger.stats().held == 1
    assert cell.cache.writer.outstanding() == {newer.features[0].data.monotonic_id: (1, 1)}
    cell.ledger.check_invariants()


def test_a_replaced_reader_is_forgiven_but_keeps_what_is_still_to_be_sent(cell: Cell) -> None:
    r = cell.acquire("A")
    step = cell.send(r)
    cell.ack(0, r)
    cell.ledger.step_done(step, failed_slots=[1])  # slot 1 died mid-step
    waiting = cell.acquire("A", "B")  # acquired before the death is known
    cell.ledger.reader_gone(1)
    assert cell.ledger.stats().in_doubt == 0 and cell.ledger.stats().held == 2
    cell.ledger.check_invariants()
    step = cell.send(waiting)  # the replacement on slot 1 receives them
    for slot in (0, 1):
        cell.ack(slot, waiting)
    cell.ledger.step_done(step)
    assert cell.cache.writer.stats().unacked_refs == 0
    cell.ledger.check_invariants()


def test_a_preempted_request_gets_fresh_references(cell: Cell) -> None:
    r = cell.acquire("A")
    step = cell.send(r)
    for slot in (0, 1):
        cell.ack(slot, r)
    cell.ledger.step_done(step)

    async def redeliver() -> None:
        cell.ledger.redeliver(r)
        assert not cell.ledger.deliverable(r)
        while not cell.redelivered:
            await asyncio.sleep(0)

    asyncio.run(redeliver())
    assert cell.ledger.deliverable(r) and cell.ledger.stats().held == 1
    assert cell.cache.writer.stats().hits == 1
    cell.ledger.check_invariants()
    cell.ledger.release(r)  # aborted while waiting
    assert cell.cache.writer.stats().unacked_refs == 0


@pytest.mark.parametrize("fault", ["unrecorded hit", "double ack"])
def test_the_check_catches_what_the_ledger_does_not_account_for(cell: Cell, fault: str) -> None:
    r = cell.acquire("A")
    if fault == "unrecorded hit":
        cell.cache.writer.hit("A")  # a reference issued behind the ledger's back
    else:
        step = cell.send(r)
        for slot in (0, 1):
            cell.ack(slot, r)
        cell.ledger.step_done(step)
        held = cell.acquire("A")
        cell.ledger.check_invariants()
        cell.ack(0, held)  # acknowledged by slot 0 although never sent: counted twice
    with pytest.raises(AssertionError):
        cell.ledger.check_invariants()
