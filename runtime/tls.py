"""SSL contexts from `[tls]`: one for every server tierflow runs, one for every client.

Servers (collector, gateway, admin, the embedded nats-server) present `tls.cert`/`tls.key`;
clients trust `tls.ca`. Empty paths mean the files `tierflow certs` writes under
`<state_dir>/certs`. With `tls.enabled = false` both functions return None, which every
caller reads as "plain", so by default every connection is plain.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from runtime.certs import DevCerts
from runtime.config import Config, ConfigError


@dataclass(frozen=True)
class TlsFiles:
    """The resolved paths of `[tls]` (client pair empty when not configured)."""

    cert: Path
    key: Path
    ca: Path
    client_cert: Path | None
    client_key: Path | None
    verify_clients: bool


def certs_dir(cfg: Config) -> Path:
    """Where `tierflow certs` writes by default and where empty `[tls]` paths point."""
    return cfg.state_path / "certs"


def tls_files(cfg: Config) -> TlsFiles | None:
    """The files `[tls]` names, checked to exist; None when TLS is off."""
    t = cfg.tls
    if not t.enabled:
        return None
    dev = DevCerts(certs_dir(cfg))

    def pick(value: str, default: Path, key: str) -> Path:
        path = Path(value).expanduser() if value else default
        if not path.is_file():
            hint = "" if value else " (run `tierflow certs` for development certificates)"
            raise ConfigError(f"tls.{key}: {path} does not exist{hint}")
        return path

    client_cert = client_key = None
    if t.client_cert:
        client_cert = pick(t.client_cert, dev.client_cert, "client_cert")
        client_key = pick(t.client_key, dev.client_key, "client_key")
    elif t.verify_clients and dev.client_cert.is_file() and dev.client_key.is_file():
        client_cert, client_key = dev.client_cert, dev.client_key
    return TlsFiles(
        cert=pick(t.cert, dev.cert, "cert"),
        key=pick(t.key, dev.key, "key"),
        ca=pick(t.ca, dev.ca, "ca"),
        client_cert=client_cert,
        client_key=client_key,
        verify_clients=t.verify_clients,
    )


def server_ssl_context(cfg: Config) -> ssl.SSLContext | None:
    """TLS 1.2+ server context (client certificates required with `verify_clients`)."""
    files = tls_files(cfg)
    if files is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(files.cert), str(files.key))
    if files.verify_clients:
        ctx.load_verify_locations(cafile=str(files.ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_ssl_context(cfg: Config) -> ssl.SSLContext | None:
    """Client context trusting `tls.ca` (hostnames checked), with the client pair if any."""
    files = tls_files(cfg)
    if files is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(files.ca))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if files.client_cert and files.client_key:
        ctx.load_cert_chain(str(files.client_cert), str(files.client_key))
    return ctx


def http_scheme(cfg: Config) -> str:
    """The scheme of the HTTP endpoints: https when `[tls]` is on (for the URLs we report)."""
    return "https" if cfg.tls.enabled else "http"


__all__ = ["TlsFiles", "certs_dir", "client_ssl_context", "http_scheme", "server_ssl_context"]
