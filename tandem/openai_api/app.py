"""The FastAPI app: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Routes only parse (pydantic), convert (:mod:`tandem.openai_api.convert`), call the
backend and write the answer; every error, whatever raised it, becomes the OpenAI error
object through :func:`tandem.errors.http_error`, the table gRPC statuses come from too.

Request ids: a client's ``x-request-id`` header becomes the GenerateRequest's
``request_id``; the id the server used comes back in the ``x-request-id`` response
header (and in the body's ``id``). A streamed answer starts only once the first message
arrived, so a request the scheduler refuses gets its 4xx status, never a 200 stream;
an error after that is one SSE event holding the error object, then ``[DONE]``.

Disconnects: a client that goes away cancels the request (streamed or not), which closes
the backend's iterator, and the cell frees the request's KV blocks and SHM references.

Sizes (:mod:`tandem.request_limits`): a body over the port's cap is refused with 413 as
it arrives (:class:`BodyLimit`), an image count over the cell's limit with 400 before any
remote image is fetched, and a ``data:`` URI too long for the image limit with 413 before
it is decoded.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem import tracing
from tandem.errors import (
    BadConstraint,
    InvalidInput,
    RequestTooLarge,
    TandemError,
    http_error,
    http_headers,
)
from tandem.openai_api import convert, schema
from tandem.openai_api.backend import Backend
from tandem.openai_api.remote_images import RemoteImageFetcher
from tandem.request_limits import check_image_count
from tandem.v1 import generate_pb2

T = TypeVar("T")
REQUEST_ID_HEADER = "x-request-id"
CLIENT_CLOSED = 499  # nobody reads it: the client is gone


class _Disconnected(Exception):
    """The client closed the connection before the answer was ready."""


def create_app(backend: Backend, max_body_bytes: int,
               fetcher: RemoteImageFetcher | None = None,
               metrics: CollectorRegistry | None = None) -> FastAPI:
    """The app over ``backend``, refusing bodies over ``max_body_bytes``; ``fetcher`` set
    = remote image URLs are allowed; ``metrics`` set (the scheduler's --http-metrics) =
    ``GET /metrics`` serves them too, as vLLM serves its own on its API port: where an
    inference extension's endpoint picker scrapes a pool's target port by default
    (docs/routing.md)."""
    # NOTE: FastAPI's own OpenTelemetry (on by default since 0.142) is off: its logs record
    # validation failures with the input, and prompts never go into telemetry here;
    # ServerSpans makes the one server span, the twin of the gRPC port's.
    app = FastAPI(title="Tandem OpenAI-compatible API", openapi_url=None, docs_url=None,
                  redoc_url=None, telemetry={"tracing": False, "metrics": False, "logs": False})
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(ServerSpans)  # added last: the outer one, so a 413 has its span too
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_exception)  # type: ignore[arg-type]
    started = int(time.time())

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: schema.ChatCompletionRequest, request: Request) -> Response:
        async def convert_request(request_id: str, info: generate_pb2.GetModelInfoResponse,
                                  ) -> generate_pb2.GenerateRequest:
            limits = info.image_limits  # unset (0 images) when the model takes none
            check_image_count(len(convert.image_urls(body)), limits.max_images_per_request)
            remote = convert.remote_image_urls(body)
            fetched = ({} if fetcher is None or not remote else
                       await fetcher.fetch_all(remote, "messages", limits.max_image_bytes))
            return convert.chat_request(body, request_id, fetched, limits.max_image_bytes,
                                        info.tool_call_parser)

        return await _complete(request, backend, body, "chatcmpl", convert_request)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: schema.CompletionRequest, request: Request) -> Response:
        async def convert_request(request_id: str, info: generate_pb2.GetModelInfoResponse,
                                  ) -> generate_pb2.GenerateRequest:
            return convert.completion_request(body, request_id)

        return await _complete(request, backend, body, "cmpl", convert_request)

    @app.get("/v1/models", response_model=None)
    async def models() -> Response:
        try:
            info = await backend.model_info()
        except Exception as exc:
            return _error_response(exc)
        return JSONResponse(schema.dump(convert.model_list(info, started)))

    if metrics is not None:
        registry = metrics

        @app.get("/metrics", response_model=None)
        async def scrape() -> Response:  # on the loop: one consistent snapshot, no locks
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _complete(request: Request, backend: Backend,
                    body: schema.ChatCompletionRequest | schema.CompletionRequest, prefix: str,
                    convert_request: Callable[[str, generate_pb2.GetModelInfoResponse],
                                              Awaitable[generate_pb2.GenerateRequest]],
                    ) -> Response:
    """Both completion endpoints: check the model, convert, generate, answer."""
    chat = isinstance(body, schema.ChatCompletionRequest)
    with_logprobs = bool(body.logprobs) if chat else body.logprobs is not None
    try:
        info = await backend.model_info()
        convert.check_model(body.model, info)
        msg = await convert_request(request.headers.get(REQUEST_ID_HEADER, ""), info)
        stream = backend.generate(msg)
        if body.stream:
            first = await _unless_disconnected(request, anext(stream))
        else:
            msgs = await _unless_disconnected(request, _collect(stream))
    except _Disconnected:
        return Response(status_code=CLIENT_CLOSED)
    except StopAsyncIteration:  # the backend ended the stream without a message: a bug
        return _error_response(TandemError("internal error; see the server log"))
    except BadConstraint as exc:
        if chat and convert.forces_call(body):  # the constraint is the tools' grammar
            exc.param = "tools"
        return _error_response(exc)
    except Exception as exc:
        return _error_response(exc)
    parser, max_calls = ((convert.tool_parser(body, info.tool_call_parser),
                          convert.max_tool_calls(body))
                         if isinstance(body, schema.ChatCompletionRequest) else (None, None))
    if not body.stream:
        meta = convert.ResponseMeta.new(prefix, msgs[0].request_id, info.model_id)
        answer: BaseModel = (
            convert.chat_completion(msgs, meta, with_logprobs, parser, max_calls) if chat
            else convert.completion(msgs, meta, with_logprobs))
        return JSONResponse(schema.dump(answer),
                            headers={REQUEST_ID_HEADER: msgs[0].request_id})
    meta = convert.ResponseMeta.new(prefix, first.request_id, info.model_id)
    usage = body.stream_options is not None and body.stream_options.include_usage
    responses = _prepend(first, stream)
    chunks: AsyncIterator[BaseModel] = (
        convert.chat_chunks(responses, meta, with_logprobs, usage, parser, max_calls) if chat
        else convert.completion_chunks(responses, meta, with_logprobs, usage))
    return StreamingResponse(_events(chunks, stream), media_type="text/event-stream",
                             headers={REQUEST_ID_HEADER: first.request_id,
                                      "cache-control": "no-cache"})


async def _events(chunks: AsyncIterator[BaseModel],
                  stream: AsyncIterator[generate_pb2.GenerateResponse]) -> AsyncIterator[str]:
    """Server-sent events; a cancelled response (the client left) closes the backend's
    stream on the way out, which aborts the request."""
    try:
        async for chunk in chunks:
            yield f"data: {chunk.model_dump_json()}\n\n"
    except Exception as exc:
        _, error = http_error(exc)
        yield f"data: {json.dumps(error)}\n\n"
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    yield "data: [DONE]\n\n"


async def _prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    yield first
    async for item in rest:
        yield item


async def _collect(stream: AsyncIterator[T]) -> list[T]:
    return [item async for item in stream]


async def _unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """``awaitable``'s result, or _Disconnected once the client closes the connection
    (the awaitable is then cancelled: for a backend stream, that aborts the request).

    NOTE: Starlette cancels a streamed body when the client leaves, but not a handler
    that is still waiting; without this watch a non-streamed request would run to its
    end for nobody.
    """
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled() and watch.done() and not watch.cancelled():
        raise _Disconnected
    return work.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error_response(exc: BaseException) -> JSONResponse:
    status, error = http_error(exc)
    return JSONResponse(error, status_code=status, headers=http_headers(status))


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that is not JSON or not the schema: 400, naming the first field at fault."""
    first: dict[str, Any] = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
        return _error_response(InvalidInput("the request body is not valid JSON",
                                            "INVALID_JSON"))
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        message = f"unknown field {param!r} (not supported by this server)"
    else:
        message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
    return _error_response(InvalidInput(message, "INVALID_REQUEST", param))


async def _http_exception(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (no such route, wrong method) as OpenAI error objects."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse({"error": {"message": f"{request.method} {request.url.path}: "
                                              f"{exc.detail}", "type": kind, "param": None,
                                   "code": None}}, status_code=exc.status_code)


class BodyLimit:
    """Refuses a request body over ``max_bytes`` with 413 while it arrives: at once when
    its Content-Length says so, else (chunked) as soon as the bytes received pass it, so
    an oversize body is never held whole. A body within the cap is read here and handed
    on as it came (the app would read it whole anyway).

    NOTE: the connection stays open, and uvicorn reads and drops (never holds) what the
    client still sends. Closing it at once would reset it under the unread bytes, and a
    client still sending its body (every SDK does) would see a connection error instead
    of the 413."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        received: deque[Message] = deque()
        size = 0
        while True:
            message = await receive()
            received.append(message)
            if message["type"] != "http.request":  # the client left: the app sees it
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            # popped, not kept: the app's copy of the body is the only one left
            return received.popleft() if received else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = _error_response(RequestTooLarge(
            f"the request body is larger than this server's limit of {self.max_bytes} bytes"))
        await refusal(scope, receive, send)


class ServerSpans:
    """One SERVER span per HTTP request while tracing is on, parented by the caller's
    ``traceparent``: the HTTP twin of the gRPC ServerSpanInterceptor, so the request's
    ``generate_content`` span hangs below it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not tracing.enabled() or scope["path"] == "/metrics":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        span = tracing.tracer().start_span(
            f"{scope['method']} {scope['path']}", propagate.extract(headers),
            kind=trace.SpanKind.SERVER,
            attributes={"http.request.method": scope["method"], "url.path": scope["path"]})
        status = CLIENT_CLOSED  # unless a response starts

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            await self.app(scope, receive, send_status)
        finally:
            otel_context.detach(token)
            span.set_attribute("http.response.status_code", status)
            if status >= 400:
                span.set_attribute("error.type", str(status))
                span.set_status(trace.StatusCode.ERROR)
            span.end()
