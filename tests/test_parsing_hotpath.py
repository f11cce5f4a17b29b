"""The collector's hot path, `parse_events`: the same ids and refusals as `parse_body` then
`assign_ids` (the dict-based reference), with each event's JSON kept as received."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from actors.collection.parsing import MAX_ID_CHARS, BadInput, assign_ids, parse_body, parse_events
from runtime.data.events import Event, new_event_ids
from runtime.data.json_depth import MAX_DEPTH
from runtime.data.logic import LogicConfig, compile_logic
from tests.strategies import json_value

pytestmark = pytest.mark.unit

JSON = "application/json"
NDJSON = "application/x-ndjson"
UUID7 = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
LIMITS = {"max_events": 10, "max_event_bytes": 1000}


def fast(ct: str | None, body: bytes, **limits: int) -> list[Event]:
    return parse_events(ct, body, "s", "raw.s", 7, token="t", **(limits or LIMITS))


def refusal(ct: str | None, body: bytes, **limits: int) -> tuple[int, str]:
    with pytest.raises(BadInput) as info:
        fast(ct, body, **limits)
    return info.value.status, info.value.reason


def reference(ct: str | None, body: bytes, **limits: int) -> list[Event] | tuple[int, str]:
    """The dict-based path the collector took before: decode every event, then ids."""
    try:
        items = parse_body(ct, body, **(limits or LIMITS))
        return assign_ids(items, "s", "raw.s", 7, token="t")
    except BadInput as bad:
        return bad.status, bad.reason


def outcome(ct: str | None, body: bytes, **limits: int) -> list[Event] | tuple[int, str]:
    try:
        return fast(ct, body, **limits)
    except BadInput as bad:
        return bad.status, bad.reason


# --------------------------------------------------------------------------- ids


def test_present_ids_keep_the_bytes_as_received() -> None:
    body = b'{"id":"a-1","x":1}\r\n\n  {"x": [1, 2], "id": 42}  \n{"id":"z","s":"\\u00e9"}\n'
    events = fast(NDJSON, body)
    assert [e.id for e in events] == ["a-1", "42", "z"]
    assert [e.data for e in events] == [
        b'{"id":"a-1","x":1}',  # CR and surrounding blanks left out
        b'{"x": [1, 2], "id": 42}',  # spacing and key order as sent; 42 stays a number
        b'{"id":"z","s":"\\u00e9"}',  # escapes as sent
    ]
    assert all(
        (e.stream, e.subject, e.received_ms, e.processed, e.token) == ("s", "raw.s", 7, False, "t")
        for e in events
    )


def test_missing_id_is_generated_and_written_first() -> None:
    events = fast(JSON, b'[{"a":1}, {}, { "b" : 2 }, {  }]')
    ids = [e.id for e in events]
    assert all(UUID7.match(i) for i in ids) and ids == sorted(ids) and len(set(ids)) == 4
    assert [e.data for e in events] == [
        b'{"id":"' + ids[0].encode() + b'","a":1}',
        b'{"id":"' + ids[1].encode() + b'"}',
        b'{"id":"' + ids[2].encode() + b'", "b" : 2 }',
        b'{"id":"' + ids[3].encode() + b'"  }',
    ]
    for e in events:
        assert msgspec.json.decode(e.data)["id"] == e.id


def test_pretty_printed_events_are_compacted_to_one_line() -> None:
    """A line break inside an event would end an SSE `data:` line or an NDJSON export early."""
    body = b'[\n  {\n    "id": "p-1",\n    "x": [1,\r\n 2]\n  },\n  {"y": "a\\nb"}\n]'
    events = fast(JSON, body)
    assert events[0].data == b'{"id":"p-1","x":[1,2]}'
    assert events[1].data == b'{"id":"' + events[1].id.encode() + b'","y": "a\\nb"}'
    assert not any(b"\n" in e.data or b"\r" in e.data for e in events)
    (one,) = fast(JSON, b'{\n "id": 7\n}')
    assert (one.id, one.data) == ("7", b'{"id":7}')


def test_null_id_is_replaced_in_place() -> None:
    (event,) = fast(JSON, b'{"a": 1, "id": null, "b": [2]}')
    assert UUID7.match(event.id)
    assert event.data == b'{"a":1,"id":"' + event.id.encode() + b'","b":[2]}'


def test_a_nested_id_is_not_the_events_id() -> None:
    (event,) = fast(JSON, b'{"user":{"id":"u-1"},"items":[{"id":2}]}')
    assert UUID7.match(event.id) and event.id != "u-1"
    assert msgspec.json.decode(event.data) == {
        "id": event.id,
        "user": {"id": "u-1"},
        "items": [{"id": 2}],
    }
    (escaped,) = fast(JSON, b'{"\\u0069d":"k-1"}')  # "id" spelt with an escape is the id
    assert escaped.id == "k-1" and escaped.data == b'{"\\u0069d":"k-1"}'


def test_integer_ids_as_their_decimal_string() -> None:
    big = 10 ** (MAX_ID_CHARS - 1) - 1
    events = fast(NDJSON, b'{"id":-5}\n{"id":' + str(big).encode() + b"}")
    assert [e.id for e in events] == ["-5", str(big)]
    assert events[1].data == b'{"id":' + str(big).encode() + b"}"


@pytest.mark.parametrize(
    ("given", "reason"),
    [
        (b"1.5", "got number"),
        (b"1e2", "got number"),
        (b"true", "got boolean"),
        (b"[1]", "got array"),
        (b'{"id":1}', "got object"),
        (b'""', "got an empty string"),
        (b'"has space"', "printable ASCII"),
        (b'"ends-in-newline\\n"', "printable ASCII"),  # a regex `$` once let it through
        (b'"\\u00e9"', "printable ASCII"),
        (b'"' + b"x" * (MAX_ID_CHARS + 1) + b'"', "printable ASCII"),
        (str(10**MAX_ID_CHARS).encode(), "got number"),
    ],
)
def test_wrong_typed_ids_are_refused_naming_the_index(given: bytes, reason: str) -> None:
    body = b'{"id":"ok"}\n{"a":1}\n{"id":' + given + b"}"
    status, text = refusal(NDJSON, body)
    assert status == 400
    assert text.startswith("event at index 2: 'id' must be") and reason in text, text
    assert (status, text) == reference(NDJSON, body)


def test_parse_errors_come_before_id_errors() -> None:
    body = b'{"id":true}\n{"a":}'  # a bad id first, malformed JSON later: the JSON wins
    assert refusal(NDJSON, body) == (400, "malformed JSON at line 2, column 6: invalid character")


# --------------------------------------------------------------------------- limits and bad input


@pytest.mark.parametrize("form", ["object", "array", "ndjson"])
def test_event_at_the_size_limit_and_one_byte_over(form: str) -> None:
    def event(size: int) -> bytes:
        head = b'{"id":"e","p":"'
        return head + b"x" * (size - len(head) - 2) + b'"}'

    def as_body(item: bytes) -> tuple[str, bytes]:
        if form == "object":
            return JSON, item
        if form == "array":
            return JSON, b"[" + item + b"]"
        return NDJSON, item + b"\n"

    limit = 1000
    ct, body = as_body(event(limit))
    if form == "ndjson":  # a line's size counts its CR, as parse_body counts it
        status, reason = refusal(
            NDJSON, event(limit) + b"\r\n", max_events=10, max_event_bytes=limit
        )
        assert (status, reason) == (413, "line 1 is 1001 bytes > max 1000")
    (ok,) = fast(ct, body, max_events=10, max_event_bytes=limit)
    assert ok.data == event(limit) and len(ok.data) == limit
    ct, body = as_body(event(limit + 1))
    status, reason = refusal(ct, body, max_events=10, max_event_bytes=limit)
    assert status == 413 and "1001 bytes > max 1000" in reason
    assert (status, reason) == reference(ct, body, max_events=10, max_event_bytes=limit)


@pytest.mark.parametrize(
    ("ct", "body", "status", "reason"),
    [
        (NDJSON, b'{"a":1}\n{"b":"\xff"}', 400, "invalid UTF-8 at byte 14"),
        (JSON, b'[{"a":1}, {"b":"\xc3"}]', 400, "invalid UTF-8 at byte 16"),
        (JSON, b'{"a":"\xed\xa0\x80"}', 400, "invalid UTF-8 at byte 6"),
        (NDJSON, b'{"a":1}\n[1]', 400, "line 2 is not a JSON object, got array"),
        (NDJSON, b'{"a":1}\n"x"', 400, "line 2 is not a JSON object, got string"),
        (JSON, b'[{"a":1}, 3]', 400, "item 1 is not a JSON object, got number"),
        (JSON, b"null", 400, "body must be a JSON object or an array of objects, got null"),
        (NDJSON, b'{"a":1}\n\n{"b":}\n', 400, "malformed JSON at line 3, column 6"),
        (NDJSON, b"\x0c{}", 400, "malformed JSON at line 1, column 1"),
        (JSON, b'{"a":1e400}', 400, "malformed JSON"),
        (JSON, b'{"a":-1E+309}', 400, "malformed JSON"),
        (JSON, b'{"a":' + b"9" * 310 + b".5}", 400, "malformed JSON"),
        (JSON, b'{"a":' + b"9" * 5000 + b"}", 400, "malformed JSON"),
        (JSON, b'{"a":"\\ud800x"}', 400, "malformed JSON"),
        (JSON, b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nested deeper than 512"),
        (JSON, b"\xef\xbb\xbf\xef\xbb\xbf{}", 400, "malformed JSON"),
        (NDJSON, b"{}\n" * 11, 413, "too many events: 11 > max 10"),
        (NDJSON, b"\r\n \n", 400, "empty body"),
        ("text/plain", b"{}", 415, "unsupported Content-Type"),
    ],
)
def test_bad_input_is_refused_as_parse_body_refuses_it(
    ct: str, body: bytes, status: int, reason: str
) -> None:
    got = refusal(ct, body)
    assert got[0] == status and reason in got[1], got
    assert got == reference(ct, body)


@pytest.mark.parametrize("form", ["object", "array", "ndjson"])
def test_an_event_nested_512_levels_is_taken_and_513_refused_at_its_bracket(form: str) -> None:
    """The nesting the sources read (runtime/data/json_depth.py) is the most the collector
    takes: an event it accepts is never malformed to analysis."""

    def event(levels: int) -> bytes:  # the event object is the first level
        return b'{"a":' + b"[" * (levels - 1) + b"]" * (levels - 1) + b"}"

    def as_body(item: bytes) -> tuple[str, bytes]:
        if form == "object":
            return JSON, item
        if form == "array":
            return JSON, b"[" + item + b"]"
        return NDJSON, b"{}\n" + item

    limits = {"max_events": 10, "max_event_bytes": 1 << 16}
    ct, body = as_body(event(MAX_DEPTH))
    assert fast(ct, body, **limits)[-1].data.endswith(event(MAX_DEPTH)[1:])  # an id goes first
    for levels in (MAX_DEPTH + 1, 5000):  # 5000: past Python's own recursion limit
        ct, body = as_body(event(levels))
        got = refusal(ct, body, **limits)
        column = 5 + MAX_DEPTH + (form == "array")  # `{"a":` then the brackets
        line = 2 if form == "ndjson" else 1
        assert got == (
            400,
            f"malformed JSON at line {line}, column {column}: nested deeper than 512 levels",
        )
        assert got == reference(ct, body, **limits)


def test_blank_lines_crlf_and_a_bom_are_not_events() -> None:
    body = b'\xef\xbb\xbf{"id":"a"}\r\n\r\n   \n\t\n{"id":"b"}\r\n'
    assert [(e.id, e.data) for e in fast(NDJSON, body)] == [
        ("a", b'{"id":"a"}'),
        ("b", b'{"id":"b"}'),
    ]
    (single,) = fast(JSON, b'\xef\xbb\xbf \n {"id":"c"} \r\n')
    assert single.data == b'{"id":"c"}'


def test_in_range_numbers_that_look_big_are_accepted_as_sent() -> None:
    body = b'{"id":"n","a":1e-400,"b":1e308,"c":' + b"9" * 250 + b',"d":"x1e999"}'
    (event,) = fast(JSON, body)  # taken through the careful path, the same result
    assert event.data == body
    assert reference(JSON, body)[0].id == "n"  # type: ignore[union-attr]


# --------------------------------------------------------------------------- same as the reference

ids = st.one_of(
    st.just(None),  # no id key at all (see below) or a null one
    st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=8),
    st.integers(-(10**20), 10**20),
    json_value,  # wrong types too
)


@st.composite
def event_objects(draw: st.DrawFn) -> tuple[dict[str, Any], bool]:
    """(object, whether it has an `id` key); the id may sit anywhere among the keys."""
    obj = draw(
        st.dictionaries(st.text(max_size=6).filter(lambda k: k != "id"), json_value, max_size=4)
    )
    if draw(st.booleans()):
        items = list(obj.items())
        items.insert(draw(st.integers(0, len(items))), ("id", draw(ids)))
        return dict(items), True
    return obj, False


def texts(obj: dict[str, Any], ascii_only: bool, spaced: bool) -> bytes:
    seps = (", ", ": ") if spaced else (",", ":")
    return json.dumps(obj, ensure_ascii=ascii_only, separators=seps).encode()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    objects=st.lists(event_objects(), min_size=1, max_size=6),
    form=st.sampled_from(["ndjson", "array", "object"]),
    ascii_only=st.booleans(),
    spaced=st.booleans(),
    eol=st.sampled_from([b"\n", b"\r\n", b"\n\n  \n"]),
)
def test_same_events_as_the_dict_based_reference(
    objects: list[tuple[dict[str, Any], bool]],
    form: str,
    ascii_only: bool,
    spaced: bool,
    eol: bytes,
) -> None:
    raws = [texts(obj, ascii_only, spaced) for obj, _ in objects]
    if form == "ndjson":
        ct, body = NDJSON, eol.join(raws) + eol
    elif form == "array":
        ct, body = JSON, b"[" + b", ".join(raws) + b"]"
    else:
        ct, body, raws = JSON, b" " + raws[0] + b"\n", raws[:1]
    limits = {"max_events": 100, "max_event_bytes": 1 << 20}
    expected = reference(ct, body, **limits)
    got = outcome(ct, body, **limits)
    if isinstance(expected, tuple):
        assert got == expected
        return
    assert isinstance(got, list) and len(got) == len(expected) == len(raws)
    for new, old, raw in zip(got, expected, raws, strict=True):
        data, old_data = msgspec.json.decode(new.data), msgspec.json.decode(old.data)
        given = msgspec.json.decode(raw).get("id")
        if given is None:  # generated: a fresh UUIDv7, in the data; the rest as the reference
            assert UUID7.match(new.id) and data["id"] == new.id
            old_data["id"] = new.id
            assert list(data.items()) == list(old_data.items())  # same keys, same order
            if b'"id"' not in raw:
                assert new.data == b'{"id":"' + new.id.encode() + (
                    b'",' + raw[1:] if len(raw) > 2 else b'"}'
                )
        else:
            assert new.id == old.id
            assert new.data == raw  # as received, byte for byte
            assert data == old_data
        assert (new.stream, new.subject, new.received_ms, new.processed, new.token) == (
            old.stream,
            old.subject,
            old.received_ms,
            old.processed,
            old.token,
        )


def _mutated(body: bytes) -> st.SearchStrategy[bytes]:
    return st.tuples(
        st.integers(0, len(body)),
        st.sampled_from(
            [b"", b"\xff", b"\xc3", b"e999", b"9" * 300, b"\\", b'"', b"{", b"\r", b"\n"]
        ),
        st.integers(0, 2),
    ).map(lambda t: body[: t[0]] + t[1] + body[t[0] + t[2] :])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    objects=st.lists(event_objects(), min_size=1, max_size=4),
    form=st.sampled_from(["ndjson", "array", "object"]),
    max_event_bytes=st.integers(1, 200),
    max_events=st.integers(1, 5),
)
@example(data=None, objects=[({"a": 1}, False)], form="object", max_event_bytes=8, max_events=1)
def test_same_refusals_as_the_reference_for_mangled_bodies(
    data: Any,
    objects: list[tuple[dict[str, Any], bool]],
    form: str,
    max_event_bytes: int,
    max_events: int,
) -> None:
    raws = [texts(obj, False, False) for obj, _ in objects]
    ct = NDJSON if form == "ndjson" else JSON
    body = b"\n".join(raws) if form == "ndjson" else b"[" + b",".join(raws) + b"]"
    if form == "object":
        body = raws[0]
    if data is not None:
        body = data.draw(_mutated(body))
    limits = {"max_events": max_events, "max_event_bytes": max_event_bytes}
    expected, got = reference(ct, body, **limits), outcome(ct, body, **limits)
    if isinstance(expected, tuple):
        assert got == expected
    else:
        assert isinstance(got, list)
        assert [e.id if not UUID7.match(e.id) else "gen" for e in got] == [
            e.id if not UUID7.match(e.id) else "gen" for e in expected
        ]
        for new, old in zip(got, expected, strict=True):
            d_new, d_old = msgspec.json.decode(new.data), msgspec.json.decode(old.data)
            d_new.pop("id", None), d_old.pop("id", None)
            assert d_new == d_old


# --------------------------------------------------------------------------- ids in bulk and logic


def test_bulk_ids_are_unique_time_ordered_uuid7() -> None:
    batch = new_event_ids(10_000) + new_event_ids(1) + new_event_ids(3)  # > 4,096 per ms
    assert len(set(batch)) == len(batch) and batch == sorted(batch)
    for eid in batch[:5] + batch[-5:]:
        parsed = uuid.UUID(eid)
        assert parsed.version == 7 and parsed.variant == uuid.RFC_4122 and UUID7.match(eid)
    assert new_event_ids(0) == []


def test_no_logic_keeps_every_event_as_is_but_processed() -> None:
    lg = compile_logic("s", LogicConfig(), "raw.s", collector="c")
    done = Event("d", "s", "raw.s.x", b"not json", 1, True, "")
    raw = Event("r", "s", "", b"{ }", 2, False, "tok")
    result = lg.apply([done, raw])
    assert result.kept == [done, Event("r", "s", "raw.s", b"{ }", 2, True, "tok")]
    assert result.kept[0] is done and result.dropped == [] and result.invalid == []
    routed = compile_logic("s", LogicConfig(route="raw.s.fixed"), "raw.s", collector="c")
    assert [e.subject for e in routed.apply([raw]).kept] == ["raw.s.fixed"]


def test_plain_bodies_never_decode_events_to_dicts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The speed-up is real only if clean input skips the dict-based path entirely."""
    import actors.collection.parsing as parsing

    def no_dicts(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("took the dict-based path")

    monkeypatch.setattr(parsing, "parse_body", no_dicts)
    monkeypatch.setattr(parsing, "_decode_any", no_dicts)
    lines = [b'{"id":"r-%d","v":{"x":[1,2.5e-3,"\xc3\xa9"]}}' % i for i in range(50)]
    assert len(fast(NDJSON, b"\r\n".join(lines), max_events=100, max_event_bytes=1000)) == 50
    assert (
        len(fast(JSON, b"[" + b",".join(lines) + b"]", max_events=100, max_event_bytes=1000)) == 50
    )
    assert fast(JSON, b'{"a": 1}')[0].data.startswith(b'{"id":"')


@pytest.mark.unit
def test_ids_that_look_like_exponents_stay_on_the_fast_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An id "e2e-100" or a UUID "550e8400-..." is a string, not a number out of range."""
    import actors.collection.parsing as parsing

    def no_dicts(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("took the dict-based path")

    body = b'{"id":"e2e-100","x":1}\n{"id":"550e8400-e29b-41d4-a716-446655440000","s":"1e999"}'
    monkeypatch.setattr(parsing, "parse_body", no_dicts)
    events = fast(NDJSON, body)
    assert [e.id for e in events] == ["e2e-100", "550e8400-e29b-41d4-a716-446655440000"]


@pytest.mark.unit
@pytest.mark.parametrize("number", [b"1e400", b"-1.5E+400", b"[1,2e309]", b"\n 1e999", b"9" * 250])
def test_numbers_that_may_be_out_of_range_go_as_the_dict_path_takes_them(number: bytes) -> None:
    body = b'{"id":"a","x":' + number + b"}"
    assert outcome(JSON, body) == reference(JSON, body)
