"""Feature codecs: to and from the protobuf form, and to and from SHM object bytes.

Tensors become raw little-endian bytes in C order. Decoding from a protobuf takes a
zero-copy view of the message's bytes (read-only: consumers copy when they move the
tensor to the compute device). Decoding from the segment copies exactly once, because the
chunk is acknowledged (and may be reclaimed) right after.

SHM object layout, as written by :func:`item_to_parts`::

    [u32 header length][JSON header][zero padding to 64 B][field 0 bytes][pad]...[field n-1]

The header lists each field's name, dtype, shape, ``keep_on_cpu`` and byte offset from the
object start, so a reader can fetch the small ``keep_on_cpu`` fields without touching the
pixels.
"""

from __future__ import annotations

import json
import struct
import warnings

import torch

from tandem.errors import InvalidInput
from tandem.features import FieldElem, MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from tandem.shm import ShmDescriptor
from tandem.v1 import tensor_pb2, worker_pb2

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_ALIGN = 64
_LEN = struct.Struct("<I")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's elements as a flat byte view (no copy when already contiguous on CPU)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def tensor_to_proto(t: torch.Tensor) -> tensor_pb2.Tensor:
    if t.dtype not in DTYPE_NAMES:
        raise InvalidInput(f"unsupported tensor dtype {t.dtype}")
    return tensor_pb2.Tensor(
        dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape), data=bytes(tensor_bytes(t))
    )


def tensor_from_buffer(buf: bytes | memoryview, dtype_name: str, shape: list[int]) -> torch.Tensor:
    """View ``buf`` as a tensor after checking dtype, shape and length agree."""
    dtype = DTYPES.get(dtype_name)
    if dtype is None:
        raise InvalidInput(f"unsupported tensor dtype {dtype_name!r}; use one of {sorted(DTYPES)}")
    if any(d < 0 for d in shape) or len(shape) > 8:
        raise InvalidInput(f"invalid tensor shape {list(shape)}")
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if numel * itemsize != len(buf):
        raise InvalidInput(
            f"tensor data holds {len(buf)} bytes but shape {list(shape)} of {dtype_name} "
            f"needs {numel * itemsize}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # read-only buffers are fine: consumers copy
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype, count=numel).reshape(shape)


def tensor_from_proto(msg: tensor_pb2.Tensor) -> torch.Tensor:
    return tensor_from_buffer(msg.data, msg.dtype, list(msg.shape))


def item_to_proto(item: MultiModalKwargsItem) -> worker_pb2.FeatureItem:
    return worker_pb2.FeatureItem(
        fields=[
            worker_pb2.FeatureField(
                name=k, tensor=tensor_to_proto(e.data), keep_on_cpu=e.keep_on_cpu
            )
            for k, e in item.items()
        ]
    )


def item_from_proto(msg: worker_pb2.FeatureItem) -> MultiModalKwargsItem:
    return MultiModalKwargsItem(
        {f.name: FieldElem(tensor_from_proto(f.tensor), f.keep_on_cpu) for f in msg.fields}
    )


def descriptor_to_proto(d: ShmDescriptor) -> worker_pb2.ShmAddress:
    return worker_pb2.ShmAddress(
        generation=d.generation, address=d.address, monotonic_id=d.monotonic_id,
        refs=d.refs, nbytes=d.nbytes,
    )


def descriptor_from_proto(msg: worker_pb2.ShmAddress) -> ShmDescriptor:
    return ShmDescriptor(
        generation=msg.generation, address=msg.address, monotonic_id=msg.monotonic_id,
        refs=msg.refs, nbytes=msg.nbytes,
    )


def feature_to_proto(f: MultiModalFeatureSpec) -> worker_pb2.Feature:
    msg = worker_pb2.Feature(
        identifier=f.identifier, modality=f.modality,
        offset=f.mm_position.offset, length=f.mm_position.length,
    )
    if isinstance(f.data, ShmDescriptor):
        msg.shm.CopyFrom(descriptor_to_proto(f.data))
    elif f.data is not None:
        msg.item.CopyFrom(item_to_proto(f.data))
    return msg


def feature_from_proto(msg: worker_pb2.Feature) -> MultiModalFeatureSpec:
    kind = msg.WhichOneof("data")
    data = (
        descriptor_from_proto(msg.shm) if kind == "shm"
        else item_from_proto(msg.item) if kind == "item"
        else None
    )
    return MultiModalFeatureSpec(
        identifier=msg.identifier, modality=msg.modality,
        mm_position=PlaceholderRange(msg.offset, msg.length), data=data,
    )


def item_to_parts(item: MultiModalKwargsItem) -> list[bytes | memoryview]:
    """The buffers of one SHM object (see the module docstring); written back to back."""
    bodies = [tensor_bytes(e.data) for e in item.values()]
    start = 0
    while True:  # absolute offsets lengthen the header; grow its room until it fits
        fields, offset = [], start
        for (name, elem), body in zip(item.items(), bodies, strict=True):
            fields.append({"name": name, "dtype": DTYPE_NAMES[elem.data.dtype],
                           "shape": list(elem.data.shape), "keep_on_cpu": elem.keep_on_cpu,
                           "offset": offset, "nbytes": len(body)})
            offset += _pad(len(body))
        header = json.dumps({"fields": fields}, separators=(",", ":")).encode()
        if _LEN.size + len(header) <= start:
            break
        start = _pad(_LEN.size + len(header))
    parts: list[bytes | memoryview] = [_LEN.pack(len(header)) + header,
                                       bytes(start - _LEN.size - len(header))]
    for body in bodies:
        parts.extend((body, bytes(_pad(len(body)) - len(body))))
    return parts


def item_from_buffer(
    buf: memoryview | bytes, only_keep_on_cpu: bool = False, device: torch.device | None = None
) -> MultiModalKwargsItem:
    """Decode an SHM object into private tensors (one copy each; the buffer may go away).

    Fields not marked ``keep_on_cpu`` are copied straight to ``device`` when it is an
    accelerator, so the segment's bytes are copied once on every device.
    """
    target = device if device is not None and device.type != "cpu" else None
    (hlen,) = _LEN.unpack_from(buf, 0)
    if _LEN.size + hlen > len(buf):
        raise InvalidInput("corrupt feature object: header exceeds the object")
    header = json.loads(bytes(buf[_LEN.size : _LEN.size + hlen]))
    item = MultiModalKwargsItem()
    for f in header["fields"]:
        if only_keep_on_cpu and not f["keep_on_cpu"]:
            continue
        if f["offset"] + f["nbytes"] > len(buf):
            raise InvalidInput(f"corrupt feature object: field {f['name']!r} out of range")
        body = buf[f["offset"] : f["offset"] + f["nbytes"]]
        view = tensor_from_buffer(body, f["dtype"], f["shape"])
        copied = (view.clone() if target is None or f["keep_on_cpu"]
                  else view.to(target, copy=True))
        item[f["name"]] = FieldElem(copied, f["keep_on_cpu"])
    return item


def _pad(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN
