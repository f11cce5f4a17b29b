"""Geo replication: replication lag at a steady 1,000 events/s, and the
`site-loss` scenario at 20,000 events (kill to the first acknowledgement on the surviving
site; acknowledged events lost or duplicated).

Two sites of 3 nodes (runtime/geo/sites.py), a stream R3 replicated from site A to site B.
Lag: a producer on A publishes 1,000 events/s with ids, each one's acknowledgement time
kept; a push consumer on B's copy, on the subject A's events are sourced to, takes each
event's arrival time. The lag of an event is its arrival on B minus its acknowledgement on
A (what a reader of B waits after the producer was told "stored"). One machine, one clock.
Also sampled: JetStream's own figure, the source's lag in events.

Then the `site-loss` scenario through the pipeline (a tierflow runtime on each site, HTTP
load into both collectors; cluster/chaos/site_loss_pipeline.py) at 20,000 events: kill to
the first acknowledgement on B, acknowledged events lost or duplicated, catch-up; its
figures go under `site_loss_pipeline` (the NATS-level run stays `site_loss`).

Prints numbers, asserts no speed; asserts the site-loss verdict (nothing acknowledged lost
or duplicated). Run alone:
`flock /tmp/tierflow-bench.lock .venv/bin/python -m pytest -s -o python_files='bench_*.py'
tests/bench/bench_geo.py`
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from cluster.chaos.site_loss import run_site_loss
from cluster.chaos.site_loss_pipeline import run_site_loss_pipeline
from runtime.config import validate
from runtime.engines.services import ensure_streams
from runtime.geo.replication import link_deny, origin_subject, replication_lag
from runtime.geo.sites import NatsSites
from runtime.nats.server import connect
from runtime.waiting import await_until
from tests.bench.common import summary, write_report
from tests.support import acked_publish

pytestmark = pytest.mark.timeout(1500)

STREAM, SUBJECT = "geo", "raw.geo"
RATE, SECONDS, BATCH = 1000, 10, 20  # 10,000 lag samples
SITE_LOSS_EVENTS = 20_000


async def _lag_run(work: Path) -> dict[str, Any]:
    cfg = validate(
        {
            "state_dir": str(work / "state"),
            "streams": {
                STREAM: {"subjects": [SUBJECT], "replicas": 3, "replicate": {"to": ["site-b"]}}
            },
        }
    )
    from nats.js.api import DeliverPolicy

    sites = NatsSites(work / "sites", sites=2, nodes=3, deny=link_deny(cfg)).start()
    try:
        nca = await connect(sites.site("site-a").url)
        ncb = await connect(sites.site("site-b").url)
        await ensure_streams(nca, cfg)
        js = nca.jetstream()
        # a new R3 stream's subjects reach the other nodes of the site a moment after it is
        # created: until then a publish through them finds no responders (seen once in
        # `make bench`). One probe, acknowledged before B's subscription starts at new events.
        await await_until(
            lambda: acked_publish(js, SUBJECT, b"{}", "ready", timeout=2),
            30,
            0.2,
            "the stream's first ack",
        )
        acked: dict[str, float] = {}
        arrived: dict[str, float] = {}

        async def on_msg(msg: Any) -> None:
            msg_id = (msg.headers or {}).get("Nats-Msg-Id", "")
            if msg_id.startswith("lag-"):  # not the probe, which may reach B after this starts
                arrived.setdefault(msg_id, time.monotonic())

        await ncb.jetstream().subscribe(
            origin_subject("site-a", SUBJECT),
            stream=STREAM,
            cb=on_msg,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.NEW,
        )
        source_lag: list[int] = []

        async def one(i: int) -> None:
            await js.publish(SUBJECT, b'{"n":%d}' % i, headers={"Nats-Msg-Id": f"lag-{i}"})
            acked[f"lag-{i}"] = time.monotonic()

        async def sample() -> None:
            while True:
                rows = await replication_lag(ncb, cfg)
                source_lag.extend(r["lag"] for r in rows if r["site"] == "site-b" and r["up"])
                await asyncio.sleep(0.5)

        sampler = asyncio.get_running_loop().create_task(sample())
        total = RATE * SECONDS
        start = time.monotonic()
        for k in range(0, total, BATCH):
            await asyncio.gather(*(one(i) for i in range(k, min(total, k + BATCH))))
            pause = start + (k + BATCH) / RATE - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
        sent_s = time.monotonic() - start
        await await_until(lambda: len(arrived) >= total, 60, 0.1, "every event on site B")
        sampler.cancel()
        lags_ms = [max(0.0, (arrived[i] - acked[i]) * 1000) for i in acked]
        await nca.close()
        await ncb.close()
        return {
            "rate_offered": RATE,
            "rate_achieved": round(total / sent_s, 1),
            "events": total,
            "lag_ms": summary(lags_ms),
            "source_lag_events_max": max(source_lag) if source_lag else None,
        }
    finally:
        sites.stop()


def test_geo(tmp_path: Path) -> None:
    lag = asyncio.run(_lag_run(tmp_path / "lag"))
    print(f"\ngeo: replication lag at {lag['rate_achieved']:,.0f}/s: {lag['lag_ms']}")
    loss = asyncio.run(
        run_site_loss(events=SITE_LOSS_EVENTS, rate=1000.0, workdir=tmp_path / "loss")
    )
    data = loss.to_dict()
    print(
        f"geo: site-loss {loss.acked:,} acked, lost {loss.lost}, duplicated {loss.duplicated}, "
        f"kill -> first ack on B {loss.kill_to_first_ack_s} s, "
        f"A's producer acked by B {loss.failover_ack_s} s after the kill, "
        f"A caught up in {loss.catch_up_s} s ({loss.kicks} source kicks)"
    )
    piped = asyncio.run(
        run_site_loss_pipeline(events=SITE_LOSS_EVENTS, rate=1000.0, workdir=tmp_path / "pipe")
    )
    piped_data = piped.to_dict()
    print(
        f"geo: site-loss (pipeline) {piped.acked:,} acked, lost {piped.lost}, "
        f"duplicated {piped.duplicated}, kill -> first ack on B {piped.kill_to_first_ack_s} s, "
        f"{piped.missing_on_b_during_outage} acked events not on B while A was down, "
        f"A caught up in {piped.catch_up_s} s ({piped.kicks} source kicks)"
    )
    write_report("geo", {"lag": lag, "site_loss": data, "site_loss_pipeline": piped_data})
    assert loss.ok, data
    assert piped.ok, piped_data
