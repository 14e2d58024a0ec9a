"""The delivery ledger: every SHM reference the scheduler issues, from acquisition to the
workers' acknowledgements. The obligation at the heart of Tandem is stated here and only
here:

    **Every reference the writer issues reaches every reader slot exactly once, or is
    released.** A reference is issued when a request's image is acquired (a put on a miss,
    a hit otherwise: one reference per delivery); it reaches a slot when the worker on that
    slot accepts a step carrying it (it then adds ``desc.refs`` to its own ack counter);
    it is released (``ShmWriter.release``) when no slot will ever receive it. A slot's
    counter is written by the scheduler only once that reader's process is known gone.

Everything else follows from it: a chunk is reclaimable exactly when no reference is
outstanding on any slot, so a leak pins segment space for ever, and an acknowledgement
counted twice lets the writer reuse a chunk while a descriptor of it is still in flight.

A reference is in one of four places, and :class:`DeliveryLedger` records which:

* **held** by a request (acquired, not yet sent): on first processing, on a processor-cache
  hit, and again when a preempted request resumes, all through one de-duplicated path
  (:meth:`DeliveryLedger.acquire`, :meth:`DeliveryLedger.redeliver`); given back
  (:meth:`DeliveryLedger.release`) when the request ends without sending it;
* **in flight**: in a step handed to the workers, outcome not known yet (with asynchronous
  scheduling two steps may be out: a worker may acknowledge the later one's references
  any time after it completed the earlier one);
* **delivered**: the step succeeded on every worker; the ledger forgets it;
* **in doubt** on a slot: the step failed there (timed out, cancelled, refused, the worker
  died...), so that worker may or may not have acknowledged it. Workers run steps one at a
  time, in the order they reach them (docs/worker.md), so once a worker has completed a
  later step every earlier one has finished or will never run: what the segment then shows
  unacknowledged on that slot never will be. Such references are released when no slot
  acknowledged them; those some slot did acknowledge stay held until the lagging reader's
  process is known gone (:meth:`DeliveryLedger.reader_gone`). A live worker may never have
  received a failed step (its stream ended with the step unread): the engine asks it to
  acknowledge those (:meth:`DeliveryLedger.unseen`, worker.proto ``Acknowledge``) when
  it reconnects, and then settles (:meth:`DeliveryLedger.settle`).

:meth:`DeliveryLedger.check_invariants` (after every step with ``TANDEM_DEBUG_INVARIANTS=1``)
compares all of this, per object and slot, with the writer's own counters
(``ShmWriter.outstanding``, whose sum is ``ShmWriter.stats().unacked_refs``).

Every delivery is also one reference of the processor cache's stream: the ledger feeds
each to the reuse curve (``tandem/reuse_curve.py``), keyed as the cache keys images and
weighed as it charges them, and the first delivery of a request attributes each image
(``Request.images``, :mod:`scheduler_svc.image_usage`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace

from scheduler_svc.input_processor import Offload
from scheduler_svc.request import Request
from scheduler_svc.request_trace import image_span
from tandem.features import FeatureData, MultiModalKwargsItem
from tandem.processor_cache import ProcessorCache, ShmProcessorCache
from tandem.reuse_curve import ReuseCurve
from tandem.shm import ShmDescriptor
from tandem.v1 import generate_pb2

log = logging.getLogger(__name__)

Process = Callable[[generate_pb2.MediaItem], MultiModalKwargsItem]


@dataclass(slots=True, eq=False)
class _Holding:
    """What one request holds between acquisition and the step that sends it."""

    refs: list[ShmDescriptor] = field(default_factory=list)  # issued for it, not yet sent
    ready: bool = False  # every feature has data for this delivery: it may be sent
    task: asyncio.Task[None] | None = None  # a re-delivery still acquiring


@dataclass(slots=True, eq=False)
class _Doubt:
    """References of one object whose delivery to some slots is unknown."""

    desc: ShmDescriptor  # names the object (its refs field is not meaningful here)
    per_slot: list[int]  # slot -> references that slot may not have acknowledged
    exact: bool = False  # per_slot is what the slots left unacknowledged (settled)


@dataclass(frozen=True, slots=True)
class LedgerStats:
    held: int  # references acquired for requests and not yet sent
    in_flight: int  # sent in a step whose outcome is not known yet
    in_doubt: int  # per object, the largest count over slots
    released_in_doubt: int  # since start: in-doubt references no slot acknowledged

    @property
    def refs(self) -> int:
        """What the writer's ``unacked_refs`` must equal once every slot completed a step."""
        return self.held + self.in_flight + self.in_doubt


class DeliveryLedger:
    """Owns the SHM references of every request (see the module docstring: the invariant).

    ``process(media)`` turns an image into its item (CPU-heavy; run through ``offload``).
    ``on_redelivered(request, error)`` is called when a preempted request's re-acquisition
    finished (``error`` None) or failed; the caller then wakes the scheduler or fails it.
    ``reuse`` observes every delivery's reference (the processor cache's reuse curve; the
    engine passes the one its CacheStats reports).

    Only this class calls the processor cache's ``pinned``/``lookup``/``store``/``release``
    and the writer's ``release``/``reset_reader_slot`` for requests; it runs on the event
    loop's thread only. With a cache other than ``shm`` nothing is referenced and the
    ledger only de-duplicates processing.
    """

    def __init__(self, cache: ProcessorCache, process: Process, offload: Offload,
                 on_redelivered: Callable[[Request, BaseException | None], None],
                 reuse: ReuseCurve | None = None) -> None:
        self.cache = cache
        self.reuse = reuse if reuse is not None else ReuseCurve()
        self.writer = cache.writer if isinstance(cache, ShmProcessorCache) else None
        self._process = process
        self._offload = offload
        self._on_redelivered = on_redelivered
        self._holdings: dict[Request, _Holding] = {}
        self._in_flight: dict[int, list[ShmDescriptor]] = {}  # step id -> refs sent
        self._doubt: dict[int, _Doubt] = {}  # monotonic id -> unknown deliveries
        self._unsettled: set[int] = set()  # slots whose last step failed: counters may move
        # Steps that failed on some slots, until the next settle: step id -> (the refs it
        # carried, those slots). A worker may never have received them (see ``unseen``).
        self._failed: dict[int, tuple[list[ShmDescriptor], frozenset[int]]] = {}
        self._processing: dict[str, asyncio.Future[MultiModalKwargsItem]] = {}
        self._released_in_doubt = 0

    @property
    def n_readers(self) -> int:
        return self.writer.n_readers if self.writer is not None else 0

    # -- acquisition ----------------------------------------------------------------------

    async def acquire(self, request: Request) -> None:
        """First delivery: every feature of ``request`` gets its data (a hit, or the image
        processed once even when other requests race for it). The request's trace gets
        one image span per image. On any failure (or cancellation) nothing stays held."""
        holding = self._holdings[request] = _Holding()
        try:
            request.mm_cache_hits = await self._fill(request, range(len(request.features)),
                                                     holding, first=True)
        except BaseException:
            self.release(request)
            raise
        holding.ready = True

    def redeliver(self, request: Request) -> None:
        """``request`` was preempted: the references it was sent were acknowledged, so it
        needs fresh ones before it is sent again. Images the segment still holds get a hit
        at once (which also keeps them from eviction while the request waits); evicted ones
        are processed again through the same de-duplicated path as first processing.
        """
        if request in self._holdings:
            raise RuntimeError(f"request {request.request_id} re-delivered while it holds data")
        holding = self._holdings[request] = _Holding()
        spent = [i for i, f in enumerate(request.features) if isinstance(f.data, ShmDescriptor)]
        if not spent:  # inline items stay in the request
            holding.ready = True
            self._on_redelivered(request, None)
            return
        holding.task = asyncio.get_running_loop().create_task(
            self._redeliver(request, holding, spent), name=f"redeliver-{request.request_id}")

    async def _redeliver(self, request: Request, holding: _Holding, spent: list[int]) -> None:
        try:
            await self._fill(request, spent, holding, first=False)
        except asyncio.CancelledError:
            raise  # released by whoever cancelled
        except Exception as exc:
            holding.task = None  # ends here: release must not cancel it
            self.release(request)
            self._on_redelivered(request, exc)
            return
        holding.task = None
        holding.ready = True
        self._on_redelivered(request, None)

    def deliverable(self, request: Request) -> bool:
        """Whether ``request`` holds data for every feature now (the scheduler's gate)."""
        holding = self._holdings.get(request)
        return holding is not None and holding.ready

    def release(self, request: Request) -> None:
        """``request`` ends (finished, aborted, failed) or its acquisition failed: give back
        the references it holds; an unfinished re-delivery is cancelled."""
        holding = self._holdings.pop(request, None)
        if holding is None:
            return
        if holding.task is not None:
            holding.task.cancel()
        for desc in holding.refs:
            self.cache.release(desc)

    async def _fill(self, request: Request, indices: Iterable[int], holding: _Holding,
                    first: bool) -> int:
        """Data for ``request.features[i]``, i in ``indices``; returns the cache hits.

        The ``first`` delivery attributes each image and gives it a span (when traced)."""
        indices = list(indices)
        hits = 0
        with self.cache.pinned([request.features[i].identifier for i in indices]):
            for i in indices:
                f, media = request.features[i], request.media[i]
                trace = request.trace if first else None
                with image_span(trace, f.identifier, f.mm_position.length,
                                request.media_bytes[i]) as span:
                    data, hit = await self._data(f.identifier, media, holding)
                    self.reuse.observe(f.identifier, self.cache.charge(data))
                    if first:
                        record = request.images[i]
                        record.delivered(hit, data, "" if hit else self.cache.refusal(data))
                        span.done(record.cache, record.refused_reason, record.transport, data)
                request.features[i] = replace(f, data=data)
                hits += hit
        return hits

    async def _data(self, key: str, media: generate_pb2.MediaItem,
                    holding: _Holding) -> tuple[FeatureData, bool]:
        """The image's data: a hit, or processed once even when requests race for it.

        Concurrent misses on one key (first processing or re-delivery alike) wait for the
        first to finish processing and then hit what it stored, instead of processing
        again and colliding on the put. A reference is recorded in ``holding`` in the same
        synchronous stretch that issued it, so the ledger never lags the writer.
        """
        pending = self._processing.get(key)
        if pending is not None:
            try:
                item = await asyncio.shield(pending)
            except asyncio.CancelledError:
                if not pending.cancelled():
                    raise  # this request was cancelled
                return await self._data(key, media, holding)  # the processing one was
            data = self._hold(self.cache.lookup(key), holding)
            return (data, True) if data is not None else (item, False)
        data = self._hold(self.cache.lookup(key), holding)
        if data is not None:
            return data, True
        future: asyncio.Future[MultiModalKwargsItem] = asyncio.get_running_loop().create_future()
        self._processing[key] = future
        try:
            item = await self._offload(lambda: self._process(media))
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved here; waiters still receive it
            raise
        finally:
            del self._processing[key]
        future.set_result(item)
        return self._hold(self.cache.store(key, item), holding), False

    @staticmethod
    def _hold(data: FeatureData, holding: _Holding) -> FeatureData:
        if isinstance(data, ShmDescriptor):
            holding.refs.append(data)
        return data

    # -- steps ----------------------------------------------------------------------------

    def sent(self, step_id: int, requests: Iterable[Request]) -> None:
        """The step carrying ``requests`` in full is being handed to the workers."""
        requests = list(requests)
        for request in requests:
            if not self.deliverable(request):
                raise RuntimeError(f"request {request.request_id} sent without its data "
                                   "(spent references would be delivered twice)")
        self._in_flight[step_id] = [d for r in requests for d in self._holdings.pop(r).refs]

    def step_done(self, step_id: int, failed_slots: Collection[int] = ()) -> None:
        """The step's outcome: it completed on every slot not in ``failed_slots``.

        Completed slots acknowledged its references; on the failed ones they are in doubt.
        When no slot failed, every slot is quiescent and the doubts are settled.
        """
        refs = self._in_flight.pop(step_id, [])
        if refs and failed_slots:
            self._failed[step_id] = refs, frozenset(failed_slots)
        for slot in failed_slots:
            for desc in refs:
                doubt = self._doubt.setdefault(
                    desc.monotonic_id, _Doubt(desc, [0] * self.n_readers))
                doubt.per_slot[slot] += desc.refs
                doubt.exact = False
        self._unsettled.update(failed_slots)
        if not failed_slots:
            self.settle()

    def unseen(self, slot: int) -> list[tuple[int, list[ShmDescriptor]]]:
        """The steps, oldest first, that failed on ``slot`` since the last settle, with
        the references each carried: what the worker there may never have received (a
        step stream ends with steps still unread), so it would never acknowledge them
        unless asked (worker.proto, Acknowledge)."""
        return [(step_id, refs) for step_id, (refs, slots) in sorted(self._failed.items())
                if slot in slots]

    def settle(self) -> None:
        """Every slot is quiescent (it just completed a step, or acknowledged what it was
        asked to with no step out), so no earlier step can still acknowledge: read what
        each slot left unacknowledged, release what no slot acknowledged. Objects that a
        later step still out also carries wait for a settle without it (that step may be
        acknowledging them now)."""
        self._unsettled.clear()
        self._failed.clear()
        if not self._doubt or self.writer is None:
            return
        outstanding = self.writer.outstanding()
        expected = self._expected()
        sent = self._sent()
        for mid, doubt in list(self._doubt.items()):
            if sent[mid]:
                continue
            left = outstanding.get(mid, (0,) * self.n_readers)
            for slot, n in enumerate(left):
                still = n - expected[mid]
                if not 0 <= still <= doubt.per_slot[slot]:
                    raise RuntimeError(f"slot {slot} of object {mid}: {n} refs unacknowledged, "
                                       f"the ledger expects {expected[mid]} plus at most "
                                       f"{doubt.per_slot[slot]} in doubt")
                doubt.per_slot[slot] = still
            doubt.exact = True
            never = min(doubt.per_slot)
            if never:
                self.writer.release(replace(doubt.desc, refs=never))
                self._released_in_doubt += never
                doubt.per_slot = [n - never for n in doubt.per_slot]
            if not any(doubt.per_slot):
                del self._doubt[mid]

    def reader_gone(self, slot: int) -> None:
        """Reader ``slot``'s process is known to have exited (its socket was re-created by
        a successor): forgive what it never acknowledged, except references still held for
        unsent requests, which its successor will receive. Call with no step in flight."""
        if self.writer is None:
            return
        if self._in_flight:
            raise RuntimeError("reader_gone with a step in flight")
        held = self._expected()
        forgiven = self.writer.reset_reader_slot(slot, keep=held)
        for mid, doubt in list(self._doubt.items()):
            doubt.per_slot[slot] = 0
            if not any(doubt.per_slot):
                del self._doubt[mid]
        self._unsettled.discard(slot)
        for step_id, (refs, slots) in list(self._failed.items()):
            self._failed[step_id] = refs, slots - {slot}
        log.info("reader slot %d reset: its process was replaced (%d refs forgiven)",
                 slot, forgiven)

    # -- accounting -----------------------------------------------------------------------

    def _expected(self) -> Counter[int]:
        """Per object: references outstanding on every slot (held and in flight)."""
        return self._held() + self._sent()

    def _held(self) -> Counter[int]:
        """Per object: references held by requests (not sent yet)."""
        counts: Counter[int] = Counter()
        for holding in self._holdings.values():
            for desc in holding.refs:
                counts[desc.monotonic_id] += desc.refs
        return counts

    def _sent(self) -> Counter[int]:
        """Per object: references in steps still out (a slot may have acknowledged them)."""
        counts: Counter[int] = Counter()
        for refs in self._in_flight.values():
            for desc in refs:
                counts[desc.monotonic_id] += desc.refs
        return counts

    def holders(self) -> set[Request]:
        """Requests holding or acquiring references now (not yet sent, or re-delivered)."""
        return set(self._holdings)

    def stats(self) -> LedgerStats:
        held = sum(d.refs for h in self._holdings.values() for d in h.refs)
        in_flight = sum(d.refs for refs in self._in_flight.values() for d in refs)
        in_doubt = sum(max(d.per_slot) for d in self._doubt.values())
        return LedgerStats(held, in_flight, in_doubt, self._released_in_doubt)

    def check_invariants(self) -> None:
        """The writer's counters, per object and slot, equal what this ledger accounts for:
        held + in flight + in doubt, where a slot may already have acknowledged what is in
        flight, and a slot whose last step failed some of its doubts. With every slot
        settled and no step out the totals match too."""
        if self.writer is None:
            assert not self._doubt and not any(h.refs for h in self._holdings.values())
            return
        outstanding = self.writer.outstanding()
        held, sent = self._held(), self._sent()
        zero = (0,) * self.n_readers
        for mid in outstanding.keys() | held.keys() | sent.keys() | self._doubt.keys():
            left = outstanding.get(mid, zero)
            entry = self._doubt.get(mid)
            doubt = entry.per_slot if entry is not None else list(zero)
            exact = entry is None or entry.exact
            for slot in range(self.n_readers):
                low = held[mid] + (doubt[slot] if exact and slot not in self._unsettled else 0)
                high = held[mid] + sent[mid] + doubt[slot]
                assert low <= left[slot] <= high, (
                    f"object {mid} slot {slot}: writer shows {left[slot]} unacknowledged, "
                    f"ledger accounts for {low}..{high}")
        if not (self._unsettled or self._in_flight
                or any(not d.exact for d in self._doubt.values())):
            unacked = self.writer.stats().unacked_refs
            assert unacked == self.stats().refs, (
                f"writer unacked_refs {unacked} != ledger {self.stats()}")

    def close(self) -> list[asyncio.Task[None]]:
        """Cancel re-deliveries in progress; the tasks, for the caller to await."""
        tasks = [h.task for h in self._holdings.values() if h.task is not None]
        for task in tasks:
            task.cancel()
        return tasks
