"""Running a job: its streaming query from the jetstream source to the result sink.

`start_job` turns a `JobSpec` into a Spark streaming query reading the ``jetstream`` source
(jobs/jetstream.py) and writing through `ResultSink` (jobs/sink.py): results on
``results.<job name>`` with ids ``<job>:<batchId>:<key>`` and the latest value per key in KV
under ``<job>.<key>`` (docs/contracts.md). `start_deadletters` is a query per stream that
sends its malformed events to ``deadletter.<stream>``, for a user's own Spark code (the
driver finds them without Spark: jobs/deadletter_scan.py). The query's checkpoint lives at
``<checkpoint root>/<name>``, so a restart resumes where the last committed batch ended.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.batch_view import BatchView, checkpoint_dir
from jobs.plans import Plan, build_plan
from jobs.sink import BatchReport, DeadLetterBatch, ResultSink, check_fence
from jobs.spark_session import POOL_PROPERTY, query_pool
from jobs.topn import BatchRows
from runtime.config import KvTableConfig
from runtime.job_specs import JobSpec, check_spec, deadletter_query_name
from runtime.nats.server import NatsEndpoint

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming import StreamingQuery

    from runtime.config import StreamConfig

    Catalog = Mapping[str, StreamConfig | KvTableConfig]


DEADLETTER_TRIGGER_S = 5.0
STAGGER_SPREAD = 0.25  # `staggered`: queries sharing an interval run up to 25% less often


def checkpoint_run_id(checkpoint: str | Path) -> str:
    """The id Spark gave the query when its checkpoint was made (``<checkpoint>/metadata``):
    the same across restarts, new after a reset. The sink guards KV with it."""
    try:
        text = (Path(checkpoint) / "metadata").read_text(encoding="utf-8")
        return str(json.loads(text.splitlines()[0])["id"])
    except (OSError, ValueError, KeyError, IndexError):
        return ""


@dataclass
class JobWriter:
    """``foreachBatch``: the batch's result rows shaped by the plan, published idempotently.

    `shape` is the plan's `Plan.batch_rows`: a pure function of (its saved state, the
    batch's rows, batch id), so a replayed batch publishes the same rows under the same ids.
    """

    sink: ResultSink
    shape: BatchRows
    on_batch: Callable[[int, BatchReport], None] | None = None
    checkpoint: str | Path | None = None

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        if self.checkpoint is not None and not self.sink.run_id:
            # Spark has written the checkpoint's metadata by the first batch
            self.sink.run_id = checkpoint_run_id(self.checkpoint)
        check_fence(f"batch {batch_id}")  # a fenced driver runs not even the batch's job
        began = time.perf_counter()
        collected = df.collect()  # the batch's Spark job
        rows_at = time.perf_counter()
        rows = self.shape([r.asDict(recursive=True) for r in collected], batch_id)
        shaped = time.perf_counter()
        report = self.sink.publish_results(rows, batch_id)
        report.parts_ms = {
            "fb_collect": round((rows_at - began) * 1000, 1),
            "fb_shape": round((shaped - rows_at) * 1000, 1),
            "fb_publish": round((time.perf_counter() - shaped) * 1000, 1),
        }
        if self.on_batch is not None:
            self.on_batch(batch_id, report)


def read_stream(
    spark: SparkSession,
    nats: NatsEndpoint,
    stream: str,
    subject: str = "",
    max_events: int = 0,
    start_seq: int = 0,
    invalid_only: bool = False,
    fields: str = "",
) -> DataFrame:
    """The jetstream source over `stream` (the JVM one where it can, jobs/jvm_source.py; the
    Python one must be registered), from the
    beginning or, on a fresh checkpoint, from `start_seq`; with `invalid_only`, its
    malformed events alone (the source's ``invalidOnly``). `fields` (the stream's schema):
    the JVM source reads them into columns of their own where it can (`_tf_parsed`,
    jobs/sql_jobs.py takes them)."""
    from jobs.jvm_source import JVM_FORMAT, stream_format

    fmt = stream_format(spark, nats)
    reader = spark.readStream.format(fmt).options(**nats.to_options())
    reader = reader.option("stream", stream)
    if fields and fmt == JVM_FORMAT:
        reader = reader.option("fields", fields)
    if start_seq:
        reader = reader.option("startingOffset", str(start_seq))
    if subject:
        reader = reader.option("subject", subject)
    if max_events:
        reader = reader.option("maxEventsPerTrigger", str(max_events))
    if invalid_only:
        reader = reader.option("invalidOnly", "true")
    return reader.load()


def read_table(
    spark: SparkSession, nats: NatsEndpoint, stream: str, subject: str = ""
) -> DataFrame:
    """The jetstream source over `stream` in batch: what it retains, read again whenever a
    plan that holds it runs (a stream-static join's every micro-batch)."""
    reader = spark.read.format("jetstream").options(**nats.to_options())
    if subject:
        reader = reader.option("subject", subject)
    return reader.option("stream", stream).option("onAgedOut", "skip").load()


def read_kv(spark: SparkSession, nats: NatsEndpoint, table: KvTableConfig) -> DataFrame:
    """A KV bucket's stream in batch, its keys under the table's prefix alone."""
    under = f"{table.prefix}.>" if table.prefix else ">"
    return read_table(spark, nats, f"KV_{table.bucket}", f"$KV.{table.bucket}.{under}")


@contextlib.contextmanager
def in_pool(spark: SparkSession, name: str) -> Iterator[None]:
    """Queries started inside run their jobs in query `name`'s scheduler pool (a Spark
    thread-local property the query's thread inherits from the starting thread)."""
    sc = spark.sparkContext
    before = sc.getLocalProperty(POOL_PROPERTY)
    sc.setLocalProperty(POOL_PROPERTY, query_pool(name))
    try:
        yield
    finally:
        sc.setLocalProperty(POOL_PROPERTY, before)  # type: ignore[arg-type]  # None unsets


SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"


@contextlib.contextmanager
def state_partitions(spark: SparkSession, n: int) -> Iterator[None]:
    """Queries started inside keep their state (and shuffle their rows) in `n` partitions;
    `n` <= 0 leaves the session's. Spark copies the session's settings when a query starts
    and records the count in a new checkpoint, from which a restart takes it again, so an
    existing checkpoint resumes with the count it was made with. A small aggregation
    needs no more: every partition costs each stateful stage a task and a state store
    commit a batch, empty ones too (a one-key sum in two partitions has one always empty)."""
    if n <= 0:
        yield
        return
    before = spark.conf.get(SHUFFLE_PARTITIONS)
    spark.conf.set(SHUFFLE_PARTITIONS, str(n))
    try:
        yield
    finally:
        spark.conf.set(SHUFFLE_PARTITIONS, before)


def processing_time(trigger_s: float) -> dict[str, Any]:
    """The ``trigger`` arguments of a micro-batch every `trigger_s` (<= 0: back to back)."""
    if trigger_s <= 0:
        return {}
    return {"processingTime": f"{max(1, round(trigger_s * 1000))} milliseconds"}


def staggered(triggers: Mapping[str, float], spread: float = STAGGER_SPREAD) -> dict[str, float]:
    """Each query's trigger interval (s), spread apart where several queries share one.

    Spark starts a processing-time micro-batch at the multiples of its interval since the
    epoch, so queries with one interval always start together: in the demo the four
    panels (every 5 s then) and the dead-letter query ran five batches at once on two
    cores every 5 s, and the top-N's slowest batches were the ones in those bursts. Here
    the k-th of n queries (by name) sharing an interval t runs every
    t * (1 + spread * k / n), never more often than asked and at most `spread` less often:
    their starts drift apart and meet only at the common multiples of their intervals. An
    interval <= 0 (back to back) stays.
    """
    groups: dict[int, list[str]] = {}
    for name, t in triggers.items():
        if t > 0:
            groups.setdefault(round(t * 1000), []).append(name)
    out = dict(triggers)
    for ms, names in groups.items():
        for k, name in enumerate(sorted(names)):
            out[name] = round(ms * (1 + spread * k / len(names))) / 1000
    return out


def start_job(
    spark: SparkSession,
    spec: JobSpec,
    nats: NatsEndpoint,
    checkpoint_root: str | Path,
    *,
    trigger: Mapping[str, Any] | None = None,
    source: DataFrame | Mapping[str, DataFrame] | None = None,
    on_batch: Callable[[int, BatchReport], None] | None = None,
    view: BatchView | None = None,
    trigger_s: float | None = None,
    streams: Catalog | None = None,
    plan: Plan | None = None,
) -> StreamingQuery:
    """Start the job's query (named after the job) with its checkpoint at root/<name>.

    A restart with the same checkpoint resumes exactly where the last committed batch
    ended. `trigger` overrides the spec's (e.g. ``{"availableNow": True}`` in tests), and so
    does `trigger_s` (the driver's `staggered` interval);
    `source` replaces the jetstream source (any streaming DataFrame with ``data``; a sql
    job's, a mapping of them by stream); `streams` are the configured streams a sql job
    reads (their schemas and event times); `plan` a plan `job_plan` made already. With a
    batch `view`, the query is the view's generation (jobs/batch_view.py): its checkpoint
    at root/<name>@<generation>, reading from the view's high-water sequence + 1, its
    results merged with the view's.
    """
    spec = check_spec(spec)
    start = view.high_water + 1 if view is not None else 0
    if plan is None:
        plan = job_plan(spark, spec, nats, streams, start, source, view)
    checkpoint = checkpoint_dir(checkpoint_root, spec.name, view)
    sink = ResultSink.for_query(nats, spec.name, generation=view.generation if view else 0)
    if trigger is None:
        trigger = processing_time(spec.trigger_s if trigger_s is None else trigger_s)
    return start_plan(spark, spec, plan, sink, checkpoint, on_batch, trigger)


def job_plan(
    spark: SparkSession,
    spec: JobSpec,
    nats: NatsEndpoint,
    streams: Catalog | None = None,
    start: int = 0,
    source: DataFrame | Mapping[str, DataFrame] | None = None,
    view: BatchView | None = None,
) -> Plan:
    """The job's plan over its source(s): the jetstream source of each stream it reads from
    sequence `start` on, unless `source` gives them."""
    if spec.kind == "sql":
        from jobs.sql_jobs import plan_sql_job

        given = dict(source) if isinstance(source, Mapping) else {}
        sources = sql_sources(spark, nats, spec, streams or {}, start, given)
        return plan_sql_job(spark, spec, streams or {}, sources).plan
    if source is None:
        source = read_stream(
            spark, nats, spec.stream, spec.subject, spec.max_events_per_trigger, start
        )
    assert not isinstance(source, Mapping)
    return build_plan(spec, source, view)


def sql_sources(
    spark: SparkSession,
    nats: NatsEndpoint,
    spec: JobSpec,
    streams: Catalog,
    start: int = 0,
    given: Mapping[str, DataFrame] | None = None,
) -> dict[str, DataFrame]:
    """A sql job's source per stream its query reads (those `given` as they are): the
    jetstream source from `start`, or for its `tables` the stream read whole in batch."""
    from jobs.sql_jobs import sql_streams

    sources = dict(given or {})
    for stream in sql_streams(spec, streams):
        cfg = streams[stream]
        if stream in sources:
            continue
        if isinstance(cfg, KvTableConfig):
            sources[stream] = read_kv(spark, nats, cfg)
        elif stream in spec.tables:  # read whole at every micro-batch (jobs/sql_jobs.py)
            sources[stream] = read_table(spark, nats, stream)
        else:
            sources[stream] = read_stream(
                spark,
                nats,
                stream,
                max_events=spec.max_events_per_trigger,
                start_seq=start,
                fields=cfg.schema,
            )
    return sources


def start_plan(
    spark: SparkSession,
    spec: JobSpec,
    plan: Plan,
    sink: ResultSink,
    checkpoint: Path,
    on_batch: Callable[[int, BatchReport], None] | None,
    trigger: dict[str, Any],
) -> StreamingQuery:
    """Start `plan`'s query into `sink` under `checkpoint`: in the job's scheduler pool and
    with its state partitions (both taken when the query starts). One place for
    `start_job` and the driver's fresh generations."""
    writer = JobWriter(sink, plan.batch_rows(checkpoint), on_batch, checkpoint)
    with in_pool(spark, spec.name), state_partitions(spark, spec.state_partitions):
        return (
            plan.df.writeStream.queryName(spec.name)
            .outputMode(plan.output_mode)
            .foreachBatch(writer)
            .option("checkpointLocation", str(checkpoint))
            .trigger(**trigger)
            .start()
        )


def start_deadletters(
    spark: SparkSession,
    stream: str,
    nats: NatsEndpoint,
    checkpoint_root: str | Path,
    *,
    on_batch: Callable[[int, BatchReport], None] | None = None,
    trigger: Mapping[str, Any] | None = None,
    trigger_s: float = 1.0,
) -> StreamingQuery:
    """The stream's malformed events to ``deadletter.<stream>`` (ids ``dl:<stream>:<seq>``).

    This query reads every event of the stream a second time, so it runs at most every
    `DEADLETTER_TRIGGER_S` (fewer, bigger batches: each batch's fixed cost would otherwise
    compete for the cores with the jobs' own); dead letters are not a live result. Its
    source keeps only the malformed events (``invalidOnly``): the workers validate every
    event anyway and drop the valid ones before Arrow, so Spark receives, converts and
    filters only the few it publishes (its progress' input rows count those).
    """
    name = deadletter_query_name(stream)
    if trigger is None:
        trigger = processing_time(max(trigger_s, DEADLETTER_TRIGGER_S))
    writer = DeadLetterBatch(ResultSink.for_query(nats, name), stream, on_batch)
    with in_pool(spark, name):
        return (
            read_stream(spark, nats, stream, invalid_only=True)
            .writeStream.queryName(name)
            .foreachBatch(writer)
            .option("checkpointLocation", str(Path(checkpoint_root) / name))
            .trigger(**trigger)
            .start()
        )
