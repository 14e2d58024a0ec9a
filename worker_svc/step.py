"""One scheduler step as the worker's domain code sees it (the Step RPC minus protobuf).

Mirrors ``StepRequest``/``StepResponse`` of ``worker.proto`` (whose comments are the
contract); conversion lives in ``step_codec.py``. Token ids are kept out of ``repr`` so
logs never show prompts.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from tandem.errors import TandemError, Unavailable
from tandem.features import MultiModalFeatureSpec


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling, resolved (the proto's "unset" already mapped to "off").

    ``generate.proto``'s SamplingParams comments are the contract for each field; the
    allowed ranges are :func:`tandem.sampling.check_sampling`'s. Stops themselves are the
    scheduler's: a worker needs the stop ids only to mask them under ``min_tokens``.
    """

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]; 1 = off
    top_k: int = 0  # <= 0 = off
    seed: int | None = None  # None: derived from the request id (same on every rank)
    min_p: float = 0.0  # in [0, 1]; 0 = off
    presence_penalty: float = 0.0  # in [-2, 2], over the output tokens; 0 = off
    frequency_penalty: float = 0.0  # in [-2, 2], per output occurrence; 0 = off
    repetition_penalty: float = 1.0  # > 0, over prompt and output tokens; 1 = off
    min_tokens: int = 0  # outputs before EOS and stop ids may be sampled
    stop_token_ids: tuple[int, ...] = ()  # masked with the EOS ids under min_tokens
    ignore_eos: bool = False  # EOS is no stop, so min_tokens leaves it unmasked
    logprobs: bool = False  # return the sampled token's logprob
    top_logprobs: int = 0  # 0..20: also this many most likely tokens (needs logprobs)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


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


def is_token_mask(mask: bytes) -> bool:
    """A token mask as ``StepInput.token_masks`` holds them: whole int32 words, at least one."""
    return bool(mask) and len(mask) % 4 == 0


class DeferredMasks:
    """Token masks that come after their step (``deferred_mask_ids``, then a ``StepMasks``
    on the same stream): the stream's reader delivers them, the step thread waits for them
    between the forward and the sampling. The wait ends when they come or when the stream
    ends (:meth:`cancel`); the scheduler bounds it with its step timeout, after which it
    cancels the stream. Delivered or cancelled once; later calls change nothing."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = frozenset(request_ids)
        self._event = threading.Event()
        self._masks: dict[str, bytes] | None = None  # None: cancelled (if the event is set)
        self.waited_s = 0.0  # how long wait() waited

    def deliver(self, masks: dict[str, bytes]) -> None:
        if not self._event.is_set():
            self._masks = masks
            self._event.set()

    def cancel(self) -> None:
        self._event.set()

    def wait(self) -> dict[str, bytes]:
        start = time.perf_counter()
        self._event.wait()
        self.waited_s = time.perf_counter() - start
        if self._masks is None:
            raise Unavailable("the step stream ended before the step's token masks came",
                              reason="MASKS_NOT_SENT")
        if self._masks.keys() != self.request_ids or not all(
                map(is_token_mask, self._masks.values())):
            # NOTE: past the step's commit point, so not a refusal (which would tell the
            # scheduler nothing changed here): an internal error, the worker counts as lost.
            raise TandemError("the deferred token masks do not match the step's "
                              "deferred_mask_ids, or are not whole int32 words",
                              reason="BAD_TOKEN_MASK")
        return self._masks


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
    # id -> the tokens it may sample (structured output): little-endian int32 bitmap words,
    # bit j of word i allows token 32 * i + j; logits past the bitmap are refused
    token_masks: dict[str, bytes] = field(default_factory=dict, repr=False)
    # Masks that follow the step (asynchronous scheduling); None: every mask is above
    deferred_masks: DeferredMasks | None = field(default=None, repr=False)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(frozen=True)
class Logprobs:
    """Log-probabilities at one sampled position (of the raw logits: worker.proto's
    SampledLogprobs)."""

    logprob: float  # of the sampled token
    top_token_ids: list[int]  # most likely first; as many as the request's top_logprobs
    top_logprobs: list[float]  # same length


@dataclass(frozen=True)
class StepOutput:
    """Invariant: ``logprobs`` has an entry for exactly the sampled requests that asked for
    logprobs, one ``Logprobs`` per sampled token."""

    step_id: int
    sampled: dict[str, list[int]]  # id -> tokens, for requests whose prompt is complete
    shm_resolved: int = 0  # address items whose payload was read
    shm_acked: int = 0  # address items acknowledged (read or not)
    encoder_runs: int = 0  # items run through the vision encoder
    logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)  # id -> per token
