"""StreamMessage.json: a stored one-line JSON payload is served as stored, its decoded
objects not kept, and every payload gets exactly the bytes the decode-then-encode rule
gives."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.access.messages import StreamMessage
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
    ],
)
def test_edge_payloads_get_the_decode_rules_bytes(raw: bytes) -> None:
    assert StreamMessage(1, "s", raw).json == reference(raw)


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
