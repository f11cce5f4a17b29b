"""StreamMessage.json: a stored one-line JSON payload is served as stored, its decoded
objects not kept, and every payload gets exactly the bytes the decode-then-encode rule
gives."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.access.messages import StreamMessage, surely_json
from tests.strategies import json_value

pytestmark = pytest.mark.unit


def reference(raw: bytes) -> bytes:
    """The rule before the undecoded path: decode; one valid line is reused, other valid
    JSON re-encoded, anything else sent as its text (a JSON string)."""
    try:
        data = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return msgspec.json.encode(raw.decode("utf-8", "replace"))
    one = raw.strip()
    if one and b"\n" not in one and b"\r" not in one:
        return one
    return msgspec.json.encode(data)


def test_a_one_line_json_payload_is_served_as_stored_keeping_no_objects() -> None:
    raw = b' {"id":"e2e-100","v":[1,2.5,"x"],"u":"550e8400-e29b"} '
    m = StreamMessage(1, "s.x", raw)
    assert m.json == raw.strip()
    assert m._data is ...  # nothing kept on the way


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a":1e400}',  # out of range: a decode refuses it, so it is text
        b'{"a":"\xff"}',  # bad UTF-8 (msgspec raises UnicodeDecodeError: it is text)
        b'{"a":[1,]}',
        b'{"a":\n 1}',  # valid, two lines: re-encoded
        b"plain text",
        b"",
        b"\xef\xbb\xbf{}",
        b'{"a":' + b"9" * 250 + b"}",
        b"\x0b1",  # bytes.strip() takes vertical tab and form feed, JSON does not: text
        b"\x0c{}",
        b"{}\x0b",
        b'{"a":1.8e308}',  # past a double by a little
        b'[1E+400,"x"]',
        b'{"a":1e308,"b":-1e-999}',  # in range (underflow is 0.0)
        b'{"a":"\xed\xa0\x80"}',  # a surrogate in UTF-8: Python's codec refuses it
        b'{"a":"\\ud800"}',  # a lone surrogate escape
        b'{"a":{"b":["caf\xc3\xa9",{"c":"\xc3"}]}}',  # bad UTF-8 deep inside
        b'{"a":' + b"1" * 300 + b".5}",
        b'{"a":' + b"1" * 150 + b".5e99}",
        b'{"id":"e2e-100","t":"1e-999 e+1234"}',
        b"[" * 2000 + b"]" * 2000,  # too deep for the decode: not a known payload
    ],
)
def test_edge_payloads_get_the_decode_rules_bytes(raw: bytes) -> None:
    try:
        want = reference(raw)
    except RecursionError:
        with pytest.raises(RecursionError):
            StreamMessage(1, "s", raw).json  # noqa: B018 - as the decode did
        return
    assert StreamMessage(1, "s", raw).json == want


def test_a_plain_payload_is_vouched_for_without_a_decode() -> None:
    """The cheap check must pass what producers send, or it only adds work."""
    rsvp = (
        b'{"venue":{"venue_name":"Caf\xc3\xa9 Lyon","lon":-73.884792,"venue_id":16284529},'
        b'"response":"yes","guests":0,"mtime":1473159126121,"n":100,"id":"e2e-100",'
        b'"group":{"group_topics":[{"urlkey":"new-in-town"}],"group_lat":40.75}}'
    )
    assert surely_json(rsvp)
    assert not surely_json(b'{"a":1e400}')
    assert not surely_json(b'{"a":"\xff"}')


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        json_value.map(msgspec.json.encode),
        json_value.map(lambda v: msgspec.json.encode(v) + b"\n"),
        st.binary(max_size=40),
        json_value.map(lambda v: msgspec.json.encode(v)[:-1]),
    )
)
def test_any_payload_gets_the_decode_rules_bytes(raw: bytes) -> None:
    assert StreamMessage(1, "s", raw).json == reference(raw)


def _mutations() -> st.SearchStrategy[bytes]:
    """JSON with bytes put in, taken out or replaced: mostly near-misses of valid JSON."""
    alphabet = st.sampled_from(list(b'0123456789eE+-.,:[]{}"\\u tfn\xff\xc3\xa9\xed\xa0'))
    edit = st.tuples(
        st.integers(0, 10_000), st.integers(0, 2), alphabet, st.sampled_from([1, 3, 250])
    )

    def apply(raw: bytes, edits: list[tuple[int, int, int, int]]) -> bytes:
        b = bytearray(raw)
        for at, kind, byte, count in edits:
            i = at % (len(b) + 1)
            if kind == 0:
                b[i:i] = bytes([byte]) * count
            elif i < len(b):
                if kind == 1:
                    del b[i]
                else:
                    b[i] = byte
        return bytes(b)

    return st.builds(apply, json_value.map(msgspec.json.encode), st.lists(edit, max_size=4))


@settings(max_examples=400, deadline=None)
@given(st.one_of(_mutations(), st.binary(max_size=60), json_value.map(msgspec.json.encode)))
def test_what_the_cheap_check_vouches_for_the_decode_accepts(raw: bytes) -> None:
    if surely_json(raw):
        msgspec.json.decode(raw)  # raises if the check was wrong
