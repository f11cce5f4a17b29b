"""The stream pattern end to end (book ch. 2 and 9), with a failover of the ingest node.

replay server (stands in for the Meetup RSVP WebSocket) -> active StreamIngest (standby
waiting on the lease) -> buffer stream -> two processing collectors -> MessageLogger ->
BrokerBridge -> the `meetup` stream. The active ingest node is SIGKILLed mid-stream;
every event the server sent must be in `meetup` exactly once.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from cluster.pipeline import CollectionTier, start_collection_tier
from cluster.replay import ReplayServer
from cluster.verify import stream_ids
from runtime.config import load
from runtime.nats.server import connect
from runtime.waiting import await_until
from tests.support import NatsFactory

EVENTS = 3000
RATE = 600.0  # events/s: the run spans about 5 s, long enough to kill mid-way


@pytest.fixture
async def replay() -> AsyncIterator[ReplayServer]:
    server = ReplayServer(7, rate=RATE, count=EVENTS)
    await server.start()
    yield server
    await server.stop()


async def test_meetup_stream_survives_ingest_node_kill(
    ray_module: Any, replay: ReplayServer, nats_factory: NatsFactory, tmp_path: Path
) -> None:
    import ray

    loop = asyncio.get_running_loop()
    with nats_factory() as nats_server:
        cfg = load(
            environ={},
            overrides={
                "state_dir": str(tmp_path / "state"),
                "ray": {"namespace": "tf-streampattern"},
                "roles": {"collector": {"replicas": 2, "port": 0}},
                "streams": {
                    "meetup": {
                        "subjects": ["raw.meetup"],
                        "source": {"url": replay.stream_url, "kind": "ws", "k": 1},
                    }
                },
            },
        )
        tier: CollectionTier = await loop.run_in_executor(
            None, lambda: start_collection_tier(cfg, nats_url=nats_server.url)
        )
        try:
            nc = await connect(nats_server.url)

            async def stored() -> int:
                try:
                    return sum((await stream_ids(nc, "meetup")).values())
                except Exception:
                    return 0

            async def active() -> dict[str, Any] | None:
                for name in tier.ingest:
                    st = await tier.actor(name).stats.remote()
                    if st.get("role") == "active":
                        return {"name": name, **st}
                return None

            victim = await await_until(
                active, timeout=60, what="an active ingest node", swallow=True
            )
            await await_until(lambda: _at_least(stored, EVENTS // 4), timeout=60, what="flowing")
            pid = (await tier.actor(victim["name"]).heartbeat.remote())["pid"]
            os.kill(pid, signal.SIGKILL)

            async def taken_over() -> bool:
                now = await active()
                return bool(now and now["name"] != victim["name"])

            await await_until(taken_over, timeout=60, interval=0.2, what="standby took over")
            await await_until(lambda: _at_least(stored, EVENTS), timeout=120, what="all events")

            ids = await stream_ids(nc, "meetup")
            await nc.close()
            positions = sorted(int(i.rsplit(":", 1)[1]) for i in ids)
            assert positions == list(range(EVENTS))  # every position, none twice
            assert all(n == 1 for n in ids.values())
            assert replay.stats()["highest_position"] == EVENTS - 1
            collected = [ray.get(tier.actor(c).stats.remote())["buffered"] for c in tier.collectors]
            assert sum(collected) >= EVENTS
        finally:
            await loop.run_in_executor(None, tier.stop)


async def _at_least(fn: Any, n: int) -> bool:
    return await fn() >= n
