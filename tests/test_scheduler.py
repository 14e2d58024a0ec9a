"""The pure scheduling loop: batching, chunked prefill, prefix hits, encoder, preemption."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys

import pytest

from scheduler_svc.encoder_cache import EncoderCacheManager
from scheduler_svc.kv_cache_manager import KVCacheManager
from scheduler_svc.output_text import OutputText
from scheduler_svc.request import Request, Sampling, Status
from scheduler_svc.scheduler import Scheduler, SchedulerLimits
from tandem.features import MultiModalFeatureSpec, PlaceholderRange
from tandem.structured import Constraint, ConstraintCompiler, GuidanceBackend
from tandem.text import ByteTokenizer
from tandem.text import byte_tokenizer as tokenizer
from tandem.v1 import generate_pb2

BLOCK = 4


def _request(rid: str, image: str | None = "img", max_tokens: int = 3, text: int = 6) -> Request:
    tokens = [tokenizer.BOS_ID, 10, 11]
    features = []
    if image:
        features.append(MultiModalFeatureSpec(image, "image", PlaceholderRange(3, 4), None))
        tokens += [tokenizer.IMAGE_ID] * 4
    tokens += list(range(20, 20 + text))
    sampling = Sampling(max_tokens, 0.0, 1.0, 0, None, frozenset(), False,
                        frozenset({tokenizer.EOS_ID}))
    return Request(rid, tokens, len(tokens), features, sampling, cache_salt="",
                   text=OutputText(ByteTokenizer().incremental_decoder()))


class Harness:
    """The pure scheduler, stepped by hand; ``held`` are the waiting requests whose data
    is not deliverable (what the delivery ledger says while it re-acquires)."""

    def __init__(self, num_blocks: int = 64, budget: int = 64, caching: bool = True) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK, caching)
        self.encoder = EncoderCacheManager(64)
        self.held: set[str] = set()
        self.sched = Scheduler(SchedulerLimits(8, budget, budget), self.kv, self.encoder,
                               lambda r: r.request_id not in self.held)

    def step(self, sample: int = 65):
        out = self.sched.schedule()
        sampled = {}
        for new in out.new_requests:
            r = new.request
            if new.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens:
                sampled[r.request_id] = [sample]
        for c in out.cached_requests:
            r = self.sched.requests[c.request_id]
            if c.num_computed_tokens + out.num_scheduled_tokens[c.request_id] == r.num_tokens:
                sampled[c.request_id] = [sample]
        results = self.sched.update(out, sampled)
        self.kv.check_invariants()
        self.encoder.check_invariants()
        return out, dict((r.request_id, o) for r, o in results)


def test_second_identical_request_hits_prefix_and_skips_encoder() -> None:
    h = Harness()
    a = _request("a")
    h.sched.add_request(a)
    out, res = h.step()
    assert out.encoder_inputs == {"a": [0]} and out.num_scheduled_tokens == {"a": 13}
    assert res["a"].token_ids == [65]
    while not a.is_finished:
        h.step()
    assert a.finish_reason == generate_pb2.FINISH_REASON_LENGTH and a.num_output_tokens == 3
    b = _request("b")
    h.sched.add_request(b)
    out, _ = h.step()
    assert out.new_requests[0].num_computed_tokens == 12  # 3 full blocks; last token recomputed
    assert out.num_scheduled_tokens == {"b": 1}
    assert out.encoder_inputs == {}, "a covered image is never scheduled for the encoder"
    assert b.num_cached_tokens == 12


def test_image_at_the_end_of_the_prompt_is_encoded_again() -> None:
    h = Harness()
    first = _request("a", text=0)  # the image ends the prompt: never fully covered
    h.sched.add_request(first)
    while not first.is_finished:
        h.step()
    second = _request("b", text=0)
    h.sched.add_request(second)
    out, _ = h.step()
    assert out.new_requests[0].num_computed_tokens == 4  # the image's last block is recomputed
    # Partly covered: its embeddings are needed, and the workers still hold them.
    assert out.encoder_inputs == {} and "img" in h.encoder
    h.encoder.free("b")
    h.sched.finish(second, generate_pb2.FINISH_REASON_ABORT)
    assert h.encoder.can_allocate(64, 64, 0) and "img" not in h.encoder  # evicted for room
    third = _request("c", text=0)
    h.sched.add_request(third)
    out, _ = h.step()
    assert out.encoder_inputs == {"c": [0]} and "img" in out.free_encoder_mm_hashes


def test_chunked_prefill_splits_before_an_image_that_does_not_fit_the_budget() -> None:
    h = Harness(budget=5)
    r = _request("a")
    h.sched.add_request(r)
    out, res = h.step()
    # 5 tokens would cut into the image (offset 3): it is encoded whole in this step.
    assert out.num_scheduled_tokens == {"a": 5} and out.encoder_inputs == {"a": [0]}
    assert res == {}, "no sample while the prompt is incomplete"
    out, _ = h.step()
    assert out.num_scheduled_tokens == {"a": 5} and out.encoder_inputs == {}
    out, res = h.step()
    assert out.num_scheduled_tokens == {"a": 3} and res["a"].token_ids == [65]


def test_prefix_caching_off_computes_everything() -> None:
    """No prefix hit, so every prompt token is computed again; the image itself is not
    encoded again: the workers' encoder cache still holds it (that cache is separate)."""
    h = Harness(caching=False)
    for rid, encoded in (("a", {"a": [0]}), ("b", {})):
        r = _request(rid)
        h.sched.add_request(r)
        out, _ = h.step()
        assert out.new_requests[0].num_computed_tokens == 0
        assert out.num_scheduled_tokens == {rid: r.num_prompt_tokens}
        assert out.encoder_inputs == encoded
        while not r.is_finished:
            h.step()
    assert h.kv.prefix_cache_blocks == 0


def test_preemption_frees_blocks_and_waits_for_the_data() -> None:
    """The preempted request is reported apart from finished ones, holds nothing, and is
    not admitted again until its data is deliverable (the ledger re-acquiring)."""
    h = Harness(num_blocks=8, budget=64)
    a, b = _request("a", max_tokens=20), _request("b", image="other", max_tokens=20)
    h.sched.add_request(a)
    h.sched.add_request(b)
    for _ in range(20):
        out, _ = h.step()
        if out.preempted_request_ids:
            break
    assert out.preempted_request_ids == ["b"] and out.finished_request_ids == []
    assert b.status is Status.WAITING and b.preemptions == 1
    assert b.num_computed_tokens == 0 and h.kv.get_block_ids("b") == []
    h.held.add("b")
    while not a.is_finished:
        out, _ = h.step()
        assert "b" not in out.num_scheduled_tokens
    out, _ = h.step()
    assert out.num_scheduled_tokens == {} and b.status is Status.WAITING, \
        "free blocks, but b's data is not deliverable yet"
    h.held.clear()
    out, _ = h.step()
    assert [n.request.request_id for n in out.new_requests] == ["b"]
    while not b.is_finished:
        h.step()
    assert h.kv.num_free_blocks == 8


def test_a_step_that_preempts_admits_no_request() -> None:
    """Fault 4 of issue 13: b shares its prefix blocks with a, so once preempted it would
    fit again at once; it must not be sent as new in the step that drops it."""
    h = Harness(num_blocks=6, budget=64)
    a = _request("a", image="other", text=6, max_tokens=7)
    b = _request("b", image="other", text=1, max_tokens=11)
    h.sched.add_request(a)
    h.step()
    h.sched.add_request(b)
    for _ in range(6):
        out, _ = h.step()
        if out.preempted_request_ids:
            break
    assert out.preempted_request_ids == ["b"]
    assert out.new_requests == [] and "b" not in out.num_scheduled_tokens
    out, _ = h.step()
    assert [n.request.request_id for n in out.new_requests] == ["b"], "b resumes next step"


def test_a_refused_step_is_undone() -> None:
    """Workers that refuse a step change nothing: its new request fails, its cached one
    starts over (its blocks of that step never reached them), and the encoder output it
    allocated is forgotten, so the next request with that image encodes it."""
    h = Harness()
    a = _request("a", max_tokens=10)
    h.sched.add_request(a)
    h.step()
    b = _request("b", image="other")
    h.sched.add_request(b)
    out = h.sched.schedule()
    assert out.encoder_inputs == {"b": [0]} and [c.request_id for c in out.cached_requests] == ["a"]
    assert h.sched.refused(out, generate_pb2.FINISH_REASON_ABORT) == [b]
    assert b.is_finished and "other" not in h.encoder and a.status is Status.WAITING
    h.encoder.check_invariants()
    out, _ = h.step()
    assert (out.finished_request_ids, out.preempted_request_ids) == (["b"], ["a"])
    assert out.num_scheduled_tokens == {}
    out, _ = h.step()
    assert [n.request.request_id for n in out.new_requests] == ["a"]
    assert out.encoder_inputs == {}, "a's image was computed before the refusal"
    c = _request("c", image="other")
    h.sched.add_request(c)
    encoded = []
    while not (a.is_finished and c.is_finished):
        out, _ = h.step()
        encoded += out.encoder_inputs.get("c", [])
    assert encoded == [0] and h.kv.num_free_blocks == 64


def test_a_request_repr_hides_tokens_and_salt() -> None:
    r = _request("r1")
    r.cache_salt = "tenant-secret"
    text = repr(r)
    assert "r1" in text and "tenant-secret" not in text
    assert " token_ids=" not in text and str(r.token_ids[-3:])[1:-1] not in text


@pytest.mark.parametrize("code", [
    "from scheduler_svc.block_pool import BlockPool as P; P(0, True)",
    "from scheduler_svc.block_pool import BlockPool as P; P(2, True).get_new_blocks(3)",
    "from scheduler_svc.kv_cache_manager import KVCacheManager as K; K(4, 0)",
    "from scheduler_svc.encoder_cache import EncoderCacheManager as E; E(0)",
    "from scheduler_svc.encoder_cache import EncoderCacheManager as E; E(4).allocate('r', 'h', 5)",
    "from scheduler_svc.worker_client import WorkerPool as W; W([])",
])
def test_limits_raise_under_python_O(code: str) -> None:
    """Runtime limits are real errors: asserts vanish under ``python -O``."""
    proc = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1 and "ValueError" in proc.stderr.splitlines()[-1], proc.stderr


def test_eos_and_stop_ids_finish_with_stop() -> None:
    h = Harness()
    r = _request("a", max_tokens=10)
    h.sched.add_request(r)
    _, res = h.step(sample=tokenizer.EOS_ID)
    assert res["a"].finish_reason == generate_pb2.FINISH_REASON_STOP and r.is_finished
    assert h.kv.num_free_blocks == 64


@pytest.mark.parametrize("state", ["waiting", "running"])
def test_finish_releases_everything(state: str) -> None:
    h = Harness(budget=4)
    r = _request("a")
    h.sched.add_request(r)
    if state == "running":
        h.step()
        assert r.status is Status.RUNNING
    h.sched.finish(r, generate_pb2.FINISH_REASON_ABORT)
    out = h.sched.schedule()
    assert out.finished_request_ids == (["a"] if state == "running" else [])
    assert h.kv.num_free_blocks == 64 and "a" not in h.sched.requests
    h.encoder.check_invariants()


def test_results_go_to_the_request_a_step_carried_not_to_a_later_holder_of_its_id() -> None:
    """Two steps out carry request r; r is aborted and a new request takes its id before
    the later step's results are applied. Those results were r's: the new request gets
    only its own token, and the blocks of the old one are not cached under its hashes."""
    h = Harness()
    old = _request("r", image=None, max_tokens=10)
    h.sched.add_request(old)
    first = h.sched.schedule()  # old's prefill
    second = h.sched.schedule()  # old's first decode, before the prefill's results
    assert second.scheduled_request_ids == ["r"] and old.num_output_placeholders == 2
    h.sched.update(first, {"r": [65]})
    h.sched.finish(old, generate_pb2.FINISH_REASON_ABORT)  # the client cancelled
    new = _request("r", image=None, max_tokens=10, text=2)  # a shorter prompt: fewer blocks
    h.sched.add_request(new)
    third = h.sched.schedule()
    assert third.finished_request_ids == ["r"] and [n.request for n in third.new_requests] == [new]
    assert h.sched.update(second, {"r": [66]}) == [], "old's token went to another request"
    [(request, output)] = h.sched.update(third, {"r": [67]})
    assert request is new and output.token_ids == [67] and new.num_output_tokens == 1
    assert new.num_output_placeholders == 0
    h.kv.check_invariants()


def test_a_token_its_constraint_refuses_ends_a_request_with_constraint(
        caplog: pytest.LogCaptureFixture) -> None:
    """Structured output: the step carries the request's mask; a sampled token the matcher
    refuses (a worker that ignored the mask) is dropped and ends the request, logged; a
    completed constraint ends another with STOP although max_tokens allows more."""
    compiler = ConstraintCompiler(GuidanceBackend(ByteTokenizer()))
    h = Harness()
    broken, done = _request("broken", image=None, max_tokens=10), _request("done", image=None,
                                                                          max_tokens=10)
    broken.matcher, _ = asyncio.run(compiler.matcher(Constraint("regex", "A+b")))
    done.matcher, _ = asyncio.run(compiler.matcher(Constraint("choice", '["A"]')))
    for r in (broken, done):
        h.sched.add_request(r)
    out, res = h.step(sample=ord("A"))
    assert set(out.token_masks) == {"broken", "done"}
    assert res["done"].finish_reason == generate_pb2.FINISH_REASON_STOP and done.is_finished
    assert res["broken"].finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED
    with caplog.at_level(logging.ERROR, logger="scheduler_svc.scheduler"):
        _, res = h.step(sample=ord("c"))
    assert res["broken"].finish_reason == generate_pb2.FINISH_REASON_CONSTRAINT
    assert res["broken"].token_ids == [] and broken.is_finished
    assert "refused by its constraint" in caplog.text
    assert h.kv.num_free_blocks == 64
    compiler.close()
