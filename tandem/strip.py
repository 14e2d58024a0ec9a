"""Strip payloads the workers will never need from the worker-bound copy of a request.

When the prefix cache covers an image's whole placeholder span, its KV is already computed
and the encoder never runs for it, so its tensors need not travel. Two kinds of data must
still reach the workers: SHM address items (each stands for a reference the workers must
receive: the obligation in ``scheduler_svc/delivery.py``; dropping one was vLLM #54994)
and, for M-RoPE models, the ``keep_on_cpu`` fields the workers compute positions from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from tandem.features import MultiModalFeatureSpec, MultiModalKwargsItem
from tandem.shm import ShmDescriptor


def strip_covered_mm_data(
    features: Sequence[MultiModalFeatureSpec], num_computed_tokens: int, uses_mrope: bool
) -> Sequence[MultiModalFeatureSpec]:
    """Copy of ``features`` with the payload of fully covered by-value items dropped.

    Kept unchanged: stripped items (``data is None``), address items, and items whose span
    ends after ``num_computed_tokens`` (a partially covered image is encoded whole).
    With nothing computed the input itself is returned. The input is never mutated.
    """
    if num_computed_tokens == 0 or not features:
        return features
    return [_strip_one(f, num_computed_tokens, uses_mrope) for f in features]


def _strip_one(
    f: MultiModalFeatureSpec, num_computed_tokens: int, uses_mrope: bool
) -> MultiModalFeatureSpec:
    if f.data is None or isinstance(f.data, ShmDescriptor) or not f.is_covered(num_computed_tokens):
        return f
    if not uses_mrope:
        return replace(f, data=None)
    kept = MultiModalKwargsItem({k: e for k, e in f.data.items() if e.keep_on_cpu})
    return replace(f, data=kept)
