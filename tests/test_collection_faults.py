"""Collection tier under queue outages and logger disk loss (real NATS, Ray, LevelDB).

Its own tier: a small log bound (so backpressure shows), two collector replicas sharing
one port with SO_REUSEPORT, and a NATS server these tests stop and restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import pytest

from cluster.loadgen import drive, known_events
from cluster.pipeline import CollectionTier, start_collection_tier
from cluster.verify import judge, stream_ids
from runtime.config import load
from runtime.nats.server import NatsServer, connect
from runtime.waiting import await_until
from tests.support import tier_config

NS = "tf-faults"
BOUND = 3000  # events the log holds before it refuses (503 + Retry-After)
OUTAGE_S = 10.0  # the scenario: NATS fully down for 10 s


@pytest.fixture(scope="module")
def tier(
    ray_module: Any, nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CollectionTier]:
    cfg = tier_config(
        tmp_path_factory.mktemp("state"),
        NS,
        roles={"collector": {"replicas": 2}},
        logging={"max_pending_events": BOUND},
    )
    t = start_collection_tier(cfg, nats_url=nats_server.url)
    yield t
    t.stop()


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def own_tier(
    nats_server: NatsServer, state: Path, namespace: str, overrides: dict[str, Any], **kwargs: Any
) -> AsyncIterator[CollectionTier]:
    """A throwaway tier with its own config, started and stopped off the event loop."""
    cfg = load(
        environ={},
        overrides={"state_dir": str(state), "ray": {"namespace": namespace}, **overrides},
    )
    loop = asyncio.get_running_loop()
    t = await loop.run_in_executor(
        None, lambda: start_collection_tier(cfg, nats_url=nats_server.url, **kwargs)
    )
    try:
        yield t
    finally:
        await loop.run_in_executor(None, t.stop)


async def verdict_after_drain(
    tier: CollectionTier, nats_server: NatsServer, acked: set[str]
) -> None:
    async def empty() -> bool:
        c = await tier.loggers[0].counts()
        return c["transient"] == 0 and c["failed"] == 0

    await await_until(empty, timeout=120, interval=0.5, what="log drained", swallow=True)
    nc = await connect(nats_server.url)
    try:
        verdict = judge(acked, await stream_ids(nc, "meetup"))
    finally:
        await nc.close()
    assert verdict.ok, str(verdict)


async def test_two_collectors_share_one_port(tier: CollectionTier) -> None:
    import ray

    eps = [ray.get(tier.actor(n).endpoints.remote(), timeout=30) for n in tier.collectors]
    assert len(eps) == 2 and eps[0]["port"] == eps[1]["port"] == tier.collector_port


async def test_nats_down_10s_backpressure_then_drain(
    tier: CollectionTier, nats_server: NatsServer
) -> None:
    events = known_events(10_000, "down")
    outage: dict[str, Any] = {}

    async def fault() -> None:
        nats_server.kill()
        outage["down"] = True
        await asyncio.sleep(OUTAGE_S)  # the scenario's length, not a wait for a result
        nats_server.restart()

    def on_batch(idx: int) -> None:
        if idx == 10 and "task" not in outage:
            outage["task"] = asyncio.ensure_future(fault())

    report = await drive(
        tier.url, "meetup", events, batch=100, concurrency=4, on_batch=on_batch, deadline_s=240
    )
    await outage["task"]
    assert outage["down"]
    assert len(report.acknowledged) == len(events)
    # The log filled to its bound while JetStream was away and refused the rest (503),
    # which the producer retried with the same ids.
    assert report.refused > 0
    await verdict_after_drain(tier, nats_server, report.acknowledged)


async def test_logger_replica_lost_with_its_disk_is_replaced_and_caught_up(
    tier: CollectionTier, nats_server: NatsServer
) -> None:
    group = tier.loggers[0]
    statuses = await group.status()
    backup = 1 - group.primary
    victim = statuses[backup]
    nats_server.kill()  # hold events in the log so the copy has something to carry
    try:
        first = await drive(tier.url, "meetup", known_events(1500, "disk-a"), batch=100)
        assert len(first.acknowledged) == 1500
        shutil.rmtree(victim["path"])
        os.kill(victim["pid"], signal.SIGKILL)

        async def healed() -> bool:
            st = (await group.status())[backup]
            return "error" not in st and st["pid"] != victim["pid"] and not st["catching_up"]

        await await_until(healed, timeout=120, interval=0.5, what="replica caught up", swallow=True)
        primary_counts = await group.counts(group.primary)
        backup_counts = await group.counts(backup)
        held = primary_counts["transient"] + primary_counts["failed"]
        assert held >= 1500
        assert backup_counts["transient"] + backup_counts["failed"] == held
        # Writes after the loss reach both replicas again.
        second = await drive(tier.url, "meetup", known_events(500, "disk-b"), batch=100)
        assert len(second.acknowledged) == 500
    finally:
        if not nats_server.running:
            nats_server.restart()
    await verdict_after_drain(tier, nats_server, first.acknowledged | second.acknowledged)


async def test_full_log_tells_websocket_producers_to_slow_down(
    tier: CollectionTier, nats_server: NatsServer
) -> None:
    import aiohttp

    nats_server.kill()
    try:
        filled = await drive(tier.url, "meetup", known_events(BOUND, "full"), batch=100)
        assert len(filled.acknowledged) == BOUND  # exactly the bound fits
        url = f"{tier.url}/v1/streams/meetup/ws"
        async with aiohttp.ClientSession() as s, s.ws_connect(url) as ws:
            await ws.send_str('{"id": "slow-1"}')
            answer = await ws.receive_json(timeout=10)
            assert answer["slow_down"] is True and answer["retry_after_ms"] > 0
            assert answer["status"] == 503 and answer["ids"] == ["slow-1"]
            nats_server.restart()

            async def accepted_on_resend() -> bool:
                await ws.send_str('{"id": "slow-1"}')  # same id: a resend, never a second event
                return "accepted" in await ws.receive_json(timeout=10)

            await await_until(accepted_on_resend, timeout=120, interval=1.0, what="log has room")
    finally:
        if not nats_server.running:
            nats_server.restart()
    await verdict_after_drain(tier, nats_server, filled.acknowledged | {"slow-1"})


async def test_mode_none_acknowledges_only_what_jetstream_holds(
    ray_module: Any, nats_server: NatsServer, tmp_path: Path
) -> None:
    """With no message log, the answer waits for JetStream: a dead queue means 503."""
    import aiohttp

    overrides = {
        "roles": {"logger": {"k": 0}, "collector": {"port": 0}},
        "logging": {"mode": "none"},
        "streams": {"nolog": {"subjects": ["raw.nolog"]}},
    }
    async with own_tier(nats_server, tmp_path, "tf-none", overrides) as t:
        url = f"{t.url}/v1/streams/nolog/events"
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(url, json={"id": "none-1"}) as r:
                    assert r.status == 200 and (await r.json())["ids"] == ["none-1"]
                nats_server.kill()
                async with s.post(url, json={"id": "none-2"}) as r:
                    assert r.status == 503 and "resend" in (await r.json())["error"]
                nats_server.restart()

                async def accepted() -> bool:
                    async with s.post(url, json={"id": "none-2"}) as r:
                        return r.status == 200

                await await_until(accepted, timeout=60, interval=0.5, what="queue back")
            nc = await connect(nats_server.url)
            stored = await stream_ids(nc, "nolog")
            await nc.close()
            assert stored == {"none-1": 1, "none-2": 1}
        finally:
            if not nats_server.running:
                nats_server.restart()


async def test_deferred_handoffs_reach_jetstream_through_the_replayer(
    ray_module: Any, nats_server: NatsServer, tmp_path: Path
) -> None:
    """With no room for in-memory handoffs, the log alone carries events to the bridge."""
    overrides = {
        "roles": {"logger": {"k": 0}, "collector": {"port": 0}},
        "streams": {"deferred": {"subjects": ["raw.deferred"]}},
    }
    async with own_tier(
        nats_server,
        tmp_path,
        "tf-deferred",
        overrides,
        collector_options={"max_handoff_events": 0},
        bridge_options={"stale_after_s": 1.0},
    ) as t:
        report = await drive(t.url, "deferred", known_events(2000, "dfr"), batch=100)
        assert len(report.acknowledged) == 2000
        stats = await t.actor(t.collectors[0]).stats.remote()
        assert stats["handoffs_deferred"] == 2000 and stats["handoffs"] == 0

        async def all_there() -> bool:
            nc = await connect(nats_server.url)
            try:
                return sum((await stream_ids(nc, "deferred")).values()) == 2000
            finally:
                await nc.close()

        await await_until(all_there, timeout=120, interval=0.5, what="replayed", swallow=True)
        nc = await connect(nats_server.url)
        verdict = judge(report.acknowledged, await stream_ids(nc, "deferred"))
        await nc.close()
        assert verdict.ok, str(verdict)


async def test_producer_tokens_guard_the_collector(
    ray_module: Any, nats_server: NatsServer, tmp_path: Path
) -> None:
    """With auth.producer_tokens set, requests without or with a wrong token get 401 and
    never reach the stream; the right token is accepted. NATS ingest and UDP, which carry
    no token, are not served unless NATS authenticates producers (nats.role_users)."""
    import aiohttp

    overrides = {
        "roles": {"logger": {"k": 0}, "collector": {"port": 0}},
        "auth": {"producer_tokens": ["p-secret"]},
        "streams": {"guarded": {"subjects": ["raw.guarded"]}},
    }
    async with own_tier(nats_server, tmp_path, "tf-auth", overrides, udp_port=free_udp_port()) as t:
        url = f"{t.url}/v1/streams/guarded/events?wait=queued"
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json={"id": "anon"}) as r:
                assert r.status == 401 and "missing" in (await r.json())["error"]
            bad = {"Authorization": "Bearer nope"}
            async with s.post(url, json={"id": "wrong"}, headers=bad) as r:
                assert r.status == 401 and "invalid" in (await r.json())["error"]
            with pytest.raises(aiohttp.WSServerHandshakeError) as err:
                await s.ws_connect(f"{t.url}/v1/streams/guarded/ws")
            assert err.value.status == 401
            good = {"Authorization": "Bearer p-secret"}
            async with s.post(url, json={"id": "ok"}, headers=good) as r:
                assert r.status == 200 and (await r.json())["ids"] == ["ok"]
        # NATS and UDP carry no token: without per-role NATS users (which make NATS itself
        # authenticate producers) neither may reach a stream, so neither is served.
        # (this module's other tier may answer `ingest.*` too: it knows no `guarded`)
        nc = await connect(nats_server.url)
        for i in range(10):
            try:
                reply = await nc.request("ingest.guarded", b'{"id": "nats-%d"}' % i, timeout=10)
            except nats.errors.NoRespondersError:
                continue
            assert "accepted" not in msgspec.json.decode(reply.data)
        stats = await t.actor(t.collectors[0]).stats.remote()
        assert stats["nats"] == 0
        assert "nats.role_users" in stats["nats_ingest_off"]
        assert t.udp_port == 0 and "token" in stats["udp_off"]
        stored = await stream_ids(nc, "guarded")
        await nc.close()
        assert stored == {"ok": 1}  # the refused ones never reached the stream
