"""StepRunner without a server: rejected steps change nothing, sampling, positions, codecs."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from tandem.errors import FailedPrecondition, InvalidInput, TandemError
from tandem_testing.scripted import (
    ScriptedRequest,
    ScriptedScheduler,
    synthetic_image,
    synthetic_prompt,
)
from worker_svc.batch import build_batch
from worker_svc.checkpoint import build_model
from worker_svc.encoder_cache import EncoderCache
from worker_svc.model_config import PRESETS
from worker_svc.positions import ImageSpan, mrope_positions
from worker_svc.request_state import new_request_state
from worker_svc.runner import StepRunner
from worker_svc.sampler import filter_top_k_top_p, sample, token_seed, uniform_draws
from worker_svc.step import NewRequestData, SamplingParams, StepInput, StepOutput
from worker_svc.step_codec import (
    step_from_proto,
    step_output_from_proto,
    step_output_to_proto,
    step_to_proto,
)

BLOCK_SIZE = 4
CONFIG = PRESETS["tiny-mrope"]
IMAGES = [("img-a", synthetic_image(CONFIG, 4, 6, seed=1)),
          ("img-b", synthetic_image(CONFIG, 2, 2, seed=2))]
TOKENS, FEATURES = synthetic_prompt(CONFIG, ["Look: ", " and ", "?"], IMAGES)


@pytest.fixture(scope="module")
def model():
    m = build_model(CONFIG, torch.device("cpu"), torch.float32)
    m.setup_caches(num_blocks=64, block_size=BLOCK_SIZE)
    return m


def _snapshot(runner: StepRunner) -> tuple:
    return (sorted((rid, s.num_computed_tokens, len(s.token_ids), len(s.block_ids))
                   for rid, s in runner.requests.items()),
            sorted(runner.encoder_cache.entries))


def _generate(model, corrupt: dict[int, Callable[[StepInput], StepInput]] | None = None,
              expected: dict[int, tuple[type[TandemError], str]] | None = None) -> list[int]:
    """Chunked greedy run; before step k, sends corrupt[k](step) and expects it rejected."""
    runner, sched = StepRunner(model, receiver=None), ScriptedScheduler(BLOCK_SIZE)
    count = 0

    def step_fn(step: StepInput) -> StepOutput:
        nonlocal count
        if corrupt and count in corrupt:
            before = _snapshot(runner)
            error, reason = expected[count]
            with pytest.raises(error) as info:
                runner.step(corrupt[count](step))
            assert info.value.reason == reason
            assert _snapshot(runner) == before, "a rejected step must change nothing"
            runner.check_invariants()
        count += 1
        return runner.step(step)

    req = ScriptedRequest("r", TOKENS, FEATURES, max_new_tokens=4, chunk_size=9)
    sched.run(step_fn, [req])
    runner.step(sched.flush())
    runner.check_invariants()
    assert not runner.requests and not runner.encoder_cache.entries
    return req.output


def _cached(step: StepInput, **changes) -> StepInput:
    return replace(step, cached_requests=[replace(step.cached_requests[0], **changes)])


def test_rejected_steps_leave_no_trace(model) -> None:
    clean = _generate(model)
    other = NewRequestData("other", TOKENS[:3], 3, [], SamplingParams(), [10**6], 0)
    corrupt = {
        # step 0: the new request; its chunk [0, 9) reaches image a at 7.
        0: lambda s: replace(s, scheduled_encoder_inputs={}),
        1: lambda s: _cached(s, num_computed_tokens=s.cached_requests[0].num_computed_tokens + 1),
        2: lambda s: _cached(s, new_block_ids=[*s.cached_requests[0].new_block_ids, 10**6]),
        3: lambda s: replace(s, num_scheduled_tokens={"r": 10**4}),
        4: lambda s: replace(s, cached_requests=[]),
        5: lambda s: replace(s, new_requests=[other], num_scheduled_tokens={
            **s.num_scheduled_tokens, "other": 3}),
    }
    expected = {
        0: (FailedPrecondition, "ENCODER_OUTPUT_MISSING"),
        1: (FailedPrecondition, "COMPUTED_MISMATCH"),
        2: (InvalidInput, "BLOCK_OUT_OF_RANGE"),
        3: (InvalidInput, "BAD_TOKEN_RANGE"),
        4: (InvalidInput, "SCHEDULED_MISMATCH"),
        5: (InvalidInput, "BLOCK_OUT_OF_RANGE"),  # valid cached request + invalid new one
    }
    assert _generate(model, corrupt, expected) == clean


def test_encoder_input_without_data_is_rejected(model) -> None:
    stripped = [replace(FEATURES[0], data=None), FEATURES[1]]
    step = StepInput(0, new_requests=[NewRequestData("r", TOKENS, len(TOKENS), stripped,
                                                     SamplingParams(), list(range(8)), 0)],
                     num_scheduled_tokens={"r": len(TOKENS)},
                     scheduled_encoder_inputs={"r": [0, 1]})
    runner = StepRunner(model, receiver=None)
    with pytest.raises(InvalidInput) as info:
        runner.step(step)
    assert info.value.reason == "MISSING_ENCODER_INPUT"
    assert not runner.requests


def test_duplicate_new_request_and_bad_placeholders(model) -> None:
    runner = StepRunner(model, receiver=None)
    req = NewRequestData("r", TOKENS, len(TOKENS), FEATURES, SamplingParams(), list(range(8)), 0)
    step = StepInput(0, new_requests=[req], num_scheduled_tokens={"r": len(TOKENS)},
                     scheduled_encoder_inputs={"r": [0, 1]})
    runner.step(step)
    with pytest.raises(InvalidInput, match="already running"):
        runner.step(replace(step, step_id=1))
    shifted = [replace(FEATURES[0], mm_position=replace(FEATURES[0].mm_position, offset=1))]
    bad = replace(req, request_id="s", features=shifted)
    with pytest.raises(InvalidInput) as info:
        runner.step(StepInput(2, new_requests=[bad], num_scheduled_tokens={"s": 3}))
    assert info.value.reason == "BAD_PLACEHOLDERS"
    runner.check_invariants()


def _sampled(model, sampling: SamplingParams, rid: str = "s") -> list[int]:
    runner, sched = StepRunner(model, receiver=None), ScriptedScheduler(BLOCK_SIZE)
    req = ScriptedRequest(rid, TOKENS, FEATURES, max_new_tokens=8, sampling=sampling)
    sched.run(runner.step, [req])
    return req.output


def test_sampling_seeded_and_greedy_limits(model) -> None:
    greedy = _sampled(model, SamplingParams())
    hot = SamplingParams(temperature=1.5, seed=7)
    assert _sampled(model, hot) == _sampled(model, hot, rid="other-id")  # seed, not id
    assert _sampled(model, hot) != _sampled(model, replace(hot, seed=8))
    assert _sampled(model, replace(hot, top_k=1)) == greedy
    assert _sampled(model, replace(hot, top_p=1e-6)) == greedy
    unseeded = SamplingParams(temperature=1.5)
    assert _sampled(model, unseeded, rid="x") == _sampled(model, unseeded, rid="x")


def test_filter_top_k_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    out = filter_top_k_top_p(logits, top_k=torch.tensor([2, 0, 0]),
                             top_p=torch.tensor([1.0, 0.7, 1.0]))
    kept = torch.isfinite(out)
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False],
                             [True, True, True, True]]
    uniforms = uniform_draws([1, 2, 3], torch.device("cpu"))
    tokens = sample(logits, torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0, 1, 0]),
                    torch.tensor([1.0, 1.0, 1.0]), torch.zeros(3), uniforms)
    assert tokens[:2].tolist() == [0, 0]  # greedy; top-k 1


def test_a_draw_follows_the_distribution_and_never_picks_a_filtered_token() -> None:
    """20000 rows of one distribution, each with its own seed: the frequencies match the
    probabilities (a standard error here is at most 0.0035), and tokens the filters
    removed (or of probability 0) never come."""
    probs = torch.tensor([0.0, 0.5, 0.3, 0.15, 0.05, 1e-3])
    rows = 20000
    logits = torch.log(probs).expand(rows, -1).contiguous()
    tokens = sample(logits, torch.ones(rows), torch.full((rows,), 4), None, None,
                    uniform_draws([token_seed(s, 0) for s in range(rows)], torch.device("cpu")))
    freq = torch.bincount(tokens, minlength=6).double() / rows
    kept = probs.double().clone()
    kept[5] = 0.0  # outside the top 4
    torch.testing.assert_close(freq, kept / kept.sum(), atol=0.015, rtol=0)
    assert freq[0] == 0 and freq[5] == 0


def test_mrope_positions_match_the_documented_example() -> None:
    pos, nxt = mrope_positions(9, [ImageSpan(offset=2, grid_h=2, grid_w=3)])
    assert pos.tolist() == [[0, 1, 2, 2, 2, 2, 2, 2, 5],
                            [0, 1, 2, 2, 2, 3, 3, 3, 5],
                            [0, 1, 2, 3, 4, 2, 3, 4, 5]]
    assert nxt == 6


def test_step_codec_round_trip() -> None:
    req = NewRequestData("r", TOKENS, len(TOKENS) - 2, FEATURES,
                         SamplingParams(temperature=0.5, top_p=0.75, top_k=5, seed=3), [1, 2], 4)
    step = StepInput(7, "seg", 9, [req], [], {"r": 3}, {"r": [0]}, ["h"], ["gone"], {"r": "tp"})
    back = step_from_proto(step_to_proto(step))
    assert back.new_requests[0].token_ids == TOKENS
    assert back.new_requests[0].features[0].data.keys() == FEATURES[0].data.keys()
    assert replace(back, new_requests=[]) == replace(step, new_requests=[])
    assert replace(back.new_requests[0], features=[]) == replace(req, features=[])
    out = StepOutput(7, {"r": [5]}, 1, 2, 1)
    assert step_output_from_proto(step_output_to_proto(out)) == out
    assert not re.search(r"\btoken_ids=", repr(req)) and str(TOKENS[1]) not in repr(req)


def test_a_batch_of_decodes_reads_each_context_and_position() -> None:
    """build_batch turns decode rows into tensors together: each row's slot, position and
    context must still be its own request's (M-RoPE positions inside the known tokens,
    after them, and contexts of different lengths padded and masked)."""
    lengths = [3, 9, 14, len(TOKENS)]
    states = []
    for i, n in enumerate(lengths):
        blocks = [(7 * i + 3 * b) % 60 for b in range(-(-(n + 1) // BLOCK_SIZE))]
        req = NewRequestData(f"r{i}", TOKENS[:n], n, [f for f in FEATURES
                                                     if f.mm_position.end <= n],
                             SamplingParams(), blocks, 0)
        state = new_request_state(req, req.features, CONFIG)
        state.num_computed_tokens = n - 1 if i % 2 else n  # inside the known tokens, or past
        if not i % 2:
            state.append_output(5)
        states.append(state)
    batch = build_batch([(s, 1) for s in states], EncoderCache(CONFIG.dim, torch.device("cpu"),
                                                                torch.float32),
                        BLOCK_SIZE, torch.device("cpu")).inputs
    for row, s in enumerate(states):
        c = s.num_computed_tokens
        assert batch.tokens[row] == s.token_ids[c]
        assert torch.equal(batch.positions[:, row:row + 1], s.positions_between(c, c + 1))
        assert batch.slot_mapping[row:row + 1].tolist() == s.slot_ids(c, c + 1, BLOCK_SIZE)
        visible = batch.decode.mask[row, 0, 0] == 0  # additive: 0 visible, -inf padding
        context = int(visible.sum())
        assert context == c + 1 and not visible[context:].any()
        read = (batch.decode.block_table[row, :, None] * BLOCK_SIZE
                + torch.arange(BLOCK_SIZE)).flatten()  # slots of the blocks read, in order
        assert read[:context].tolist() == s.slot_ids(0, c + 1, BLOCK_SIZE)
    assert batch.decode.rows.tolist() == list(range(len(states)))
