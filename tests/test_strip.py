"""strip_covered_mm_data: which payloads leave the scheduler for the workers."""

from __future__ import annotations

import torch

from tandem.features import FieldElem, MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from tandem.shm import ShmDescriptor
from tandem.strip import strip_covered_mm_data


def _item() -> MultiModalKwargsItem:
    return MultiModalKwargsItem({
        "pixel_values": FieldElem(torch.ones(4, 588)),
        "image_grid_thw": FieldElem(torch.tensor([[1, 2, 2]]), keep_on_cpu=True),
    })


def _feature(name: str, offset: int, length: int, data: object) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(name, "image", PlaceholderRange(offset, length), data)  # type: ignore[arg-type]


def _features() -> list[MultiModalFeatureSpec]:
    return [
        _feature("a", 0, 100, _item()),
        _feature("b", 150, 100, _item()),
        _feature("c", 300, 100, _item()),
        _feature("d", 100, 50, None),
    ]


def test_fully_covered_plain_items_are_stripped_and_end_equal_counts() -> None:
    features = _features()
    out = strip_covered_mm_data(features, 250, uses_mrope=False)
    assert [f.data is None for f in out] == [True, True, False, True]
    assert [(f.identifier, f.mm_position) for f in out] == [
        (f.identifier, f.mm_position) for f in features
    ]
    assert all(f.data is not None for f in features[:3]), "input must not be mutated"
    assert out[2] is features[2]


def test_address_item_is_kept_as_the_same_object() -> None:
    desc = ShmDescriptor(generation=9, address=4096, monotonic_id=7, refs=1, nbytes=10)
    features = [_feature("a", 0, 100, desc)]
    out = strip_covered_mm_data(features, 250, uses_mrope=False)
    assert out[0].data is desc


def test_partially_covered_item_is_kept_whole() -> None:
    features = [_feature("a", 90, 20, _item())]
    out = strip_covered_mm_data(features, 100, uses_mrope=False)
    assert out[0] is features[0]
    assert set(out[0].data) == {"pixel_values", "image_grid_thw"}  # type: ignore[arg-type]


def test_mrope_keeps_only_keep_on_cpu_fields() -> None:
    features = _features()
    out = strip_covered_mm_data(features, 250, uses_mrope=True)
    assert list(out[0].data) == ["image_grid_thw"]  # type: ignore[arg-type]
    assert list(out[1].data) == ["image_grid_thw"]  # type: ignore[arg-type]
    assert set(out[2].data) == {"pixel_values", "image_grid_thw"}  # type: ignore[arg-type]
    assert torch.equal(out[0].data["image_grid_thw"].data, torch.tensor([[1, 2, 2]]))  # type: ignore[index]
    assert set(features[0].data) == {"pixel_values", "image_grid_thw"}  # type: ignore[arg-type]


def test_nothing_computed_returns_the_input_unchanged() -> None:
    features = _features()
    assert strip_covered_mm_data(features, 0, uses_mrope=False) is features
    assert strip_covered_mm_data([], 100, uses_mrope=True) == []
