"""The n:1 fan-out without NATS: ring, backfill, catch-up reads, lag policy, acks, rates.

An in-memory stream stands in for JetStream behind the `Reader` protocol; the policy
functions are pure and tested with a fake clock. Every test runs twice: with clients the
feed can serve in its own pass (`deliver_now`, refused while the client is blocked) and
with clients served only by their pumps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import pytest

from actors.access.fanout import Feed, LagPolicy, Subscriber, TokenBucket, judge_lag
from actors.access.messages import StreamMessage
from runtime.data.query import compile_filter
from runtime.waiting import await_until

pytestmark = pytest.mark.unit
INLINE = [False]


@pytest.fixture(autouse=True, params=[False, True], ids=["pump", "inline"])
def inline(request: pytest.FixtureRequest) -> bool:
    """Whether the `Client`s made by this test offer `deliver_now`."""
    INLINE[0] = request.param
    return request.param


class MemStream:
    """A stream in memory; readers block up to their timeout for new events."""

    def __init__(self) -> None:
        self.events: list[StreamMessage] = []
        self.changed = asyncio.Event()
        self.opened: list[int] = []

    def publish(self, n: int, make: Callable[[int], dict] = lambda i: {"i": i}) -> None:
        for _ in range(n):
            seq = len(self.events) + 1
            self.events.append(StreamMessage(seq, "raw.s", msgspec.json.encode(make(seq))))
        self.changed.set()
        self.changed = asyncio.Event()

    async def open(self, start: int) -> MemReader:
        self.opened.append(start)
        return MemReader(self, start)


class MemReader:
    def __init__(self, stream: MemStream, start: int) -> None:
        self.stream = stream
        self.pos = max(1, start)

    async def fetch(self, max_events: int, timeout: float) -> list[StreamMessage]:
        if self.pos > len(self.stream.events):
            try:
                await asyncio.wait_for(self.stream.changed.wait(), timeout)
            except TimeoutError:
                return []
        out = self.stream.events[self.pos - 1 : self.pos - 1 + max_events]
        self.pos += len(out)
        return [StreamMessage(e.seq, e.subject, e.raw) for e in out]  # fresh objects, like NATS

    async def close(self) -> None:
        pass


class Client:
    """A subscriber with a deliver that records, optionally blocked or slowed."""

    def __init__(self, policy: LagPolicy | None = None, *, flt: str = "", **kw: object) -> None:
        self.seqs: list[int] = []
        self.lags: list[int] = []
        self.drops: list[tuple[int, int, int]] = []
        self.cut: list[int] = []
        self.progress: list[int] = []
        self.gate = asyncio.Event()
        self.gate.set()
        if INLINE[0]:
            kw.setdefault("deliver_now", self.deliver_now)
        self.sub = Subscriber(
            "s",
            compile_filter(flt),
            policy or LagPolicy(),
            deliver=self.deliver,
            on_lag=self.lags.append,
            on_dropped=lambda n, a, b: self.drops.append((n, a, b)),
            on_overflow=self.cut.append,
            on_progress=self.progress.append,
            batch=16,
            **kw,  # type: ignore[arg-type]
        )

    async def deliver(self, batch: list[tuple[StreamMessage, bytes]]) -> None:
        await self.gate.wait()
        self.seqs.extend(e.seq for e, _ in batch)

    def deliver_now(self, batch: list[tuple[StreamMessage, bytes]]) -> bool:
        if not self.gate.is_set():
            return False  # a blocked socket refuses; its pump waits instead
        self.seqs.extend(e.seq for e, _ in batch)
        return True


async def run(feed: Feed, client: Client, start: int, history: MemStream) -> asyncio.Task[None]:
    feed.attach(client.sub, start)
    return asyncio.get_running_loop().create_task(client.sub.pump(feed, history.open))


async def finish(feed: Feed, *tasks: asyncio.Task[None]) -> None:
    await feed.stop()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_judge_lag_and_token_bucket_are_pure() -> None:
    p = LagPolicy(max_lag=100, warn_lag=50, warn_every_s=1.0)
    assert judge_lag(p, 10, 99.0) == "ok"
    assert judge_lag(p, 50, 1.0) == "warn"
    assert judge_lag(p, 60, 0.5) == "ok"  # warned a moment ago
    assert judge_lag(p, 101, 0.0) == "overflow"
    with pytest.raises(ValueError):
        LagPolicy(max_lag=10, warn_lag=20)
    now = [0.0]
    bucket = TokenBucket(10.0, burst=2.0, clock=lambda: now[0])
    assert bucket.delay(2) == 0.0
    assert bucket.delay(1) == pytest.approx(0.1)
    now[0] = 1.0
    assert bucket.delay(1) == 0.0  # refilled (capped at the burst)


async def test_one_reader_serves_everyone_and_backfill_covers_late_resumes() -> None:
    mem = MemStream()
    mem.publish(100)
    feed = Feed("s", mem.open, ring_size=64, backfill=32, fetch_timeout_s=0.05)
    a, b = Client(), Client()
    ta = await run(feed, a, 90, mem)
    tb = await run(feed, b, 70, mem)  # earlier than a, but inside the backfill
    mem.publish(20)
    await await_until(lambda: a.seqs[-1:] == [120] and b.seqs[-1:] == [120], timeout=5)
    assert a.seqs == list(range(90, 121)) and b.seqs == list(range(70, 121))
    assert mem.opened == [58]  # one reader, from the first start minus the backfill
    assert feed.counters["history_readers"] == 0
    assert a.progress[-1] == 120
    # at the head, clients that can be served in the feed's pass are, their pumps stay parked
    wakes = feed.counters["pump_wakes"]
    await await_until(lambda: feed.stats()["parked"] == 2, timeout=5)
    mem.publish(10)
    await await_until(lambda: a.seqs[-1:] == [130] and b.seqs[-1:] == [130], timeout=5)
    assert a.seqs == list(range(90, 131)) and b.seqs == list(range(70, 131))
    if INLINE[0]:
        assert feed.counters["pump_wakes"] == wakes and feed.counters["served_inline"] >= 2
    else:
        assert feed.counters["pump_wakes"] >= wakes + 2 and feed.counters["served_inline"] == 0
    await finish(feed, ta, tb)


async def test_a_start_older_than_the_ring_catches_up_privately() -> None:
    mem = MemStream()
    mem.publish(300)
    feed = Feed("s", mem.open, ring_size=32, backfill=8, fetch_timeout_s=0.05)
    live, old = Client(), Client()
    t1 = await run(feed, live, 301, mem)
    t2 = await run(feed, old, 1, mem)
    mem.publish(50)
    await await_until(lambda: old.seqs[-1:] == [350] and live.seqs[-1:] == [350], timeout=5)
    assert old.seqs == list(range(1, 351))  # history, then the ring: no gap, no repeat
    assert live.seqs == list(range(301, 351))
    assert feed.counters["history_readers"] >= 1 and feed.history_open == 0
    assert not old.sub.catching_up
    await finish(feed, t1, t2)


async def test_slow_subscriber_is_warned_then_cut_off_others_unaffected() -> None:
    mem = MemStream()
    feed = Feed("s", mem.open, ring_size=512, backfill=0, fetch_timeout_s=0.05, lag_every_s=0)
    policy = LagPolicy(max_lag=60, warn_lag=20, warn_every_s=0.0)
    fast, slow = Client(policy), Client(policy)
    slow.gate.clear()  # never reads
    t1 = await run(feed, fast, 1, mem)
    t2 = await run(feed, slow, 1, mem)
    for _ in range(20):
        mem.publish(10)
        await asyncio.sleep(0.01)
    await await_until(lambda: slow.cut, timeout=5, what="slow client cut off")
    await await_until(lambda: fast.seqs[-1:] == [200], timeout=5)
    assert fast.seqs == list(range(1, 201)) and not fast.lags and not fast.cut
    assert len(slow.lags) >= 2 and all(b >= 20 for b in slow.lags)  # warned as it fell back
    assert slow.lags[:-1] == sorted(slow.lags[:-1]) and slow.lags[-2] <= 60 + 10
    assert slow.lags[-1] == slow.cut[0] > 60 and slow.sub.closed  # a last word, then the cut
    await finish(feed, t1, t2)


async def test_drop_oldest_skips_ahead_and_counts_what_matched() -> None:
    mem = MemStream()
    feed = Feed("s", mem.open, ring_size=512, backfill=0, fetch_timeout_s=0.05, lag_every_s=0)
    policy = LagPolicy(max_lag=40, warn_lag=20, warn_every_s=0.0, overflow="drop_oldest")
    slow = Client(policy, flt="WHERE i > 0")
    slow.gate.clear()
    task = await run(feed, slow, 1, mem)
    mem.publish(100)
    await await_until(lambda: slow.drops, timeout=5, what="a drop")
    slow.gate.set()
    await await_until(lambda: slow.seqs[-1:] == [100], timeout=5)
    count, first, last = slow.drops[0]
    assert count == last - first + 1  # every skipped event matched `i > 0`
    assert not slow.cut and slow.sub.dropped == sum(d[0] for d in slow.drops)
    assert slow.seqs == sorted(set(slow.seqs))  # in order, no repeat
    skipped = set(range(1, 101)) - set(slow.seqs)
    assert len(skipped) == sum(d[0] for d in slow.drops)
    await finish(feed, task)


async def test_ack_window_holds_delivery_until_acknowledged() -> None:
    mem = MemStream()
    mem.publish(30)
    feed = Feed("s", mem.open, ring_size=64, backfill=0, fetch_timeout_s=0.05)
    c = Client(ack_window=5)
    task = await run(feed, c, 1, mem)
    await await_until(lambda: len(c.seqs) >= 5, timeout=5)
    await asyncio.sleep(0.1)
    assert len(c.seqs) <= 16 and c.progress == []  # a batch at most, nothing acked yet
    c.sub.ack(c.seqs[-1])
    await await_until(lambda: c.seqs[-1:] == [30], timeout=5)
    c.sub.ack(30)
    assert c.progress[-1] == 30 and c.seqs == list(range(1, 31))
    await finish(feed, task)


async def test_acks_past_what_was_delivered_are_refused() -> None:
    """An ack of a seq the client was never sent must not move its cursor."""
    mem = MemStream()
    mem.publish(30)
    feed = Feed("s", mem.open, ring_size=64, backfill=0, fetch_timeout_s=0.05)
    c = Client(ack_window=5)
    task = await run(feed, c, 1, mem)
    await await_until(lambda: len(c.seqs) >= 5, timeout=5)
    assert c.sub.ack_limit >= c.seqs[-1] and c.sub.ack_limit < 30
    assert c.sub.ack(10**9) is False and c.sub.ack(30) is False
    assert c.progress == [] and c.sub.acked == 0
    assert c.sub.ack(c.seqs[1]) is True and c.progress == [c.seqs[1]]
    await finish(feed, task)


async def test_filters_render_once_per_event() -> None:
    ev = StreamMessage(1, "raw.s", b'{"a": 1,\n "b": 2}')
    f = compile_filter("SELECT a")
    assert ev.view(f) == b'{"a":1}' and ev.view(f) is ev.view(f)
    assert ev.json == b'{"a":1,"b":2}'  # a multi-line payload is re-encoded on one line
    assert StreamMessage(2, "s", b"not json").json == b'"not json"'
    assert StreamMessage(3, "s", b'{"a":1}').view(compile_filter("WHERE a = 2")) is None


async def test_a_pass_that_leaves_events_behind_wakes_the_pump() -> None:
    """The feed's pass takes one fetch's worth; a parked subscriber left with more (a
    batch larger than that) is woken and its pump delivers the rest, in order."""
    mem = MemStream()
    feed = Feed("s", mem.open, batch=4, fetch_timeout_s=0.05)
    c = Client()
    task = await run(feed, c, 1, mem)
    await await_until(lambda: feed.stats()["parked"] == 1, timeout=5)
    feed._dispatch([StreamMessage(i, "raw.s", b'{"i":%d}' % i) for i in range(1, 11)])
    await await_until(lambda: c.seqs[-1:] == [10], timeout=5)
    assert c.seqs == list(range(1, 11)) and c.progress[-1] == 10
    if INLINE[0]:
        assert feed.counters["served_inline"] == 0 and feed.counters["pump_wakes"] == 1
        assert c.sub.sent == 10
    await finish(feed, task)
