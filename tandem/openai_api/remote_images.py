"""Fetching ``image_url`` images from remote URLs: off unless enabled, and guarded.

A server that fetches URLs for its clients can be made to reach what only it can reach
(its cloud metadata endpoint, the cluster's services, its own loopback). So every hop is
checked before it is made: the scheme is http or https, the host resolves only to global
unicast addresses (no loopback, private, link-local, shared, multicast or reserved
ones), and the connection goes to the address that was checked (the Host header and TLS
name stay the URL's), so a second DNS answer cannot swap in another target. Redirects are
followed by hand, each one checked the same way, at most ``MAX_REDIRECTS``; the body is
read up to ``max_bytes`` and the whole fetch, redirects included, within ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

from tandem.errors import InvalidInput

MAX_REDIRECTS = 3
REFUSED = "REMOTE_IMAGE_REFUSED"
FAILED = "REMOTE_IMAGE_FAILED"


@dataclass(frozen=True, slots=True)
class RemoteImageLimits:
    max_bytes: int = 20 * 2**20
    timeout_s: float = 10.0


def is_public(address: str) -> bool:
    """Whether a connection to ``address`` leaves the host's own networks."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


async def resolve_public(host: str, port: int, param: str) -> str:
    """One address of ``host``, refused unless every address it resolves to is public."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)
    except OSError:
        raise InvalidInput(f"the image URL's host {host!r} does not resolve", FAILED,
                           param) from None
    addresses = [info[4][0] for info in infos]
    if not addresses or not all(is_public(a) for a in addresses):
        raise InvalidInput(f"the image URL's host {host!r} is not a public address; "
                           "the server fetches images only from the public internet",
                           REFUSED, param)
    return addresses[0]


class RemoteImageFetcher:
    """Fetches one image per call within ``limits``; errors are InvalidInput (HTTP 400)."""

    def __init__(self, limits: RemoteImageLimits) -> None:
        self.limits = limits
        self._client = httpx.AsyncClient(follow_redirects=False, trust_env=False)

    async def fetch(self, url: str, param: str) -> tuple[bytes, str]:
        """The body and Content-Type of ``url``."""
        try:
            async with asyncio.timeout(self.limits.timeout_s):
                return await self._follow(url, param)
        except TimeoutError:
            raise InvalidInput(f"fetching the image took longer than {self.limits.timeout_s} s",
                               FAILED, param) from None
        except httpx.HTTPError:
            raise InvalidInput("the image could not be fetched (connection failed)", FAILED,
                               param) from None

    async def _follow(self, url: str, param: str) -> tuple[bytes, str]:
        for _ in range(MAX_REDIRECTS + 1):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise InvalidInput("an image URL must be http(s)://host/... or a data: URI",
                                   REFUSED, param)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            address = await resolve_public(parts.hostname, port, param)
            host = f"[{address}]" if ":" in address else address
            pinned = urlunsplit(parts._replace(netloc=f"{host}:{port}"))
            request = self._client.build_request(
                "GET", pinned, headers={"Host": parts.netloc.rpartition("@")[2]},
                extensions={"sni_hostname": parts.hostname})
            response = await self._client.send(request, stream=True)
            try:
                if response.is_redirect and "location" in response.headers:
                    url = urljoin(url, response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise InvalidInput(f"fetching the image failed: HTTP {response.status_code}",
                                       FAILED, param)
                return await self._body(response, param), response.headers.get(
                    "content-type", "").split(";")[0].strip()
            finally:
                await response.aclose()
        raise InvalidInput(f"the image URL redirects more than {MAX_REDIRECTS} times", FAILED,
                           param)

    async def _body(self, response: httpx.Response, param: str) -> bytes:
        limit = self.limits.max_bytes
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
