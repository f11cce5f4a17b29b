"""Publishing event batches to JetStream with dedup ids and pipelined acks (bridge engine).

Every event goes out with `Nats-Msg-Id` = its id, so a resend with the same id inside the
stream's duplicate window is acknowledged as a duplicate instead of stored twice: retries
(owned by the caller, normally the logger's failed store) become exactly-once.

`JetStreamPublisher.publish_batch` keeps up to `max_in_flight` acks outstanding at once over
one reply-inbox subscription (the mechanism of nats-py's `publish_async`, minus its per-event
Future, nuid, done callbacks and generic JSON parsing, and plus the ack timeout it lacks).
Guarantees:

- every input event is reported exactly once, either `Published` or `Failed`, in input order;
- no per-event failure raises;
- an event too big for the server's `max_payload` (headers included) is never sent (it
  would reset the connection and fail every publish in flight): it fails, not retryable;
- each event waits at most `ack_timeout` after it was sent; nothing is sent while the client
  is not connected (it fails at once, retryable), so a batch cannot stall on a dead server;
- at most `max_in_flight` events (across all concurrent batches) await an ack at any time.

`publish_atomic` gives the same guarantees for events bound for one stream, sent as
JetStream atomic batches (ADR-50): one commit round trip and one stored-together unit per
batch instead of one ack per event. The server's rules it follows (nats-server
server/stream.go `processJetStreamAtomicBatchMsg`, server/jetstream_batching.go, ADR-50):
every message carries `Nats-Batch-Id` (at most 64 chars) and `Nats-Batch-Sequence` 1..n
without gaps, the last also `Nats-Batch-Commit: 1`; a batch holds at most 1000 messages
(`max_batch_size`), each within the stream's size limits; 50 batches may be open per stream;
one without traffic for 10 s is abandoned unstored. Every message is checked (a stream
without `allow_atomic` refuses each one), so only the commit is sent as a request and its
reply is the verdict: a PubAck `{stream, seq: the last one, batch, count}` (the batch's
events hold the `count` sequences ending at `seq`) or an error. A `Nats-Msg-Id` the stream
already holds, or one twice in the batch, rejects the whole batch (err_code 10201); so
does any per-message refusal (10176 incomplete). Any refused batch is published again
event by event (`publish_batch`), which reports each event as above and turns a resend
into duplicate acks; a stream that refuses batching (10174, or a server that ignores the
headers) is remembered and gets per-event publishing. No commit reply within `ack_timeout`
or a lost connection: every event of the batch fails, retryable (a later resend is stored
once: a committed batch comes back 10201, then duplicates).

No Ray in here: a Ray actor wraps this class.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import secrets
from array import array
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from itertools import repeat
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from runtime.errors import TierflowError
from runtime.nats.publish import publish, raise_swallowed_cancel

MSG_ID_HEADER = "Nats-Msg-Id"
_STATUS_HEADER = "Status"
_NO_RESPONDERS = "503"
_RESERVOIR_SIZE = 8192
BATCH_ID_HEADER = "Nats-Batch-Id"
BATCH_SEQ_HEADER = "Nats-Batch-Sequence"
BATCH_COMMIT_HEADER = "Nats-Batch-Commit"
MAX_ATOMIC_BATCH = 1000  # nats-server's default max_batch_size (streamDefaultMaxAtomicBatchSize)
MAX_OPEN_BATCHES = 16  # below the server's 50 open atomic batches per stream
BATCHES_PER_STREAM = 2  # in flight per stream; what arrives meanwhile joins the next batch
NOT_ATOMIC_RECHECK_S = 300.0  # a stream that refused batching is asked again after this
# err_codes of an atomic commit (nats-server server/errors.json)
ERR_BATCH_DISABLED = 10174
ERR_BATCH_UNSUPPORTED_HEADER = 10177
ERR_BATCH_TOO_LARGE = 10199
ERR_BATCH_DUPLICATE = 10201


class Outgoing(msgspec.Struct, frozen=True):
    """One event to publish; `id` becomes the Nats-Msg-Id (the dedup key)."""

    id: str
    subject: str
    data: bytes
    headers: dict[str, str] = {}


class Published(msgspec.Struct, frozen=True):
    """JetStream stored the event (or already had it: `duplicate`) at stream sequence `seq`."""

    id: str
    stream: str
    seq: int
    duplicate: bool


class Failed(msgspec.Struct, frozen=True):
    """No ack for the event. `retryable`: the event is fine, a later resend may succeed."""

    id: str
    error: str
    retryable: bool


Outcome = Published | Failed


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _PubAck(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: _ApiError | None = None
    batch: str = ""  # an atomic commit's ack: its batch id and how many messages it stored
    count: int = 0


_decode_ack = msgspec.json.Decoder(_PubAck).decode


def duplicate_window_for(retry_horizon_s: float) -> float:
    """The JetStream duplicate window (seconds) for retries that may go on for `retry_horizon_s`.

    The window must exceed the longest retry horizon: a resend that arrives after the window
    has expired is stored a second time, and exactly-once is lost. Twice the horizon, never
    below 120 s (JetStream's default is 120 s).
    """
    if retry_horizon_s < 0:
        raise ValueError("retry horizon must be >= 0")
    return max(2.0 * retry_horizon_s, 120.0)


# 409 "duplicate message id is in process": another message with the same Nats-Msg-Id is
# being stored right now (a resend racing its original, or the same id arriving from another
# site's copy); a resend gets the duplicate ack once it is stored
ERR_ID_IN_PROCESS = 10158


def api_error_retryable(code: int, err_code: int = 0) -> bool:
    """JetStream API errors with a 5xx (or 429) code are conditions of the server, not of the
    event (store failure, limits with discard-new, no quorum): a resend may succeed. So is
    an id still in process (`ERR_ID_IN_PROCESS`): the resend is answered as a duplicate."""
    return code >= 500 or code == 429 or err_code == ERR_ID_IN_PROCESS


def blind_retry_horizon(duplicate_window_s: float) -> float:
    """How long after an event was received a resend may go out without proof (seconds).

    The inverse of `duplicate_window_for`: half the stream's duplicate window, so a resend
    of an event whose earlier copy was stored (ack lost) still falls inside the window, with
    the other half as margin for clock skew between the receiving node and the server.
    """
    if duplicate_window_s <= 0:
        raise ValueError("duplicate window must be > 0")
    return duplicate_window_s / 2.0


class ScanIncomplete(TierflowError):
    """`find_stored` could not read the whole range it had to (too many messages, too slow,
    or the server did not answer): absence is not proven. `too_big`: the range is over the
    message limit, so asking again will not help."""

    def __init__(self, reason: str, *, too_big: bool = False) -> None:
        super().__init__(reason)
        self.too_big = too_big


async def find_stored(
    nc: Client,
    stream: str,
    ids: set[str],
    since_ms: int,
    *,
    max_messages: int = 200_000,
    timeout_s: float = 30.0,
    batch: int = 2000,
) -> dict[str, int]:
    """Which of `ids` `stream` already holds, with their stream sequences.

    The proof a resend past the duplicate window needs: JetStream cannot be asked for a
    Nats-Msg-Id once the window forgot it, so read the `Nats-Msg-Id` header of every message
    stored from `since_ms` (server time; pass the earliest time any copy could have been
    stored, minus clock skew) up to the stream's last sequence at the start of the call,
    with an ephemeral headers-only consumer (one round trip per `batch`). Bounded: more than
    `max_messages` to read, more than `timeout_s`, or any server error raises ScanIncomplete
    (absence not proven; the caller must not resend).
    """
    from datetime import UTC, datetime

    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    js = nc.jetstream()
    found: dict[str, int] = {}
    try:
        info = await asyncio.wait_for(js.stream_info(stream), timeout_s)
        last = info.state.last_seq
        if info.state.messages == 0:
            return found
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=datetime.fromtimestamp(max(0, since_ms) / 1000, UTC),
            ack_policy=AckPolicy.NONE,
            headers_only=True,
            inactive_threshold=30.0,
            max_waiting=1,
        )
        sub = await asyncio.wait_for(
            js.pull_subscribe(">", stream=stream, config=config), timeout_s
        )
    except (nats.errors.Error, TimeoutError, OSError) as err:
        raise ScanIncomplete(f"cannot read stream {stream!r}: {type(err).__name__}: {err}") from err
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    read = 0
    try:
        pending = (await sub.consumer_info()).num_pending
        if pending > max_messages:
            raise ScanIncomplete(
                f"{pending} messages of {stream!r} to read, over the limit of {max_messages}",
                too_big=True,
            )
        seq = 0
        while pending > 0 and seq < last:
            if loop.time() > deadline:
                raise ScanIncomplete(f"read {read} messages of {stream!r} in {timeout_s} s")
            try:
                msgs = await sub.fetch(batch, timeout=min(2.0, max(0.1, deadline - loop.time())))
            except nats.errors.TimeoutError:
                pending = (await sub.consumer_info()).num_pending
                continue
            for msg in msgs:
                read += 1
                seq = msg.metadata.sequence.stream
                pending = msg.metadata.num_pending
                msg_id = (msg.headers or {}).get(MSG_ID_HEADER)
                if msg_id in ids:
                    found.setdefault(msg_id, seq)
            if read > max_messages:
                raise ScanIncomplete(
                    f"over {max_messages} messages of {stream!r} to read", too_big=True
                )
    except (nats.errors.Error, OSError) as err:
        raise ScanIncomplete(f"reading stream {stream!r}: {type(err).__name__}: {err}") from err
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(sub.unsubscribe(), 5.0)
    return found


class LatencyReservoir:
    """The most recent ack latencies (seconds) in a fixed ring; quantiles on demand."""

    def __init__(self, size: int = _RESERVOIR_SIZE) -> None:
        self._ring = array("d", bytes(8 * size))
        self._size = size
        self._count = 0

    def add(self, seconds: float) -> None:
        self._ring[self._count % self._size] = seconds
        self._count += 1

    def add_many(self, seconds: float, n: int) -> None:
        """`add(seconds)` n times (every event of a committed batch has its latency)."""
        size, ring = self._size, self._ring
        if n >= size:  # the whole ring, whatever position it is at
            ring[:] = array("d", [seconds]) * size
        elif n > 0:
            start = self._count % size
            first = min(n, size - start)
            ring[start : start + first] = array("d", [seconds]) * first
            if n > first:
                ring[: n - first] = array("d", [seconds]) * (n - first)
        self._count += max(0, n)

    def __len__(self) -> int:
        return min(self._count, self._size)

    def quantile(self, q: float) -> float | None:
        """Nearest-rank quantile of the retained samples, None when empty."""
        n = len(self)
        if n == 0:
            return None
        ordered = sorted(self._ring[:n])
        return ordered[min(n - 1, max(0, round(q * (n - 1))))]

    def clear(self) -> None:
        self._count = 0


class _Slots:
    """The in-flight window: `acquire(n)` takes n slots at once or waits, first come first
    served, holding none meanwhile (so two batches waiting can never each hold part of
    what the other needs); `release(n)` gives them back. An atomic batch takes its slots
    in one step instead of one semaphore round per event."""

    __slots__ = ("_free", "_waiters")

    def __init__(self, size: int) -> None:
        self._free = size
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def free(self) -> int:
        return self._free

    async def acquire(self, n: int = 1) -> None:
        if not self._waiters and self._free >= n:
            self._free -= n
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(n)  # granted as the cancel landed: give the slots back
            else:
                self._waiters.remove(entry)
                self._wake()  # a smaller waiter behind it may fit now
            raise

    def release(self, n: int = 1) -> None:
        self._free += n
        self._wake()

    def _wake(self) -> None:
        waiters = self._waiters
        while waiters:
            n, fut = waiters[0]
            if fut.done():  # cancelled, its acquire not yet resumed to remove it
                waiters.popleft()
                continue
            if self._free < n:
                return
            waiters.popleft()
            self._free -= n
            fut.set_result(None)


class _Batch:
    """Per-call bookkeeping (of publish_batch and publish_atomic alike): one result slot per
    input event, resolved exactly once; `outstanding` counts events not settled yet."""

    __slots__ = ("events", "results", "outstanding", "done")

    def __init__(self, events: Sequence[Outgoing]) -> None:
        self.events = events
        self.results: list[Outcome | None] = [None] * len(events)
        self.outstanding = 0
        self.done: asyncio.Future[None] | None = None

    def outcomes(self) -> tuple[list[Published], list[Failed]]:
        """(published, failed), each in input order, once every slot is resolved."""
        published: list[Published] = []
        failed: list[Failed] = []
        for r in self.results:
            if type(r) is Published:
                published.append(r)
            else:
                failed.append(r)  # type: ignore[arg-type]
        return published, failed


class _Lane:
    """One stream's queue of (call, index) waiting for a batch, and its batches in flight."""

    __slots__ = ("queue", "in_flight")

    def __init__(self) -> None:
        self.queue: deque[tuple[_Batch, int]] = deque()
        self.in_flight = 0


_FATAL_SEND_ERRORS = (
    nats.errors.MaxPayloadError,
    nats.errors.BadSubjectError,
    nats.errors.BadHeaderError,
)


def header_bytes(headers: dict[str, str]) -> int:
    """Bytes the headers take on the wire (nats-py's HPUB block: `NATS/1.0` line, one
    `Key: Value` line each, blank line); an upper bound, as nats-py only strips them."""
    return 12 + sum(len(k.encode()) + len(v.encode()) + 4 for k, v in headers.items())


def oversize_error(data: bytes, headers: dict[str, str], max_payload: int) -> str | None:
    """Why a message cannot be sent (None when it fits): the server checks headers plus
    payload against its `max_payload` and answers a violation by closing the connection,
    which fails every other publish in flight. nats-py checks the payload alone."""
    total = len(data) + header_bytes(headers)
    if max_payload > 0 and total > max_payload:
        return (
            f"message of {total} bytes ({len(data)} payload + headers) over the server's "
            f"max_payload of {max_payload} bytes"
        )
    return None


def batch_headers(ev: Outgoing, batch_id: str, seq: int, *, commit: bool = False) -> dict[str, str]:
    """The headers of `ev` as message `seq` (1-based) of atomic batch `batch_id`."""
    headers = {**ev.headers, MSG_ID_HEADER: ev.id, BATCH_ID_HEADER: batch_id}
    headers[BATCH_SEQ_HEADER] = str(seq)
    if commit:
        headers[BATCH_COMMIT_HEADER] = "1"
    return headers


# What `batch_wire` sends as it is: printable ASCII without spaces (nats-py would send such
# a subject or header value unchanged; anything else goes through nats-py's own checks).
_PLAIN = re.compile(r"[\x21-\x7e]+\Z").match


def batch_wire(
    evs: Sequence[Outgoing], batch_id: str, reply: str, max_payload: int
) -> bytes | None:
    """Atomic batch `batch_id` as NATS protocol bytes: the HPUB of each event with the
    headers `batch_headers` gives it (the last with the commit and `reply`), byte for byte
    what nats-py's `publish` would send one call at a time. None when any event needs
    nats-py's own checks: headers of its own, a subject or id that is not printable ASCII
    without spaces, a payload over `max_payload`."""
    n = len(evs)
    if not n:
        return b""
    ids = [ev.id for ev in evs]
    # one check of every id at once: each non-empty, together printable ASCII, no spaces
    if not all(ids) or not _PLAIN("".join(ids)) or any(ev.headers for ev in evs):
        return None
    if max_payload > 0 and max(len(ev.data) for ev in evs) > max_payload:
        return None
    subjects: dict[str, bytes] = {}
    for subject in {ev.subject for ev in evs}:
        if not _PLAIN(subject):
            return None
        subjects[subject] = subject.encode()
    bid = batch_id.encode()
    head = b"NATS/1.0\r\nNats-Msg-Id: %b\r\nNats-Batch-Id: " + bid.replace(b"%", b"%%")
    head += b"\r\nNats-Batch-Sequence: %d\r\n"
    # the header block's length less its id and sequence digits (ids are ASCII: 1 byte a char)
    fixed = len(head % (b"", 0)) - 1 + 2
    # control line and header block in one formatting: HPUB <subject> <hdr len> <total len>
    line = b"HPUB %b %d %d\r\n" + head + b"\r\n"
    parts: list[bytes] = []
    add = parts.append
    for j in range(1, n):
        ev = evs[j - 1]
        mid = ids[j - 1]
        size = (
            fixed + len(mid) + (1 if j < 10 else 2 if j < 100 else 3 if j < 1000 else len(str(j)))
        )
        add(line % (subjects[ev.subject], size, size + len(ev.data), mid.encode(), j))
        add(ev.data)
        add(b"\r\n")
    ev = evs[-1]
    hdr = head % (ids[-1].encode(), n) + b"Nats-Batch-Commit: 1\r\n\r\n"
    size = len(hdr)
    add(b"HPUB %b %b %d %d\r\n" % (subjects[ev.subject], reply.encode(), size, size + len(ev.data)))
    add(hdr)
    add(ev.data)
    add(b"\r\n")
    return b"".join(parts)


def _can_send_raw(nc: Any) -> bool:
    """nats-py's client (2.x) with the pending buffer `_send_raw` writes into."""
    return isinstance(nc, Client) and hasattr(nc, "_send_command") and hasattr(nc, "_flush_pending")


async def _send_raw(nc: Client, data: bytes, messages: int, payload_bytes: int) -> None:
    """Queue protocol bytes on nats-py's connection as its `publish` does (same buffer,
    same flush, same refusals while closed or draining), for many messages at once."""
    if nc.is_closed:
        raise nats.errors.ConnectionClosedError
    if nc.is_draining_pubs:
        raise nats.errors.ConnectionDrainingError
    nc.stats["out_msgs"] += messages
    nc.stats["out_bytes"] += payload_bytes
    await nc._send_command(data)
    if nc._flush_queue is not None and nc._flush_queue.empty():
        await nc._flush_pending()
    raise_swallowed_cancel()  # as `runtime.nats.publish.publish`: the flush swallows a cancel


def batch_limit_from(description: str) -> int | None:
    """The server's batch size limit named in a 10199 error ("... too large: 1000")."""
    found = re.search(r"(\d+)\s*$", description)
    return int(found.group(1)) if found else None


def _classify_send_error(err: Exception) -> tuple[str, bool]:
    """(message, retryable) for an exception raised while handing a message to the client.

    A malformed event (too big, bad subject or header) fails the same way every time; anything
    else (closed, draining, reconnect buffer full, socket errors) is about the connection.
    """
    return f"{type(err).__name__}: {err}", not isinstance(err, _FATAL_SEND_ERRORS)


class JetStreamPublisher:
    """Publishes batches to JetStream with many acks in flight; see the module docstring.

    One concept at some length: the window of acks in flight, the atomic-batch and
    event-by-event paths and their retries share one ordering and one set of counters.

    Counters: `published` (acks that stored a new message), `duplicates` (acks JetStream
    flagged duplicate), `failed`, `in_flight` (now), and `latency` (recent ack latencies).
    An optional prometheus `registry` also gets an ack-latency histogram named
    `{metric_prefix}_ack_latency_seconds` (one publisher per registry and prefix).
    Bound to the event loop it first publishes on.
    """

    def __init__(
        self,
        nc: Client,
        max_in_flight: int = 2048,
        ack_timeout: float = 5.0,
        *,
        registry: Any | None = None,
        metric_prefix: str = "tierflow_bridge",
        max_batch: int = MAX_ATOMIC_BATCH,
        max_open_batches: int = MAX_OPEN_BATCHES,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        if ack_timeout <= 0:
            raise ValueError("ack_timeout must be > 0")
        self._nc = nc
        self.max_in_flight = max_in_flight
        self.ack_timeout = ack_timeout
        self.published = 0
        self.duplicates = 0
        self.failed = 0
        self.latency = LatencyReservoir()
        self._histogram: Any | None = None
        if registry is not None:
            from prometheus_client import Histogram

            self._histogram = Histogram(
                f"{metric_prefix}_ack_latency_seconds",
                "JetStream publish ack latency",
                registry=registry,
                buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            )
        # reply subject -> (batch, index, sent_at); insertion order is send order, and every
        # entry has the same timeout, so the first entry is always the next one to expire.
        self._inflight: OrderedDict[str, tuple[_Batch, int, float]] = OrderedDict()
        self._window = _Slots(max_in_flight)
        self._prefix = ""
        self._next_token = 0
        self._sub: Any | None = None
        self._start_lock = asyncio.Lock()
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        # atomic batches: a batch is at most this long (lowered by the server's 10199)
        self.max_batch = max(1, min(max_batch, max_in_flight))
        self.batches = 0  # committed atomic batches
        self.batch_fallbacks = 0  # refused batches published again event by event
        self._open_batches = asyncio.Semaphore(max_open_batches)
        self._commits: dict[str, asyncio.Future[Msg | None]] = {}
        self._lanes: dict[str, _Lane] = {}  # stream -> events waiting for a batch
        self._lane_tasks: set[asyncio.Task[None]] = set()
        self._not_atomic: dict[str, float] = {}  # stream (or subject) -> when it refused
        self._batch_prefix = secrets.token_hex(8) + "-"

    # ---- lifecycle -------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    async def start(self) -> None:
        """Subscribe the reply inbox (done lazily by the first publish). Idempotent."""
        async with self._start_lock:
            if self._sub is not None:
                return
            if self._closed:
                raise RuntimeError("publisher is closed")
            prefix = self._nc.new_inbox() + "."
            self._sub = await self._nc.subscribe(prefix + "*", cb=self._on_reply)
            self._prefix = prefix

    async def close(self) -> None:
        """Stop listening for acks; in-flight and not yet sent events are reported Failed.

        An event failed here may still have been stored (its ack is simply not awaited): a
        resend with the same id is then acknowledged as a duplicate.
        """
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for fut in self._commits.values():
            if not fut.done():
                fut.set_result(None)  # the batch's events fail: "publisher closed"
        for lane in self._lanes.values():
            self._fail_queued(lane)
        while self._inflight:
            _, (batch, i, _) = self._inflight.popitem(last=False)
            self._window.release()  # wakes batches waiting for room; they see _closed
            self._resolve(batch, i, Failed(batch.events[i].id, "publisher closed", True))
        sub, self._sub = self._sub, None
        if sub is not None and not self._nc.is_closed:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    # ---- publishing ------------------------------------------------------------------

    async def publish_batch(
        self, events: Sequence[Outgoing]
    ) -> tuple[list[Published], list[Failed]]:
        """Publish every event once; return (acked, failed), each in input order."""
        if not events:
            return [], []
        if self._closed:
            return [], [Failed(ev.id, "publisher closed", True) for ev in events]
        if self._sub is None:
            await self.start()
        batch = _Batch(events)
        loop = asyncio.get_running_loop()
        nc = self._nc
        window = self._window
        inflight = self._inflight
        prefix = self._prefix
        for i, ev in enumerate(events):
            await window.acquire()
            if self._closed:
                window.release()
                self._fail_now(batch, i, "publisher closed", True)
                continue
            if not nc.is_connected:
                window.release()
                what = "NATS connection closed" if nc.is_closed else "not connected to NATS"
                self._fail_now(batch, i, f"{what} (nothing sent)", True)
                continue
            self._next_token += 1
            reply = prefix + str(self._next_token)
            headers = (
                {MSG_ID_HEADER: ev.id} if not ev.headers else {**ev.headers, MSG_ID_HEADER: ev.id}
            )
            too_big = oversize_error(ev.data, headers, nc.max_payload)
            if too_big is not None:  # sending it would reset the connection for everyone
                window.release()
                self._fail_now(batch, i, too_big, False)
                continue
            now = loop.time()
            inflight[reply] = (batch, i, now)
            batch.outstanding += 1
            try:
                await publish(nc, ev.subject, ev.data, reply=reply, headers=headers)
            except Exception as err:  # noqa: BLE001 - per-event failure, reported not raised
                if inflight.pop(reply, None) is not None:
                    batch.outstanding -= 1
                    window.release()
                message, retryable = _classify_send_error(err)
                self._fail_now(batch, i, message, retryable)
                continue
            if self._timer is None:
                self._timer = loop.call_at(now + self.ack_timeout, self._expire)
        if batch.outstanding:
            batch.done = loop.create_future()
            await batch.done
        return batch.outcomes()

    async def publish_with_retry(
        self,
        events: Sequence[Outgoing],
        *,
        attempts: int,
        backoff: Callable[[int], float],
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> tuple[list[Published], list[Failed]]:
        """Up to `attempts` tries; each retry resends only the retryable failures, same ids.

        Results are final outcomes in input order (ids are expected unique within a call).

        `backoff(n)` is the pause in seconds before retry n (1-based). With the stream's
        duplicate window longer than the whole retry horizon (`duplicate_window_for`), an
        event whose ack was lost but which was stored comes back `duplicate=True`: stored once.
        """
        if attempts < 1:
            raise ValueError("attempts must be >= 1")
        by_id = {ev.id: ev for ev in events}
        order = {ev.id: i for i, ev in enumerate(events)}
        done, failed = await self.publish_batch(events)
        for attempt in range(1, attempts):
            retry = [f for f in failed if f.retryable]
            if not retry:
                break
            await sleep(backoff(attempt))
            again, still = await self.publish_batch([by_id[f.id] for f in retry])
            done += again
            failed = [f for f in failed if not f.retryable] + still
        done.sort(key=lambda p: order[p.id])
        failed.sort(key=lambda f: order[f.id])
        return done, failed

    async def publish_atomic(
        self, events: Sequence[Outgoing], *, stream: str | None = None
    ) -> tuple[list[Published], list[Failed]]:
        """Publish events bound for one stream as atomic batches; (acked, failed) in input
        order, with `publish_batch`'s guarantees (see the module docstring).

        Concurrent calls for the same stream share batches (group commit): up to
        `BATCHES_PER_STREAM` batches per stream are in flight, and what arrives meanwhile
        goes out together in the next (at most `max_batch` events each). `stream` names
        the JetStream stream that captures every subject (the key under which a refusal to
        batch is remembered; the first subject when None). Events for several streams must
        be split by the caller: a batch spread over two streams is incomplete in both and
        is published again event by event.
        """
        if not events:
            return [], []
        key = stream or events[0].subject
        if self._closed or len(events) == 1 or not self.atomic_allowed(key):
            return await self.publish_batch(events)
        if self._sub is None:
            await self.start()
        call = _Batch(events)
        max_payload = self._nc.max_payload
        # the largest batch headers any message gets: id, sequence up to the limit, commit
        probe_id = self._batch_prefix + "0" * 12
        # what the batch headers take besides the id: an event without headers of its own
        # whose payload and id (4 bytes a char at most) fit the rest needs no exact check
        base = header_bytes(
            batch_headers(Outgoing("", "", b""), probe_id, MAX_ATOMIC_BATCH * 10, commit=True)
        )
        room = max_payload - base if max_payload > 0 else None
        alone: list[int] = []
        lane = self._lanes.setdefault(key, _Lane())
        if room is None or all(
            not ev.headers and len(ev.data) + 4 * len(ev.id) <= room for ev in events
        ):  # the usual case: every event fits, all queued at once
            lane.queue.extend(zip(repeat(call), range(len(events))))
            call.outstanding = len(events)
        else:
            for i, ev in enumerate(events):
                if not ev.headers and len(ev.data) + 4 * len(ev.id) <= room:
                    lane.queue.append((call, i))
                    call.outstanding += 1
                    continue
                probe = batch_headers(ev, probe_id, MAX_ATOMIC_BATCH * 10, commit=True)
                if oversize_error(ev.data, probe, max_payload) is None:
                    lane.queue.append((call, i))
                    call.outstanding += 1
                elif why := oversize_error(
                    ev.data, {**ev.headers, MSG_ID_HEADER: ev.id}, max_payload
                ):
                    call.results[i] = Failed(ev.id, why, False)  # never sent: resets the link
                    self.failed += 1
                else:
                    alone.append(i)  # fits without the batch headers: published on its own
        if call.outstanding:
            call.done = asyncio.get_running_loop().create_future()
            self._pump(key, lane)
        if alone:
            await self._publish_each(events, alone, call.results)
        if call.done is not None:
            await call.done
        return call.outcomes()

    def atomic_allowed(self, stream: str) -> bool:
        """False while `stream` is remembered as refusing atomic batches."""
        refused = self._not_atomic.get(stream)
        if refused is None:
            return True
        if asyncio.get_running_loop().time() - refused > NOT_ATOMIC_RECHECK_S:
            del self._not_atomic[stream]
            return True
        return False

    def _pump(self, key: str, lane: _Lane) -> None:
        """Start batches from the lane's queue while it has fewer than its limit in flight."""
        while lane.queue and lane.in_flight < BATCHES_PER_STREAM:
            take = min(self.max_batch, len(lane.queue))
            entries = [lane.queue.popleft() for _ in range(take)]
            lane.in_flight += 1
            task = asyncio.ensure_future(self._lane_batch(key, lane, entries))
            self._lane_tasks.add(task)
            task.add_done_callback(self._lane_tasks.discard)

    async def _lane_batch(self, key: str, lane: _Lane, entries: list[tuple[_Batch, int]]) -> None:
        """One batch of queued entries, every entry's outcome set exactly once."""
        try:
            evs = [call.events[i] for call, i in entries]
            outcomes = None
            if len(evs) > 1:
                n = len(evs)
                async with self._open_batches:
                    await self._window.acquire(n)  # the whole batch's slots at once
                    try:
                        outcomes = await self._send_batch(evs, key)
                    finally:
                        self._window.release(n)
            if outcomes is None:  # refused (or one event): each call's share event by event
                if len(evs) > 1:
                    self.batch_fallbacks += 1
                shares: dict[int, tuple[_Batch, list[int]]] = {}
                for call, i in entries:
                    shares.setdefault(id(call), (call, []))[1].append(i)
                await asyncio.gather(
                    *(self._publish_each(c.events, idx, c.results) for c, idx in shares.values())
                )
            else:
                for (call, i), outcome in zip(entries, outcomes, strict=True):
                    call.results[i] = outcome
        except BaseException as err:  # never leave a caller waiting: fail what is unsettled
            for call, i in entries:
                if call.results[i] is None:
                    call.results[i] = Failed(call.events[i].id, f"atomic batch: {err!r}", True)
                    self.failed += 1
            raise
        finally:
            for call, _ in entries:
                call.outstanding -= 1
                if call.outstanding == 0 and call.done is not None and not call.done.done():
                    call.done.set_result(None)
            lane.in_flight -= 1
            if not self._closed:
                self._pump(key, lane)
            else:
                self._fail_queued(lane)

    def _fail_queued(self, lane: _Lane) -> None:
        while lane.queue:
            call, i = lane.queue.popleft()
            call.results[i] = Failed(call.events[i].id, "publisher closed", True)
            self.failed += 1
            call.outstanding -= 1
            if call.outstanding == 0 and call.done is not None and not call.done.done():
                call.done.set_result(None)

    async def _publish_each(
        self, events: Sequence[Outgoing], idx: Sequence[int], results: list[Outcome | None]
    ) -> None:
        """The per-event path for `events[i] for i in idx`, outcomes into `results`."""
        by_id: dict[str, list[int]] = {}
        for i in idx:
            by_id.setdefault(events[i].id, []).append(i)
        published, failed = await self.publish_batch([events[i] for i in idx])
        for r in [*published, *failed]:  # an id twice in idx: one outcome for each copy
            results[by_id[r.id].pop(0)] = r

    async def _send_batch(self, evs: Sequence[Outgoing], key: str) -> list[Outcome] | None:
        """Send one batch and settle it from its commit reply: an outcome per event, or
        None when the server refused it and the events must go out one by one instead."""
        nc = self._nc
        loop = asyncio.get_running_loop()
        n = len(evs)
        self._next_token += 1
        batch_id = f"{self._batch_prefix}{self._next_token}"
        reply = self._prefix + str(self._next_token)
        commit: asyncio.Future[Msg | None] = loop.create_future()
        self._commits[reply] = commit

        def fail_all(error: str) -> list[Outcome]:
            self._commits.pop(reply, None)
            self.failed += n
            return [Failed(ev.id, error, True) for ev in evs]

        sent_at = loop.time()
        wire = batch_wire(evs, batch_id, reply, nc.max_payload) if _can_send_raw(nc) else None
        if wire is not None:  # the whole batch in one write: no per-message nats-py call
            if self._closed:
                return fail_all("publisher closed")
            if not nc.is_connected:
                what = "NATS connection closed" if nc.is_closed else "not connected to NATS"
                return fail_all(f"{what} (atomic batch not committed)")
            try:
                await _send_raw(nc, wire, n, sum(len(ev.data) for ev in evs))
            except Exception as err:  # noqa: BLE001 - the connection: reported, not raised
                message, _ = _classify_send_error(err)
                return fail_all(f"{message} (atomic batch not committed)")
        for j, ev in enumerate(evs if wire is None else (), 1):
            if self._closed:
                return fail_all("publisher closed")
            if not nc.is_connected:
                what = "NATS connection closed" if nc.is_closed else "not connected to NATS"
                return fail_all(f"{what} (atomic batch not committed)")
            last = j == n
            try:
                await publish(
                    nc,
                    ev.subject,
                    ev.data,
                    reply=reply if last else "",
                    headers=batch_headers(ev, batch_id, j, commit=last),
                )
            except Exception as err:  # noqa: BLE001 - reported per event, not raised
                message, retryable = _classify_send_error(err)
                if retryable:  # the connection: nothing of the batch can be committed
                    return fail_all(f"{message} (atomic batch not committed)")
                # the event itself (bad subject or header): the per-event path says which;
                # the server abandons the uncommitted batch after its timeout
                self._commits.pop(reply, None)
                return None
        try:
            msg = await asyncio.wait_for(commit, self.ack_timeout)
        except TimeoutError:
            return fail_all(f"no ack for the atomic batch within {self.ack_timeout:g}s (timeout)")
        finally:
            self._commits.pop(reply, None)
        if msg is None:
            return fail_all("publisher closed")
        if msg.headers and msg.headers.get(_STATUS_HEADER) == _NO_RESPONDERS:
            return fail_all(
                f"no responders: no JetStream stream captures subject {evs[0].subject!r} "
                "(or the stream is unavailable)"
            )
        try:
            ack = _decode_ack(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            return fail_all(f"unreadable JetStream ack: {err}")
        if ack.error is not None:
            code = ack.error.err_code
            if code in (ERR_BATCH_DISABLED, ERR_BATCH_UNSUPPORTED_HEADER):
                self._not_atomic[key] = loop.time()
            elif code == ERR_BATCH_TOO_LARGE:
                limit = batch_limit_from(ack.error.description)
                if limit is not None and limit >= 1:
                    self.max_batch = min(self.max_batch, limit)
            return None
        if ack.batch != batch_id or ack.count != n or ack.seq < n:
            # a server that ignores the batch headers stored each message as it came: the
            # per-event resend is acknowledged as duplicates, with every sequence
            self._not_atomic[key] = loop.time()
            return None
        first = ack.seq - n + 1
        self.published += n
        self.batches += 1
        lat = loop.time() - sent_at
        self.latency.add_many(lat, n)
        if self._histogram is not None:
            self._histogram.observe(lat)
        stream = ack.stream
        return [
            Published(ev.id, stream, seq, False)
            for ev, seq in zip(evs, range(first, first + n), strict=True)
        ]

    # ---- ack handling ----------------------------------------------------------------

    async def _on_reply(self, msg: Msg) -> None:
        commit = self._commits.pop(msg.subject, None)
        if commit is not None:
            if not commit.done():
                commit.set_result(msg)
            return
        entry = self._inflight.pop(msg.subject, None)
        if entry is None:
            return  # timed out already, or a reply for a publisher that was closed
        batch, i, sent_at = entry
        ev_id = batch.events[i].id
        hdrs = msg.headers
        if hdrs and hdrs.get(_STATUS_HEADER) == _NO_RESPONDERS:
            subject = batch.events[i].subject
            outcome: Outcome = Failed(
                ev_id,
                f"no responders: no JetStream stream captures subject {subject!r} "
                "(or the stream is unavailable)",
                True,
            )
        else:
            try:
                ack = _decode_ack(msg.data)
            except (msgspec.DecodeError, msgspec.ValidationError) as err:
                outcome = Failed(ev_id, f"unreadable JetStream ack: {err}", True)
            else:
                if ack.error is not None:
                    e = ack.error
                    outcome = Failed(
                        ev_id,
                        f"JetStream API error {e.code} (err_code {e.err_code}): {e.description}",
                        api_error_retryable(e.code, e.err_code),
                    )
                elif ack.seq <= 0:
                    outcome = Failed(ev_id, f"JetStream ack without sequence: {msg.data!r}", True)
                else:
                    outcome = Published(ev_id, ack.stream, ack.seq, ack.duplicate)
                    lat = asyncio.get_running_loop().time() - sent_at
                    self.latency.add(lat)
                    if self._histogram is not None:
                        self._histogram.observe(lat)
        self._window.release()
        self._resolve(batch, i, outcome)

    def _expire(self) -> None:
        """Timer: fail every in-flight event older than ack_timeout, re-arm for the next."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        inflight = self._inflight
        timeout = self.ack_timeout
        while inflight:
            reply = next(iter(inflight))
            batch, i, sent_at = inflight[reply]
            deadline = sent_at + timeout
            if deadline > now:
                self._timer = loop.call_at(deadline, self._expire)
                return
            del inflight[reply]
            self._window.release()
            self._resolve(
                batch, i, Failed(batch.events[i].id, f"no ack within {timeout:g}s (timeout)", True)
            )

    def _fail_now(self, batch: _Batch, i: int, error: str, retryable: bool) -> None:
        batch.outstanding += 1
        self._resolve(batch, i, Failed(batch.events[i].id, error, retryable))

    def _resolve(self, batch: _Batch, i: int, outcome: Outcome) -> None:
        batch.results[i] = outcome
        if type(outcome) is Published:
            if outcome.duplicate:
                self.duplicates += 1
            else:
                self.published += 1
        else:
            self.failed += 1
        batch.outstanding -= 1
        if batch.outstanding == 0 and batch.done is not None and not batch.done.done():
            batch.done.set_result(None)


def jittered(base: float, cap: float, rng: random.Random) -> Callable[[int], float]:
    """A full-jitter exponential backoff: uniform(0, min(cap, base * 2**(n-1)))."""

    def backoff(n: int) -> float:
        return rng.uniform(0.0, min(cap, base * 2 ** (n - 1)))

    return backoff


__all__ = [
    "BATCH_COMMIT_HEADER",
    "BATCH_ID_HEADER",
    "BATCH_SEQ_HEADER",
    "MAX_ATOMIC_BATCH",
    "Failed",
    "JetStreamPublisher",
    "LatencyReservoir",
    "Outgoing",
    "Published",
    "ScanIncomplete",
    "api_error_retryable",
    "batch_headers",
    "batch_limit_from",
    "batch_wire",
    "blind_retry_horizon",
    "duplicate_window_for",
    "find_stored",
    "header_bytes",
    "jittered",
    "oversize_error",
]
