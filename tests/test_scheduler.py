"""The pure scheduling loop: batching, chunked prefill, prefix hits, encoder, preemption."""

from __future__ import annotations

import pytest

from scheduler_svc.encoder_cache import EncoderCacheManager
from scheduler_svc.kv_cache_manager import KVCacheManager
from scheduler_svc.request import Request, Sampling, Status
from scheduler_svc.scheduler import Scheduler, SchedulerLimits
from tandem import tokenizer
from tandem.features import MultiModalFeatureSpec, PlaceholderRange
from tandem.v1 import generate_pb2

BLOCK = 4


def _request(rid: str, image: str | None = "img", max_tokens: int = 3, text: int = 6) -> Request:
    tokens = [tokenizer.BOS_ID, 10, 11]
    features = []
    if image:
        features.append(MultiModalFeatureSpec(image, "image", PlaceholderRange(3, 4), None))
        tokens += [tokenizer.IMAGE_ID] * 4
    tokens += list(range(20, 20 + text))
    sampling = Sampling(max_tokens, 0.0, 1.0, 0, None, frozenset(), False)
    return Request(rid, tokens, len(tokens), features, sampling, cache_salt="")


class Harness:
    def __init__(self, num_blocks: int = 64, budget: int = 64, caching: bool = True) -> None:
        self.kv = KVCacheManager(num_blocks, BLOCK, caching)
        self.encoder = EncoderCacheManager(64)
        self.redelivered: list[str] = []
        self.sched = Scheduler(SchedulerLimits(8, budget, budget), self.kv, self.encoder,
                               lambda r: self.redelivered.append(r.request_id))

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
    h = Harness(caching=False)
    for rid in ("a", "b"):
        r = _request(rid)
        h.sched.add_request(r)
        out, _ = h.step()
        assert out.new_requests[0].num_computed_tokens == 0
        assert out.encoder_inputs.get(rid) in ([0], None)
        while not r.is_finished:
            h.step()


def test_preemption_frees_blocks_and_redelivers() -> None:
    h = Harness(num_blocks=8, budget=64)
    a, b = _request("a", max_tokens=20), _request("b", image="other", max_tokens=20)
    h.sched.add_request(a)
    h.sched.add_request(b)
    preempted = False
    for _ in range(40):
        out, _ = h.step()
        if "b" in out.finished_request_ids and b.status is Status.WAITING:
            preempted = True
            assert b.num_computed_tokens == 0 and h.kv.get_block_ids("b") == []
        if a.is_finished and b.is_finished:
            break
    assert preempted and b.preemptions >= 1
    assert a.is_finished and b.is_finished
    assert "b" in h.redelivered, "a preempted request's spent features are re-acquired"
    assert h.kv.num_free_blocks == 8


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
