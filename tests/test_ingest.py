"""The Collector's pure request path: parsing, ids, stream logic, group commit."""

from __future__ import annotations

import asyncio
import itertools
import json
import pickle
import sys
import textwrap
import tomllib
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.collection.group_commit import GroupCommitPolicy, GroupCommitter, Overloaded
from actors.collection.parsing import MAX_ID_CHARS, BadInput, assign_ids, parse_body
from runtime.config import ConfigError
from runtime.data.events import Event
from runtime.data.logic import LogicConfig, StreamLogic, compile_logic, dead_letters
from runtime.data.query import compile_where
from runtime.waiting import await_until
from tests.strategies import json_value

pytestmark = pytest.mark.unit

JSON = "application/json"
NDJSON = "application/x-ndjson"


def parse(ct: str | None, body: bytes, max_events: int = 10, max_event_bytes: int = 1000) -> Any:
    return parse_body(ct, body, max_events=max_events, max_event_bytes=max_event_bytes)


# --------------------------------------------------------------------------- parse_body


@pytest.mark.parametrize(
    ("ct", "body", "expected"),
    [
        (JSON, b'{"a": 1}', [{"a": 1}]),
        ("application/json; charset=UTF-8", b' [{"a":1}, {"b":[2]}] ', [{"a": 1}, {"b": [2]}]),
        ('Application/JSON;charset="utf-8"', b'{"a":"\xc3\xa9"}', [{"a": "é"}]),
        (JSON, b'\xef\xbb\xbf{"a":1}', [{"a": 1}]),
        (NDJSON, b'{"a":1}\n\n  \n{"b":2}\r\n', [{"a": 1}, {"b": 2}]),
        ("application/jsonl", b'{"a":1}', [{"a": 1}]),
        ("application/x-ndjson; charset=utf-8", b'{"a":1}\n{"a":2}', [{"a": 1}, {"a": 2}]),
    ],
)
def test_parse_accepts(ct: str, body: bytes, expected: list[dict[str, Any]]) -> None:
    assert parse(ct, body) == expected


@pytest.mark.parametrize(
    ("ct", "body", "status", "reason"),
    [
        ("text/plain", b"{}", 415, "unsupported Content-Type 'text/plain'"),
        ("application/x-www-form-urlencoded", b"a=1", 415, "unsupported Content-Type"),
        (None, b"{}", 415, "missing Content-Type"),
        ("", b"{}", 415, "missing Content-Type"),
        ("application/json; charset=latin-1", b"{}", 415, "unsupported charset 'latin-1'"),
        (JSON, b"", 400, "empty body"),
        (JSON, b" \r\n\t", 400, "empty body"),
        (NDJSON, b"\n\n", 400, "empty body"),
        (JSON, b'{"a":"\xff"}', 400, "invalid UTF-8 at byte 6"),
        (JSON, b'[{"a":1}, {"b":"\xc3"}]', 400, "invalid UTF-8 at byte 16"),
        (NDJSON, b'{"a":1}\n{"b":"\xed\xa0\x80"}', 400, "invalid UTF-8 at byte 14"),
        (JSON, b'{"a":1,\n "b": }', 400, "malformed JSON at line 2, column 7: invalid character"),
        (JSON, b'{"a":1', 400, "malformed JSON at line 1, column 7: input data was truncated"),
        (JSON, b'{"a":1} {"b":2}', 400, "malformed JSON at line 1, column 9: trailing characters"),
        (JSON, b'[{"a":1},\n {"b":}]', 400, "malformed JSON at line 2, column 7"),
        (NDJSON, b'{"a":1}\n\n{"b":}\n', 400, "malformed JSON at line 3, column 6"),
        (JSON, b"[" * 10_000, 400, "line 1, column 514: nested deeper than 512 levels"),
        (JSON, b'"x"', 400, "body must be a JSON object or an array of objects, got string"),
        (JSON, b"[]", 400, "empty array: no events"),
        (JSON, b'[{"a":1}, 3]', 400, "item 1 is not a JSON object, got number"),
        (JSON, b'[{"a":1}, null]', 400, "item 1 is not a JSON object, got null"),
        (NDJSON, b'{"a":1}\n\n[1]', 400, "line 3 is not a JSON object, got array"),
        (JSON, b"[" + b"{}," * 10 + b"{}]", 413, "too many events: 11 > max 10"),
        (NDJSON, b"{}\n" * 11, 413, "too many events: 11 > max 10"),
        (JSON, b'{"a":"' + b"x" * 1000 + b'"}', 413, "event is 1008 bytes > max 1000"),
        (JSON, b'[{}, {"a":"' + b"x" * 1000 + b'"}]', 413, "item 1 is 1008 bytes > max 1000"),
        (NDJSON, b'{}\n{"a":"' + b"x" * 1000 + b'"}', 413, "line 2 is 1008 bytes > max 1000"),
    ],
)
def test_parse_refuses(ct: str | None, body: bytes, status: int, reason: str) -> None:
    with pytest.raises(BadInput) as info:
        parse(ct, body)
    assert info.value.status == status
    assert reason in info.value.reason, info.value.reason


def test_parse_counts_limits_exactly() -> None:
    body = b"[" + b",".join([b"{}"] * 10) + b"]"
    assert len(parse(JSON, body, max_events=10)) == 10
    item = b'{"a":"' + b"x" * 992 + b'"}'  # exactly 1000 bytes
    assert parse(JSON, item) == [{"a": "x" * 992}]
    assert parse(NDJSON, item + b"\n" + item) == [{"a": "x" * 992}] * 2


json_object = st.dictionaries(st.text(max_size=8), json_value, max_size=5)
content_types = st.one_of(
    st.sampled_from(
        [
            JSON,
            NDJSON,
            "application/jsonl",
            "application/json; charset=utf-8",
            "application/json; charset=latin-1",
            "text/plain",
            "",
        ]
    ),
    st.none(),
    st.text(max_size=30),
)


def _mutations(data: bytes) -> st.SearchStrategy[bytes]:
    """Bodies near a valid one: cut, spliced with random bytes."""
    return st.tuples(st.integers(0, len(data)), st.binary(max_size=4), st.integers(0, 3)).map(
        lambda t: data[: t[0]] + t[1] + data[t[0] + t[2] :]
    )


bodies = st.one_of(
    st.binary(max_size=200),
    st.lists(json_value, max_size=4).map(lambda v: json.dumps(v, ensure_ascii=False).encode()),
    json_object.map(lambda v: json.dumps(v, ensure_ascii=False).encode()).flatmap(_mutations),
    st.lists(json_object, max_size=4)
    .map(lambda vs: "\n".join(json.dumps(v) for v in vs).encode())
    .flatmap(_mutations),
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ct=content_types,
    body=bodies,
    max_events=st.integers(1, 5),
    max_event_bytes=st.integers(1, 300),
)
def test_parse_fuzz_returns_dicts_or_bad_input(
    ct: str | None, body: bytes, max_events: int, max_event_bytes: int
) -> None:
    try:
        out = parse_body(ct, body, max_events=max_events, max_event_bytes=max_event_bytes)
    except BadInput as err:
        assert err.status in (400, 413, 415)
        assert err.reason
        return
    assert isinstance(out, list) and 1 <= len(out) <= max_events
    assert all(isinstance(item, dict) for item in out)
    body.decode("utf-8")  # whatever is accepted is valid UTF-8 (msgspec checks strings)


@settings(max_examples=300, deadline=None)
@given(
    objects=st.lists(json_object, min_size=1, max_size=8),
    ascii_only=st.booleans(),
    indent=st.sampled_from([None, 2]),
    eol=st.sampled_from(["\n", "\r\n"]),
    blank_every=st.integers(0, 3),
)
def test_parse_round_trip_array_ndjson_single(
    objects: list[dict[str, Any]], ascii_only: bool, indent: int | None, eol: str, blank_every: int
) -> None:
    big = {"max_events": 100, "max_event_bytes": 1 << 20}
    array = json.dumps(objects, ensure_ascii=ascii_only, indent=indent).encode()
    lines: list[str] = []
    for i, obj in enumerate(objects):
        lines.append(json.dumps(obj, ensure_ascii=ascii_only))
        if blank_every and i % blank_every == 0:
            lines.append("  ")
    ndjson = eol.join(lines).encode()
    assert parse_body(JSON, array, **big) == objects
    assert parse_body(NDJSON, ndjson, **big) == objects
    single = json.dumps(objects[0], ensure_ascii=ascii_only, indent=indent).encode()
    assert parse_body(JSON, single, **big) == objects[:1]


# --------------------------------------------------------------------------- assign_ids


def test_assign_ids_keeps_producer_ids_and_generates_the_rest() -> None:
    items = [{"id": "rsvp-1", "a": 1}, {"id": 42}, {"a": 2}, {"a": 3, "id": None}]
    events = assign_ids(items, "meetup", "raw.meetup", now_ms=1234, token="tok")
    assert [e.id for e in events[:2]] == ["rsvp-1", "42"]
    generated = [events[2].id, events[3].id]
    assert len(set(generated)) == 2 and all(len(g) == 36 for g in generated)
    assert generated == sorted(generated)  # time-ordered
    for event, item in zip(events, items, strict=True):
        assert (event.stream, event.subject, event.received_ms, event.token) == (
            "meetup",
            "raw.meetup",
            1234,
            "tok",
        )
        assert event.processed is False
        data = msgspec.json.decode(event.data)
        assert {k: v for k, v in data.items() if k != "id"} == {
            k: v for k, v in item.items() if k != "id"
        }
    assert msgspec.json.decode(events[1].data)["id"] == 42  # the producer's value is untouched
    assert list(msgspec.json.decode(events[2].data)) == ["id", "a"]  # generated id comes first
    assert msgspec.json.decode(events[2].data)["id"] == events[2].id
    assert msgspec.json.decode(events[3].data)["id"] == events[3].id
    assert "id" not in items[2] and items[3]["id"] is None  # the caller's dicts are not changed


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ([1], "got array"),
        ({"x": 1}, "got object"),
        (True, "got boolean"),
        (False, "got boolean"),
        ("", "got an empty string"),
        ("has space", "printable ASCII"),
        ("new\r\nline", "printable ASCII"),
        ("é", "printable ASCII"),
        ("x" * (MAX_ID_CHARS + 1), "printable ASCII"),
        (10**MAX_ID_CHARS, "got number"),
        (1.5, "got number"),
    ],
)
def test_assign_ids_refuses_bad_ids_naming_the_index(bad: Any, reason: str) -> None:
    with pytest.raises(BadInput) as info:
        assign_ids([{"id": "ok"}, {"a": 1}, {"id": bad}], "s", "raw.s", 0)
    assert info.value.status == 400
    assert "event at index 2" in info.value.reason and reason in info.value.reason


def test_assign_ids_accepts_the_longest_id() -> None:
    longest = "x" * MAX_ID_CHARS
    assert assign_ids([{"id": longest}], "s", "raw.s", 0)[0].id == longest


# --------------------------------------------------------------------------- logic


@pytest.fixture(scope="module")
def hooks_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A user's hook module on sys.path, as a deployment would install it."""
    root = tmp_path_factory.mktemp("hooks")
    name = "tierflow_test_hooks"
    (root / f"{name}.py").write_text(
        textwrap.dedent(
            """
            def check(data):
                if data.get("guests", 0) > 10:
                    return "too many guests"
                return None

            def strict(data):
                return data.get("ok") is True

            def explode(data):
                raise RuntimeError("boom")

            def add_geo(data):
                return {**data, "geo": data.get("city", "?").upper()}

            def tag(data):
                data["tagged"] = True

            def wrong(data):
                return 42

            def keep_even(data):
                return data.get("n", 1) % 2 == 0

            class Nested:
                @staticmethod
                def hook(data):
                    return None

            NOT_CALLABLE = 3
            """
        )
    )
    sys.path.insert(0, str(root))
    yield name
    sys.path.remove(str(root))
    sys.modules.pop(name, None)


def ev(data: dict[str, Any], id: str = "e1", subject: str = "raw.meetup") -> Event:
    return Event(id, "meetup", subject, msgspec.json.encode(data), 1000)


def logic(**kwargs: Any) -> StreamLogic:
    return compile_logic("meetup", LogicConfig(**kwargs), "raw.meetup", collector="c-1")


def body(event: Event) -> dict[str, Any]:
    return msgspec.json.decode(event.data)


def test_logic_config_from_toml_is_strict() -> None:
    text = textwrap.dedent(
        """
        [streams.meetup.logic]
        validate = { response = "str", guests = "int", group.group_city = "str" }
        enrich = ["received_at", "collector"]
        filter = "response = 'yes' AND guests >= 0"
        route = "raw.meetup.{group.group_country}"
        """
    )
    table = tomllib.loads(text)["streams"]["meetup"]["logic"]
    cfg = msgspec.convert(table, LogicConfig)
    assert cfg.validate == {"response": "str", "guests": "int", "group": {"group_city": "str"}}
    lg = compile_logic("meetup", cfg, "raw.meetup")
    ok = ev({"response": "yes", "guests": 0, "group": {"group_city": "A", "group_country": "nl"}})
    bad = ev({"response": "yes", "guests": 0, "group": {}}, id="e2")
    result = lg.apply([ok, bad])
    assert [e.subject for e in result.kept] == ["raw.meetup.nl"]
    assert result.invalid == [(bad, "missing field group.group_city")]
    with pytest.raises(msgspec.ValidationError, match="unknown field `filtr`"):
        msgspec.convert({"filtr": "a = 1"}, LogicConfig)


def test_no_logic_marks_processed_without_touching_data() -> None:
    lg = logic()
    raw = Event("e1", "meetup", "raw.meetup", b'{ "a" : 1 }', 5)  # bytes kept verbatim
    own = Event("e2", "meetup", "raw.meetup.custom", b"{}", 5)
    result = lg.apply([raw, own])
    assert result.kept == [
        msgspec.structs.replace(raw, processed=True),
        msgspec.structs.replace(own, processed=True),
    ]
    assert result.dropped == [] and result.invalid == []


def test_processed_events_pass_through_unchanged() -> None:
    lg = logic(validate={"must": "str"}, route="x.{must}")
    done = msgspec.structs.replace(ev({}), processed=True)
    assert lg.apply([done]).kept == [done]


def test_validate_schema_types_and_optional_fields() -> None:
    lg = logic(
        validate={
            "s": "str",
            "i": "int",
            "f": "float",
            "b": "bool",
            "o": "object",
            "a": "array",
            "x": "any",
            "opt": "str?",
            "deep.er.path": "number",
        }
    )
    good = {
        "s": "x",
        "i": 1,
        "f": 2,
        "b": False,
        "o": {},
        "a": [],
        "x": 0,
        "deep": {"er": {"path": 1.5}},
    }
    assert len(lg.apply([ev(good)]).kept) == 1
    assert len(lg.apply([ev({**good, "opt": None})]).kept) == 1
    cases = {
        "missing field s": {k: v for k, v in good.items() if k != "s"},
        "field i: expected int, got boolean": {**good, "i": True},
        "field i: expected int, got number": {**good, "i": 1.0},
        "field f: expected float, got string": {**good, "f": "1"},
        "field opt: expected str, got number": {**good, "opt": 3},
        "missing field x": {**good, "x": None},
        "missing field deep.er.path": {**good, "deep": {"er": 5}},
    }
    for reason, data in cases.items():
        result = lg.apply([ev(data)])
        assert result.kept == [] and result.invalid == [(ev(data), reason)], reason
    both = {**good, "s": 1, "i": "2"}
    assert lg.apply([ev(both)]).invalid[0][1] == (
        "field s: expected str, got number; field i: expected int, got string"
    )


def test_validate_hook_reasons(hooks_module: str) -> None:
    lg = logic(validate_hook=f"{hooks_module}:check")
    fine, busy = ev({"guests": 1}), ev({"guests": 11}, id="e2")
    result = lg.apply([fine, busy])
    assert [e.id for e in result.kept] == ["e1"]
    assert result.invalid == [(busy, "too many guests")]
    strict = logic(validate_hook=f"{hooks_module}:strict")
    assert strict.apply([ev({"ok": False})]).invalid[0][1] == "rejected by validate_hook"
    boom = logic(validate_hook=f"{hooks_module}:explode")
    assert boom.apply([ev({})]).invalid[0][1] == "validate_hook raised RuntimeError: boom"


def test_data_that_is_not_an_object_is_invalid_not_raised() -> None:
    lg = logic(validate={"a": "int"})
    broken = Event("e1", "meetup", "raw.meetup", b"{not json", 0)
    array = Event("e2", "meetup", "raw.meetup", b"[1]", 0)
    result = lg.apply([broken, array])
    assert result.invalid[0][0] == broken and result.invalid[0][1].startswith("data is not JSON")
    assert result.invalid[1] == (array, "data is not a JSON object, got array")


def test_enrich_builtins_and_hooks(hooks_module: str) -> None:
    lg = logic(
        enrich=["received_at", "collector", f"{hooks_module}:add_geo", f"{hooks_module}:tag"]
    )
    (out,) = lg.apply([ev({"city": "ams", "collector": "spoofed"})]).kept
    assert body(out) == {
        "city": "ams",
        "collector": "c-1",
        "received_at": 1000,
        "geo": "AMS",
        "tagged": True,
    }
    assert out.processed and out.id == "e1"
    boom = logic(enrich=[f"{hooks_module}:explode"])
    assert boom.apply([ev({})]).invalid[0][1] == (
        f"enrich {hooks_module}:explode raised RuntimeError: boom"
    )
    wrong = logic(enrich=[f"{hooks_module}:wrong"])
    assert "returned int, expected dict or None" in wrong.apply([ev({})]).invalid[0][1]


def test_enrich_collector_name_defaults_to_host_and_pid() -> None:
    lg = compile_logic("meetup", LogicConfig(enrich=["collector"]), "raw.meetup")
    (out,) = lg.apply([ev({})]).kept
    assert body(out)["collector"].endswith(f":{__import__('os').getpid()}")


def test_filter_drops_and_keeps(hooks_module: str) -> None:
    lg = logic(filter="response = 'yes' AND guests >= 0")
    events = [
        ev({"response": "yes", "guests": 0}, id="keep"),
        ev({"response": "no", "guests": 0}, id="no"),
        ev({"response": "yes"}, id="missing"),
        ev({"response": "yes", "guests": -1}, id="neg"),
    ]
    result = lg.apply(events)
    assert [e.id for e in result.kept] == ["keep"]
    assert [e.id for e in result.dropped] == ["no", "missing", "neg"]
    assert result.dropped[0] == events[1]  # dropped as received
    hooked = logic(filter=f"{hooks_module}:keep_even")
    result = hooked.apply([ev({"n": 2}, id="a"), ev({"n": 3}, id="b")])
    assert [e.id for e in result.kept] == ["a"] and [e.id for e in result.dropped] == ["b"]
    boom = logic(filter=f"{hooks_module}:explode")
    assert boom.apply([ev({})]).invalid[0][1] == "filter raised RuntimeError: boom"


@pytest.mark.parametrize(
    ("clause", "data", "keep"),
    [
        ("a = 1", {"a": 1}, True),
        ("a = 1", {"a": 1.0}, True),
        ("a = 1", {"a": "1"}, False),
        ("a = 1", {"a": True}, False),
        ("a = TRUE", {"a": True}, True),
        ("a = 1", {}, False),
        ("a != 1", {"a": 2}, True),
        ("a <> 1", {"a": "x"}, True),
        ("a != 1", {}, False),
        ("a < 2", {"a": 1}, True),
        ("a <= 1", {"a": 1}, True),
        ("a > 1", {"a": 1}, False),
        ("a >= 1.5", {"a": 2}, True),
        ("a > -1", {"a": 0}, True),
        ("a > 'b'", {"a": "c"}, True),
        ("a > 1", {"a": "2"}, False),
        ("NOT a = 1", {"a": 2}, True),
        ("NOT a = 1", {}, False),
        ("NOT (a = 1 OR b = 2)", {"a": 3, "b": 3}, True),
        ("a = 1 OR b = 2", {"b": 2}, True),
        ("a = 1 AND b = 2", {"a": 1}, False),
        ("NOT (a = 1 AND b = 2)", {"a": 2}, True),
        ("a IN (1, 2, 'x')", {"a": "x"}, True),
        ("a IN (1, 2)", {"a": 3}, False),
        ("a NOT IN (1, 2)", {"a": 3}, True),
        ("a NOT IN (1, 2)", {}, False),
        ("a NOT IN (1, NULL)", {"a": 3}, False),
        ("a IS NULL", {}, True),
        ("a IS NULL", {"a": None}, True),
        ("a IS NULL", {"a": 0}, False),
        ("a IS NOT NULL", {"a": 0}, True),
        ("group.group_country = 'nl'", {"group": {"group_country": "nl"}}, True),
        ("group.group_country = 'nl'", {"group": "nl"}, False),
        ("a.b.c.d.e = 1", {"a": {"b": {"c": {"d": {"e": 1}}}}}, True),
        ('"select" = 1', {"select": 1}, True),
        ('"a.b" = 1', {"a.b": 1}, True),
        ("a = b", {"a": 1, "b": 1}, True),
    ],
)
def test_where_semantics(clause: str, data: dict[str, Any], keep: bool) -> None:
    assert compile_where(clause)(data) is keep


@pytest.mark.parametrize(
    ("clause", "message"),
    [
        ("a LIKE y", "LIKE needs a quoted pattern ('job.%') at line 1, column 3"),
        ("a = 1 AND b + 1 > 2", "unsupported syntax ADD at line 1, column 11"),
        ("x BETWEEN 1 AND 2", "unsupported syntax BETWEEN at line 1, column 3"),
        ("a = 1 AND\n  b LIKE y", "LIKE needs a quoted pattern ('job.%') at line 2, column 5"),
        ("a IS TRUE", "only IS NULL / IS NOT NULL are supported at line 1, column 3"),
        ("a", "expected a comparison (e.g. flag = TRUE) at line 1, column 1"),
        ("a = 0x10", "unexpected 'x10' at line 1, column 6"),
        ("a = ", "cannot parse 'a = ' at line 1, column 3"),
        ("a = 1 2", "cannot parse 'a = 1 2' at line 1, column 7"),
        ("(a = 1", "cannot parse '(a = 1' at line 1, column 6"),
        ("a = 1 AND b = 'open", "at line 1, column 15: unterminated quote"),
    ],
)
def test_where_compile_errors_name_the_position(clause: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        logic(filter=clause)
    assert str(info.value).startswith("streams.meetup.logic.filter: ")
    assert message in str(info.value), str(info.value)


def test_route_template_default_and_sanitising() -> None:
    lg = logic(route="raw.meetup.{group.group_country}.{kind}", route_default="none")
    events = [
        ev({"group": {"group_country": "nl"}, "kind": "rsvp"}, id="a"),
        ev({"group": {"group_country": "New York.*>"}, "kind": 7}, id="b"),
        ev({"kind": True}, id="c"),
        ev({"group": {"group_country": ""}, "kind": {"x": 1}}, id="d"),
        ev({"group": {"group_country": "x" * 500}, "kind": "k"}, id="e"),
    ]
    subjects = [e.subject for e in lg.apply(events).kept]
    assert subjects == [
        "raw.meetup.nl.rsvp",
        "raw.meetup.New_York___.7",
        "raw.meetup.none.true",
        "raw.meetup.none.none",
        "raw.meetup." + "x" * 128 + ".k",
    ]
    constant = logic(route="raw.meetup.all")
    assert constant.apply([ev({})]).kept[0].subject == "raw.meetup.all"


def test_logic_order_is_validate_enrich_filter_route(hooks_module: str) -> None:
    """The filter and the route see enriched fields; invalid events skip the rest."""
    lg = logic(
        validate={"city": "str"},
        enrich=[f"{hooks_module}:add_geo"],
        filter="geo != 'XX'",
        route="raw.meetup.{geo}",
    )
    result = lg.apply([ev({"city": "ams"}, id="a"), ev({"city": "xx"}, id="b"), ev({}, id="c")])
    assert [(e.id, e.subject, body(e)["geo"]) for e in result.kept] == [
        ("a", "raw.meetup.AMS", "AMS")
    ]
    assert [e.id for e in result.dropped] == ["b"]
    assert [(e.id, r) for e, r in result.invalid] == [("c", "missing field city")]


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"validate": {"a": "string"}}, "streams.meetup.logic.validate.a: expected one of"),
        ({"validate": {"a": {"b": 3}}}, "streams.meetup.logic.validate.a.b: expected one of"),
        ({"validate": {"a..b": "str"}}, "bad field path 'a..b'"),
        ({"validate_hook": "no_such_module_xyz:fn"}, "cannot import 'no_such_module_xyz'"),
        ({"validate_hook": "json:nope"}, "'json' has no attribute 'nope'"),
        ({"validate_hook": "not a hook"}, "expected 'module:function'"),
        ({"enrich": ["received_at", "geoip"]}, "enrich[1]: 'geoip' is neither a built-in"),
        ({"route": "raw.{a"}, "unbalanced braces"),
        ({"route": "raw..x"}, "does not make a subject"),
        ({"route": "raw.*"}, "does not make a subject"),
        ({"route": "raw.{}"}, "bad field path ''"),
        ({"route": "raw.{a}", "route_default": "a.b"}, "route_default: 'a.b' must be"),
    ],
)
def test_compile_logic_errors_name_the_key(cfg: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        logic(**cfg)
    assert message in str(info.value), str(info.value)


def test_hook_not_callable_and_nested_attribute(hooks_module: str) -> None:
    with pytest.raises(ConfigError, match="is not callable"):
        logic(validate_hook=f"{hooks_module}:NOT_CALLABLE")
    lg = logic(validate_hook=f"{hooks_module}:Nested.hook")
    assert len(lg.apply([ev({})]).kept) == 1


def test_stream_logic_pickles_by_recompiling() -> None:
    lg = logic(filter="a = 1", route="raw.meetup.{b}", enrich=["collector"])
    clone = pickle.loads(pickle.dumps(lg))
    events = [ev({"a": 1, "b": "x"}, id="k"), ev({"a": 2}, id="d")]
    assert clone.apply(events) == lg.apply(events)
    assert body(clone.apply(events).kept[0])["collector"] == "c-1"


def test_dead_letters_carry_reason_and_original() -> None:
    lg = logic(validate={"a": "int"})
    bad = ev({"a": "x", "n": [1]}, id="bad-1")
    broken = Event("bad-2", "meetup", "raw.meetup", b"{oops", 7)
    result = lg.apply([bad, broken])
    letters = dead_letters(result.invalid)
    assert [(e.id, e.subject, e.processed) for e in letters] == [
        ("bad-1", "deadletter.meetup", True),
        ("bad-2", "deadletter.meetup", True),
    ]
    first = body(letters[0])
    assert first["reason"] == "field a: expected int, got string"
    assert first["event"] == {"a": "x", "n": [1]} and first["stream"] == "meetup"
    assert body(letters[1])["event"] == "{oops"


# --------------------------------------------------------------------------- group commit


def test_policy_should_flush() -> None:
    p = GroupCommitPolicy(max_events=10, max_bytes=1000, max_delay_ms=5.0)
    assert not p.should_flush(0, 0, 1e9)  # nothing to flush
    assert not p.should_flush(9, 999, 4.9)
    assert p.should_flush(10, 0, 0.0)
    assert p.should_flush(1, 1000, 0.0)
    assert p.should_flush(1, 1, 5.0)
    assert p.wait_ms(2.0) == 3.0 and p.wait_ms(9.0) == 0.0
    assert GroupCommitPolicy(10, 1000, 0.0).should_flush(1, 1, 0.0)  # natural batching
    for bad in [(0, 1, 1.0), (1, 0, 1.0), (1, 1, -1.0)]:
        with pytest.raises(ValueError):
            GroupCommitPolicy(*bad)


class FakeFlush:
    """Records each flush; can hold flushes at a gate and fail batches holding `poison`."""

    def __init__(self, gated: bool = False, poison: str = "") -> None:
        self.calls: list[list[str]] = []
        self.done: list[list[str]] = []
        self.gate = asyncio.Event()
        if not gated:
            self.gate.set()
        self.poison = poison
        self.running = 0
        self.max_running = 0

    async def __call__(self, events: list[Event]) -> list[str]:
        ids = [e.id for e in events]
        self.calls.append(ids)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await self.gate.wait()
            await asyncio.sleep(0)
            if self.poison and self.poison in ids:
                raise RuntimeError(f"flush of {len(ids)} failed")
            return ids
        finally:
            self.running -= 1
            self.done.append(ids)


_ids = itertools.count()


def batch(n: int, prefix: str = "e", size: int = 10) -> list[Event]:
    return [Event(f"{prefix}{next(_ids)}", "s", "raw.s", b"x" * size, 0) for _ in range(n)]


def committer(flush: FakeFlush, **kwargs: Any) -> GroupCommitter[list[str]]:
    policy = GroupCommitPolicy(
        kwargs.pop("max_events", 1000), kwargs.pop("max_bytes", 1 << 20), kwargs.pop("delay", 5.0)
    )
    return GroupCommitter(flush, policy, **kwargs)


async def test_concurrent_submitters_share_one_flush() -> None:
    flush = FakeFlush()
    gc = committer(flush)
    requests = [batch(1 + i % 3) for i in range(50)]
    results = await asyncio.wait_for(asyncio.gather(*(gc.submit(r) for r in requests)), timeout=10)
    assert 1 <= len(flush.calls) <= 3
    for request, result in zip(requests, results, strict=True):
        ids = [e.id for e in request]
        start = result.index(ids[0])
        assert result[start : start + len(ids)] == ids  # its events, contiguous, in order
    assert sorted(itertools.chain(*flush.calls)) == sorted(e.id for r in requests for e in r)
    assert gc.pending_events == 0 and gc.flushes == len(flush.calls)
    await gc.aclose()


async def test_flushes_run_one_at_a_time_in_order() -> None:
    flush = FakeFlush()
    gc = committer(flush, max_events=3, delay=0.0)
    requests = [batch(1) for _ in range(30)]
    tasks = [asyncio.create_task(gc.submit(r)) for r in requests]
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
    assert flush.max_running == 1
    assert flush.done == flush.calls  # each finished before the next started
    assert list(itertools.chain(*flush.calls)) == [r[0].id for r in requests]
    assert all(len(c) <= 3 for c in flush.calls) and len(flush.calls) >= 10
    await gc.aclose()


async def test_batch_fills_while_a_flush_is_in_flight() -> None:
    flush = FakeFlush(gated=True)
    gc = committer(flush, delay=0.0)
    first = asyncio.create_task(gc.submit(batch(1, "first")))
    await await_until(lambda: flush.calls, timeout=5, what="first flush started")
    later = [asyncio.create_task(gc.submit(batch(2))) for _ in range(10)]
    await await_until(lambda: gc.pending_events == 21, timeout=5, what="submits queued")
    assert len(flush.calls) == 1  # nothing else may start while one is in flight
    flush.gate.set()
    await asyncio.wait_for(asyncio.gather(first, *later), timeout=10)
    assert [len(c) for c in flush.calls] == [1, 20]
    await gc.aclose()


async def test_max_in_flight_allows_overlapping_flushes() -> None:
    flush = FakeFlush(gated=True)
    gc = committer(flush, max_events=2, delay=0.0, max_in_flight=2)
    tasks = [asyncio.create_task(gc.submit(batch(2))) for _ in range(3)]
    await await_until(lambda: len(flush.calls) == 2, timeout=5, what="two flushes in flight")
    assert flush.running == 2 and gc.in_flight == 2
    flush.gate.set()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
    assert len(flush.calls) == 3 and flush.max_running == 2
    await gc.aclose()


async def test_failed_flush_fails_exactly_its_submitters() -> None:
    flush = FakeFlush(gated=True, poison="poison")
    gc = committer(flush, max_events=2, delay=0.0)
    a = asyncio.create_task(gc.submit(batch(1, "a")))
    await await_until(lambda: flush.calls, timeout=5, what="batch 1 in flight")
    b = asyncio.create_task(gc.submit([Event("poison", "s", "raw.s", b"{}", 0)]))
    c = asyncio.create_task(gc.submit(batch(1, "c")))  # fills batch 2 with b
    d = asyncio.create_task(gc.submit(batch(1, "d")))  # batch 3
    await await_until(lambda: gc.pending_events == 4, timeout=5, what="all submitted")
    flush.gate.set()
    outcomes = await asyncio.wait_for(
        asyncio.gather(a, b, c, d, return_exceptions=True), timeout=10
    )
    assert [len(call) for call in flush.calls] == [1, 2, 1]
    assert isinstance(outcomes[0], list) and isinstance(outcomes[3], list)
    assert isinstance(outcomes[1], RuntimeError) and outcomes[1] is outcomes[2]
    assert str(outcomes[1]) == "flush of 2 failed"
    assert gc.pending_events == 0
    await gc.aclose()


async def test_oversize_submission_is_flushed_alone_and_whole() -> None:
    flush = FakeFlush()
    gc = committer(flush, max_events=5, delay=50.0)
    small, big, after = batch(2, "s"), batch(12, "big"), batch(1, "t")
    results = await asyncio.wait_for(
        asyncio.gather(gc.submit(small), gc.submit(big), gc.submit(after)), timeout=10
    )
    assert flush.calls == [[e.id for e in small], [e.id for e in big], [e.id for e in after]]
    assert results[1] == [e.id for e in big]
    await gc.aclose()


async def test_byte_bound_closes_a_batch() -> None:
    flush = FakeFlush()
    gc = committer(flush, max_bytes=300, delay=50.0)
    requests = [batch(1, size=100) for _ in range(4)]  # ~140 bytes each with overhead
    await asyncio.wait_for(asyncio.gather(*(gc.submit(r) for r in requests)), timeout=10)
    assert [len(c) for c in flush.calls] == [2, 2]
    await gc.aclose()


async def test_overloaded_past_the_pending_bound() -> None:
    flush = FakeFlush(gated=True)
    gc = committer(flush, max_pending_events=10, delay=0.0)
    held = asyncio.create_task(gc.submit(batch(8)))
    await await_until(lambda: flush.calls, timeout=5, what="flush in flight")
    with pytest.raises(Overloaded, match="8 events pending, 3 more would pass 10"):
        await gc.submit(batch(3))
    assert gc.rejected == 1 and gc.pending_events == 8  # nothing of the refused one taken
    fits = asyncio.create_task(gc.submit(batch(2)))
    flush.gate.set()
    await asyncio.wait_for(asyncio.gather(held, fits), timeout=10)
    assert gc.pending_events == 0
    assert await asyncio.wait_for(gc.submit(batch(3)), timeout=10)
    await gc.aclose()


async def test_cancelled_submitter_does_not_cancel_the_batch() -> None:
    flush = FakeFlush(gated=True)
    gc = committer(flush, delay=0.0)
    first = asyncio.create_task(gc.submit(batch(1, "first")))
    await await_until(lambda: flush.calls, timeout=5, what="first flush started")
    quitter = asyncio.create_task(gc.submit(batch(1, "quit")))
    stayer = asyncio.create_task(gc.submit(batch(1, "stay")))
    await await_until(lambda: gc.pending_events == 3, timeout=5, what="both queued")
    quitter.cancel()
    flush.gate.set()
    result = await asyncio.wait_for(stayer, timeout=10)
    await asyncio.wait_for(first, timeout=10)
    assert len(result) == 2 and result[1].startswith("stay") and result[0].startswith("quit")
    assert quitter.cancelled()
    await gc.aclose()


async def test_injected_clock_drives_the_delay() -> None:
    now = [0.0]
    flush = FakeFlush()
    gc = committer(flush, delay=60_000.0, clock=lambda: now[0])
    first = asyncio.create_task(gc.submit(batch(1, "a")))
    for _ in range(5):
        await asyncio.sleep(0)
    assert flush.calls == []  # a minute's window has not passed on the injected clock
    now[0] += 61.0
    second = asyncio.create_task(gc.submit(batch(1, "b")))  # wakes the flusher
    await asyncio.wait_for(asyncio.gather(first, second), timeout=5)
    assert [len(c) for c in flush.calls] == [2]
    await gc.aclose()


async def test_delay_flushes_a_lone_submitter() -> None:
    flush = FakeFlush()
    gc = committer(flush, delay=1.0)
    assert await asyncio.wait_for(gc.submit(batch(1, "lone")), timeout=5)
    await gc.aclose()


async def test_aclose_flushes_pending_then_refuses() -> None:
    flush = FakeFlush()
    gc = committer(flush, delay=60_000.0)
    waiting = asyncio.create_task(gc.submit(batch(3)))
    await await_until(lambda: gc.pending_events == 3, timeout=5, what="queued")
    await asyncio.wait_for(gc.aclose(), timeout=5)
    assert len(await waiting) == 3
    with pytest.raises(Overloaded, match="closing"):
        await gc.submit(batch(1))
    with pytest.raises(ValueError):
        await committer(FakeFlush()).submit([])


def test_committer_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError):
        committer(FakeFlush(), max_pending_events=0)
    with pytest.raises(ValueError):
        committer(FakeFlush(), max_in_flight=0)
