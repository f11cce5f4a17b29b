"""The bridge's data path (`BridgePath._publish_atomic`) with a group that spans streams:
the streams' shares go out concurrently, each in its own order, each event stored once.

A unit test with a fake publisher (one stream's commit cannot finish before the other
stream's share was handed over: sequential shares would wait forever) and one with a real
nats-server and a real JetStreamPublisher.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from actors.queue.bridge_link import NatsLink
from actors.queue.bridge_path import BridgePath
from actors.queue.bridge_status import new_counters
from cluster.verify import stream_ids
from runtime.config import validate
from runtime.data.events import Event, new_event_id
from runtime.nats.publisher import Failed, JetStreamPublisher, Outgoing, Published
from runtime.nats.server import NatsServer, connect

pytestmark = pytest.mark.timeout(60)


def path_for(pub: Any, nc: Any = None, targets: dict[str, str] | None = None) -> BridgePath:
    """A bridge's data path with only what `_publish_atomic` uses (no Ray, no data-plane
    thread, no connection opened); `targets` (subject -> stream) pre-fills its stream
    lookup cache."""
    cfg = validate({})
    link = NatsLink(cfg, "nats://unused", name="test-bridge", counters=new_counters())
    link.pub, link.nc = pub, nc
    now = asyncio.get_running_loop().time()
    link._targets = {subj: (s, 120.0, now) for subj, s in (targets or {}).items()}
    path = BridgePath(cfg, link, link.counters)
    path.atomic = True
    return path


def ev(subject: str, n: int) -> Event:
    return Event(new_event_id(), subject.split(".")[1], subject, b'{"n": %d}' % n, 0)


class GatedPublisher:
    """Stream a's commit waits until stream b's share has been handed over."""

    def __init__(self) -> None:
        self.b_started = asyncio.Event()
        self.calls: list[tuple[str | None, list[str]]] = []

    async def publish_atomic(
        self, items: Sequence[Outgoing], *, stream: str | None = None
    ) -> tuple[list[Published], list[Failed]]:
        self.calls.append((stream, [o.id for o in items]))
        if stream == "b":
            self.b_started.set()
        else:
            await asyncio.wait_for(self.b_started.wait(), 5.0)
        return [Published(o.id, stream or "", i + 1, False) for i, o in enumerate(items)], []

    async def publish_batch(
        self, items: Sequence[Outgoing]
    ) -> tuple[list[Published], list[Failed]]:
        raise AssertionError("every subject has a stream: no per-event publishing")


@pytest.mark.unit
async def test_a_group_spanning_streams_publishes_the_shares_concurrently() -> None:
    pub = GatedPublisher()
    path = path_for(pub, targets={"raw.a": "a", "raw.b": "b"})
    events = [ev("raw.a", 0), ev("raw.b", 1), ev("raw.a", 2), ev("raw.b", 3), ev("raw.a", 4)]
    published, failed = await asyncio.wait_for(path._publish_atomic(events), 10.0)
    assert failed == []
    assert sorted(p.id for p in published) == sorted(e.id for e in events)
    shares = dict(pub.calls)
    assert shares["a"] == [events[0].id, events[2].id, events[4].id]  # input order kept
    assert shares["b"] == [events[1].id, events[3].id]


async def test_shares_across_real_streams_land_once_each_in_order(
    nats_server: NatsServer,
) -> None:
    from nats.js.api import StreamConfig

    nc = await connect(nats_server.url, name="test-bridge-streams")
    try:
        js = nc.jetstream()
        for name in ("bsa", "bsb"):
            await js.add_stream(
                StreamConfig(name=name, subjects=[f"raw.{name}"], allow_atomic=True)
            )
        pub = JetStreamPublisher(nc, 256, 5.0)
        await pub.start()
        path = path_for(pub, nc)  # stream names looked up from the server
        events = [ev(f"raw.{'bsa' if i % 3 else 'bsb'}", i) for i in range(60)]
        published, failed = await path._publish_atomic(events)
        assert failed == []
        seq = {p.id: (p.stream, p.seq) for p in published}
        for name in ("bsa", "bsb"):
            mine = [e.id for e in events if e.subject == f"raw.{name}"]
            assert [seq[i][0] for i in mine] == [name] * len(mine)
            seqs = [seq[i][1] for i in mine]
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
            stored = await stream_ids(nc, name)
            assert {i: stored.get(i) for i in mine} == dict.fromkeys(mine, 1)
        again, failed = await path._publish_atomic(events)  # a resend: duplicates only
        assert failed == [] and all(p.duplicate for p in again)
        for name in ("bsa", "bsb"):
            assert all(n == 1 for n in (await stream_ids(nc, name)).values())
        await pub.close()
    finally:
        await nc.close()
