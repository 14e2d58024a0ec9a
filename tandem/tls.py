"""TLS for the public gRPC port: server credentials from PEM files, and the client's side.

The public port (Generate, CacheStats, health) is the only one meant for other machines;
the workers stay on Unix sockets in the cell's private directory. With a certificate and
key the port speaks TLS; adding a client CA makes it mutual TLS: a client must present a
certificate that CA signed, or the handshake fails before any RPC runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


class TlsConfigError(ValueError):
    """Incomplete or unreadable TLS settings (the process refuses to start)."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM file paths; all empty = plaintext."""

    cert: str = ""  # certificate chain of this endpoint
    key: str = ""  # its private key
    ca: str = ""  # server: CA that client certificates must chain to (mutual TLS);
    # client: CA that the server certificate must chain to (empty = the system roots)

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.key or self.ca)


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials | None:
    """None for plaintext; TLS with ``cert`` and ``key``; mutual TLS when ``ca`` is set too."""
    if not files.enabled:
        return None
    if not (files.cert and files.key):
        raise TlsConfigError("TLS needs both --tls-cert and --tls-key (--tls-client-ca only "
                             "adds client verification)")
    ca = _read(files.ca, "--tls-client-ca") if files.ca else None
    return grpc.ssl_server_credentials(
        [(_read(files.key, "--tls-key"), _read(files.cert, "--tls-cert"))],
        root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Client credentials: trust ``ca`` (or the system roots); present ``cert`` + ``key``
    when both are given (mutual TLS)."""
    if bool(files.cert) != bool(files.key):
        raise TlsConfigError("a client certificate needs both --tls-cert and --tls-key")
    return pem_channel_credentials(
        _read(files.ca, "--tls-ca") if files.ca else None,
        _read(files.key, "--tls-key") if files.key else None,
        _read(files.cert, "--tls-cert") if files.cert else None)


def pem_channel_credentials(ca: bytes | None, key: bytes | None,
                            cert: bytes | None) -> grpc.ChannelCredentials:
    """:func:`channel_credentials` from PEM bytes already read (the operator has them from a
    Secret, not from files)."""
    if (key is None) != (cert is None):
        raise TlsConfigError("a client certificate needs both its certificate and its key")
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                        certificate_chain=cert)


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"{flag} {path}: {exc.strerror}") from exc
