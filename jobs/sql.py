"""Ad-hoc SQL over the streams and results (book ch. 8): one table per stream, whole history.

A stream's table is its archive (jobs/archive.py) up to the archive's committed position,
plus the live tail still only in JetStream from there on, read by the ``jetstream`` source
in batch mode: every event once, whether it is archived yet or not. Without an archive the
table is what the stream retains. `results` is a stream like the others.

Columns are the events' JSON fields, by a Spark DDL schema declared in config
(`[streams.X] schema`) or inferred from a sample of the newest events, plus the event's
envelope: ``_seq``, ``_subject``, ``_ts`` and ``_id``. Malformed events are left out
(they are in ``deadletter``).

Queries pass `runtime.data.sql_check.check_select` first; only the tables a query names are
built. A query that names no table is run only for a caller allowed on every table: it reads
no stream, so no stream's permission covers it. Each query reads its tables through temp
views of its own and runs under its own Spark job tag, cancelled when it overruns its
timeout, in the scheduler pool the caller names; its answer holds at most `limit` rows and
`max_bytes` of JSON (rows past either are left out and the answer says `truncated`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import decimal
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.archive import ARCHIVE_COLUMNS, archive_position, read_archive
from jobs.read_lease import HistoryGap, ReadLease
from jobs.spark_session import POOL_PROPERTY
from runtime.config import Config
from runtime.data.sql_check import CheckedQuery, SqlRefused, check_select
from runtime.errors import TierflowError
from runtime.nats.server import NatsEndpoint

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, DataFrameReader, SparkSession
    from pyspark.sql.types import StructType

    from jobs.jetstream_options import Bounds

__all__ = [
    "ENVELOPE",
    "SAMPLE_EVENTS",
    "SqlResult",
    "SqlTimeout",
    "StreamTable",
    "run_sql",
    "stream_events",
    "json_result",
    "representable",
    "table_frame",
    "tables_for",
]

SAMPLE_EVENTS = 1_000
MAX_ANSWER_BYTES = 8 << 20  # the rows of one answer as JSON
CANCEL_EVERY_S = 0.5
CANCEL_TRIES = 240  # two minutes of cancelling after the timeout, then give up
ENVELOPE = {"_seq": "seq", "_subject": "subject", "_ts": "ts", "_id": "msg_id"}


class SqlTimeout(TierflowError, TimeoutError):
    """The query ran past its timeout and was cancelled."""


@dataclass(frozen=True)
class StreamTable:
    """Where a stream's table comes from: its archive root (None: not archived) and the
    checkpoint root the archive's position is read from; `schema` a Spark DDL ('' infers)."""

    stream: str
    archive_root: str | None = None
    checkpoint_root: str | Path | None = None
    schema: str = ""


@dataclass
class SqlResult:
    columns: list[str]
    rows: list[tuple[Any, ...]]
    truncated: bool
    tables: list[str] = field(default_factory=list)
    # fields of an inferred schema left out of a table, and why (`representable`)
    notes: list[str] = field(default_factory=list)


def tables_for(cfg: Config, checkpoint_root: str | Path) -> dict[str, StreamTable]:
    """One table per configured stream (`results` included): its archive, if it has one,
    whose position is read under `checkpoint_root` (`jobs.archive.queries_root`)."""
    return {
        name: StreamTable(
            stream=name,
            archive_root=cfg.archive_root(name) if s.archive is not None else None,
            checkpoint_root=str(checkpoint_root) if s.archive is not None else None,
            schema=s.schema,
        )
        for name, s in cfg.streams.items()
    }


def plain(value: Any) -> Any:
    """A cell as JSON takes it (Spark gives datetimes, decimals, rows, bytes)."""
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    if hasattr(value, "asDict"):
        return {k: plain(v) for k, v in value.asDict(recursive=True).items()}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def json_result(result: SqlResult) -> dict[str, Any]:
    """The result as plain JSON data: columns, rows as lists, truncated, tables, and
    `notes` when a table's inferred schema left fields out."""
    out: dict[str, Any] = {
        "columns": result.columns,
        "rows": [[plain(v) for v in row] for row in result.rows],
        "truncated": result.truncated,
        "tables": result.tables,
    }
    if result.notes:
        out["notes"] = result.notes
    return out


def stream_events(
    spark: SparkSession, nats: NatsEndpoint, table: StreamTable, until: int = 0
) -> DataFrame:
    """Every retained or archived event of the stream, each once (the source's columns);
    with `until`, only those with a sequence below it.

    Archived: the archive below its position P, and the live tail from P read at once,
    under a reader lease that holds retention back from P (jobs/read_lease.py), and kept
    (Spark's local checkpoint, so it is never read again later, unprotected). A tail whose
    start was purged anyway fails (HistoryGap naming the range), never answers short."""
    tail = (
        spark.read.format("jetstream").options(**nats.to_options()).option("stream", table.stream)
    )
    if until:
        tail = tail.option("endingOffset", str(until))
    if table.archive_root is None or table.checkpoint_root is None:
        return tail.option("onAgedOut", "skip").load()  # what the stream retains
    reader = f"history read, pid {os.getpid()}"
    with ReadLease(table.checkpoint_root, table.stream, reader) as lease:
        # the lease (at 0) is written before the position is read: see jobs/read_lease.py
        position = archive_position(table.checkpoint_root, table.stream)
        start = position.next_seq if position else _first_seq(nats, table.stream)
        lease.move(start)
        live = _read_tail(nats, tail, table.stream, start, until)
    if position is None:
        return live
    # a batch the archive commits meanwhile is in both: the archive side stops at the
    # position read here and the tail starts there
    archived = read_archive(spark, table.archive_root, table.stream)
    archived = archived.where(archived.seq < position.next_seq).select(*ARCHIVE_COLUMNS)
    return archived.unionByName(live)


def _read_tail(
    nats: NatsEndpoint, tail: DataFrameReader, stream: str, start: int, until: int
) -> DataFrame:
    """The tail from `start`, read now and kept; HistoryGap if any of it was purged first
    (the source fails on a start below the stream's first sequence, and a purge that
    lands mid-read shows as a first sequence above `start` afterwards: the first
    sequence only grows)."""
    try:
        live = tail.option("startingOffset", str(start)).option("onAgedOut", "fail").load()
        live = live.localCheckpoint(eager=True)
        error: Exception | None = None
    except Exception as err:
        error = err
    if not until or start < until:
        bounds = _bounds(nats, stream)
        if bounds.aged_out(start):
            raise HistoryGap(stream, start, bounds.first) from error
    if error is not None:
        raise error
    return live


def _bounds(nats: NatsEndpoint, stream: str) -> Bounds:
    from jobs.jetstream_read import stream_bounds

    async def go() -> Bounds:
        nc = await nats.connect(name="history-read")
        try:
            return await stream_bounds(nc, stream)
        finally:
            await nc.close()

    return asyncio.run(go())


def _first_seq(nats: NatsEndpoint, stream: str) -> int:
    """Where a stream with no archived batch yet is read from: its first sequence."""
    return _bounds(nats, stream).earliest


def table_frame(
    events: DataFrame,
    schema: str = "",
    sample: int = SAMPLE_EVENTS,
    notes: list[str] | None = None,
) -> DataFrame:
    """The events as a table: envelope columns, then the JSON fields by `schema` or by a
    schema inferred from up to `sample` of the newest valid events. Inferred fields that
    cannot be columns are left out, each with a line in `notes`."""
    from pyspark.sql import functions as F

    valid = events.where(F.col("valid"))
    parse: str | StructType | None = schema or None
    if parse is None:
        parse, left_out = _infer_schema(valid, sample)
        if notes is not None:
            notes.extend(left_out)
    envelope = [F.col(src).alias(name) for name, src in ENVELOPE.items()]
    if parse is None:  # nothing to infer from: the envelope and the raw JSON text
        return valid.select(*envelope, F.col("data"))
    parsed = valid.select(*envelope, F.from_json("data", parse).alias("_e"))
    fields = [c for c in parsed.select("_e.*").columns if c not in ENVELOPE]
    return parsed.select(*ENVELOPE, *(F.col("_e").getField(c).alias(c) for c in fields))


def _infer_schema(valid: DataFrame, sample: int) -> tuple[StructType | None, list[str]]:
    """The schema Spark infers from the newest events, as a StructType (no DDL text to
    quote: any name at any depth is taken as it is), less what `representable` leaves out."""
    spark = valid.sparkSession
    rows = valid.orderBy(valid.seq.desc()).select("data").limit(sample).collect()
    texts = [r.data for r in rows if r.data]
    if not texts:
        return None, []
    inferred = spark.read.json(spark.sparkContext.parallelize(texts, 1)).schema
    kept, notes = representable(inferred, top=True)
    return (kept if kept.fields else None), notes


def representable(schema: StructType, *, top: bool = False) -> tuple[StructType, list[str]]:
    """`schema` without the fields no query could name apart: empty names, and names that
    differ only in case (Spark resolves names case-insensitively, so each would be an
    ambiguous reference), at every depth; at the top also Spark's `_corrupt_record` and the
    envelope's names. A note per field left out, by its dotted path."""
    from pyspark.sql.types import StructType

    notes: list[str] = []
    kept = _struct(schema, "", top, notes)
    return (kept if isinstance(kept, StructType) else StructType([])), notes


def _struct(dtype: Any, path: str, top: bool, notes: list[str]) -> Any:
    from pyspark.sql.types import ArrayType, MapType, StructField, StructType

    if isinstance(dtype, ArrayType):
        inner = _struct(dtype.elementType, f"{path}[]", False, notes)
        return ArrayType(inner, dtype.containsNull)
    if isinstance(dtype, MapType):
        inner = _struct(dtype.valueType, f"{path}{{}}", False, notes)
        return MapType(dtype.keyType, inner, dtype.valueContainsNull)
    if not isinstance(dtype, StructType):
        return dtype
    folded: dict[str, list[str]] = {}
    for f in dtype.fields:
        folded.setdefault(f.name.lower(), []).append(f.name)
    fields = []
    for f in dtype.fields:
        where = f"{path}.{f.name}" if path else f.name
        if top and f.name == "_corrupt_record":
            continue
        if not f.name:
            notes.append(f"a field with an empty name{' in ' + path if path else ''} is left out")
        elif len(folded[f.name.lower()]) > 1:
            names = " and ".join(f"{path}.{n}" if path else n for n in folded[f.name.lower()])
            note = f"fields {names} differ only in case: left out"
            if note not in notes:
                notes.append(note)
        elif top and f.name in ENVELOPE:
            notes.append(f"field {f.name} is left out: the envelope's column has its name")
        else:
            fields.append(StructField(f.name, _struct(f.dataType, where, False, notes), True))
    return StructType(fields)


def run_sql(
    spark: SparkSession,
    nats: NatsEndpoint,
    sql: str,
    tables: Mapping[str, StreamTable],
    *,
    limit: int = 1_000,
    timeout_s: float = 60.0,
    allowed: Callable[[str], bool] = lambda stream: True,
    pool: str | None = None,
    max_bytes: int = MAX_ANSWER_BYTES,
) -> SqlResult:
    """Check `sql` (SqlRefused), build the tables it names, run it with a row limit and a
    timeout (SqlTimeout) in Spark scheduler pool `pool` (None: the thread's own).
    `allowed(stream)` is the caller's authorisation: a query naming a stream it refuses, or
    naming none while it refuses any, is refused before anything is read."""
    readable = sorted(name for name in tables if allowed(name))
    checked: CheckedQuery = check_select(sql, tables, listed=readable)
    for name in sorted(checked.tables):
        if not allowed(name):
            raise SqlRefused(f"not allowed to read stream {name!r}")
    if not checked.tables and len(readable) < len(tables):
        raise SqlRefused(
            "a query that names no table runs only for a caller allowed on every stream"
        )
    ctx = spark.sparkContext
    if pool is not None:
        ctx.setLocalProperty(POOL_PROPERTY, pool)
    tag = f"tierflow_sql_{uuid.uuid4().hex[:12]}"
    views = {name: f"{tag}_{i}" for i, name in enumerate(sorted(checked.tables))}
    timed_out, finished = threading.Event(), threading.Event()

    def cancel() -> None:
        """Cancel the query's jobs, again and again: a query runs several jobs one after
        another (broadcasts first), and between two of them there is nothing to cancel."""
        timed_out.set()
        for _ in range(CANCEL_TRIES):
            ctx.cancelJobsWithTag(tag)
            if finished.wait(CANCEL_EVERY_S):
                return

    timer = threading.Timer(timeout_s, cancel)
    timer.daemon = True
    notes: list[str] = []
    ctx.addJobTag(tag)  # this thread's jobs, schema sampling included, until removed
    ctx.setInterruptOnCancel(True)
    timer.start()
    try:
        for name, view in views.items():  # temp views of this query only
            spec = tables[name]
            left_out: list[str] = []
            events = stream_events(spark, nats, spec)
            table_frame(events, spec.schema, notes=left_out).createTempView(view)
            notes += [f"{name}: {note}" for note in left_out]
        df = spark.sql(checked.renamed(views))
        rows = df.limit(limit + 1).collect()
    except Exception as err:
        if timed_out.is_set():
            raise SqlTimeout(f"the query ran past its timeout of {timeout_s:g} s") from None
        raise _clear(err, views) from None
    finally:
        finished.set()
        timer.cancel()
        ctx.removeJobTag(tag)
        if pool is not None:
            ctx.setLocalProperty(POOL_PROPERTY, None)  # type: ignore[arg-type]
        for view in views.values():
            spark.catalog.dropTempView(view)
    kept = _within_bytes([tuple(r) for r in rows[:limit]], max_bytes)
    return SqlResult(
        columns=list(df.columns),
        rows=kept,
        truncated=len(rows) > len(kept),
        tables=sorted(checked.tables),
        notes=notes,
    )


def _within_bytes(rows: list[tuple[Any, ...]], max_bytes: int) -> list[tuple[Any, ...]]:
    """The first `rows` whose JSON fits in `max_bytes`; SqlRefused when not even one does."""
    import msgspec

    total = 0
    for i, row in enumerate(rows):
        total += len(msgspec.json.encode([plain(v) for v in row], enc_hook=str)) + 1
        if total > max_bytes:
            if i == 0:
                raise SqlRefused(
                    f"one row of the answer is over {max_bytes} bytes as JSON: select fewer "
                    "or smaller columns"
                )
            return rows[:i]
    return rows


def _clear(err: Exception, views: Mapping[str, str]) -> Exception:
    """Spark's analysis errors (unknown column, type mismatch) as SqlRefused, naming the
    streams rather than this query's views: the user's query is wrong, not the system;
    anything else unchanged."""
    from pyspark.errors import AnalysisException, ParseException

    if not isinstance(err, ParseException | AnalysisException):
        return err
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    for name, view in views.items():
        text = text.replace(view, name)
    return SqlRefused(text[:500])
