"""A stream's declared schema as the collector's check (runtime/data/event_schema.py),
measured against what real Spark's `from_json` makes of the same JSON: whatever the check
accepts, Spark reads as a value, never a silent null; and for numbers, booleans and the
nested kinds it refuses exactly what Spark would null."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.config import ConfigError
from runtime.config import load as load_config
from runtime.data.event_schema import EventSchema, SchemaError, schema_fields

TYPES = [
    "BIGINT",
    "INT",
    "SMALLINT",
    "TINYINT",
    "DOUBLE",
    "FLOAT",
    "DECIMAL(5,2)",
    "DECIMAL",
    "BOOLEAN",
    "STRING",
    "DATE",
    "TIMESTAMP",
    "TIMESTAMP_NTZ",
    "BINARY",
    "STRUCT<a: INT>",
    "ARRAY<INT>",
    "ARRAY<DECIMAL(3,1)>",
    "MAP<STRING, INT>",
    "MAP<STRING, ARRAY<BOOLEAN>>",
]
VALUES = [
    "0",
    "1",
    "-1",
    "-0",
    "1.0",
    "1.5",
    "1e3",
    "127",
    "128",
    "-129",
    "32767",
    "32768",
    "2147483647",
    "2147483648",
    "-2147483649",
    "9223372036854775807",
    "9223372036854775808",
    "123.456",
    "999.99",
    "999.995",
    "1000",
    "99.95",
    "0.1e-400",
    "1e300",
    '"12"',
    '"1.5"',
    '"-7.25"',
    '"NaN"',
    '"Infinity"',
    '"-Infinity"',
    '"+INF"',
    '"-INF"',
    '"INF"',
    '"nan"',
    '"abc"',
    '""',
    "true",
    "false",
    "{}",
    '{"a":1}',
    '{"a":"x"}',
    '{"a":null}',
    '{"b":1}',
    '{"x":[true]}',
    '{"x":[1]}',
    "[]",
    "[1]",
    "[1,null]",
    '[1,"x"]',
    "[1.5,99.9]",
    "[99.99]",
    "[[1]]",
    '"2024-01-02"',
    '"2024-01-02T03:04:05Z"',
    '"aGVsbG8="',
    "1700000000",
]
# where Spark reads a value the check refuses, each for a reason: Spark takes 128..255
# for TINYINT (and wraps it), 1E400 and the like for DOUBLE (as infinity)
SPARK_LENIENT: set[tuple[str, str]] = {("TINYINT", "128")}
# a string for these is read by Spark's date, timestamp or base64 parser, which the check
# leaves to it: any string passes, other JSON is checked like the rest
SPARK_PARSES_STRINGS = {"DATE", "TIMESTAMP", "TIMESTAMP_NTZ", "BINARY"}


def spark_reads(spark: Any, pairs: list[tuple[str, str]]) -> list[bool]:
    """For each (type, JSON value): Spark's `from_json` of ``{"v": value}`` under
    ``v <type>`` gives a value with no null the JSON did not have (a struct's `a`, an
    array's elements)."""
    from pyspark.sql import functions as F

    rows = [(t, '{"v": ' + v + "}") for t, v in pairs]
    df = spark.createDataFrame(rows, "t string, data string")
    cols = []
    for t in TYPES:
        parsed = F.from_json("data", f"v {t}").getField("v")
        if t.startswith("STRUCT"):
            # the struct came, and its `a` did if the JSON had a non-null `a`
            raw_a = F.get_json_object("data", "$.v.a")
            ok = parsed.isNotNull() & (raw_a.isNull() | parsed.getField("a").isNotNull())
        elif t.startswith("ARRAY"):
            # as many null elements as the JSON array had (an element Spark could not read
            # is null, or the whole array is)
            as_text = F.from_json(F.get_json_object("data", "$.v"), "array<string>")
            ok = parsed.isNotNull() & (
                F.size(F.filter(parsed, lambda x: x.isNull()))
                == F.size(F.filter(as_text, lambda x: x.isNull()))
            )
        elif t.startswith("MAP"):
            as_text = F.from_json(F.get_json_object("data", "$.v"), "map<string, string>")
            ok = parsed.isNotNull() & (
                F.size(F.filter(F.map_values(parsed), lambda x: x.isNull()))
                == F.size(F.filter(F.map_values(as_text), lambda x: x.isNull()))
            )
        else:
            ok = parsed.isNotNull()
        cols.append(F.when(F.col("t") == t, ok))
    out = df.select(F.coalesce(*cols).alias("ok")).collect()
    return [bool(r.ok) for r in out]


def test_the_check_accepts_what_spark_reads_and_refuses_what_spark_nulls(spark: Any) -> None:
    pairs = [(t, v) for t in TYPES for v in VALUES]
    read = spark_reads(spark, pairs)
    accepted_but_null, refused_but_read = [], []
    for (t, v), spark_ok in zip(pairs, read, strict=True):
        if t in SPARK_PARSES_STRINGS and v.startswith('"'):
            continue  # Spark's own parser decides (the module's notes)
        ours = EventSchema(f"v {t}").problem(b'{"v": ' + v.encode() + b"}") is None
        if ours and not spark_ok:
            accepted_but_null.append((t, v))
        if spark_ok and not ours and (t, v) not in SPARK_LENIENT:
            refused_but_read.append((t, v))
    assert accepted_but_null == []
    assert refused_but_read == []
    # and the check is not vacuous: it refuses a good share, and accepts a good share
    refused = sum(
        EventSchema(f"v {t}").problem(b'{"v": ' + v.encode() + b"}") is not None for t, v in pairs
    )
    assert len(pairs) * 0.3 < refused < len(pairs) * 0.9


@pytest.mark.parametrize(
    ("ddl", "names"),
    [
        ("auction BIGINT, price DOUBLE", ["auction", "price"]),
        ("a: INT, b: STRING", ["a", "b"]),
        ("struct<a:int,b:array<string>>", ["a", "b"]),
        ("`we ird, name` STRING COMMENT 'a, b', n INT NOT NULL", ["we ird, name", "n"]),
        ("v VOID, y INTERVAL YEAR, m MAP<STRING, STRUCT<x: INT, y: INT>>, z INT", None),
        ("d DECIMAL(10, 2), t TIMESTAMP_NTZ, `q``x` INT", ["d", "t", "q`x"]),
    ],
)
def test_schema_fields_are_the_fields_spark_reads(
    spark: Any, ddl: str, names: list[str] | None
) -> None:
    from pyspark.sql.types import _parse_datatype_string

    spark_names = [f.name for f in _parse_datatype_string(ddl).fields]
    assert [name for name, _ in schema_fields(ddl)] == spark_names
    if names is not None:
        assert spark_names == names


def test_a_type_sqlglot_cannot_read_takes_anything_and_the_rest_are_checked() -> None:
    schema = EventSchema("v VOID, n INT")
    assert schema.problem(b'{"v": {"any": [1]}, "n": 1}') is None
    assert schema.problem(b'{"v": 1, "n": "1"}') == '`$.n` must be INT, got the string "1"'


@pytest.mark.parametrize(
    ("ddl", "message"),
    [
        ("", "no fields"),
        ("  ", "no fields"),
        ("a INT, a STRING", "field 'a' is declared twice"),
        ("a", "'a' is not a field: a name, then a Spark type"),
    ],
)
def test_schema_that_is_no_field_list_is_refused(ddl: str, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        schema_fields(ddl)


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b'{"price": "12.5"}', '`$.price` must be DOUBLE, got the string "12.5"'),
        (b'{"auction": 1.0}', "`$.auction` must be BIGINT, got the number 1.0"),
        (b'{"n": 2147483648}', "`$.n` must be INT, got the number 2147483648, out of INT's range"),
        (b'{"ok": 1}', "`$.ok` must be BOOLEAN, got the number 1"),
        (b'{"at": true}', "`$.at` must be TIMESTAMP, got true"),
        (b'{"tags": [1, "a"]}', '`$.tags[1]` must be INT, got the string "a"'),
        (b'{"price": {"x": 1}}', "`$.price` must be DOUBLE, got an object"),
        (b'{"cost": 999.995}', "`$.cost` must be DECIMAL(5, 2), got 999.995, which it cannot hold"),
        (b'{"cost": "NaN"}', "`$.cost` must be DECIMAL(5, 2), got NaN, which it cannot hold"),
        (b'{"who": {"age": "9"}}', '`$.who.age` must be INT, got the string "9"'),
        (b'{"who": [1]}', "`$.who` must be STRUCT<age: INT>, got an array"),
        (b'{"price": 1, "auction": -3, "cost": "1.5", "tags": null, "extra": [1]}', None),
        (b'{"at": "2024-01-02", "who": {}, "ok": false, "price": "NaN"}', None),
    ],
)
def test_a_refusal_names_the_field_its_type_and_what_came(raw: bytes, problem: str | None) -> None:
    schema = EventSchema(
        "auction BIGINT, price DOUBLE, n INT, ok BOOLEAN, at TIMESTAMP, "
        "tags ARRAY<INT>, cost DECIMAL(5,2), who STRUCT<age: INT>"
    )
    assert schema.problem(raw) == problem


def test_config_refuses_a_schema_that_is_no_field_list_and_an_event_time_outside_it() -> None:
    def load(stream: dict[str, Any]) -> Any:
        return load_config(environ={}, overrides={"streams": {"bid": stream}})

    with pytest.raises(ConfigError, match=r"streams\.bid\.schema: field 'a' is declared twice"):
        load({"subjects": ["raw.bid"], "schema": "a INT, a BIGINT"})
    with pytest.raises(ConfigError, match=r"streams\.bid\.event_time: 't': name a top-level field"):
        load({"subjects": ["raw.bid"], "schema": "at BIGINT", "event_time": "t"})
    cfg = load({"subjects": ["raw.bid"], "schema": "`t` BIGINT, x VOID", "event_time": "t"})
    assert cfg.streams["bid"].event_time == "t"
