"""Feature codecs: protobuf round trips, SHM object bytes, and rejection of bad tensors."""

from __future__ import annotations

import pytest
import torch

from tandem.errors import InvalidInput
from tandem.feature_codec import (
    feature_from_proto,
    feature_to_proto,
    item_from_buffer,
    item_to_parts,
    tensor_from_proto,
    tensor_to_proto,
)
from tandem.features import FieldElem, MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from tandem.shm import ShmDescriptor
from tandem.v1 import tensor_pb2, worker_pb2


def _item() -> MultiModalKwargsItem:
    g = torch.Generator().manual_seed(0)
    return MultiModalKwargsItem({
        "pixel_values": FieldElem(torch.randn(16, 588, generator=g)),
        "half": FieldElem(torch.randn(3, 5, generator=g).to(torch.bfloat16)),
        "image_grid_thw": FieldElem(torch.tensor([[1, 4, 4]]), keep_on_cpu=True),
    })


def _assert_same(a: MultiModalKwargsItem, b: MultiModalKwargsItem) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].keep_on_cpu == b[k].keep_on_cpu
        assert a[k].data.dtype == b[k].data.dtype and torch.equal(a[k].data, b[k].data)


@pytest.mark.parametrize("data", ["item", "shm", None])
def test_feature_proto_round_trip(data: str | None) -> None:
    desc = ShmDescriptor(generation=2**63 + 5, address=2**40, monotonic_id=2**35, refs=3, nbytes=77)
    payload = {"item": _item(), "shm": desc, None: None}[data]
    f = MultiModalFeatureSpec("h" * 64, "image", PlaceholderRange(7, 16), payload)
    wire = worker_pb2.Feature.FromString(feature_to_proto(f).SerializeToString())
    back = feature_from_proto(wire)
    assert (back.identifier, back.modality) == ("h" * 64, "image")
    assert back.mm_position == PlaceholderRange(7, 16)
    if data == "item":
        _assert_same(back.data, payload)  # type: ignore[arg-type]
    else:
        assert back.data == payload  # descriptor ints survive exactly


def test_shm_object_round_trip_and_keep_on_cpu_only() -> None:
    item = _item()
    buf = b"".join(bytes(p) for p in item_to_parts(item))
    assert len(buf) % 64 == 0
    _assert_same(item_from_buffer(memoryview(buf)), item)
    small = item_from_buffer(memoryview(buf), only_keep_on_cpu=True)
    assert list(small) == ["image_grid_thw"]
    assert torch.equal(small["image_grid_thw"].data, torch.tensor([[1, 4, 4]]))


def test_decoded_tensors_own_their_memory() -> None:
    buf = bytearray(b"".join(bytes(p) for p in item_to_parts(_item())))
    item = item_from_buffer(memoryview(buf))
    before = item["pixel_values"].data.clone()
    buf[:] = bytes(len(buf))  # the chunk being reused must not change what was read
    assert torch.equal(item["pixel_values"].data, before)


@pytest.mark.parametrize(
    ("dtype", "shape", "nbytes", "message"),
    [
        ("complex128", [2], 32, "unsupported tensor dtype"),
        ("float32", [2, 3], 20, "needs 24"),
        ("float32", [-1, 3], 12, "invalid tensor shape"),
    ],
)
def test_bad_tensors_are_rejected(dtype: str, shape: list[int], nbytes: int, message: str) -> None:
    msg = tensor_pb2.Tensor(dtype=dtype, shape=shape, data=bytes(nbytes))
    with pytest.raises(InvalidInput, match=message):
        tensor_from_proto(msg)


def test_tensor_proto_round_trip_keeps_dtype_and_shape() -> None:
    t = torch.arange(24, dtype=torch.int64).reshape(2, 3, 4)
    back = tensor_from_proto(tensor_to_proto(t))
    assert back.dtype == torch.int64 and torch.equal(back, t)


def test_decoding_to_an_accelerator_copies_tensors_there_and_keeps_cpu_fields() -> None:
    # "meta" stands in for an accelerator: any non-CPU device gets the one copy directly.
    buf = b"".join(bytes(p) for p in item_to_parts(_item()))
    item = item_from_buffer(memoryview(buf), device=torch.device("meta"))
    assert item["pixel_values"].data.device.type == "meta"
    assert item["pixel_values"].data.shape == (16, 588)
    assert item["image_grid_thw"].data.device.type == "cpu"
    assert torch.equal(item["image_grid_thw"].data, torch.tensor([[1, 4, 4]]))
