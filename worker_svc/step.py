"""One scheduler step as the worker's domain code sees it (the Step RPC minus protobuf).

Mirrors ``StepRequest``/``StepResponse`` of ``worker.proto`` (whose comments are the
contract); conversion lives in ``step_codec.py``. Token ids are kept out of ``repr`` so
logs never show prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.features import MultiModalFeatureSpec


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]; 1 = off
    top_k: int = 0  # <= 0 = off
    seed: int | None = None  # None: derived from the request id (same on every rank)


@dataclass(frozen=True)
class NewRequestData:
    """A request scheduled for the first time, or again after a preemption."""

    request_id: str
    token_ids: list[int] = field(repr=False)  # every known token, placeholders expanded
    num_prompt_tokens: int
    features: list[MultiModalFeatureSpec]  # sorted by offset; data: item, address or None
    sampling: SamplingParams
    block_ids: list[int]  # block table covering the request's tokens
    num_computed_tokens: int  # prefix-cache hit, block aligned


@dataclass(frozen=True)
class CachedRequestData:
    request_id: str
    new_block_ids: list[int]  # appended to the block table
    num_computed_tokens: int  # must equal the worker's own count


@dataclass(frozen=True)
class StepInput:
    """Invariant: ``num_scheduled_tokens`` has exactly the ids of new + cached requests."""

    step_id: int
    segment_name: str = ""  # "" when the cache is not "shm"
    segment_generation: int = 0
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # id -> tokens, > 0
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)  # id -> indices
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    trace_context: dict[str, str] = field(default_factory=dict)  # id -> W3C traceparent

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(frozen=True)
class StepOutput:
    step_id: int
    sampled: dict[str, list[int]]  # id -> tokens, for requests whose prompt is complete
    shm_resolved: int = 0  # address items whose payload was read
    shm_acked: int = 0  # address items acknowledged (read or not)
    encoder_runs: int = 0  # items run through the vision encoder
