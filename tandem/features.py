"""Multimodal feature specs: what the scheduler knows about each image of a request.

A feature's ``data`` has three forms on its way to the workers:

* a :class:`MultiModalKwargsItem` -- the processed tensors, travelling by value;
* a :class:`~tandem.shm.ShmDescriptor` -- an address item into the cell's shared segment,
  standing for writer references (who owes what: ``scheduler_svc/delivery.py``);
* ``None`` -- stripped: the item's span lies inside the computed prefix and no worker
  will need its payload (see :mod:`tandem.strip`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.shm import ShmDescriptor


@dataclass(frozen=True, slots=True)
class PlaceholderRange:
    """Placeholder tokens of one item: ``[offset, offset + length)`` in the prompt."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class FieldElem:
    """One named tensor of a processed item.

    ``keep_on_cpu`` marks metadata that never moves to the accelerator (``image_grid_thw``);
    M-RoPE models compute positions from it, so stripping keeps it.
    """

    data: torch.Tensor
    keep_on_cpu: bool = False


class MultiModalKwargsItem(dict[str, FieldElem]):
    """One processed item: field name -> tensor, e.g. ``pixel_values``, ``image_grid_thw``."""

    @property
    def nbytes(self) -> int:
        return sum(e.data.numel() * e.data.element_size() for e in self.values())

    def __repr__(self) -> str:  # shapes only: never tensor contents in logs
        fields = ", ".join(f"{k}={tuple(e.data.shape)}" for k, e in self.items())
        return f"MultiModalKwargsItem({fields})"


FeatureData = MultiModalKwargsItem | ShmDescriptor | None


@dataclass(frozen=True, slots=True)
class MultiModalFeatureSpec:
    """One multimodal item of a request, sorted by ``mm_position.offset`` within it.

    ``identifier`` is the mm hash: the key of the processor cache, the encoder cache and the
    prefix-hash extra keys.
    """

    identifier: str
    modality: str
    mm_position: PlaceholderRange
    data: FeatureData

    def is_covered(self, num_computed_tokens: int) -> bool:
        """True when the whole span is inside the computed prefix (end == computed counts).

        The one coverage predicate: strip and encoder scheduling both use it, so an item
        stripped for the workers is never scheduled for the encoder.
        """
        return self.mm_position.end <= num_computed_tokens
