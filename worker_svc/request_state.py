"""The worker's copy of one running request: tokens, block table, features, positions."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from tandem.errors import InvalidInput
from tandem.features import MultiModalFeatureSpec, MultiModalKwargsItem
from worker_svc.model_config import ModelConfig
from worker_svc.positions import ImageSpan, mrope_positions, rope_positions
from worker_svc.sampler import seed_for_request
from worker_svc.step import NewRequestData, SamplingParams

PIXEL_VALUES = "pixel_values"
IMAGE_GRID_THW = "image_grid_thw"


@dataclass(frozen=True)
class TokenCounts:
    """The penalties' view of a request, on the device: which tokens its prompt holds and
    how often each occurs in its output.

    Built from the tokens the worker knows (``token_ids[:num_prompt_tokens]`` is the
    prompt, the rest output) and advanced by one per sampled token, so a request resumed
    after a preemption, or admitted with a prefix-cache hit, counts exactly what an
    uninterrupted one does. Invariant (checked by ``RequestState.check_invariants``):
    ``output_counts`` sums to the request's output token count.
    """

    prompt_mask: Tensor = field(repr=False)  # (V,) bool
    output_counts: Tensor = field(repr=False)  # (V,) int32

    @classmethod
    def of(cls, token_ids: list[int], num_prompt_tokens: int, vocab_size: int,
           device: torch.device) -> TokenCounts:
        ids = torch.tensor(token_ids, dtype=torch.int64)
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[ids[:num_prompt_tokens]] = True
        counts = torch.bincount(ids[num_prompt_tokens:], minlength=vocab_size)
        return cls(mask.to(device, non_blocking=True),
                   counts.to(device=device, dtype=torch.int32, non_blocking=True))


@dataclass
class RequestState:
    """One request between its NewRequest and its release.

    Invariants: ``num_computed_tokens <= len(token_ids)``; the block table covers the
    computed tokens; ``positions`` covers the first ``positions.shape[1]`` tokens and later
    ones continue from ``next_position``; a feature inside the computed prefix carries no
    payload (nothing will encode it again, so its pixels are dropped). Only the runner
    mutates a state, and only after the step that does so has been validated.
    """

    request_id: str
    token_ids: list[int] = field(repr=False)
    num_prompt_tokens: int
    features: list[MultiModalFeatureSpec]  # data: an item or None, never an address
    sampling: SamplingParams
    seed: int
    block_ids: list[int]
    num_computed_tokens: int
    positions: Tensor = field(repr=False)  # (3, n0) for the tokens known at creation
    next_position: int  # position of token n0; token n0 + i gets next_position + i
    # Built on the first sampling of a request with penalties (``token_counts``), then
    # advanced by ``append_output``; None otherwise.
    counts: TokenCounts | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def token_counts(self, vocab_size: int, device: torch.device) -> TokenCounts:
        if self.counts is None:
            self.counts = TokenCounts.of(self.token_ids, self.num_prompt_tokens, vocab_size,
                                         device)
        return self.counts

    def append_output(self, token: int) -> None:
        """Record a sampled token (and count it, once counts exist)."""
        self.token_ids.append(token)
        if self.counts is not None:
            self.counts.output_counts[token] += 1

    def positions_between(self, start: int, end: int) -> Tensor:
        """(3, end - start) positions of tokens [start, end)."""
        n0 = self.positions.shape[1]
        known = self.positions[:, start:min(end, n0)]
        if end <= n0:
            return known
        later = self.next_position + torch.arange(max(start, n0) - n0, end - n0).expand(3, -1)
        return torch.cat([known, later], dim=1)

    def position_of(self, index: int) -> tuple[int, int, int]:
        """The (t, h, w) position of token ``index``, as integers."""
        n0 = self.positions.shape[1]
        if index >= n0:
            p = self.next_position + index - n0
            return p, p, p
        t, h, w = self.positions[:, index].tolist()
        return t, h, w

    def slot_ids(self, start: int, end: int, block_size: int) -> list[int]:
        """Cache slots of positions [start, end), through the block table."""
        table = self.block_ids
        return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]

    def drop_covered_payloads(self) -> None:
        self.features = [
            replace(f, data=None) if f.data is not None and f.is_covered(self.num_computed_tokens)
            else f
            for f in self.features
        ]

    def check_invariants(self, block_size: int, num_blocks: int) -> None:
        assert 0 <= self.num_computed_tokens <= self.num_tokens, "computed beyond known tokens"
        assert len(self.block_ids) * block_size >= self.num_computed_tokens, "table too short"
        assert all(0 <= b < num_blocks for b in self.block_ids), "block id out of range"
        assert self.positions.shape[0] == 3 and self.positions.shape[1] <= self.num_tokens
        for f in self.features:
            assert not (f.is_covered(self.num_computed_tokens) and f.data is not None), (
                f"covered feature {f.identifier} still holds a payload")
        if self.counts is not None:
            assert int(self.counts.output_counts.sum()) == self.num_output_tokens, (
                "penalty counts differ from the output tokens")


def new_request_state(req: NewRequestData, features: list[MultiModalFeatureSpec],
                      config: ModelConfig) -> RequestState:
    """State for ``req`` whose features' address items are already resolved.

    Raises InvalidInput for features that do not fit the prompt or the model.
    """
    spans = [_image_span(f, req.token_ids, config) for f in features]
    if config.uses_mrope:
        known = [s for s in spans if s is not None]
        if len(known) != len(spans):
            raise InvalidInput(f"request {req.request_id}: an M-RoPE model needs every "
                               f"image's {IMAGE_GRID_THW}", reason="MISSING_GRID")
        positions, next_position = mrope_positions(len(req.token_ids), known)
    else:
        positions, next_position = rope_positions(len(req.token_ids))
    state = RequestState(
        request_id=req.request_id, token_ids=list(req.token_ids),
        num_prompt_tokens=req.num_prompt_tokens, features=list(features),
        sampling=req.sampling,
        seed=req.sampling.seed if req.sampling.seed is not None else seed_for_request(
            req.request_id),
        block_ids=list(req.block_ids), num_computed_tokens=req.num_computed_tokens,
        positions=positions, next_position=next_position,
    )
    state.drop_covered_payloads()
    return state


def _image_span(f: MultiModalFeatureSpec, token_ids: list[int],
                config: ModelConfig) -> ImageSpan | None:
    """The merged grid of ``f`` checked against its placeholders (None without a grid)."""
    pos = f.mm_position
    if config.image_token_id is None:
        raise InvalidInput(f"feature {f.identifier}: model {config.model_type} takes no images",
                           reason="NO_VISION")
    placeholders = token_ids[pos.offset:pos.end]
    if any(t != config.image_token_id for t in placeholders) or pos.end > len(token_ids):
        raise InvalidInput(f"feature {f.identifier}: tokens [{pos.offset}, {pos.end}) are not "
                           "all image placeholders", reason="BAD_PLACEHOLDERS")
    if not isinstance(f.data, MultiModalKwargsItem) or IMAGE_GRID_THW not in f.data:
        return None
    grid = f.data[IMAGE_GRID_THW].data
    if grid.shape != (1, 3) or int(grid[0, 0]) != 1:
        raise InvalidInput(f"feature {f.identifier}: {IMAGE_GRID_THW} must be [[1, h, w]]",
                           reason="BAD_GRID")
    h, w = int(grid[0, 1]), int(grid[0, 2])
    m = config.merge_size
    if h <= 0 or w <= 0 or h % m or w % m or (h // m) * (w // m) != pos.length:
        raise InvalidInput(f"feature {f.identifier}: grid {h}x{w} does not give "
                           f"{pos.length} embeddings", reason="BAD_GRID")
    if max(h, w) > config.vision_max_grid:
        raise InvalidInput(f"feature {f.identifier}: grid {h}x{w} has a side over "
                           f"{config.vision_max_grid} patches", reason="BAD_GRID")
    pixels = f.data.get(PIXEL_VALUES)
    if pixels is not None and (tuple(pixels.data.shape) != (h * w, config.patch_dim)
                               or not pixels.data.is_floating_point()):
        raise InvalidInput(f"feature {f.identifier}: {PIXEL_VALUES} must be floats shaped "
                           f"({h * w}, {config.patch_dim})", reason="BAD_PIXELS")
    return ImageSpan(pos.offset, h // m, w // m)
