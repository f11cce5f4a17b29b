"""Scaling each role while data flows: collectors 1 -> 3 -> 1, loggers and bridges
1 -> 2 -> 1, gateways 1 -> 2 -> 1, all under a steady load, nothing lost.

Real nats-server, Ray and LevelDB. The producer keeps sending known ids from before the
first step until after the last; scale-down drains (a collector closes its socket,
finishes its requests, hands its logged batches on; a logger group is emptied into
JetStream; a gateway closes its clients with 1001 after flushing their cursors), so a
client at most retries and every acknowledged id lands once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from cluster.pipeline import CollectionTier, start_collection_tier
from runtime.nats.server import connect
from runtime.waiting import await_until
from tests.support import NatsFactory, assert_all_landed, tier_config, under_load


@pytest.fixture(scope="module")
def tier(
    ray_module: Any, nats_factory: NatsFactory, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    with nats_factory() as server:
        cfg = tier_config(
            tmp_path_factory.mktemp("state"),
            "tf-scaling",
            roles={"collector": {"replicas": 1, "port": 0}},
        )
        t = start_collection_tier(cfg, nats_url=server.url)
        yield t, server
        t.stop()


async def test_collectors_scale_up_and_down_under_load(tier: Any) -> None:
    t, server = tier
    t: CollectionTier
    loop = asyncio.get_running_loop()
    steps: list[list[str]] = []

    async def resize() -> None:
        steps.append(await loop.run_in_executor(None, t.scale, "collector", 3))
        pids = {n: (await t.actor(n).heartbeat.remote())["pid"] for n in steps[-1]}
        assert len(set(pids.values())) == 3  # three live processes share the port
        steps.append(await loop.run_in_executor(None, t.scale, "collector", 1))

    report = await under_load(t, "sc", resize)
    assert steps == [["collector-0", "collector-1", "collector-2"], ["collector-0"]]
    sup = await t.supervisor.status.remote()
    assert sup["children"]["collector-1"]["state"] == "dropped"
    assert sup["children"]["collector-0"]["state"] == "running"
    with pytest.raises(ValueError):
        ray.get(t.actor("collector-1").endpoints.remote(), timeout=5)
    await assert_all_landed(t, server, report)


async def test_loggers_and_bridges_scale_under_load(tier: Any) -> None:
    """Loggers 1 -> 2 -> 1 and bridges 1 -> 2 -> 1: the collectors roll onto each new
    layout, and a leaving logger group is emptied into JetStream before it stops."""
    t, server = tier
    t: CollectionTier
    loop = asyncio.get_running_loop()
    layouts: list[tuple[list[str], list[str]]] = []

    async def resize() -> None:
        for role, n in (("logger", 2), ("bridge", 2), ("bridge", 1), ("logger", 1)):
            await loop.run_in_executor(None, t.scale, role, n)
            layouts.append(([g.name for g in t.loggers], list(t.bridges)))
            # every collector writes to a logger of the layout and names only its bridges
            for name in t.collectors:
                spec = await t.supervisor.child_spec.remote(name)
                assert spec.kwargs["bridges"] == t.bridges
                assert spec.kwargs["logger"].name in layouts[-1][0]

    report = await under_load(t, "lb", resize)
    assert [len(lg) for lg, _ in layouts] == [2, 2, 2, 1]
    assert [len(br) for _, br in layouts] == [1, 2, 1, 1]
    assert layouts[0][0] == ["logger-0", "logger-1"]
    await assert_all_landed(t, server, report)


async def test_gateways_scale_under_load_without_a_gap_for_clients(tier: Any) -> None:
    """Gateways 1 -> 2 -> 1 while events flow and clients read the raw stream: clients on
    the leaving replica are closed with 1001, reconnect to the other and resume by
    cursor; each sees every stored event exactly once, in order, without a gap."""
    from actors.access.client import TierflowClient
    from cluster.deploy.gateway import scale_gateways, start_gateways, stop_gateways

    t, server = tier
    t: CollectionTier
    loop = asyncio.get_running_loop()
    cfg = t.cfg
    names = await loop.run_in_executor(None, lambda: start_gateways(cfg, server.url, 1, 0))
    nc = await connect(server.url)
    clients: list[TierflowClient] = []
    readers: list[asyncio.Future[None]] = []
    try:
        url = (await t.actor(names[0]).endpoints.remote())["url"]
        before = (await nc.jetstream().stream_info("meetup")).state.last_seq
        seen: list[list[int]] = []

        def add_client() -> None:
            client = TierflowClient(url, give_up_after=60)
            got: list[int] = []

            async def read() -> None:
                async for d in client.subscribe("meetup", start=before + 1):
                    got.append(d.seq)

            clients.append(client)
            seen.append(got)
            readers.append(asyncio.ensure_future(read()))

        for _ in range(3):
            add_client()

        async def resize() -> None:
            assert await loop.run_in_executor(None, scale_gateways, cfg, names, 2) == names
            assert names == ["gateway-0", "gateway-1"]

            async def one_on_the_new_replica() -> bool:  # SO_REUSEPORT spreads connections
                if (await t.actor("gateway-1").stats.remote())["open"]["ws"] > 0:
                    return True
                add_client()
                return False

            await await_until(one_on_the_new_replica, 60, 0.3, what="a client on gateway-1")
            assert await loop.run_in_executor(None, scale_gateways, cfg, names, 1) == names
            assert names == ["gateway-0"]

        report = await under_load(t, "gw", resize, rate=600)
        await assert_all_landed(t, server, report)
        last = (await nc.jetstream().stream_info("meetup")).state.last_seq
        want = list(range(before + 1, last + 1))  # only this load wrote since `before`

        async def all_read() -> bool:
            return all(len(got) >= len(want) for got in seen)

        await await_until(all_read, timeout=120, interval=0.3, what="every client caught up")
        for got, client in zip(seen, clients, strict=True):  # each once, in order, no gap
            assert got[: len(want)] == want
            assert client.stats.dropped == 0 and client.stats.aged_out == 0
        assert sum(c.stats.reconnects for c in clients) >= 1  # someone really moved
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        for client in clients:
            await client.close()
        await nc.close()
        await loop.run_in_executor(None, stop_gateways, cfg, names)
