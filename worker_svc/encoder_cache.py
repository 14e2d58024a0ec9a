"""Vision-encoder outputs kept between steps, keyed by mm hash."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


class EncoderCache:
    """Embeddings of encoded images until the scheduler frees them.

    Why: a prompt chunk may cover only part of an image, and the encoder is bidirectional,
    so the whole image is encoded once and later chunks (and other requests with the same
    image) take their rows from here. The scheduler's encoder-cache manager decides what
    lives here; the worker only fills entries when told to encode and drops them when told
    to free.

    Invariant: every entry is a (length, dim) tensor of the model's device and dtype.
    Only ``put`` and ``free`` mutate ``entries``.
    """

    def __init__(self, dim: int, device: torch.device, dtype: torch.dtype) -> None:
        self.dim, self.device, self.dtype = dim, device, dtype
        self.entries: dict[str, Tensor] = {}

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, mm_hash: str) -> Tensor:
        return self.entries[mm_hash]

    def put(self, mm_hash: str, embeds: Tensor) -> None:
        assert embeds.dim() == 2 and embeds.shape[1] == self.dim, f"embeds {embeds.shape}"
        self.entries[mm_hash] = embeds

    def free(self, mm_hashes: Iterable[str]) -> None:
        """Drop entries; hashes not present are ignored (freed before ever being encoded
        here, e.g. by a worker that restarted)."""
        for h in mm_hashes:
            self.entries.pop(h, None)

    def check_invariants(self) -> None:
        for h, e in self.entries.items():
            assert e.dim() == 2 and e.shape[1] == self.dim, f"{h}: shape {tuple(e.shape)}"
            assert e.device == self.device and e.dtype == self.dtype, f"{h}: {e.device} {e.dtype}"
