"""What the HTTP app needs from the process it runs in: generation and the model's info."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from tandem.v1 import generate_pb2


class Backend(Protocol):
    """What the HTTP routes serve from: the scheduler's engine, in-process.

    ``generate`` yields the same messages the gRPC Generate stream would, and raises the
    errors (``tandem.errors``) the gRPC status would carry; closing the iterator early
    aborts the request and frees everything it holds.
    """

    def generate(self, request: generate_pb2.GenerateRequest,
                 ) -> AsyncIterator[generate_pb2.GenerateResponse]: ...

    async def model_info(self) -> generate_pb2.GetModelInfoResponse: ...
