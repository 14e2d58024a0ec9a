"""Fetching ``image_url`` images from remote URLs: off unless enabled, and guarded.

A server that fetches URLs for its clients can be made to reach what only it can reach
(its cloud metadata endpoint, the cluster's services, its own loopback). So every hop is
checked before it is made: the scheme is http or https, the host resolves only to global
unicast addresses (no loopback, private, link-local, shared, multicast or reserved
ones, nor an IPv6 address that carries such an IPv4 address: see :func:`is_public`) or
to networks the operator allowed, and the connection goes to the address that was
checked (the Host header and TLS name stay the URL's), so a second DNS answer cannot swap
in another target. Redirects are followed by hand, each one checked the same way, at
most ``MAX_REDIRECTS``.

A request's images are bounded before the first connection: their count against the
port's image limit (the caller checks it), each body read up to the smaller of
``max_bytes`` and the port's image-byte limit (so the request's total stays within the
count times that), and all of them fetched at once within one ``timeout_s``; the first
failure stops the others.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import SplitResult, urljoin, urlsplit, urlunsplit

import httpx

from tandem.errors import InvalidInput

MAX_REDIRECTS = 3
REFUSED = "REMOTE_IMAGE_REFUSED"
FAILED = "REMOTE_IMAGE_FAILED"
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# IPv6 ranges whose addresses stand for the IPv4 address in their low 32 bits: a
# connection to one reaches that IPv4 host (IPv4-mapped, IPv4-translated (SIIT),
# IPv4-compatible, and the NAT64 well-known prefix, RFC 6052).
_IPV4_IN_LOW_BITS = tuple(ipaddress.IPv6Network(n) for n in (
    "::ffff:0:0/96", "::ffff:0:0:0/96", "::/96", "64:ff9b::/96"))
# RFC 8215's local-use NAT64 prefix puts the IPv4 address where the operator chose.
_LOCAL_NAT64 = ipaddress.IPv6Network("64:ff9b:1::/48")


@dataclass(frozen=True, slots=True)
class RemoteImageLimits:
    max_bytes: int = 20 * 2**20  # one image
    timeout_s: float = 10.0  # all of a request's images together
    # Networks fetched from although not public (an in-cluster image store, tests).
    allow_networks: tuple[Network, ...] = ()


def is_public(address: str, allow_networks: Sequence[Network] = ()) -> bool:
    """Whether the server may connect to ``address``: an address in ``allow_networks``,
    or a public one. An IPv6 address carrying an IPv4 address is judged by that too:
    the forms in ``_IPV4_IN_LOW_BITS`` are their IPv4 address, 6to4 and Teredo addresses
    need each IPv4 address they carry to pass as well (Python's ``is_global`` alone
    passes ``64:ff9b::a9fe:a9fe``, the cloud metadata address behind NAT64)."""
    return _allowed(ipaddress.ip_address(address), allow_networks)


def _allowed(ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
             allow_networks: Sequence[Network]) -> bool:
    if any(ip in net for net in allow_networks):
        return True
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _LOCAL_NAT64:
            return False
        if any(ip in net for net in _IPV4_IN_LOW_BITS):
            return _allowed(ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF), allow_networks)
        carried = [ip.sixtofour] if ip.sixtofour is not None else list(ip.teredo or ())
        if not all(_allowed(v4, allow_networks) for v4 in carried):
            return False
    return ip.is_global and not ip.is_multicast


async def resolve_public(host: str, port: int, param: str,
                         allow_networks: Sequence[Network] = ()) -> str:
    """One address of ``host``, refused unless every address it resolves to passes
    :func:`is_public`."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):  # UnicodeError: not a valid host name (empty label...)
        raise InvalidInput(f"the image URL's host {host!r} does not resolve", FAILED,
                           param) from None
    addresses = [info[4][0] for info in infos]
    if not addresses or not all(is_public(a, allow_networks) for a in addresses):
        raise InvalidInput(f"the image URL's host {host!r} is not a public address; "
                           "the server fetches images only from the public internet",
                           REFUSED, param)
    return addresses[0]


def _split(url: str, param: str) -> tuple[SplitResult, str, int]:
    """``url``'s parts, host and port, or the client's error (never a 500) when it is
    not an http(s) URL with a host and a valid port."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:  # urllib's text names what is wrong ("Port out of range")
        raise InvalidInput(f"the image URL is malformed: {exc}", REFUSED, param) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidInput("an image URL must be http(s)://host/... or a data: URI",
                           REFUSED, param)
    return parts, parts.hostname, port


class RemoteImageFetcher:
    """Fetches a request's images within ``limits``; errors are InvalidInput (HTTP 400)."""

    def __init__(self, limits: RemoteImageLimits) -> None:
        self.limits = limits
        self._client = httpx.AsyncClient(follow_redirects=False, trust_env=False)

    async def fetch_all(self, urls: Sequence[str], param: str, max_image_bytes: int,
                        ) -> dict[str, tuple[bytes, str]]:
        """Each URL's body and Content-Type (each URL fetched once), all fetched at once
        within one deadline; the first failure cancels the rest and is raised."""
        limit = min(self.limits.max_bytes, max_image_bytes)
        tasks = {url: asyncio.ensure_future(self._fetch(url, param, limit))
                 for url in dict.fromkeys(urls)}
        try:
            async with asyncio.timeout(self.limits.timeout_s):
                for done in asyncio.as_completed(tasks.values()):
                    await done
        except TimeoutError:
            raise InvalidInput(f"fetching the images took longer than "
                               f"{self.limits.timeout_s} s", FAILED, param) from None
        finally:
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        return {url: task.result() for url, task in tasks.items()}

    async def _fetch(self, url: str, param: str, limit: int) -> tuple[bytes, str]:
        try:
            return await self._follow(url, param, limit)
        except (httpx.HTTPError, httpx.InvalidURL):
            raise InvalidInput("the image could not be fetched (connection failed)", FAILED,
                               param) from None

    async def _follow(self, url: str, param: str, limit: int) -> tuple[bytes, str]:
        for _ in range(MAX_REDIRECTS + 1):
            parts, hostname, port = _split(url, param)
            address = await resolve_public(hostname, port, param,
                                           self.limits.allow_networks)
            host = f"[{address}]" if ":" in address else address
            pinned = urlunsplit(parts._replace(netloc=f"{host}:{port}"))
            request = self._client.build_request(
                "GET", pinned, headers={"Host": parts.netloc.rpartition("@")[2]},
                extensions={"sni_hostname": hostname})
            response = await self._client.send(request, stream=True)
            try:
                if response.is_redirect and "location" in response.headers:
                    url = urljoin(url, response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise InvalidInput(f"fetching the image failed: HTTP {response.status_code}",
                                       FAILED, param)
                return await self._body(response, param, limit), response.headers.get(
                    "content-type", "").split(";")[0].strip()
            finally:
                await response.aclose()
        raise InvalidInput(f"the image URL redirects more than {MAX_REDIRECTS} times", FAILED,
                           param)

    @staticmethod
    async def _body(response: httpx.Response, param: str, limit: int) -> bytes:
        too_big = InvalidInput(f"the image is larger than {limit} bytes", FAILED, param)
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > limit:
                raise too_big
        return bytes(body)

    async def close(self) -> None:
        await self._client.aclose()
