"""Which browser requests an HTTP endpoint serves: `Host`, `Origin` and body type (pure).

Any web page the operator opens can reach a loopback endpoint: a WebSocket needs no CORS, a
`text/plain` or form POST needs no preflight, and DNS rebinding points the attacker's own
name at the endpoint, which the browser then treats as that page's own origin. So every
request, bar the listed exceptions, is checked:

- `Host` must name this server: `localhost`, the loopback literals, the bind host, this
  machine's names, the IP literal the client connected to, or a configured name (a rebound
  request carries the attacker's name). Refused 421, since the name is not served here.
- `Origin`, when sent, must be the server's own (its scheme, with the host and port of the
  accepted `Host`) or a configured one. A page's no-cors load (`<script src>`, `<img>`)
  sends no Origin, but browsers mark it `Sec-Fetch-Site: cross-site`, refused as well
  unless it is a navigation to one of the server's pages. Refused 403.
- a request with a body (POST, PUT, PATCH) must declare one of the server's JSON types
  (a server that parses bodies by their type checks this itself):
  the bodies a page may send cross-origin without a preflight are text/plain, form and
  multipart ones. Refused 415.

Clients that are not browsers (curl, Python) send neither Origin nor Sec-Fetch-Site and
pass, so the rules cost scripts nothing but a correct `Content-Type`. A page of an allowed
origin is answered with `cors_headers` (a preflight too), so it can read what it asked for;
no credentials are allowed, tokens travel in headers, never in cookies.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import urlsplit

__all__ = [
    "ANY",
    "JSON_TYPES",
    "BrowserGuard",
    "Origin",
    "Refusal",
    "cors_headers",
    "host_name",
    "machine_names",
    "parse_origin",
]

ANY = "*"
JSON_TYPES = frozenset({"application/json"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_LOOPBACK = ("localhost", "127.0.0.1", "::1")
_WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})
_NAME = re.compile(r"^[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*$")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def cors_headers(origin: str, *, preflight: bool = False) -> dict[str, str]:
    """The answer's headers that let a page of `origin` (already allowed) read it; for a
    preflight, also the methods and headers it may send."""
    headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
    if preflight:
        headers["Access-Control-Allow-Methods"] = "GET, POST, DELETE"
        headers["Access-Control-Allow-Headers"] = "Authorization, Content-Type, Last-Event-ID"
        headers["Access-Control-Max-Age"] = "600"
    return headers


class Origin(NamedTuple):
    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = _DEFAULT_PORTS.get(self.scheme)
        return f"{self.scheme}://{host}" + ("" if self.port == default else f":{self.port}")


class Refusal(NamedTuple):
    """Why a request is not served: the HTTP status and a reason for its JSON body."""

    status: int
    reason: str


def host_name(name: str) -> str:
    """A host name as compared: lower case, no brackets around IPv6, no trailing dot;
    ValueError if it is neither a DNS name nor an IP literal."""
    text = name.strip().lower().rstrip(".")
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        pass
    if not _NAME.match(text) or len(text) > 253:
        raise ValueError(f"{name!r} is not a host name or an IP address")
    return text


def parse_origin(text: str) -> Origin:
    """`scheme://host[:port]` as a browser sends it in `Origin`; ValueError otherwise
    (`null`, a path, a user, another scheme)."""
    try:
        parts = urlsplit(text.strip())
        port = parts.port
    except ValueError:
        raise ValueError(f"{text!r} is not an origin") from None
    scheme = parts.scheme.lower()
    if (
        scheme not in _DEFAULT_PORTS
        or not parts.hostname
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or parts.username is not None
    ):
        raise ValueError(f"{text!r} is not an origin (scheme://host[:port], http or https)")
    return Origin(scheme, host_name(parts.hostname), port or _DEFAULT_PORTS[scheme])


def _split_host(header: str) -> tuple[str, int | None]:
    """(name, port) of a `Host` header; ValueError if it is malformed."""
    text = header.strip()
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"malformed Host {header!r}")
        name, rest = text[: end + 1], text[end + 1 :]
        port_text = rest[1:] if rest.startswith(":") else ""
        if rest and not rest.startswith(":"):
            raise ValueError(f"malformed Host {header!r}")
    elif text.count(":") == 1:
        name, port_text = text.split(":")
    else:
        name, port_text = text, ""
    if port_text and not port_text.isdigit():
        raise ValueError(f"malformed Host {header!r}")
    return host_name(name), int(port_text) if port_text else None


def machine_names(bind_host: str) -> frozenset[str]:
    """The names a client on this machine or its network may use for a server bound to
    `bind_host`: loopback, the bind host, the host name and its fully qualified form, and
    the addresses those resolve to. Resolution failures only leave names out."""
    names = set(_LOOPBACK)
    if bind_host not in _WILDCARD_BINDS:
        names.add(bind_host)
    hostname = socket.gethostname()
    for name in {hostname, socket.getfqdn(hostname)}:
        names.add(name)
        try:
            names.update(str(info[4][0]) for info in socket.getaddrinfo(name, None))
        except OSError:
            continue
    out = set()
    for name in names:
        try:
            out.add(host_name(name.split("%")[0]))
        except ValueError:
            continue
    return frozenset(out)


@dataclass(frozen=True)
class BrowserGuard:
    """One server's rules: `check` says why a request is refused, or None to serve it.

    `hosts`/`origins` are what `build` accepts from the config plus the defaults; `exempt`
    paths skip every check (a health probe); `pages(path)` are documents a link from
    another site may open (a GET navigation without Origin)."""

    scheme: str
    hosts: frozenset[str]
    origins: frozenset[Origin]
    any_host: bool = False
    any_origin: bool = False
    exempt: frozenset[str] = frozenset({"/healthz"})
    pages: Callable[[str], bool] = field(default=lambda path: False)
    json_types: frozenset[str] | None = JSON_TYPES  # None: the server checks body types

    @classmethod
    def build(
        cls,
        *,
        scheme: str,
        bind_host: str,
        allowed_hosts: Iterable[str] = (),
        allowed_origins: Iterable[str] = (),
        exempt: Iterable[str] = ("/healthz",),
        pages: Callable[[str], bool] = lambda path: False,
        json_types: Iterable[str] | None = JSON_TYPES,
    ) -> BrowserGuard:
        """The rules from config values (checked at load: a bad one raises ValueError)."""
        hosts = list(allowed_hosts)
        origins = list(allowed_origins)
        return cls(
            scheme=scheme,
            hosts=machine_names(bind_host) | {host_name(h) for h in hosts if h != ANY},
            origins=frozenset(parse_origin(o) for o in origins if o != ANY),
            any_host=ANY in hosts,
            any_origin=ANY in origins,
            exempt=frozenset(exempt),
            pages=pages,
            json_types=None if json_types is None else frozenset(json_types),
        )

    def check(
        self, method: str, path: str, headers: Mapping[str, str], local_ip: str | None = None
    ) -> Refusal | None:
        if path in self.exempt:
            return None
        host_header = headers.get("Host", "")
        try:  # no Host at all (HTTP/1.0): no browser sent it, nothing can be rebound
            host, port = _split_host(host_header) if host_header else ("", None)
        except ValueError:
            return Refusal(400, f"malformed Host header {host_header!r}")
        if host and not self.any_host and host not in self.hosts and host != _ip(local_ip):
            return Refusal(
                421,
                f"this server does not answer to host {host!r}: add it to the allowed hosts "
                "if clients reach the server by that name",
            )
        origin_header = headers.get("Origin")
        if origin_header is not None:
            refused = self._origin(origin_header, Origin(self.scheme, host, port or 0))
            if refused is not None:
                return refused
        elif self._cross_site_load(method, path, headers):
            return Refusal(403, "cross-site requests from browsers are refused")
        if method in _BODY_METHODS and self.json_types is not None:
            media = headers.get("Content-Type", "").split(";")[0].strip().lower()
            if media not in self.json_types:
                return Refusal(
                    415,
                    f"the body must be sent as {' or '.join(sorted(self.json_types))} "
                    f"(got {media or 'no Content-Type'!r})",
                )
        return None

    def _cross_site_load(self, method: str, path: str, headers: Mapping[str, str]) -> bool:
        """A browser's request without Origin made by another site's page (not a link
        followed to one of the server's pages)."""
        if self.any_origin or headers.get("Sec-Fetch-Site", "").lower() != "cross-site":
            return False
        return not (method in ("GET", "HEAD") and self.pages(path))

    def _origin(self, header: str, own: Origin) -> Refusal | None:
        if self.any_origin:
            return None
        try:
            origin = parse_origin(header)
        except ValueError:
            return Refusal(403, f"requests from origin {header!r} are refused")
        if own.port == 0:
            own = own._replace(port=_DEFAULT_PORTS.get(own.scheme, 0))
        if origin == own or origin in self.origins:
            return None
        return Refusal(
            403,
            f"requests from origin {header!r} are refused: only this server's own pages "
            "and the allowed origins may use it",
        )


def _ip(text: str | None) -> str | None:
    if not text:
        return None
    try:
        return str(ipaddress.ip_address(text.split("%")[0]))
    except ValueError:
        return None
