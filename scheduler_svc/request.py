"""A request as the scheduler tracks it, from arrival to its last streamed message."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from scheduler_svc.image_usage import ImageRecord
from scheduler_svc.output_text import OutputText
from scheduler_svc.prefix_hash import BlockHash, request_block_hashes
from scheduler_svc.request_trace import RequestTrace
from tandem.features import MultiModalFeatureSpec
from tandem.structured import ConstraintUse, Matcher
from tandem.v1 import generate_pb2, worker_pb2


class Status(enum.Enum):
    WAITING = "waiting"  # never scheduled, or preempted and waiting to start over
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class Sampling:
    """Validated sampling settings (the public message after defaults and checks; the
    fields mean what ``generate.proto`` says, ranges in :mod:`tandem.sampling`)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int  # 0 = off
    seed: int | None
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    eos_token_ids: frozenset[int]  # the model's end-of-sequence ids (from its files)
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    stop: tuple[str, ...] = ()  # stop strings (the scheduler's alone: workers never see them)
    include_stop_str_in_output: bool = False

    @property
    def ending_ids(self) -> frozenset[int]:
        """The ids that end the request when sampled: stop ids, and EOS unless ignored."""
        return self.stop_token_ids | (frozenset() if self.ignore_eos else self.eos_token_ids)

    def to_proto(self) -> generate_pb2.SamplingParams:
        """What the workers sample with. NOTE: ``stop_token_ids`` carries every ending id
        (EOS included) rather than the client's alone, so the workers' min_tokens mask
        covers exactly what the scheduler would stop on, whatever ids the workers' own
        config lists."""
        msg = generate_pb2.SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, stop_token_ids=sorted(self.ending_ids),
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_p=self.min_p,
            logprobs=self.logprobs, top_logprobs=self.top_logprobs,
        )
        if self.seed is not None:
            msg.seed = self.seed
        return msg


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step produced for one request (becomes one GenerateResponse)."""

    token_ids: list[int]
    finish_reason: int = generate_pb2.FINISH_REASON_UNSPECIFIED
    text: str = ""  # the text to stream now (see scheduler_svc.output_text)
    # With sampling.logprobs: one entry per token id (rank 0's, as the worker sent them).
    logprobs: list[worker_pb2.SampledLogprobs] = field(default_factory=list)


@dataclass(eq=False)
class Request:
    """Scheduler-side state of one Generate call.

    ``features`` keep their full data for the request's life (the worker-bound copy is
    stripped, never this one); their SHM references belong to the delivery ledger
    (:mod:`scheduler_svc.delivery`), which alone fills and replaces that data. ``media``
    are the client's images, kept so a preempted request whose SHM objects were evicted
    can be processed again. ``trace`` is the request's span while tracing is on, else None.

    ``text`` decodes the outputs and finds stop strings; it lives as long as the request,
    so a preemption does not touch it. ``images`` attribute each image's work
    (:mod:`scheduler_svc.image_usage`), one record per feature.

    ``repr`` leaves out what a log must not show (docs/security.md): token ids, the cache
    salt, text, images and the trace.
    """

    request_id: str
    token_ids: list[int] = field(repr=False)  # prompt (placeholders expanded) then outputs
    num_prompt_tokens: int
    features: list[MultiModalFeatureSpec]
    sampling: Sampling
    cache_salt: str = field(repr=False)
    text: OutputText = field(repr=False)
    media: list[generate_pb2.MediaItem] = field(default_factory=list, repr=False)
    media_bytes: list[int] = field(default_factory=list, repr=False)  # each image's data
    mm_cache_hits: int = 0
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens scheduled so far: advanced when scheduled
    # Tokens that steps still in flight will sample for it (asynchronous scheduling): the
    # workers feed them to the next step themselves, the scheduler learns them afterwards.
    num_output_placeholders: int = 0
    num_cached_tokens: int = -1  # prefix hit of the first scheduling; -1 = not yet scheduled
    encoder_runs: int = 0
    preemptions: int = 0
    finish_reason: int = generate_pb2.FINISH_REASON_UNSPECIFIED
    block_hashes: list[BlockHash] = field(default_factory=list, repr=False)
    arrival: float = field(default_factory=time.monotonic)
    outputs: asyncio.Queue[StepOutput | BaseException] = field(
        default_factory=asyncio.Queue, repr=False
    )
    trace: RequestTrace | None = field(default=None, repr=False)
    # Structured output: where the applied outputs stand in the request's constraint
    # (None: free text). Only Scheduler.update advances it, with applied tokens only.
    matcher: Matcher | None = field(default=None, repr=False)
    constraint: ConstraintUse | None = None  # its kind and compile cost (usage, span)
    images: list[ImageRecord] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.images = [ImageRecord.of(f) for f in self.features]

    @property
    def image_bytes(self) -> int:
        """The client's image data the request holds (what admission bounds)."""
        return sum(self.media_bytes)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def update_block_hashes(self, block_size: int) -> None:
        """Extend the chained hashes over blocks that prompt or outputs have filled."""
        self.block_hashes.extend(request_block_hashes(
            self.token_ids, self.features, block_size, self.cache_salt, known=self.block_hashes
        ))
