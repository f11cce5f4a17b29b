"""How deep a JSON event may nest: `MAX_DEPTH` levels of arrays and objects.

msgspec leaves depth to Python's recursion limit, which depends on how deep the caller's own
stack already is, and ends with RecursionError rather than a decode error. A fixed limit
gives one answer wherever an event is checked (the JVM jetstream source keeps the same one,
jobs/jvm/.../JsonCheck.java), and a stream cannot hold an event one reader takes and another
refuses. The collector refuses such an event
(actors/collection/parsing.py), the sources mark one that reached a stream some other way
malformed. Real events nest a few levels; 512 leaves room for any of them.
"""

from __future__ import annotations

import re

MAX_DEPTH = 512
_STRUCTURE = re.compile(rb'[\[\]{}"\\]')
_BYTE_AT = re.compile(r"\s*\(byte (\d+)\)$")


def error_byte(message: str) -> tuple[str, int | None]:
    """A msgspec decode error's words and the byte it names ("expected ':' (byte 5)" ->
    ("expected ':'", 5)); None where it names none ("Input data was truncated"). Both
    depth checks compare that byte with the too-deep bracket's."""
    m = _BYTE_AT.search(message)
    return (message[: m.start()], int(m.group(1))) if m else (message, None)


def may_be_too_deep(payload: bytes, limit: int = MAX_DEPTH) -> bool:
    """A cheap pass: False for every payload that cannot open more than `limit` levels."""
    return len(payload) > limit and (payload.count(b"[") + payload.count(b"{") > limit)


def too_deep_at(payload: bytes, limit: int = MAX_DEPTH) -> int | None:
    """The byte offset of the bracket that opens level `limit + 1`, outside strings; None
    when no such bracket is there. Over the well-formed part of a document this follows its
    structure exactly. (A body that is an array of events: `limit` one more.)"""
    depth, escape_at = 0, -2
    in_string = escaped = False
    for m in _STRUCTURE.finditer(payload):
        c = m.group()
        if in_string:
            if escaped:
                # an escape is one byte after the backslash; only `"` and `\` are found here
                escaped = False
                if m.start() == escape_at + 1:
                    continue
            if c == b"\\":
                escaped, escape_at = True, m.start()
            elif c == b'"':
                in_string = False
            continue
        if c == b'"':
            in_string = True
        elif c in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return m.start()
        elif c in (b"]", b"}"):
            depth -= 1
    return None


def depth_error(payload: bytes, error_at: int | None) -> str | None:
    """msgspec-style words for a payload nested too deep, when its too-deep bracket comes
    before `error_at` (the byte of the decoder's own error; None: no such byte)."""
    if not may_be_too_deep(payload):
        return None
    at = too_deep_at(payload)
    if at is None or (error_at is not None and error_at <= at):
        return None
    return f"JSON is malformed: nested deeper than {MAX_DEPTH} levels (byte {at})"
