"""A gateway's JetStream reader whose consumer's server stops answering (a host cut off or
paused) notices it by the missing idle heartbeats and says so, so the feed reopens it on a
server that answers; an idle reader whose server answers is never taken for lost.

A real three-node JetStream cluster; the reader's client is connected to one node, its
consumer (one replica) lives on another, and that node is paused with SIGSTOP: its routes
stay open, so the cluster keeps routing the reader's pull requests to it and nothing
answers, as in a partition.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js.api import StreamConfig

from actors.access.reader import ConsumerLost, JetStreamReader
from runtime.nats.server import NatsCluster, NatsServer

pytestmark = pytest.mark.timeout(180)

STREAM = "hb"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    c = NatsCluster(tmp_path / "nats", nodes=3)
    try:
        c.start(timeout=60)
        yield c
    finally:
        for s in c.servers:
            pid = s.pid
            if pid is not None:  # a paused server must run again to stop
                os.kill(pid, signal.SIGCONT)
        for s in c.servers:
            s.stop()


async def _publish(js: object, start: int, n: int, deadline_s: float = 30.0) -> None:
    """n messages, each retried while the stream elects a leader (bounded)."""
    deadline = time.monotonic() + deadline_s
    for i in range(start, start + n):
        while True:
            try:
                await js.publish(f"{STREAM}.x", str(i).encode(), timeout=2)  # type: ignore[attr-defined]
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)


async def _reader_elsewhere(js: object, avoid: str, start: int) -> tuple[JetStreamReader, str]:
    """A reader whose consumer lives on a server other than `avoid` (placement is the
    cluster's choice: readers are opened until one lands elsewhere, at most 30 tries;
    with a node paused the cluster may first elect a new meta leader, so a request that
    times out is tried again)."""
    for _ in range(30):
        try:
            reader = await JetStreamReader(js, STREAM, start, heartbeat_s=0.5).open()
            info = await js.consumer_info(STREAM, reader.name)  # type: ignore[attr-defined]
        except (TimeoutError, nats.errors.Error, nats.js.errors.Error):
            await asyncio.sleep(0.5)
            continue
        home = info.cluster.leader if info.cluster else None
        if home and home != avoid:
            return reader, home
        await reader.close()
    raise AssertionError(f"no consumer placed off {avoid} in 30 tries")


def test_a_reader_whose_consumer_server_stops_answering_raises_and_reopens_elsewhere(
    cluster: NatsCluster,
) -> None:
    client_server: NatsServer = cluster.servers[0]

    async def run() -> None:
        nc = await nats.connect(client_server.url)
        try:
            js = nc.jetstream()
            await js.add_stream(StreamConfig(name=STREAM, subjects=[f"{STREAM}.>"], num_replicas=3))
            await _publish(js, 0, 10)
            reader, home = await _reader_elsewhere(js, str(client_server.server_name), 1)
            got: list[int] = []
            deadline = time.monotonic() + 20
            while len(got) < 10 and time.monotonic() < deadline:
                got += [m.seq for m in await reader.fetch(10, 1.0)]
            assert got == list(range(1, 11))

            # idle, its server answering: heartbeats keep it alive past 3 missed beats' time
            quiet_until = time.monotonic() + 4.0
            while time.monotonic() < quiet_until:
                assert await reader.fetch(10, 1.0) == []

            paused = cluster.server(home)
            pid = paused.pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            lost: ConsumerLost | None = None
            deadline = time.monotonic() + 30
            while lost is None and time.monotonic() < deadline:
                try:
                    assert await reader.fetch(10, 1.0) == []
                except ConsumerLost as err:
                    lost = err
            assert lost is not None, "the reader kept waiting on a server that does not answer"
            await reader.close()

            # reopened from its position: what is stored meanwhile reaches it. With one
            # server still stopped, a new consumer may answer 503 while its leader is
            # elected: the reader raises it, and its caller reopens from where it is, as the
            # gateway does
            await _publish(js, 10, 5)
            more: list[int] = []
            again: JetStreamReader | None = None
            deadline = time.monotonic() + 30
            while len(more) < 5 and time.monotonic() < deadline:
                try:
                    if again is None:
                        again, _ = await _reader_elsewhere(js, home, 11 + len(more))
                    more += [m.seq for m in await again.fetch(10, 1.0)]
                except (ConsumerLost, nats.js.errors.ServiceUnavailableError):
                    if again is not None:
                        await again.close()
                    again = None
                    await asyncio.sleep(0.2)
            assert more == list(range(11, 16))
            if again is not None:
                await again.close()
        finally:
            await nc.close()

    asyncio.run(run())


def test_a_client_whose_server_stops_answering_moves_to_another_within_its_ping_window(
    cluster: NatsCluster,
) -> None:
    """runtime.nats.server.connect's pings: two missed (3 s apart) and the client reconnects to
    another server of its list, well inside the 30 s a partition's cut server held a
    client with pings every 10 s and three missed."""
    from runtime.nats.server import connect

    async def run() -> None:
        nc = await connect(cluster.url)
        try:
            js = nc.jetstream()
            await js.add_stream(StreamConfig(name=STREAM, subjects=[f"{STREAM}.>"], num_replicas=3))
            first = nc.connected_url.netloc if nc.connected_url else ""
            server = next(s for s in cluster.servers if s.url.endswith(first))
            assert server.pid is not None
            os.kill(server.pid, signal.SIGSTOP)
            paused_at = time.monotonic()
            deadline = paused_at + 20
            while time.monotonic() < deadline:
                now = nc.connected_url.netloc if nc.connected_url else ""
                if nc.is_connected and now != first:
                    break
                await asyncio.sleep(0.2)
            moved = nc.connected_url.netloc if nc.connected_url else ""
            assert moved != first, f"still on the paused server {first} after 20 s"
            await _publish(js, 0, 5)  # and JetStream answers through the new one
        finally:
            await nc.close()

    asyncio.run(run())
