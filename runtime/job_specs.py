"""Analysis jobs as data: `JobSpec`, its checks, and the forms it is written in.

A `JobSpec` names a stream, a kind (``topn``, ``distinct``, ``count``, ``sample`` or
``custom``; jobs/plans.py says what each computes, or ``sql``: a continuous query over
streams by name, jobs/sql_jobs.py) and the fields to analyse by JSON path
(jobs/paths.py). The same spec works from the config (``[[jobs]]``), the CLI (`parse_job`:
``key=value`` words or JSON) and code (`decode_spec`). Everything here is pure: the CLI checks
a spec without loading Spark, and the config checks every `[[jobs]]` entry as it loads
(`runtime.config.validate`), before anything starts.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

from runtime.errors import JobError
from runtime.hooks import is_hook
from runtime.json_paths import parse_path

Name = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$", max_length=100)]
Kind = Literal["topn", "distinct", "count", "sample", "custom", "sql"]
KINDS: tuple[str, ...] = ("topn", "distinct", "count", "sample", "custom", "sql")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,100}$")
DEADLETTER_PREFIX = "deadletter_"
RESERVED_NAMES = frozenset({"checkpoints"})


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
    stream: str = ""  # every kind but sql, whose streams are the tables its query names
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
    # kept so older specs still load; top-N counts every item exactly (jobs/topn.py)
    capacity: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 1024
    lg_k: Annotated[int, msgspec.Meta(ge=4, le=21)] = 12
    seed: int = 0
    function: str = ""
    output_mode: Literal["update", "append", "complete"] = "update"
    # a micro-batch of the top-N costs ~0.3-0.4 s on 2 cores (measured): a shorter trigger
    # only runs batches back to back; under a backlog a batch takes what has arrived
    trigger_s: Annotated[float, msgspec.Meta(ge=0)] = 0.5
    max_events_per_trigger: Annotated[int, msgspec.Meta(ge=0)] = 0
    # partitions of the query's state (and its shuffles); 0: the session's
    # spark.sql.shuffle.partitions. Fixed in the checkpoint when the query first starts: a
    # restart resumes with the checkpoint's count whatever this says (jobs/running.py)
    state_partitions: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 0
    # kind sql: one SELECT over streams by name (runtime/data/sql_jobs.py says what runs)
    sql: str = ""
    # kind sql: the watermark of every stream the query reads, over each stream's own
    # `[streams.X] watermark`
    watermark: str = ""
    # kind sql: streams the query reads as tables, the latest event per key of a compacted
    # stream (`[streams.X.compact]`) as of each micro-batch: a stream-table join
    tables: list[str] = []


def check_spec(spec: JobSpec) -> JobSpec:
    """Raise JobError for a spec no field type can rule out; return it (paths checked too)."""
    where = f"job {spec.name!r}"
    if spec.kind == "sql":
        _check_sql_spec(spec, where)
    elif not _NAME.match(spec.stream):
        raise JobError(f"{where}: `stream` must name a stream (letters, digits, _ and -)")
    if spec.name in RESERVED_NAMES or spec.name.startswith(DEADLETTER_PREFIX):
        raise JobError(f"{where}: the name is reserved; pick another")
    if spec.kind == "topn" and not spec.field:
        raise JobError(f"{where}: topn needs `field`, the JSON path of the items to rank")
    if spec.kind == "distinct" and not spec.field:
        raise JobError(f"{where}: distinct needs `field`, the JSON path of what to count")
    if spec.kind == "count" and not (spec.by or spec.window):
        raise JobError(f"{where}: count needs `by` (JSON paths of the key) or a `window`")
    if spec.kind == "custom" and not spec.function:
        raise JobError(f"{where}: custom needs `function`, e.g. 'mypkg.jobs:run'")
    if spec.function and not is_hook(spec.function):
        raise JobError(f"{where}: function: expected 'module:function', got {spec.function!r}")
    if spec.kind != "custom" and spec.function:
        raise JobError(f"{where}: `function` is only for kind custom")
    if spec.by_as and len(spec.by_as) != len(spec.by):
        raise JobError(f"{where}: by_as must name each of the {len(spec.by)} `by` paths")
    if spec.kind not in ("custom", "sql") and spec.output_mode != "update":
        raise JobError(
            f"{where}: only custom and sql jobs choose an output mode (built-ins use update)"
        )
    if spec.kind != "sql" and (spec.sql or spec.watermark or spec.tables):
        raise JobError(
            f"{where}: `sql`, `watermark` and `tables` are for kind sql (a window has its own)"
        )
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


_NOT_SQL = ("stream", "subject", "field", "by", "by_as", "window", "window_as", "time_field")


def _check_sql_spec(spec: JobSpec, where: str) -> None:
    """What a sql job may say; its query's own check needs sqlglot (runtime/data/sql_jobs.py,
    run where the spec loads: the config, the CLI and the driver)."""
    if not spec.sql.strip():
        raise JobError(f"{where}: sql needs `sql`, one SELECT over streams by name")
    given = [k for k in _NOT_SQL if getattr(spec, k) != getattr(_DEFAULTS, k)]
    if given:
        raise JobError(
            f"{where}: a sql job reads the streams its query names; drop {', '.join(given)} "
            "(a window is window() or session_window() in the query)"
        )
    if spec.watermark:
        interval(spec.watermark)


def output_names(spec: JobSpec) -> list[str]:
    """The result-row names of a count job's `by` values (default: each path's last name)."""
    return list(spec.by_as) or [parse_path(p)[-1].name.lstrip("_") for p in spec.by]


_DEFAULTS = JobSpec(name="x", kind="sql", sql="x")


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


_LIST_KEYS = {"by", "by_as", "tables"}


def parse_job(text: str) -> JobSpec:
    """A spec from CLI text: a JSON object, or ``key=value`` words.

    ``name=top_skus kind=topn stream=orders field=items[].sku n=5``;
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
        elif key in ("n", "capacity", "lg_k", "seed", "max_events_per_trigger", "state_partitions"):
            data[key] = _number(key, value, int)
        elif key == "trigger_s":
            data[key] = _number(key, value, float)
        else:
            data[key] = value
    if data.get("kind") == "sql" and "watermark" in window:
        data["watermark"] = window.pop("watermark")
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


def deadletter_query_name(stream: str) -> str:
    """The query sending `stream`'s malformed events to dead letter (a reserved job name)."""
    return f"{DEADLETTER_PREFIX}{stream}"
