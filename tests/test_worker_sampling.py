"""The worker's sampling features against references independent of its code.

A tiny random Llama checkpoint (``hf_checkpoints.py``) runs through the worker's step
path (``StepRunner`` fed by ``ScriptedScheduler``), and transformers' forward pass over
the same tokens is the reference: logprobs equal its ``log_softmax``; greedy decoding
with penalties equals a plain-Python implementation of vLLM's/OpenAI's penalty formulas
(``sampling_reference.py``); min-p keeps only tokens the reference deems likely enough; min_tokens
masks the end ids. Every feature gives the same result cold, with a prefix-cache hit,
in chunked prefill and across a preemption (the request re-sent with its outputs).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hf_checkpoints import reference, save
from sampling_reference import greedy, hf_logits

from tandem.errors import InvalidInput
from tandem_testing.scripted import ScriptedRequest, ScriptedScheduler
from worker_svc.checkpoint import load_model
from worker_svc.model import Transformer
from worker_svc.runner import StepRunner
from worker_svc.sampler import apply_penalties, filter_min_p
from worker_svc.step import (
    CachedRequestData,
    Logprobs,
    NewRequestData,
    SamplingParams,
    StepInput,
    StepOutput,
)
from worker_svc.step_codec import (
    step_from_proto,
    step_output_from_proto,
    step_output_to_proto,
    step_to_proto,
)

BLOCK_SIZE = 4
PROMPT = [5, 17, 33, 40, 41, 60, 61, 62, 63, 64, 70, 17, 33]
MAX_NEW = 10
# float32 on CPU: transformers' and the worker's logits differ by ~1e-6 (test_hf_model.py).
LOGPROB_ATOL = 1e-4
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):
    hf = reference("llama")
    return hf, load(save(hf, tmp_path_factory.mktemp("llama")))


def load(model_dir: Path) -> Transformer:
    model = load_model(str(model_dir), CPU, torch.float32)
    model.setup_caches(num_blocks=512, block_size=BLOCK_SIZE)
    return model


class Worker:
    """One StepRunner and one ScriptedScheduler; block ids are never reused, so an
    earlier request's KV stays readable for a prefix hit."""

    def __init__(self, model: Transformer) -> None:
        self.runner = StepRunner(model, receiver=None, debug_invariants=True)
        self.sched = ScriptedScheduler(BLOCK_SIZE)
        self.logprobs: dict[str, list[Logprobs]] = {}

    def step(self, step: StepInput) -> StepOutput:
        out = self.runner.step(step)
        assert step_output_from_proto(step_output_to_proto(out)) == out
        for rid, tokens in out.sampled.items():
            if rid in out.logprobs:  # aligned with the tokens: one entry each
                assert len(out.logprobs[rid]) == len(tokens)
                self.logprobs.setdefault(rid, []).extend(out.logprobs[rid])
        return out

    def run(self, *requests: ScriptedRequest) -> list[list[int]]:
        self.sched.run(self.step, requests)
        self.runner.step(self.sched.flush())
        assert not self.runner.requests
        return [r.output for r in requests]

    def variants(self, sampling: SamplingParams, max_new: int = MAX_NEW,
                 prompt: list[int] = PROMPT) -> dict[str, list[int]]:
        """The outputs of one request run cold, prefix-cached, chunked and preempted."""
        cold = ScriptedRequest("cold", prompt, [], max_new, sampling)
        out = {"cold": self.run(cold)[0]}
        hit = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
        out["cached"], out["chunked"] = self.run(
            ScriptedRequest("cached", prompt, [], max_new, sampling,
                            prefix_blocks=cold.block_ids[:hit // BLOCK_SIZE],
                            num_computed_tokens=hit),
            ScriptedRequest("chunked", prompt, [], max_new, sampling, chunk_size=3))
        out["preempted"] = self.preempted(prompt, sampling, max_new, after=max_new // 2)
        return out

    def preempted(self, prompt: list[int], sampling: SamplingParams, max_new: int,
                  after: int) -> list[int]:
        """Runs ``after`` tokens, drops the request, then re-sends it the way the
        scheduler resumes a preempted one: every token so far, the prompt count unchanged,
        nothing cached."""
        first = self.run(ScriptedRequest("preempted", prompt, [], after, sampling))[0]
        tokens, rid = prompt + first, "preempted"
        blocks = self.sched.allocate(-(-(len(tokens) + max_new) // BLOCK_SIZE))
        new = NewRequestData(rid, tokens, len(prompt), [], sampling, blocks, 0)
        out = self.step(StepInput(self.sched.step_id, new_requests=[new],
                                  num_scheduled_tokens={rid: len(tokens)}))
        outputs, computed = first + out.sampled[rid], len(tokens)
        while len(outputs) < max_new:
            cached = CachedRequestData(rid, [], computed)
            out = self.step(StepInput(self.sched.step_id, cached_requests=[cached],
                                      num_scheduled_tokens={rid: 1}))
            outputs, computed = outputs + out.sampled[rid], computed + 1
        self.runner.step(StepInput(self.sched.step_id, finished_request_ids=[rid]))
        return outputs


# -- logprobs ---------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [
    SamplingParams(logprobs=True, top_logprobs=20),
    # Raw logprobs: penalties, temperature and filters change the draw, never the logprobs.
    SamplingParams(logprobs=True, top_logprobs=3, temperature=1.3, seed=5, top_k=40,
                   min_p=0.05, presence_penalty=0.5, repetition_penalty=1.3),
], ids=["greedy-top20", "sampled-penalised-top3"])
def test_logprobs_equal_log_softmax_of_transformers(llama, sampling: SamplingParams) -> None:
    hf, model = llama
    worker = Worker(model)
    for name, output in worker.variants(sampling).items():
        assert len(output) == MAX_NEW
        ref = torch.log_softmax(hf_logits(hf, PROMPT + output)[len(PROMPT) - 1:-1], dim=-1)
        got = worker.logprobs[name]
        assert len(got) == MAX_NEW, name
        for i, (lp, token) in enumerate(zip(got, output, strict=True)):
            assert lp.logprob == pytest.approx(float(ref[i, token]), abs=LOGPROB_ATOL)
            k = sampling.top_logprobs
            assert len(lp.top_token_ids) == len(lp.top_logprobs) == k
            assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
            want = ref[i].topk(k).values.tolist()
            assert lp.top_logprobs == pytest.approx(want, abs=LOGPROB_ATOL), (name, i)
            assert [float(ref[i, t]) for t in lp.top_token_ids] == pytest.approx(
                lp.top_logprobs, abs=LOGPROB_ATOL)
        if sampling.temperature == 0:
            assert all(lp.top_token_ids[0] == t for lp, t in zip(got, output, strict=True))


def test_logprobs_only_for_requests_that_ask(llama) -> None:
    _, model = llama
    worker = Worker(model)
    worker.run(ScriptedRequest("plain", PROMPT, [], 3),
               ScriptedRequest("top0", PROMPT, [], 3, SamplingParams(logprobs=True)),
               ScriptedRequest("top2", PROMPT[:5], [], 3,
                               SamplingParams(logprobs=True, top_logprobs=2)))
    assert set(worker.logprobs) == {"top0", "top2"}
    assert all(lp.top_token_ids == [] for lp in worker.logprobs["top0"])
    assert all(len(lp.top_token_ids) == 2 for lp in worker.logprobs["top2"])


# -- penalties --------------------------------------------------------------------------


@pytest.mark.parametrize("presence,frequency,repetition", [
    (0.8, 0.6, 1.0), (0.0, 0.0, 1.8), (1.0, 0.5, 1.4), (-1.5, -0.5, 0.6)])
def test_greedy_with_penalties_equals_the_reference(llama, presence: float, frequency: float,
                                                    repetition: float) -> None:
    hf, model = llama
    want = greedy(hf, PROMPT, MAX_NEW, presence, frequency, repetition)
    plain = greedy(hf, PROMPT, MAX_NEW)
    assert want != plain, "the penalties change nothing here: the test would prove little"
    sampling = SamplingParams(presence_penalty=presence, frequency_penalty=frequency,
                              repetition_penalty=repetition)
    for name, output in Worker(model).variants(sampling).items():
        assert output == want, name


def test_apply_penalties_on_numbers() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0]])
    prompt = torch.tensor([[True, True, False, False], [False, False, False, False]])
    counts = torch.tensor([[0, 0, 2, 1], [0, 0, 0, 0]], dtype=torch.int32)
    out = apply_penalties(logits, prompt, counts, presence=torch.tensor([0.5, 0.5]),
                          frequency=torch.tensor([0.25, 0.25]),
                          repetition=torch.tensor([2.0, 2.0]))
    # token 0: prompt only, 2/2; token 1: prompt, -1*2; token 2: output twice,
    # 0.5/2 - 2*0.25 - 0.5; token 3: once, 3/2 - 0.25 - 0.5. Row 1: nothing seen.
    assert out.tolist() == [[1.0, -2.0, -0.75, 0.75], [1.0, 1.0, 1.0, 1.0]]


# -- min-p ------------------------------------------------------------------------------


def test_filter_min_p_on_numbers() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    kept = torch.isfinite(filter_min_p(logits, torch.tensor([0.0, 0.5, 1.0])))
    # floors: 0, 0.25, 0.5 (times the top probability 0.5)
    assert kept.tolist() == [[True] * 4, [True, True, False, False],
                             [True, False, False, False]]


def test_min_p_keeps_only_likely_tokens(llama) -> None:
    """Many seeded draws at a high temperature: with min_p every token is at least min_p
    times as likely as the top one under transformers' distribution (after temperature);
    without, some are not (so the check can fail)."""
    hf, model = llama
    temperature, min_p = 2.0, 0.3
    ref = torch.softmax(hf_logits(hf, PROMPT)[-1] / temperature, dim=-1)
    floor = min_p * float(ref.max())

    def first_tokens(p: float) -> list[int]:
        reqs = [ScriptedRequest(f"r{seed}", PROMPT, [], 1, SamplingParams(
            temperature=temperature, seed=seed, min_p=p)) for seed in range(40)]
        return [out[0] for out in Worker(model).run(*reqs)]

    assert all(float(ref[t]) >= floor * (1 - 1e-4) for t in first_tokens(min_p))
    assert any(float(ref[t]) < floor for t in first_tokens(0.0))
    plain = Worker(model).run(ScriptedRequest("g", PROMPT, [], 1))[0]
    assert set(first_tokens(1.0)) == set(plain), "min_p 1 leaves the top token only"


# -- min_tokens -------------------------------------------------------------------------


def test_min_tokens_masks_stop_ids_and_eos(llama, tmp_path: Path) -> None:
    hf, model = llama
    plain = Worker(model).run(ScriptedRequest("g", PROMPT, [], 3))[0]
    first = plain[0]
    logits = hf_logits(hf, PROMPT)[-1]
    logits[first] = -math.inf
    runner_up = int(logits.argmax())
    stop = SamplingParams(stop_token_ids=(first,), min_tokens=1)
    for name, output in Worker(model).variants(stop, max_new=2).items():
        assert output[0] == runner_up, name
    # Past min_tokens the stop id may be sampled again.
    assert Worker(model).run(ScriptedRequest("late", PROMPT, [], 1, replace(
        stop, min_tokens=0)))[0] == [first]

    # The model's end id: masked under min_tokens unless ignore_eos (then it is no stop).
    hf.generation_config.eos_token_id = first
    eos_model = load(save(hf, tmp_path / "eos"))
    hf.generation_config.eos_token_id = None
    assert eos_model.config.eos_token_ids == (first,)
    runs = Worker(eos_model).run(
        ScriptedRequest("masked", PROMPT, [], 1, SamplingParams(min_tokens=1)),
        ScriptedRequest("free", PROMPT, [], 1, SamplingParams(min_tokens=1, ignore_eos=True)),
        ScriptedRequest("none", PROMPT, [], 1))
    assert runs == [[runner_up], [first], [first]]


# -- validation -------------------------------------------------------------------------


@pytest.mark.parametrize("bad,message", [
    (dict(logprobs=True, top_logprobs=21), "top_logprobs must be in 0..20"),
    (dict(top_logprobs=2), "top_logprobs needs logprobs"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=math.inf), "repetition_penalty must be > 0"),
    (dict(presence_penalty=2.5), "presence_penalty must be in"),
    (dict(frequency_penalty=-2.01), "frequency_penalty must be in"),
    (dict(frequency_penalty=math.nan), "frequency_penalty must be in"),
    (dict(min_p=1.5), "min_p must be in"),
    (dict(min_p=math.nan), "min_p must be in"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_p=1.5), "top_p must be in"),
    (dict(stop_token_ids=(10**6,)), "outside the vocabulary"),
])
def test_bad_sampling_in_a_step_is_refused_and_changes_nothing(llama, bad: dict,
                                                               message: str) -> None:
    _, model = llama
    runner = StepRunner(model, receiver=None)
    good = NewRequestData("good", PROMPT, len(PROMPT), [], SamplingParams(), [0, 1, 2, 3], 0)
    bad_req = replace(good, request_id="bad", sampling=SamplingParams(**bad),
                      block_ids=[4, 5, 6, 7])
    step = StepInput(0, new_requests=[good, bad_req],
                     num_scheduled_tokens={"good": len(PROMPT), "bad": len(PROMPT)})
    with pytest.raises(InvalidInput, match=message) as info:
        runner.step(step_from_proto(step_to_proto(step)))
    assert info.value.reason == "BAD_SAMPLING"
    assert not runner.requests


def test_sampling_codec_round_trip() -> None:
    p = SamplingParams(temperature=0.5, top_p=0.75, top_k=5, seed=3, min_p=0.25,
                       presence_penalty=-0.5, frequency_penalty=1.5, repetition_penalty=1.25,
                       min_tokens=4, stop_token_ids=(7, 9), ignore_eos=True, logprobs=True,
                       top_logprobs=4)
    req = NewRequestData("r", PROMPT, len(PROMPT), [], p, [0, 1, 2, 3], 0)
    step = StepInput(1, new_requests=[req], num_scheduled_tokens={"r": len(PROMPT)})
    assert step_from_proto(step_to_proto(step)).new_requests[0].sampling == p
    unset = step_to_proto(replace(step, new_requests=[replace(req, sampling=SamplingParams())]))
    unset.new_requests[0].sampling.ClearField("repetition_penalty")
    assert step_from_proto(unset).new_requests[0].sampling == SamplingParams()
