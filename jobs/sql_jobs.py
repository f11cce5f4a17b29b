"""Continuous SQL jobs: a user's ``SELECT`` over streams, run as a Spark streaming query.

Each stream the query names is a table of its events (runtime/data/sql_jobs.py says what is
checked and how rows are keyed):

- the envelope ``_seq``, ``_subject``, ``_ts`` (when JetStream stored it) and ``_id`` (the
  event's Nats-Msg-Id), then the JSON fields by the stream's declared schema;
- the stream's ``event_time`` field as a TIMESTAMP (``_ts`` when it names none), with the
  stream's watermark (or the job's) on it;
- when the query keeps state (joins, groups, windows), events at or under the watermark are
  dropped before it, and counted, by the same ``dedupeWithinWatermark`` operator the
  built-in windowed jobs use (jobs/windows.py): the driver's late counter reads it, so a
  late event shows in the job's ``late_events``, never silently gone. It also drops an
  event published twice under one id.

A query Spark cannot run incrementally is refused when the job is planned, by Spark's own
check (`UnsupportedOperationChecker`, the one `start()` runs), with its words and the fix:
the driver plans a job before it wants it, so ``tierflow jobs start`` fails, not the query
later. The output mode is the job's (``update`` by default); a query Spark runs only in
append mode (stream-stream joins, aggregates over them) runs in append mode.
"""

from __future__ import annotations

import datetime as dt
import decimal
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from jobs.event_time import source_events
from jobs.jvm_source import PARSED
from jobs.plans import Plan
from jobs.sql import ENVELOPE
from jobs.topn import BatchRows
from runtime.config import KvTableConfig
from runtime.data.sql_check import SqlRefused
from runtime.data.sql_jobs import SqlJobQuery, check_tables, sql_job_query
from runtime.errors import JobError
from runtime.job_specs import JobSpec, interval

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import StructType

    from runtime.config import StreamConfig

__all__ = ["SqlJobPlan", "explain", "keyed_rows", "plan_sql_job", "sql_streams", "stream_table"]


@dataclass
class SqlJobPlan:
    """A planned sql job: its plan for the sink, the mode Spark runs it in, its checked
    query and the event time and watermark of each stream it reads."""

    plan: Plan
    output_mode: str
    query: SqlJobQuery
    times: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def df(self) -> DataFrame:
        return self.plan.df


def event_fields(df: DataFrame, schema: StructType) -> Column:
    """The events' fields as a struct of `schema`: Spark's `from_json` of `data`, except
    where the JVM source has read them already (`_tf_parsed`: the plain events, into
    columns `_tf_f0`, ...; its FieldParser leaves every other event to `from_json`)."""
    from pyspark.sql import functions as F

    spark_reads = F.from_json("data", schema)
    if PARSED not in df.columns:
        return spark_reads
    read = F.struct(*(F.col(f"_tf_f{i}").alias(f.name) for i, f in enumerate(schema.fields)))
    return F.when(F.col(PARSED), read).otherwise(spark_reads)


def stream_table(
    source: DataFrame, stream: str, cfg: StreamConfig, watermark: str, stateful: bool
) -> tuple[DataFrame, dict[str, str]]:
    """The stream's events as the query's table (see the module doc) and its time: the
    event-time column and the watermark delay ('' when none)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StructType, TimestampType, _parse_datatype_string

    if not cfg.schema:
        raise JobError(
            f"stream {stream!r} needs [streams.{stream}] schema for a sql job (a Spark DDL "
            "such as 'id BIGINT, price DOUBLE')"
        )
    schema = _parse_datatype_string(cfg.schema)
    if not isinstance(schema, StructType):
        raise JobError(f"streams.{stream}.schema: expected fields, got {cfg.schema!r}")
    df = source_events(source)  # the valid events, with every envelope column
    parsed = df.select(
        *(F.col(src).alias(name) for name, src in ENVELOPE.items()),
        event_fields(df, schema).alias("_e"),
    )
    columns = [F.col(name) for name in ENVELOPE]
    time_col = "_ts"
    for f in schema.fields:
        value = F.col("_e").getField(f.name)
        if f.name == cfg.event_time:
            time_col = f.name
            if not isinstance(f.dataType, TimestampType):
                value = _as_timestamp(value, cfg.event_time_format)
        columns.append(value.alias(f.name))
    if cfg.event_time and time_col != cfg.event_time:
        raise JobError(
            f"streams.{stream}.event_time: {cfg.event_time!r} is not a field of its schema"
        )
    table = parsed.select(*columns)
    if not table.isStreaming:  # a table: the latest event per key as of each micro-batch
        if cfg.compact is None:
            raise JobError(
                f"stream {stream!r} is read as a table, the latest event per key: give it "
                f"[streams.{stream}.compact] key"
            )
        from pyspark.sql.window import Window

        newest = Window.partitionBy("_subject").orderBy(F.col("_seq").desc())
        table = (
            table.withColumn("_tf_rank", F.row_number().over(newest))
            .where(F.col("_tf_rank") == 1)
            .drop("_tf_rank")
        )
        return table, {"event_time": time_col, "watermark": "", "table": "latest per key"}
    delay = watermark or cfg.watermark
    if delay:
        table = table.withWatermark(time_col, interval(delay))
        if stateful:
            # a source without ids or sequences (files) dedups nothing: each row its own id
            ident = F.coalesce(
                F.col("_id"),
                F.concat(F.lit("seq:"), F.col("_seq").cast("string")),
                F.expr("uuid()"),
            )
            table = (
                table.withColumn("_tf_id", ident)
                .dropDuplicatesWithinWatermark(["_tf_id"])
                .drop("_tf_id")
            )
    return table, {"event_time": time_col, "watermark": interval(delay) if delay else ""}


def kv_table(source: DataFrame, name: str, cfg: KvTableConfig) -> tuple[DataFrame, dict[str, str]]:
    """A KV bucket read whole (`jobs.running.read_kv`) as the query's table `name`: the
    latest value of every key, with ``key`` (its `prefix` cut off), the value's fields by
    `cfg.schema`, ``_seq`` and ``_ts``. A key whose latest entry is a delete or a purge
    (an empty value, so not JSON) is not in it, nor is one whose latest value is malformed:
    an older value must not come back in its place."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StructType, _parse_datatype_string
    from pyspark.sql.window import Window

    schema = _parse_datatype_string(cfg.schema)
    if not isinstance(schema, StructType):
        raise JobError(f"tables.{name}.schema: expected fields, got {cfg.schema!r}")
    clash = {"key", "_seq", "_ts"} & {f.name for f in schema.fields}
    if clash:
        raise JobError(f"tables.{name}.schema: {sorted(clash)} name the table's own columns")
    head = len(f"$KV.{cfg.bucket}.") + (len(cfg.prefix) + 1 if cfg.prefix else 0)
    newest = Window.partitionBy("subject").orderBy(F.col("seq").desc())
    latest = (
        source.withColumn("_tf_rank", F.row_number().over(newest))
        .where((F.col("_tf_rank") == 1) & F.col("valid"))
        .select(
            F.expr(f"substring(subject, {head + 1})").alias("key"),
            F.col("seq").alias("_seq"),
            F.col("ts").alias("_ts"),
            F.from_json("data", schema).alias("_v"),
        )
    )
    fields = [F.col("_v").getField(f.name).alias(f.name) for f in schema.fields]
    table = latest.select("key", *fields, "_seq", "_ts")
    return table, {"event_time": "", "watermark": "", "table": f"KV bucket {cfg.bucket}"}


def _as_timestamp(value: Any, form: str) -> Any:
    from pyspark.sql import functions as F

    if form == "iso":
        return F.to_timestamp(value)
    if form == "epoch_s":
        return F.timestamp_millis((value.cast("double") * 1000).cast("long"))
    return F.timestamp_millis(value.cast("double").cast("long"))


def kv_names(streams: Mapping[str, Any]) -> set[str]:
    """The names in a sql catalog (`Config.sql_tables`) that are KV tables."""
    return {name for name, cfg in streams.items() if isinstance(cfg, KvTableConfig)}


def _checked(spec: JobSpec, streams: Mapping[str, StreamConfig | KvTableConfig]) -> SqlJobQuery:
    """The job's query and tables checked over `streams` (JobError says why not)."""
    try:
        query = sql_job_query(spec.sql, streams)
        check_tables(spec, query, kv_names(streams))
    except SqlRefused as err:
        raise JobError(f"job {spec.name!r}: {err}") from None
    return query


def sql_streams(spec: JobSpec, streams: Mapping[str, StreamConfig | KvTableConfig]) -> list[str]:
    """The streams and KV tables a sql job reads (JobError when its query is refused)."""
    return _checked(spec, streams).streams


def plan_sql_job(
    spark: SparkSession,
    spec: JobSpec,
    streams: Mapping[str, StreamConfig | KvTableConfig],
    sources: Mapping[str, DataFrame],
) -> SqlJobPlan:
    """The job's query over `sources` (a streaming DataFrame per stream it names, e.g.
    jobs/running.py `read_stream`), checked, in the output mode Spark runs it in; JobError
    says why a query cannot run, and how to change it."""
    query = _checked(spec, streams)
    views: dict[str, str] = {}
    times: dict[str, dict[str, str]] = {}
    tag = hashlib.sha1(spec.name.encode()).hexdigest()[:12]
    kv = kv_names(streams)
    for i, stream in enumerate(query.streams):
        cfg = streams[stream]
        if isinstance(cfg, KvTableConfig):
            table, times[stream] = kv_table(sources[stream], stream, cfg)
        else:
            table, times[stream] = stream_table(
                sources[stream], stream, cfg, spec.watermark, query.stateful
            )
        views[stream] = f"tf_sqljob_{tag}_{i}"
        table.createOrReplaceTempView(views[stream])
    try:
        df = spark.sql(query.checked.renamed(views))
    except Exception as err:
        raise JobError(f"job {spec.name!r}: {_spark_words(err, views)}") from None
    mode = _incremental_mode(spec, df, views)
    streaming = {s: v for s, v in views.items() if s not in spec.tables and s not in kv}
    order = _source_order(df, streaming)
    plan = Plan(df, mode, batches=lambda _c: keyed_rows(query, df.columns), streams=order)
    return SqlJobPlan(plan, mode, query, times)


def _source_order(df: DataFrame, views: Mapping[str, str]) -> tuple[str, ...]:
    """The streams in the order Spark lists the query's sources (and their offsets): the
    order their views first appear in the analyzed plan, which Spark walks the same way."""
    text = logical_plan(df)
    found = {stream: text.find(view) for stream, view in views.items()}
    return tuple(sorted((s for s in found if found[s] >= 0), key=found.__getitem__))


def _incremental_mode(spec: JobSpec, df: DataFrame, views: Mapping[str, str]) -> str:
    """The output mode Spark runs `df` in: the job's, or append for a query Spark runs only
    in append mode; JobError with Spark's reason and the fix when none."""
    wanted = spec.output_mode
    tries = [wanted, "append"] if wanted == "update" else [wanted]
    reasons: list[str] = []
    for mode in tries:
        reason = _unsupported(df, mode)
        if not reason:
            return mode
        reasons.append(f"in {mode} mode: {_spark_words(reason, views)}")
    fixes = " ".join(dict.fromkeys(_fix(r) for r in reasons))
    raise JobError(
        f"job {spec.name!r}: Spark cannot run this query incrementally "
        f"({'; '.join(reasons)}). {fixes}"
    )


def _unsupported(df: DataFrame, mode: str) -> str:
    """Spark's reason `df` cannot run as a streaming query in `mode` ('' when it can)."""
    jvm = df.sparkSession._jvm
    assert jvm is not None
    output = getattr(jvm.org.apache.spark.sql.streaming.OutputMode, mode.capitalize())()
    checker = jvm.org.apache.spark.sql.catalyst.analysis.UnsupportedOperationChecker
    try:
        checker.checkForStreaming(df._jdf.queryExecution().analyzed(), output)
    except Exception as err:
        return _java_message(err)
    return ""


_FIXES = (
    (
        "without watermark",
        "Declare the stream's event time and watermark ([streams.X] event_time and watermark, "
        "or the job's watermark) and group by window(...) or session_window(...) of it.",
    ),
    (
        "outer join",
        "An outer join between streams needs a watermark on both and a time bound in its "
        "condition (b.t BETWEEN a.t AND a.t + INTERVAL 10 SECONDS).",
    ),
    (
        "Sorting is not supported",
        "A stream has no end to sort: ORDER BY only over an aggregation in complete mode "
        "(output_mode=complete), or rank when reading the results.",
    ),
    (
        "Limits are not supported",
        "A stream has no end to limit: drop LIMIT, or keep the top rows when reading.",
    ),
    (
        "Non-time-based windows",
        "OVER (...) windows do not run over a stream: group by window(...) instead.",
    ),
    (
        "Multiple streaming aggregations",
        "Aggregate once per query, or over windows in append mode.",
    ),
    (
        "distinct aggregations",
        "Use approx_count_distinct(...), which runs incrementally.",
    ),
)


def _fix(reason: str) -> str:
    low = reason.lower()
    for words, fix in _FIXES:
        if words.lower() in low:
            return fix
    return "Rewrite the query with operators Spark streams (docs/sql-jobs.md lists them)."


def _java_message(err: Exception) -> str:
    text = str(err)
    m = re.search(r"(?:AnalysisException|SparkException)\]?:?\s*(.*)", text, re.DOTALL)
    return (m.group(1) if m else text).strip()


def _spark_words(err: Exception | str, views: Mapping[str, str]) -> str:
    """Spark's message, first lines only, with the query's own table names for the views."""
    text = str(err).strip()
    for stream, view in views.items():
        text = text.replace(f"`{view}`", stream).replace(view, stream)
    lines = [ln for ln in text.splitlines() if ln.strip()][:3]
    out = " ".join(ln.strip() for ln in lines)
    return out[:600]


# ---- result rows ------------------------------------------------------------------------


def keyed_rows(query: SqlJobQuery, columns: list[str]) -> BatchRows:
    """A batch's rows as result rows, each with its ``key`` (runtime/data/sql_jobs.py): a
    pure function of the batch's id and rows, so a replayed batch gives the same keys, and
    equal rows of two batches (two equal bids) keep a key each."""
    key_names = [columns[i] for i in query.key_positions]

    def shape(rows: list[dict[str, Any]], batch_id: int) -> list[dict[str, Any]]:
        out = []
        seen: dict[str, int] = {}
        for row in rows:
            cells = {k: cell(v) for k, v in row.items()}
            if query.has_key:
                cells["key"] = _key_part(cells["key"]) if cells["key"] is not None else ""
            elif key_names:
                cells["key"] = "|".join(_key_part(cells[n]) for n in key_names)
            else:
                digest = hashlib.sha1(msgspec.json.encode(cells, order="sorted")).hexdigest()
                n = seen[digest] = seen.get(digest, -1) + 1
                cells["key"] = f"{batch_id}-{digest[:20]}-{n}"
            out.append(cells)
        return out

    return shape


def _key_part(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, dict) and "start" in value:  # a window: by its start
        return str(value["start"])
    if isinstance(value, dict | list):
        return msgspec.json.encode(value, order="sorted").decode()
    return str(value)


def cell(value: Any) -> Any:
    """A value as JSON takes it. Spark hands timestamps over as naive local datetimes:
    they are shown in UTC with a Z."""
    if isinstance(value, dt.datetime):
        aware = value if value.tzinfo else value.astimezone()
        text = aware.astimezone(dt.UTC).isoformat(timespec="milliseconds")
        return text.replace("+00:00", "Z").replace(".000Z", "Z")
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, dict):
        return {k: cell(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [cell(v) for v in value]
    return value


# ---- explain ----------------------------------------------------------------------------


def logical_plan(df: DataFrame) -> str:
    """Spark's analyzed plan of a query not started (a streaming plan has no physical plan
    before `start()`)."""
    return str(df._jdf.queryExecution().analyzed().treeString())


def explain(plan: SqlJobPlan, running: Any = None) -> dict[str, Any]:
    """What `tierflow jobs explain` shows of a sql job: its query as run, the output mode,
    where its key comes from, each stream's event time and watermark, the plan (the running
    query's physical plan, else the analyzed one), and, while it runs, each stateful
    operator's state (its last batch's drops by the watermark too) and the current
    watermark. The late events since the driver started are its late counter's."""
    q = plan.query
    columns = plan.df.columns
    out: dict[str, Any] = {
        "sql": q.checked.sql,
        "output_mode": plan.output_mode,
        "key": "key column"
        if q.has_key
        else ("|".join(columns[i] for i in q.key_positions) or "the row's digest"),
        "streams": plan.times,
        "columns": columns,
    }
    progress = running.lastProgress if running is not None else None
    if running is not None:
        out["plan"] = str(running._jsq.explainInternal(False))
    else:
        out["plan"] = logical_plan(plan.df)
    if progress:
        out["watermark"] = (progress.get("eventTime") or {}).get("watermark")
        out["state"] = [
            {
                "operator": op["operatorName"],
                "rows": op["numRowsTotal"],
                "bytes": op["memoryUsedBytes"],
                "dropped_by_watermark": op.get("numRowsDroppedByWatermark", 0),
            }
            for op in progress.get("stateOperators", [])
        ]
    return out
