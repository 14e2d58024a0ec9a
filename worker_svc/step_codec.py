"""Pure conversions between the Step RPC messages and the worker's domain types.

``step_to_proto`` is the inverse of ``step_from_proto``: the test client that plays the
scheduler and the benchmark build their messages with it.
"""

from __future__ import annotations

from tandem.feature_codec import feature_from_proto, feature_to_proto
from tandem.v1 import generate_pb2, worker_pb2
from worker_svc.step import (
    CachedRequestData,
    DeferredMasks,
    Logprobs,
    NewRequestData,
    SamplingParams,
    StepInput,
    StepOutput,
)


def sampling_from_proto(msg: generate_pb2.SamplingParams) -> SamplingParams:
    """Proto defaults become the domain's "off": top_p 0 -> 1, top_k -1 -> 0, an unset
    repetition_penalty -> 1. Ranges are checked later, with the step (``StepRunner``)."""
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p if msg.top_p > 0 else 1.0,
        top_k=max(msg.top_k, 0),
        seed=msg.seed if msg.HasField("seed") else None,
        min_p=msg.min_p,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=(msg.repetition_penalty if msg.HasField("repetition_penalty")
                            else 1.0),
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs,
        top_logprobs=msg.top_logprobs,
    )


def sampling_to_proto(p: SamplingParams) -> generate_pb2.SamplingParams:
    return generate_pb2.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed, min_p=p.min_p,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, min_tokens=p.min_tokens,
        stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos, logprobs=p.logprobs,
        top_logprobs=p.top_logprobs)


def new_request_from_proto(msg: worker_pb2.NewRequest) -> NewRequestData:
    return NewRequestData(
        request_id=msg.request_id,
        token_ids=list(msg.token_ids),
        num_prompt_tokens=msg.num_prompt_tokens,
        features=[feature_from_proto(f) for f in msg.features],
        sampling=sampling_from_proto(msg.sampling),
        block_ids=list(msg.block_ids),
        num_computed_tokens=msg.num_computed_tokens,
    )


def new_request_to_proto(r: NewRequestData) -> worker_pb2.NewRequest:
    return worker_pb2.NewRequest(
        request_id=r.request_id, token_ids=r.token_ids, num_prompt_tokens=r.num_prompt_tokens,
        features=[feature_to_proto(f) for f in r.features], sampling=sampling_to_proto(r.sampling),
        block_ids=r.block_ids, num_computed_tokens=r.num_computed_tokens,
    )


def step_from_proto(msg: worker_pb2.StepRequest) -> StepInput:
    return StepInput(
        step_id=msg.step_id,
        segment_name=msg.segment_name,
        segment_generation=msg.segment_generation,
        new_requests=[new_request_from_proto(r) for r in msg.new_requests],
        cached_requests=[
            CachedRequestData(r.request_id, list(r.new_block_ids), r.num_computed_tokens)
            for r in msg.cached_requests
        ],
        num_scheduled_tokens=dict(msg.num_scheduled_tokens),
        scheduled_encoder_inputs={
            k: list(v.feature_indices) for k, v in msg.scheduled_encoder_inputs.items()
        },
        free_encoder_mm_hashes=list(msg.free_encoder_mm_hashes),
        finished_request_ids=list(msg.finished_request_ids),
        trace_context=dict(msg.trace_context),
        token_masks=dict(msg.token_masks),
        deferred_masks=(DeferredMasks(list(msg.deferred_mask_ids)) if msg.deferred_mask_ids
                        else None),
    )


def step_to_proto(step: StepInput) -> worker_pb2.StepRequest:
    return worker_pb2.StepRequest(
        step_id=step.step_id,
        segment_name=step.segment_name,
        segment_generation=step.segment_generation,
        new_requests=[new_request_to_proto(r) for r in step.new_requests],
        cached_requests=[
            worker_pb2.CachedRequest(request_id=r.request_id, new_block_ids=r.new_block_ids,
                                     num_computed_tokens=r.num_computed_tokens)
            for r in step.cached_requests
        ],
        num_scheduled_tokens=step.num_scheduled_tokens,
        scheduled_encoder_inputs={
            k: worker_pb2.EncoderInputs(feature_indices=v)
            for k, v in step.scheduled_encoder_inputs.items()
        },
        free_encoder_mm_hashes=step.free_encoder_mm_hashes,
        finished_request_ids=step.finished_request_ids,
        trace_context=step.trace_context,
        token_masks=step.token_masks,
        deferred_mask_ids=(sorted(step.deferred_masks.request_ids)
                           if step.deferred_masks is not None else []),
    )


def step_output_to_proto(out: StepOutput) -> worker_pb2.StepResponse:
    return worker_pb2.StepResponse(
        step_id=out.step_id,
        sampled={k: worker_pb2.SampledTokens(
            token_ids=v, logprobs=[_logprobs_to_proto(lp) for lp in out.logprobs.get(k, [])])
            for k, v in out.sampled.items()},
        shm_resolved=out.shm_resolved, shm_acked=out.shm_acked, encoder_runs=out.encoder_runs,
    )


def step_output_from_proto(msg: worker_pb2.StepResponse) -> StepOutput:
    return StepOutput(
        step_id=msg.step_id,
        sampled={k: list(v.token_ids) for k, v in msg.sampled.items()},
        shm_resolved=msg.shm_resolved, shm_acked=msg.shm_acked, encoder_runs=msg.encoder_runs,
        logprobs={k: [_logprobs_from_proto(lp) for lp in v.logprobs]
                  for k, v in msg.sampled.items() if v.logprobs},
    )


def _logprobs_to_proto(lp: Logprobs) -> worker_pb2.SampledLogprobs:
    return worker_pb2.SampledLogprobs(logprob=lp.logprob, top_token_ids=lp.top_token_ids,
                                      top_logprobs=lp.top_logprobs)


def _logprobs_from_proto(msg: worker_pb2.SampledLogprobs) -> Logprobs:
    return Logprobs(msg.logprob, list(msg.top_token_ids), list(msg.top_logprobs))
