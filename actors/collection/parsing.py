"""The Collector's request parsing without the I/O: bodies to JSON objects, objects to `Event`s.

Pure, so the ingest path (`actors/collection/ingest.py`) and its transports stay thin and these
rules are tested alone:

- `parse_body` turns a request body into JSON objects or raises `BadInput` (HTTP 4xx
  with a reason). The total body size is NOT checked here: aiohttp enforces it with
  `web.Application(client_max_size=...)` and answers 413 before the body is read.
- `assign_ids` makes the `Event`s: the producer's `id` is kept (it is the dedup key
  end to end), otherwise a time-ordered id is generated and written into the JSON.
- `parse_events` is the collector's hot path: the two above in one pass, giving the same
  ids and the same refusals (status and reason), without decoding events to dicts.

What `parse_events` puts in `Event.data`: the event's JSON as the producer sent it (the
NDJSON line, the array item, the body; surrounding whitespace and a BOM left out), so
nothing is decoded and re-encoded. A missing `id` is written in as the first key
(`{"id":"<generated>",` before the rest, as received); a null `id` is replaced in place,
the one case where the event is re-encoded (compact, from its decoded form). `assign_ids`,
which only has the decoded objects, re-encodes every event.
"""

import re
from typing import Any, Literal

import msgspec

from runtime.data.events import Event, json_kind, new_event_ids, skippable_json
from runtime.data.json_depth import MAX_DEPTH, error_byte, may_be_too_deep, too_deep_at
from runtime.errors import TierflowError

__all__ = [
    "BadInput",
    "MAX_ID_CHARS",
    "assign_ids",
    "parse_body",
    "parse_events",
]

# --------------------------------------------------------------------------- parsing


class BadInput(TierflowError):
    """A request the collector refuses: `status` is the HTTP status, `reason` the text;
    `extra` goes into the JSON answer beside them (e.g. the limit a 413 names)."""

    def __init__(self, status: int, reason: str, **extra: Any) -> None:
        super().__init__(f"{status}: {reason}")
        self.status = status
        self.reason = reason
        self.extra = extra


JSON_TYPES = ("application/json",)
NDJSON_TYPES = ("application/x-ndjson", "application/jsonl", "application/ndjson")
_ACCEPTED = "application/json or application/x-ndjson"

_raw_array = msgspec.json.Decoder(list[msgspec.Raw])
_decode_any = msgspec.json.decode
_BOM = b"\xef\xbb\xbf"


def _media_type(content_type: str | None) -> Literal["json", "ndjson"]:
    """Which parser a Content-Type header selects; 415 for anything else."""
    if not content_type or not content_type.strip():
        raise BadInput(415, f"missing Content-Type; send {_ACCEPTED}")
    mime, *params = (p.strip() for p in content_type.split(";"))
    mime = mime.lower()
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            charset = value.strip().strip('"').lower()
            if charset not in ("utf-8", "utf8"):
                raise BadInput(415, f"unsupported charset {charset!r}; only utf-8")
    if mime in JSON_TYPES:
        return "json"
    if mime in NDJSON_TYPES:
        return "ndjson"
    raise BadInput(415, f"unsupported Content-Type {mime!r}; send {_ACCEPTED}")


def _utf8_error(data: bytes, base: int = 0) -> BadInput | None:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        return BadInput(400, f"invalid UTF-8 at byte {base + err.start}")
    return None


def _where(data: bytes, offset: int) -> str:
    """`line L, column C` (1-based, column in characters) of a byte offset."""
    offset = max(0, min(offset, len(data)))
    line = data.count(b"\n", 0, offset) + 1
    start = data.rfind(b"\n", 0, offset) + 1
    column = len(data[start:offset].decode("utf-8", "replace")) + 1
    return f"line {line}, column {column}"


def _at(data: bytes, offset: int, line_no: int) -> str:
    """Where a byte offset is: in the body, or in NDJSON line `line_no` (its column)."""
    where = _where(data, offset)
    return f"line {line_no}, " + where.split(", ", 1)[1] if line_no else where


def _too_deep(data: bytes, line_no: int = 0, limit: int = MAX_DEPTH) -> BadInput | None:
    """The 400 for an event nested deeper than analysis reads (runtime/data/json_depth.py);
    `limit` one more for a body that is an array of events."""
    if not may_be_too_deep(data, limit):
        return None
    at = too_deep_at(data, limit)
    if at is None:
        return None
    return BadInput(
        400, f"malformed JSON at {_at(data, at, line_no)}: nested deeper than {MAX_DEPTH} levels"
    )


def _malformed(data: bytes, err: Exception, line_no: int = 0, limit: int = MAX_DEPTH) -> BadInput:
    """The 400 for a decode failure of `data` (the body, or one NDJSON line)."""
    bad_utf8 = _utf8_error(data)
    if bad_utf8 is not None:
        return bad_utf8
    if isinstance(err, RecursionError):
        deep = _too_deep(data, line_no, limit)
        return deep or BadInput(400, f"malformed JSON: nested deeper than {MAX_DEPTH} levels")
    text, at = error_byte(str(err).removeprefix("JSON is malformed: "))
    offset = len(data) if at is None else at
    if text.startswith("trailing characters"):
        offset -= 1  # msgspec names the byte after the first trailing one
    text = text[:1].lower() + text[1:]
    return BadInput(400, f"malformed JSON at {_at(data, offset, line_no)}: {text}")


def _decode(data: bytes, line_no: int = 0, limit: int = MAX_DEPTH) -> Any:
    """`data` decoded, or the 400 for it: malformed, or nested past the limit."""
    try:
        value = _decode_any(data)
    except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError) as err:
        raise _malformed(data, err, line_no, limit) from None
    deep = _too_deep(data, line_no, limit)
    if deep is not None:
        raise deep
    return value


def _too_many(count: int, max_events: int) -> BadInput:
    return BadInput(413, f"too many events: {count} > max {max_events}")


def _too_big(what: str, size: int, max_event_bytes: int) -> BadInput:
    return BadInput(413, f"{what} is {size} bytes > max {max_event_bytes}")


def parse_body(
    content_type: str | None, body: bytes, *, max_events: int, max_event_bytes: int
) -> list[dict[str, Any]]:
    """The JSON objects of a request body, or `BadInput` naming what is wrong and where.

    `content_type` is the raw header value (parameters allowed; charset must be utf-8).
    `application/json`: one object or an array of objects. `application/x-ndjson`
    (also `application/jsonl`, `application/ndjson`): one object per line, blank lines
    ignored. A body with no event is refused (400), so an accepted request always
    carries at least one. Event sizes are the raw bytes as received. The whole body's
    size is aiohttp's job (`client_max_size`).
    """
    kind = _media_type(content_type)
    if body.startswith(_BOM):  # RFC 8259 lets a parser ignore a byte order mark
        body = body[len(_BOM) :]
    if not body.strip():
        raise BadInput(400, "empty body")
    if kind == "ndjson":
        return _parse_ndjson(body, max_events, max_event_bytes)
    if body.lstrip()[:1] == b"[":
        return _parse_array(body, max_events, max_event_bytes)
    value = _decode(body)
    if not isinstance(value, dict):
        raise BadInput(
            400, f"body must be a JSON object or an array of objects, got {json_kind(value)}"
        )
    if len(body) > max_event_bytes:
        raise _too_big("event", len(body), max_event_bytes)
    return [value]


def _parse_array(body: bytes, max_events: int, max_event_bytes: int) -> list[dict[str, Any]]:
    # A first pass into raw slices checks the syntax, the count and each item's size
    # before any item is materialised, and saves re-encoding items to measure them.
    try:
        raws = _raw_array.decode(body)
    except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError) as err:
        raise _malformed(body, err, limit=MAX_DEPTH + 1) from None
    if not raws:
        raise BadInput(400, "empty array: no events")
    if len(raws) > max_events:
        raise _too_many(len(raws), max_events)
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(raws):
        size = len(memoryview(raw))
        if size > max_event_bytes:
            raise _too_big(f"item {i}", size, max_event_bytes)
        try:
            value = _decode_any(raw)
            deep = may_be_too_deep(bytes(raw))
        except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError) as err:
            _decode(body, limit=MAX_DEPTH + 1)  # again on the whole body, for a position
            raise BadInput(400, f"item {i}: malformed JSON: {err}") from None
        if deep:
            _decode(body, limit=MAX_DEPTH + 1)  # the body's line and column of the bracket
        if not isinstance(value, dict):
            raise BadInput(400, f"item {i} is not a JSON object, got {json_kind(value)}")
        out.append(value)
    return out


def _parse_ndjson(body: bytes, max_events: int, max_event_bytes: int) -> list[dict[str, Any]]:
    lines = [(n, line) for n, line in enumerate(body.split(b"\n"), 1) if line.strip()]
    if len(lines) > max_events:
        raise _too_many(len(lines), max_events)
    out: list[dict[str, Any]] = []
    starts = _line_starts(body)
    for n, line in lines:
        if len(line) > max_event_bytes:
            raise _too_big(f"line {n}", len(line), max_event_bytes)
        bad_utf8 = None
        try:
            value = _decode_any(line)
        except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError) as err:
            bad_utf8 = _utf8_error(line, base=starts[n - 1])
            if bad_utf8 is None:
                raise _malformed(line, err, n) from None
        if bad_utf8 is not None:
            raise bad_utf8
        deep = _too_deep(line, n)
        if deep is not None:
            raise deep
        if not isinstance(value, dict):
            raise BadInput(400, f"line {n} is not a JSON object, got {json_kind(value)}")
        out.append(value)
    return out


def _line_starts(body: bytes) -> list[int]:
    starts = [0]
    find = body.find
    pos = find(b"\n")
    while pos != -1:
        starts.append(pos + 1)
        pos = find(b"\n", pos + 1)
    return starts


# --------------------------------------------------------------------------- identity

MAX_ID_CHARS = 256
_ID_RE = re.compile(rf"^[\x21-\x7e]{{1,{MAX_ID_CHARS}}}\Z")  # \Z: $ would let a final newline in
_INT_ID = 10 ** (MAX_ID_CHARS - 1)  # an integer id's decimal form fits the length rule
_encode = msgspec.json.encode


def assign_ids(
    items: list[dict[str, Any]], stream: str, subject: str, now_ms: int, token: str = ""
) -> list[Event]:
    """One `Event` per item, each with the identity it keeps end to end.

    A producer's `id` (a string of 1..256 printable ASCII characters, no spaces, or an
    integer, as its decimal string) is kept, so a producer's retry is deduplicated.
    A missing or null `id` gets `new_event_id()`, written into the JSON (first key) so
    consumers see it. Any other `id` is refused: `BadInput(400)` naming the index. The
    ASCII rule keeps ids safe as a `Nats-Msg-Id` header and a LevelDB key.
    """
    fresh = iter(new_event_ids(sum(1 for item in items if item.get("id") is None)))
    events: list[Event] = []
    for i, item in enumerate(items):
        given = item.get("id")
        if given is None:
            eid = next(fresh)
            if "id" in item:
                item = dict(item)
                item["id"] = eid
            else:
                item = {"id": eid, **item}
        elif isinstance(given, str) and _ID_RE.match(given):
            eid = given
        elif isinstance(given, int) and not isinstance(given, bool) and -_INT_ID < given < _INT_ID:
            eid = str(given)
        else:
            raise BadInput(400, _bad_id(i, given))
        events.append(Event(eid, stream, subject, _encode(item), now_ms, False, token))
    return events


def _bad_id(index: int, given: Any) -> str:
    head = f"event at index {index}: 'id' must be a non-empty string or an integer"
    if isinstance(given, str):
        if not given:
            return f"{head}, got an empty string"
        return f"{head}; strings are 1-{MAX_ID_CHARS} printable ASCII characters, no spaces"
    return f"{head}, got {json_kind(given)}"


# --------------------------------------------------------------------------- the hot path


class _Head(msgspec.Struct):
    """All the hot path decodes of an event: its `id`. Every other field is skipped
    (checked for syntax, never built into Python objects)."""

    id: str | int | None | msgspec.UnsetType = msgspec.UNSET


_decode_head = msgspec.json.Decoder(_Head).decode
_UNSET = msgspec.UNSET
_DECODE_ERRORS = (msgspec.MsgspecError, UnicodeDecodeError, RecursionError)

# Skipping a value checks less than decoding it; `skippable_json` (runtime/data/events.py) says
# when a skip accepts exactly what a decode would. Anything else takes the dict-based path.
_skippable = skippable_json


def _raw_events(kind: Literal["json", "ndjson"], body: bytes) -> list[bytes]:
    """Each event's JSON text in a body `parse_body` accepts, in its order."""
    if kind == "ndjson":
        return [s for s in (line.strip() for line in body.split(b"\n")) if s]
    if body.lstrip()[:1] == b"[":
        return [bytes(raw) for raw in _raw_array.decode(body)]
    return [body.strip()]


def _fast_heads(
    kind: Literal["json", "ndjson"], body: bytes, max_events: int, max_event_bytes: int
) -> tuple[list[bytes], list[Any]] | None:
    """(event texts, ids) when every event is plainly fine; None for anything to refuse
    or look at closer, which `parse_body` then does with its exact reasons."""
    if not _skippable(body):
        return None
    head = _decode_head
    try:
        if kind == "ndjson":
            raws: list[bytes] = []
            ids: list[Any] = []
            for line in body.split(b"\n"):
                text = line.strip()
                if text:
                    if len(line) > max_event_bytes or may_be_too_deep(line):
                        return None
                    ids.append(head(line).id)  # the line as parse_body decodes it
                    raws.append(text)
            if len(raws) > max_events:
                return None
            return raws, ids
        if body.lstrip()[:1] == b"[":
            items = _raw_array.decode(body)
            if not items or len(items) > max_events:
                return None
            raws = [bytes(raw) for raw in items]
            if max(map(len, raws)) > max_event_bytes or any(map(may_be_too_deep, raws)):
                return None
            return raws, [head(raw).id for raw in raws]
        if len(body) > max_event_bytes or may_be_too_deep(body):
            return None
        return [body.strip()], [head(body).id]
    except _DECODE_ERRORS:
        return None


def parse_events(
    content_type: str | None,
    body: bytes,
    stream: str,
    subject: str,
    now_ms: int,
    *,
    max_events: int,
    max_event_bytes: int,
    token: str = "",
) -> list[Event]:
    """`assign_ids(parse_body(...), ...)` without decoding events to dicts.

    Accepts and refuses exactly what those two do, with the same status and reason, and
    gives the same ids; `Event.data` is the event as received (see the module's notes).
    Only each event's `id` is decoded; a body with anything to refuse, or that only
    looks like it might have, goes through `parse_body` for its exact reason.
    """
    kind = _media_type(content_type)
    trimmed = body[len(_BOM) :] if body.startswith(_BOM) else body
    if not trimmed.strip():
        raise BadInput(400, "empty body")
    fast = _fast_heads(kind, trimmed, max_events, max_event_bytes)
    if fast is None:
        items = parse_body(
            content_type, body, max_events=max_events, max_event_bytes=max_event_bytes
        )
        raws = _raw_events(kind, trimmed)
        ids = [item.get("id", _UNSET) for item in items]
    else:
        raws, ids = fast
    return _identify(raws, ids, stream, subject, now_ms, token)


def _identify(
    raws: list[bytes], ids: list[Any], stream: str, subject: str, now_ms: int, token: str
) -> list[Event]:
    """The events of `raws` given each one's decoded `id` (UNSET if absent), by the rules
    of `assign_ids`."""
    fresh = iter(new_event_ids(sum(1 for given in ids if given is None or given is _UNSET)))
    events: list[Event] = []
    append = events.append
    match = _ID_RE.match
    for i, (raw, given) in enumerate(zip(raws, ids, strict=True)):
        if b"\n" in raw or b"\r" in raw:
            # a pretty-printed event: kept as received, its line breaks would end an SSE
            # `data:` line or an NDJSON export early, so it is re-encoded compactly
            raw = _encode(_decode_any(raw))
        if given.__class__ is str and match(given):
            eid, data = given, raw
        elif given is _UNSET:
            eid = next(fresh)
            data = _with_first_id(raw, eid)
        elif given is None:
            eid = next(fresh)
            item = _decode_any(raw)
            item["id"] = eid
            data = _encode(item)
        elif isinstance(given, int) and not isinstance(given, bool) and -_INT_ID < given < _INT_ID:
            eid, data = str(given), raw
        else:
            raise BadInput(400, _bad_id(i, given))
        append(Event(eid, stream, subject, data, now_ms, False, token))
    return events


def _with_first_id(raw: bytes, eid: str) -> bytes:
    """`raw` (a JSON object with no `id`) with `"id": eid` as its first member."""
    rest = raw[1:]
    if rest[:1] == b'"' or rest.lstrip()[:1] != b"}":
        return b'{"id":"' + eid.encode() + b'",' + rest
    return b'{"id":"' + eid.encode() + b'"' + rest
