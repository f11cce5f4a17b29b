"""Reading a jetstream source's sequence range from NATS (on a Spark executor), and the
driver's connection for the stream's bounds.

Each partition is read through its own connection and an ephemeral in-memory pull consumer
(ack none, from the start sequence, with the subject filter), a few thousand messages per
round trip with the next pull in flight while Spark consumes the previous one, and handed to
Spark as Arrow record batches. Spark's code is sync and nats-py is async: the client runs
on a `runtime.loop_thread.LoopThread` of its own, which keeps answering pings between calls.

Every event becomes a row; a payload that is not UTF-8 (or, with ``validate=json``, not
JSON) is a malformed event: ``valid`` is false, ``error`` says why, ``raw`` keeps the bytes,
so a job can route it to a dead-letter subject (``ResultSink.dead_letters``) and go on.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Coroutine, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from jobs.jetstream_options import (
    DEFAULT_TIMEOUT,
    AgedOutError,
    Bounds,
    SeqRange,
    SourceError,
    SourceOptions,
    schema,
)
from runtime.loop_thread import LoopThread
from runtime.publisher import MSG_ID_HEADER

if TYPE_CHECKING:
    import pyarrow as pa
    from nats.aio.client import Client
    from nats.aio.msg import Msg

log = logging.getLogger(__name__)

STATUS_HEADER = "Status"
CONSUMER_INACTIVE_S = 60.0

T = TypeVar("T")


def _run(lt: LoopThread, coro: Coroutine[Any, Any, T], timeout: float) -> T:
    """`coro` on the source's loop thread, for sync Spark code; SourceError on timeout."""
    try:
        return lt.run_sync(coro, timeout)
    except TimeoutError as err:
        raise SourceError(f"jetstream source: NATS call timed out after {timeout} s") from err


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
    """The stream's first and last sequence; SourceError naming the stream when it is missing."""
    from nats.js.errors import NotFoundError

    try:
        info = await nc.jetstream(timeout=timeout).stream_info(stream)
    except NotFoundError as err:
        raise SourceError(f"jetstream source: stream {stream!r} does not exist") from err
    return Bounds(first=int(info.state.first_seq or 0), last=int(info.state.last_seq or 0))


# --------------------------------------------------------------------------- reading a range


def _parse_reply(reply: str) -> tuple[int, int, int]:
    """(stream seq, timestamp ns, pending) from a JetStream delivery's reply subject."""
    # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>, or the v2 form
    # $JS.ACK.<domain>.<account>.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>.<r>
    t = reply.split(".")
    if len(t) == 9:
        return int(t[5]), int(t[7]), int(t[8])
    if len(t) >= 12:
        return int(t[7]), int(t[9]), int(t[10])
    raise SourceError(f"jetstream source: unexpected delivery reply subject {reply!r}")


Fetched = tuple[int, str, int, str | None, bytes]  # seq, subject, ts ns, msg id, payload


class _RangeFetcher:
    """Reads stream sequences [start, end) through an ephemeral pull consumer.

    One pull request is in flight at a time and the next is sent as soon as the previous one
    is complete, so it travels while the caller converts and hands over the last chunk. A pull
    that gets no answer (a reconnect, a lost consumer) starts a new consumer right after the
    last sequence received, a bounded number of times, so nothing is skipped or repeated.
    """

    def __init__(self, opts: SourceOptions, part: SeqRange, restarts: int = 3) -> None:
        self._opts, self._part = opts, part
        self._restarts_left = restarts
        self._nc: Client | None = None
        self._sub: Any = None
        self._consumer: str | None = None
        self._gen = 0
        self._chunk: list[Fetched] = []
        self._want = 0
        self._next_seq = part.start
        self._finished = False
        self._error: str | None = None
        self._done = asyncio.Event()
        self.skipped = 0

    async def open(self) -> None:
        opts, part = self._opts, self._part
        self._nc = await opts.nats.connect(name=f"jetstream-read-{opts.stream}")
        bounds = await stream_bounds(self._nc, opts.stream, opts.timeout)
        if bounds.first > part.start:
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
        self._gen += 1
        self._error = None
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
        if not info.num_pending:
            self._finished = True
            self._done.set()
            return
        gen = self._gen

        async def on_msg(msg: Msg) -> None:
            if gen == self._gen:
                self._on_msg(msg)

        self._sub = await self._nc.subscribe(
            self._nc.new_inbox(),
            cb=on_msg,
            pending_msgs_limit=4 * opts.fetch_batch + 16,
            pending_bytes_limit=256 << 20,
        )
        await self._pull()

    async def _drop_consumer(self) -> None:
        sub, name, self._sub, self._consumer = self._sub, self._consumer, None, None
        try:
            if sub is not None:
                await sub.unsubscribe()
            if name and self._nc is not None:
                await self._nc.jetstream().delete_consumer(self._opts.stream, name)
        except Exception as err:  # the inactive threshold removes it anyway
            log.debug("jetstream source: drop consumer %s: %r", name, err)

    async def _pull(self) -> None:
        assert self._nc is not None and self._sub is not None
        self._want = max(1, min(self._opts.fetch_batch, self._part.end - self._next_seq))
        self._done.clear()
        await self._nc.publish(
            f"$JS.API.CONSUMER.MSG.NEXT.{self._opts.stream}.{self._consumer}",
            b'{"batch":%d,"no_wait":true}' % self._want,
            reply=self._sub.subject,
        )

    def _on_msg(self, msg: Msg) -> None:
        if self._finished or self._done.is_set():
            return  # the tail of a request already complete (e.g. past the range's end)
        headers = msg.headers
        if headers and STATUS_HEADER in headers:
            status = headers[STATUS_HEADER]
            if status in ("404", "408"):  # no more messages now / request expired
                if not self._chunk:
                    self._finished = True
                self._done.set()
            elif status != "100":  # 100 = heartbeat or flow control
                self._error = f"{status} {headers.get('Description', '')}".strip()
                self._done.set()
            return
        seq, ts, pending = _parse_reply(msg.reply)
        if seq >= self._part.end:
            self._finished = True
            self._done.set()
            return
        msg_id = headers.get(MSG_ID_HEADER) if headers else None
        self._chunk.append((seq, msg.subject, ts, msg_id, msg.data))
        self._next_seq = seq + 1
        self._want -= 1
        if pending == 0 or seq + 1 >= self._part.end:
            self._finished = True
            self._done.set()
        elif self._want <= 0:
            self._done.set()

    async def next_chunk(self) -> list[Fetched] | None:
        """The next events of the range (in sequence order); None when the range is done."""
        while True:
            try:
                await asyncio.wait_for(self._done.wait(), self._opts.timeout)
                problem = self._error
            except TimeoutError:
                problem = f"no answer to a pull within {self._opts.timeout} s"
            if problem is None:
                break
            if self._restarts_left <= 0:
                raise SourceError(
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
        chunk, self._chunk = self._chunk, []
        if not self._finished:
            await self._pull()
        elif not chunk:
            return None
        return chunk

    async def close(self) -> None:
        await self._drop_consumer()
        nc, self._nc = self._nc, None
        if nc is not None:
            await nc.close()


def _arrow_schema() -> pa.Schema:
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema(), timezone="UTC")


def check_payload(payload: bytes, validate: str) -> tuple[str | None, str | None]:
    """(text, error): the payload as text when it is UTF-8, and why it is malformed, if it is."""
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, f"payload is not UTF-8: {err}"
    if validate == "json":
        try:
            msgspec.json.decode(payload, type=msgspec.Raw)
        except msgspec.DecodeError as err:
            return text, f"payload is not JSON: {err}"
    return text, None


def events_to_batch(
    events: list[Fetched], validate: str, arrow_schema: pa.Schema
) -> pa.RecordBatch:
    """Events as one Arrow record batch in the source's schema."""
    import pyarrow as pa

    seqs, subjects, tss, ids, datas, valids, errors, raws = ([] for _ in range(8))
    for seq, subject, ts, msg_id, payload in events:
        if validate == "none":
            text, err = payload.decode("utf-8", "replace"), None
        else:
            text, err = check_payload(payload, validate)
        seqs.append(seq)
        subjects.append(subject)
        tss.append(ts // 1000)
        ids.append(msg_id)
        datas.append(text)
        valids.append(err is None)
        errors.append(err)
        raws.append(payload if err is not None else None)
    cols = [seqs, subjects, tss, ids, datas, valids, errors, raws]
    arrays = [pa.array(c, type=f.type) for c, f in zip(cols, arrow_schema, strict=True)]
    return pa.RecordBatch.from_arrays(arrays, schema=arrow_schema)


def read_range(opts: SourceOptions, part: SeqRange) -> Iterator[pa.RecordBatch]:
    """Every retained event in the range matching the filter, as Arrow batches, in order."""
    if not isinstance(part, SeqRange) or part.end <= part.start:
        return
    arrow_schema = _arrow_schema()
    lt = LoopThread("jetstream-read")
    lt.start()
    fetcher = _RangeFetcher(opts, part)
    call_timeout = opts.timeout * 3
    try:
        _run(lt, fetcher.open(), call_timeout)
        while True:
            chunk = _run(lt, fetcher.next_chunk(), call_timeout)
            if chunk is None:
                break
            if chunk:
                yield events_to_batch(chunk, opts.validate, arrow_schema)
    finally:
        try:
            _run(lt, fetcher.close(), call_timeout)
        except Exception as err:
            log.debug("jetstream source: close: %r", err)
        lt.stop(5.0)


__all__ = [
    "Fetched",
    "StreamControl",
    "check_payload",
    "events_to_batch",
    "read_range",
    "stream_bounds",
]
