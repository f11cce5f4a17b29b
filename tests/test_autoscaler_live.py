"""The autoscaler inside a running runtime: a load step adds collectors, its end removes
them, and nothing acknowledged is lost on the way.

A real `Runtime` (embedded nats-server, local Ray, the collection tier and a gateway) with
`[roles.collector.autoscaling]` set to short delays. The load is a producer keeping 8
requests in flight; the collectors' load figure is HTTP requests in hand, so the policy
(target 2 per replica, at most 3) asks for 3 replicas while it runs and 1 after.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator

import pytest

from cluster.launcher import Runtime
from cluster.loadgen import drive, known_events
from cluster.verify import judge, stream_ids
from runtime.config import load
from runtime.nats.server import connect
from runtime.waiting import await_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
async def runtime(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Runtime]:
    import ray

    if ray.is_initialized():  # the runtime owns its Ray here
        ray.shutdown()
    state = tmp_path_factory.mktemp("autoscale")
    cfg = load(
        environ={},
        overrides={
            "state_dir": str(state),
            "ray": {"namespace": "tf-autoscale", "num_cpus": 2},
            "roles": {
                "logger": {"k": 0},
                "collector": {
                    "replicas": 1,
                    "port": 0,
                    "autoscaling": {
                        "min_replicas": 1,
                        "max_replicas": 3,
                        "target_per_replica": 2,
                        "upscale_delay_s": 1,
                        "downscale_delay_s": 4,
                        "look_back_s": 2,
                    },
                },
                "gateway": {"port": 0},
            },
            "streams": {"meetup": {"subjects": ["raw.meetup"]}},
        },
    )
    rt = Runtime(cfg)
    try:
        await rt.start()
        yield rt
    finally:
        await rt.stop()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read()


async def test_a_load_step_adds_collectors_and_its_end_removes_them(runtime: Runtime) -> None:
    rt = runtime
    assert rt.roles.replicas("collector") == 1
    stop = asyncio.Event()
    load = asyncio.ensure_future(
        drive(
            rt.tier.url,
            "meetup",
            known_events(2_000_000, "auto"),
            batch=20,
            concurrency=8,
            deadline_s=600,
            until=stop,
        )
    )
    try:
        await await_until(
            lambda: rt.roles.replicas("collector") == 3, 120, 0.2, what="scaled up to 3"
        )
        assert not load.done()
        loop = asyncio.get_running_loop()
        status = json.loads(await loop.run_in_executor(None, _get, rt.admin_url + "/status"))
        collectors = status["roles"]["collector"]
        assert len(collectors["replicas"]) == 3
        assert status["autoscaling"]["collector"]["desired"] == 3
        metrics = (await loop.run_in_executor(None, _get, rt.admin_url + "/metrics")).decode()
        assert 'tierflow_role_replicas{role="collector"} 3.0' in metrics
    finally:
        stop.set()
    report = await load
    assert not report.rejected and report.acknowledged
    await await_until(
        lambda: rt.roles.replicas("collector") == 1, 120, 0.2, what="scaled back to 1"
    )
    await await_until(  # the tick that scaled down has finished
        lambda: rt.autoscaler.last["collector"].desired == 1, 60, 0.2, what="decided 1"
    )

    async def drained() -> bool:
        c = await rt.tier.loggers[0].counts()
        return c["transient"] == 0 and c["failed"] == 0

    await await_until(drained, timeout=120, interval=0.5, what="log drained", swallow=True)
    nc = await connect(rt.services.nats_url)
    try:
        verdict = judge(report.acknowledged, await stream_ids(nc, "meetup"))
    finally:
        await nc.close()
    assert verdict.ok, str(verdict)
