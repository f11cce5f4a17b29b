"""What each kind of job computes: a `Plan` (result DataFrame, output mode, row shaping).

=========  ================================================================================
kind       result rows (``key`` always; ``window_start``/``window_end`` ISO when windowed)
=========  ================================================================================
topn       ``{"key","top":[{"item","count","error"}...n],"events"}``: exact counts per
           item (per window; per pane of sliding windows, summed into windows on the
           driver) in Spark's own state, the top n merged on the driver (jobs/topn.py);
           key ``"all"`` or the window start (windowed rows have no ``events``). Error is
           0; ties rank by item. ``capacity`` no longer bounds anything: state holds one
           count per distinct item (per open window or pane).
distinct   ``{"key","distinct","lower","upper"}``: HyperLogLog by Spark's own
           ``hll_sketch_agg`` (JVM), bounds at 2 standard deviations.
count      ``{"key", <by names>..., "count"}`` per key (and window): exact. The key joins the
           by-values and the window start with ``|``.
sample     ``{"key","sample":[...n],"seen"}``: a uniform reservoir (`Reservoir`, seeded, so a
           replayed batch draws the same sample) of a field, or of whole events.
custom     a user's function ``DataFrame -> DataFrame`` (``function = "package.module:fn"``,
           runtime/hooks.py): it gets the valid events (``seq``,
           ``subject``, ``ts``, ``msg_id``, ``data``) and returns rows with a ``key`` column.
=========  ================================================================================

The queries run in update mode, so KV always holds each key's current value. Every
micro-batch is a pure function of (state, the batch's sequence range): a batch Spark replays
after a crash publishes the same result ids with the same values, and the results stream's
dedup drops them. pyspark is imported where a plan is built (the engine runs in the analysis
driver; the CLI imports the specs without it).

With a batch view (jobs/batch_view.py), the plan is the speed layer of a recomputed job: it
reads only the events after the view's high-water sequence, and its rows are merged with the
view's before they are published (counts add, top-N counts add per item, sketches union).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.batch_view import BatchView, check_mergeable, merged_count, merged_sketch
from jobs.event_time import iso_ms, source_events, window_column, windowed_events
from jobs.paths import extract
from jobs.sketch_state import sketch_state, window_sketch_state
from jobs.sketches import Reservoir
from jobs.topn import BatchRows, as_top, pane_ms, topn_batches, topn_counts
from runtime.errors import JobError
from runtime.hooks import load_hook
from runtime.job_specs import JobSpec, check_spec, duration_ms, output_names

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

ALL = "all"

Finalize = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass
class Plan:
    """What a job computes: the result DataFrame, its output mode, and the row shaping done
    on the driver before the rows are published (sketch bytes -> the query's answer; for
    top-N, the updated counts -> the top lists)."""

    df: DataFrame
    output_mode: str = "update"
    finalize: Finalize = field(default=lambda row: row)
    batches: Callable[[Path | None], BatchRows] | None = None
    # the streams it reads in the order of the query's sources (its offsets log's lines)
    streams: tuple[str, ...] = ()

    def batch_rows(self, checkpoint: Path | None) -> BatchRows:
        """A micro-batch's rows (and batch id) -> its result rows. Plans that keep driver
        state between batches (top-N) keep it under the query's `checkpoint`; the others
        shape each row with `finalize`."""
        if self.batches is not None:
            return self.batches(checkpoint)
        return lambda rows, _batch_id: [self.finalize(r) for r in rows]


def build_plan(spec: JobSpec, source: DataFrame, view: BatchView | None = None) -> Plan:
    """The job's result DataFrame over a source (jetstream, or any with a JSON ``data``);
    with `view`, its rows merged with that batch view's."""
    spec = check_spec(spec)
    if view is not None:
        check_mergeable(spec)
    events = source_events(source)
    build = {
        "topn": _topn,
        "distinct": _distinct,
        "count": _count,
        "sample": _sample,
        "custom": _custom,
    }[spec.kind]
    return build(spec, events, view)


def _window_fields(spec: JobSpec, start_ms: int | None, end_ms: int | None) -> dict[str, Any]:
    if spec.window is None:
        return {}
    if spec.window_as:
        return {spec.window_as: iso_ms(start_ms)}
    return {"window_start": iso_ms(start_ms), "window_end": iso_ms(end_ms)}


def _topn(spec: JobSpec, events: DataFrame, view: BatchView | None) -> Plan:
    def shape(key: int | None, value: Any) -> dict[str, Any]:
        if key is None:
            top, events_so_far = value
            return {"key": ALL, "top": as_top(top), "events": events_so_far}
        window = _window_fields(spec, key, value.end)
        return {"key": iso_ms(key), **window, "top": as_top(value.top)}

    base = view.top if view is not None else None
    pane = pane_ms(spec, events.isStreaming)
    batches = topn_batches(spec, shape, base, pane)
    return Plan(topn_counts(spec, events, pane), "update", batches=batches)


def _window_state(spec: JobSpec, items: DataFrame, kind: Any, params: dict[str, Any]) -> Any:
    assert spec.window is not None
    length = duration_ms(spec.window.length)
    slide = duration_ms(spec.window.slide) if spec.window.slide else length
    return window_sketch_state(
        items,
        item="_tf_it",
        kind=kind,
        params=params,
        order="seq",
        length_ms=length,
        slide_ms=slide,
    )


def _window_row(spec: JobSpec, row: dict[str, Any]) -> dict[str, Any]:
    start = int(row["start"])
    return {"key": iso_ms(start), **_window_fields(spec, start, row["end_ms"])}


def _sample(spec: JobSpec, events: DataFrame, view: BatchView | None) -> Plan:
    from pyspark.sql import functions as F

    if spec.window is not None:
        events = windowed_events(events, spec)
    if spec.field:
        items = extract(events, {"_tf_it": spec.field})
    else:
        items = events.withColumn("_tf_it", F.col("data"))
    params = {"k": spec.n, "seed": spec.seed}
    if spec.window is None:
        state = sketch_state(
            items.withColumn("_tf_key", F.lit(ALL)),
            key="_tf_key",
            item="_tf_it",
            kind="reservoir",
            params=params,
            order="seq",
        )
    else:
        state = _window_state(spec, items, "reservoir", params)

    def finalize(row: dict[str, Any]) -> dict[str, Any]:
        sample = Reservoir.from_bytes(row["sketch"])
        out = _window_row(spec, row) if spec.window is not None else {"key": ALL}
        return {**out, "sample": sample.sample(), "seen": sample.n}

    return Plan(state, "update", finalize)


def _distinct(spec: JobSpec, events: DataFrame, view: BatchView | None) -> Plan:
    from pyspark.sql import functions as F

    if spec.window is not None:
        events = windowed_events(events, spec)
    items = extract(events, {"_tf_it": spec.field}).where(F.col("_tf_it").isNotNull())
    sketch = F.hll_sketch_agg(F.col("_tf_it"), spec.lg_k).alias("sketch")
    if spec.window is None:
        df = items.groupBy(F.lit(ALL).alias("_tf_key")).agg(sketch)
    else:
        df = (
            items.groupBy(window_column(spec).alias("_tf_w"))
            .agg(sketch)
            .select(
                F.unix_millis(F.col("_tf_w.start")).alias("start"),
                F.unix_millis(F.col("_tf_w.end")).alias("end_ms"),
                "sketch",
            )
        )

    def finalize(row: dict[str, Any]) -> dict[str, Any]:
        out = _window_row(spec, row) if spec.window is not None else {"key": ALL}
        hll = merged_sketch(view, str(out["key"]), row["sketch"])
        lower, upper = hll.bounds(2)
        return {
            **out,
            "distinct": round(hll.estimate()),
            "lower": math.floor(lower),
            "upper": math.ceil(upper),
        }

    return Plan(df, "update", finalize)


def _count(spec: JobSpec, events: DataFrame, view: BatchView | None) -> Plan:
    from pyspark.sql import functions as F

    if spec.window is not None:
        events = windowed_events(events, spec)
    aliases = [f"_tf_by{i}" for i in range(len(spec.by))]
    events = extract(events, dict(zip(aliases, spec.by, strict=True)))
    groups: list[Column] = [F.col(a) for a in aliases]
    if spec.window is not None:
        groups.append(window_column(spec).alias("_tf_w"))
    df = events.groupBy(*groups).agg(F.count(F.lit(1)).alias("_tf_count"))
    if spec.window is not None:
        df = df.select(
            *aliases,
            F.unix_millis(F.col("_tf_w.start")).alias("_tf_start"),
            F.unix_millis(F.col("_tf_w.end")).alias("_tf_end"),
            "_tf_count",
        )
    names = output_names(spec)

    def finalize(row: dict[str, Any]) -> dict[str, Any]:
        values = [row[a] for a in aliases]
        parts = ["" if v is None else str(v) for v in values]
        extra: dict[str, Any] = {}
        if spec.window is not None:
            start = row["_tf_start"]
            parts.append(str(iso_ms(start)))
            extra = _window_fields(spec, start, row["_tf_end"])
        out: dict[str, Any] = {"key": "|".join(parts)}
        out.update(zip(names, values, strict=True))
        out.update(extra)
        out[spec.count_as] = row["_tf_count"]
        return merged_count(view, out, spec.count_as)

    return Plan(df, "update", finalize)


def load_function(ref: str, key: str = "function") -> Callable[[DataFrame], DataFrame]:
    """The user's job function, named ``module:function`` (runtime/hooks.py: one form and
    one error for every reference to code)."""
    return load_hook(ref, key)


def _custom(spec: JobSpec, events: DataFrame, view: BatchView | None) -> Plan:
    fn = load_function(spec.function, f"job {spec.name!r}: function")
    df = fn(events.select("seq", "subject", "ts", "msg_id", "data"))
    if "key" not in df.columns:
        raise JobError(f"custom job {spec.name!r}: {spec.function} must return a `key` column")
    return Plan(df, spec.output_mode, _plain_row)


def _plain_row(row: dict[str, Any]) -> dict[str, Any]:
    """JSON-ready values: timestamps as ISO text, the rest as they are."""
    out = {}
    for k, v in row.items():
        if isinstance(v, dt.datetime):
            v = v.replace(tzinfo=v.tzinfo or dt.UTC).isoformat().replace("+00:00", "Z")
        out[k] = v
    return out
