"""Where analysis results go: a results stream, the latest value per key in NATS KV, dead letters.

`ResultSink.write` is a ``foreachBatch`` function. For each result row it publishes to
``<prefix>.<query>`` with ``Nats-Msg-Id = "<query>:<batchId>:<key>"`` and puts the row into
the KV bucket under the key (``<kv_prefix>.<key>`` when `kv_prefix` is set: the analysis jobs
set it to the query name, as docs/contracts.md asks). The results go out through the
pipelined-ack publisher of runtime/nats/publisher.py (up to `max_in_flight` acks pending, a failed
publish resent with the same id up to `attempts` times) and every ack is awaited before
`write` returns, so Spark records the batch as done only once its results are durable. A
batch Spark replays after a crash publishes the same ids, which JetStream's duplicate window
drops, and puts the same values: with the jetstream source's sequence offsets the pipeline is
exactly-once end to end (the results stream's dedup window must outlast a restart).

KV is written only after the batch's results are acknowledged, and each put is conditional
(`_put_latest`): a value carries its run (the query's checkpoint id) and batch id, so an older
batch never overwrites a newer value, and a run whose checkpoint was reset (batch ids back at
0) is refused with a SinkError naming the cause instead of rolling KV back. A job recomputed
as a batch view (jobs/batch_view.py) starts a new *generation*: its ids are
``<query>@<generation>:<batchId>:<key>`` and its values carry the generation, which outranks
any older generation's run and batch.

A warm pair of drivers (jobs/standby.py) installs its lease as the process's write fence
(`set_fence`): every write (a batch's results, each KV put, dead letters, retired keys) is
refused with `LeaseFenced` unless the lease is fresh (renewed well within its TTL: no I/O), so
a driver that was paused or cut off past its lease writes nothing once it runs again, and
its query fails instead. Results and KV values then carry the lease's epoch
(``Tierflow-Epoch``), and a KV value of a newer epoch than the sink's own fails the put
unless the bucket still names this driver (checked then: the lease bucket may have been
made anew, restarting its revisions).

Malformed events read by the jetstream source (``valid`` false) go to
``<deadletter_prefix>.<stream>`` with their original bytes, the reason and their origin in
headers, and ``Nats-Msg-Id = "dl:<stream>:<seq>"``, so replays do not duplicate them either.

A stream must capture the results and dead-letter subjects (e.g. ``results.>``,
``deadletter.>``); a missing one fails the batch with an error naming the subject, rather
than dropping results. The KV bucket is created (history 1, file storage) when missing.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import math
import re
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import msgspec

from runtime.errors import FencedError, TierflowError
from runtime.loop_thread import LoopThread
from runtime.nats.publisher import MSG_ID_HEADER, JetStreamPublisher, Outgoing, Published
from runtime.nats.server import NatsEndpoint, js_publish
from runtime.waiting import WaitTimeout, await_until

if TYPE_CHECKING:
    from nats.aio.client import Client
    from pyspark.sql import DataFrame

log = logging.getLogger(__name__)

QUERY_HEADER = "Tierflow-Query"
BATCH_HEADER = "Tierflow-Batch"
KEY_HEADER = "Tierflow-Key"
ERROR_HEADER = "Tierflow-Error"
SOURCE_STREAM_HEADER = "Tierflow-Source-Stream"
SOURCE_SEQ_HEADER = "Tierflow-Source-Seq"
SOURCE_SUBJECT_HEADER = "Tierflow-Source-Subject"
SOURCE_MSG_ID_HEADER = "Tierflow-Source-Msg-Id"
RUN_HEADER = "Tierflow-Run"  # on KV values: the query's checkpoint id (see `_put_latest`)
GENERATION_HEADER = "Tierflow-Generation"  # on KV values: the job's batch-view generation
EPOCH_HEADER = "Tierflow-Epoch"  # on results and KV values: the writer's lease epoch (`set_fence`)
_RECONNECT_WAIT_S = 2.0
_EXPECT_LAST = "Nats-Expected-Last-Subject-Sequence"
_WRONG_LAST_SEQUENCE = 10071  # JetStream: the expected last subject sequence did not match
B64_PREFIX = "b64."
NULL_KEY = "b64.-"  # never produced by encoding a string: base64 output is >= 2 characters
EMPTY_KEY = "b64.="
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")
_SUBJECT = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")
_PLAIN_KV_KEY = re.compile(r"^[-/_=a-zA-Z0-9]([-/_=.a-zA-Z0-9]*[-/_=a-zA-Z0-9])?$")
_HEADER_MAX = 512
_HELD_MAX = 10_000  # KV values a sink remembers putting (`_put_latest`), ~1 MB
_encoder = msgspec.json.Encoder(enc_hook=str)

T = TypeVar("T")


class SinkError(TierflowError, RuntimeError):
    """Results could not be made durable; the batch must fail (and be replayed)."""


class LeaseFenced(FencedError, SinkError):
    """This process no longer holds (or cannot show it holds) the lease its writes need.

    A `FencedError` (another driver may write now) and a `SinkError` (the batch fails)."""


class WriteFence(Protocol):
    """A lease guarding this process's writes (runtime.nats.lease.LeaseKeeper)."""

    @property
    def epoch(self) -> int: ...

    def fresh(self) -> bool: ...

    async def confirm(self) -> bool: ...


_fence: WriteFence | None = None


def set_fence(fence: WriteFence | None) -> None:
    """Guard every sink of this process with `fence` from now on (None: unguarded)."""
    global _fence
    _fence = fence


def write_fence() -> WriteFence | None:
    """The fence this process's sinks check, if any."""
    return _fence


def check_fence(what: str) -> int:
    """Raise `LeaseFenced` unless this process may write now; the epoch to write with (0 when
    unguarded). Cheap: no I/O."""
    fence = _fence
    if fence is None:
        return 0
    if not fence.fresh():
        raise LeaseFenced(
            f"{what}: refused, this driver's lease (epoch {fence.epoch}) is lost or stale: "
            "another driver may run the queries now"
        )
    return fence.epoch


def kv_key(key: Any) -> str:
    """The KV key (also the id's last part) for a result key; reversible with `key_from_kv`.

    Keys KV accepts as they are stay as they are; others (spaces, unicode, ...) become
    ``b64.`` + URL-safe base64. None and "" have reserved forms.
    """
    if key is None:
        return NULL_KEY
    text = key if isinstance(key, str) else str(key)
    if text == "":
        return EMPTY_KEY
    if _PLAIN_KV_KEY.match(text) and not text.startswith(B64_PREFIX):
        return text
    return B64_PREFIX + base64.urlsafe_b64encode(text.encode("utf-8")).decode("ascii").rstrip("=")


def key_from_kv(kv: str) -> str | None:
    """The result key a `kv_key` came from."""
    if kv == NULL_KEY:
        return None
    if kv == EMPTY_KEY:
        return ""
    if kv.startswith(B64_PREFIX):
        body = kv[len(B64_PREFIX) :]
        return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode("utf-8")
    return kv


def result_id(query: str, batch_id: int, key: Any) -> str:
    """The Nats-Msg-Id of one result: the same for a replay of the same batch."""
    return f"{query}:{batch_id}:{kv_key(key)}"


def result_kv_key(query: str, key: Any) -> str:
    """The KV key of a query's result (docs/contracts.md): ``<query>.<kv_key(key)>``.

    A sink writes it when its `kv_prefix` is the query name, so queries never collide.
    """
    return f"{query}.{kv_key(key)}"


def _header_value(value: Any) -> str:
    text = " ".join(str(value).split())  # no CR/LF in a header
    return text[:_HEADER_MAX]


class _KvPut(NamedTuple):
    subject: str
    payload: bytes


@dataclass
class BatchReport:
    """What one call made durable; duplicates are publishes JetStream had already stored."""

    published: int = 0
    duplicates: int = 0
    kv_puts: int = 0
    kv_stale: int = 0  # keys KV already held from a newer (or the same) batch: left alone
    # where the batch's foreachBatch spent its time, ms (set by jobs.running.JobWriter):
    # Spark's own progress counts all of it as addBatch
    parts_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class SinkStats:
    """Totals since this sink object was created (on the driver, where foreachBatch runs)."""

    batches: int = 0
    results: int = 0
    duplicates: int = 0
    kv_puts: int = 0
    kv_reads: int = 0  # KV values read back before a put (see `_put_latest`)
    dead_letters: int = 0
    dead_letter_duplicates: int = 0
    last_batch_id: int | None = None


class _Connection:
    """One NATS connection kept between a sink's batches, on a loop thread of its own.

    Connecting (and TLS, and authenticating) for every micro-batch cost more than the
    batch's publishes. The connection is made on first use, made again when nats-py has
    closed it, dropped after a call that failed (the next call starts clean, failing fast
    if NATS is gone, as a fresh connect does) and closed after `idle_s` without a call or
    by `close` (the driver calls `close_sinks` when a query stops).
    """

    def __init__(self, connect: Callable[[], Awaitable[Client]], name: str, idle_s: float):
        self._connect = connect
        self._name = name
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._lt: LoopThread | None = None
        self._nc: Client | None = None
        self._timer: threading.Timer | None = None
        self._calls = 0  # an idle timer closes only if no call came after it was armed

    def run(self, fn: Callable[[Client], Awaitable[T]]) -> T:
        """`fn(client)` on the kept connection, from sync code (never the loop's thread)."""
        with self._lock:
            self._calls += 1
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._lt is None:
                lt = LoopThread(f"result-sink-{self._name}")
                lt.start()
                self._lt = lt
            try:
                return self._lt.run_sync(self._on_client(fn), None)
            except BaseException:
                self._close_locked()
                raise
            finally:
                if self._lt is not None:
                    calls = self._calls
                    timer = threading.Timer(self._idle_s, self._idle, (calls,))
                    timer.daemon = True
                    timer.start()
                    self._timer = timer

    async def _on_client(self, fn: Callable[[Client], Awaitable[T]]) -> T:
        if self._nc is None or self._nc.is_closed:
            self._nc = await self._connect()
        return await fn(self._nc)

    def _idle(self, calls: int) -> None:
        with self._lock:
            if calls == self._calls:
                self._close_locked()

    def close(self) -> None:
        """Close the connection and stop its loop thread; a later call opens them again."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        lt, nc, self._lt, self._nc = self._lt, self._nc, None, None
        if lt is None:
            return
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                lt.run_sync(nc.close(), 10.0)
        lt.stop()

    @property
    def open(self) -> bool:
        return self._lt is not None


_sinks: weakref.WeakValueDictionary[int, ResultSink] = weakref.WeakValueDictionary()
_sinks_lock = threading.Lock()


def close_sinks(query: str) -> int:
    """Close the kept connection of every sink of `query` in this process (its query
    stopped or died); returns how many were open. A sink used again reconnects."""
    with _sinks_lock:
        sinks = [s for s in _sinks.values() if s.query_name == query]
    closed = 0
    for sink in sinks:
        closed += sink.connected
        sink.close()
    return closed


def _as_dict(row: Any) -> dict[str, Any]:
    if isinstance(row, Mapping):
        return dict(row)
    if hasattr(row, "asDict"):
        return row.asDict(recursive=True)
    raise TypeError(f"a result row must be a Row or a mapping, not {type(row).__name__}")


@dataclass
class ResultSink:
    """Idempotent results for one query: results stream + latest value per key in KV.

    One concept: a batch's results made durable once, whichever writer replays it.

    `nats` is where the streams are: an endpoint (credentials, TLS), or a plain URL.
    """

    nats: NatsEndpoint | str
    results_subject_prefix: str = "results"
    kv_bucket: str = "results"
    query_name: str = "query"
    key_column: str = "key"
    deadletter_prefix: str = "deadletter"
    timeout: float = 10.0
    max_in_flight: int = 512
    attempts: int = 3
    create_bucket: bool = True
    kv_prefix: str = ""
    run_id: str = ""
    generation: int = 0
    idle_close_s: float = 30.0
    stats: SinkStats = field(default_factory=SinkStats, compare=False)
    _bucket_ready: bool = field(default=False, init=False, repr=False, compare=False)
    # KV subject -> (sequence, batch id, run) of the value this sink last put there
    _held: dict[str, tuple[int, int, str]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _conn: _Connection = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.nats, str):
            self.nats = NatsEndpoint(self.nats)
        if not _TOKEN.match(self.query_name):
            raise ValueError(f"query_name must match [A-Za-z0-9_-]+, not {self.query_name!r}")
        if not _TOKEN.match(self.kv_bucket):
            raise ValueError(f"kv_bucket must match [A-Za-z0-9_-]+, not {self.kv_bucket!r}")
        if self.kv_prefix and not _SUBJECT.match(self.kv_prefix):
            raise ValueError(f"kv_prefix must be plain key tokens, not {self.kv_prefix!r}")
        for name in ("results_subject_prefix", "deadletter_prefix"):
            if not _SUBJECT.match(getattr(self, name)):
                raise ValueError(
                    f"{name} must be plain subject tokens, not {getattr(self, name)!r}"
                )
        if self.max_in_flight < 1 or self.attempts < 1:
            raise ValueError("max_in_flight and attempts must be >= 1")
        self._conn = _Connection(self.connect, self.query_name, self.idle_close_s)
        with _sinks_lock:
            _sinks[id(self)] = self

    @classmethod
    def for_query(cls, nats: NatsEndpoint, query: str, **kwargs: Any) -> ResultSink:
        """The sink of analysis query `query`: ``results.<query>``, KV keys ``<query>.<key>``."""
        return cls(nats, query_name=query, kv_prefix=query, **kwargs)

    @property
    def id_prefix(self) -> str:
        """The results' id prefix: the query, and its generation once it has one."""
        return f"{self.query_name}@{self.generation}" if self.generation else self.query_name

    @property
    def results_subject(self) -> str:
        return f"{self.results_subject_prefix}.{self.query_name}"

    def deadletter_subject(self, stream: str) -> str:
        return f"{self.deadletter_prefix}.{stream}"

    # ---- Spark entry points ------------------------------------------------------------

    def write(self, df: DataFrame, batch_id: int) -> None:
        """``foreachBatch`` function: the batch's result rows, one per key, made durable.

        The rows are collected to the driver (results are per-key aggregates, not events),
        once the fence allows this process to write: a fenced driver runs no more of the
        batch's Spark job either (its state store's next version is the new driver's).
        """
        check_fence(f"batch {batch_id} of {self.query_name!r}")
        rows = df.collect()
        self.publish_results(rows, batch_id)

    def dead_letters(self, stream: str) -> DeadLetterBatch:
        """A ``foreachBatch`` function sending a jetstream source's invalid rows to dead letter."""
        return DeadLetterBatch(self, stream)

    # ---- sync API ----------------------------------------------------------------------

    def publish_results(self, rows: Iterable[Any], batch_id: int) -> BatchReport:
        """Publish and KV-put every row; return only when all are acknowledged.

        One row per key: two rows with the same key in a batch would share an id, so the
        second would be dropped as a duplicate; that is refused with ValueError.
        """
        dicts = [_as_dict(r) for r in rows]
        return self._conn.run(lambda nc: self.apublish_results(nc, dicts, batch_id))

    def dead_letter(self, rows: Iterable[Any], stream: str) -> BatchReport:
        """Publish malformed source rows (seq, subject, msg_id, error, raw/data) to dead letter."""
        dicts = [_as_dict(r) for r in rows]
        if not dicts:
            return BatchReport()
        return self._conn.run(lambda nc: self.adead_letter(nc, dicts, stream))

    def close(self) -> None:
        """Close the NATS connection kept between batches (a later call reconnects)."""
        self._conn.close()

    @property
    def connected(self) -> bool:
        """Whether a connection is kept open now."""
        return self._conn.open

    # ---- async API ---------------------------------------------------------------------

    async def connect(self) -> Client:
        """A connection for this sink's batches: it reconnects for about `timeout` seconds
        (what a batch waits for NATS to come back), then closes, so a kept connection to a
        server that went away is not retried forever; the next batch connects anew."""
        assert isinstance(self.nats, NatsEndpoint)  # __post_init__ made it one
        return await self.nats.connect(
            name=f"result-sink-{self.query_name}",
            max_reconnect_attempts=max(1, math.ceil(self.timeout / _RECONNECT_WAIT_S)),
            reconnect_time_wait=_RECONNECT_WAIT_S,
            error_cb=_connection_error,
        )

    async def apublish_results(
        self, nc: Client, rows: list[dict[str, Any]], batch_id: int
    ) -> BatchReport:
        """`publish_results` on an open connection."""
        results: list[Outgoing] = []
        puts: list[_KvPut] = []
        seen: set[str] = set()
        for row in rows:
            if self.key_column not in row:
                raise ValueError(
                    f"result sink {self.query_name!r}: row has no key column "
                    f"{self.key_column!r}: {sorted(row)}"
                )
            key = kv_key(row[self.key_column])
            if key in seen:
                raise ValueError(
                    f"result sink {self.query_name!r}: batch {batch_id} has two rows for key "
                    f"{row[self.key_column]!r}; results must be one row per key"
                )
            seen.add(key)
            payload = _encoder.encode(row)
            headers = {QUERY_HEADER: self.query_name, BATCH_HEADER: str(batch_id), KEY_HEADER: key}
            msg_id = f"{self.id_prefix}:{batch_id}:{key}"  # the publisher sends it as Nats-Msg-Id
            results.append(Outgoing(msg_id, self.results_subject, payload, headers))
            kv = f"{self.kv_prefix}.{key}" if self.kv_prefix else key
            puts.append(_KvPut(f"$KV.{self.kv_bucket}.{kv}", payload))
        if results:
            await self._ensure_bucket(nc)
        if len(self._held) > _HELD_MAX:
            self._held.clear()
        epoch = check_fence(f"results of {self.query_name!r} batch {batch_id}")
        if epoch:
            for out in results:
                out.headers[EPOCH_HEADER] = str(epoch)
        acks = await self._publish_all(nc, results)  # KV shows only what results hold
        dups = sum(1 for a in acks if a.duplicate)
        sem = asyncio.Semaphore(self.max_in_flight)

        async def put(p: _KvPut) -> bool:
            async with sem:
                return await self._put_latest(nc, p, batch_id)

        done = await asyncio.gather(*(put(p) for p in puts))
        report = BatchReport(
            published=len(results),
            duplicates=dups,
            kv_puts=sum(done),
            kv_stale=len(done) - sum(done),
        )
        s = self.stats
        s.batches += 1
        s.results += report.published
        s.duplicates += report.duplicates
        s.kv_puts += report.kv_puts
        s.last_batch_id = batch_id
        log.debug("result sink %s: batch %d: %s", self.query_name, batch_id, report)
        return report

    async def _put_latest(self, nc: Client, put: _KvPut, batch_id: int) -> bool:
        """Put one KV value unless KV holds a newer batch's; False when left alone.

        Each value carries its run (the query's checkpoint id) and batch id in headers, and
        the put is conditional on the key's last revision, so a late replay of an older
        batch never overwrites a newer value, even racing it. A value from another run
        means the checkpoint was reset: refused with SinkError (batch ids restart at 0, so
        the new run's result ids would be dropped as the old run's duplicates). Generations
        come first: a newer one's value is left alone, an older one's is replaced.

        The put is first tried without reading the key, conditional on the revision this
        sink put there itself for an earlier batch of this run, or on no value at all for
        a key it has not put: JetStream stores it only when KV holds exactly that, which
        is a value the checks below accept. Any other value fails the put, and the key is
        read and judged as above. So the rules are the same; a batch's keys cost one round
        trip each instead of two while this sink is their only writer.
        """
        import nats.errors
        from nats.js.errors import APIError

        js = nc.jetstream(timeout=self.timeout)
        headers = {BATCH_HEADER: str(batch_id), RUN_HEADER: self.run_id}
        if self.generation:
            headers[GENERATION_HEADER] = str(self.generation)
        if epoch := check_fence(f"KV put to {put.subject!r}"):
            headers[EPOCH_HEADER] = str(epoch)
        held = self._held.pop(put.subject, None)
        if held is None or (held[1] < batch_id and held[2] == self.run_id):
            expect = {_EXPECT_LAST: str(0 if held is None else held[0])}
            try:
                ack = await js_publish(js, put.subject, put.payload, headers={**headers, **expect})
                self._held[put.subject] = (ack.seq, batch_id, self.run_id)
                return True
            except (TimeoutError, nats.errors.TimeoutError):
                pass  # maybe stored: the read says
            except APIError as err:
                if err.err_code != _WRONG_LAST_SEQUENCE:
                    raise SinkError(f"KV put to {put.subject!r} failed: {err}") from err
        return await self._put_checked(js, put, batch_id, headers)

    async def _put_checked(
        self, js: Any, put: _KvPut, batch_id: int, headers: dict[str, str]
    ) -> bool:
        """`_put_latest` reading the key's value first and judging it."""
        import nats.errors
        from nats.js.errors import APIError, NotFoundError

        stream = f"KV_{self.kv_bucket}"
        for attempt in range(self.attempts + 5):
            if attempt:
                await asyncio.sleep(0.05 * attempt)
            try:
                self.stats.kv_reads += 1
                last = await js.get_last_msg(stream, put.subject)
                held_seq, held = last.seq or 0, dict(last.headers or {})
            except NotFoundError:
                held_seq, held = 0, {}
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            op = (held.get("KV-Operation") or "PUT").upper()
            await self._check_epoch(int(held.get(EPOCH_HEADER) or 0) if op == "PUT" else 0, put)
            held_gen = int(held.get(GENERATION_HEADER) or 0) if op == "PUT" else 0
            if held_gen > self.generation:
                return False  # a newer generation (a later recompute) owns the key
            if op == "PUT" and BATCH_HEADER in held and held_gen == self.generation:
                run, batch = held.get(RUN_HEADER, ""), int(held[BATCH_HEADER])
                if run and self.run_id and run != self.run_id:
                    raise SinkError(
                        f"query {self.query_name!r}: its checkpoint was reset (KV key "
                        f"{put.subject!r} holds batch {batch} of run {run}, this run is "
                        f"{self.run_id} at batch {batch_id}); its results would be dropped as "
                        "duplicates: give the job a new name, or restore its checkpoint"
                    )
                if batch >= batch_id:
                    return False
            expect = {_EXPECT_LAST: str(held_seq)}
            try:
                ack = await js_publish(js, put.subject, put.payload, headers={**headers, **expect})
                self._held[put.subject] = (ack.seq, batch_id, self.run_id)
                return True
            except (TimeoutError, nats.errors.TimeoutError):
                continue  # maybe stored: the next read says
            except APIError as err:
                if err.err_code != _WRONG_LAST_SEQUENCE:
                    raise SinkError(f"KV put to {put.subject!r} failed: {err}") from err
                # another writer got there first: read again
        raise SinkError(f"KV put to {put.subject!r}: no conditional write after retries")

    async def _check_epoch(self, held_epoch: int, put: _KvPut) -> None:
        """A value of a newer epoch than this sink's: another driver took the lease since,
        unless the bucket still names this one (its revisions started over)."""
        fence = _fence
        if fence is None or held_epoch <= fence.epoch:
            return
        if not await fence.confirm():
            raise LeaseFenced(
                f"KV put to {put.subject!r}: refused, the key holds a value of epoch "
                f"{held_epoch}, newer than this driver's {fence.epoch}"
            )

    def retire_keys(self, keep: Iterable[Any]) -> int:
        """Delete this query's KV keys an older generation wrote that `keep` (result keys)
        does not hold: a batch view replaces the whole view. Returns how many went."""
        wanted = {kv_key(k) for k in keep}
        return self._conn.run(lambda nc: self._aretire(nc, wanted))

    async def _aretire(self, nc: Client, keep: set[str]) -> int:
        from nats.js.errors import NotFoundError

        if not self.kv_prefix:
            raise ValueError("retire_keys needs the sink's kv_prefix (its query's keys)")
        await self._ensure_bucket(nc)
        check_fence(f"retiring keys of {self.query_name!r}")
        js = nc.jetstream(timeout=self.timeout)
        prefix = f"$KV.{self.kv_bucket}.{self.kv_prefix}."
        info = await js.stream_info(f"KV_{self.kv_bucket}", subjects_filter=f"{prefix}>")
        kv = await js.key_value(self.kv_bucket)
        gone = 0
        for subject in sorted(info.state.subjects or {}):
            key = subject[len(prefix) :]
            if key in keep:
                continue
            try:
                last = await js.get_last_msg(f"KV_{self.kv_bucket}", subject)
            except NotFoundError:
                continue
            held = dict(last.headers or {})
            if (held.get("KV-Operation") or "PUT").upper() != "PUT":
                continue
            if int(held.get(GENERATION_HEADER) or 0) < self.generation:
                await kv.delete(f"{self.kv_prefix}.{key}")
                gone += 1
        return gone

    async def adead_letter(
        self, nc: Client, rows: list[dict[str, Any]], stream: str
    ) -> BatchReport:
        """`dead_letter` on an open connection."""
        subject = self.deadletter_subject(stream)
        epoch = check_fence(f"dead letters of {stream!r}")
        out = []
        for row in rows:
            raw = row.get("raw")
            if raw is None:
                raw = (row.get("data") or "").encode("utf-8")
            headers = {
                SOURCE_STREAM_HEADER: stream,
                SOURCE_SEQ_HEADER: str(row["seq"]),
                ERROR_HEADER: _header_value(row.get("error") or "malformed"),
            }
            if row.get("subject"):
                headers[SOURCE_SUBJECT_HEADER] = _header_value(row["subject"])
            if row.get("msg_id"):
                headers[SOURCE_MSG_ID_HEADER] = _header_value(row["msg_id"])
            if epoch:
                headers[EPOCH_HEADER] = str(epoch)
            out.append(Outgoing(f"dl:{stream}:{row['seq']}", subject, bytes(raw), headers))
        acks = await self._publish_all(nc, out)
        dups = sum(1 for a in acks if a.duplicate)
        self.stats.dead_letters += len(out)
        self.stats.dead_letter_duplicates += dups
        log.warning(
            "result sink %s: %d malformed events from stream %r sent to %s",
            self.query_name,
            len(out),
            stream,
            subject,
        )
        return BatchReport(published=len(out), duplicates=dups)

    async def _ensure_bucket(self, nc: Client) -> None:
        from nats.js.api import KeyValueConfig, StorageType
        from nats.js.errors import BucketNotFoundError, NotFoundError

        if self._bucket_ready:
            return
        js = nc.jetstream(timeout=self.timeout)
        try:
            await js.key_value(self.kv_bucket)
        except (BucketNotFoundError, NotFoundError) as err:
            if not self.create_bucket:
                raise SinkError(f"KV bucket {self.kv_bucket!r} does not exist") from err
            await js.create_key_value(
                KeyValueConfig(bucket=self.kv_bucket, history=1, storage=StorageType.FILE)
            )
        self._bucket_ready = True

    async def _publish_all(self, nc: Client, msgs: list[Outgoing]) -> list[Published]:
        """Publish all through `JetStreamPublisher` (up to `max_in_flight` acks pending); a
        failure it calls retryable is resent with the same id, up to `attempts` tries in all.
        Any message still not acknowledged fails the batch (SinkError)."""
        publisher = JetStreamPublisher(nc, self.max_in_flight, self.timeout)
        try:
            done, failed = await publisher.publish_with_retry(
                msgs,
                attempts=self.attempts,
                backoff=_backoff,
                sleep=lambda s: self._pause(nc, s),
            )
        finally:
            await publisher.close()
        if failed:
            subjects = {m.id: m.subject for m in msgs}
            first = failed[0]
            raise SinkError(
                f"publishing to {subjects[first.id]!r} failed ({len(failed)} of {len(msgs)} "
                f"messages not acknowledged after up to {self.attempts} attempts): {first.error}"
            )
        return done

    async def _pause(self, nc: Client, seconds: float) -> None:
        """The pause before a resend, then up to `timeout` more while the client reconnects:
        the publisher fails at once when disconnected, and a batch should ride out a NATS
        blip as long as a publish waiting for its ack would (each try up to `timeout`)."""
        await asyncio.sleep(seconds)
        with contextlib.suppress(WaitTimeout):  # still down: the resend fails and says so
            await await_until(
                lambda: nc.is_connected or nc.is_closed, self.timeout, what="NATS reconnect"
            )


async def _connection_error(err: Exception) -> None:
    """A kept connection's errors (a server gone between batches, reconnects): a batch that
    cannot publish fails with a SinkError saying why, so these are only logged for debug."""
    log.debug("result sink connection: %s: %s", type(err).__name__, err)


def _backoff(attempt: int) -> float:
    """Seconds before resend `attempt` (1-based): 0.2, 0.4, 0.8, ..."""
    return 0.1 * 2**attempt


@dataclass
class DeadLetterBatch:
    """``foreachBatch`` function: rows of a jetstream source with ``valid`` false -> dead letter.

    `on_batch(batch_id, report)` runs after the dead letters are durable (`report.published`
    of them); a replayed batch calls it again with the same id, so a counter keyed by batch id
    stays exact.
    """

    sink: ResultSink
    stream: str
    on_batch: Callable[[int, BatchReport], None] | None = None

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        bad = df.where("valid = false").select("seq", "subject", "msg_id", "error", "raw", "data")
        report = self.sink.dead_letter(bad.collect(), self.stream)
        if self.on_batch is not None:
            self.on_batch(batch_id, report)


__all__ = [
    "MSG_ID_HEADER",
    "BatchReport",
    "DeadLetterBatch",
    "LeaseFenced",
    "ResultSink",
    "SinkError",
    "SinkStats",
    "WriteFence",
    "check_fence",
    "close_sinks",
    "key_from_kv",
    "kv_key",
    "result_id",
    "result_kv_key",
    "set_fence",
    "write_fence",
]


async def kv_items(js: Any, bucket: str) -> dict[str, bytes]:
    """Every live key of a KV bucket with its value.

    The keys come from the bucket stream's per-subject counts (one request), not from
    nats-py's `KeyValue.keys`, whose watcher answers "no keys" when it times out, which
    it does on a loaded machine with keys in the bucket.
    """
    from nats.js.errors import KeyDeletedError, KeyNotFoundError, NotFoundError

    prefix = f"$KV.{bucket}."
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
    kv = await js.key_value(bucket)
    out: dict[str, bytes] = {}
    for subject in sorted(info.state.subjects or {}):
        key = subject[len(prefix) :]
        try:
            entry = await kv.get(key)
        except (KeyDeletedError, KeyNotFoundError, NotFoundError):
            continue
        if entry.value is not None:
            out[key] = entry.value
    return out


async def results_by_query(js: Any, bucket: str = "results") -> dict[str, dict[Any, Any]]:
    """A results bucket as {query: {result key: row}} (KV keys are `<query>.<kv key>`)."""
    out: dict[str, dict[Any, Any]] = {}
    for key, value in (await kv_items(js, bucket)).items():
        query, _, rest = key.partition(".")
        out.setdefault(query, {})[key_from_kv(rest)] = msgspec.json.decode(value)
    return out
