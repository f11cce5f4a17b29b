"""Consumer filters: SELECT projection over the existing WHERE compiler, positions in errors."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.data.query import MATCH_ALL, FilterError, compile_filter, compile_named

pytestmark = pytest.mark.unit

RSVP = {
    "response": "yes",
    "guests": 2,
    "group": {"group_city": "Paris", "group_topics": [{"topic_name": "Python"}]},
    "member": {"member_name": "Ada"},
}


def test_empty_and_star_keep_everything() -> None:
    for text in ["", "   ", "SELECT *"]:
        f = compile_filter(text)
        assert f.matches(RSVP) and f.select(RSVP) is RSVP
    assert compile_filter("") is MATCH_ALL


@pytest.mark.parametrize(
    ("text", "keeps"),
    [
        ("WHERE response = 'yes'", True),
        ("response = 'no'", False),  # a bare condition is a WHERE clause
        ("SELECT * WHERE guests > 1 AND group.group_city = 'Paris'", True),
        ("SELECT * WHERE missing = 1", False),  # NULL is not true
        ("SELECT * WHERE NOT missing = 1", False),  # NOT NULL is still NULL
        ("SELECT * WHERE missing IS NULL", True),
        ("WHERE _subject = 'raw.meetup'", True),
        ("WHERE _subject IN ('results.a', 'results.b')", False),
    ],
)
def test_where(text: str, keeps: bool) -> None:
    assert compile_filter(text).matches(RSVP, "raw.meetup") is keeps


def test_projection_keeps_the_shape_and_names_aliases() -> None:
    f = compile_filter("SELECT group.group_city, response AS r, nope.x WHERE guests >= 2")
    assert f.select(RSVP) == {"group": {"group_city": "Paris"}, "r": "yes", "nope": {"x": None}}
    both = compile_filter("SELECT *, _subject")
    out = both.select(RSVP, "raw.meetup")
    assert out == {**RSVP, "_subject": "raw.meetup"}
    assert "_subject" not in RSVP


def test_projection_never_changes_the_event() -> None:
    before = copy.deepcopy(RSVP)
    f = compile_filter("SELECT *, group.group_city, member.member_name AS who")
    out = f.select(RSVP)
    out["group"]["group_city"] = "changed"
    assert before == RSVP


def test_subject_only_when_named() -> None:
    assert not compile_filter("SELECT a WHERE b = 1").uses_subject
    assert compile_filter("SELECT _subject").uses_subject
    assert compile_filter("WHERE _subject = 'x'").uses_subject
    # non-object payloads: fields are NULL, the subject still works
    assert compile_filter("WHERE _subject = 'x'").matches("text", "x")
    assert not compile_filter("WHERE a = 1").matches([1, 2], "x")


@pytest.mark.parametrize(
    ("text", "line", "column", "words"),
    [
        ("SELECT a WHERE", 1, 14, "cannot parse"),
        ("SELECT a\nWHERE b = = 1", 2, 11, "cannot parse"),
        ("SELECT a WHERE x = 'abc", 1, 20, "unterminated quote"),
        ("SELECT count(a)", 1, 8, "functions are not supported"),
        ("SELECT a FROM t", 1, 10, "FROM is not supported"),
        ("SELECT a WHERE b = 1 ORDER BY a", 1, 22, "ORDER BY is not supported"),
        ("SELECT a LIMIT 3", 1, 10, "LIMIT is not supported"),
        ("SELECT DISTINCT a", 1, 8, "DISTINCT is not supported"),
        ("SELECT a WHERE x LIKE y", 1, 18, "LIKE needs a quoted pattern"),
        ("SELECT\n  a,\n  b\nWHERE c + 1 = 2", 4, 7, "unsupported syntax ADD"),
        ("SELECT a, a.b", 1, 8, "overlap"),
        ("WHERE", 1, 6, "needs a condition"),
        ("x", 1, 1, "expected a comparison"),
    ],
)
def test_errors_name_reason_and_position(text: str, line: int, column: int, words: str) -> None:
    with pytest.raises(FilterError) as info:
        compile_filter(text)
    err = info.value
    assert (err.line, err.column) == (line, column), err.reason
    assert words in err.reason
    assert f"line {line}, column {column}" in err.reason
    assert err.to_dict() == {"reason": err.reason, "line": line, "column": column}


def test_where_positions_are_in_the_whole_query_not_the_clause() -> None:
    with pytest.raises(FilterError) as info:
        compile_filter("SELECT group.group_city, response\nWHERE guests > 1 AND city ~ 'x'")
    assert (info.value.line, info.value.column) == (2, 27)


def test_named_filters_compile_up_front() -> None:
    named = compile_named({"yes": "WHERE response = 'yes'", "cities": "SELECT group.group_city"})
    assert named["yes"].matches(RSVP) and named["cities"].select(RSVP) == {
        "group": {"group_city": "Paris"}
    }
    with pytest.raises(FilterError, match="named filter 'bad'"):
        compile_named({"bad": "SELECT a WHERE"})


def test_one_filter_per_text() -> None:
    assert compile_filter("WHERE a = 1") is compile_filter("WHERE a = 1")


def test_too_long_or_not_text() -> None:
    with pytest.raises(FilterError, match="at most"):
        compile_filter("WHERE a = 1 OR " * 400 + "a = 2")
    with pytest.raises(FilterError, match="string"):
        compile_filter(3)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("SELECT WHERE *,.()'\"=<>!aAbB01_\n")), max_size=40))
def test_any_text_compiles_or_raises_filter_error(text: str) -> None:
    """Whatever a client sends, the answer is a Filter or a FilterError with a position."""
    try:
        f = compile_filter(text)
    except FilterError as err:
        assert err.line >= 1 and err.column >= 1 and err.reason
        return
    f.matches(RSVP, "s")
    f.select(RSVP, "s")


@pytest.mark.parametrize(
    ("where", "data", "keeps"),
    [
        ("key LIKE 'top.%'", {"key": "top.a"}, True),
        ("key LIKE 'top.%'", {"key": "topx.a"}, False),
        ("key LIKE 'to_.a'", {"key": "top.a"}, True),
        ("key LIKE 'a.b'", {"key": "aXb"}, False),  # a dot is a dot, not any character
        ("key LIKE '%'", {"key": 7}, False),  # not a string: NULL, not kept
        ("key LIKE '%'", {}, False),
        ("NOT key LIKE 'x%'", {"key": "y"}, True),
        ("key NOT LIKE 'x%'", {"key": "xy"}, False),
        ("key NOT LIKE 'x%'", {"key": "yx"}, True),
        ("key NOT LIKE 'x%'", {}, False),
    ],
)
def test_like_matches_a_quoted_pattern_against_strings(where: str, data: dict, keeps: bool) -> None:
    assert compile_filter(f"WHERE {where}").matches(data, "s") is keeps


def test_like_needs_a_quoted_pattern() -> None:
    with pytest.raises(FilterError, match="quoted pattern"):
        compile_filter("WHERE key LIKE other")
