"""Test certificates made with ``cryptography``: a CA, a server certificate for
localhost/127.0.0.1, a client certificate from the same CA and one from a rogue CA. Used by
the security, gateway and chart tests."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    rogue_key: Path

    def client(self, cert: Path | None = None, key: Path | None = None,
               ca: Path | None = None) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=(ca or self.ca).read_bytes(),
            private_key=key.read_bytes() if key else None,
            certificate_chain=cert.read_bytes() if cert else None)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key, issuer: str, issuer_key, ca: bool,
          names: list[x509.GeneralName] = ()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(hours=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key) -> tuple[Path, Path]:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return path.with_suffix(".crt"), path.with_suffix(".key")


def make_pki(d: Path) -> Pki:
    ca_key, rogue_ca_key = _key(), _key()
    ca = _cert("tandem test CA", ca_key, "tandem test CA", ca_key, ca=True)
    _write(d / "ca", ca, ca_key)
    server_key = _key()
    server = _cert("localhost", server_key, "tandem test CA", ca_key, ca=False,
                   names=[x509.DNSName("localhost"),
                          x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client_key, rogue_key = _key(), _key()
    client = _cert("tenant-a", client_key, "tandem test CA", ca_key, ca=False)
    rogue = _cert("mallory", rogue_key, "rogue CA", rogue_ca_key, ca=False)
    return Pki(d / "ca.crt", *_write(d / "server", server, server_key),
               *_write(d / "client", client, client_key), *_write(d / "rogue", rogue, rogue_key))
