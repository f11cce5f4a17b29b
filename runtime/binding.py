"""Where a role's server listens and the address it gives others (`roles.<role>.host`).

- ``"127.0.0.1"`` (the default): loopback, one machine;
- ``"node"``: the address of the Ray node the actor runs on, which is also what it
  advertises: the form for a cluster, where every host runs the same config;
- ``"0.0.0.0"`` / ``"::"``: every address of the host; it advertises the node's address;
- any other address or name: that one, advertised as it is.

Pure: the node's address is passed in (`ray.util.get_node_ip_address()` in an actor).

A role's replicas share one port (SO_REUSEPORT). When another process holds it, a replica's
bind fails with `PortTakenError` (errno EADDRINUSE) rather than a bare OSError, and its
message names the port in a form `taken_port` reads back from the text Ray gives for the
actor's death, so the starter (cluster/deploy/deployer.py) can choose another port.
"""

from __future__ import annotations

import errno
import ipaddress
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from runtime.errors import TierflowError

__all__ = [
    "NODE",
    "WILDCARDS",
    "Binding",
    "PortTakenError",
    "bind_failure",
    "check_host",
    "resolve",
    "taken_port",
    "url_host",
]

NODE = "node"
WILDCARDS = frozenset({"0.0.0.0", "::"})
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-.")


class Binding(NamedTuple):
    """The address a server binds and the one clients are told."""

    bind: str
    advertise: str


def resolve(host: str, node_ip: Callable[[], str]) -> Binding:
    """The binding of `host` (see the module doc); `node_ip` is asked only when needed."""
    if host == NODE:
        ip = node_ip()
        return Binding(ip, ip)
    if host in WILDCARDS:
        return Binding(host, node_ip())
    return Binding(host, host)


def check_host(host: str) -> str | None:
    """Why `host` is not a usable `roles.<role>.host`, or None."""
    if host == NODE or host in WILDCARDS:
        return None
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    name = host.lower().rstrip(".")
    if name and len(name) <= 253 and set(name) <= _NAME_CHARS and ".." not in name:
        return None
    return f"{host!r} is not an address, a host name, 'node' or '0.0.0.0'"


def url_host(host: str) -> str:
    """`host` as a URL takes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


# --------------------------------------------------------------------------- a taken port

TAKEN = "the port is taken (EADDRINUSE)"
_TAKEN_RE = re.compile(r"could not bind \S*?:(\d+): " + re.escape(TAKEN))


class PortTakenError(TierflowError, OSError):
    """A server could not bind its port: another process holds it. `errno` is EADDRINUSE
    and `port` the port; the message names both, and who could not bind it."""

    def __init__(self, message: str, port: int) -> None:
        super().__init__(errno.EADDRINUSE, message)
        self.port = port

    def __str__(self) -> str:
        return str(self.strerror)

    def __reduce__(self) -> tuple[Any, ...]:  # pickled by Ray as (message, port)
        return (type(self), (self.strerror, self.port))


def bind_failure(who: str, host: str, port: int, err: OSError) -> OSError:
    """What a server `who` raises when binding `host`:`port` failed with `err`: a
    `PortTakenError` if another process holds the port, else `err` itself."""
    if err.errno != errno.EADDRINUSE:
        return err
    return PortTakenError(f"{who} could not bind {url_host(host)}:{port}: {TAKEN}", port)


def taken_port(text: str) -> int | None:
    """The port a `bind_failure` message in `text` (an error, a traceback) names, or None."""
    found = _TAKEN_RE.search(text)
    return int(found.group(1)) if found else None
