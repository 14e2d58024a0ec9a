"""Typed errors of the domain code and the one place that maps them to gRPC and HTTP.

Domain code raises these; servicers never build statuses themselves. Each error carries a
message written for the user of the API (never an internal exception's text) and a
machine-readable ``reason`` sent as ``google.rpc.ErrorInfo`` (domain ``tandem.dev``) over
gRPC, and as the OpenAI error object's ``code`` over HTTP. Both APIs derive their status
from the error's gRPC code through one table, :data:`HTTP_STATUS`.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from tandem.shm import errors as shm_errors

log = logging.getLogger(__name__)

ERROR_DOMAIN = "tandem.dev"


class TandemError(Exception):
    """Base of the errors a client may see; subclasses fix the status code and the default
    reason in their class statement: ``class X(TandemError, code=..., reason=...)``."""

    code = grpc.StatusCode.INTERNAL
    default_reason = "INTERNAL"
    # The HTTP status and OpenAI error type when the code's row in HTTP_STATUS is not it.
    http_status: tuple[int, str] | None = None

    def __init_subclass__(cls, code: grpc.StatusCode | None = None, reason: str = "",
                          **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code, cls.default_reason = code, reason or code.name

    def __init__(self, message: str, reason: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason or self.default_reason
        self.param = param  # the request field at fault, when known (OpenAI's "param")


class InvalidInput(TandemError, ValueError, code=grpc.StatusCode.INVALID_ARGUMENT,
                   reason="INVALID_INPUT"):
    pass


class BadConstraint(InvalidInput, code=grpc.StatusCode.INVALID_ARGUMENT, reason="BAD_CONSTRAINT"):
    """A structured-output constraint that cannot be used (bad JSON schema, regex, grammar
    or choices, too large, too slow to compile): the compiler's message, and the OpenAI
    field at fault, ``response_format``, as its ``param``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="response_format")


class ResourceExhausted(TandemError, code=grpc.StatusCode.RESOURCE_EXHAUSTED):
    pass


class RequestTooLarge(TandemError, code=grpc.StatusCode.RESOURCE_EXHAUSTED,
                      reason="REQUEST_TOO_LARGE"):
    """A request (or one image in it) over the port's size cap: gRPC's own status for a
    message over its limit, and HTTP's 413 rather than 429 (no point in retrying it)."""

    http_status = (413, "invalid_request_error")


class Unavailable(TandemError, code=grpc.StatusCode.UNAVAILABLE):
    pass


class DeadlineExceeded(TandemError, code=grpc.StatusCode.DEADLINE_EXCEEDED):
    pass


class FailedPrecondition(TandemError, code=grpc.StatusCode.FAILED_PRECONDITION):
    pass


class Aborted(TandemError, code=grpc.StatusCode.ABORTED):
    pass


class NotFound(TandemError, code=grpc.StatusCode.NOT_FOUND):
    pass


# The HTTP status and OpenAI error ``type`` of each gRPC code: the one table both APIs
# derive from (gRPC's own mapping of HTTP to gRPC codes, read backwards; 499 is the
# "client closed request" status proxies use for a cancelled call).
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "not_implemented_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
_HTTP_INTERNAL = (500, "internal_server_error")  # INTERNAL, UNKNOWN, DATA_LOSS
# How long a client is asked to wait before retrying a 429 (RESOURCE_EXHAUSTED but a
# request too large: a full queue or segment drains as requests finish): HTTP
# ``Retry-After``, gRPC ``RetryInfo``.
RETRY_AFTER_S = 1


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


def reported(exc: BaseException) -> TandemError:
    """``classify(exc)``, logging the exception when it had to be translated (the client
    never sees its text): what every API answers for ``exc``."""
    err = classify(exc)
    if err is not exc:
        log.log(
            logging.WARNING if isinstance(exc, shm_errors.ShmError) else logging.ERROR,
            "request failed: %s", exc, exc_info=not isinstance(exc, shm_errors.ShmError),
        )
    return err


def http_error(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error object (``{"error": {message, type, param, code}}``)
    for any exception, through the same ``classify`` and code as the gRPC status."""
    err = reported(exc)
    status, kind = _http_status(err)
    return status, {"error": {"message": err.message, "type": kind, "param": err.param,
                              "code": err.reason.lower()}}


def _http_status(err: TandemError) -> tuple[int, str]:
    return err.http_status or HTTP_STATUS.get(err.code, _HTTP_INTERNAL)


def http_headers(status: int) -> dict[str, str]:
    """The headers of an error answer with HTTP ``status``: ``Retry-After`` on 429."""
    return {"retry-after": str(RETRY_AFTER_S)} if status == 429 else {}


def rich_status(err: TandemError, metadata: dict[str, str] | None = None) -> tuple:
    """Trailing metadata carrying ``google.rpc.Status`` with an ``ErrorInfo`` detail, and
    a ``RetryInfo`` one when the error is worth retrying later (HTTP's 429)."""
    infos: list[Any] = [error_details_pb2.ErrorInfo(
        reason=err.reason, domain=ERROR_DOMAIN, metadata=metadata or {})]
    if _http_status(err)[0] == 429:
        infos.append(error_details_pb2.RetryInfo(
            retry_delay=duration_pb2.Duration(seconds=RETRY_AFTER_S)))
    details = [any_pb2.Any() for _ in infos]
    for detail, info in zip(details, infos, strict=True):
        detail.Pack(info)
    status = status_pb2.Status(
        code=getattr(code_pb2, err.code.name), message=err.message, details=details
    )
    return (("grpc-status-details-bin", status.SerializeToString()),)


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """Abort the RPC with the status that ``exc`` maps to (logs unexpected errors)."""
    err = reported(exc)
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

    Wraps unary-unary, unary-stream and stream-stream behaviours (the shapes Tandem uses);
    cancellation propagates untouched.
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
        if handler.stream_stream is not None and inspect.isasyncgenfunction(
                handler.stream_stream):
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream(handler.stream_stream),
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
