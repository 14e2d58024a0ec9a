"""Scheduler output -> the worker-bound StepRequest, stripping what workers won't need."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.scheduler import SchedulerOutput
from tandem.feature_codec import feature_to_proto
from tandem.strip import strip_covered_mm_data
from tandem.v1 import worker_pb2


@dataclass(frozen=True, slots=True)
class Stripped:
    """What the builder did to one new request's features (for its trace)."""

    covered: int  # items whose whole span is inside the computed prefix
    dropped: int  # of those, by-value payloads strip removed; the others are address items


def build_step_request(out: SchedulerOutput, step_id: int, segment_name: str,
                       segment_generation: int, uses_mrope: bool,
                       ) -> tuple[worker_pb2.StepRequest, dict[str, Stripped]]:
    """The step message every worker receives, and per new request what was stripped.

    New requests carry their features through :func:`strip_covered_mm_data`. Preempted
    and finished requests both become ``finished_request_ids``: either way the workers
    drop their state (a preempted request comes back later as a new one).
    """
    msg = worker_pb2.StepRequest(
        step_id=step_id, segment_name=segment_name, segment_generation=segment_generation,
        num_scheduled_tokens=out.num_scheduled_tokens,
        free_encoder_mm_hashes=out.free_encoder_mm_hashes,
        finished_request_ids=out.finished_request_ids + out.preempted_request_ids,
        token_masks=out.token_masks,
        deferred_mask_ids=[r.request_id for r in out.deferred_masks],
    )
    stripped: dict[str, Stripped] = {}
    for new in out.new_requests:
        r, computed = new.request, new.num_computed_tokens
        features = strip_covered_mm_data(r.features, computed, uses_mrope)
        stripped[r.request_id] = Stripped(
            covered=sum(f.is_covered(computed) for f in r.features),
            dropped=sum(s.data is not f.data for s, f in zip(features, r.features, strict=True)))
        msg.new_requests.append(worker_pb2.NewRequest(
            request_id=r.request_id, token_ids=r.token_ids,
            num_prompt_tokens=r.num_prompt_tokens,
            features=[feature_to_proto(f) for f in features],
            sampling=r.sampling.to_proto(), block_ids=new.block_ids,
            num_computed_tokens=computed,
        ))
    for cached in out.cached_requests:
        msg.cached_requests.append(worker_pb2.CachedRequest(
            request_id=cached.request_id, new_block_ids=cached.new_block_ids,
            num_computed_tokens=cached.num_computed_tokens,
        ))
    for request_id, indices in out.encoder_inputs.items():
        msg.scheduled_encoder_inputs[request_id].feature_indices.extend(indices)
    return msg, stripped
