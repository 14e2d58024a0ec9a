"""Scheduler output -> the worker-bound StepRequest, stripping what workers won't need."""

from __future__ import annotations

from scheduler_svc.scheduler import SchedulerOutput
from tandem.feature_codec import feature_to_proto
from tandem.strip import strip_covered_mm_data
from tandem.v1 import worker_pb2


def build_step_request(out: SchedulerOutput, step_id: int, segment_name: str,
                       segment_generation: int, uses_mrope: bool,
                       trace_context: dict[str, str] | None = None) -> worker_pb2.StepRequest:
    """The step message every worker receives.

    New requests carry their features through :func:`strip_covered_mm_data`: payloads
    inside the prefix hit are dropped, SHM address items always travel (each worker must
    acknowledge them). After this call those references count as delivered.
    """
    msg = worker_pb2.StepRequest(
        step_id=step_id, segment_name=segment_name, segment_generation=segment_generation,
        num_scheduled_tokens=out.num_scheduled_tokens,
        free_encoder_mm_hashes=out.free_encoder_mm_hashes,
        finished_request_ids=out.finished_request_ids,
        trace_context=trace_context or {},
    )
    for new in out.new_requests:
        r = new.request
        features = strip_covered_mm_data(r.features, new.num_computed_tokens, uses_mrope)
        msg.new_requests.append(worker_pb2.NewRequest(
            request_id=r.request_id, token_ids=r.token_ids,
            num_prompt_tokens=r.num_prompt_tokens,
            features=[feature_to_proto(f) for f in features],
            sampling=r.sampling.to_proto(), block_ids=new.block_ids,
            num_computed_tokens=new.num_computed_tokens,
        ))
    for cached in out.cached_requests:
        msg.cached_requests.append(worker_pb2.CachedRequest(
            request_id=cached.request_id, new_block_ids=cached.new_block_ids,
            num_computed_tokens=cached.num_computed_tokens,
        ))
    for request_id, indices in out.encoder_inputs.items():
        msg.scheduled_encoder_inputs[request_id].feature_indices.extend(indices)
    return msg


def mark_delivered(out: SchedulerOutput) -> None:
    """The step reached the workers: the new requests' SHM references are spent."""
    for new in out.new_requests:
        new.request.undelivered = False
