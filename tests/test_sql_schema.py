"""A stream without a declared schema gets one inferred from its newest events: no event a
producer sends may make that schema unusable. Real nats-server and Spark."""

from __future__ import annotations

import json
from typing import Any

import pytest

from jobs.sql import (
    StreamTable,
    json_result,
    representable,
    run_sql,
    stream_events,
    table_frame,
)
from runtime.nats.server import NatsEndpoint
from tests.support import with_nats
from tests.test_jetstream_source import add_stream, nats_url, publish, sp

# nats_url and sp are test_jetstream_source's module fixtures, imported so pytest finds them
__all__ = ["nats_url", "sp"]

pytestmark = pytest.mark.timeout(300)

ODD = "odd-events"
N = 200
# names no unquoted DDL can carry, nested; names that differ only in case, nested too
ODD_EVENTS = [
    {"n": 1000, "x": {"a,b": 1, "c d": "", "e>f": "", "g:h": "", "`q`": ""}},
    {"n": 1001, "Item": 1, "item": 2, "x": {"Deep": 1, "deep": 2}},
    {"n": 1002, "x": {"a": 7, "": "empty name", "y": {"z<w>": [1, 2]}}},
]


@pytest.fixture(scope="module")
def odd_stream(nats_url: str) -> dict[str, Any]:
    """`odd-events`: N plain events, then the odd ones, all among the newest 1,000."""
    add_stream(nats_url, ODD, [f"raw.{ODD}"])
    plain = [{"n": i, "x": {"a": i % 7}} for i in range(N)]
    msgs = [(f"raw.{ODD}", json.dumps(e).encode(), f"e-{e['n']}") for e in plain + ODD_EVENTS]
    with_nats(lambda nc: publish(nc, msgs), nats_url)
    return {"events": plain + ODD_EVENTS, "tables": {ODD: StreamTable(ODD)}}


def test_odd_field_names_at_any_depth_leave_sql_working(
    sp: Any, nats_url: str, odd_stream: dict[str, Any]
) -> None:
    events = odd_stream["events"]
    r = run_sql(
        sp,
        NatsEndpoint(nats_url),
        f"SELECT count(*) AS c, sum(n) AS s, sum(x.a) AS a FROM `{ODD}`",
        odd_stream["tables"],
    )
    want_a = sum(e["x"].get("a", 0) for e in events if isinstance(e["x"].get("a"), int))
    assert r.rows == [(len(events), sum(e["n"] for e in events), want_a)]


def test_nested_odd_names_are_readable_by_their_quoted_names(
    sp: Any, nats_url: str, odd_stream: dict[str, Any]
) -> None:
    r = run_sql(
        sp,
        NatsEndpoint(nats_url),
        f"SELECT x.`a,b` AS ab, x.`e>f` AS ef, x.y.`z<w>` AS zw FROM `{ODD}` "
        "WHERE n >= 1000 ORDER BY n",
        odd_stream["tables"],
    )
    assert r.rows == [(1, "", None), (None, None, None), (None, None, [1, 2])]


def test_names_differing_only_in_case_are_left_out_with_a_note(
    sp: Any, nats_url: str, odd_stream: dict[str, Any]
) -> None:
    notes: list[str] = []
    spec = odd_stream["tables"][ODD]
    frame = table_frame(stream_events(sp, NatsEndpoint(nats_url), spec), notes=notes)
    assert "Item" not in frame.columns and "item" not in frame.columns
    assert "n" in frame.columns and "x" in frame.columns
    nested = frame.schema["x"].dataType.fieldNames()
    assert "Deep" not in nested and "deep" not in nested and "" not in nested
    assert "a,b" in nested and "y" in nested
    text = " ".join(notes)
    assert "Item" in text and "item" in text and "x.Deep" in text and "case" in text
    answer = run_sql(sp, NatsEndpoint(nats_url), f"SELECT count(*) FROM `{ODD}`", {ODD: spec})
    assert answer.notes and all(n.startswith(f"{ODD}: ") for n in answer.notes)
    assert json_result(answer)["notes"] == answer.notes


@pytest.mark.unit
def test_representable_leaves_out_what_no_query_can_name_at_every_depth() -> None:
    from pyspark.sql.types import (
        ArrayType,
        LongType,
        MapType,
        StringType,
        StructField,
        StructType,
    )

    def struct(*names: str, inner: Any = None) -> StructType:
        return StructType([StructField(n, inner or LongType()) for n in names])

    schema = StructType(
        [
            StructField("_corrupt_record", StringType()),
            StructField("_seq", LongType()),
            StructField("", LongType()),
            StructField("ok", LongType()),
            StructField("list", ArrayType(struct("A", "a", "b c"))),
            StructField("map", MapType(StringType(), struct("", "k"))),
            StructField("deep", struct("s", inner=struct("Z", "z", "y"))),
        ]
    )
    kept, notes = representable(schema, top=True)
    assert kept.fieldNames() == ["ok", "list", "map", "deep"]
    assert kept["list"].dataType.elementType.fieldNames() == ["b c"]
    assert kept["map"].dataType.valueType.fieldNames() == ["k"]
    assert kept["deep"].dataType["s"].dataType.fieldNames() == ["y"]
    text = "\n".join(notes)
    assert "_seq" in text and "list[].A and list[].a" in text and "deep.s.Z" in text
    assert text.count("empty name") == 2
