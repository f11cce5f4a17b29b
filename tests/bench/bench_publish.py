"""Publish throughput: nats-py's own pipelined ceiling vs JetStreamPublisher.publish_batch.

Run: `.venv/bin/python tests/bench/bench_publish.py`, or `pytest tests/bench/bench_publish.py -s`
(pytest collects it only when named explicitly). Prints a table, asserts nothing about speed.

For each fsync policy (`sync_interval` "always", the tierflow default, and "2m", nats-server's
default) it starts its own nats-server and measures, on a fresh stream each time:
(a) js.publish_async for every event, then every ack awaited (nats-py's pipelined ceiling);
(b) JetStreamPublisher.publish_batch in batches of 512 and of 4096;
(c) the atomic-batch ceiling: nats-py alone sending JetStream atomic batches (ADR-50) of
1000 (core publishes with the batch headers, the commit as a request, 4 commits awaited at
once; tests/bench/bench_ingest.atomic_ceiling);
(d) JetStreamPublisher.publish_atomic (what the bridge uses) in calls of 4096 events,
split by it into batches of at most 1000.
The 2-core machine is shared, so the "2m" runs are repeated and the median run is shown.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script from anywhere
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nats.aio.client import Client
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import NotFoundError

from runtime.nats.publisher import MSG_ID_HEADER, JetStreamPublisher, Outgoing
from runtime.nats.server import NatsServer, connect

EVENTS = 10_000  # per run; the fsync-per-message rows take ~5 s each at this size
PAYLOAD = 500
STREAM = "bench"
SUBJECT = "raw.bench"
BATCH_SIZES = (512, 4096)
ATOMIC_CALL = 4096  # events per publish_atomic call (split into batches of at most 1000)
SYNC_POLICIES = ("always", "2m")
# Repeats per policy (median run reported); "always" is fsync-bound and slow, so once.
REPEATS = {"always": 1, "2m": 3}


@dataclass
class Row:
    sync: str
    method: str
    events: int
    seconds: float
    p50_ms: float
    p99_ms: float

    @property
    def rate(self) -> float:
        return self.events / self.seconds


def quantile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def fresh_stream(nc: Client) -> None:
    js = nc.jetstream()
    with contextlib.suppress(NotFoundError):
        await js.delete_stream(STREAM)
    await js.add_stream(
        StreamConfig(name=STREAM, subjects=[SUBJECT], storage=StorageType.FILE, allow_atomic=True)
    )


async def raw_ceiling(nc: Client, tag: str) -> tuple[float, list[float]]:
    """nats-py publish_async for all events (its own 4000-pending cap), then await every ack."""
    js = nc.jetstream()
    loop = asyncio.get_running_loop()
    payload = b"x" * PAYLOAD
    latencies: list[float] = []
    futures = []
    t0 = time.perf_counter()
    for i in range(EVENTS):
        fut = await js.publish_async(SUBJECT, payload, headers={MSG_ID_HEADER: f"{tag}-{i}"})
        sent = loop.time()  # as for publish_batch: from hand-off to the client, not the call
        fut.add_done_callback(lambda _f, s=sent: latencies.append(loop.time() - s))
        futures.append(fut)
    acks = await asyncio.gather(*futures)
    elapsed = time.perf_counter() - t0
    assert len({a.seq for a in acks}) == EVENTS
    return elapsed, latencies


async def bridge_batches(nc: Client, tag: str, batch_size: int) -> tuple[float, list[float]]:
    pub = JetStreamPublisher(nc)
    pub.latency = type(pub.latency)(size=EVENTS)  # keep every sample for this run
    payload = b"x" * PAYLOAD
    events = [Outgoing(id=f"{tag}-{i}", subject=SUBJECT, data=payload) for i in range(EVENTS)]
    t0 = time.perf_counter()
    for k in range(0, EVENTS, batch_size):
        _, failed = await pub.publish_batch(events[k : k + batch_size])
        assert not failed, failed[:3]
    elapsed = time.perf_counter() - t0
    await pub.close()
    lat = pub.latency
    return elapsed, [lat._ring[i] for i in range(len(lat))]


async def atomic_raw(nc: Client, tag: str) -> tuple[float, list[float]]:
    """nats-py atomic batches of 1000 on the stream (bench_ingest's ceiling, on `nc`)."""
    loop = asyncio.get_running_loop()
    payload = b"x" * PAYLOAD
    latencies: list[float] = []
    window = asyncio.Semaphore(4)  # as bench_ingest's ATOMIC_IN_FLIGHT

    async def commit(headers: dict[str, str], count: int, started: float) -> None:
        try:
            msg = await nc.request(SUBJECT, payload, timeout=30, headers=headers)
            assert b'"count":' + str(count).encode() in msg.data, msg.data
            latencies.extend([loop.time() - started] * count)
        finally:
            window.release()

    tasks = []
    t0 = time.perf_counter()
    for b, k in enumerate(range(0, EVENTS, 1000)):
        await window.acquire()
        started = loop.time()
        count = min(1000, EVENTS - k)
        batch_id = f"{tag}-{b}"
        for j in range(1, count):
            headers = {MSG_ID_HEADER: f"{tag}-{k + j}", "Nats-Batch-Id": batch_id}
            headers["Nats-Batch-Sequence"] = str(j)
            await nc.publish(SUBJECT, payload, headers=headers)
        headers = {MSG_ID_HEADER: f"{tag}-{k + count}", "Nats-Batch-Id": batch_id}
        headers |= {"Nats-Batch-Sequence": str(count), "Nats-Batch-Commit": "1"}
        tasks.append(asyncio.ensure_future(commit(headers, count, started)))
    await asyncio.gather(*tasks)
    return time.perf_counter() - t0, latencies


async def bridge_atomic(nc: Client, tag: str, batch_size: int) -> tuple[float, list[float]]:
    pub = JetStreamPublisher(nc)
    pub.latency = type(pub.latency)(size=EVENTS)
    payload = b"x" * PAYLOAD
    events = [Outgoing(id=f"{tag}-{i}", subject=SUBJECT, data=payload) for i in range(EVENTS)]
    t0 = time.perf_counter()
    for k in range(0, EVENTS, batch_size):
        _, failed = await pub.publish_atomic(events[k : k + batch_size], stream=STREAM)
        assert not failed, failed[:3]
    elapsed = time.perf_counter() - t0
    assert pub.batch_fallbacks == 0
    await pub.close()
    lat = pub.latency
    return elapsed, [lat._ring[i] for i in range(len(lat))]


async def bench_policy(sync: str, base: Path) -> list[Row]:
    rows: list[Row] = []
    server = NatsServer(store_dir=base / f"nats-{sync}", sync_interval=sync).start()
    try:
        nc = await connect(server.url, name=f"bench-{sync}")
        try:
            await fresh_stream(nc)
            await JetStreamPublisher(nc).publish_batch(  # warm-up: connection, stream files
                [Outgoing(id=f"warm-{i}", subject=SUBJECT, data=b"w") for i in range(500)]
            )
            runs: list[tuple[str, int | None]] = [("nats-py publish_async", None)]
            runs += [(f"publish_batch({b})", b) for b in BATCH_SIZES]
            runs += [("nats-py atomic(1000)", None), (f"publish_atomic({ATOMIC_CALL})", None)]
            got: dict[str, list[Row]] = {name: [] for name, _ in runs}
            for rep in range(REPEATS[sync]):  # interleaved, so load spikes hit every method
                for name, batch in runs:
                    await fresh_stream(nc)
                    tag = f"{name}-{sync}-{rep}"
                    if name.startswith("nats-py atomic"):
                        elapsed, lat = await atomic_raw(nc, tag)
                    elif name.startswith("publish_atomic"):
                        elapsed, lat = await bridge_atomic(nc, tag, ATOMIC_CALL)
                    elif batch is None:
                        elapsed, lat = await raw_ceiling(nc, tag)
                    else:
                        elapsed, lat = await bridge_batches(nc, tag, batch)
                    p50, p99 = quantile(lat, 0.5) * 1e3, quantile(lat, 0.99) * 1e3
                    got[name].append(Row(sync, name, EVENTS, elapsed, p50, p99))
            for name, _ in runs:  # the run with the median rate stands for the method
                rows.append(sorted(got[name], key=lambda r: r.rate)[len(got[name]) // 2])
        finally:
            await nc.close()
    finally:
        server.stop()
    return rows


def render(rows: list[Row]) -> str:
    head = (
        f"{'sync_interval':<14}{'method':<24}{'events/s':>10}"
        f"{'p50 ms':>9}{'p99 ms':>9}{'vs (a)':>8}"
    )
    lines = [head, "-" * len(head)]
    ceiling = {r.sync: r.rate for r in rows if r.method == "nats-py publish_async"}
    for r in rows:
        ratio = r.rate / ceiling[r.sync]
        lines.append(
            f"{r.sync:<14}{r.method:<24}{r.rate:>10,.0f}{r.p50_ms:>9.1f}{r.p99_ms:>9.1f}{ratio:>8.2f}"
        )
    return "\n".join(lines)


async def main() -> str:
    with tempfile.TemporaryDirectory(prefix="tierflow-bench-") as tmp:
        rows: list[Row] = []
        for sync in SYNC_POLICIES:
            rows += await bench_policy(sync, Path(tmp))
    table = render(rows)
    print(f"\n{EVENTS} events of {PAYLOAD} B per run; ratio = method / publish_async")
    print(table)
    from tests.bench.common import write_report

    atomic = {
        r.sync: r.rate for r in rows if r.method.startswith("nats-py atomic")
    }  # publish_atomic against nats-py's own atomic batches, per fsync policy
    write_report(
        "publish",
        {
            "events": EVENTS,
            "payload": PAYLOAD,
            "rows": [{**asdict(r), "rate": r.rate} for r in rows],
            "atomic_vs_ceiling": {
                r.sync: r.rate / atomic[r.sync]
                for r in rows
                if r.method.startswith("publish_atomic")
            },
        },
    )
    return table


def test_bench_publish() -> None:
    """Prints the table; no speed assertion (the numbers depend on the machine)."""
    table = asyncio.run(main())
    assert "publish_batch(4096)" in table and "publish_atomic" in table


if __name__ == "__main__":
    asyncio.run(main())
