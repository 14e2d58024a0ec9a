"""How large a request may be, on either port: one computation for gRPC and HTTP.

A request carries at most ``max_images`` images of ``max_image_bytes`` each (encoded) plus
its text and settings, which get :data:`OVERHEAD_BYTES`. The gRPC port caps a message at
that (:func:`max_message_bytes`); the HTTP port takes the same request as JSON, where an
image is a base64 ``data:`` URI, so its body cap is the base64 length of the same figure
(:func:`max_http_body_bytes`): both ports accept the same requests, and a body over the
cap is refused while it arrives, never buffered whole.
"""

from __future__ import annotations

from tandem.errors import InvalidInput

OVERHEAD_BYTES = 1 << 20  # a request's text, messages and settings beyond its images


def max_message_bytes(max_images: int, max_image_bytes: int) -> int:
    """The largest gRPC ``GenerateRequest`` a port accepts."""
    return max_images * max_image_bytes + OVERHEAD_BYTES


def max_http_body_bytes(message_bytes: int) -> int:
    """The largest HTTP body for a port whose gRPC messages are capped at
    ``message_bytes``: the same request with its images as base64."""
    return base64_length(message_bytes)


def base64_length(size: int) -> int:
    """Characters of ``size`` bytes in (padded) base64: the longest ``data:`` URI payload
    that can decode to at most ``size`` bytes."""
    return 4 * -(-size // 3)


def check_image_count(count: int, max_images: int) -> None:
    """Refuse a request with more images than the port takes (0: the model takes none)."""
    if count > max_images:
        raise InvalidInput(f"{count} images; the limit is {max_images} per request",
                           "TOO_MANY_IMAGES")
