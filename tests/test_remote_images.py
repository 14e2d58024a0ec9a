"""The remote-image guard's address rules, without a server: every IPv6 form that carries
an IPv4 address is judged by that IPv4 address too, ordinary public addresses pass, and
``--http-remote-image-allow-networks`` lets named networks through (tests/test_http_limits.py
runs the guard against a real cell)."""

from __future__ import annotations

import asyncio
import socket
from ipaddress import ip_network

import pytest

from tandem.errors import InvalidInput
from tandem.openai_api.remote_images import REFUSED, is_public, resolve_public
from tandem_cli.cli import _scheduler_config, build_parser

METADATA = "169.254.169.254"  # the cloud metadata address: a9fe:a9fe


@pytest.mark.parametrize(("address", "carried"), [
    ("64:ff9b::a9fe:a9fe", METADATA),  # NAT64 well-known prefix (RFC 6052)
    ("64:ff9b::a00:1", "10.0.0.1"),
    ("64:ff9b::7f00:1", "127.0.0.1"),
    ("::a9fe:a9fe", METADATA),  # IPv4-compatible (deprecated)
    ("::ffff:a9fe:a9fe", METADATA),  # IPv4-mapped
    ("::ffff:0:a9fe:a9fe", METADATA),  # IPv4-translated (SIIT)
    ("::ffff:0:a00:1", "10.0.0.1"),
    ("2002:a9fe:a9fe::1", METADATA),  # 6to4: the IPv4 address in bits 16-48
    ("2002:c0a8:1::1", "192.168.0.1"),
    ("2001:0:808:808:0:0:f5fe:56fd", "10.1.169.2"),  # Teredo: the client's, inverted
])
def test_ipv6_forms_of_a_private_ipv4_address_are_refused(address: str, carried: str) -> None:
    assert not is_public(carried)
    assert not is_public(address)


@pytest.mark.parametrize("address", [
    "8.8.8.8", "2001:4860:4860::8888", "2606:4700:4700::1111",
    "64:ff9b::808:808",  # NAT64 of 8.8.8.8: how an IPv6-only host reaches it
    "::ffff:8.8.8.8", "::ffff:0:808:808", "2002:808:808::1",
])
def test_public_addresses_and_forms_of_public_ipv4_addresses_pass(address: str) -> None:
    assert is_public(address)


@pytest.mark.parametrize("address", [
    "64:ff9b:1::808:808",  # RFC 8215's local-use NAT64: the IPv4 address may be anywhere
    "::", "::1", "ff02::1", "fe80::1", "fd00::1", "2001:db8::1", "0.0.0.0", "224.0.0.1",
])
def test_other_non_public_addresses_are_refused(address: str) -> None:
    assert not is_public(address)


def test_allowed_networks_pass_and_only_they() -> None:
    allowed = (ip_network("127.0.0.0/8"), ip_network("fd00::/8"))
    assert is_public("127.0.0.1", allowed) and is_public("fd00::5", allowed)
    assert is_public("::ffff:127.0.0.1", allowed)  # the same host, written in IPv6
    assert not is_public("10.0.0.1", allowed) and not is_public(METADATA, allowed)
    assert not is_public("64:ff9b::a9fe:a9fe", allowed)
    assert is_public("8.8.8.8", allowed)


def test_every_address_a_name_resolves_to_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name passes only if each of its addresses does (DNS answers as given here)."""
    def answer(*addresses: str) -> None:
        monkeypatch.setattr(socket, "getaddrinfo", lambda *_, **__: [
            (socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
             (a, 80)) for a in addresses])

    answer("8.8.8.8", "64:ff9b::a9fe:a9fe")
    with pytest.raises(InvalidInput) as caught:
        asyncio.run(resolve_public("images.example", 80, "messages"))
    assert caught.value.reason == REFUSED
    answer("8.8.8.8", "2001:4860:4860::8888")
    assert asyncio.run(resolve_public("images.example", 80, "messages")) == "8.8.8.8"
    answer("10.0.0.7", "fd00::7")
    allowed = (ip_network("10.0.0.0/8"), ip_network("fd00::/8"))
    assert asyncio.run(resolve_public("store.internal", 80, "messages", allowed)) == "10.0.0.7"
    with pytest.raises(InvalidInput):
        asyncio.run(resolve_public("store.internal", 80, "messages", allowed[:1]))


def test_the_allow_networks_flag(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args([
        "scheduler", "--http-remote-image-allow-networks", "10.0.0.0/8, fd00::/8"])
    config = _scheduler_config(args, ["unix:///tmp/w.sock"])
    assert config.http.remote_images.allow_networks == (ip_network("10.0.0.0/8"),
                                                       ip_network("fd00::/8"))
    assert build_parser().parse_args(["scheduler"]).http_remote_image_allow_networks == ()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["scheduler", "--http-remote-image-allow-networks",
                                   "10.0.0.1/8"])
    assert "expected networks like 10.0.0.0/8" in capsys.readouterr().err
