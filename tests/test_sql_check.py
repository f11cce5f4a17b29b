"""runtime/data/sql_check.py: one read-only query over named streams passes; everything that could
read files, call Java, run a command or change state is refused with a reason."""

from __future__ import annotations

import pytest
import sqlglot
from hypothesis import given
from hypothesis import strategies as st

from runtime.data.sql_check import MAX_SQL_CHARS, SqlRefused, check_select

pytestmark = pytest.mark.unit

KNOWN = ["meetup", "results", "My-Stream", "flights"]


@pytest.mark.parametrize(
    ("sql", "tables"),
    [
        ("SELECT a, count(*) AS n FROM meetup GROUP BY a ORDER BY n DESC LIMIT 5", {"meetup"}),
        ("select * from MEETUP", {"meetup"}),
        ("SELECT * FROM `my-stream` m JOIN results r ON m.id = r.id", {"My-Stream", "results"}),
        ("WITH x AS (SELECT id FROM flights) SELECT count(*) FROM x", {"flights"}),
        ("SELECT * FROM meetup WHERE id IN (SELECT id FROM results)", {"meetup", "results"}),
        ("(SELECT id FROM meetup) UNION ALL (SELECT id FROM flights)", {"meetup", "flights"}),
        ("SELECT window(ts, '1 minute'), count(*) FROM meetup GROUP BY 1", {"meetup"}),
        ("SELECT * FROM meetup LATERAL VIEW explode(tags) t AS tag", {"meetup"}),
        ("SELECT 1;", set()),
    ],
)
def test_one_read_only_query_passes_with_the_tables_it_reads(sql: str, tables: set[str]) -> None:
    checked = check_select(sql, KNOWN)
    assert checked.tables == tables
    # what runs is sqlglot's rendering of the checked tree, and it checks the same again
    assert check_select(checked.sql, KNOWN).tables == tables


@pytest.mark.parametrize(
    ("sql", "reason"),
    [
        ("", "empty"),
        ("   ;  ", "empty"),
        ("SELEC 1", "not valid SQL"),
        ("SELECT 1; SELECT 2", "one statement only"),
        ("SELECT 1 FROM meetup; DROP TABLE meetup", "one statement only"),
        ("INSERT INTO meetup SELECT 1", "not INSERT"),
        ("CREATE TABLE x AS SELECT * FROM meetup", "not CREATE"),
        ("DROP TABLE meetup", "not DROP"),
        ("SET spark.sql.x=1", "not SET"),
        ("CACHE TABLE meetup", "not CACHE"),
        ("ADD JAR /tmp/x.jar", "not COMMAND"),
        ("DESCRIBE meetup", "not DESCRIBE"),
        ("VALUES (1)", "not VALUES"),
        ("SELECT * FROM json.`/etc/passwd`", "without a qualifier"),
        ("SELECT * FROM parquet.`s3://bucket/x`", "without a qualifier"),
        ("SELECT * FROM spark_catalog.default.meetup", "without a qualifier"),
        ("SELECT * FROM range(10)", "table functions"),
        ("SELECT * FROM read_files('/etc')", "table functions"),
        ("SELECT reflect('java.lang.System', 'getenv')", "reflect() is not allowed"),
        ("SELECT upper(java_method('java.lang.System', 'exit', 1))", "java_method()"),
        ("SELECT TRY_REFLECT('a', 'b') FROM meetup", "try_reflect()"),
        ("SELECT TRANSFORM(a) USING 'cat /etc/passwd' FROM meetup", "QUERYTRANSFORM"),
        ("SELECT * FROM nope", "unknown table 'nope'"),
        ("SELECT * FROM meetup WHERE id IN (SELECT id FROM secret)", "unknown table 'secret'"),
    ],
)
def test_anything_else_is_refused_with_a_reason(sql: str, reason: str) -> None:
    with pytest.raises(SqlRefused, match=reason.replace("(", r"\(").replace(")", r"\)")):
        check_select(sql, KNOWN)


def test_the_unknown_table_reason_lists_the_tables_there_are() -> None:
    with pytest.raises(SqlRefused) as info:
        check_select("SELECT * FROM x", ["b", "a"])
    assert str(info.value).endswith("the tables are: a, b")


def test_a_query_over_the_length_limit_is_refused() -> None:
    pad = " " * MAX_SQL_CHARS
    with pytest.raises(SqlRefused, match="longer than"):
        check_select(f"SELECT 1 FROM meetup{pad}WHERE 1 = 1", KNOWN)


@given(st.text(max_size=200))
def test_any_text_is_either_refused_or_a_single_query(text: str) -> None:
    """Whatever a client sends, the check answers SqlRefused or passes a lone query whose
    tables are all known: never another exception, never an unknown table."""
    try:
        checked = check_select(text, KNOWN)
    except SqlRefused:
        return
    assert checked.tables <= set(KNOWN)
    assert len(sqlglot.parse(checked.sql, read="spark")) == 1
