"""The scheduling loop's pure part: which tokens of which requests run in the next step.

Continuous batching under a token budget: running requests first (decodes and unfinished
prefills), then waiting ones in arrival order, each prompt chunked to what the budget and
the KV pool allow. Images are scheduled for the encoder only when their span lies beyond
the computed prefix and they are not already in the workers' encoder cache. When blocks
run out, the most recently arrived running request is preempted by recompute.

Nothing here does I/O: :meth:`Scheduler.schedule` returns a :class:`SchedulerOutput`, the
engine sends it to the workers, and :meth:`Scheduler.update` applies what they sampled.

A step's tokens count as computed as soon as it is scheduled, and a step that completes a
request's known tokens leaves one *output placeholder* on it: the token the workers will
sample. So the next step can be scheduled before the last one's results are back
(asynchronous scheduling): a decoding request gets one more token scheduled, which the
workers take from their own sample. Stops stay exact: results are applied in step order,
a request that a result finishes is released in the next step (the token the workers
computed past its end is dropped), and a request whose placeholders already reach its
``max_tokens`` is not scheduled again. Applying results in step order is enough for
every rule here as long as at most two steps are out at once (the engine's depth): a
request preempted while a step is out is admitted again only after that step's results.

A step's results are matched to the request *objects* it carried, never looked up by id:
an id names a request for the client and the workers, but the request that held it may
have ended while the step ran, and another may hold it by the time the results are
applied (the engine admits a reused id only once no step out carries the earlier one,
see ``Engine.generate``; this rule does not depend on that).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from scheduler_svc.encoder_cache import EncoderCacheManager
from scheduler_svc.image_usage import record_encoder
from scheduler_svc.kv_cache_manager import KVCacheManager
from scheduler_svc.request import Request, Status, StepOutput
from tandem.structured import allowed_masks
from tandem.v1 import generate_pb2, worker_pb2

log = logging.getLogger(__name__)
_ONLY_TOKEN_0 = (1).to_bytes(4, "little")  # a token mask (worker.proto) allowing token 0


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_num_encoder_tokens: int  # encoder compute budget per step, in embeddings


@dataclass(slots=True)
class SchedulerCounters:
    """Totals since start; they outlive a scheduler reset. Prompts count once, when
    admitted (a waiting request is looked up in the prefix cache again every step)."""

    prompt_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    preemptions: int = 0
    encoder_runs: int = 0  # encoder inputs scheduled (each runs once, on every worker)


@dataclass(slots=True)
class NewRequestData:
    """A request sent to the workers in full: first schedule, or again after preemption."""

    request: Request
    block_ids: list[int]  # its whole block table, in order (prefix hits first)
    num_computed_tokens: int  # tokens whose KV is already there (the prefix hit)


@dataclass(slots=True)
class CachedRequestData:
    """A request the workers already hold: only what changed."""

    request: Request
    new_block_ids: list[int]  # blocks appended to its table this step
    num_computed_tokens: int  # before this step (the workers check it equals theirs)

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True)
class SchedulerOutput:
    """One step.

    Invariants (checked by :meth:`validate` in every ``schedule``): ``num_scheduled_tokens``
    has exactly the new and cached ids; a request is never both; encoder inputs belong to
    scheduled requests; preempted, finished and scheduled ids are disjoint, and a step that
    preempted admits no waiting request (it would take back the blocks just freed).
    """

    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # request id -> tokens to compute this step (new and cached requests)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # request id -> indices into its features to run through the encoder this step
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    # mm hashes whose encoder outputs the workers may drop (evicted, or a predecessor's)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    # requests that finished, were aborted or failed since the last step (or that the
    # workers may still hold after a worker loss): gone for good, workers drop their state
    finished_request_ids: list[str] = field(default_factory=list)
    # requests preempted in this step (or between steps): back in the waiting queue, workers
    # drop their state
    preempted: list[Request] = field(default_factory=list)
    # encoder outputs this step allocated (the workers compute them in it)
    allocated_mm_hashes: list[str] = field(default_factory=list)
    # request id -> the tokens it may sample this step (structured output; worker.proto's
    # token_masks): constrained requests that sample in this step, their matcher current
    token_masks: dict[str, bytes] = field(default_factory=dict)
    # constrained requests that sample in this step while the step before samples their
    # previous token: their masks follow once that step is applied (deferred_masks)
    deferred_masks: list[Request] = field(default_factory=list)
    # seconds the scheduler spent computing this step's masks (sent and deferred ones)
    mask_seconds: float = 0.0

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not (self.num_scheduled_tokens or self.finished_request_ids
                    or self.preempted or self.free_encoder_mm_hashes)

    @property
    def preempted_request_ids(self) -> list[str]:
        return [r.request_id for r in self.preempted]

    @property
    def scheduled_request_ids(self) -> list[str]:
        return [r.request_id for r, _ in self.scheduled()]

    def scheduled(self) -> list[tuple[Request, int]]:
        """(request, tokens computed before this step) of every request the step runs:
        the objects it carried, whatever holds their ids now."""
        return [(c.request, c.num_computed_tokens) for c in self.cached_requests] + [
            (n.request, n.num_computed_tokens) for n in self.new_requests]

    def validate(self) -> None:
        ids = self.scheduled_request_ids
        assert len(set(ids)) == len(ids), "a request is both new and cached"
        assert set(ids) == set(self.num_scheduled_tokens), "scheduled tokens != requests"
        assert set(self.encoder_inputs) <= set(ids), "encoder inputs of unscheduled requests"
        deferred = {r.request_id for r in self.deferred_masks}
        assert set(self.token_masks) | deferred <= set(ids), "masks of unscheduled requests"
        assert not deferred & set(self.token_masks), "a mask both sent and deferred"
        preempted, finished = set(self.preempted_request_ids), set(self.finished_request_ids)
        assert not preempted & set(ids), "a preempted request is scheduled in the same step"
        assert not preempted & finished, "a request is both preempted and finished"
        assert not (preempted and self.new_requests), "a step that preempted admitted requests"


class Scheduler:
    """Owns the waiting queue, the running list and their KV and encoder-cache holdings.

    ``deliverable(request)`` says whether a waiting request's features hold data for a
    delivery now; a preempted request does not until the delivery ledger re-acquired its
    references (:mod:`scheduler_svc.delivery`), and it waits at the head of the queue.
    """

    def __init__(self, limits: SchedulerLimits, kv: KVCacheManager, encoder: EncoderCacheManager,
                 deliverable: Callable[[Request], bool],
                 counters: SchedulerCounters | None = None) -> None:
        self.limits = limits
        self.kv = kv
        self.encoder = encoder
        self._deliverable = deliverable
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # to tell the workers in the next step
        self._preempted: list[Request] = []  # preempted between steps, likewise
        self._orphan_mm_hashes: list[str] = []  # encoder outputs of a predecessor, to drop
        self._to_mask: list[Request] = []  # sampling in the step being scheduled, constrained
        self.counters = counters if counters is not None else SchedulerCounters()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished_ids
                    or self._preempted or self._orphan_mm_hashes)

    def leftovers(self) -> tuple[list[str], list[str]]:
        """(request ids, mm hashes) the workers may still hold for this scheduler: what a
        successor must release after a worker failure (the surviving workers keep them)."""
        return ([r.request_id for r in self.running + self._preempted] + self._finished_ids,
                self.encoder.mm_hashes + self._orphan_mm_hashes)

    def release_on_workers(self, request_ids: list[str], mm_hashes: list[str]) -> None:
        """Tell the workers in the next step to drop these requests and encoder outputs
        (ids and hashes they do not hold are ignored there)."""
        self._finished_ids += request_ids
        self._orphan_mm_hashes += mm_hashes

    def refused(self, out: SchedulerOutput, reason: int) -> list[Request]:
        """The workers refused ``out``, which changes nothing on them: undo it (then
        :meth:`unapplied` for the steps scheduled after it).

        Its new requests are finished and returned, for the caller to fail: a new request
        carries what a worker checks (tokens, features, blocks), so it is the likely cause.
        Its cached requests, accepted before, are preempted and start over as new ones:
        their blocks of this step never reached the workers.
        """
        new = [n.request for n in out.new_requests if not n.request.is_finished]
        for request in new:
            self.finish(request, reason)
        self._undo(out)
        return new

    def unapplied(self, out: SchedulerOutput) -> None:
        """The workers never ran ``out``: it was queued behind a step they refused. Every
        request of it still running starts over, its new ones included (nothing of them
        is suspect)."""
        for new in reversed(out.new_requests):
            if new.request.status is Status.RUNNING:
                self._preempt(new.request, None)
        self._undo(out)

    def _undo(self, out: SchedulerOutput) -> None:
        """The rest of undoing a step the workers did not apply: its cached requests start
        over, the encoder outputs it allocated (never computed) are forgotten, and the
        releases it carried are sent again with the next step."""
        for cached in reversed(out.cached_requests):  # the earliest ends up first in line
            if cached.request.status is Status.RUNNING:  # else gone already
                self._preempt(cached.request, None)
        self.encoder.forget(out.allocated_mm_hashes)
        self.release_on_workers(out.finished_request_ids + out.preempted_request_ids,
                                out.free_encoder_mm_hashes)

    def add_request(self, request: Request) -> None:
        request.update_block_hashes(self.kv.block_size)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish(self, request: Request, reason: int) -> None:
        """Stop ``request`` (finished, aborted, or failed) and free what it holds."""
        if request.is_finished:
            return
        if request.status is Status.RUNNING:
            self.running.remove(request)
            self._finished_ids.append(request.request_id)
        else:
            self.waiting.remove(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        self.kv.free(request.request_id)
        self.encoder.free(request.request_id)
        del self.requests[request.request_id]

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids, preempted=self._preempted)
        self._finished_ids, self._preempted = [], []
        budget = self.limits.max_num_batched_tokens
        encoder_budget = self.limits.max_num_encoder_tokens
        for request in list(self.running):
            if request.status is not Status.RUNNING or budget == 0:
                continue  # preempted earlier in this loop
            if (request.num_output_placeholders and request.num_output_tokens
                    + request.num_output_placeholders >= request.sampling.max_tokens):
                continue  # the step in flight samples its last token
            n = min(request.num_tokens + request.num_output_placeholders
                    - request.num_computed_tokens, budget)
            n, enc, encoder_budget = self._schedule_encoder(request, n, encoder_budget)
            if n == 0:
                continue
            new_blocks = self._allocate_or_preempt(request, n, out)
            if new_blocks is None:
                continue
            out.cached_requests.append(CachedRequestData(
                request, [b.block_id for b in new_blocks], request.num_computed_tokens))
            self._commit(request, n, enc, out)
            budget -= n
        # NOTE: after any preemption nothing is admitted in this step, not even requests
        # that would fit: the victim sits at the head of the queue and, when it shares
        # blocks with a running request, could fit again at once and be sent as new in
        # the very step that tells the workers to drop it.
        if not out.preempted:
            budget, encoder_budget = self._schedule_waiting(out, budget, encoder_budget)
        self._fill_masks(out)
        out.free_encoder_mm_hashes = self._orphan_mm_hashes + self.encoder.get_freed_mm_hashes()
        self._orphan_mm_hashes = []
        out.validate()
        return out

    def _schedule_waiting(self, out: SchedulerOutput, budget: int,
                          encoder_budget: int) -> tuple[int, int]:
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            request = self.waiting[0]
            if not self._deliverable(request):
                break  # its references are being re-acquired; it keeps its place
            hits, num_computed = self.kv.get_computed_blocks(request.block_hashes,
                                                             request.num_tokens)
            n = min(request.num_tokens - num_computed, budget)
            request.num_computed_tokens = num_computed
            n, enc, new_budget = self._schedule_encoder(request, n, encoder_budget)
            blocks = None if n == 0 else self.kv.allocate_slots(
                request.request_id, n, 0, hits)
            if blocks is None:
                request.num_computed_tokens = 0
                break
            encoder_budget = new_budget
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
                self.counters.prefix_cache_hit_tokens += num_computed
                self.counters.prompt_tokens += request.num_prompt_tokens
            request.status = Status.RUNNING
            self.running.append(request)
            out.new_requests.append(NewRequestData(
                request, self.kv.get_block_ids(request.request_id), num_computed))
            self._commit(request, n, enc, out)
            budget -= n
        return budget, encoder_budget

    def _commit(self, request: Request, n: int, enc: list[int], out: SchedulerOutput) -> None:
        """``n`` tokens of ``request`` (and its encoder inputs ``enc``) are in ``out``."""
        record_encoder(request.images, request.features, request.num_computed_tokens, n, enc)
        for i in enc:
            f = request.features[i]
            self.encoder.allocate(request.request_id, f.identifier, f.mm_position.length)
            out.allocated_mm_hashes.append(f.identifier)
        request.encoder_runs += len(enc)
        self.counters.encoder_runs += len(enc)
        out.num_scheduled_tokens[request.request_id] = n
        if enc:
            out.encoder_inputs[request.request_id] = enc
        request.num_computed_tokens += n
        if request.num_computed_tokens == request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1  # the step samples its next token
            if request.matcher is not None and request.num_output_placeholders == 1:
                self._to_mask.append(request)  # its mask: once the step is complete
            elif request.matcher is not None:  # the step out samples what its mask needs
                out.deferred_masks.append(request)

    def _fill_masks(self, out: SchedulerOutput) -> None:
        """The masks of the step's constrained requests that sample, computed together
        (requests preempted since they were committed left the step)."""
        out.token_masks = self._masks(out, self._to_mask)
        self._to_mask = []

    @staticmethod
    def _masks(out: SchedulerOutput, requests: Sequence[Request]) -> dict[str, bytes]:
        """Request id -> mask of those of ``requests`` still running, computed together;
        the time goes to ``out.mask_seconds``."""
        live = [r for r in requests if r.status is Status.RUNNING]
        if not live:
            return {}
        start = time.perf_counter()
        masks = allowed_masks([r.matcher for r in live])
        out.mask_seconds += time.perf_counter() - start
        return {r.request_id: m for r, m in zip(live, masks, strict=True)}

    def _schedule_encoder(self, request: Request, n: int,
                          budget: int) -> tuple[int, list[int], int]:
        """Encoder inputs needed to compute tokens ``[computed, computed + n)``.

        Returns the possibly reduced token count, the feature indices to encode and the
        budget left. An image that does not fit stops the chunk right before it; one that
        is already partly computed must be encoded whole, so then nothing is scheduled.
        """
        computed = request.num_computed_tokens
        scheduled: list[int] = []
        planned = 0
        for i, f in enumerate(request.features):
            start = f.mm_position.offset
            if start >= computed + n:
                break
            if f.is_covered(computed):
                continue  # the same predicate strip uses: covered items never encode
            if f.identifier in self.encoder or any(
                    request.features[j].identifier == f.identifier for j in scheduled):
                self.encoder.check_and_update_cache(request.request_id, f.identifier)
                continue
            length = f.mm_position.length
            if not self.encoder.can_allocate(length, budget - planned, planned):
                n = start - computed if start > computed else 0
                break
            scheduled.append(i)
            planned += length
        return n, scheduled, budget - planned

    def _allocate_or_preempt(self, request: Request, n: int, out: SchedulerOutput):
        """Blocks for ``n`` more tokens of a running request, preempting others if needed."""
        while True:
            blocks = self.kv.allocate_slots(request.request_id, n, request.num_computed_tokens)
            if blocks is not None:
                return blocks
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return None

    def _preempt(self, request: Request, out: SchedulerOutput | None) -> None:
        """Back to the waiting queue's head with nothing held; reported in ``out``, or in
        the next step's output when ``out`` is None (between steps)."""
        log.info("preempting request %s (recompute)", request.request_id)
        self.running.remove(request)
        self.kv.free(request.request_id)
        self.encoder.free(request.request_id)
        request.status = Status.WAITING
        request.num_computed_tokens = request.num_output_placeholders = 0
        request.preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(request)
        if out is None:
            self._preempted.append(request)
            return
        out.preempted.append(request)
        out.num_scheduled_tokens.pop(request.request_id, None)
        out.encoder_inputs.pop(request.request_id, None)
        out.deferred_masks = [r for r in out.deferred_masks if r is not request]
        out.cached_requests = [c for c in out.cached_requests if c.request is not request]

    def deferred_masks(self, out: SchedulerOutput) -> dict[str, bytes]:
        """The masks of ``out``'s deferred requests, once the step before it is applied
        (their matchers have its tokens). A request that is no longer running (finished,
        aborted or preempted since) gets a mask allowing token 0 alone: what ``out``
        samples for it is dropped anyway."""
        masks = self._masks(out, out.deferred_masks)
        return {r.request_id: masks.get(r.request_id, _ONLY_TOKEN_0)
                for r in out.deferred_masks}

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]],
               logprobs: Mapping[str, Sequence[worker_pb2.SampledLogprobs]] | None = None,
               ) -> list[tuple[Request, StepOutput]]:
        """Apply a finished step (the oldest one out): free encoder inputs and cache blocks
        up to what it computed, append samples, check stops (ids and length here, stop
        strings in the request's text), decode the text.

        Results go to the request objects ``out`` carried (see the module docstring);
        ``logprobs`` has an entry per token of ``sampled`` for requests that asked."""
        results: list[tuple[Request, StepOutput]] = []
        for request, before in out.scheduled():
            if request.status is not Status.RUNNING:
                continue  # finished, aborted or preempted while the step ran
            request_id = request.request_id
            computed = before + out.num_scheduled_tokens[request_id]  # a later step may be out
            for f in request.features:
                if f.is_covered(computed):
                    self.encoder.free_encoder_input(request_id, f.identifier)
            new = sampled.get(request_id, [])
            if not new:
                self.kv.cache_blocks(request_id, request.block_hashes, computed)
                continue
            request.num_output_placeholders -= 1
            results.append((request, self._append(
                request, new, (logprobs or {}).get(request_id, ()), computed)))
        return results

    def _append(self, request: Request, new: list[int],
                logprobs: Sequence[worker_pb2.SampledLogprobs], computed: int) -> StepOutput:
        """Append ``new`` up to its first stop and finish the request there, if any."""
        new, reason = _apply_stop(request, new)
        delta = request.text.feed(new, request.num_output_tokens)
        if delta.stopped:
            new, reason = new[:delta.kept], generate_pb2.FINISH_REASON_STOP
        request.token_ids.extend(new)
        request.update_block_hashes(self.kv.block_size)
        self.kv.cache_blocks(request.request_id, request.block_hashes, computed)
        text = delta.text
        if reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
            text += request.text.finish()
            self.finish(request, reason)
        return StepOutput(new, reason, text, list(logprobs[:len(new)]))


def _apply_stop(request: Request, new: list[int]) -> tuple[list[int], int]:
    """Truncate ``new`` at the first stop id, end of its constraint, or length; the finish
    reason (or UNSPECIFIED).

    Under ``min_tokens`` no id ends the request (the workers mask them; this is the rule,
    whatever was sampled). A constrained request ends (STOP) once its output is complete,
    ``min_tokens`` or not: nothing may follow. A token its constraint refuses (the workers
    applied the step's mask, so a fault) is dropped and ends it with CONSTRAINT, logged."""
    s, matcher = request.sampling, request.matcher
    for i, token in enumerate(new):
        outputs = request.num_output_tokens + i + 1
        if matcher is not None and not matcher.consume(token):
            log.error("request %s: token %d refused by its constraint (%s); ending it",
                      request.request_id, token, matcher.error())
            return new[:i], generate_pb2.FINISH_REASON_CONSTRAINT
        if token in s.ending_ids and outputs > s.min_tokens:
            return new[: i + 1], generate_pb2.FINISH_REASON_STOP
        if matcher is not None and matcher.is_stopped():
            return new[: i + 1], generate_pb2.FINISH_REASON_STOP
        if outputs >= s.max_tokens:
            return new[: i + 1], generate_pb2.FINISH_REASON_LENGTH
    return new, generate_pb2.FINISH_REASON_UNSPECIFIED
