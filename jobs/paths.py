"""JSON paths: how a job names the fields it analyses, and reading them with Spark.

``a.b.c`` walks objects, ``name[]`` explodes an array, so ``group.group_topics[].topic_name``
gives one row per topic of each RSVP. A leading ``$.`` is allowed. ``_subject``, ``_seq``,
``_ts`` and ``_msg_id`` name the source's own columns. Paths are parsed with Spark's
`from_json` against a schema built from the paths themselves (no sampling: every leaf is read
as a string, numbers and objects as their JSON text), so a field missing from an event is
null, never an error.

`extract` gives one row per value (exploding); `extract_values` keeps one row per event with
the values a path reaches as an array (what top-N counts, with no explode before its
aggregation). Parsing is pure and lives in the foundation (runtime/json_paths.py), where the
config checks a job's paths as it loads; `json_schema`, `extract` and `extract_values` import
pyspark when called (it is the job's engine, not the CLI's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from runtime.errors import JobError
from runtime.json_paths import PSEUDO_FIELDS, parse_path

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame


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


def extract_values(df: DataFrame, alias: str, path: str, *, json_col: str = "data") -> DataFrame:
    """`df` plus `alias`: array<string> of the non-null values `path` reaches in each event.

    Every ``[]`` flattens instead of exploding, so the row count stays one per event; a
    missing or empty array gives an empty array (never null). Spark expressions only
    (`from_json`, `transform`, `flatten`, `filter`): no Python per event.
    """
    from pyspark.sql import functions as F

    steps = parse_path(path)
    if steps[0].name in PSEUDO_FIELDS:
        values = F.array(F.col(PSEUDO_FIELDS[steps[0].name]).cast("string"))
    else:
        col: Column = F.from_json(F.col(json_col), json_schema([path]))
        many = False
        for step in steps:
            col = F.transform(col, _member(step.name)) if many else col.getField(step.name)
            if step.explode:
                if many:  # an array of arrays: drop the missing ones, then flatten
                    col = F.flatten(F.filter(col, lambda a: a.isNotNull()))
                many = True
        values = col if many else F.array(col)
        values = F.transform(values, lambda v: v.cast("string"))
    kept = F.filter(values, lambda v: v.isNotNull())
    return df.withColumn(alias, F.coalesce(kept, F.array().cast("array<string>")))


def _member(name: str) -> Callable[[Column], Column]:
    # a one-argument lambda: Spark's `transform` passes the index to a second parameter
    return lambda x: x.getField(name)
