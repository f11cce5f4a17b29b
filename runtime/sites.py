"""Several NATS JetStream sites on one machine: each site a cluster in its own JetStream
domain, the sites joined by leaf node connections (docs/geo.md says why not a supercluster).

Each site is an ordinary `NatsCluster`-shaped group of `NatsServer`s whose nats.conf adds
`jetstream { domain: <site> }` and a `leafnodes {}` block. Every node listens for leaf
connections; the nodes of every site but the first (the hub) dial all of the hub's leaf
ports, so the sites form a star. A leaf connection carries only subjects, never JetStream
state: each site keeps its own meta group, so losing one site never costs another its quorum.
`kill_site` / `start_site` are the fault a site-loss test injects; stores and ports are kept,
so a returning site is the same JetStream peers on the same addresses.
"""

from __future__ import annotations

import json
import random
import socket
import string
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.nats import NatsServer, NatsServerError, _conf_str, free_ports
from runtime.waiting import poll

SITES_FILE = "sites.json"


def stable_ports(n: int, host: str = "127.0.0.1", seed: int | None = None) -> list[int]:
    """`n` distinct free ports *below* the kernel's ephemeral range.

    A site that is killed and restarted must bind its old ports again, while the other
    sites' leaf connections (and clients) keep dialling them. A dial to a dead loopback port
    inside the ephemeral range can be given that very port as its own source port (a TCP
    self-connect), which then holds it: the restart fails with "address already in use"
    (seen in the site-loss scenario). Ports outside the range are never handed out that way.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    floor = max(1024, low - 16384)
    rng = random.Random(seed)
    held: list[socket.socket] = []
    try:
        for _ in range(50 * n):  # bounded
            if len(held) == n:
                break
            port = rng.randrange(floor, low)
            if any(h.getsockname()[1] == port for h in held):
                continue
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                continue
            held.append(sock)
        if len(held) < n:
            return free_ports(n, host)  # a crowded range: fall back to the OS's choice
        return [h.getsockname()[1] for h in held]
    finally:
        for h in held:
            h.close()


def site_names(n: int) -> list[str]:
    """site-a, site-b, ...: the names `nats up --sites N` gives (also their JS domains)."""
    if not 1 <= n <= 26:
        raise ValueError("between 1 and 26 sites")
    return [f"site-{c}" for c in string.ascii_lowercase[:n]]


def leaf_block(listen: str, remotes: list[str], deny: Sequence[str] = ()) -> list[str]:
    """The `leafnodes {}` block: listen for other sites, and dial the hub's leaf `remotes`
    (host:port) if this site is not the hub. Reconnects are the server's (every second).

    `deny`: subjects the link never carries either way. Without it a stream's subjects are
    interest like any other, and a site's stream would also capture the other site's
    publishes directly (twice stored, origin lost); with it the link carries only
    JetStream's own traffic ($JS.<domain>.API, source consumers' deliveries, replies)."""
    lines = ["leafnodes {", f"  listen: {_conf_str(listen)}", '  reconnect: "1s"']
    if remotes:
        urls = ", ".join(_conf_str(f"nats-leaf://{r}") for r in remotes)
        denied = ", ".join(_conf_str(d) for d in deny)
        lines += ["  remotes: [", "    {", f"      urls: [{urls}]"]
        if deny:
            lines += [f"      deny_imports: [{denied}]", f"      deny_exports: [{denied}]"]
        lines += ["    }", "  ]"]
    lines.append("}")
    return lines


@dataclass
class Site:
    """One site: a JetStream cluster (or a single server) in its own domain."""

    name: str
    servers: list[NatsServer]
    leaf_ports: list[int]

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        """Comma-joined client URLs (runtime.nats.connect splits them)."""
        return ",".join(self.urls)

    @property
    def running(self) -> bool:
        return any(s.running for s in self.servers)

    @property
    def pids(self) -> list[int]:
        return [s.pid for s in self.servers if s.pid is not None]

    def meta_ready(self) -> bool:
        """Every node up, in this site's domain, agreeing on one JetStream meta leader."""
        leaders = set()
        for s in self.servers:
            if not s.running:
                return False
            status, body = s.monitor("jsz")
            if status != 200 or not isinstance(body, dict):
                return False
            if len(self.servers) == 1:
                leaders.add(s.server_name)
                continue
            meta = body.get("meta_cluster") or {}
            if not meta.get("leader") or meta.get("cluster_size", 0) < len(self.servers):
                return False
            leaders.add(meta["leader"])
        return len(leaders) == 1

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "domain": self.name,
            "urls": self.urls,
            "monitor": [s.monitor_url for s in self.servers],
            "leaf_ports": self.leaf_ports,
            "pids": self.pids,
        }


@dataclass
class NatsSites:
    """`sites` JetStream domains of `nodes` servers each on loopback, joined by leaf nodes.

    Start, kill and restart only the processes it started (their pids are in `describe()`).
    """

    base_dir: Path
    sites: int = 2
    nodes: int = 3
    sync_interval: str = "always"
    host: str = "127.0.0.1"
    # subjects the sites never exchange over the leaf links: every replicated stream's
    # subjects (see `leaf_block`); runtime/geo.py `link_deny` derives them from the config
    deny: list[str] = field(default_factory=list)
    members: list[Site] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.base_dir = Path(self.base_dir)
        if self.nodes < 1:
            raise ValueError("a site needs at least one node")
        site_names(self.sites)

    def site(self, name: str) -> Site:
        for s in self.members:
            if s.name == name:
                return s
        raise KeyError(f"no site {name!r} (sites: {[s.name for s in self.members]})")

    def _build(self) -> None:
        n = self.nodes
        hub_leaf: list[int] = []
        # every port of every site in one call: chosen per site, a later site could be
        # handed a port an earlier one chose but has not bound yet
        every = stable_ports(4 * n * self.sites, self.host)
        for i, name in enumerate(site_names(self.sites)):
            ports = every[4 * n * i : 4 * n * (i + 1)]
            client, monitor, route, leaf = (ports[k * n : (k + 1) * n] for k in range(4))
            if i == 0:
                hub_leaf = leaf
            remotes = [] if i == 0 else [f"{self.host}:{p}" for p in hub_leaf]
            servers = []
            for j in range(n):
                routes = [f"nats-route://{self.host}:{p}" for k, p in enumerate(route) if k != j]
                servers.append(
                    NatsServer(
                        store_dir=self.base_dir / name / f"n{j + 1}",
                        host=self.host,
                        port=client[j],
                        monitor_port=monitor[j],
                        sync_interval=self.sync_interval,
                        server_name=f"{name}-n{j + 1}",
                        cluster_name=name if n > 1 else None,
                        cluster_port=route[j] if n > 1 else 0,
                        routes=routes if n > 1 else [],
                        js_domain=name,
                        extra_conf=leaf_block(f"{self.host}:{leaf[j]}", remotes, self.deny),
                    )
                )
            self.members.append(Site(name, servers, leaf))

    def plan(self) -> NatsSites:
        """Choose every port and write nothing (what `start` does first); idempotent."""
        if not self.members:
            self._build()
        return self

    def route_leafs_via(self, hub_addresses: list[str]) -> None:
        """Make the other sites dial the hub through these host:port (e.g. fault proxies
        in front of `members[0].leaf_ports`) instead of directly; before `start`."""
        self.plan()
        for site in self.members[1:]:
            for s, port in zip(site.servers, site.leaf_ports, strict=True):
                s.extra_conf = leaf_block(f"{self.host}:{port}", hub_addresses, self.deny)

    def start(self, timeout: float = 40.0) -> NatsSites:
        """Start every site and wait until each has a JetStream meta leader and the leaf
        connections are up."""
        self.plan()
        try:
            for site in self.members:
                self.start_site(site.name, timeout, wait_leaf=False)
            self.wait_leafs(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start_site(self, name: str, timeout: float = 40.0, wait_leaf: bool = True) -> Site:
        """(Re)start one site's servers on their old ports and stores; wait for its meta
        leader (and, with `wait_leaf`, for its leaf connections to the other sites)."""
        site = self.site(name)
        deadline = time.monotonic() + timeout
        for s in site.servers:
            s._spawn()
        try:
            for s in site.servers:
                s._wait_ready(deadline)

            def alive() -> None:
                for s in site.servers:
                    s._check_alive()

            if not poll(site.meta_ready, deadline - time.monotonic(), 0.1, on_tick=alive):
                tails = "\n".join(f"--- {s.server_name}:\n{s.log_tail(1500)}" for s in site.servers)
                raise NatsServerError(f"site {name}: no JetStream meta leader\n{tails}")
            if wait_leaf:
                self.wait_leafs(deadline - time.monotonic())
        except BaseException:
            for s in site.servers:
                s.stop()
            raise
        return site

    def leafs_up(self) -> bool:
        """Every running non-hub site has a leaf connection from each of its running nodes."""
        hub = self.members[0]
        if not hub.running:
            return True
        for site in self.members[1:]:
            for s in site.servers:
                if not s.running:
                    continue
                status, body = s.monitor("leafz")
                if status != 200 or not (body or {}).get("leafnodes"):
                    return False
        return True

    def wait_leafs(self, timeout: float) -> None:
        if not poll(self.leafs_up, max(0.0, timeout), 0.1):
            raise NatsServerError(f"leaf connections between sites not up after {timeout:.0f}s")

    def kill_site(self, name: str) -> list[int]:
        """SIGKILL every server of a site (the site is lost); returns the pids killed."""
        site = self.site(name)
        pids = site.pids
        for s in site.servers:
            s.kill()
        return pids

    def stop(self) -> None:
        """Stop every server we started. Idempotent."""
        for site in self.members:
            for s in site.servers:
                s.stop()

    def describe(self) -> dict[str, Any]:
        return {"sites": [s.describe() for s in self.members]}

    def write_state(self, path: Path | None = None) -> Path:
        """sites.json: each site's URLs, monitor URLs and pids (what `tierflow site` reads)."""
        path = Path(path) if path else self.base_dir / SITES_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.describe(), indent=2))
        return path

    def __enter__(self) -> NatsSites:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["SITES_FILE", "NatsSites", "Site", "leaf_block", "site_names", "stable_ports"]
