"""A feed's ring on a compacted stream replays what the stream retains.

JetStream keeps the last `keep` messages of every subject of a compacted stream, so a
`from: "all"` read from JetStream gets the latest value per key. A gateway whose feed for
the stream is already running serves a new subscriber from its ring instead: the ring
must skip what JetStream dropped. The in-memory stream of tests/test_fanout.py stands in
for JetStream (it keeps everything: what is skipped here is the ring's doing); the
gateway with a real JetStream is in tests/test_compaction_flow.py.
"""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.access.fanout import Feed, _Ring
from actors.access.messages import StreamMessage
from runtime.data.query import compile_filter
from runtime.waiting import await_until
from tests.test_fanout import INLINE, Client, MemStream, finish, run

pytestmark = pytest.mark.unit
ALL = compile_filter("")


def publish_keys(mem: MemStream, keys: list[str], round_: int) -> None:
    """One event per key, on the key's subject (as compaction gives it)."""
    for k in keys:
        seq = len(mem.events) + 1
        body = msgspec.json.encode({"key": k, "round": round_})
        mem.events.append(StreamMessage(seq, f"air.planes.{k}", body))
    mem.changed.set()
    mem.changed = asyncio.Event()


def retained(events: list[StreamMessage], keep: int, base: int) -> list[int]:
    """What a compacted stream holds at or after `base`: an event with fewer than `keep`
    later events of its subject (the reference, by brute force)."""
    out = []
    for i, e in enumerate(events):
        later = sum(1 for f in events[i + 1 :] if f.subject == e.subject)
        if e.seq >= base and later < keep:
            out.append(e.seq)
    return out


@settings(max_examples=150, deadline=None)
@given(
    subjects=st.lists(st.integers(0, 6), min_size=1, max_size=120),
    keep=st.integers(1, 3),
    capacity=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_the_ring_skips_exactly_what_the_stream_drops(
    subjects: list[int], keep: int, capacity: int, seed: int
) -> None:
    """Appended in batches of any size, past the ring's capacity (its lists are cut):
    the events a read of the ring sends are the ones the stream retains since its base."""
    events = [StreamMessage(i + 1, f"s.{k}", b"{}") for i, k in enumerate(subjects)]
    ring = _Ring(capacity, 1, keep)
    rnd = random.Random(seed)
    i = 0
    while i < len(events):
        n = rnd.randint(1, 9)
        ring.append(events[i : i + n])
        i += n
    read = ring.read(ring.base, len(events))
    assert [e.seq for e in read] == [e.seq for e in events if e.seq >= ring.base]
    sent = [e.seq for e in read if e.view(ALL) is not None]
    assert sent == retained(events, keep, ring.base)
    # the subject index tracks only what the ring holds: bounded by the ring, not the keys
    assert sum(len(v) for v in ring._slots.values()) == len(sent) <= capacity
    assert ring.count(ALL, ring.base, events[-1].seq + 1) == len(sent)


def test_a_ring_without_keep_sends_everything() -> None:
    ring = _Ring(10, 1)
    ring.append([StreamMessage(i, "s.a", b"{}") for i in range(1, 6)])
    assert [e.seq for e in ring.read(1, 10) if e.view(ALL) is not None] == [1, 2, 3, 4, 5]
    assert ring.superseded == 0 and not ring._slots


@pytest.mark.parametrize("inline", [False, True], ids=["pump", "inline"])
@pytest.mark.parametrize("keep", [1, 2])
async def test_a_warm_feed_replays_the_latest_per_key_then_the_live_tail(
    keep: int, inline: bool
) -> None:
    """A first subscriber sees every event as it comes (it was there); a second one
    `from: "all"` of the running feed gets the last `keep` events of every key, then
    what comes next. Clients served in the feed's pass (`inline`) or by their pumps."""
    INLINE[0] = inline
    mem = MemStream()
    keys = [f"N{i}" for i in range(5)]
    feed = Feed("planes", mem.open, fetch_timeout_s=0.05, keep=keep)
    first = Client()
    t1 = await run(feed, first, 1, mem)
    for r in range(3):  # a round at a time, each seen by `first` before the next
        publish_keys(mem, keys, r)
        await await_until(lambda r=r: len(first.seqs) == 5 * (r + 1), timeout=5)
    assert first.seqs == list(range(1, 16))
    assert mem.opened == [1]  # one reader: the second subscriber is served from the ring
    second = Client()
    t2 = await run(feed, second, 1, mem)
    want = list(range(16 - 5 * keep, 16))  # the last `keep` rounds
    await await_until(lambda: second.seqs == want, timeout=5)
    publish_keys(mem, keys[:1], 3)  # the live tail
    await await_until(lambda: second.seqs[-1:] == [16] and first.seqs[-1:] == [16], timeout=5)
    assert second.seqs == [*want, 16] and first.seqs == list(range(1, 17))
    assert feed.counters["history_readers"] == 0
    assert feed.stats()["superseded"] == 5 * (3 - keep) + 1
    await finish(feed, t1, t2)
