"""One image's attribution as one line of columns, the same for ``tandem generate`` (from
``Usage.images``) and ``tandem traces`` (from the ``tandem.mm.process`` span)."""

from __future__ import annotations

from tandem.v1 import generate_pb2


def columns(key: str, cache: str, reason: str, transport: str, encoder: str, cached: object,
            tokens: object) -> str:
    """``<key prefix>  cache <hit|miss|refused (why)>  <shm|inline>  encoder <...>
    prefix <cached>/<tokens> tokens``; "?" for what is not known."""
    why = f" ({reason})" if reason else ""
    return (f"{key[:16]:<16}  cache {cache + why:<18} {transport:<6}  encoder {encoder:<7}  "
            f"prefix {cached}/{tokens} tokens")


def usage_columns(image: generate_pb2.ImageUsage) -> str:
    return columns(
        image.key,
        _name(generate_pb2.ProcessorCacheResult.Name(image.processor_cache),
              "PROCESSOR_CACHE_RESULT_"),
        image.refused_reason,
        _name(generate_pb2.ImageTransport.Name(image.transport), "IMAGE_TRANSPORT_"),
        _name(generate_pb2.EncoderResult.Name(image.encoder), "ENCODER_RESULT_"),
        image.cached_tokens, image.tokens)


def _name(enum_name: str, prefix: str) -> str:
    name = enum_name.removeprefix(prefix).lower()
    return "?" if name == "unspecified" else name
