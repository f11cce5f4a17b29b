"""The events a job reads: the source's valid rows, their event time, and time windows.

Windows use event time (``time_field``, default the time JetStream stored the event) with a
watermark: an event older than the watermark is late, dropped and counted (the
``dedupeWithinWatermark`` operator of `jobs.windows`, which also drops redelivered ids).
Malformed events (the source's ``valid`` false) never reach a job: jobs/running.py sends
them to dead letter with a query of their own.
"""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

from jobs.paths import extract
from runtime.job_specs import interval

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

    from runtime.job_specs import JobSpec


def source_events(source: DataFrame) -> DataFrame:
    """The valid events of a source, with the columns jobs rely on (missing ones as null).

    Works for the jetstream source and for any DataFrame with a JSON ``data`` column (a file
    source in a benchmark).
    """
    from pyspark.sql import functions as F

    df = source.where(F.col("valid")) if "valid" in source.columns else source
    defaults = {"seq": "bigint", "subject": "string", "ts": "timestamp", "msg_id": "string"}
    for name, kind in defaults.items():
        if name not in df.columns:
            df = df.withColumn(name, F.lit(None).cast(kind))
    return df


def event_time(df: DataFrame, spec: JobSpec) -> DataFrame:
    """`df` with ``_tf_time`` (timestamp): the spec's time field, or the stream's own time."""
    from pyspark.sql import functions as F

    if not spec.time_field:
        return df.withColumn("_tf_time", F.col("ts"))
    df = extract(df, {"_tf_time_raw": spec.time_field})
    raw = F.col("_tf_time_raw")
    if spec.time_format == "iso":
        t = F.to_timestamp(raw)
    elif spec.time_format == "epoch_s":
        t = F.timestamp_millis((raw.cast("double") * 1000).cast("long"))
    else:
        t = F.timestamp_millis(raw.cast("double").cast("long"))
    return df.withColumn("_tf_time", t).drop("_tf_time_raw")


def windowed_events(df: DataFrame, spec: JobSpec) -> DataFrame:
    """Events with event time, watermark, and late events (and repeated ids) dropped.

    The drop is at event level, before any explode, so `jobs.windows.late_count` counts
    late *events*. Ids are the event's Nats-Msg-Id, else its stream sequence.
    """
    from pyspark.sql import functions as F

    assert spec.window is not None
    df = event_time(df, spec)
    ident = F.coalesce(F.col("msg_id"), F.concat(F.lit("seq:"), F.col("seq").cast("string")))
    df = df.withColumn("_tf_id", F.coalesce(ident, F.expr("uuid()")))
    if not df.isStreaming:  # a recompute (jobs/recompute.py): the whole history at once
        return df.dropDuplicates(["_tf_id"])
    df = df.withWatermark("_tf_time", interval(spec.window.watermark))
    return df.dropDuplicatesWithinWatermark(["_tf_id"])


def window_column(spec: JobSpec) -> Column:
    from pyspark.sql import functions as F

    assert spec.window is not None
    length = interval(spec.window.length)
    if spec.window.slide:
        return F.window("_tf_time", length, interval(spec.window.slide))
    return F.window("_tf_time", length)


def iso_ms(ms: int | None) -> str | None:
    """Epoch ms as ``2016-09-06T10:52:00Z`` (milliseconds shown only when not zero)."""
    if ms is None:
        return None
    t = dt.datetime.fromtimestamp(ms / 1000, dt.UTC)
    text = t.strftime("%Y-%m-%dT%H:%M:%S")
    if ms % 1000:
        text += f".{ms % 1000:03d}"
    return text + "Z"
