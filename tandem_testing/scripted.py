"""Scripted worker steps for tests and benchmarks: synthetic prompts and a stand-in
scheduler that drives a worker's step function without the real scheduler.

``synthetic_prompt`` lays out BOS, text bytes and one IMAGE placeholder per embedding of each
image (images from ``worker_svc.synthetic.synthetic_image``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tandem.features import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from worker_svc.model_config import ModelConfig
from worker_svc.request_state import IMAGE_GRID_THW
from worker_svc.step import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    StepInput,
    StepOutput,
)
from worker_svc.synthetic import synthetic_image

__all__ = ["ScriptedRequest", "ScriptedScheduler", "synthetic_image", "synthetic_prompt"]


def synthetic_prompt(config: ModelConfig, texts: Sequence[str],
                     images: Sequence[tuple[str, MultiModalKwargsItem]],
                     ) -> tuple[list[int], list[MultiModalFeatureSpec]]:
    """BOS + texts[0] + image 0 + texts[1] + ... ; len(texts) == len(images) + 1, the texts
    as UTF-8 bytes (the built-in models' ids), the special ids the model config's.

    ``images`` are (identifier, item) pairs; the features carry the items by value.
    """
    assert len(texts) == len(images) + 1, "one text before, between and after the images"
    assert config.bos_token_id is not None and config.image_token_id is not None
    tokens, features = [config.bos_token_id, *texts[0].encode()], []
    for (identifier, item), text in zip(images, texts[1:], strict=True):
        _, h, w = (int(x) for x in item[IMAGE_GRID_THW].data[0])
        n = config.num_image_tokens(h, w)
        features.append(MultiModalFeatureSpec(identifier, "image",
                                              PlaceholderRange(len(tokens), n), item))
        tokens.extend([config.image_token_id] * n)
        tokens.extend(text.encode())
    return tokens, features


@dataclass
class ScriptedRequest:
    """One request for :class:`ScriptedScheduler`; the run fills the fields from ``block_ids``
    on and advances ``num_computed_tokens``."""

    request_id: str
    token_ids: list[int] = field(repr=False)
    features: list[MultiModalFeatureSpec]  # as sent: items, address items or None
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prefix_blocks: list[int] = field(default_factory=list)  # blocks of a cached prefix
    num_computed_tokens: int = 0  # that prefix's length (block aligned)
    chunk_size: int = 1 << 30  # prefill tokens per step
    block_ids: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    started: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + len(self.output)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens


StepFn = Callable[[StepInput], StepOutput]


class ScriptedScheduler:
    """Plays the scheduler in tests and benchmarks: drives requests to completion.

    Not a scheduler: no token budget, no preemption, no prefix-hash lookup (the caller
    says which blocks hold a cached prefix), and block ids are never reused. It does what
    the worker must be able to rely on: block tables that cover the scheduled tokens,
    encoder runs scheduled when a chunk first reaches an image that the worker's encoder
    cache lacks, encoder entries freed once their span is computed, finished ids sent.
    """

    def __init__(self, block_size: int, segment_name: str = "", segment_generation: int = 0):
        self.block_size = block_size
        self.segment = (segment_name, segment_generation)
        self.step_id = 0
        self.next_block = 0
        self.encoded: set[str] = set()  # mm hashes the worker's encoder cache holds
        self.to_free: list[str] = []
        self.finished: list[str] = []

    def allocate(self, n: int) -> list[int]:
        self.next_block += n
        return list(range(self.next_block - n, self.next_block))

    def run(self, step_fn: StepFn, requests: Sequence[ScriptedRequest]) -> list[StepOutput]:
        """Steps all ``requests`` together until each has its tokens; returns the outputs."""
        outputs = []
        while not all(r.done for r in requests):
            outputs.append(step_fn(self.next_step([r for r in requests if not r.done])))
            for r in requests:
                r.output.extend(outputs[-1].sampled.get(r.request_id, []))
                if r.done:
                    self.finished.append(r.request_id)
        return outputs

    def next_step(self, active: Sequence[ScriptedRequest]) -> StepInput:
        """The next step for ``active``; assumes the worker then computes every token."""
        new, cached, scheduled, encode = [], [], {}, {}
        for r in active:
            computed = r.num_computed_tokens
            n = min(r.chunk_size, r.num_tokens - computed)
            need = -(-(computed + n) // self.block_size)
            if not r.started:
                r.block_ids = list(r.prefix_blocks)
            new_blocks = self.allocate(max(0, need - len(r.block_ids)))
            r.block_ids += new_blocks
            todo = [i for i, f in enumerate(r.features)
                    if f.mm_position.offset < computed + n and computed < f.mm_position.end
                    and f.identifier not in self.encoded]
            if todo:
                encode[r.request_id] = todo
                self.encoded.update(r.features[i].identifier for i in todo)
            if r.started:
                cached.append(CachedRequestData(r.request_id, new_blocks, computed))
            else:
                new.append(NewRequestData(r.request_id, list(r.token_ids), len(r.token_ids),
                                          list(r.features), r.sampling, list(r.block_ids),
                                          computed))
            r.started, scheduled[r.request_id] = True, n
            r.num_computed_tokens = computed + n
        step = StepInput(self.step_id, *self.segment, new, cached, scheduled, encode,
                         self.to_free, self.finished)
        self.step_id += 1
        self.to_free, self.finished = [], []
        for r in active:
            done = [f.identifier for f in r.features
                    if f.is_covered(r.num_computed_tokens) and f.identifier in self.encoded]
            self.encoded.difference_update(done)
            self.to_free += done
        return step

    def flush(self) -> StepInput:
        """A step with no tokens that delivers pending releases."""
        step = StepInput(self.step_id, *self.segment, free_encoder_mm_hashes=self.to_free,
                         finished_request_ids=self.finished)
        self.step_id += 1
        self.to_free, self.finished = [], []
        return step
