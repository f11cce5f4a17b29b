"""Nexmark events into JetStream: the three streams, straight from the generator.

The analysis bench and the tests load events this way (the collection tier is measured by
its own benchmarks); each event goes out with the id ``nexmark:<seed>:<n>``, so a load
started again over a range stores each event once (JetStream's duplicate window). A load
either stores every event it was given or raises: failed publishes are sent again, a
bounded number of times.

`paced` loads at a steady rate of wall-clock time with event times taken from the clock,
for latency measurements: an event's time is when it was generated.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from cluster.nexmark.generator import STREAMS, Generator, Kind
from runtime.nats.publisher import JetStreamPublisher, Outgoing

__all__ = ["LoadReport", "ensure_streams", "load", "paced"]

BATCH = 2_000
ATTEMPTS = 5
_encoder = msgspec.json.Encoder()


@dataclass
class LoadReport:
    events: int = 0
    duplicates: int = 0
    per_stream: dict[str, int] | None = None
    seconds: float = 0.0


def subjects(prefix: str = "nexmark") -> dict[Kind, str]:
    return {kind: f"{prefix}.{kind}" for kind in STREAMS}


async def ensure_streams(nc: Any, config: Mapping[str, Mapping[str, Any]]) -> None:
    """Create the streams of `config` (`nexmark_streams()`) that are not there yet."""
    from nats.js.api import StreamConfig

    js = nc.jetstream()
    for name, stream in config.items():
        try:
            await js.stream_info(name)
        except Exception:
            await js.add_stream(
                StreamConfig(
                    name=name,
                    subjects=list(stream["subjects"]),
                    num_replicas=int(stream.get("replicas", 1)),
                    duplicate_window=600,
                )
            )


async def _publish(
    publisher: JetStreamPublisher, batch: list[Outgoing], report: LoadReport
) -> None:
    pending = batch
    for _attempt in range(ATTEMPTS):
        acked, failed = await publisher.publish_batch(pending)
        report.events += len(acked)
        report.duplicates += sum(1 for a in acked if a.duplicate)
        if not failed:
            return
        retry = {f.id for f in failed if f.retryable}
        if len(retry) < len(failed):
            raise RuntimeError(f"nexmark load: events refused: {failed[0].error}")
        pending = [ev for ev in pending if ev.id in retry]
        await asyncio.sleep(0.5)
    raise RuntimeError(f"nexmark load: {len(pending)} events not stored after {ATTEMPTS} tries")


async def load(
    nc: Any,
    gen: Generator,
    first: int,
    count: int,
    *,
    prefix: str = "nexmark",
    on_batch: Callable[[int], None] | None = None,
) -> LoadReport:
    """Publish events [first, first + count) in emission order; every one is stored
    (or was already) when this returns."""
    publisher = JetStreamPublisher(nc, max_in_flight=4096)
    topics = subjects(prefix)
    report = LoadReport(per_stream=dict.fromkeys(STREAMS, 0))
    assert report.per_stream is not None
    began = time.perf_counter()
    batch: list[Outgoing] = []
    for n, kind, fields in gen.events(first, count):
        batch.append(Outgoing(f"nexmark:{gen.seed}:{n}", topics[kind], _encoder.encode(fields)))
        report.per_stream[kind] += 1
        if len(batch) >= BATCH:
            await _publish(publisher, batch, report)
            if on_batch is not None:
                on_batch(len(batch))
            batch = []
    if batch:
        await _publish(publisher, batch, report)
        if on_batch is not None:
            on_batch(len(batch))
    report.seconds = time.perf_counter() - began
    return report


async def paced(
    nc: Any,
    gen: Generator,
    rate: int,
    seconds: float,
    *,
    prefix: str = "nexmark",
    first: int = 0,
    tick_s: float = 0.05,
) -> LoadReport:
    """Publish `rate` events per second of wall-clock time for `seconds`, each stamped with
    the time it is sent (event time = wall time), in ticks of `tick_s`."""
    base_ms = int(time.time() * 1000)
    live = replace(gen, rate=rate, base_ms=base_ms, disorder=1)
    publisher = JetStreamPublisher(nc, max_in_flight=4096)
    topics = subjects(prefix)
    report = LoadReport(per_stream=dict.fromkeys(STREAMS, 0))
    assert report.per_stream is not None
    began = time.perf_counter()
    sent = 0
    total = int(rate * seconds)
    while sent < total:
        due = min(total, int((time.perf_counter() - began) * rate) + 1)
        if due <= sent:
            await asyncio.sleep(tick_s / 4)
            continue
        batch = []
        for n in range(first + sent, first + due):
            kind, fields = live.event(n)
            fields["dateTime"] = int(time.time() * 1000)
            batch.append(Outgoing(f"nexmark:{gen.seed}:{n}", topics[kind], _encoder.encode(fields)))
            report.per_stream[kind] += 1
        await _publish(publisher, batch, report)
        sent = due
    report.seconds = time.perf_counter() - began
    return report
