"""Scaling a role while data flows: collectors 1 -> 3 -> 1 under load, nothing lost.

Real nats-server, Ray and LevelDB. The producer keeps sending known ids throughout;
scale-down drains (the replica closes its socket, finishes its requests, hands its
logged batches on), so a client at most retries and every acknowledged id lands once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from runtime.config import load
from runtime.loadgen import drive, known_events
from runtime.nats import NatsServer, connect
from runtime.pipeline import CollectionTier, start_collection_tier
from runtime.verify import judge, stream_ids
from runtime.waiting import await_until


@pytest.fixture(scope="module")
def tier(ray_module: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with NatsServer(store_dir=tmp_path_factory.mktemp("nats")).start() as server:
        cfg = load(
            environ={},
            overrides={
                "state_dir": str(tmp_path_factory.mktemp("state")),
                "ray": {"namespace": "tf-scaling"},
                "roles": {"logger": {"k": 1}, "collector": {"replicas": 1, "port": 0}},
                "streams": {"meetup": {"subjects": ["raw.meetup"]}},
            },
        )
        t = start_collection_tier(cfg, nats_url=server.url)
        yield t, server
        t.stop()


async def test_collectors_scale_up_and_down_under_load(tier: Any, tmp_path: Path) -> None:
    t, server = tier
    t: CollectionTier
    loop = asyncio.get_running_loop()
    steps: list[list[str]] = []

    async def scale_during_load() -> None:
        steps.append(await loop.run_in_executor(None, t.scale, "collector", 3))
        pids = {n: (await t.actor(n).heartbeat.remote())["pid"] for n in steps[-1]}
        assert len(set(pids.values())) == 3  # three live processes share the port
        steps.append(await loop.run_in_executor(None, t.scale, "collector", 1))

    flowing = asyncio.Event()
    load = asyncio.ensure_future(
        drive(
            t.url,
            "meetup",
            known_events(12_000, "sc"),
            batch=100,
            concurrency=4,
            rate=1500,
            on_batch=lambda i: flowing.set() if i >= 10 else None,
        )
    )
    await asyncio.wait_for(flowing.wait(), 60)  # scale only once the load is accepted
    await scale_during_load()
    assert not load.done()  # the scaling happened under load
    report = await load
    assert steps == [["collector-0", "collector-1", "collector-2"], ["collector-0"]]
    assert len(report.acknowledged) == 12_000  # the load kept being accepted throughout
    sup = await t.supervisor.status.remote()
    assert sup["children"]["collector-1"]["state"] == "dropped"
    assert sup["children"]["collector-0"]["state"] == "running"
    with pytest.raises(ValueError):
        ray.get(t.actor("collector-1").endpoints.remote(), timeout=5)

    async def drained() -> bool:
        c = await t.loggers[0].counts()
        return c["transient"] == 0 and c["failed"] == 0

    await await_until(drained, timeout=120, interval=0.5, what="log drained", swallow=True)
    nc = await connect(server.url)
    verdict = judge(report.acknowledged, await stream_ids(nc, "meetup"))
    await nc.close()
    assert verdict.ok, str(verdict)
