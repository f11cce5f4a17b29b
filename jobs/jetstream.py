"""JetStream as a PySpark data source (format ``"jetstream"``): offsets are stream sequences.

A streaming query's offset is ``{"seq": N, "skipped": K}``: N is the next stream sequence to
read, K how many sequences were skipped because they had aged out (``onAgedOut=skip``). Spark
writes each micro-batch's (start, end) to its checkpoint before running it, so a restarted
query re-reads exactly its uncommitted range; end-to-end exactly-once also needs an
idempotent sink (jobs/sink.py). The same source reads in batch mode (``spark.read``) over
whatever the stream retains.

Partitions are sequence ranges. Each is read on an executor through its own connection and an
ephemeral in-memory pull consumer (ack none, from the start sequence, with the subject
filter), a few thousand messages per round trip with the next pull in flight while Spark
consumes the previous one, and handed to Spark as Arrow record batches.

Every event becomes a row; a payload that is not UTF-8 (or, with ``validate=json``, not
JSON) is a malformed event: ``valid`` is false, ``error`` says why, ``raw`` keeps the bytes,
so a job can route it to a dead-letter subject (``ResultSink.dead_letters``) and go on.

Options (names are case-insensitive):

==================== ==========================================================================
url                  NATS URL, or several comma-joined (required)
user, password       credentials; or ``token``; or ``creds`` (a .creds file); ``tlsCa`` a CA file
tlsCert, tlsKey      the client certificate and key (for a server that verifies clients)
stream               the JetStream stream (required)
subject              subject filter; several comma-joined (default: every subject)
startingOffset       ``earliest`` (default), ``latest``, or a stream sequence; a new query only
endingOffset         batch reads: ``latest`` (default) or a sequence, exclusive
maxEventsPerTrigger  cap on the sequences one micro-batch spans (with a subject filter a batch
                     may hold fewer events than that)
onAgedOut            ``fail`` (default): a start sequence below the stream's first sequence is
                     an error naming both; ``skip``: continue from the first sequence and add
                     the gap to the offset's ``skipped`` count (and log it)
validate             ``json`` (default), ``utf8``, or ``none``
partitionSize        sequences per partition (default 20000)
fetchBatch           messages per pull request (default 2000)
timeout              seconds for a NATS request (default 10)
==================== ==========================================================================

Credentials given as options are visible in the query plan, as with Spark's Kafka source.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

if TYPE_CHECKING:
    import pyarrow as pa
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

FORMAT = "jetstream"
SCHEMA_DDL = (
    "seq BIGINT, subject STRING, ts TIMESTAMP, msg_id STRING, data STRING, "
    "valid BOOLEAN, error STRING, raw BINARY"
)
MSG_ID_HEADER = "Nats-Msg-Id"
STATUS_HEADER = "Status"
DEFAULT_PARTITION_SIZE = 20_000
DEFAULT_FETCH_BATCH = 2_000
DEFAULT_TIMEOUT = 10.0
CONSUMER_INACTIVE_S = 60.0
AGED_OUT_MODES = ("fail", "skip")
VALIDATE_MODES = ("json", "utf8", "none")

T = TypeVar("T")


class SourceError(RuntimeError):
    """The jetstream source was misconfigured or could not read; the message says which."""


class AgedOutError(SourceError):
    """The start sequence is below the stream's first sequence: those events are gone."""

    def __init__(self, stream: str, requested: int, first: int) -> None:
        self.stream, self.requested, self.first = stream, requested, first
        super().__init__(
            f"jetstream stream {stream!r}: start sequence {requested} has aged out; the first "
            f"sequence the stream still holds is {first} (up to {first - requested} events "
            f"lost to the stream's limits). Set option onAgedOut=skip to continue from "
            f"{first}, or start a new query."
        )


def schema() -> StructType:
    """The source's fixed schema, SCHEMA_DDL as a StructType (built without a JVM)."""
    from pyspark.sql.types import (
        BinaryType,
        BooleanType,
        LongType,
        StringType,
        StructField,
        TimestampType,
    )

    types = {
        "seq": LongType(),
        "subject": StringType(),
        "ts": TimestampType(),
        "msg_id": StringType(),
        "data": StringType(),
        "valid": BooleanType(),
        "error": StringType(),
        "raw": BinaryType(),
    }
    return StructType([StructField(name, t, True) for name, t in types.items()])


def register(spark: SparkSession) -> None:
    """Make ``spark.read.format("jetstream")`` and ``readStream.format("jetstream")`` work."""
    spark.dataSource.register(JetStreamDataSource)


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class NatsOptions:
    """Where and how to connect; picklable, so it travels to executors."""

    url: str
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds: str | None = None
    tls_ca: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> NatsOptions:
        url = options.get("url")
        if not url:
            raise SourceError("jetstream source: option 'url' (the NATS server URL) is required")
        return cls(
            url=url,
            user=options.get("user") or None,
            password=options.get("password") or None,
            token=options.get("token") or None,
            creds=options.get("creds") or None,
            tls_ca=options.get("tlsCa") or None,
            timeout=_positive_float(options, "timeout", DEFAULT_TIMEOUT),
            tls_cert=options.get("tlsCert") or None,
            tls_key=options.get("tlsKey") or None,
        )

    async def connect(self, name: str) -> Client:
        from jobs.sink import _tls_kwargs
        from runtime.nats import connect

        return await connect(
            self.url,
            user=self.user,
            password=self.password,
            token=self.token,
            creds=self.creds,
            name=name,
            **_tls_kwargs(self.tls_ca, self.tls_cert, self.tls_key),
        )


@dataclass(frozen=True)
class SourceOptions:
    """The parsed, validated options of one jetstream source."""

    nats: NatsOptions
    stream: str
    subjects: tuple[str, ...] = ()
    starting: str = "earliest"
    ending: str = "latest"
    max_events: int | None = None
    on_aged_out: str = "fail"
    validate: str = "json"
    partition_size: int = DEFAULT_PARTITION_SIZE
    fetch_batch: int = DEFAULT_FETCH_BATCH

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        stream = options.get("stream")
        if not stream:
            raise SourceError("jetstream source: option 'stream' is required")
        subjects = tuple(s.strip() for s in (options.get("subject") or "").split(",") if s.strip())
        on_aged_out = (options.get("onAgedOut") or "fail").lower()
        if on_aged_out not in AGED_OUT_MODES:
            raise SourceError(
                f"jetstream source: onAgedOut must be fail or skip, not {on_aged_out!r}"
            )
        validate = (options.get("validate") or "json").lower()
        if validate not in VALIDATE_MODES:
            raise SourceError(
                f"jetstream source: validate must be one of {VALIDATE_MODES}, not {validate!r}"
            )
        max_events = options.get("maxEventsPerTrigger")
        return cls(
            nats=NatsOptions.from_options(options),
            stream=stream,
            subjects=subjects,
            starting=_offset_spec(options, "startingOffset", "earliest"),
            ending=_offset_spec(options, "endingOffset", "latest"),
            max_events=_positive_int(options, "maxEventsPerTrigger", 0) if max_events else None,
            on_aged_out=on_aged_out,
            validate=validate,
            partition_size=_positive_int(options, "partitionSize", DEFAULT_PARTITION_SIZE),
            fetch_batch=_positive_int(options, "fetchBatch", DEFAULT_FETCH_BATCH),
        )


def _positive_int(options: Mapping[str, str], key: str, default: int) -> int:
    raw = options.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise SourceError(
            f"jetstream source: option {key!r} must be a positive integer, not {raw!r}"
        )
    return value


def _positive_float(options: Mapping[str, str], key: str, default: float) -> float:
    raw = options.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise SourceError(
            f"jetstream source: option {key!r} must be a positive number, not {raw!r}"
        )
    return value


def _offset_spec(options: Mapping[str, str], key: str, default: str) -> str:
    raw = (options.get(key) or default).strip().lower()
    if raw in ("earliest", "latest") or (raw.isdigit() and int(raw) >= 1):
        return raw
    raise SourceError(
        f"jetstream source: option {key!r} must be earliest, latest or a stream sequence >= 1, "
        f"not {raw!r}"
    )


# --------------------------------------------------------------------------- offsets (pure)


@dataclass(frozen=True)
class Bounds:
    """A stream's state: first sequence held and last sequence written (0, 0 when new)."""

    first: int
    last: int

    @property
    def earliest(self) -> int:
        return max(self.first, 1)

    @property
    def latest(self) -> int:
        """The next sequence the stream will write: an exclusive end."""
        return self.last + 1


def resolve_start(spec: str, bounds: Bounds) -> int:
    """The first sequence an ``earliest`` / ``latest`` / number spec names."""
    if spec == "earliest":
        return bounds.earliest
    if spec == "latest":
        return bounds.latest
    return int(spec)


def make_offset(seq: int, skipped: int = 0) -> dict[str, int]:
    return {"seq": seq, "skipped": skipped}


def next_offset(
    start: Mapping[str, int],
    bounds: Bounds,
    *,
    stream: str,
    on_aged_out: str,
    limit: ReadLimit,
    target: int | None = None,
) -> dict[str, int]:
    """The end offset of the next micro-batch from `start` (pure policy, no I/O).

    A start below the stream's first sequence fails (AgedOutError) or, with ``skip``, moves
    to the first sequence and adds the gap to ``skipped``. ``ReadMaxRows`` caps the sequence
    span, ``target`` (Trigger.AvailableNow) caps the end; returning `start` means no new data.
    """
    seq, skipped = int(start["seq"]), int(start.get("skipped", 0))
    base = seq
    if bounds.first > seq:
        if on_aged_out != "skip":
            raise AgedOutError(stream, seq, bounds.first)
        skipped += bounds.first - seq
        base = bounds.first
        log.warning(
            "jetstream stream %r: sequences %d..%d aged out before they were read; skipping "
            "to %d (%d skipped in total)",
            stream,
            seq,
            bounds.first - 1,
            bounds.first,
            skipped,
        )
    latest = bounds.latest if target is None else min(bounds.latest, target)
    end = max(base, latest)
    if isinstance(limit, ReadMaxRows):
        end = min(end, base + max(1, limit.max_rows))
    elif isinstance(limit, ReadMinRows) and end - base < limit.min_rows:
        return make_offset(seq, int(start.get("skipped", 0)))  # wait for more
    return make_offset(end, skipped)


@dataclass
class SeqRange(InputPartition):
    """Stream sequences [start, end) read by one Spark task."""

    start: int
    end: int


def split_range(start: int, end: int, size: int) -> list[SeqRange]:
    """[start, end) cut into ranges of at most `size` sequences (none when empty)."""
    return [SeqRange(s, min(s + size, end)) for s in range(start, end, max(1, size))]


# --------------------------------------------------------------------------- event loop


class _LoopThread:
    """A private asyncio loop on a daemon thread, so sync Spark code can drive nats-py.

    The loop keeps running between calls, so the client answers pings and buffers the next
    pull while Spark consumes the previous one.
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, make: Callable[[], Awaitable[T]], timeout: float) -> T:
        async def run() -> T:
            return await make()

        fut = asyncio.run_coroutine_threadsafe(run(), self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError as err:
            fut.cancel()
            raise SourceError(f"jetstream source: NATS call timed out after {timeout} s") from err

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self.loop.close()


class _Control:
    """The driver's connection for stream state; opened on first use, kept until close()."""

    def __init__(self, opts: SourceOptions) -> None:
        self._opts = opts
        self._lt: _LoopThread | None = None
        self._nc: Client | None = None

    def bounds(self) -> Bounds:
        if self._lt is None:
            self._lt = _LoopThread("jetstream-control")
        return self._lt.call(self._bounds, self._opts.nats.timeout * 2)

    async def _bounds(self) -> Bounds:
        if self._nc is None or self._nc.is_closed:
            self._nc = await self._opts.nats.connect(name=f"jetstream-source-{self._opts.stream}")
        return await stream_bounds(self._nc, self._opts.stream, self._opts.nats.timeout)

    def close(self) -> None:
        lt, nc = self._lt, self._nc
        self._lt = self._nc = None
        if lt is None:
            return
        if nc is not None:
            try:
                lt.call(nc.close, 5.0)
            except Exception as err:  # closing is best effort
                log.debug("jetstream source: close: %r", err)
        lt.close()


async def stream_bounds(nc: Client, stream: str, timeout: float = DEFAULT_TIMEOUT) -> Bounds:
    """The stream's first and last sequence; SourceError naming the stream when it is missing."""
    from nats.js.errors import NotFoundError

    try:
        info = await nc.jetstream(timeout=timeout).stream_info(stream)
    except NotFoundError as err:
        raise SourceError(f"jetstream source: stream {stream!r} does not exist") from err
    return Bounds(first=int(info.state.first_seq or 0), last=int(info.state.last_seq or 0))


# --------------------------------------------------------------------------- reading


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


Event = tuple[int, str, int, str | None, bytes]  # seq, subject, ts ns, msg id, payload


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
        self._chunk: list[Event] = []
        self._want = 0
        self._next_seq = part.start
        self._finished = False
        self._error: str | None = None
        self._done = asyncio.Event()
        self.skipped = 0

    async def open(self) -> None:
        opts, part = self._opts, self._part
        self._nc = await opts.nats.connect(name=f"jetstream-read-{opts.stream}")
        bounds = await stream_bounds(self._nc, opts.stream, opts.nats.timeout)
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
        info = await self._nc.jetstream(timeout=opts.nats.timeout).add_consumer(opts.stream, config)
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

    async def next_chunk(self) -> list[Event] | None:
        """The next events of the range (in sequence order); None when the range is done."""
        while True:
            try:
                await asyncio.wait_for(self._done.wait(), self._opts.nats.timeout)
                problem = self._error
            except TimeoutError:
                problem = f"no answer to a pull within {self._opts.nats.timeout} s"
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


def events_to_batch(events: list[Event], validate: str, arrow_schema: pa.Schema) -> pa.RecordBatch:
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
    lt = _LoopThread("jetstream-read")
    fetcher = _RangeFetcher(opts, part)
    call_timeout = opts.nats.timeout * 3
    try:
        lt.call(fetcher.open, call_timeout)
        while True:
            chunk = lt.call(fetcher.next_chunk, call_timeout)
            if chunk is None:
                break
            if chunk:
                yield events_to_batch(chunk, opts.validate, arrow_schema)
    finally:
        try:
            lt.call(fetcher.close, call_timeout)
        except Exception as err:
            log.debug("jetstream source: close: %r", err)
        lt.close()


# --------------------------------------------------------------------------- Spark API


class JetStreamBatchReader(DataSourceReader):
    """``spark.read.format("jetstream")``: the retained events in [startingOffset, endingOffset)."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts

    def partitions(self) -> list[InputPartition]:
        control = _Control(self.opts)
        try:
            bounds = control.bounds()
        finally:
            control.close()
        start = resolve_start(self.opts.starting, bounds)
        end = bounds.latest if self.opts.ending == "latest" else int(self.opts.ending)
        if bounds.first > start and start < end:
            if self.opts.on_aged_out != "skip":
                raise AgedOutError(self.opts.stream, start, bounds.first)
            log.warning(
                "jetstream stream %r: %d requested sequences aged out; reading from %d",
                self.opts.stream,
                bounds.first - start,
                bounds.first,
            )
            start = bounds.first
        return list(split_range(start, end, self.opts.partition_size)) or [SeqRange(start, start)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_range(self.opts, partition)  # type: ignore[arg-type]


class JetStreamStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("jetstream")``: micro-batches over stream sequence ranges."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self._control: _Control | None = None
        self._target: int | None = None
        self._latest: Bounds | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_control"] = None
        return state

    def _bounds(self) -> Bounds:
        if self._control is None:
            self._control = _Control(self.opts)
        self._latest = self._control.bounds()
        return self._latest

    def initialOffset(self) -> dict:
        return make_offset(resolve_start(self.opts.starting, self._bounds()))

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.opts.max_events:
            return ReadMaxRows(self.opts.max_events)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._bounds().latest

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        return next_offset(
            start,
            self._bounds(),
            stream=self.opts.stream,
            on_aged_out=self.opts.on_aged_out,
            limit=limit,
            target=self._target,
        )

    def reportLatestOffset(self) -> dict | None:
        return make_offset(self._latest.latest) if self._latest else None

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        # A skip recorded in `end` moved the batch's first sequence past the aged-out gap.
        first = int(start["seq"]) + int(end.get("skipped", 0)) - int(start.get("skipped", 0))
        return list(split_range(first, int(end["seq"]), self.opts.partition_size))

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_range(self.opts, partition)  # type: ignore[arg-type]

    def commit(self, end: dict) -> None:
        """Nothing to release: the stream keeps events by its own limits, not by our reads."""

    def stop(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None


class JetStreamDataSource(DataSource):
    """The ``jetstream`` format; options are described in this module's docstring."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> str:
        return SCHEMA_DDL

    def _opts(self, given: StructType) -> SourceOptions:
        if given != schema():
            raise SourceError(
                f"jetstream source: the schema is fixed ({SCHEMA_DDL}); do not pass another"
            )
        return SourceOptions.parse(self.options)

    def reader(self, schema: StructType) -> DataSourceReader:
        return JetStreamBatchReader(self._opts(schema))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return JetStreamStreamReader(self._opts(schema))


def skipped_total(progress: Any) -> int:
    """The aged-out sequences a query skipped so far, from a progress report's end offsets."""
    import json

    if progress is None:
        return 0
    # StreamingQueryProgress is a dict subclass whose nested parts are objects: use its JSON
    data = json.loads(progress.json) if hasattr(progress, "json") else progress
    total = 0
    for source in data.get("sources", []):
        end = source.get("endOffset")
        if isinstance(end, str):
            end = json.loads(end)
        if isinstance(end, Mapping):
            total += int(end.get("skipped", 0))
    return total


__all__ = [
    "FORMAT",
    "SCHEMA_DDL",
    "AgedOutError",
    "Bounds",
    "JetStreamBatchReader",
    "JetStreamDataSource",
    "JetStreamStreamReader",
    "NatsOptions",
    "SeqRange",
    "SourceError",
    "SourceOptions",
    "check_payload",
    "events_to_batch",
    "make_offset",
    "next_offset",
    "read_range",
    "register",
    "resolve_start",
    "schema",
    "skipped_total",
    "split_range",
    "stream_bounds",
]
