"""Typed errors of the domain code and the one place that maps them to gRPC statuses.

Domain code raises these; servicers never build statuses themselves. Each error carries a
message written for the user of the API (never an internal exception's text) and a
machine-readable ``reason`` sent as ``google.rpc.ErrorInfo`` (domain ``tandem.dev``).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from tandem.shm import errors as shm_errors

log = logging.getLogger(__name__)

ERROR_DOMAIN = "tandem.dev"


class TandemError(Exception):
    """Base of the errors a client may see; subclasses fix the status code and the default
    reason in their class statement: ``class X(TandemError, code=..., reason=...)``."""

    code = grpc.StatusCode.INTERNAL
    default_reason = "INTERNAL"

    def __init_subclass__(cls, code: grpc.StatusCode | None = None, reason: str = "",
                          **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code, cls.default_reason = code, reason or code.name

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason


class InvalidInput(TandemError, ValueError, code=grpc.StatusCode.INVALID_ARGUMENT,
                   reason="INVALID_INPUT"):
    pass


class ResourceExhausted(TandemError, code=grpc.StatusCode.RESOURCE_EXHAUSTED):
    pass


class Unavailable(TandemError, code=grpc.StatusCode.UNAVAILABLE):
    pass


class FailedPrecondition(TandemError, code=grpc.StatusCode.FAILED_PRECONDITION):
    pass


class Aborted(TandemError, code=grpc.StatusCode.ABORTED):
    pass


def classify(exc: BaseException) -> TandemError:
    """The client-facing error for any exception (unknown ones become a generic INTERNAL)."""
    if isinstance(exc, TandemError):
        return exc
    if isinstance(exc, shm_errors.StaleDescriptor | shm_errors.SegmentMismatch):
        # The store's text names addresses, ids and the segment generation: log it, never send it.
        return FailedPrecondition("shared-memory descriptor rejected (stale or invalid)",
                                  reason="SHM_STALE_DESCRIPTOR")
    if isinstance(exc, shm_errors.SegmentFull):
        return ResourceExhausted("the shared feature segment is full", reason="SHM_FULL")
    return TandemError("internal error; see the server log")


def rich_status(err: TandemError, metadata: dict[str, str] | None = None) -> tuple:
    """Trailing metadata carrying ``google.rpc.Status`` with an ``ErrorInfo`` detail."""
    info = error_details_pb2.ErrorInfo(
        reason=err.reason, domain=ERROR_DOMAIN, metadata=metadata or {}
    )
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(
        code=getattr(code_pb2, err.code.name), message=err.message, details=[detail]
    )
    return (("grpc-status-details-bin", status.SerializeToString()),)


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Abort the RPC with the status that ``exc`` maps to (logs unexpected errors)."""
    err = classify(exc)
    if err is not exc:
        log.log(
            logging.WARNING if isinstance(exc, shm_errors.ShmError) else logging.ERROR,
            "request failed: %s", exc, exc_info=not isinstance(exc, shm_errors.ShmError),
        )
    context.set_trailing_metadata(rich_status(err))
    await context.abort(err.code, err.message)


def error_info(exc: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """Client side: the ErrorInfo detail of a failed call, if the server sent one."""
    for key, value in (exc.trailing_metadata() or ()):  # type: ignore[attr-defined]
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return info
    return None


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions escaping any RPC method to a status, in one place.

    Wraps unary-unary and unary-stream behaviours (the shapes Tandem uses); cancellation
    propagates untouched.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            # A stream handler either yields (an async generator) or writes with
            # context.write() and returns (e.g. grpc.health.v1 Watch): wrap each as itself.
            stream = handler.unary_stream
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(stream) if inspect.isasyncgenfunction(stream)
                else _wrap_unary(stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def _wrap_unary(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(request, context)
        except Exception as exc:
            await _fail(context, exc)

    return call


def _wrap_stream(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in fn(request, context):
                yield item
        except Exception as exc:
            await _fail(context, exc)

    return call


async def _fail(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, grpc.aio.AbortError):  # context.abort() was called: pass it through
        raise exc
    await abort(context, exc)
