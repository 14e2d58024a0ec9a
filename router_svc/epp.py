"""Tandem's endpoint picker (EPP): Envoy carries the bytes, this decides which cell gets them.

Envoy's ext_proc filter streams each request through ``ExternalProcessor.Process`` (bodies
``FULL_DUPLEX_STREAMED``, trailers ``SEND``; see ``tandem_operator.envoy``). The picker
buffers the request body to its end, reads it as a ``tandem.v1`` ``GenerateRequest`` (h2c
gRPC) or an OpenAI JSON body, computes the router's routing key
(:mod:`router_svc.routing_key`) and lets the router's balancer pick a cell from live state
(health and queue from :class:`router_svc.cell_pool.CellPool`, bounded-load affinity).
It answers the request headers with ``x-gateway-destination-endpoint: ip:port`` (and the
same value in dynamic metadata ``envoy.lb``, with the cells to fail over to: see
:func:`_route_to`), streams the body back unchanged, and echoes whatever of the response
the gateway sends (Tandem's own bootstrap sends only its trailers; GIE's reference
configuration sends it all). The cell holds a slot in the balancer for as long as the
ext_proc stream lives, which is as long as the request. Each pick is a ``tandem.route``
span (:mod:`router_svc.route_span`) whose context the header answer hands to the cell.

Refusals are immediate responses built from :mod:`tandem.errors`: 503 / UNAVAILABLE when no
cell is up (or none of the gateway's subset hint), 429 / RESOURCE_EXHAUSTED when every
eligible cell's queue is over its bound, 504 / DEADLINE_EXCEEDED when the body does not
arrive in time (Envoy ignores its own message timeout in this mode, so the picker bounds
every wait itself).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import logging
import socket
from collections.abc import AsyncIterator, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError
from prometheus_client import Counter
from pydantic import ValidationError

from router_svc import ext_proc_pb2 as ext_proc
from router_svc.balancer import Balancer, RouteDecision
from router_svc.cell_pool import MAX_MESSAGE_BYTES
from router_svc.route_span import RouteSpan
from router_svc.routing_key import RoutingKey, routing_key
from tandem.errors import (
    DeadlineExceeded,
    RequestTooLarge,
    ResourceExhausted,
    TandemError,
    Unavailable,
    http_error,
    http_headers,
)
from tandem.openai_api import convert, schema
from tandem.v1 import generate_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"  # Envoy's; the messages:
# router_svc/ext_proc.proto
DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
# Failover (docs/routing.md): GIE's protocol names one fallback endpoint; Envoy's
# override-host policy takes them all, in order, as "ip:port,ip:port".
FALLBACK_KEY = "x-gateway-destination-endpoint-fallback"
FALLBACKS_KEY = "x-gateway-destination-endpoint-fallbacks"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
GENERATE_PATH = f"/{generate_pb2.DESCRIPTOR.services_by_name['Generation'].full_name}/Generate"
OPENAI_PATHS = {"/v1/chat/completions": schema.ChatCompletionRequest,
                "/v1/completions": schema.CompletionRequest}
# Envoy takes streamed body chunks below 64 KiB.
CHUNK_BYTES = 60 * 1024
GRPC_FRAME_PREFIX = 5  # compressed flag (1 byte) + message length (4 bytes, big-endian)
# Larger bodies (images) are read into a key off the event loop, so decoding and hashing
# them never stalls the other requests' streams.
OFF_LOOP_BYTES = 256 * 1024


# --- cells -------------------------------------------------------------------------------

@dataclass(frozen=True)
class CellEndpoint:
    """One cell: checked over gRPC at ``host:grpc_port``; Envoy sends gRPC requests to
    ``ip:grpc_port`` and HTTP ones to ``ip:http_port`` (``ip``: ``host`` resolved, since
    Envoy's ORIGINAL_DST cluster connects to an address, not a name)."""

    host: str
    grpc_port: int
    http_port: int
    ip: str = ""

    @property
    def name(self) -> str:
        """The cell's name in the balancer and the metrics: its gRPC target."""
        return f"{_bracketed(self.host)}:{self.grpc_port}"

    def destination(self, grpc_request: bool) -> str:
        return f"{_bracketed(self.ip)}:{self.grpc_port if grpc_request else self.http_port}"


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def parse_cells(text: str, default_http_port: int) -> tuple[CellEndpoint, ...]:
    """``host:GRPC_PORT`` or ``host:GRPC_PORT/HTTP_PORT`` entries, comma-separated (IPv6
    hosts in brackets); ``default_http_port`` for entries without one. ValueError names
    the bad entry."""
    cells = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        address, _, http = entry.partition("/")
        host, sep, port = address.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        try:
            grpc_port = int(port)
            http_port = int(http) if http else default_http_port
        except ValueError:
            raise ValueError(f"cell {entry!r}: expected host:GRPC_PORT or "
                             "host:GRPC_PORT/HTTP_PORT") from None
        if not sep or not host or not all(0 < p < 65536 for p in (grpc_port, http_port)):
            raise ValueError(f"cell {entry!r}: expected host:GRPC_PORT or "
                             "host:GRPC_PORT/HTTP_PORT with ports in 1..65535")
        cells.append(CellEndpoint(host, grpc_port, http_port))
    if len({c.name for c in cells}) != len(cells):
        raise ValueError(f"a cell is listed twice in {text!r}")
    return tuple(cells)


async def resolved(cell: CellEndpoint) -> CellEndpoint:
    """``cell`` with its host resolved to an IP address (the first the resolver gives);
    OSError when it resolves to none."""
    try:
        ipaddress.ip_address(cell.host)
        return CellEndpoint(cell.host, cell.grpc_port, cell.http_port, cell.host)
    except ValueError:
        pass
    infos = await asyncio.get_running_loop().getaddrinfo(cell.host, cell.grpc_port,
                                                         type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"{cell.host} resolves to no address")
    return CellEndpoint(cell.host, cell.grpc_port, cell.http_port, str(infos[0][4][0]))


# --- requests ----------------------------------------------------------------------------

def is_grpc(content_type: str) -> bool:
    return content_type.startswith("application/grpc")


def request_key(path: str, content_type: str, body: bytes, block_size: int) -> RoutingKey:
    """The router's routing key of a buffered request.

    A gRPC Generate's one framed ``GenerateRequest``, or an OpenAI chat/completion body
    converted as the cells convert it (a remote image is named by its URL: the picker
    fetches nothing). Anything else (other methods, compressed or malformed bodies) gets
    the key of an empty request: it goes to the cell that key prefers, whose answer
    (model info, or the error a bad request deserves) is the same everywhere.
    """
    return routing_key(_generate_request(path, content_type, body), block_size)


def _generate_request(path: str, content_type: str, body: bytes,
                      ) -> generate_pb2.GenerateRequest:
    empty = generate_pb2.GenerateRequest()
    if is_grpc(content_type):
        if path != GENERATE_PATH or len(body) < GRPC_FRAME_PREFIX or body[0] != 0:
            return empty
        length = int.from_bytes(body[1:GRPC_FRAME_PREFIX], "big")
        msg = generate_pb2.GenerateRequest()
        try:
            msg.ParseFromString(body[GRPC_FRAME_PREFIX:GRPC_FRAME_PREFIX + length])
        except DecodeError:  # the cell will refuse it with its own message
            return empty
        return msg
    model = OPENAI_PATHS.get(path.partition("?")[0])
    if model is None:
        return empty
    try:
        req = model.model_validate(json.loads(body))
        if isinstance(req, schema.ChatCompletionRequest):
            remote = {url: (url.encode(), "") for url in convert.remote_image_urls(req)}
            return convert.chat_request(req, fetched=remote)
        return convert.completion_request(req)
    except (ValueError, ValidationError, TandemError):
        return empty


def subset_hint(metadata: ext_proc.Metadata) -> frozenset[str] | None:
    """The gateway's subset hint (``ip:port`` entries), None when it gave none."""
    if SUBSET_NAMESPACE not in metadata.filter_metadata:
        return None
    value = metadata.filter_metadata[SUBSET_NAMESPACE].fields.get(SUBSET_KEY)
    if value is None:
        return None
    if value.HasField("list_value"):
        entries: Iterable[str] = (v.string_value for v in value.list_value.values)
    else:
        entries = value.string_value.split(",")
    return frozenset(e.strip() for e in entries if e.strip())


# --- picking -----------------------------------------------------------------------------

class Picker:
    """The cells by name and the router's balancer over them.

    A cell's host is resolved again at every :meth:`resolve` (each health interval): on
    Kubernetes a scheduler pod that is not ready yet has no DNS record, and a restarted one
    has a new IP. A cell without an address is never picked (the others still are)."""

    def __init__(self, balancer: Balancer, cells: Sequence[CellEndpoint]) -> None:
        self.balancer = balancer
        self.cells = {c.name: c for c in cells}

    async def resolve(self) -> bool:
        """Resolve every cell's host again; whether an address changed."""
        before = dict(self.cells)
        found = await asyncio.gather(*(resolved(c) for c in self.cells.values()),
                                     return_exceptions=True)
        for name, cell in zip(list(self.cells), found, strict=True):
            if isinstance(cell, CellEndpoint):
                self.cells[name] = cell
            elif isinstance(cell, OSError):
                if self.cells[name].ip:
                    log.warning("cell %s no longer resolves (%s): not picked", name, cell)
                self.cells[name] = dataclasses.replace(self.cells[name], ip="")
            else:
                raise cell
        return self.cells != before

    def in_subset(self, hint: Collection[str]) -> set[str]:
        """The cells a subset hint names, by either of their ports or their bare IP."""
        return {name for name, c in self.cells.items()
                if c.ip and {c.ip, c.destination(True), c.destination(False)} & set(hint)}

    def eligible(self, hint: Collection[str] | None) -> set[str]:
        """The cells a request may go to: those with an address, within the hint."""
        return ({name for name, c in self.cells.items() if c.ip} if hint is None
                else self.in_subset(hint))

    def pick(self, key: RoutingKey, hint: Collection[str] | None) -> RouteDecision:
        """A slot on a cell (give it back with ``balancer.release``), or the refusal."""
        only = self.eligible(hint)
        decision = self.balancer.route(key, only=only)
        if decision is not None:
            return decision
        if not self.balancer.serving(only=only):
            raise Unavailable("no cell is serving" if hint is None else
                              "no cell of the gateway's subset hint is serving")
        raise ResourceExhausted("every cell's queue is full; retry later", "QUEUE_FULL")


# --- the ext_proc stream -----------------------------------------------------------------

def ext_proc_handler(servicer: EppServicer) -> grpc.GenericRpcHandler:
    """``servicer`` as Envoy's ``ExternalProcessor`` service, registered by name: its
    messages are this project's wire-compatible subset (router_svc/ext_proc.proto)."""
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "Process": grpc.stream_stream_rpc_method_handler(
            servicer.Process,
            request_deserializer=ext_proc.ProcessingRequest.FromString,
            response_serializer=ext_proc.ProcessingResponse.SerializeToString)})


class EppServicer:
    """One ``Process`` stream per request: pick, then pass everything through.

    ``refused`` counts the requests the picker answered itself, by HTTP status.
    """

    def __init__(self, picker: Picker, block_size: int, body_timeout_s: float,
                 refused: Counter) -> None:
        self.picker = picker
        self.block_size = block_size
        self.body_timeout_s = body_timeout_s
        self.refused = refused

    async def Process(self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
                      context: grpc.aio.ServicerContext,
                      ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("request_headers"):
            return  # Envoy always opens with the request headers; nothing to do otherwise
        picker = self.picker  # the cells may change (a cells file); this stream keeps its own
        headers = _header_map(first.request_headers.headers)
        grpc_request = is_grpc(headers.get("content-type", ""))
        route = RouteSpan(headers)
        try:
            body, ended_by_trailers = b"", False
            if not first.request_headers.end_of_stream:
                body, ended_by_trailers = await self._body(request_iterator)
            args = (headers.get(":path", ""), headers.get("content-type", ""), body,
                    self.block_size)
            key = (request_key(*args) if len(body) <= OFF_LOOP_BYTES
                   else await asyncio.to_thread(request_key, *args))
            hint = subset_hint(first.metadata_context)
            decision = picker.pick(key, hint)
            trace_headers = route.picked(decision, picker.balancer)
        except TandemError as error:
            route.refused(error)
            yield self._refuse(error, grpc_request)
            return
        finally:
            route.end()
        try:
            fallbacks = picker.balancer.fallbacks(key, decision.cell, picker.eligible(hint))
            yield _with_headers(_route_to([picker.cells[c].destination(grpc_request)
                                           for c in (decision.cell, *fallbacks)]),
                                trace_headers)
            if not first.request_headers.end_of_stream:
                for response in _streamed(body, last=not ended_by_trailers):
                    yield ext_proc.ProcessingResponse(request_body=response)
            if ended_by_trailers:  # read while buffering; answered once the body is back
                yield ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())
            async for msg in request_iterator:
                yield _pass_through(msg)
        finally:
            picker.balancer.release(decision.cell)

    async def _body(self, requests: AsyncIterator[ext_proc.ProcessingRequest],
                    ) -> tuple[bytes, bool]:
        """The whole request body, and whether trailers (not the body) ended it."""
        body = bytearray()
        try:
            async with asyncio.timeout(self.body_timeout_s):
                async for msg in requests:
                    if msg.HasField("request_trailers"):
                        return bytes(body), True
                    if not msg.HasField("request_body"):
                        continue
                    body += msg.request_body.body
                    if len(body) > MAX_MESSAGE_BYTES:
                        raise RequestTooLarge(
                            f"the request body is larger than {MAX_MESSAGE_BYTES} bytes")
                    if msg.request_body.end_of_stream:
                        return bytes(body), False
        except TimeoutError:
            raise DeadlineExceeded(
                f"the request body did not arrive within {self.body_timeout_s:g} s") from None
        raise Unavailable("the gateway closed the stream before the request body ended")

    def _refuse(self, error: TandemError, grpc_request: bool) -> ext_proc.ProcessingResponse:
        status, body = http_error(error)
        self.refused.labels(str(status)).inc()
        log.info("refused a request: %d %s", status, error.message)
        if grpc_request:
            # A gRPC client reads the status from grpc-status, in a 200 trailers-only answer.
            return ext_proc.ProcessingResponse(immediate_response=ext_proc.ImmediateResponse(
                status=ext_proc.HttpStatus(code=200),
                grpc_status=ext_proc.GrpcStatus(status=error.code.value[0]),
                body=error.message.encode(), details=f"tandem_epp_{error.reason.lower()}"))
        mutation = ext_proc.HeaderMutation(set_headers=[
            _header(k, v) for k, v in {"content-type": "application/json",
                                       **http_headers(status)}.items()])
        return ext_proc.ProcessingResponse(immediate_response=ext_proc.ImmediateResponse(
            status=ext_proc.HttpStatus(code=status), headers=mutation,
            body=json.dumps(body).encode(), details=f"tandem_epp_{error.reason.lower()}"))


def _header_map(headers: ext_proc.HeaderMap) -> dict[str, str]:
    return {h.key.lower(): h.raw_value.decode(errors="replace") if h.raw_value else h.value
            for h in headers.headers}


def _header(key: str, value: str) -> ext_proc.HeaderValueOption:
    return ext_proc.HeaderValueOption(
        header=ext_proc.HeaderValue(key=key, raw_value=value.encode()),
        append_action=ext_proc.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def _route_to(destinations: Sequence[str]) -> ext_proc.ProcessingResponse:
    """The request headers' answer: the picked cell (the first destination) as a header
    (Envoy re-picks the route with it) and as ``envoy.lb`` metadata (for gateways that read
    that instead); the others, where the gateway retries a request whose cell failed before
    answering, as GIE's one fallback and as Envoy's list of them (``FALLBACKS_KEY``)."""
    destination, *fallbacks = destinations
    metadata = struct_pb2.Struct()
    lb = metadata.get_or_create_struct(DESTINATION_NAMESPACE)
    lb[DESTINATION_HEADER] = destination
    if fallbacks:
        lb[FALLBACK_KEY] = fallbacks[0]
        lb[FALLBACKS_KEY] = ",".join(fallbacks)
    return ext_proc.ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(response=ext_proc.CommonResponse(
            header_mutation=ext_proc.HeaderMutation(
                set_headers=[_header(DESTINATION_HEADER, destination)]),
            clear_route_cache=True)),
        dynamic_metadata=metadata)


def _with_headers(answer: ext_proc.ProcessingResponse,
                  headers: Mapping[str, str]) -> ext_proc.ProcessingResponse:
    """``answer`` (to the request headers) also setting ``headers`` on the request: the
    ``traceparent`` that puts the cell's spans under the pick (:mod:`router_svc.route_span`)."""
    answer.request_headers.response.header_mutation.set_headers.extend(
        _header(k, v) for k, v in headers.items())
    return answer


def _streamed(body: bytes, last: bool) -> Iterable[ext_proc.BodyResponse]:
    """``body`` as streamed chunks below Envoy's limit (one empty chunk for no body)."""
    starts = range(0, len(body), CHUNK_BYTES) if body else [0]
    for start in starts:
        chunk = body[start:start + CHUNK_BYTES]
        yield _body_response(chunk, last and start + CHUNK_BYTES >= len(body))


def _body_response(chunk: bytes, end_of_stream: bool) -> ext_proc.BodyResponse:
    return ext_proc.BodyResponse(response=ext_proc.CommonResponse(
        body_mutation=ext_proc.BodyMutation(streamed_response=ext_proc.StreamedBodyResponse(
            body=chunk, end_of_stream=end_of_stream))))


def _pass_through(msg: ext_proc.ProcessingRequest) -> ext_proc.ProcessingResponse:
    """The unchanged answer to anything after the pick: trailers, the response's headers,
    body chunks (echoed at once, so tokens stream) and trailers."""
    kind = msg.WhichOneof("request")
    if kind == "request_trailers":
        return ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())
    if kind == "response_headers":
        return ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())
    if kind == "response_body":
        return ext_proc.ProcessingResponse(response_body=_body_response(
            msg.response_body.body, msg.response_body.end_of_stream))
    if kind == "response_trailers":
        return ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())
    if kind == "request_body":  # only after trailers ended the buffering: cannot happen
        return ext_proc.ProcessingResponse(request_body=_body_response(
            msg.request_body.body, msg.request_body.end_of_stream))
    raise Unavailable(f"unexpected ext_proc message {kind!r}")
