"""Group commit: concurrent submitters share one flush (one LevelDB batch, one Ray call).

`GroupCommitPolicy` is the pure rule (count, size or the oldest member's wait);
`GroupCommitter` needs only an event loop, and bounds what may wait by `max_pending_events`
so an overloaded collector answers 503 instead of queueing without end.
"""

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

import msgspec

from runtime.data.events import Event
from runtime.errors import TierflowError

__all__ = [
    "GroupCommitPolicy",
    "GroupCommitter",
    "Overloaded",
    "event_bytes",
    "take_batches",
]


def take_batches(waiting: deque[list[Event]], max_events: int) -> list[Event]:
    """Group commit of bridge hand-offs: the batches waiting, oldest first and each whole,
    joined into one call of at most `max_events` (the first batch always, however big).
    Order is kept: a batch never overtakes an older one."""
    out: list[Event] = []
    while waiting and (not out or len(out) + len(waiting[0]) <= max_events):
        out.extend(waiting.popleft())
    return out


class Overloaded(TierflowError):
    """Too many events already waiting to be flushed, or the committer is closing.

    The caller answers 503 with Retry-After; nothing of the refused request was taken.
    """


def event_bytes(event: Event) -> int:
    """An event's approximate size in a batch (what `max_bytes` counts)."""
    return len(event.data) + len(event.id) + len(event.subject) + len(event.token) + 16


class GroupCommitPolicy(msgspec.Struct, frozen=True):
    """When an open batch is flushed: count, size, or the oldest member's wait.

    `max_delay_ms = 0` means natural batching: flush as soon as the flusher is free,
    so batches grow only while a flush is in flight.
    """

    max_events: int = 1000
    max_bytes: int = 4 << 20
    max_delay_ms: float = 2.0

    def __post_init__(self) -> None:
        if self.max_events < 1 or self.max_bytes < 1 or self.max_delay_ms < 0:
            raise ValueError(f"bad group commit policy {self!r}")

    def should_flush(self, pending_events: int, pending_bytes: int, oldest_wait_ms: float) -> bool:
        """True if a batch this big, whose oldest member has waited this long, must go."""
        if pending_events <= 0:
            return False
        return (
            pending_events >= self.max_events
            or pending_bytes >= self.max_bytes
            or oldest_wait_ms >= self.max_delay_ms
        )

    def wait_ms(self, oldest_wait_ms: float) -> float:
        """How much longer the oldest member may wait before its batch is due."""
        return max(0.0, self.max_delay_ms - oldest_wait_ms)


R = TypeVar("R")


class _Batch:
    __slots__ = ("events", "nbytes", "opened", "future")

    def __init__(self, future: asyncio.Future[Any], opened: float) -> None:
        self.events: list[Event] = []
        self.nbytes = 0
        self.opened = opened
        self.future = future


def _consume_exception(fut: asyncio.Future[Any]) -> None:
    """Mark a batch's error as seen even if every submitter was cancelled."""
    if not fut.cancelled():
        fut.exception()


class GroupCommitter(Generic[R]):
    """Concurrent submitters share one `flush` call; each gets that call's result.

    Guarantees:
    - A submission is never split: its events are in one flush, contiguous, in
      submission order. A submission of `policy.max_events` or more is flushed alone.
    - Flushes start in the order their batches closed; at most `max_in_flight` run at
      once (1: strictly one after another). While they run, the next batch keeps
      filling (up to the policy's size bounds). A flush that ends starts the next due
      batch's flush before its own submitters resume.
    - Every submitter of a batch gets `flush`'s return value, or its exception.
    - At most `max_pending_events` events are held (waiting or in flight); past that,
      `submit` raises `Overloaded` at once. A single request larger than the bound
      can never be accepted, so keep the per-request limit at or below it.
    - A cancelled submitter does not withdraw its events: they may still be flushed.

    Ordering with `max_in_flight` > 1: flushes may finish out of order, so a later batch
    can be answered (and handed to a bridge) before an earlier one. Kept: a submission's
    events are contiguous and in order in one flush, and a submission made after another
    was answered is flushed after it. Nothing downstream relies on more: the log keys
    entries by (stream, id) and appends are idempotent; the bridge's calls already run
    concurrently and exactly-once rests on each event's Nats-Msg-Id; the replayer picks
    entries by age (`received_ms`), not by log order. The collector keeps 1: with two in
    flight, flushes came out smaller and slower on two cores (docs/benchmarks.md).

    Example::

        committer = GroupCommitter(logger_group.append, GroupCommitPolicy(500, 4 << 20, 2))
        await committer.submit(events)   # returns when this batch is on every replica
    """

    def __init__(
        self,
        flush: Callable[[list[Event]], Awaitable[R]],
        policy: GroupCommitPolicy,
        *,
        max_pending_events: int = 100_000,
        max_in_flight: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_pending_events < 1 or max_in_flight < 1:
            raise ValueError("max_pending_events and max_in_flight must be >= 1")
        self._flush = flush
        self.policy = policy
        self.max_pending_events = max_pending_events
        self.max_in_flight = max_in_flight
        self._clock = clock
        self._open: _Batch | None = None
        self._ready: deque[_Batch] = deque()
        self._pending = 0
        self._in_flight = 0
        self._closing = False
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.flushes = 0
        self.rejected = 0

    @property
    def pending_events(self) -> int:
        """Events accepted and not yet answered (waiting or being flushed)."""
        return self._pending

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def submit(self, events: Sequence[Event]) -> R:
        """Flush `events` with whatever else arrives in the window; return the flush result.

        Raises `Overloaded` (nothing taken) or whatever the batch's flush raised.
        """
        return await self.enqueue(events)

    def enqueue(self, events: Sequence[Event]) -> asyncio.Future[R]:
        """`submit` in two steps: take `events` into the open batch and wake the flusher
        now, before the caller runs anything else; await the returned future for the
        flush result. So a caller can do synchronous work (HML's logic) while its events
        are already in the batch and the batch's delay is already counting.

        Raises `Overloaded` at once (nothing taken). Await the future: it carries the
        flush's exception, and cancelling it does not withdraw the events (as `submit`).
        """
        n = len(events)
        if n == 0:
            raise ValueError("submit needs at least one event")
        if self._closing:
            raise Overloaded("group committer is closing")
        if self._pending + n > self.max_pending_events:
            self.rejected += 1
            raise Overloaded(
                f"{self._pending} events pending, {n} more would pass {self.max_pending_events}"
            )
        loop = asyncio.get_running_loop()
        self._start(loop)
        size = sum(event_bytes(e) for e in events)
        policy = self.policy
        batch = self._open
        if batch is not None and (
            len(batch.events) + n > policy.max_events or batch.nbytes + size > policy.max_bytes
        ):
            self._seal()
            batch = None
        if batch is None:
            batch = self._open = _Batch(loop.create_future(), self._clock())
            batch.future.add_done_callback(_consume_exception)
        batch.events.extend(events)
        batch.nbytes += size
        self._pending += n
        if len(batch.events) >= policy.max_events or batch.nbytes >= policy.max_bytes:
            self._seal()
        assert self._wake is not None
        self._wake.set()
        return asyncio.shield(batch.future)

    async def aclose(self) -> None:
        """Flush what is pending, wait for it, and refuse further submits."""
        self._closing = True
        if self._driver is None:
            return
        assert self._wake is not None
        self._wake.set()
        await asyncio.shield(self._driver)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._driver is None or self._driver.done():
            self._wake = asyncio.Event()
            self._driver = loop.create_task(self._drive(), name="group-commit")

    def _seal(self) -> None:
        if self._open is not None:
            self._ready.append(self._open)
            self._open = None

    async def _drive(self) -> None:
        """Close batches when the policy says so and start flushes while slots are free."""
        wake = self._wake
        assert wake is not None
        try:
            while True:
                wake.clear()
                timeout = self._advance()
                if self._closing and self._open is None and not self._ready and not self._in_flight:
                    return
                if timeout is None or timeout > 0:
                    try:
                        async with asyncio.timeout(timeout):
                            await wake.wait()
                    except TimeoutError:
                        pass
        except BaseException as err:
            self._fail_all(err)
            raise

    def _advance(self) -> float | None:
        """Close the open batch if the policy says so and start flushes while slots are
        free; the seconds until the open batch is due (None: nothing to time)."""
        timeout: float | None = None
        batch = self._open
        if batch is not None and self._in_flight < self.max_in_flight:
            waited = (self._clock() - batch.opened) * 1000.0
            if self._closing or self.policy.should_flush(len(batch.events), batch.nbytes, waited):
                self._seal()
            else:
                timeout = self.policy.wait_ms(waited) / 1000.0
        while self._ready and self._in_flight < self.max_in_flight:
            self._launch(self._ready.popleft())
        return timeout

    def _launch(self, batch: _Batch) -> None:
        self._in_flight += 1
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: _Batch) -> None:
        result: Any = None
        error: Exception | None = None
        try:
            result = await self._flush(batch.events)
        except asyncio.CancelledError:
            batch.future.cancel()
            raise
        except Exception as err:
            error = err
        finally:
            self._in_flight -= 1
            self._pending -= len(batch.events)
            self.flushes += 1
            if self._wake is not None:
                self._wake.set()
        # The next due flush starts before this batch's submitters resume: what they do
        # next (answer, hand off, RBML's logic) then runs while that write is in flight,
        # instead of ahead of it.
        try:
            if self._driver is not None and not self._driver.done():
                self._advance()
        finally:
            if not batch.future.done():
                if error is not None:
                    batch.future.set_exception(error)
                else:
                    batch.future.set_result(result)

    def _fail_all(self, err: BaseException) -> None:
        """The driver died: answer every waiting submitter instead of leaving it hanging."""
        failure = err if isinstance(err, Exception) else Overloaded("group committer stopped")
        batches = list(self._ready) + ([self._open] if self._open is not None else [])
        self._ready.clear()
        self._open = None
        for batch in batches:
            self._pending -= len(batch.events)
            if not batch.future.done():
                batch.future.set_exception(failure)
