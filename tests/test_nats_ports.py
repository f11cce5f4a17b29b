"""Ports are chosen free and bound a moment later: a nats-server (alone, in a cluster, in
leaf-linked sites) whose chosen port another process took in between starts again on a new
one, with every peer pointed at it; a port it was given, or served on before, is kept and
the error names it. Each start here is handed the taken port as its first choice through
its `port_chooser`, so the race is certain, not luck.

Also the free-port chooser's range: below the kernel's ephemeral range, or the range
`$TIERFLOW_PORT_SLICE` gives (conftest gives each pytest-xdist worker its own part).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.js.api import StreamConfig

import runtime.nats.server as rn
from runtime.geo.sites import NatsSites
from runtime.nats.server import NatsCluster, NatsServer, NatsServerError, connect, free_ports
from runtime.waiting import await_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def taken() -> Iterator[int]:
    """A port bound and listened on by this test: nobody else can bind it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


class FirstChoice:
    """A port chooser whose first answer has `taken` at index `at` (the race lost once):
    free ports otherwise. `calls` counts the ports each call asked for."""

    def __init__(self, taken: int, at: int = 0) -> None:
        self.taken, self.at = taken, at
        self.calls: list[int] = []

    def __call__(self, n: int, host: str = "127.0.0.1") -> list[int]:
        ports = free_ports(n, host)  # never `taken`: it is bound
        if not self.calls:
            ports[self.at] = self.taken
        self.calls.append(n)
        return ports


async def _serves(url: str, replicas: int = 1, stream: str = "PORTS") -> None:
    """A JetStream stream made through `url` takes an acknowledged publish."""
    nc = await connect(url)
    try:
        js = nc.jetstream(timeout=10)
        config = StreamConfig(name=stream, subjects=[f"{stream.lower()}.>"], num_replicas=replicas)
        await await_until(lambda: js.add_stream(config), 30, 0.2, "the stream", swallow=True)
        ack = await js.publish(f"{stream.lower()}.x", b"x", timeout=10)
        assert ack.stream == stream and ack.seq == 1
    finally:
        await nc.close()


# --------------------------------------------------------------------------- one server


@pytest.mark.parametrize("listener", ["port", "monitor_port"])
async def test_a_server_whose_chosen_port_was_taken_starts_on_new_ports(
    taken: int, tmp_path: Path, listener: str
) -> None:
    at = 0 if listener == "port" else 1  # `_resolve_ports` chooses client, then monitor
    chooser = FirstChoice(taken, at)
    server = NatsServer(store_dir=tmp_path / "n", port_chooser=chooser)
    try:
        server.start(timeout=20)
        assert server.running and taken not in (server.port, server.monitor_port)
        assert len(chooser.calls) == 2  # both chosen, then the taken one again
        log = server.log_path.read_text()
        assert f"127.0.0.1:{taken}: bind: {rn.PORT_TAKEN}" in log  # the first start did fail
        await _serves(server.url)
        # ports are fixed once served on: a restart comes back on the same ones
        before = (server.port, server.monitor_port)
        server.restart()
        assert (server.port, server.monitor_port) == before
    finally:
        server.stop()


def test_a_server_given_a_taken_port_fails_saying_so(taken: int, tmp_path: Path) -> None:
    server = NatsServer(store_dir=tmp_path / "n", port=taken)
    with pytest.raises(NatsServerError, match=rn.PORT_TAKEN) as err:
        server.start(timeout=20)
    assert f"port {taken} is taken" in str(err.value) and "after 1 start(s)" in str(err.value)
    assert "Error listening on port" in str(err.value)  # the server's own words
    assert not server.running


def test_a_restart_keeps_the_ports_clients_know(tmp_path: Path) -> None:
    server = NatsServer(store_dir=tmp_path / "n").start(timeout=20)
    port = server.port
    server.stop()
    with socket.socket() as s:  # another process takes it while the server is down
        s.bind(("127.0.0.1", port))
        s.listen()
        with pytest.raises(NatsServerError, match=f"port {port} is taken"):
            server.start(timeout=20)
    assert server.port == port and not server.running


def test_a_port_taken_every_time_gives_up_after_the_bounded_starts(tmp_path: Path) -> None:
    held: list[socket.socket] = []

    def lost_each_race(n: int, host: str = "127.0.0.1") -> list[int]:
        s = socket.socket()  # another process takes the first port of each choice
        held.append(s)
        s.bind((host, 0))
        s.listen()
        return [s.getsockname()[1], *free_ports(n - 1, host)]

    server = NatsServer(store_dir=tmp_path / "n", port_chooser=lost_each_race)
    try:
        with pytest.raises(NatsServerError, match=rn.PORT_TAKEN) as err:
            server.start(timeout=20, port_attempts=3)
        last = held[-1].getsockname()[1]
        assert len(held) == 3 and f"port {last} is taken" in str(err.value)
        assert "after 3 start(s)" in str(err.value)
        assert not server.running
    finally:
        for s in held:
            s.close()


# --------------------------------------------------------------------------- groups


def _routes_point_at_peers(cluster_ports: list[int], routes: list[list[str]]) -> None:
    for i, own in enumerate(routes):
        peers = [p for j, p in enumerate(cluster_ports) if j != i]
        assert own == [f"nats-route://127.0.0.1:{p}" for p in peers]


async def test_a_cluster_node_whose_route_port_was_taken_moves_and_its_peers_follow(
    taken: int, tmp_path: Path
) -> None:
    # `_build` chooses 3 client, 3 monitor, then 3 route ports: n2's route port is taken
    chooser = FirstChoice(taken, at=7)
    cluster = NatsCluster(tmp_path / "c", nodes=3, port_chooser=chooser)
    try:
        cluster.start(timeout=60)
        ports = [s.cluster_port for s in cluster.servers]
        assert taken not in ports and len(chooser.calls) == 2
        assert f"127.0.0.1:{taken}: bind" in cluster.servers[1].log_path.read_text()
        _routes_point_at_peers(ports, [s.routes for s in cluster.servers])
        assert all(taken not in s.addressed_ports() for s in cluster.servers)
        assert cluster.meta_leader() is not None  # the three found each other
        await _serves(cluster.url, replicas=3)
    finally:
        cluster.stop()


async def test_sites_whose_hub_leaf_port_was_taken_link_on_a_new_one(
    taken: int, tmp_path: Path
) -> None:
    # per site: client, monitor, route, leaf ports (one node each): the hub's leaf port
    chooser = FirstChoice(taken, at=3)
    sites = NatsSites(tmp_path / "s", sites=2, nodes=1, auth=None, port_chooser=chooser)
    try:
        sites.start(timeout=60)
        hub, leaf = sites.site("site-a"), sites.site("site-b")
        assert taken not in hub.leaf_ports and len(chooser.calls) == 2
        assert f"127.0.0.1:{taken}: bind" in hub.servers[0].log_path.read_text()
        remote = f"nats-leaf://127.0.0.1:{hub.leaf_ports[0]}"
        assert remote in "\n".join(leaf.servers[0].extra_conf)  # B dials the new port
        assert sites.leafs_up()
        await _serves(hub.url, stream="HUB")
        await _serves(leaf.url, stream="LEAF")
        nc = await connect(hub.url)  # the link carries B's JetStream API to A's clients
        try:
            assert (await nc.request("$JS.site-b.API.INFO", b"", timeout=5)).data
        finally:
            await nc.close()
    finally:
        sites.stop()


def test_a_proxied_hub_leaf_port_that_was_taken_is_kept_and_named(
    taken: int, tmp_path: Path
) -> None:
    sites = NatsSites(tmp_path / "s", sites=2, nodes=1, port_chooser=FirstChoice(taken, at=3))
    sites.route_leafs_via(["127.0.0.1:1"])  # a proxy forwards to the hub's leaf port
    with pytest.raises(NatsServerError, match=f"port {taken} is taken") as err:
        sites.start(timeout=30)
    assert "proxy" in str(err.value) and "Error listening on leafnode port" in str(err.value)
    assert not any(s.running for site in sites.members for s in site.servers)


# --------------------------------------------------------------------------- the parts


FATAL_LINES = {
    "client": 'Error listening on port: 127.0.0.1:4101, "listen tcp 127.0.0.1:4101: bind: '
    'address already in use"',
    "monitor": "Can't start monitoring: can't listen to the monitor port: listen tcp "
    "127.0.0.1:4102: bind: address already in use",
    "cluster": "Error listening on router port: 4103 - listen tcp 127.0.0.1:4103: bind: "
    "address already in use",
    "leafnode": "Error listening on leafnode port: 4104 - listen tcp [::1]:4104: bind: "
    "address already in use",
}


@pytest.mark.unit
def test_taken_ports_are_read_from_the_servers_fatal_line() -> None:
    """nats-server 2.x's own lines, one per listener."""
    for i, line in enumerate(FATAL_LINES.values()):
        assert rn.taken_ports(f"[1] 2026/01/01 [INF] ready?\n[1] [FTL] {line}\n") == [4101 + i]
    assert rn.taken_ports("\n".join(FATAL_LINES.values())) == [4101, 4102, 4103, 4104]
    assert rn.taken_ports("[FTL] Can't start JetStream: no space left") == []


@pytest.mark.unit
def test_moving_a_port_rewrites_every_mention_of_it_and_nothing_else(tmp_path: Path) -> None:
    a = NatsServer(
        store_dir=tmp_path,
        port=4101,
        monitor_port=4102,
        cluster_name="c",
        cluster_port=4103,
        routes=["nats-route://127.0.0.1:4113", "nats-route://127.0.0.1:41030"],
        extra_conf=['leafnodes { listen: "127.0.0.1:4103" }', '  urls: ["x@127.0.0.1:4103"]'],
    )
    b = NatsServer(store_dir=tmp_path, port=4111, monitor_port=4112, routes=[a.cluster_url])
    moved = rn.move_ports([a, b], [4103], "127.0.0.1", lambda n, host: [4103, 41030, 4999][:n])
    assert moved == {4103: 4999}  # none the group already names
    assert a.cluster_port == 4999 and b.routes == ["nats-route://127.0.0.1:4999"]
    assert a.routes == ["nats-route://127.0.0.1:4113", "nats-route://127.0.0.1:41030"]
    leaf = ['leafnodes { listen: "127.0.0.1:4999" }', '  urls: ["x@127.0.0.1:4999"]']
    assert a.extra_conf == leaf
    assert (a.port, a.monitor_port, b.port) == (4101, 4102, 4111)


@pytest.mark.unit
def test_each_pytest_worker_chooses_ports_from_its_own_share() -> None:
    from tests.conftest import _port_slice

    both = {"PYTEST_XDIST_WORKER_COUNT": "2"}
    quiet = range(20000, 32768)
    assert _port_slice({**both, "PYTEST_XDIST_WORKER": "gw0"}, quiet) == "20000-26383"
    assert _port_slice({**both, "PYTEST_XDIST_WORKER": "gw1"}, quiet) == "26384-32767"
    assert _port_slice({}, quiet) is None  # one process: the whole range
    assert _port_slice({**both, "PYTEST_XDIST_WORKER": "gw0"}, range(0)) is None
    for worker in ("gw0", "gw1"):  # what the product reads back
        spec = _port_slice({**both, "PYTEST_XDIST_WORKER": worker}, quiet)
        assert spec is not None
        part = rn.parse_port_range(spec)
        assert part is not None and len(part) == 6384 and set(part) <= set(quiet)
    # ...and the variable is no config key (TIERFLOW_* are settings otherwise)
    from runtime.config import NOT_CONFIG_KEYS, load

    assert rn.PORT_SLICE_ENV in NOT_CONFIG_KEYS
    load(environ={rn.PORT_SLICE_ENV: "20000-26383"})


@pytest.mark.unit
def test_free_ports_come_from_below_the_ephemeral_range_or_the_configured_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port the kernel hands out for port 0 can go to an outgoing connection before its
    server binds it (a collector failed that way); ports below the ephemeral range cannot."""
    ranges = tmp_path / "range"
    ranges.write_text("32768\t60999\n")
    assert rn.quiet_ports(ranges) == range(rn.QUIET_PORTS_FROM, 32768)
    ranges.write_text("1024 65535\n")
    assert len(rn.quiet_ports(ranges)) == 0
    assert len(rn.quiet_ports(tmp_path / "missing")) == 0
    assert rn.parse_port_range("20000-20009") == range(20000, 20010)
    for junk in ("", "1/2", "9-8", "0-10", "10-70000", "a-b"):
        assert rn.parse_port_range(junk) is None

    def bindable(ports: list[int]) -> None:
        for p in ports:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", p))

    monkeypatch.delenv(rn.PORT_SLICE_ENV, raising=False)
    ports = free_ports(5)
    assert len(set(ports)) == 5
    if len(rn.quiet_ports()):
        assert all(p in rn.quiet_ports() for p in ports)
    bindable(ports)
    low = free_ports(1)[0]  # a free port, then the 40 above it as this process's range
    monkeypatch.setenv(rn.PORT_SLICE_ENV, f"{low}-{low + 40}")
    assert rn.port_range() == range(low, low + 41)
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(low <= p <= low + 40 for p in ports)
    bindable(ports)


@pytest.mark.unit
def test_the_sites_stable_ports_keep_to_the_configured_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from runtime.geo.sites import stable_ports

    low = free_ports(1)[0]
    monkeypatch.setenv(rn.PORT_SLICE_ENV, f"{low}-{low + 60}")
    ports = stable_ports(8)
    assert len(set(ports)) == 8 and all(low <= p <= low + 60 for p in ports)
