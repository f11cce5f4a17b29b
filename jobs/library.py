"""Reusable analysis jobs: top-N, distinct, count and sample over any stream, set up as data.

A `JobSpec` names a stream and the fields to analyse by JSON path; `start_job` turns it into a
Spark streaming query reading the ``jetstream`` source and writing through `ResultSink`:
results on ``results.<job name>`` with ids ``<job>:<batchId>:<key>`` and the latest value per
key in KV under ``<job>.<key>`` (docs/contracts.md). The same spec works from the config, the
CLI (`parse_job`) and code.

JSON paths: ``a.b.c`` walks objects, ``name[]`` explodes an array, so
``group.group_topics[].topic_name`` gives one row per topic of each RSVP. A leading ``$.`` is
allowed. ``_subject``, ``_seq``, ``_ts`` and ``_msg_id`` name the source's own columns. Paths
are parsed with Spark's `from_json` against a schema built from the paths themselves (no
sampling: every leaf is read as a string, numbers and objects as their JSON text), so a field
missing from an event is null, never an error.

=========  ================================================================================
kind       result rows (``key`` always; ``window_start``/``window_end`` ISO when windowed)
=========  ================================================================================
topn       ``{"key","top":[{"item","count","error"}...n],"events"}``: Space-Saving
           (`jobs.sketches.TopN`, ``capacity`` counters) kept in Spark state across
           micro-batches; key ``"all"`` or the window start. With capacity >= distinct items
           the counts are exact (error 0).
distinct   ``{"key","distinct","lower","upper"}``: HyperLogLog by Spark's own
           ``hll_sketch_agg`` (JVM), bounds at 2 standard deviations.
count      ``{"key", <by names>..., "count"}`` per key (and window): exact. The key joins the
           by-values and the window start with ``|``.
sample     ``{"key","sample":[...n],"seen"}``: a uniform reservoir (`Reservoir`, seeded, so a
           replayed batch draws the same sample) of a field, or of whole events.
custom     a user's function ``DataFrame -> DataFrame`` (``function = "module:fn"``; a bare
           module name means ``jobs.<module>``): it gets the valid events (``seq``,
           ``subject``, ``ts``, ``msg_id``, ``data``) and returns rows with a ``key`` column.
=========  ================================================================================

Windows use event time (``time_field``, default the time JetStream stored the event) with a
watermark: an event older than the watermark is late, dropped and counted (the
``dedupeWithinWatermark`` operator of `jobs.windows`, which also drops redelivered ids). Windowed
top-N and samples keep one mergeable summary per pane (gcd of length and slide) and emit each
changed window as the merge of its panes, so an event reaches Python once, not once per
sliding window. The queries run in update mode, so KV always holds each key's current value.
Malformed events (the source's ``valid`` false) never reach a job: `start_deadletters` runs
one query per stream that sends them to ``deadletter.<stream>`` and counts them.

Every micro-batch is a pure function of (state, the batch's sequence range): rows are put
in a fixed order before a sketch sees them, so a batch Spark replays after a crash publishes
the same result ids with the same values, and the results stream's dedup drops them.
"""

from __future__ import annotations

import datetime as dt
import importlib
import inspect
import math
import re
import shlex
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from jobs.sink import BatchReport, ResultSink

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.streaming import StreamingQuery
    from pyspark.sql.streaming.state import GroupState

    from runtime.config import Config

Name = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$", max_length=100)]
Kind = Literal["topn", "distinct", "count", "sample", "custom"]
KINDS: tuple[str, ...] = ("topn", "distinct", "count", "sample", "custom")
DEADLETTER_PREFIX = "deadletter_"
RESERVED_NAMES = frozenset({"checkpoints"})
PSEUDO_FIELDS = {"_subject": "subject", "_seq": "seq", "_ts": "ts", "_msg_id": "msg_id"}
ALL = "all"


class JobError(ValueError):
    """A job spec or a JSON path is invalid; the message names the field and the fix."""


# --------------------------------------------------------------------------- specs


class WindowSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """An event-time window: tumbling when `slide` is empty, else sliding every `slide`.

    Durations are Spark intervals ("5 minutes") or short forms ("5m", "10s", "500ms", "1h").
    """

    length: str
    slide: str = ""
    watermark: str = "1 minute"


class JobSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """One analysis job; `check_spec` enforces the rules that span fields."""

    name: Name
    kind: Kind
    stream: Name
    subject: str = ""
    field: str = ""
    by: list[str] = []
    by_as: list[str] = []
    count_as: str = "count"
    window: WindowSpec | None = None
    window_as: str = ""
    time_field: str = ""
    time_format: Literal["epoch_ms", "epoch_s", "iso"] = "epoch_ms"
    n: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 10
    capacity: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 1024
    lg_k: Annotated[int, msgspec.Meta(ge=4, le=21)] = 12
    seed: int = 0
    function: str = ""
    output_mode: Literal["update", "append", "complete"] = "update"
    trigger_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    max_events_per_trigger: Annotated[int, msgspec.Meta(ge=0)] = 0


def check_spec(spec: JobSpec) -> JobSpec:
    """Raise JobError for a spec no field type can rule out; return it (paths checked too)."""
    where = f"job {spec.name!r}"
    if spec.name in RESERVED_NAMES or spec.name.startswith(DEADLETTER_PREFIX):
        raise JobError(f"{where}: the name is reserved; pick another")
    if spec.kind == "topn" and not spec.field:
        raise JobError(f"{where}: topn needs `field`, the JSON path of the items to rank")
    if spec.kind == "distinct" and not spec.field:
        raise JobError(f"{where}: distinct needs `field`, the JSON path of what to count")
    if spec.kind == "count" and not (spec.by or spec.window):
        raise JobError(f"{where}: count needs `by` (JSON paths of the key) or a `window`")
    if spec.kind == "custom" and not spec.function:
        raise JobError(f"{where}: custom needs `function`, e.g. 'myjob:run' (module in jobs/)")
    if spec.kind != "custom" and spec.function:
        raise JobError(f"{where}: `function` is only for kind custom")
    if spec.by_as and len(spec.by_as) != len(spec.by):
        raise JobError(f"{where}: by_as must name each of the {len(spec.by)} `by` paths")
    if spec.kind != "custom" and spec.output_mode != "update":
        raise JobError(f"{where}: only custom jobs choose an output mode (built-ins use update)")
    for path in [spec.field, *spec.by, spec.time_field]:
        if path:
            parse_path(path)
    if spec.time_field and any(s.explode for s in parse_path(spec.time_field)):
        raise JobError(f"{where}: time_field cannot explode an array ([])")
    if spec.window is not None:
        for part in ("length", "slide", "watermark"):
            value = getattr(spec.window, part)
            if value or part != "slide":
                interval(value)
    names = [*output_names(spec), spec.count_as, spec.window_as]
    for n in names:
        if n and n in ("key", "window_start", "window_end"):
            raise JobError(f"{where}: output name {n!r} is taken by the result row itself")
    return spec


def output_names(spec: JobSpec) -> list[str]:
    """The result-row names of a count job's `by` values (default: each path's last name)."""
    return list(spec.by_as) or [parse_path(p)[-1].name.lstrip("_") for p in spec.by]


def decode_spec(data: Mapping[str, Any] | bytes | str | JobSpec) -> JobSpec:
    """A checked JobSpec from a mapping, JSON text/bytes, or a spec."""
    try:
        if isinstance(data, JobSpec):
            spec = data
        elif isinstance(data, bytes | str):
            spec = msgspec.json.decode(data, type=JobSpec)
        else:
            spec = msgspec.convert(dict(data), JobSpec)
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        raise JobError(f"job spec: {err}") from None
    return check_spec(spec)


def encode_spec(spec: JobSpec) -> bytes:
    return msgspec.json.encode(spec)


_LIST_KEYS = {"by", "by_as"}


def parse_job(text: str) -> JobSpec:
    """A spec from CLI text: a JSON object, or ``key=value`` words.

    ``name=topics kind=topn stream=meetup field=group.group_topics[].topic_name n=5``;
    ``by=a,b`` gives a list; ``window=5m`` or ``window=5m/10s`` (length/slide) and
    ``watermark=1m`` set the window.
    """
    text = text.strip()
    if text.startswith("{"):
        return decode_spec(text)
    data: dict[str, Any] = {}
    window: dict[str, str] = {}
    for word in shlex.split(text):
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise JobError(f"job spec: expected key=value, got {word!r}")
        if key in _LIST_KEYS:
            data[key] = [v for v in value.split(",") if v]
        elif key == "window":
            length, _, slide = value.partition("/")
            window.update(length=length, slide=slide)
        elif key == "watermark":
            window["watermark"] = value
        elif key in ("n", "capacity", "lg_k", "seed", "max_events_per_trigger"):
            data[key] = _number(key, value, int)
        elif key == "trigger_s":
            data[key] = _number(key, value, float)
        else:
            data[key] = value
    if window:
        if "length" not in window:
            raise JobError("job spec: watermark= needs window=LENGTH[/SLIDE]")
        data["window"] = window
    return decode_spec(data)


def _number(key: str, value: str, kind: type[int] | type[float]) -> int | float:
    try:
        return kind(value)
    except ValueError:
        raise JobError(f"job spec: {key} must be a number, not {value!r}") from None


_SHORT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$")
_LONG = re.compile(
    r"^\s*\d+\s+(millisecond|second|minute|hour|day|week)s?\s*$",
    re.IGNORECASE,
)
_UNITS = {"ms": "milliseconds", "s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def interval(text: str) -> str:
    """A Spark interval string from "5m" / "10 seconds" forms; JobError otherwise."""
    m = _SHORT.match(text)
    if m:
        number = m.group(1)
        if "." in number:
            raise JobError(f"duration {text!r}: use whole numbers (e.g. 500ms, not 0.5s)")
        return f"{number} {_UNITS[m.group(2)]}"
    if _LONG.match(text):
        return " ".join(text.split()).lower()
    raise JobError(f"duration {text!r}: expected e.g. '10s', '5m', '1h' or '5 minutes'")


# --------------------------------------------------------------------------- JSON paths


@dataclass(frozen=True)
class Step:
    """One path segment: an object member, exploded when it is an array (``name[]``)."""

    name: str
    explode: bool = False


_SEGMENT = re.compile(r"^([^.\[\]]+)(\[\])?$")


def parse_path(path: str) -> tuple[Step, ...]:
    """``group.group_topics[].topic_name`` -> steps; JobError naming the bad part."""
    text = path.strip()
    if text.startswith("$."):
        text = text[2:]
    if not text:
        raise JobError(f"JSON path {path!r} is empty")
    if text in PSEUDO_FIELDS:
        return (Step(text),)
    steps = []
    for part in text.split("."):
        m = _SEGMENT.match(part)
        if not m:
            raise JobError(
                f"JSON path {path!r}: bad segment {part!r} (use name, or name[] to explode an "
                "array; members are separated by '.')"
            )
        steps.append(Step(m.group(1), bool(m.group(2))))
    return tuple(steps)


def json_schema(paths: Sequence[str]) -> Any:
    """The smallest Spark schema that reads every path (leaves are strings)."""
    from pyspark.sql.types import ArrayType, StringType, StructField, StructType

    tree: dict[str, Any] = {}
    origin: dict[tuple[str, ...], str] = {}
    for path in paths:
        steps = parse_path(path)
        if steps[0].name in PSEUDO_FIELDS:
            continue
        node = tree
        for i, step in enumerate(steps):
            leaf = i == len(steps) - 1
            prefix = tuple(s.name for s in steps[: i + 1])
            shape = (step.explode, leaf)
            seen = node.get(step.name)
            if seen is not None and seen[0] != shape:
                raise JobError(
                    f"JSON paths {origin[prefix]!r} and {path!r} disagree about "
                    f"{'.'.join(prefix)!r} (array or not, object or value)"
                )
            if seen is None:
                seen = node[step.name] = (shape, {})
                origin[prefix] = path
            node = seen[1]

    def build(node: dict[str, Any]) -> StructType:
        fields = []
        for name, ((explode, leaf), children) in node.items():
            t: Any = StringType() if leaf else build(children)
            fields.append(StructField(name, ArrayType(t) if explode else t, True))
        return StructType(fields)

    return build(tree)


def extract(
    df: DataFrame, fields: Mapping[str, str], *, outer: bool = False, json_col: str = "data"
) -> DataFrame:
    """`df` plus one string column per alias in `fields` (alias -> JSON path).

    Each ``[]`` explodes: one row per array element (`outer`: an event with an empty or
    missing array keeps one row with null). The JSON is parsed once for all paths.
    """
    from pyspark.sql import functions as F

    json_paths = {a: p for a, p in fields.items() if parse_path(p)[0].name not in PSEUDO_FIELDS}
    for alias, path in fields.items():
        if alias not in json_paths:
            df = df.withColumn(alias, F.col(PSEUDO_FIELDS[parse_path(path)[0].name]))
    if not json_paths:
        return df
    schema = json_schema(list(json_paths.values()))
    df = df.withColumn("_tf_json", F.from_json(F.col(json_col), schema))
    temps = ["_tf_json"]
    explode = F.explode_outer if outer else F.explode
    for alias, path in json_paths.items():
        col: Column = F.col("_tf_json")
        for i, step in enumerate(parse_path(path)):
            col = col.getField(step.name)
            if step.explode:
                tmp = f"_tf_x_{alias}_{i}"
                df = df.withColumn(tmp, explode(col))
                temps.append(tmp)
                col = F.col(tmp)
        df = df.withColumn(alias, col.cast("string"))
    return df.drop(*temps)


# --------------------------------------------------------------------------- events


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


# --------------------------------------------------------------------------- sketch state


def _apply(kind: str, blob: bytes | None, pdf: pd.DataFrame, params: Mapping[str, Any]) -> bytes:
    """Add a group's rows (``_tf_item``, ``_tf_order``) to a sketch, in a fixed order.

    Top-N items go in as this batch's counts (weights), lightest first, so the purges of a
    full summary fall on light items; a reservoir sees the rows in (order, item) order.
    """
    from jobs.sketches import update_bytes

    items = pdf[pdf["_tf_item"].notna()]
    if kind == "topn":
        counts = items["_tf_item"].astype(str).value_counts()
        ranked = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]))
        return update_bytes(
            kind, blob, [k for k, _ in ranked], [int(c) for _, c in ranked], **params
        )
    items = items.sort_values(["_tf_order", "_tf_item"], kind="stable")
    return update_bytes(kind, blob, items["_tf_item"].astype(str).tolist(), **params)


def sketch_state(
    df: DataFrame,
    *,
    key: str,
    item: str,
    kind: Literal["topn", "reservoir"],
    params: Mapping[str, Any],
    order: str,
    event: str | None = None,
) -> DataFrame:
    """A sketch per key kept in Spark state: ``[key, sketch, events, n]`` per changed key.

    Rows are applied in a fixed order (`_apply`), so a replayed micro-batch rebuilds the
    same sketch. `events` counts distinct `event` values (an event's exploded rows count
    once; a null item still counts its event), `n` the items. Keys never expire: suited to
    bounded key sets. Use output mode "update".
    """
    from pyspark.sql import functions as F
    from pyspark.sql.streaming.state import GroupStateTimeout

    key_type = df.schema[key].dataType.simpleString()
    args = dict(params)

    def step(
        key_value: tuple[Any, ...], pdfs: Iterator[pd.DataFrame], state: GroupState
    ) -> Iterator[pd.DataFrame]:
        import pandas as pd

        frames = [p for p in pdfs if len(p)]
        if not frames:
            return
        pdf = pd.concat(frames, ignore_index=True)
        blob, events, n = state.get if state.exists else (None, 0, 0)
        if event is not None:
            events += int(pdf["_tf_event"].nunique())
        blob = _apply(kind, blob, pdf, args)
        n += int(pdf["_tf_item"].notna().sum())
        state.update((blob, events, n))
        yield pd.DataFrame({key: [key_value[0]], "sketch": [blob], "events": [events], "n": [n]})

    cols = [
        F.col(key),
        F.col(item).alias("_tf_item"),
        F.col(order).alias("_tf_order"),
        (F.col(event) if event else F.lit(None).cast("bigint")).alias("_tf_event"),
    ]
    return (
        df.select(*cols)
        .groupBy(key)
        .applyInPandasWithState(
            step,
            f"{key} {key_type}, sketch binary, events long, n long",
            "sketch binary, events long, n long",
            "update",
            GroupStateTimeout.NoTimeout,
        )
    )


_UNIT_MS = {
    "millisecond": 1,
    "second": 1000,
    "minute": 60_000,
    "hour": 3_600_000,
    "day": 86_400_000,
    "week": 604_800_000,
}


def duration_ms(text: str) -> int:
    """Milliseconds in a duration ("10s", "5 minutes")."""
    number, unit = interval(text).split()
    return int(number) * _UNIT_MS[unit.rstrip("s")]


def pane_windows(pane: int, pane_ms: int, length_ms: int, slide_ms: int) -> list[int]:
    """Starts of the windows ``[s, s + length)`` (s a multiple of `slide_ms`, Spark's rule)
    that contain the pane ``[pane, pane + pane_ms)``; `pane_ms` divides length and slide."""
    last = pane - pane % slide_ms
    return list(range(last, pane - length_ms, -slide_ms))[::-1]


def window_sketch_state(
    df: DataFrame,
    *,
    item: str,
    kind: Literal["topn", "reservoir"],
    params: Mapping[str, Any],
    order: str,
    length_ms: int,
    slide_ms: int,
) -> DataFrame:
    """Sliding or tumbling windows of mergeable sketches, built from panes.

    A pane is gcd(length, slide) of event time (``_tf_time``; the input needs a watermark).
    Each pane's sketch is kept in state; every micro-batch updates the panes it touches and
    emits ``[start, end_ms, sketch]`` for each window holding one of them, the window's
    sketch being the merge of its panes (Space-Saving and reservoir summaries are
    mergeable). An event therefore reaches Python once, not once per window it falls in.
    Panes whose last window ended at or before the watermark are dropped: such windows are
    final (late events never reach them). Use output mode "update".
    """
    from pyspark.sql import functions as F
    from pyspark.sql.streaming.state import GroupStateTimeout

    from jobs.sketches import merge_bytes

    pane_ms = math.gcd(length_ms, slide_ms)
    args = dict(params)
    sketch_kind = kind

    def step(
        _key: tuple[Any, ...], pdfs: Iterator[pd.DataFrame], state: GroupState
    ) -> Iterator[pd.DataFrame]:
        import pandas as pd

        frames = [p for p in pdfs if len(p)]
        panes: dict[int, bytes] = dict(msgspec.msgpack.decode(state.get[0])) if state.exists else {}
        touched: set[int] = set()
        if frames:
            pdf = pd.concat(frames, ignore_index=True)
            for pane, group in pdf.groupby("_tf_pane", sort=True):
                p = int(pane)
                panes[p] = _apply(sketch_kind, panes.get(p), group, args)
                touched.add(p)
        starts = sorted({s for p in touched for s in pane_windows(p, pane_ms, length_ms, slide_ms)})
        out: dict[str, list[Any]] = {"start": [], "end_ms": [], "sketch": []}
        for s in starts:
            parts = [panes.get(p) for p in range(s, s + length_ms, pane_ms)]
            out["start"].append(s)
            out["end_ms"].append(s + length_ms)
            out["sketch"].append(merge_bytes(sketch_kind, parts))
        wm = state.getCurrentWatermarkMs()
        panes = {p: b for p, b in panes.items() if p + length_ms > wm}
        state.update((msgspec.msgpack.encode(panes),))
        if starts:
            yield pd.DataFrame(out)

    ms = F.unix_millis(F.col("_tf_time"))
    cols = [
        F.lit(0).alias("_tf_group"),
        (ms - F.pmod(ms, F.lit(pane_ms))).alias("_tf_pane"),
        F.col(item).alias("_tf_item"),
        F.col(order).alias("_tf_order"),
        F.col("_tf_time"),  # the watermark's column must reach the stateful operator
    ]
    return (
        df.where(F.col("_tf_time").isNotNull())
        .select(*cols)
        .groupBy("_tf_group")
        .applyInPandasWithState(
            step,
            "start long, end_ms long, sketch binary",
            "panes binary",
            "update",
            GroupStateTimeout.NoTimeout,
        )
    )


# --------------------------------------------------------------------------- plans


Finalize = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass
class Plan:
    """What a job computes: the result DataFrame, its output mode, and the row shaping done
    on the driver before the rows are published (sketch bytes -> the query's answer)."""

    df: DataFrame
    output_mode: str = "update"
    finalize: Finalize = field(default=lambda row: row)


def build_plan(spec: JobSpec, source: DataFrame) -> Plan:
    """The job's result DataFrame over a source (jetstream, or any with a JSON ``data``)."""
    spec = check_spec(spec)
    events = source_events(source)
    build = {
        "topn": _topn,
        "distinct": _distinct,
        "count": _count,
        "sample": _sample,
        "custom": _custom,
    }[spec.kind]
    return build(spec, events)


def _window_fields(spec: JobSpec, start_ms: int | None, end_ms: int | None) -> dict[str, Any]:
    if spec.window is None:
        return {}
    if spec.window_as:
        return {spec.window_as: iso_ms(start_ms)}
    return {"window_start": iso_ms(start_ms), "window_end": iso_ms(end_ms)}


def _topn(spec: JobSpec, events: DataFrame) -> Plan:
    from pyspark.sql import functions as F

    from jobs.sketches import TopN

    if spec.window is not None:
        events = windowed_events(events, spec)
    items = extract(events, {"_tf_it": spec.field}, outer=True)
    params = {"capacity": spec.capacity}
    if spec.window is None:
        state = sketch_state(
            items.withColumn("_tf_key", F.lit(ALL)),
            key="_tf_key",
            item="_tf_it",
            kind="topn",
            params=params,
            order="seq",
            event="seq",
        )
    else:
        state = _window_state(spec, items, "topn", params)

    def finalize(row: dict[str, Any]) -> dict[str, Any]:
        top = TopN.from_bytes(row["sketch"]).top(spec.n)
        if spec.window is None:
            return {"key": ALL, "top": top, "events": row["events"]}
        return {**_window_row(spec, row), "top": top}

    return Plan(state, "update", finalize)


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


def _sample(spec: JobSpec, events: DataFrame) -> Plan:
    from pyspark.sql import functions as F

    from jobs.sketches import Reservoir

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


def _distinct(spec: JobSpec, events: DataFrame) -> Plan:
    from pyspark.sql import functions as F

    from jobs.sketches import Distinct

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
        hll = Distinct.from_bytes(row["sketch"])
        lower, upper = hll.bounds(2)
        out = _window_row(spec, row) if spec.window is not None else {"key": ALL}
        return {
            **out,
            "distinct": round(hll.estimate()),
            "lower": math.floor(lower),
            "upper": math.ceil(upper),
        }

    return Plan(df, "update", finalize)


def _count(spec: JobSpec, events: DataFrame) -> Plan:
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
        return out

    return Plan(df, "update", finalize)


def load_function(ref: str) -> Callable[[DataFrame], DataFrame]:
    """The user's job function: ``module:fn``; a module without a dot is ``jobs.<module>``;
    without ``:fn`` the module's `job` function, or its only public function."""
    module, _, attr = ref.partition(":")
    if "." not in module:
        module = f"jobs.{module}"
    try:
        mod = importlib.import_module(module)
    except ImportError as err:
        raise JobError(f"custom job {ref!r}: cannot import {module!r}: {err}") from None
    if attr:
        fn = getattr(mod, attr, None)
    else:
        fn = getattr(mod, "job", None)
        if fn is None:
            own = [
                f
                for n, f in inspect.getmembers(mod, inspect.isfunction)
                if f.__module__ == mod.__name__ and not n.startswith("_")
            ]
            fn = own[0] if len(own) == 1 else None
    if not callable(fn):
        raise JobError(
            f"custom job {ref!r}: name the function as 'module:function' (module {module!r} "
            "has no `job` and not exactly one public function)"
        )
    return fn


def _custom(spec: JobSpec, events: DataFrame) -> Plan:
    fn = load_function(spec.function)
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


# --------------------------------------------------------------------------- running


@dataclass(frozen=True)
class NatsTarget:
    """Where sources read and sinks write: a NATS URL and its credentials."""

    url: str
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, cfg: Config, url: str = "") -> NatsTarget:
        """As the `analysis` role (its NATS user when configured); with `[tls]` on, trusting
        `tls.ca` and presenting the client pair (needed with `tls.verify_clients`) as
        `connect_nats` does."""
        from runtime.nats_roles import credentials
        from runtime.tls import tls_files

        who = credentials(cfg, "analysis")
        files = tls_files(cfg)
        return cls(
            url=url or cfg.nats.url,
            user=who.user or None,
            password=who.password or None,
            token=who.token or None,
            creds=who.creds or None,
            tls_ca=str(files.ca) if files is not None else cfg.nats.tls_ca or None,
            tls_cert=str(files.client_cert) if files and files.client_cert else None,
            tls_key=str(files.client_key) if files and files.client_key else None,
        )

    def source_options(self) -> dict[str, str]:
        opts = {"url": self.url}
        for key, value in (
            ("user", self.user),
            ("password", self.password),
            ("token", self.token),
            ("creds", self.creds),
            ("tlsCa", self.tls_ca),
            ("tlsCert", self.tls_cert),
            ("tlsKey", self.tls_key),
        ):
            if value:
                opts[key] = value
        return opts

    def sink(self, query: str, **kwargs: Any) -> ResultSink:
        """A ResultSink for `query`: results.<query>, KV keys <query>.<key>."""
        return ResultSink(
            self.url,
            query_name=query,
            kv_prefix=query,
            user=self.user,
            password=self.password,
            token=self.token,
            creds=self.creds,
            tls_ca=self.tls_ca,
            tls_cert=self.tls_cert,
            tls_key=self.tls_key,
            **kwargs,
        )


def checkpoint_run_id(checkpoint: str | Path) -> str:
    """The id Spark gave the query when its checkpoint was made (``<checkpoint>/metadata``):
    the same across restarts, new after a reset. The sink guards KV with it."""
    import json

    try:
        text = (Path(checkpoint) / "metadata").read_text(encoding="utf-8")
        return str(json.loads(text.splitlines()[0])["id"])
    except (OSError, ValueError, KeyError, IndexError):
        return ""


def _claim_run(sink: ResultSink, checkpoint: str | Path | None) -> None:
    if checkpoint is not None and not sink.run_id:
        sink.run_id = checkpoint_run_id(checkpoint)


@dataclass
class JobWriter:
    """``foreachBatch``: the batch's result rows shaped by the plan, published idempotently."""

    sink: ResultSink
    finalize: Finalize
    on_batch: Callable[[int, BatchReport], None] | None = None
    checkpoint: str | Path | None = None

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        _claim_run(self.sink, self.checkpoint)  # Spark has written the metadata by now
        rows = [self.finalize(r.asDict(recursive=True)) for r in df.collect()]
        report = self.sink.publish_results(rows, batch_id)
        if self.on_batch is not None:
            self.on_batch(batch_id, report)


@dataclass
class DeadLetterWriter:
    """``foreachBatch``: a stream's malformed events to ``deadletter.<stream>``, then counted.

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


def read_stream(
    spark: SparkSession, nats: NatsTarget, stream: str, subject: str = "", max_events: int = 0
) -> DataFrame:
    """The jetstream source over `stream` (the format must be registered)."""
    reader = spark.readStream.format("jetstream").options(**nats.source_options())
    reader = reader.option("stream", stream)
    if subject:
        reader = reader.option("subject", subject)
    if max_events:
        reader = reader.option("maxEventsPerTrigger", str(max_events))
    return reader.load()


def _trigger(spec_trigger_s: float, trigger: Mapping[str, Any] | None) -> dict[str, Any]:
    if trigger is not None:
        return dict(trigger)
    if spec_trigger_s <= 0:
        return {}
    ms = max(1, round(spec_trigger_s * 1000))
    return {"processingTime": f"{ms} milliseconds"}


def start_job(
    spark: SparkSession,
    spec: JobSpec,
    nats: NatsTarget,
    checkpoint_root: str | Path,
    *,
    trigger: Mapping[str, Any] | None = None,
    source: DataFrame | None = None,
    on_batch: Callable[[int, BatchReport], None] | None = None,
) -> StreamingQuery:
    """Start the job's query (named after the job) with its checkpoint at root/<name>.

    A restart with the same checkpoint resumes exactly where the last committed batch
    ended. `trigger` overrides the spec's (e.g. ``{"availableNow": True}`` in tests);
    `source` replaces the jetstream source (any streaming DataFrame with ``data``).
    """
    spec = check_spec(spec)
    if source is None:
        source = read_stream(spark, nats, spec.stream, spec.subject, spec.max_events_per_trigger)
    plan = build_plan(spec, source)
    checkpoint = Path(checkpoint_root) / spec.name
    writer = JobWriter(nats.sink(spec.name), plan.finalize, on_batch, checkpoint)
    return (
        plan.df.writeStream.queryName(spec.name)
        .outputMode(plan.output_mode)
        .foreachBatch(writer)
        .option("checkpointLocation", str(checkpoint))
        .trigger(**_trigger(spec.trigger_s, trigger))
        .start()
    )


def deadletter_query_name(stream: str) -> str:
    return f"{DEADLETTER_PREFIX}{stream}"


def start_deadletters(
    spark: SparkSession,
    stream: str,
    nats: NatsTarget,
    checkpoint_root: str | Path,
    *,
    on_batch: Callable[[int, BatchReport], None] | None = None,
    trigger: Mapping[str, Any] | None = None,
    trigger_s: float = 1.0,
) -> StreamingQuery:
    """The stream's malformed events to ``deadletter.<stream>`` (ids ``dl:<stream>:<seq>``)."""
    name = deadletter_query_name(stream)
    writer = DeadLetterWriter(nats.sink(name), stream, on_batch)
    return (
        read_stream(spark, nats, stream)
        .writeStream.queryName(name)
        .foreachBatch(writer)
        .option("checkpointLocation", str(Path(checkpoint_root) / name))
        .trigger(**_trigger(trigger_s, trigger))
        .start()
    )


__all__ = [
    "ALL",
    "DeadLetterWriter",
    "JobError",
    "JobSpec",
    "JobWriter",
    "NatsTarget",
    "Plan",
    "Step",
    "WindowSpec",
    "build_plan",
    "check_spec",
    "checkpoint_run_id",
    "deadletter_query_name",
    "decode_spec",
    "duration_ms",
    "encode_spec",
    "event_time",
    "extract",
    "interval",
    "iso_ms",
    "json_schema",
    "load_function",
    "parse_job",
    "parse_path",
    "read_stream",
    "pane_windows",
    "sketch_state",
    "source_events",
    "start_deadletters",
    "start_job",
    "window_sketch_state",
    "windowed_events",
]
