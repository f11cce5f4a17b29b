"""Reading a jetstream source's sequence range from NATS (on a Spark executor), and the
driver's connection for the stream's bounds.

Each partition is read through an ephemeral in-memory pull consumer of its own (ack none,
from the start sequence, with the subject filter), a few thousand messages per round trip
with the next pull in flight while Spark consumes the previous one, and handed to Spark as
Arrow record batches. Spark's code is sync and nats-py is async: the client runs on a
`runtime.loop_thread.LoopThread`, which keeps answering pings between calls.

Spark reuses its Python workers across tasks and micro-batches, so the loop thread and one
connection per endpoint are kept per process (`_SharedClient`) instead of being opened and
closed per partition: a connection found closed or not connected is closed and replaced
before a read starts, and the endpoint (URL, credentials, TLS files) is the cache key, so
each set of options still connects as itself.

Every event becomes a row; a payload that is not UTF-8 (or, with ``validate=json``, not
JSON) is a malformed event: ``valid`` is false, ``error`` says why, ``raw`` keeps the bytes,
so a job can route it to a dead-letter subject (``ResultSink.dead_letters``) and go on.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import re
import threading
import uuid
from collections.abc import Coroutine, Iterator
from itertools import accumulate
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from jobs.jetstream_options import (
    DEFAULT_TIMEOUT,
    AgedOutError,
    Bounds,
    JetStreamSourceError,
    SeqRange,
    SourceOptions,
    only_compaction,
    pull_max_bytes,
    websocket_ready,
)
from runtime.data.json_depth import depth_error, error_byte, may_be_too_deep
from runtime.loop_thread import LoopThread
from runtime.nats.endpoint import NatsEndpoint
from runtime.nats.publisher import MSG_ID_HEADER
from runtime.nats.wire import Take, install

if TYPE_CHECKING:
    import pyarrow as pa
    from nats.aio.client import Client
    from nats.aio.msg import Msg

log = logging.getLogger(__name__)

STATUS_HEADER = "Status"
# before a new consumer reads on past a replica that had not caught up with the leader
LAGGING_REPLICA_WAIT_S = 0.5
# nats-server's status ending a pull whose next message would pass the request's max_bytes
# (consumer.go, nextWaiting): what came before it is the pull's whole answer
MAX_BYTES_STATUS = b"409 Message Size Exceeds MaxBytes"
_PENDING_BYTES = re.compile(rb"\r\nNats-Pending-Bytes:\s*(\d+)")
CONSUMER_INACTIVE_S = 60.0
# a shared connection rides out a short outage mid-read (0.25 s apart), then closes; an
# idle one whose server is gone stops trying instead of retrying for the worker's life
SHARED_RECONNECTS = 20

T = TypeVar("T")


def _run(lt: LoopThread, coro: Coroutine[Any, Any, T], timeout: float) -> T:
    """`coro` on the source's loop thread, for sync Spark code; JetStreamSourceError on timeout."""
    try:
        return lt.run_sync(coro, timeout)
    except TimeoutError as err:
        raise JetStreamSourceError(
            f"jetstream source: NATS call timed out after {timeout} s"
        ) from err


class StreamControl:
    """The driver's connection for stream state; opened on first use, kept until close()."""

    def __init__(self, opts: SourceOptions) -> None:
        self._opts = opts
        self._lt: LoopThread | None = None
        self._nc: Client | None = None

    def bounds(self) -> Bounds:
        if self._lt is None:
            self._lt = LoopThread("jetstream-control")
            self._lt.start()
        return _run(self._lt, self._bounds(), self._opts.timeout * 2)

    async def _bounds(self) -> Bounds:
        if self._nc is None or self._nc.is_closed:
            websocket_ready(self._opts.nats.url)
            self._nc = await self._opts.nats.connect(name=f"jetstream-source-{self._opts.stream}")
        return await stream_bounds(self._nc, self._opts.stream, self._opts.timeout)

    def close(self) -> None:
        lt, nc = self._lt, self._nc
        self._lt = self._nc = None
        if lt is None:
            return
        if nc is not None:
            try:
                _run(lt, nc.close(), 5.0)
            except Exception as err:  # closing is best effort
                log.debug("jetstream source: close: %r", err)
        lt.stop(5.0)


async def stream_bounds(nc: Client, stream: str, timeout: float = DEFAULT_TIMEOUT) -> Bounds:
    """The stream's first and last sequence; JetStreamSourceError naming the stream when it
    is missing."""
    from nats.js.errors import NotFoundError

    try:
        info = await nc.jetstream(timeout=timeout).stream_info(stream)
    except NotFoundError as err:
        raise JetStreamSourceError(f"jetstream source: stream {stream!r} does not exist") from err
    c = info.config
    compacted = only_compaction(
        c.max_msgs_per_subject,
        c.max_age,
        c.max_msgs,
        c.max_bytes,
        getattr(c.discard, "value", c.discard),
    )
    return Bounds(
        first=int(info.state.first_seq or 0),
        last=int(info.state.last_seq or 0),
        compacted=compacted,
    )


# --------------------------------------------------------------------------- per process


class _SharedClient:
    """One connection to an endpoint, shared by the reads of this process one after another.

    Deliveries go straight to the fetcher whose consumer inbox they are for (`register`);
    what no fetcher claims goes through nats-py as usual."""

    def __init__(self, endpoint: NatsEndpoint) -> None:
        self.endpoint = endpoint
        self.nc: Client | None = None
        self._takers: dict[int, Take] = {}

    async def client(self) -> Client:
        """The live connection, after replacing one that is closed or not connected."""
        nc = self.nc
        if nc is not None and nc.is_connected:
            return nc
        self.nc = None
        if nc is not None:
            log.info("jetstream source: replacing a NATS connection that is not connected")
            await _close_quietly(nc)
        self._takers.clear()
        websocket_ready(self.endpoint.url)
        nc = await self.endpoint.connect(
            name=f"jetstream-read-{os.getpid()}",
            max_reconnect_attempts=SHARED_RECONNECTS,
            error_cb=_quiet_error,
        )
        take_deliveries(nc, self._take)
        self.nc = nc
        return nc

    def register(self, sid: int, take: Take) -> None:
        self._takers[sid] = take

    def unregister(self, sid: int) -> None:
        self._takers.pop(sid, None)

    def _take(
        self, sid: int, subject: bytes, reply: bytes, headers: bytes | None, data: bytes
    ) -> bool:
        take = self._takers.get(sid)
        return take is not None and take(sid, subject, reply, headers, data)

    async def close(self) -> None:
        nc, self.nc = self.nc, None
        self._takers.clear()
        if nc is not None:
            await _close_quietly(nc)


async def _quiet_error(err: Exception) -> None:
    """An idle shared connection losing its server is not news: the next read replaces it."""
    log.debug("jetstream source: NATS: %r", err)


async def _close_quietly(nc: Client) -> None:
    try:
        await asyncio.wait_for(nc.close(), 5.0)
    except Exception as err:  # closing is best effort
        log.debug("jetstream source: close: %r", err)


class _Process:
    """This process's loop thread and shared clients, started on first use (and again in
    a forked child, which inherits neither the thread nor the sockets' ownership)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = LoopThread("jetstream-read")
        self.loop.start()
        self.clients: dict[NatsEndpoint, _SharedClient] = {}

    def client(self, endpoint: NatsEndpoint) -> _SharedClient:
        shared = self.clients.get(endpoint)
        if shared is None:
            shared = self.clients[endpoint] = _SharedClient(endpoint)
        return shared


_PROCESS: _Process | None = None
_PROCESS_LOCK = threading.Lock()


def _process() -> _Process:
    global _PROCESS
    with _PROCESS_LOCK:
        if _PROCESS is None or _PROCESS.pid != os.getpid():
            _PROCESS = _Process()
        return _PROCESS


def close_shared_clients() -> None:
    """Close this process's shared connections (they are reopened on the next read)."""
    with _PROCESS_LOCK:
        proc = _PROCESS
        if proc is None or proc.pid != os.getpid():
            return
        clients, proc.clients = list(proc.clients.values()), {}
    for shared in clients:
        try:
            _run(proc.loop, shared.close(), 10.0)
        except JetStreamSourceError as err:
            log.debug("jetstream source: close: %r", err)


# --------------------------------------------------------------------------- reading a range


def _parse_reply(reply: str) -> tuple[int, int, int]:
    """(stream seq, timestamp ns, pending) from a JetStream delivery's reply subject."""
    # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>, or the v2 form
    # $JS.ACK.<domain>.<account>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>.<r>
    t = reply.split(".")
    try:
        if len(t) == 9:
            return int(t[5]), int(t[7]), int(t[8])
        if len(t) >= 12:
            return int(t[7]), int(t[9]), int(t[10])
    except ValueError:
        pass
    raise JetStreamSourceError(f"jetstream source: unexpected delivery reply subject {reply!r}")


class Chunk:
    """Deliveries as the client read them off the wire, one list per part, in stream order:
    no per-event object, no header parsing (both happen per column in `chunk_to_batch`)."""

    __slots__ = ("headers", "payloads", "replies", "subjects")

    def __init__(self) -> None:
        self.subjects: list[bytes] = []
        self.replies: list[bytes] = []
        self.headers: list[bytes | None] = []
        self.payloads: list[bytes] = []

    def __len__(self) -> int:
        return len(self.payloads)

    def append(self, subject: bytes, reply: bytes, headers: bytes | None, payload: bytes) -> None:
        self.subjects.append(subject)
        self.replies.append(reply)
        self.headers.append(headers)
        self.payloads.append(payload)

    def last_reply(self) -> tuple[int, int, int]:
        return _parse_reply(self.replies[-1].decode("utf-8", "replace"))

    def select(self, indices: list[int]) -> Chunk:
        """The deliveries at `indices` (rising), in order."""
        out = Chunk()
        out.subjects = [self.subjects[i] for i in indices]
        out.replies = [self.replies[i] for i in indices]
        out.headers = [self.headers[i] for i in indices]
        out.payloads = [self.payloads[i] for i in indices]
        return out


class _RangeFetcher:
    """Reads stream sequences [start, end) through an ephemeral pull consumer.

    One pull request is in flight at a time and the next is sent as soon as the previous one
    is complete, so it travels while the caller converts and hands over the last chunk. Each
    pull is capped by bytes too (`pull_max_bytes`); the server ends one early with
    `MAX_BYTES_STATUS`, which ends that pull like a full batch (the next one goes on from the
    last sequence received). A pull filled to exactly its cap ends with no status at all
    (nats-server's consumer.go `nextWaiting`: at zero bytes left the request takes this one
    message and is done); the reader ends it on its own count of the same bytes, and since a
    count short of the server's would leave the server filling that pull past what was
    taken, the pull after it goes to a new consumer instead. A pull that gets no answer (a
    reconnect, a lost consumer) starts a new consumer right after the last sequence
    received, a bounded number of times, so nothing is skipped or repeated.

    Deliveries to the consumer's inbox are taken straight off the wire (`take_deliveries`):
    nats-py's per-message `Msg`, header dict and subscription queue cost more than the rest
    of the read.
    """

    def __init__(
        self,
        opts: SourceOptions,
        part: SeqRange,
        restarts: int = 3,
        shared: _SharedClient | None = None,
    ) -> None:
        self._opts, self._part = opts, part
        self._restarts_left = restarts
        self._shared = shared or _SharedClient(opts.nats)
        self._owns_client = shared is None
        self._nc: Client | None = None
        self._sub: Any = None
        self._sid: int | None = None
        self._consumer: str | None = None
        self._chunk = Chunk()
        self._want = 0
        self._bytes_left: int | None = None  # of the current pull's max_bytes, as the server counts
        self._uncapped_next = False
        self._count_bytes = True
        self._fresh_consumer_next = False
        self.consumers_started = 0
        self.pulls_cut_by_bytes = 0
        self.pulls_ended_at_zero = 0
        self._next_seq = part.start
        self._finished = False
        # finished with nothing pending before the range's end: confirmed with the stream's
        # leader before it counts as the end (`_confirm_end`)
        self._short = False
        self.lagging_replicas = 0
        self._error: str | None = None
        self._done = asyncio.Event()
        self.skipped = 0

    async def open(self) -> None:
        opts, part = self._opts, self._part
        self._nc = nc = await self._shared.client()
        bounds = await stream_bounds(nc, opts.stream, opts.timeout)
        if bounds.aged_out(part.start):
            if opts.on_aged_out != "skip":
                raise AgedOutError(opts.stream, part.start, bounds.first)
            self.skipped = min(bounds.first, part.end) - part.start
            log.warning(
                "jetstream stream %r: %d sequences from %d aged out before they were read",
                opts.stream,
                self.skipped,
                part.start,
            )
        await self._start_consumer()

    async def _start_consumer(self) -> None:
        """A consumer from the next wanted sequence, its own inbox, and the first pull."""
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        assert self._nc is not None
        opts = self._opts
        await self._drop_consumer()
        self._error = None
        self._fresh_consumer_next = False
        config = ConsumerConfig(
            name=f"tf-read-{uuid.uuid4().hex[:16]}",
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self._next_seq,
            ack_policy=AckPolicy.NONE,
            mem_storage=True,
            num_replicas=1,
            inactive_threshold=CONSUMER_INACTIVE_S,
        )
        if len(opts.subjects) == 1:
            config.filter_subject = opts.subjects[0]
        elif opts.subjects:
            config.filter_subjects = list(opts.subjects)
        info = await self._nc.jetstream(timeout=opts.timeout).add_consumer(opts.stream, config)
        self._consumer = info.name
        self.consumers_started += 1
        if not info.num_pending:
            self._finished = True
            self._short = self._next_seq < self._part.end
            self._done.set()
            return

        async def unused(msg: Msg) -> None:  # deliveries go to `_take`
            """Never called: `take_deliveries` takes this inbox's messages."""

        self._sub = await self._nc.subscribe(self._nc.new_inbox(), cb=unused)
        self._sid = self._sub._id
        self._shared.register(self._sid, self._take)
        await self._pull()

    async def _drop_consumer(self) -> None:
        sub, name, self._sub, self._consumer = self._sub, self._consumer, None, None
        if self._sid is not None:
            self._shared.unregister(self._sid)
        self._sid = None
        try:
            if sub is not None:
                await sub.unsubscribe()
            if name and self._nc is not None:
                await self._nc.jetstream().delete_consumer(self._opts.stream, name)
        except Exception as err:  # the inactive threshold removes it anyway
            log.debug("jetstream source: drop consumer %s: %r", name, err)

    async def _pull(self) -> None:
        assert self._nc is not None and self._sub is not None
        if self._uncapped_next:
            self._uncapped_next = False
            self._want, self._bytes_left = 1, None
            request = b'{"batch":1,"no_wait":true}'
        else:
            self._want = max(1, min(self._opts.fetch_batch, self._part.end - self._next_seq))
            self._bytes_left = pull_max_bytes(self._opts.fetch_max_bytes, self._nc.max_payload)
            request = b'{"batch":%d,"max_bytes":%d,"no_wait":true}' % (
                self._want,
                self._bytes_left,
            )
        self._done.clear()
        await self._nc.publish(
            f"$JS.API.CONSUMER.MSG.NEXT.{self._opts.stream}.{self._consumer}",
            request,
            reply=self._sub.subject,
        )

    def _take(
        self, sid: int, subject: bytes, reply: bytes, headers: bytes | None, data: bytes
    ) -> bool:
        """One message off the wire: True if it was for the current consumer's inbox."""
        if sid != self._sid:
            return False
        if not (self._finished or self._done.is_set()):  # else: the tail of a complete request
            self._on_delivery(subject, reply, headers, data)
        return True

    def _on_delivery(
        self, subject: bytes, reply: bytes, headers: bytes | None, data: bytes
    ) -> None:
        """One delivery or status message for the current pull."""
        if headers is not None and headers[8:9] == b" ":  # "NATS/1.0 404 ...": a status
            status = headers[9:12]
            if status in (b"404", b"408"):  # no more messages now / request expired
                if not self._chunk:
                    self._finished = True
                    self._short = self._next_seq < self._part.end
                self._done.set()
            elif headers[9:].startswith(MAX_BYTES_STATUS):  # the pull is full by bytes
                # nothing delivered: the next event alone is bigger than the pull's cap
                self._uncapped_next = not self._chunk
                self.pulls_cut_by_bytes += 1
                self._check_byte_count(headers)
                self._done.set()
            elif status != b"100":  # 100 = heartbeat or flow control
                line = headers[9:].split(b"\r\n", 1)[0]
                self._error = line.decode("utf-8", "replace").strip()
                self._done.set()
            return
        self._chunk.append(subject, reply, headers, data)
        self._want -= 1
        if self._bytes_left is not None:
            # the server's count (consumer.go): subject, ack reply, headers and payload; at
            # exactly zero it ends the request after this message without a status
            self._bytes_left -= len(subject) + len(reply) + len(data)
            if headers is not None:
                self._bytes_left -= len(headers)
            if self._bytes_left == 0 and self._count_bytes:
                # ended on this reader's count alone: were it short of the server's, the
                # server would go on filling this pull into the consumer's inbox, past what
                # is taken here; so the next pull goes to a new consumer from the next
                # sequence, and nothing depends on the count being right
                self._fresh_consumer_next = True
                self.pulls_ended_at_zero += 1
                self._done.set()
        if self._want <= 0:
            self._done.set()

    def _check_byte_count(self, status: bytes) -> None:
        """Compare the server's bytes left of the pull (its ``Nats-Pending-Bytes``) with
        this reader's count, and stop ending pulls on a count found wrong (a pull the server
        fills to exactly zero then waits for the timeout and a new consumer)."""
        found = _PENDING_BYTES.search(status)
        if found is None or self._bytes_left is None:
            return
        if int(found.group(1)) != self._bytes_left:
            log.warning(
                "jetstream source: the server counts %s bytes left of a pull, this reader %d; "
                "pulls end on the server's status alone from now on",
                found.group(1).decode(),
                self._bytes_left,
            )
            self._count_bytes = False

    def _advance(self) -> None:
        """Move the next wanted sequence past what the chunk holds; finish at the range's
        end or when the consumer has nothing more pending."""
        if not self._chunk:
            return
        seq, _, pending = self._chunk.last_reply()
        self._next_seq = seq + 1
        if pending == 0 or seq + 1 >= self._part.end:
            self._finished = True
            self._short = seq + 1 < self._part.end

    async def next_chunk(self) -> Chunk | None:
        """The next deliveries of the range (in sequence order; the last chunk may run past
        the range's end, `chunk_to_batch` cuts it); None when the range is done."""
        await self._answer()
        tries = 0
        while not self._chunk and not self._finished:
            # the pull's byte cap ended it before its first event, too big for it alone:
            # ask for that event alone, uncapped (answered with it, or with no messages)
            if tries == 3:
                raise JetStreamSourceError(
                    f"jetstream source: reading stream {self._opts.stream!r} from sequence "
                    f"{self._next_seq}: pulls end before their first event"
                )
            tries += 1
            await self._pull()
            await self._answer()
        chunk, self._chunk = self._chunk, Chunk()
        if self._finished and self._short and await self._confirm_end():
            # a new consumer reads on from the next sequence (its first pull is out)
            return chunk if chunk else await self.next_chunk()
        if self._finished:
            return chunk or None
        if self._fresh_consumer_next:
            await self._start_consumer()
        else:
            await self._pull()
        return chunk

    async def _confirm_end(self) -> bool:
        """A consumer with nothing pending before the range's end is asked of the stream's
        leader: an R1 consumer sits on any replica of the stream, and one on a replica still
        catching up (a server back from a partition) has nothing pending where the stream
        goes on, so its end would skip what the leader holds. When the leader has a wanted
        message left in the range, a new consumer reads on from the next sequence after a
        moment (True), a bounded number of times; otherwise the range is done (False)."""
        self._short = False
        left = await self._leader_next()
        if left is None or left >= self._part.end:
            return False
        if self._restarts_left <= 0:
            raise JetStreamSourceError(
                f"jetstream source: reading stream {self._opts.stream!r}: its consumers end "
                f"at sequence {self._next_seq - 1}, the stream's leader holds {left} in the "
                f"range up to {self._part.end - 1}"
            )
        self._restarts_left -= 1
        self.lagging_replicas += 1
        log.warning(
            "jetstream source: stream %r: the consumer had nothing after sequence %d, the "
            "stream's leader has %d; reading on from a new consumer",
            self._opts.stream,
            self._next_seq - 1,
            left,
        )
        await asyncio.sleep(LAGGING_REPLICA_WAIT_S)
        self._finished = False
        await self._start_consumer()
        return True

    async def _leader_next(self) -> int | None:
        """The first sequence at or after the next wanted one holding a message of the
        read's subjects, as the stream's leader answers (a message get is the leader's)."""
        from nats.js.errors import NotFoundError

        assert self._nc is not None
        js = self._nc.jetstream(timeout=self._opts.timeout)
        found = []
        for subject in self._opts.subjects or [">"]:
            try:
                msg = await js.get_msg(
                    self._opts.stream, seq=self._next_seq, subject=subject, next=True
                )
            except NotFoundError:
                continue
            if msg.seq is not None:
                found.append(int(msg.seq))
        return min(found) if found else None

    async def _answer(self) -> None:
        """Wait for the current pull's answer (replacing a consumer that gives none), and
        move the next wanted sequence past it."""
        while True:
            try:
                await asyncio.wait_for(self._done.wait(), self._opts.timeout)
                problem = self._error
            except TimeoutError:
                problem = f"no answer to a pull within {self._opts.timeout} s"
            if problem is None:
                break
            self._advance()
            if self._finished:
                break
            if self._restarts_left <= 0:
                raise JetStreamSourceError(
                    f"jetstream source: reading stream {self._opts.stream!r} from sequence "
                    f"{self._next_seq}: {problem}"
                )
            self._restarts_left -= 1
            log.warning(
                "jetstream source: stream %r at sequence %d: %s; starting a new consumer",
                self._opts.stream,
                self._next_seq,
                problem,
            )
            await self._start_consumer()
        self._advance()

    async def close(self) -> None:
        """Drop the consumer; the connection stays open for the process's next read
        (closed only when this fetcher made its own)."""
        await self._drop_consumer()
        self._nc = None
        if self._owns_client:
            await self._shared.close()


# --------------------------------------------------------------------------- off the wire


def take_deliveries(nc: Client, take: Take) -> None:
    """Offer every message `nc` receives to `take(sid, subject, reply, headers, payload)`
    first, before nats-py builds anything for it; what `take` declines (returns False for)
    goes on through nats-py as usual.

    Relies on two internals of the pinned nats-py (2.16): the protocol parser `nc._ps` and
    `nc._process_msg`, which the parser calls per message. The parser keeps its state; only
    its class changes, to `runtime.nats.wire.FastLaneParser`, whose fast lane reads whole
    ``MSG``/``HMSG`` frames with a few byte operations and leaves every other operation to
    nats-py.
    """
    parsed = nc._process_msg

    async def process_msg(
        sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        if not take(sid, subject, reply, headers, data):
            await parsed(sid, subject, reply, data, headers)

    nc._process_msg = process_msg  # type: ignore[method-assign]
    install(nc, take)


# --------------------------------------------------------------------------- to Arrow


_ARROW_SCHEMA: pa.Schema | None = None


def _arrow_schema() -> pa.Schema:
    """SCHEMA_DDL in Arrow, as Spark's `to_arrow_schema(schema(), timezone="UTC")` gives it,
    built with pyarrow alone (pyspark.sql.pandas.types imports pandas into the worker)."""
    global _ARROW_SCHEMA
    if _ARROW_SCHEMA is None:
        import pyarrow as pa

        _ARROW_SCHEMA = pa.schema(
            [
                pa.field("seq", pa.int64()),
                pa.field("subject", pa.string()),
                pa.field("ts", pa.timestamp("us", tz="UTC")),
                pa.field("msg_id", pa.string()),
                pa.field("data", pa.string()),
                pa.field("valid", pa.bool_()),
                pa.field("error", pa.string()),
                pa.field("raw", pa.binary()),
            ]
        )
    return _ARROW_SCHEMA


_RAW = msgspec.json.Decoder(msgspec.Raw)
_MSG_ID = r"\r\n" + MSG_ID_HEADER + r":[ \t]*(?P<id>[^\r\n]*?)[ \t]*\r\n"
# how a publisher's header block starts when the message id is its first header
_MSG_ID_FIRST = b"NATS/1.0\r\n" + MSG_ID_HEADER.encode() + b": "
_BINARY_MAX = 2**31 - 1  # a binary column's int32 offsets


def binary_column(values: list[bytes]) -> pa.Array:
    """`pa.array(values, pa.binary())` for bytes (no None): the same array, built from one
    joined buffer and its offsets instead of a conversion per value."""
    import pyarrow as pa

    data = b"".join(values)
    offsets = array.array("i", [0])
    if len(data) > _BINARY_MAX or offsets.itemsize != 4:
        return pa.array(values, pa.binary())
    offsets.extend(accumulate(map(len, values)))
    return pa.Array.from_buffers(
        pa.binary(), len(values), [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )


def msg_ids(headers: pa.Array) -> pa.Array:
    """Each header block's message id (binary; null where it has none), exactly as the
    regular expression `_MSG_ID` finds it. When every block starts with that header, as a
    publisher writes it, the id is its first line after the status line, cut by columns
    (a third of the regex's time); anything else (another header first, spaces or a lone
    CR or LF around the id, no line end) is matched by the regex."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if len(headers) > headers.null_count and pc.all(pc.starts_with(headers, _MSG_ID_FIRST)).as_py():
        lines = pc.split_pattern(headers, b"\r\n", max_splits=2)
        if pc.min(pc.list_value_length(lines)).as_py() >= 3:  # the id's line ends in CRLF
            skip = len(_MSG_ID_FIRST) - len(b"NATS/1.0\r\n")
            ids = pc.binary_slice(pc.list_element(lines, 1), skip, _BINARY_MAX)
            stray = [pc.count_substring(ids, c) for c in (b"\r", b"\n")]
            edges = [f(ids, c) for f in (pc.starts_with, pc.ends_with) for c in (b" ", b"\t")]
            if not any(pc.sum(n).as_py() for n in stray) and not any(
                pc.any(e).as_py() for e in edges
            ):
                return ids.cast(pa.binary())
    found = pc.extract_regex(headers, _MSG_ID)
    return pc.struct_field(found, "id")  # null where no header matched (.field is not)


def check_payload(payload: bytes, validate: str) -> tuple[str | None, str | None]:
    """(text, error): the payload as text when it is UTF-8, and why it is malformed, if it is.

    The per-event rule; `payload_columns` applies the same rule to a whole chunk at once."""
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, f"payload is not UTF-8: {err}"
    if validate == "json":
        error = json_error(payload)
        if error is not None:
            return text, f"payload is not JSON: {error}"
    return text, None


def json_error(payload: bytes) -> str | None:
    """Why `payload` is not one JSON document (msgspec's words), or None: msgspec's rule with
    `runtime.data.json_depth`'s limit, so a deeply nested event is malformed here as in the
    JVM source, never a RecursionError that ends the read."""
    try:
        _RAW.decode(payload)
    except msgspec.DecodeError as err:
        deep = depth_error(payload, error_byte(str(err))[1])
        return deep or str(err)
    except RecursionError:
        return depth_error(payload, None) or "JSON is malformed: nested too deeply"
    return depth_error(payload, None)


def _as_text(values: pa.Array) -> pa.Array:
    """A binary column as strings; a value that is not UTF-8 gets U+FFFD (as nats-py would)."""
    import pyarrow as pa

    try:
        return values.cast(pa.string())
    except pa.ArrowInvalid:
        return pa.array(
            [None if v is None else v.decode("utf-8", "replace") for v in values.to_pylist()],
            pa.string(),
        )


def payload_errors(
    payloads: list[bytes], validate: str, binary: pa.Array | None = None
) -> tuple[dict[int, str], pa.Array]:
    """(why each malformed payload is, by index; the payloads as text, null where not
    UTF-8): exactly `check_payload` per event (`binary`: the payloads as an Arrow column).

    UTF-8 is checked by one Arrow cast of the whole column and JSON by msgspec's C decoder
    in one loop; only a chunk holding a payload that is not UTF-8 pays a per-event pass."""
    import pyarrow as pa

    if binary is None:
        binary = binary_column(payloads)
    errors: dict[int, str] = {}
    if validate == "none":
        return errors, _as_text(binary)
    try:
        text = binary.cast(pa.string())
    except pa.ArrowInvalid:  # some payload is not UTF-8: find which, per event
        texts: list[str | None] = []
        for i, payload in enumerate(payloads):
            one, err = check_payload(payload, "utf8")
            texts.append(one)
            if err is not None:
                errors[i] = err
        text = pa.array(texts, pa.string())
    if validate == "json":
        decode = _RAW.decode
        for i, payload in enumerate(payloads):
            try:
                decode(payload)
                if not may_be_too_deep(payload):
                    continue
            except (msgspec.DecodeError, RecursionError):
                pass
            error = json_error(payload)
            if error is not None and i not in errors:
                errors[i] = f"payload is not JSON: {error}"
    return errors, text


def payload_columns(
    payloads: list[bytes], validate: str
) -> tuple[pa.Array, pa.Array, pa.Array, pa.Array]:
    """(data, valid, error, raw) for a chunk's payloads: exactly `check_payload` per event
    (`payload_errors`); only the malformed events carry `error` and `raw`."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(payloads)
    binary = binary_column(payloads)
    errors, data = payload_errors(payloads, validate, binary)
    if not errors:
        return data, pa.repeat(True, n), pa.nulls(n, pa.string()), pa.nulls(n, pa.binary())
    valid = pa.array([i not in errors for i in range(n)], pa.bool_())
    error = pa.array([errors.get(i) for i in range(n)], pa.string())
    raw = pc.if_else(valid, pa.scalar(None, pa.binary()), binary)
    return data, valid, error, raw


# a delivery's reply subject, short and v2 forms (`_parse_reply`), as one match per value
_REPLY_FORMS = (
    r"^\$JS\.ACK\.[^.]+\.[^.]+\.\d+\.(?P<seq>\d+)\.\d+\.(?P<ts>\d+)\.\d+$",
    r"^\$JS\.ACK(?:\.[^.]+){4}\.\d+\.(?P<seq>\d+)\.\d+\.(?P<ts>\d+)\.\d+(?:\.[^.]*)+$",
)


def _reply_columns(replies: list[bytes]) -> tuple[pa.Array, pa.Array]:
    """(stream seq, timestamp ns) from the deliveries' reply subjects, by column: one
    regular expression over the whole column (a third of the time of splitting it into
    tokens); a column in neither form is parsed per value, which raises on a bad one."""
    import pyarrow as pa
    import pyarrow.compute as pc

    text = binary_column(replies).cast(pa.string())
    for form in _REPLY_FORMS:
        found = pc.extract_regex(text, form)
        if found.null_count:
            continue
        try:
            return (
                pc.struct_field(found, "seq").cast(pa.int64()),
                pc.struct_field(found, "ts").cast(pa.int64()),
            )
        except pa.ArrowInvalid:  # a number past int64
            break
    parsed = [_parse_reply(r.decode("utf-8", "replace")) for r in replies]
    try:
        return pa.array([p[0] for p in parsed], pa.int64()), pa.array(
            [p[1] for p in parsed], pa.int64()
        )
    except OverflowError as err:
        raise JetStreamSourceError(f"jetstream source: a delivery's sequence: {err}") from err


def chunk_to_batch(
    chunk: Chunk,
    validate: str,
    arrow_schema: pa.Schema,
    end: int | None = None,
    invalid_only: bool = False,
) -> pa.RecordBatch:
    """A chunk as one Arrow record batch in the source's schema, cut before sequence `end`;
    with `invalid_only`, of its malformed events alone (the valid ones never become Arrow
    rows: a dead-letter query reads every event to find the few it wants)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if invalid_only:
        errors, _ = payload_errors(chunk.payloads, validate)
        if not errors:
            return pa.RecordBatch.from_pylist([], schema=arrow_schema)
        chunk = chunk.select(sorted(errors))
    seq, ts_ns = _reply_columns(chunk.replies)
    n = len(chunk)
    if end is not None and n and seq[n - 1].as_py() >= end:
        n = pc.sum(pc.less(seq, end)).as_py() or 0  # sequences rise: the first n are in range
        seq, ts_ns = seq[:n], ts_ns[:n]
    subjects = chunk.subjects if n == len(chunk) else chunk.subjects[:n]
    headers = chunk.headers if n == len(chunk) else chunk.headers[:n]
    payloads = chunk.payloads if n == len(chunk) else chunk.payloads[:n]
    ts = pc.divide(ts_ns, 1000).cast(arrow_schema.field("ts").type)
    if None not in headers:
        msg_id = _as_text(msg_ids(binary_column(headers)))  # type: ignore[arg-type]
    elif any(h is not None for h in headers):
        msg_id = _as_text(msg_ids(pa.array(headers, pa.binary())))
    else:
        msg_id = pa.nulls(n, pa.string())
    data, valid, error, raw = payload_columns(payloads, validate)
    subject = _as_text(binary_column(subjects))
    return pa.RecordBatch.from_arrays(
        [seq, subject, ts, msg_id, data, valid, error, raw], schema=arrow_schema
    )


def read_range(opts: SourceOptions, part: SeqRange) -> Iterator[pa.RecordBatch]:
    """Every retained event in the range matching the filter, as Arrow batches, in order."""
    if not isinstance(part, SeqRange) or part.end <= part.start:
        return
    arrow_schema = _arrow_schema()
    proc = _process()
    lt = proc.loop
    fetcher = _RangeFetcher(opts, part, shared=proc.client(opts.nats))
    call_timeout = opts.timeout * 3
    try:
        _run(lt, fetcher.open(), call_timeout)
        while True:
            chunk = _run(lt, fetcher.next_chunk(), call_timeout)
            if chunk is None:
                break
            batch = chunk_to_batch(chunk, opts.validate, arrow_schema, part.end, opts.invalid_only)
            if batch.num_rows:
                yield batch
    finally:
        try:
            _run(lt, fetcher.close(), call_timeout)
        except Exception as err:
            log.debug("jetstream source: close: %r", err)


__all__ = [
    "Chunk",
    "StreamControl",
    "binary_column",
    "check_payload",
    "close_shared_clients",
    "take_deliveries",
    "chunk_to_batch",
    "msg_ids",
    "payload_columns",
    "payload_errors",
    "read_range",
    "stream_bounds",
]
