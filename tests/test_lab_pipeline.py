"""The pipeline on three hosts, run as a user runs it on a cluster, and the network cut.

Three network-namespace hosts (cluster/lab), each with a NATS JetStream node (streams R3)
and a Ray node (the head on h1); the Meetup pipeline submitted from the laptop with `ray job
submit` (token auth), every collector and gateway bound to its own host's address; a
producer on the laptop with every collector's address, moving on when one stops answering.
Then a host is cut off for 20 s, and another crashes (SIGKILL of every process in it) and
comes back on its own state. The verdict: every acknowledged event stored exactly once, and
a client on the laptop reading a third of them through both gateways (on two hosts) got
each stored match exactly once, across the cut and the crash.

Needs root and network namespaces: skipped with that reason elsewhere.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import pytest

from cluster.chaos.runner import Subscriber
from cluster.lab.cluster import LabCluster, pipeline_lab
from cluster.lab.hosts import lab_unavailable
from cluster.loadgen import drive
from cluster.verify import judge, stream_ids
from runtime.nats.server import connect
from runtime.waiting import WaitTimeout, await_until

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

EVENTS = 10_000
STREAM = "meetup"


@pytest.fixture(scope="module")
def lab_cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    why = lab_unavailable()
    if why is not None:
        pytest.skip(why)
    with pipeline_lab(tmp_path_factory.mktemp("lab")) as lc:
        yield lc


def _endpoints(lc: LabCluster) -> tuple[list[str], list[str]]:
    """The collectors' and the gateways' addresses, as Ray has them: each a host's own."""
    urls, gateways = lc.addresses()
    assert all("127.0.0.1" not in u for u in urls + gateways), (urls, gateways)
    return urls, gateways


def test_the_pipeline_spans_the_hosts_and_keeps_every_event_through_a_cut_and_a_crash(
    lab_cluster: LabCluster,
) -> None:
    lc = lab_cluster
    lab = lc.lab
    urls, gateways = _endpoints(lc)
    homes = lc.hosts_of([f"collector-{i}" for i in range(3)] + ["gateway-0", "gateway-1"])
    print(f"\nlab: collectors at {urls}; actors on {homes}")
    assert len(set(homes.values())) >= 2, homes  # the roles really are on several hosts
    events = [{"id": f"lab-{i}", "n": i, "k": "abc"[i % 3]} for i in range(EVENTS)]
    cut, crash = "h2", "h3"
    marks: dict[str, float] = {}
    sub = Subscriber()

    async def scenario() -> tuple[Any, Any, Any]:
        """The load, the faults, the verdict's reads and the client, on one event loop:
        the client reads until the end."""
        done: list[int] = []
        await sub.start(gateways, STREAM, "WHERE k = 'a'")
        load = asyncio.create_task(
            drive(
                urls,
                STREAM,
                events,
                batch=50,
                concurrency=6,
                rate=200.0,
                deadline_s=600,
                request_timeout_s=5.0,
                on_batch=done.append,
            )
        )
        await asyncio.sleep(8)
        marks["cut"] = time.monotonic()
        await asyncio.to_thread(lab.link, cut, False)
        await asyncio.sleep(20)
        await asyncio.to_thread(lab.link, cut, True)
        marks["healed"] = time.monotonic()
        await asyncio.sleep(8)
        marks["crash"] = time.monotonic()
        killed = await asyncio.to_thread(lab.signal_host, crash, signal.SIGKILL)
        print(f"lab: SIGKILLed {len(killed)} processes on {crash}")
        await asyncio.sleep(5)
        await asyncio.to_thread(lc.restart_host, crash)
        marks["restarted"] = time.monotonic()
        report = await load
        print(
            f"lab: {len(report.acknowledged)} of {EVENTS} acknowledged in "
            f"{report.elapsed_s:.0f} s; errors {report.errors}, 503s {report.refused}, "
            f"rejected {report.rejected}"
        )

        async def complete() -> Any:
            nc = await connect(lc.nats_url)
            try:
                got = await stream_ids(nc, STREAM, timeout=180)
            finally:
                await nc.close()
            return got if all(got[i] for i in report.acknowledged) else None

        try:
            got = await await_until(complete, 240, 2.0, what="acknowledged events stored")
        except WaitTimeout:
            print(await asyncio.to_thread(lc.job_logs))
            raise
        want = {i for i in got if int(i.rsplit("-", 1)[1]) % 3 == 0}
        try:
            delivery = await sub.caught_up(want, 180)
        finally:
            await sub.stop()
        return report, got, delivery

    report, got, delivery = asyncio.run(scenario())
    verdict = judge(report.acknowledged, got)
    assert len(report.acknowledged) == EVENTS, report
    assert verdict.ok, verdict
    print(f"lab: the gateway client got {delivery.received} of {delivery.expected}")
    assert delivery.ok, (delivery, sub.error)
