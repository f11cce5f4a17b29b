"""n:1 fan-out (book ch. 8-9): one JetStream consumer per stream feeds every local client.

A `Feed` reads one stream through ONE ephemeral pull consumer, started at the oldest
position its first subscribers need (minus a backfill, so clients that resume a little
earlier are served from memory too), and keeps the latest `ring_size` events in a ring.
Each `Subscriber` is only a position in that ring: the feed never copies an event per
client, and a client's sender reads the ring at the client's own pace.

One wake per batch, not per client: a subscriber whose pump waits at the head is parked
with the feed, and when a batch arrives the feed serves every parked subscriber in place,
in one pass, through its `deliver_now` (a write that cannot wait: the protocol's socket
takes it now or it refuses). Only a subscriber that cannot be served that way (a paused
socket, a rate limit, a full ack window, no `deliver_now`) has its own pump woken, which
delivers at the client's own pace; so a slow socket never holds the pass up.

Bounded per client: a subscriber may be at most `LagPolicy.max_lag` stream messages behind
the feed, counting what the feed has held for at least one lag check (`lag_every_s`), so a
burst the client drains at once is not lag. Past `warn_lag` it is warned in-stream (how far
behind, what will happen), at most once per `warn_every_s`; past `max_lag` its policy
applies: `drop_oldest` skips it ahead to the newest events (it is told how many were
dropped), `disconnect` cuts it off (4408). Other clients never wait for a slow one: the feed
does not block on any subscriber.

A subscriber that starts further back than the ring (or with a backlog larger than the warn
level) is catching up: its lag policy is off until it is within `warn_lag` of the head, and
what the ring no longer holds it reads through a private, short-lived history reader at its
own pace (so does a live subscriber within its lag bound that the ring trimmed past).

On a compacted stream (`[streams.X.compact]`) the ring drops what the stream drops: an
event with `keep` newer ones of its key (its subject) is skipped by every later read of
the ring, so a `from: "all"` served from a running feed gets the latest per key, as one
served by JetStream does.
Rewinding the shared consumer instead would make every live client wait for the slowest
history reader.

Everything here runs on one event loop; I/O is behind the `Reader` protocol
(actors/access/messages.py; JetStream's is actors/access/reader.py), so the policy and the
ring are tested with an in-memory reader.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Literal

import msgspec

from actors.access.messages import OpenReader, Reader, StreamMessage
from runtime.config import Overflow
from runtime.data.query import Filter

log = logging.getLogger(__name__)

__all__ = [
    "Feed",
    "Hub",
    "LagPolicy",
    "Subscriber",
    "TokenBucket",
    "Verdict",
    "judge_lag",
]

Verdict = Literal["ok", "warn", "overflow"]
_NOT_PARKED: Any = object()


# --------------------------------------------------------------------------- policy


class LagPolicy(msgspec.Struct, frozen=True):
    """How far behind a client may fall (in stream messages) and what happens then."""

    max_lag: int = 2048
    warn_lag: int = 1024
    warn_every_s: float = 1.0
    overflow: Overflow = "disconnect"

    def __post_init__(self) -> None:
        if not 0 < self.warn_lag <= self.max_lag:
            raise ValueError(f"need 0 < warn_lag <= max_lag, got {self.warn_lag}/{self.max_lag}")

    @property
    def keep_after_drop(self) -> int:
        """drop_oldest keeps this many of the newest messages, so it does not flap."""
        return max(1, self.warn_lag // 2)


def judge_lag(policy: LagPolicy, behind: int, since_warned_s: float) -> Verdict:
    """What a client `behind` messages behind gets now (pure)."""
    if behind > policy.max_lag:
        return "overflow"
    if behind >= policy.warn_lag and since_warned_s >= policy.warn_every_s:
        return "warn"
    return "ok"


class TokenBucket:
    """A rate limit (a client's slow-down request): `take(n)` waits until n tokens exist."""

    def __init__(
        self, rate: float, burst: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        self.rate = rate
        self.burst = burst if burst is not None else max(1.0, rate / 10)
        self._clock = clock
        self._tokens = self.burst
        self._at = clock()

    def delay(self, n: int) -> float:
        """Seconds to wait before `n` tokens exist, taking them (pure but for the clock)."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        self._tokens -= n
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate

    async def take(self, n: int) -> None:
        wait = self.delay(n)
        if wait > 0:
            await asyncio.sleep(wait)


# --------------------------------------------------------------------------- ring


class _Superseded(StreamMessage):
    """A ring slot whose event newer events of its key replaced (a compacted stream): a
    reader handles it as filtered out, so it moves past it and sends nothing."""

    __slots__ = ()

    def __init__(self, ev: StreamMessage) -> None:
        super().__init__(ev.seq, ev.subject, b"")

    def view(self, flt: Filter) -> bytes | None:
        return None


class _Ring:
    """The latest events of a stream: holds EVERY stream message with seq in [base, end).

    With `keep` (a compacted stream: JetStream keeps the last `keep` messages per
    subject) an event with `keep` newer ones of its subject in the ring is superseded, as
    JetStream drops it: its slot becomes a `_Superseded`, so a replay from the ring sends
    what a read of the stream would (the latest per key), not what the feed once read.
    A subscriber that already read the event has had it, which is right for a live one.
    """

    def __init__(self, capacity: int, base: int, keep: int | None = None) -> None:
        self.capacity = capacity
        self.base = base
        self.keep = keep
        self._events: list[StreamMessage] = []
        self._seqs: list[int] = []
        self._head = 0
        self._cut = 0  # slots deleted from the front of the lists: absolute slot = index + _cut
        # compacted only: subject -> absolute slots of its newest events in the ring, oldest first
        self._slots: dict[str, deque[int]] = {}
        self.superseded = 0

    def __len__(self) -> int:
        return len(self._events) - self._head

    def append(self, events: Sequence[StreamMessage]) -> None:
        start = len(self._events)
        self._events.extend(events)
        self._seqs.extend(e.seq for e in events)
        if self.keep is not None:
            self._supersede(start)
        over = len(self) - self.capacity
        if over > 0:
            if self.keep is not None:
                self._forget(self._head, self._head + over)
            self._head += over
            self.base = self._seqs[self._head - 1] + 1
            if self._head > self.capacity:
                del self._events[: self._head]
                del self._seqs[: self._head]
                self._cut += self._head
                self._head = 0

    def _supersede(self, start: int) -> None:
        """Mark what the events appended from index `start` on replaced."""
        keep, slots, evs, cut = self.keep, self._slots, self._events, self._cut
        assert keep is not None
        for i in range(start, len(evs)):
            subject = evs[i].subject
            held = slots.get(subject)
            if held is None:
                slots[subject] = held = deque()
            held.append(i + cut)
            if len(held) > keep:
                j = held.popleft() - cut
                if j >= self._head:
                    evs[j] = _Superseded(evs[j])
                    self.superseded += 1

    def _forget(self, lo: int, hi: int) -> None:
        """Slots [lo, hi) leave the ring: their subjects stop tracking them."""
        slots, evs, cut = self._slots, self._events, self._cut
        for i in range(lo, hi):
            subject = evs[i].subject
            held = slots.get(subject)
            if held and held[0] == i + cut:  # a superseded slot is no longer tracked
                held.popleft()
                if not held:
                    del slots[subject]

    def read(self, seq: int, limit: int) -> list[StreamMessage]:
        """Events with seq >= `seq` (which must be >= base), at most `limit`."""
        i = bisect.bisect_left(self._seqs, seq, self._head)
        return self._events[i : i + limit]

    def last(self) -> StreamMessage | None:
        return self._events[-1] if len(self) else None

    def count(self, flt: Filter, start: int, end: int) -> int:
        """How many events in [start, end) match `flt`."""
        i = bisect.bisect_left(self._seqs, max(start, self.base), self._head)
        j = bisect.bisect_left(self._seqs, end, self._head)
        return sum(1 for e in self._events[i:j] if e.view(flt) is not None)


# --------------------------------------------------------------------------- subscriber


class Subscriber:
    """One client subscription: a position in a feed, a filter and a lag policy.

    The protocol layer gives it `deliver(batch)` (write these (event, data JSON) pairs to the
    client) and optionally `deliver_now(batch) -> bool` (write them without waiting, or
    refuse with False having written nothing), and is told about lag through
    `on_lag(behind)`, `on_dropped(count, first, last)` and `on_overflow(behind)` (cut the
    client off). `delivered` is the last sequence handled (written, or filtered out);
    `on_progress(seq)` reports it as it moves. With `ack_window` the client acknowledges
    (`ack(seq)`), at most `ack_window` events stay unacknowledged, and progress is the last
    acknowledged sequence.
    """

    def __init__(
        self,
        sid: str,
        flt: Filter,
        policy: LagPolicy,
        *,
        deliver: Callable[[list[tuple[StreamMessage, bytes]]], Awaitable[None]],
        on_lag: Callable[[int], None] = lambda behind: None,
        on_dropped: Callable[[int, int, int], None] = lambda count, first, last: None,
        on_overflow: Callable[[int], None] = lambda behind: None,
        on_progress: Callable[[int], None] = lambda seq: None,
        ack_window: int | None = None,
        batch: int = 64,
        clock: Callable[[], float] = time.monotonic,
        deliver_now: Callable[[list[tuple[StreamMessage, bytes]]], bool] | None = None,
    ) -> None:
        self.sid = sid
        self.filter = flt
        self.policy = policy
        self._deliver = deliver
        self._deliver_now = deliver_now
        self._feed: Feed | None = None
        self._waiter: asyncio.Future[None] | None = None  # set while parked with the feed
        self._on_lag = on_lag
        self._on_dropped = on_dropped
        self._on_overflow = on_overflow
        self._on_progress = on_progress
        self.ack_window = ack_window
        self.batch = batch
        self._clock = clock
        self.next_seq = 0
        self.delivered = 0
        self.catching_up = False
        self.closed = False
        self.overflowed = False
        self.limiter: TokenBucket | None = None
        self._gen = 0  # bumped when the position is moved from outside the pump
        self._writing = 0  # last seq of the batch handed to deliver
        self._warned_at = float("-inf")
        self._unacked: list[int] = []
        self._acked = asyncio.Event()
        self.acked = 0
        self.sent = 0
        self.dropped = 0
        self.warnings = 0

    # ---- called by the feed (lag checks) ----------------------------------------------

    def behind(self, position: int) -> int:
        return max(0, position - self.next_seq)

    def check_lag(self, feed: Feed, aged_position: int) -> None:
        """Judge the backlog the client had time to take: what the feed held at the previous
        check (`aged_position`) and it has not been sent yet. A burst the client drains in a
        moment is no lag; the warning reports the full distance to the head."""
        if self.closed or self.catching_up or self.overflowed:
            return
        aged = self.behind(aged_position)
        verdict = judge_lag(self.policy, aged, self._clock() - self._warned_at)
        if verdict == "warn":
            self._warned_at = self._clock()
            self.warnings += 1
            self._on_lag(self.behind(feed.position))
        elif verdict == "overflow":
            self.overflow(feed, self.behind(feed.position))

    def overflow(self, feed: Feed, behind: int) -> None:
        """Too far behind: apply the policy."""
        if self.policy.overflow == "disconnect":
            self.overflowed = True
            self.warnings += 1
            self._on_lag(behind)  # a burst may skip the warn band: always warn before the cut
            self._on_overflow(behind)
            self.close()
            return
        target = max(feed.ring.base, feed.position - self.policy.keep_after_drop)
        first = max(self.next_seq, self._writing + 1)  # a batch being written is not dropped
        if target <= first:
            return
        count = feed.ring.count(self.filter, first, target) + max(0, feed.ring.base - first)
        self.next_seq = target
        self._gen += 1
        self.dropped += count
        self._on_dropped(count, first, target - 1)
        feed.wake_one(self)

    # ---- client acks ------------------------------------------------------------------

    @property
    def ack_limit(self) -> int:
        """The highest sequence a client may acknowledge: the last one handed to it (a
        batch being written counts, its frames may already be read)."""
        return max(self.delivered, self._writing)

    def ack(self, seq: int) -> bool:
        """Cumulative: acknowledges every event delivered up to `seq`. An ack past what was
        delivered is refused (False) and changes nothing: it would move the cursor over
        events the client never got."""
        if seq > self.ack_limit:
            return False
        i = bisect.bisect_right(self._unacked, seq)
        if i:
            del self._unacked[:i]
        if seq > self.acked:
            self.acked = seq
            self._on_progress(seq)
        self._acked.set()
        return True

    async def _window(self, n: int) -> None:
        assert self.ack_window is not None
        while len(self._unacked) + n > self.ack_window and self._unacked and not self.closed:
            self._acked.clear()
            await self._acked.wait()

    # ---- the pump ---------------------------------------------------------------------

    def close(self) -> None:
        self.closed = True
        self._acked.set()

    async def pump(self, feed: Feed, history: OpenReader) -> None:
        """Deliver from `next_seq` on until closed: from the ring, or through a private
        history reader while the ring no longer holds what this subscriber needs."""
        reader: Reader | None = None
        reader_seq = -1
        try:
            while not self.closed:
                if feed.stopped:
                    self.close()
                    break
                gen = self._gen
                if self.next_seq < feed.ring.base and feed.position > self.next_seq:
                    behind = self.behind(feed.position)
                    if not self.catching_up and behind > self.policy.max_lag:
                        self.overflow(feed, behind)
                        continue
                    if reader is None or reader_seq != self.next_seq:
                        if reader is not None:
                            await feed.close_history(reader)
                        reader = None
                        reader = await feed.open_history(history, self.next_seq)
                        reader_seq = self.next_seq
                    try:
                        events = await reader.fetch(self.batch, 1.0)
                    except Exception as err:  # noqa: BLE001 - its server went: read elsewhere
                        log.info(
                            "%s: history read at %d: %r; reopening", self.sid, self.next_seq, err
                        )
                        await feed.close_history(reader)
                        reader = None
                        await asyncio.sleep(0.2)
                        continue
                    if not events:
                        continue
                else:
                    if reader is not None:
                        await feed.close_history(reader)
                        reader = None
                    events = feed.ring.read(self.next_seq, self.batch)
                    if not events:
                        self.catching_up = False
                        await feed.park(self)
                        continue
                await self._send(events, gen)
                if self._gen == gen:
                    reader_seq = self.next_seq
                if self.catching_up and self.behind(feed.position) < self.policy.warn_lag:
                    self.catching_up = False  # near the head: live, the lag policy applies
        finally:
            if reader is not None:
                await feed.close_history(reader)

    async def _send(self, events: list[StreamMessage], gen: int) -> None:
        flt = self.filter
        out: list[tuple[StreamMessage, bytes]] = []
        for ev in events:
            if ev.seq < self.next_seq:
                continue
            body = ev.view(flt)
            if body is not None:
                out.append((ev, body))
        last = events[-1].seq
        if out:
            if self.limiter is not None:
                await self.limiter.take(len(out))
            if self.ack_window is not None:
                await self._window(len(out))
            if self.closed or self._gen != gen:
                return
            self._writing = out[-1][0].seq
            await self._deliver(out)
            self._sent(out)
        if self.closed or self._gen != gen:
            return
        self._advance(last)

    def serve_inline(self, feed: Feed) -> bool:
        """Deliver, in place and without waiting, what the feed holds past this parked
        subscriber's position. True: done (or nothing to do), it stays parked. False: its
        pump must run: nothing was written (a paused or closed socket, a rate limit, an ack
        window without room, a position the ring no longer holds), or more is left than
        one pass takes."""
        if (
            self._deliver_now is None
            or self.closed
            or self.catching_up
            or self.limiter is not None
            or self.next_seq < feed.ring.base
        ):
            return False
        events = feed.ring.read(self.next_seq, feed.batch)
        if not events:
            return True
        flt = self.filter
        out = [(ev, body) for ev in events if (body := ev.view(flt)) is not None]
        if out:
            window = self.ack_window
            if window is not None and self._unacked and len(self._unacked) + len(out) > window:
                return False
            try:
                written = self._deliver_now(out)
            except Exception:  # noqa: BLE001 - the pump retries it the slow way and ends there
                log.debug("deliver_now of %s failed", self.sid, exc_info=True)
                return False
            if not written:
                return False
            self._writing = out[-1][0].seq
            self._sent(out)
        self._advance(events[-1].seq)
        return self.next_seq >= feed.position

    def _sent(self, out: list[tuple[StreamMessage, bytes]]) -> None:
        self.sent += len(out)
        if self.ack_window is not None:
            self._unacked.extend(e.seq for e, _ in out)

    def _advance(self, last: int) -> None:
        """Everything up to `last` is handled (written or filtered out)."""
        first = self.next_seq
        self.next_seq = last + 1
        self.delivered = last
        if self.ack_window is None:
            self._on_progress(last)
        elif not self._unacked and last > self.acked:
            self.acked = last  # everything sent is acknowledged; the rest was filtered out
            self._on_progress(last)
        if self._feed is not None:
            self._feed.reached(self, first, last)


# --------------------------------------------------------------------------- feed


class Feed:
    """One stream, one consumer, many subscribers (see the module doc)."""

    def __init__(
        self,
        name: str,
        open_reader: OpenReader,
        *,
        ring_size: int = 8192,
        backfill: int = 4096,
        batch: int = 512,
        fetch_timeout_s: float = 1.0,
        lag_every_s: float = 0.1,
        idle_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        on_stop: Callable[[Feed], None] = lambda feed: None,
        keep: int | None = None,
    ) -> None:
        self.name = name
        self._open = open_reader
        self.ring = _Ring(ring_size, 0, keep)
        self.backfill = min(backfill, ring_size // 2)
        self.batch = batch
        self.fetch_timeout_s = fetch_timeout_s
        self.lag_every_s = lag_every_s
        self.idle_s = idle_s
        self._clock = clock
        self._on_stop = on_stop
        self.position = 0
        self.subs: set[Subscriber] = set()
        self.pollers = 0
        self.stopped = False
        self._task: asyncio.Task[None] | None = None
        self._changed: asyncio.Future[None] | None = None
        self._wake = asyncio.Event()
        self._last_lag_check = 0.0
        self._checked_position = 0  # the position at the previous lag check
        self._idle_since = clock()
        self.history_open = 0
        self._parked: dict[Subscriber, None] = {}  # insertion-ordered: served in that order
        # the spread of the newest batch: from its arrival to its last subscriber's write
        self._spread_end = 0
        self._spread_t0 = 0.0
        self._spread_left: set[Subscriber] = set()
        self.spread_ms: deque[float] = deque(maxlen=256)
        self.counters = {
            "read": 0,
            "reopens": 0,
            "read_errors": 0,
            "history_readers": 0,
            "catchups": 0,
            "served_inline": 0,
            "pump_wakes": 0,
            "spread_batches": 0,
            "spread_unfinished": 0,
        }

    # ---- lifecycle --------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._task is not None

    def start(self, start_seq: int) -> None:
        """Start reading at `start_seq - backfill` (the oldest position worth keeping)."""
        if self._task is not None:
            return
        first = max(1, start_seq - self.backfill)
        self.position = self._checked_position = first
        self.ring.base = first
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"feed-{self.name}")

    async def stop(self) -> None:
        self.stopped = True
        self.wake()
        for sub in list(self.subs):
            sub.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def wake(self) -> None:
        """Wake every waiting subscriber and poller (new events, or a position moved)."""
        self._wake_pollers()
        for sub in list(self._parked):
            self.wake_one(sub)

    def _wake_pollers(self) -> None:
        fut, self._changed = self._changed, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def wake_one(self, sub: Subscriber) -> None:
        """Wake `sub`'s pump if it is parked (its position moved, or it must serve itself)."""
        if self._parked.pop(sub, _NOT_PARKED) is _NOT_PARKED:
            return
        fut = sub._waiter
        if fut is not None and not fut.done():
            fut.set_result(None)
            self.counters["pump_wakes"] += 1

    async def park(self, sub: Subscriber) -> None:
        """Wait, as `sub`'s pump, until the feed is past `sub.next_seq - 1` and `sub` must
        serve itself; while parked, each new batch is delivered to it in place
        (`Subscriber.serve_inline`) and it stays parked."""
        if self.position > sub.next_seq or self.stopped or sub.closed:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        sub._waiter = fut
        self._parked[sub] = None
        try:
            await fut
        finally:
            sub._waiter = None
            self._parked.pop(sub, None)

    async def wait_change(self, next_seq: int, timeout: float | None = None) -> bool:
        """Wait until the feed is past `next_seq - 1` (or anything changed); False on timeout."""
        if self.position > next_seq or self.stopped:
            return True
        if self._changed is None or self._changed.done():
            self._changed = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._changed), timeout)
        except TimeoutError:
            return False
        return True

    # ---- subscribers ------------------------------------------------------------------

    def attach(self, sub: Subscriber, start_seq: int) -> None:
        """Serve `sub` from `start_seq` on (the feed starts if it was not running)."""
        self.start(start_seq)
        sub._feed = self
        sub.next_seq = start_seq
        sub.delivered = start_seq - 1
        sub.acked = start_seq - 1
        sub.catching_up = self.position - start_seq >= sub.policy.warn_lag or (
            start_seq < self.ring.base
        )
        if sub.catching_up:
            self.counters["catchups"] += 1
        self.subs.add(sub)
        self._idle_since = self._clock()

    def detach(self, sub: Subscriber) -> None:
        sub.close()
        self.subs.discard(sub)
        self.wake_one(sub)
        self._wake_pollers()
        self._spread_left.discard(sub)  # not timed: the batch was not written to it
        if not self.subs and not self.pollers:
            self._idle_since = self._clock()

    async def open_history(self, history: OpenReader, start_seq: int) -> Reader:
        self.counters["history_readers"] += 1
        self.history_open += 1
        try:
            return await history(start_seq)
        except BaseException:
            self.history_open -= 1
            raise

    async def close_history(self, reader: Reader) -> None:
        self.history_open -= 1
        with contextlib.suppress(Exception):
            await reader.close()

    @contextlib.contextmanager
    def poller(self) -> Iterator[None]:
        """Held by a long poll while it waits: keeps the feed from stopping as idle."""
        self.pollers += 1
        try:
            yield
        finally:
            self.pollers -= 1
            self._idle_since = self._clock()

    # ---- the reading loop -------------------------------------------------------------

    async def _run(self) -> None:
        reader: Reader | None = None
        failures = 0
        try:
            while not self.stopped:
                if reader is None:
                    try:
                        reader = await self._open(self.position)
                        failures = 0
                    except Exception as err:  # noqa: BLE001 - NATS may be restarting
                        failures += 1
                        self.counters["read_errors"] += 1
                        log.info("feed %s: open at %d: %r", self.name, self.position, err)
                        await asyncio.sleep(min(2.0, 0.1 * 2**failures))
                        continue
                try:
                    events = await reader.fetch(self.batch, self.fetch_timeout_s)
                except Exception as err:  # noqa: BLE001 - reopen from the same position
                    self.counters["read_errors"] += 1
                    self.counters["reopens"] += 1
                    log.info("feed %s: read at %d: %r; reopening", self.name, self.position, err)
                    with contextlib.suppress(Exception):
                        await reader.close()
                    reader = None
                    await asyncio.sleep(0.2)
                    continue
                if events:
                    self._dispatch(events)
                self._check_lag()
                if self._idle():
                    break
        finally:
            self.stopped = True
            self._on_stop(self)
            self.wake()
            if reader is not None:
                with contextlib.suppress(Exception):
                    await reader.close()

    def _dispatch(self, events: list[StreamMessage]) -> None:
        """One pass per batch: parked subscribers are served in place, the rest woken."""
        events = [e for e in events if e.seq >= self.position]
        if not events:
            return
        self._spread_start(events[-1].seq)
        self.ring.append(events)
        self.position = events[-1].seq + 1
        self.counters["read"] += len(events)
        served = 0
        for sub in list(self._parked):
            if sub._waiter is None or sub._waiter.done():
                continue
            if sub.serve_inline(self):
                served += 1
            else:
                self.wake_one(sub)
        self.counters["served_inline"] += served
        self._wake_pollers()

    # ---- the spread: a batch's arrival to its last live subscriber's write ------------

    def _spread_start(self, end: int) -> None:
        if self._spread_left:
            self.counters["spread_unfinished"] += 1  # a newer batch came first
        self._spread_end = end
        self._spread_t0 = self._clock()
        self._spread_left = {
            s for s in self.subs if not (s.closed or s.catching_up) and s.next_seq <= end
        }

    def reached(self, sub: Subscriber, first: int, last: int) -> None:
        """`sub` has handled [first, last]: it is done with the batch being timed if that
        range holds the batch's last sequence."""
        if first <= self._spread_end <= last:
            self._spread_done(sub)

    def _spread_done(self, sub: Subscriber) -> None:
        left = self._spread_left
        if sub in left:
            left.discard(sub)
            if not left:
                self.spread_ms.append((self._clock() - self._spread_t0) * 1000)
                self.counters["spread_batches"] += 1

    def _check_lag(self) -> None:
        now = self._clock()
        if now - self._last_lag_check < self.lag_every_s:
            return
        self._last_lag_check = now
        aged, self._checked_position = self._checked_position, self.position
        position = self.position
        for sub in list(self.subs):
            if sub.closed:
                self.subs.discard(sub)
            elif sub.next_seq < position:  # one at the head is behind by nothing: "ok"
                sub.check_lag(self, aged)

    def _idle(self) -> bool:
        if self.subs or self.pollers:
            return False
        return self._clock() - self._idle_since >= self.idle_s

    def stats(self) -> dict[str, Any]:
        last = self.ring.last()
        return {
            **self.counters,
            "position": self.position,
            "ring_base": self.ring.base,
            "ring_events": len(self.ring),
            "superseded": self.ring.superseded,
            "last_seq": last.seq if last else None,
            "subscribers": len(self.subs),
            "catching_up": sum(1 for s in self.subs if s.catching_up),
            "pollers": self.pollers,
            "history_open": self.history_open,
            "consumers": 1 + self.history_open if self.started and not self.stopped else 0,
            "parked": len(self._parked),
            "spread_recent_ms": [round(ms, 2) for ms in self.spread_ms],
        }


class Hub:
    """The feeds of one gateway replica, by stream; a feed stops itself when idle.

    `keep_of(stream)` is the messages a compacted stream keeps per subject (None for any
    other stream): its feed's ring then replays what the stream retains (see `_Ring`)."""

    def __init__(
        self,
        open_reader: Callable[[str], OpenReader],
        keep_of: Callable[[str], int | None] = lambda stream: None,
        **feed_options: Any,
    ) -> None:
        self._open = open_reader
        self._keep_of = keep_of
        self._options = feed_options
        self.feeds: dict[str, Feed] = {}

    def feed(self, stream: str) -> Feed:
        feed = self.feeds.get(stream)
        if feed is None or feed.stopped:
            feed = Feed(
                stream,
                self._open(stream),
                on_stop=self._stopped,
                keep=self._keep_of(stream),
                **self._options,
            )
            self.feeds[stream] = feed
        return feed

    def _stopped(self, feed: Feed) -> None:
        if self.feeds.get(feed.name) is feed:
            del self.feeds[feed.name]

    async def stop(self) -> None:
        for feed in list(self.feeds.values()):
            await feed.stop()
        self.feeds.clear()

    def stats(self) -> dict[str, Any]:
        return {name: feed.stats() for name, feed in self.feeds.items()}
