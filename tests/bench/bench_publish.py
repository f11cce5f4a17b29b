"""Publish throughput: nats-py's own pipelined ceiling vs JetStreamPublisher.publish_batch.

Run: `.venv/bin/python tests/bench/bench_publish.py`, or `pytest tests/bench/bench_publish.py -s`
(pytest collects it only when named explicitly). Prints a table, asserts nothing about speed.

For each fsync policy (`sync_interval` "always", the tierflow default, and "2m", nats-server's
default) it starts its own nats-server and measures, on a fresh stream each time:
(a) js.publish_async for every event, then every ack awaited (nats-py's pipelined ceiling);
(b) JetStreamPublisher.publish_batch in batches of 512 and of 4096.
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

from runtime.nats import NatsServer, connect
from runtime.publisher import MSG_ID_HEADER, JetStreamPublisher, Outgoing

EVENTS = 20_000
PAYLOAD = 500
STREAM = "bench"
SUBJECT = "raw.bench"
BATCH_SIZES = (512, 4096)
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
    await js.add_stream(StreamConfig(name=STREAM, subjects=[SUBJECT], storage=StorageType.FILE))


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
            got: dict[str, list[Row]] = {name: [] for name, _ in runs}
            for rep in range(REPEATS[sync]):  # interleaved, so load spikes hit every method
                for name, batch in runs:
                    await fresh_stream(nc)
                    tag = f"{name}-{sync}-{rep}"
                    if batch is None:
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
    ceiling = {r.sync: r.rate for r in rows if r.method.startswith("nats-py")}
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
    print(f"\n{EVENTS} events of {PAYLOAD} B per run; ratio = publish_batch / publish_async")
    print(table)
    from tests.bench.common import write_report

    write_report(
        "publish",
        {
            "events": EVENTS,
            "payload": PAYLOAD,
            "rows": [{**asdict(r), "rate": r.rate} for r in rows],
        },
    )
    return table


def test_bench_publish() -> None:
    """Prints the table; no speed assertion (the numbers depend on the machine)."""
    table = asyncio.run(main())
    assert "publish_batch(4096)" in table


if __name__ == "__main__":
    asyncio.run(main())
