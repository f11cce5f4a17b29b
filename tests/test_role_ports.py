"""A role's replicas share one port, fixed before any of them binds it: when another process
takes a port tierflow chose, the role starts again on a new one; a port it was given (the
config's) that is taken fails at once, naming the port and the role.

Each start is handed a port this test holds listening as its first choice, through the
`port_chooser` hook, so the race is certain, not luck. The unit tests below check the
pieces without engines: the bind error an actor raises, how the starter reads it from the
text of the actor's death, and `deploy_on_port`'s retries.
"""

from __future__ import annotations

import errno
import pickle
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import cluster.deploy.deployer as deployer
from cluster.deploy.deployer import deploy_on_port
from cluster.deploy.gateway import start_gateways, stop_gateways, wait_gateway
from cluster.pipeline import start_collection_tier
from runtime.binding import PortTakenError, bind_failure, taken_port
from runtime.loop_thread import LoopThread
from runtime.nats.server import PORT_ATTEMPTS, NatsServer, free_ports
from tests.support import tier_config

NS = "tf-role-ports"


@pytest.fixture
def taken() -> Iterator[int]:
    """A port bound and listened on by this test, without SO_REUSEPORT: nobody else can
    bind it, a replica binding with SO_REUSEPORT included."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


class FirstChoice:
    """A port chooser whose first answer is `taken` (the race lost once), free ports
    after; `calls` counts its calls."""

    def __init__(self, taken: int) -> None:
        self.taken = taken
        self.calls = 0

    def __call__(self, n: int, host: str = "127.0.0.1") -> list[int]:
        self.calls += 1
        ports = free_ports(n, host)  # never `taken`: it is bound
        if self.calls == 1:
            ports[0] = self.taken
        return ports


# --------------------------------------------------------------------------- unit


@pytest.mark.unit
def test_a_taken_port_is_a_port_taken_error_the_starter_reads_back() -> None:
    err = bind_failure("collector-0", "127.0.0.1", 23456, OSError(errno.EADDRINUSE, "in use"))
    assert isinstance(err, PortTakenError) and isinstance(err, OSError)
    assert err.errno == errno.EADDRINUSE and err.port == 23456
    assert "collector-0" in str(err) and "23456" in str(err)
    again = pickle.loads(pickle.dumps(err))  # Ray pickles an actor's creation error
    assert (type(again), again.errno, again.port, str(again)) == (
        PortTakenError,
        errno.EADDRINUSE,
        23456,
        str(err),
    )
    # what Ray gives the caller: the actor's death, with the traceback as text
    death = f"The actor died because of an error raised in its creation task\n  ...\n{err!r}"
    assert taken_port(death) == 23456
    assert taken_port(str(bind_failure("gateway-0", "::", 8080, err))) == 8080
    assert taken_port("OSError: [Errno 98] Address already in use") is None
    other = OSError(errno.EACCES, "denied")
    assert bind_failure("gateway-0", "0.0.0.0", 80, other) is other


@pytest.mark.unit
def test_a_loop_thread_raises_a_tierflow_error_as_it_is() -> None:
    async def bind(stop: Any, ready: Any) -> None:
        raise bind_failure("gw", "127.0.0.1", 1234, OSError(errno.EADDRINUSE, "in use"))

    with pytest.raises(PortTakenError) as got:
        LoopThread("ports").start(bind, 5.0)
    assert got.value.port == 1234

    async def broken(stop: Any, ready: Any) -> None:
        raise KeyError("x")

    with pytest.raises(RuntimeError, match="broken-thread"):
        LoopThread("broken-thread").start(broken, 5.0)


class FakeDeploy:
    """`deploy` whose roles find each port in `taken` taken."""

    def __init__(self, taken: set[int]) -> None:
        self.taken = taken
        self.ports: list[int] = []

    def __call__(self, specs: list[int], **_: Any) -> list[str]:
        (port,) = specs
        self.ports.append(port)
        if port in self.taken:
            raise PortTakenError(f"collector-0 could not bind port {port}: it is taken", port)
        return [f"on {port}"]


@pytest.mark.unit
def test_a_chosen_port_taken_is_chosen_again(monkeypatch: pytest.MonkeyPatch, taken: int) -> None:
    fake = FakeDeploy({taken})
    monkeypatch.setattr(deployer, "deploy", fake)
    chooser = FirstChoice(taken)
    got, port = deploy_on_port(
        lambda p: [p], role="collector", port=0, namespace="x", state_dir="x", chooser=chooser
    )
    assert fake.ports == [taken, port] and port != taken
    assert got == [f"on {port}"] and chooser.calls == 2


@pytest.mark.unit
def test_a_given_port_taken_fails_naming_it_and_the_role(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeDeploy({8080})
    monkeypatch.setattr(deployer, "deploy", fake)
    with pytest.raises(PortTakenError, match=r"gateway: port 8080 is taken.*roles.gateway.port"):
        deploy_on_port(
            lambda p: [p],
            role="gateway",
            port=8080,
            given="it is roles.gateway.port in the config",
            namespace="x",
            state_dir="x",
        )
    assert fake.ports == [8080]  # no other tried


@pytest.mark.unit
def test_chosen_ports_taken_every_time_give_up_after_the_attempts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Every:
        def __init__(self) -> None:
            self.ports: list[int] = []

        def __call__(self, specs: list[int], **_: Any) -> list[str]:
            self.ports.append(specs[0])
            raise PortTakenError("taken", specs[0])

    fake = Every()
    monkeypatch.setattr(deployer, "deploy", fake)
    with pytest.raises(PortTakenError, match=rf"collector: port \d+ is taken.*{PORT_ATTEMPTS}"):
        deploy_on_port(lambda p: [p], role="collector", port=0, namespace="x", state_dir="x")
    assert len(set(fake.ports)) == PORT_ATTEMPTS  # a new port each start


# --------------------------------------------------------------------------- Ray


@pytest.fixture
def cfg(tmp_path: Path) -> Any:
    return tier_config(
        tmp_path / "state",
        NS,
        roles={
            "logger": {"k": 0},
            "collector": {"replicas": 2, "port": 0},
            "bridge": {"replicas": 1},
            "gateway": {"replicas": 2, "port": 0},
        },
    )


async def _get(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status


async def test_a_collection_tier_whose_chosen_port_was_taken_serves_on_another(
    ray_module: Any, nats_server: NatsServer, cfg: Any, taken: int
) -> None:
    import asyncio

    chooser = FirstChoice(taken)
    tier = await asyncio.to_thread(
        start_collection_tier, cfg, nats_url=nats_server.url, port_chooser=chooser
    )
    try:
        assert chooser.calls == 2 and tier.collector_port not in (0, taken)
        body = b'[{"id": "ports-1", "v": 1}]'
        url = f"{tier.url}/v1/streams/meetup/events"
        async with (
            aiohttp.ClientSession() as s,
            s.post(url, data=body, headers={"Content-Type": "application/json"}) as r,
        ):
            answer = await r.json()
            assert r.status == 200, answer
            assert answer["ids"] == ["ports-1"]
        for name in tier.collectors:  # both replicas on the one port
            assert tier.wait_serving(name)["port"] == tier.collector_port
    finally:
        await asyncio.to_thread(tier.stop)


async def test_gateways_whose_chosen_port_was_taken_serve_on_another(
    ray_module: Any, nats_server: NatsServer, cfg: Any, taken: int
) -> None:
    import asyncio

    chooser = FirstChoice(taken)
    names = await asyncio.to_thread(
        start_gateways, cfg, nats_server.url, port=0, port_chooser=chooser
    )
    try:
        ports = {wait_gateway(cfg, n)["port"] for n in names}
        assert len(names) == 2 and len(ports) == 1 and taken not in ports
        assert chooser.calls == 2
        assert await _get(f"http://127.0.0.1:{ports.pop()}/healthz") == 200
    finally:
        await asyncio.to_thread(stop_gateways, cfg, names)


def test_a_configured_port_that_is_taken_fails_naming_it(
    ray_module: Any, nats_server: NatsServer, tmp_path: Path, taken: int
) -> None:
    import ray

    cfg = tier_config(
        tmp_path / "state",
        NS,
        roles={"logger": {"k": 0}, "gateway": {"replicas": 1, "port": taken}},
    )
    with pytest.raises(PortTakenError) as got:
        start_gateways(cfg, nats_server.url, timeout_s=60)
    message = str(got.value)
    assert f"port {taken} is taken" in message and "gateway" in message, message
    assert "roles.gateway.port" in message and got.value.port == taken
    with pytest.raises(ValueError):  # nothing left behind: no supervisor starting it again
        ray.get_actor("gateways", namespace=NS)

    cfg = tier_config(
        tmp_path / "state2",
        NS,
        roles={"logger": {"k": 0}, "collector": {"replicas": 1, "port": taken}},
    )
    with pytest.raises(PortTakenError, match=rf"collector: port {taken} is taken.*collector.port"):
        start_collection_tier(cfg, nats_url=nats_server.url)
    with pytest.raises(ValueError):
        ray.get_actor("collection", namespace=NS)
