"""Preemption after a covered image was stripped, with its covering KV blocks evicted before
the request resumes (the case that crashed vLLM: the payload was gone when the encoder
needed it again).

Deterministic: the real scheduler (KV manager, encoder-cache manager, strip, step message)
drives a real worker ``StepRunner`` (tiny model) through the protobuf codec, one step at a
time, so the test can check each message. A cell-level run of the same fault under
concurrency is in test_faults_cache.py.
"""

from __future__ import annotations

import torch

from scheduler_svc.encoder_cache import EncoderCacheManager
from scheduler_svc.kv_cache_manager import KVCacheManager
from scheduler_svc.request import Request, Sampling, Status
from scheduler_svc.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from scheduler_svc.step_message import build_step_request, mark_delivered
from tandem.v1 import worker_pb2
from tandem_testing.scripted import synthetic_image, synthetic_prompt
from worker_svc.checkpoint import build_model
from worker_svc.model_config import PRESETS
from worker_svc.runner import StepRunner
from worker_svc.step_codec import step_from_proto

BLOCK = 4
CONFIG = PRESETS["tiny"]
IMAGE = ("img-x", synthetic_image(CONFIG, 4, 4, seed=1))  # 4 placeholders
OTHER = ("img-y", synthetic_image(CONFIG, 4, 4, seed=2))
NUM_BLOCKS = 20


def _request(rid: str, image: tuple, text: str, max_tokens: int) -> Request:
    tokens, features = synthetic_prompt(CONFIG, [f"Look {text}: ", " then answer."], [image])
    sampling = Sampling(max_tokens, 0.0, 1.0, 0, None, frozenset(), True)
    return Request(rid, tokens, len(tokens), list(features), sampling, cache_salt="")


class Cell:
    """Scheduler and worker in one process, stepped by hand. The encoder cache holds one
    image, so encoding another evicts it."""

    def __init__(self) -> None:
        model = build_model(CONFIG, torch.device("cpu"), torch.float32)
        model.setup_caches(num_blocks=NUM_BLOCKS, block_size=BLOCK)
        self.worker = StepRunner(model, receiver=None, debug_invariants=True)
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_caching=True)
        self.sched = Scheduler(SchedulerLimits(8, 64, 64), self.kv, EncoderCacheManager(4),
                               redeliver=lambda r: None)  # inline data stays in the request
        self.messages: list[worker_pb2.StepRequest] = []

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        msg = build_step_request(out, len(self.messages) + 1, "", 0, uses_mrope=False)
        mark_delivered(out)
        self.messages.append(msg)
        sampled = self.worker.step(step_from_proto(msg)).sampled
        self.sched.update(out, sampled)
        self.kv.check_invariants()
        self.sched.encoder.check_invariants()
        return out

    def run(self, *requests: Request) -> None:
        for _ in range(500):
            if all(r.is_finished for r in requests):
                return
            self.step()
        raise AssertionError("requests did not finish")


def _sent(msg: worker_pb2.StepRequest, rid: str) -> worker_pb2.NewRequest | None:
    return next((r for r in msg.new_requests if r.request_id == rid), None)


def test_resumed_request_gets_its_payload_and_the_encoder_runs_again() -> None:
    cell = Cell()
    reference = _request("ref", IMAGE, "here", max_tokens=24)
    cell.sched.add_request(reference)
    cell.run(reference)
    expected = reference.token_ids[reference.num_prompt_tokens:]

    # A hog holding most of the pool, admitted first so the covered request is the victim.
    hog = _request("hog", OTHER, "elsewhere and keep talking", max_tokens=30)
    cell.sched.add_request(hog)
    cell.step()
    again = _request("again", IMAGE, "here", max_tokens=24)
    cell.sched.add_request(again)
    out = cell.step()
    first = _sent(cell.messages[-1], "again")
    assert first is not None and again.num_cached_tokens > again.features[0].mm_position.end
    assert not first.features[0].HasField("item") and "again" not in out.encoder_inputs, \
        "the covered image travels stripped and is not encoded"

    cell.run(hog, again)
    assert again.preemptions >= 1, "the pool is too large to force a preemption"
    resumed = [m for m in cell.messages if _sent(m, "again") is not None][1:]
    assert resumed, "the preempted request was never sent again"
    last = _sent(resumed[-1], "again")
    feature = last.features[0]
    assert last.num_computed_tokens <= feature.offset, \
        "its covering blocks were evicted before it resumed"
    assert feature.HasField("item"), "the payload is sent again"
    assert any(list(m.scheduled_encoder_inputs["again"].feature_indices) == [0]
               for m in resumed if "again" in m.scheduled_encoder_inputs), \
        "the encoder runs again"
    assert again.token_ids[again.num_prompt_tokens:] == expected
    # Everything released, on both sides.
    cell.step()
    assert cell.kv.num_free_blocks == NUM_BLOCKS and not cell.worker.requests
    assert not cell.sched.requests and hog.status is Status.FINISHED
