"""`tierflow jobs recompute NAME`: a job's spec run as a batch job, its view served.

`recompute` reads the stream's whole history, archive plus live tail (jobs/sql.py
`stream_events`, every event once) up to a high-water sequence, and runs the job's own plan
over it as a static DataFrame: the same code as the streaming job (jobs/plans.py), fed the
history as one batch, so both count the same way. `serve_view` then puts the view's rows in
KV and on the results stream as the new generation (jobs/batch_view.py) and deletes the keys
an older generation left that the view no longer has.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

from jobs.batch_view import BatchView, check_mergeable
from jobs.copies import CopyId
from jobs.event_time import iso_ms
from jobs.plans import ALL, build_plan
from jobs.sink import BatchReport, ResultSink
from jobs.sql import StreamTable, stream_events
from jobs.topn import TopBase
from runtime.clock import now_ms
from runtime.job_specs import JobSpec, check_spec
from runtime.nats.server import NatsEndpoint

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

VIEW_BATCH = -1  # the batch id of a view's rows: before the speed layer's batch 0


def subject_regex(patterns: str) -> str:
    """A regex matching the subjects any of the comma-separated NATS `patterns` match
    (``*`` one token, ``>`` one or more at the end): the jetstream source's ``subject``
    option applied to a table that is already read."""
    alternatives = []
    for pattern in (p.strip() for p in patterns.split(",")):
        if not pattern:
            continue
        tokens = []
        for token in pattern.split("."):
            if token == "*":
                tokens.append(r"[^.]+")
            elif token == ">":
                tokens.append(r".+")
            else:
                tokens.append(re.escape(token))
        alternatives.append(r"\.".join(tokens))
    return "^(?:" + "|".join(alternatives) + ")$"


def _subject_filter(patterns: str) -> Column:
    from pyspark.sql import functions as F

    return F.col("subject").rlike(subject_regex(patterns))


def history(
    spark: SparkSession, nats: NatsEndpoint, spec: JobSpec, table: StreamTable, high_water: int
) -> DataFrame:
    """The job's input: every event of its stream (and subjects) up to `high_water`."""
    events = stream_events(spark, nats, table, until=high_water + 1)
    events = events.where(events.seq <= high_water)
    if spec.subject:
        events = events.where(_subject_filter(spec.subject))
    return events


def recompute(
    spark: SparkSession,
    nats: NatsEndpoint,
    spec: JobSpec,
    table: StreamTable,
    *,
    high_water: int,
    generation: int = 0,
    copy: CopyId | None = None,
) -> BatchView:
    """The job's batch view over its stream up to `high_water` (inclusive), as generation
    `generation` (default: now, in epoch ms); `copy` is the copy of the stream `nats` reads
    (recorded in the view: its `high_water` is a sequence of that copy)."""
    spec = check_spec(spec)
    check_mergeable(spec)
    started = time.monotonic()
    generation = generation or now_ms()
    plan = build_plan(spec, history(spark, nats, spec, table, high_water))
    counted = [r.asDict(recursive=True) for r in plan.df.collect()]
    rows = plan.batch_rows(None)(counted, 0)
    view = BatchView(
        spec=spec,
        generation=generation,
        high_water=high_water,
        computed_at_ms=now_ms(),
        rows=rows,
        copy=copy,
    )
    windowed = spec.window is not None
    if spec.kind == "topn":
        view.top = TopBase.from_rows(counted, windowed)
        view.events = view.top.events
    elif spec.kind == "count":
        view.counts = {str(r["key"]): int(r[spec.count_as]) for r in rows}
    elif spec.kind == "distinct":
        view.sketches = {_sketch_key(r, windowed): bytes(r["sketch"]) for r in counted}
    view.seconds = time.monotonic() - started
    return view


def _sketch_key(row: dict[str, Any], windowed: bool) -> str:
    """The result key of a distinct job's sketch row (as jobs/plans.py names it)."""
    return str(iso_ms(int(row["start"]))) if windowed else ALL


def serve_view(nats: NatsEndpoint, view: BatchView) -> BatchReport:
    """Make the view what the serving layer shows: its rows on ``results.<job>`` and in KV
    as its generation, and the older generations' other keys deleted. Idempotent (same ids,
    conditional puts), so a crash in the middle is repaired by serving again."""
    sink = ResultSink.for_query(nats, view.name, generation=view.generation)
    report = sink.publish_results(view.rows, VIEW_BATCH)
    sink.retire_keys(r["key"] for r in view.rows)
    return report
