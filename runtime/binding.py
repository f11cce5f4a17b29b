"""Where a role's server listens and the address it gives others (`roles.<role>.host`).

- ``"127.0.0.1"`` (the default): loopback, one machine;
- ``"node"``: the address of the Ray node the actor runs on, which is also what it
  advertises: the form for a cluster, where every host runs the same config;
- ``"0.0.0.0"`` / ``"::"``: every address of the host; it advertises the node's address;
- any other address or name: that one, advertised as it is.

Pure: the node's address is passed in (`ray.util.get_node_ip_address()` in an actor).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["NODE", "WILDCARDS", "Binding", "check_host", "resolve", "url_host"]

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
