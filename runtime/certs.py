"""Development certificates: a private CA, a server certificate and a client certificate.

For development and tests only: the CA key sits next to the certificates, so whoever
reads the directory can mint certificates. Production uses certificates from the
operator's own CA and points `[tls]` at them. Private keys are written 0600 (the
directory 0700) and never printed.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_CERT, CA_KEY = "ca.pem", "ca-key.pem"
SERVER_CERT, SERVER_KEY = "server.pem", "server-key.pem"
CLIENT_CERT, CLIENT_KEY = "client.pem", "client-key.pem"
DEFAULT_NAMES = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class DevCerts:
    """Paths of one certificate directory (the layout `[tls]` defaults to)."""

    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / CA_CERT

    @property
    def ca_key(self) -> Path:
        return self.dir / CA_KEY

    @property
    def cert(self) -> Path:
        return self.dir / SERVER_CERT

    @property
    def key(self) -> Path:
        return self.dir / SERVER_KEY

    @property
    def client_cert(self) -> Path:
        return self.dir / CLIENT_CERT

    @property
    def client_key(self) -> Path:
        return self.dir / CLIENT_KEY


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """Created 0600 before any byte is written, so the key is never readable by others."""
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.chmod(0o644)


def _san(names: Sequence[str]) -> x509.SubjectAlternativeName:
    out: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):  # keep order, drop repeats
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            out.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(out)


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    days: int,
    now: dt.datetime,
    names: Sequence[str] = (),
    usage: x509.ObjectIdentifier | None = None,
) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    is_ca = issuer is None
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name if is_ca else issuer.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=not is_ca,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=is_ca,
                crl_sign=is_ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )
    if not is_ca:
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), False
        )
    if names:
        builder = builder.add_extension(_san(names), critical=False)
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _load_ca(certs: DevCerts) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    if not (certs.ca.is_file() and certs.ca_key.is_file()):
        return None
    cert = x509.load_pem_x509_certificate(certs.ca.read_bytes())
    key = serialization.load_pem_private_key(certs.ca_key.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        return None
    return cert, key


def make_dev_certs(
    out: str | os.PathLike[str],
    names: Sequence[str] = (),
    *,
    client: bool = True,
    days: int = 825,
    now: dt.datetime | None = None,
) -> DevCerts:
    """Write (or reuse) a dev CA in `out`, then a fresh server certificate for
    127.0.0.1, localhost and `names`, and a client certificate when `client`.

    Reusing an existing CA keeps clients that already trust it working when the server
    certificate is remade (e.g. with more names).
    """
    certs = DevCerts(Path(out))
    certs.dir.mkdir(parents=True, exist_ok=True)
    certs.dir.chmod(0o700)
    now = now or dt.datetime.now(dt.UTC)
    loaded = _load_ca(certs)
    if loaded is None:
        ca_key = _key()
        ca = _issue("tierflow development CA", ca_key, None, ca_key, days, now)
        _write_key(certs.ca_key, ca_key)
        _write_cert(certs.ca, ca)
    else:
        ca, ca_key = loaded
    server_key = _key()
    server = _issue(
        "tierflow server",
        server_key,
        ca,
        ca_key,
        days,
        now,
        names=[*DEFAULT_NAMES, *names],
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
    )
    _write_key(certs.key, server_key)
    _write_cert(certs.cert, server)
    if client:
        client_key = _key()
        cert = _issue(
            "tierflow client",
            client_key,
            ca,
            ca_key,
            days,
            now,
            usage=ExtendedKeyUsageOID.CLIENT_AUTH,
        )
        _write_key(certs.client_key, client_key)
        _write_cert(certs.client_cert, cert)
    return certs


def server_names(path: str | os.PathLike[str]) -> list[str]:
    """The subject alternative names of a certificate file, as strings."""
    cert = x509.load_pem_x509_certificate(Path(path).read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(v) for v in san.get_values_for_type(x509.IPAddress)] + list(
        san.get_values_for_type(x509.DNSName)
    )


__all__ = ["DevCerts", "make_dev_certs", "server_names"]
