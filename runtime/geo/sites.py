"""Several NATS JetStream sites on one machine: each site a cluster in its own JetStream
domain, the sites joined by leaf node connections (docs/geo.md says why not a supercluster).

Each site is an ordinary `NatsCluster`-shaped group of `NatsServer`s whose nats.conf adds
`jetstream { domain: <site> }` and a `leafnodes {}` block. Every node listens for leaf
connections; the nodes of every site but the first (the hub) dial all of the hub's leaf
ports, so the sites form a star. A leaf connection carries only subjects, never JetStream
state: each site keeps its own meta group, so losing one site never costs another its quorum.
`kill_site` / `start_site` are the fault a site-loss test injects; stores and ports are kept,
so a returning site is the same JetStream peers on the same addresses.

The links are authenticated: every leaf port requires a user and password (`LeafAuth`)
generated per `NatsSites` (so per `nats up --sites` run) and kept in `leaf-auth.json` (0600)
next to sites.json. With `tls` (`[tls]` on, `NatsSites.from_config`) the links run TLS with
the runtime's CA: the dialling side checks the listening side's certificate and name, and
presents the client pair, which the listening side then requires (mutual TLS). A leaf
connection with wrong or no credentials (or no valid certificate) is refused and carries
nothing. `server_opts` (the same client-facing users, TLS and encryption `start_nats`
gives a single server) go to every server unchanged.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import socket
import string
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.nats.server import (
    PORT_ATTEMPTS,
    NatsServer,
    NatsServerError,
    PortChooser,
    _conf_str,
    configured_ports,
    free_ports,
    move_ports,
    port_taken_error,
    taken_ports,
)
from runtime.waiting import poll

if TYPE_CHECKING:
    from runtime.config import Config
    from runtime.tls import TlsFiles

SITES_FILE = "sites.json"
LEAF_AUTH_FILE = "leaf-auth.json"
LEAF_USER = "tierflow-leaf"


@dataclass(frozen=True)
class LeafAuth:
    """The user and password every leaf port requires (one pair for all the sites' links)."""

    user: str = LEAF_USER
    password: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)

    def __post_init__(self) -> None:
        for part in (self.user, self.password):  # they go into nats-leaf://user:pass@host URLs
            if not part or any(c in part for c in ':@/?#%" '):
                raise ValueError("leaf user and password: non-empty, no ':@/?#%\" or spaces")


def stable_ports(n: int, host: str = "127.0.0.1", seed: int | None = None) -> list[int]:
    """`n` distinct free ports *below* the kernel's ephemeral range.

    A site that is killed and restarted must bind its old ports again, while the other
    sites' leaf connections (and clients) keep dialling them. A dial to a dead loopback port
    inside the ephemeral range can be given that very port as its own source port (a TCP
    self-connect), which then holds it: the restart fails with "address already in use"
    (seen in the site-loss scenario). Ports outside the range are never handed out that way.
    A configured range (`$TIERFLOW_PORT_SLICE`, runtime/nats/server.py) is used instead.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    floor = max(1024, low - 16384)
    if (configured := configured_ports()) is not None:
        floor, low = configured.start, configured.stop
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


def _tls_lines(indent: str, files: TlsFiles, *, listen: bool) -> list[str]:
    """A leafnodes `tls {}` block. Listening: the server pair, and `verify` (require the
    dialler's certificate, signed by the CA) when there is a client pair to present.
    Dialling: trust the CA (the listener's name is checked against its certificate) and
    present the client pair when there is one."""

    def path(p: Path | str) -> str:
        return _conf_str(str(Path(p).resolve()))

    mutual = files.client_cert is not None and files.client_key is not None
    lines = [f"{indent}tls {{"]
    if listen:
        lines += [
            f"{indent}  cert_file: {path(files.cert)}",
            f"{indent}  key_file: {path(files.key)}",
        ]
        lines.append(f"{indent}  ca_file: {path(files.ca)}")
        if mutual:
            lines.append(f"{indent}  verify: true")
    else:
        lines.append(f"{indent}  ca_file: {path(files.ca)}")
        if mutual:
            assert files.client_cert is not None and files.client_key is not None
            lines.append(f"{indent}  cert_file: {path(files.client_cert)}")
            lines.append(f"{indent}  key_file: {path(files.client_key)}")
    lines += [f"{indent}  timeout: 2", f"{indent}}}"]
    return lines


def leaf_block(
    listen: str,
    remotes: list[str],
    deny: Sequence[str] = (),
    auth: LeafAuth | None = None,
    tls: TlsFiles | None = None,
) -> list[str]:
    """The `leafnodes {}` block: listen for other sites, and dial the hub's leaf `remotes`
    (host:port) if this site is not the hub. Reconnects are the server's (every second).

    `deny`: subjects the link never carries either way. Without it a stream's subjects are
    interest like any other, and a site's stream would also capture the other site's
    publishes directly (twice stored, origin lost); with it the link carries only
    JetStream's own traffic ($JS.<domain>.API, source consumers' deliveries, replies).

    `auth`: the listener requires this user and password, and the remotes present them.
    `tls`: TLS on the links with the CA of `tls` (see `_tls_lines`). Both None: an open
    link (anyone reaching the leaf port joins the subject space; tests of the old shape)."""
    lines = ["leafnodes {", f"  listen: {_conf_str(listen)}", '  reconnect: "1s"']
    if auth is not None:
        lines += [
            "  authorization {",
            f"    user: {_conf_str(auth.user)}",
            f"    password: {_conf_str(auth.password)}",
            "    timeout: 2",
            "  }",
        ]
    if tls is not None:
        lines += _tls_lines("  ", tls, listen=True)
    if remotes:
        cred = f"{auth.user}:{auth.password}@" if auth is not None else ""
        urls = ", ".join(_conf_str(f"nats-leaf://{cred}{r}") for r in remotes)
        denied = ", ".join(_conf_str(d) for d in deny)
        lines += ["  remotes: [", "    {", f"      urls: [{urls}]"]
        if tls is not None:
            lines += _tls_lines("      ", tls, listen=False)
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
        """Comma-joined client URLs (runtime.nats.server.connect splits them)."""
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
    The leaf links require `auth` (generated here unless given; None leaves them open) and
    run TLS when `tls` is set; `server_opts` are `NatsServer` fields every server gets
    (client-facing users, TLS, encryption: `site_server_options`).
    """

    base_dir: Path
    sites: int = 2
    nodes: int = 3
    sync_interval: str = "always"
    host: str = "127.0.0.1"
    # subjects the sites never exchange over the leaf links: every replicated stream's
    # subjects (see `leaf_block`); runtime/geo/replication.py `link_deny` derives them
    # from the config
    deny: list[str] = field(default_factory=list)
    auth: LeafAuth | None = field(default_factory=LeafAuth)
    tls: TlsFiles | None = None
    server_opts: dict[str, Any] = field(default_factory=dict, repr=False)
    # chooses every port of every site, (n, host) -> ports; default `stable_ports`
    port_chooser: PortChooser | None = field(default=None, repr=False, compare=False)
    members: list[Site] = field(default_factory=list, init=False)
    # True once the sites ran: their ports are known to clients and to each other
    _started: bool = field(default=False, init=False, repr=False, compare=False)
    # ports something outside dials on our behalf (`route_leafs_via`'s proxies): kept
    _pinned: set[int] = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.base_dir = Path(self.base_dir)
        if self.nodes < 1:
            raise ValueError("a site needs at least one node")
        site_names(self.sites)

    @classmethod
    def from_config(cls, cfg: Config, base_dir: Path, sites: int = 2, nodes: int = 3) -> NatsSites:
        """The sites `tierflow nats up --sites` runs for `cfg`: its streams' subjects kept
        off the links, leaf auth generated, and with `[tls]` on TLS for clients and links."""
        from runtime.geo.replication import link_deny

        return cls(
            base_dir=base_dir,
            sites=sites,
            nodes=nodes,
            sync_interval=cfg.nats.sync_interval,
            deny=link_deny(cfg),
            tls=leaf_tls(cfg),
            server_opts=site_server_options(cfg),
        )

    def _leaf(self, listen_port: int, remotes: list[str]) -> list[str]:
        return leaf_block(f"{self.host}:{listen_port}", remotes, self.deny, self.auth, self.tls)

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
        every = (self.port_chooser or stable_ports)(4 * n * self.sites, self.host)
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
                        extra_conf=self._leaf(leaf[j], remotes),
                        **self.server_opts,
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
        self._pinned.update(self.members[0].leaf_ports)  # the proxies forward to these
        for site in self.members[1:]:
            for s, port in zip(site.servers, site.leaf_ports, strict=True):
                s.extra_conf = self._leaf(port, hub_addresses)

    def start(self, timeout: float = 40.0, port_attempts: int = PORT_ATTEMPTS) -> NatsSites:
        """Start every site and wait until each has a JetStream meta leader and the leaf
        connections are up.

        On the first start, a port another process took between its choice and the bind
        is chosen again (`move_ports`: the listener, and every route and leaf remote that
        dials it, in every site) and all the sites start again, up to `port_attempts`
        starts in all. Ports they ran on before, and the hub's leaf ports behind
        `route_leafs_via`, are kept: the error names the port."""
        self.plan()
        for attempt in range(1, port_attempts + 1):
            try:
                for site in self.members:
                    self.start_site(site.name, timeout, wait_leaf=False)
                self.wait_leafs(timeout)
            except NatsServerError as err:
                self.stop()
                taken = taken_ports(str(err))
                if not taken:
                    raise
                kept = self._started or bool(self._pinned.intersection(taken))
                if kept or attempt == port_attempts:
                    why = "served on before, or dialled through a proxy: kept" if kept else ""
                    raise port_taken_error("nats sites", taken, attempt, err, why) from err
                self._move_ports(taken)
                continue
            except BaseException:
                self.stop()
                raise
            self._started = True
            return self
        raise AssertionError("unreachable")

    def _move_ports(self, taken: list[int]) -> None:
        servers = [s for site in self.members for s in site.servers]
        moved = move_ports(servers, taken, self.host, self.port_chooser or stable_ports)
        for site in self.members:
            site.leaf_ports = [moved.get(p, p) for p in site.leaf_ports]

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
        """What sites.json holds: no secret (the leaf password is in `LEAF_AUTH_FILE`)."""
        return {
            "sites": [s.describe() for s in self.members],
            "leaf_auth": LEAF_AUTH_FILE if self.auth is not None else None,
            "leaf_tls": self.tls is not None,
        }

    def write_state(self, path: Path | None = None) -> Path:
        """sites.json: each site's URLs, monitor URLs and pids (what `tierflow site` reads);
        and next to it, 0600 and written first, `leaf-auth.json`: the leaf links' user and
        password. Each file is replaced whole, so a reader never sees half of one."""
        path = Path(path) if path else self.base_dir / SITES_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.auth is not None:
            secret = {"user": self.auth.user, "password": self.auth.password}
            write_private(path.parent / LEAF_AUTH_FILE, json.dumps(secret).encode())
        write_private(path, json.dumps(self.describe(), indent=2).encode(), mode=0o644)
        return path

    def __enter__(self) -> NatsSites:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def write_private(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace `path` (atomically) with a file that has `mode` from its creation on."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)  # whatever the umask
    tmp.replace(path)


def read_leaf_auth(state_dir: Path) -> LeafAuth | None:
    """The leaf credentials `write_state` kept in `state_dir` (None if there are none)."""
    try:
        body = json.loads((Path(state_dir) / LEAF_AUTH_FILE).read_text())
    except (OSError, ValueError):
        return None
    return LeafAuth(user=body["user"], password=body["password"])


def leaf_tls(cfg: Config) -> TlsFiles | None:
    """`[tls]`'s files for the leaf links (None when TLS is off), with the client pair
    found as for clients, or else the one `tierflow certs` wrote: a dialling site presents
    it, so the listening site can require it (mutual TLS)."""
    from runtime.certs import DevCerts
    from runtime.tls import certs_dir, tls_files

    files = tls_files(cfg)
    if files is None or files.client_cert is not None:
        return files
    dev = DevCerts(certs_dir(cfg))
    if dev.client_cert.is_file() and dev.client_key.is_file():
        return replace(files, client_cert=dev.client_cert, client_key=dev.client_key)
    return files


def site_server_options(cfg: Config) -> dict[str, Any]:
    """The client-facing `NatsServer` fields every site's server gets: what `start_nats`
    gives the single embedded server (users or role users, TLS, encryption at rest)."""
    from runtime.nats.roles import server_users
    from runtime.tls import tls_files

    tls = tls_files(cfg)
    return {
        "user": cfg.nats.user or None,
        "password": cfg.nats.password or None,
        "users": server_users(cfg) if cfg.nats.role_users else [],
        "tls_cert": str(tls.cert) if tls else None,
        "tls_key": str(tls.key) if tls else None,
        "tls_ca": str(tls.ca) if tls else None,
        "tls_verify": bool(tls and tls.verify_clients),
        "encryption_key": cfg.nats.encryption_key or None,
        "encryption_cipher": cfg.nats.encryption_cipher,
    }


__all__ = [
    "LEAF_AUTH_FILE",
    "SITES_FILE",
    "LeafAuth",
    "NatsSites",
    "Site",
    "leaf_block",
    "leaf_tls",
    "read_leaf_auth",
    "site_names",
    "site_server_options",
    "stable_ports",
    "write_private",
]
