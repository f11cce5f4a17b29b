"""The Collector's request path without the I/O: parse, identify, apply logic, group-commit.

Everything here is pure (or, for `GroupCommitter`, needs only an event loop), so the
aiohttp/Ray layer in `actors/collector.py` stays a thin shell and these rules are
tested alone:

- `parse_body` turns a request body into JSON objects or raises `BadInput` (HTTP 4xx
  with a reason). The total body size is NOT checked here: aiohttp enforces it with
  `web.Application(client_max_size=...)` and answers 413 before the body is read.
- `assign_ids` makes the `Event`s: the producer's `id` is kept (it is the dedup key
  end to end), otherwise a time-ordered id is generated and written into the JSON.
- `compile_logic` builds a stream's `StreamLogic` (book ch. 2: validate, enrich,
  filter, route) once from its `[streams.NAME.logic]` table; `StreamLogic.apply`
  never raises for bad events: they come back as `invalid` with a reason, for
  `deadletter.{stream}` (see `dead_letters`).
- `GroupCommitter` gathers concurrent submitters into one flush (one LevelDB batch,
  one Ray call), bounded by `GroupCommitPolicy` and by `max_pending_events`.
"""

from __future__ import annotations

import asyncio
import importlib
import operator
import os
import re
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import msgspec
import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError, SqlglotError, TokenError

from actors.events import Event, new_event_id
from runtime.config import ConfigError, LogicConfig

__all__ = [
    "BadInput",
    "GroupCommitPolicy",
    "GroupCommitter",
    "LogicConfig",
    "LogicResult",
    "MAX_ID_CHARS",
    "Overloaded",
    "StreamLogic",
    "assign_ids",
    "compile_logic",
    "compile_where",
    "dead_letters",
    "event_bytes",
    "load_hook",
    "parse_body",
]

# --------------------------------------------------------------------------- parsing


class BadInput(Exception):
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
_BYTE_AT = re.compile(r"\s*\(byte (\d+)\)$")
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


def _json_kind(value: Any) -> str:
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"


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


def _malformed(data: bytes, err: Exception, line_no: int = 0) -> BadInput:
    """The 400 for a decode failure of `data` (the body, or one NDJSON line)."""
    bad_utf8 = _utf8_error(data)
    if bad_utf8 is not None:
        return bad_utf8
    if isinstance(err, RecursionError):
        where = f" at line {line_no}" if line_no else ""
        return BadInput(400, f"malformed JSON{where}: nested too deeply")
    text = str(err).removeprefix("JSON is malformed: ")
    m = _BYTE_AT.search(text)
    offset = int(m.group(1)) if m else len(data)
    text = text[: m.start()] if m else text
    if text.startswith("trailing characters"):
        offset -= 1  # msgspec names the byte after the first trailing one
    text = text[:1].lower() + text[1:]
    where = _where(data, offset)
    if line_no:  # one NDJSON line: its column, the body's line number
        where = f"line {line_no}, " + where.split(", ", 1)[1]
    return BadInput(400, f"malformed JSON at {where}: {text}")


def _decode(data: bytes, line_no: int = 0) -> Any:
    try:
        return _decode_any(data)
    except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError) as err:
        raise _malformed(data, err, line_no) from None


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
            400, f"body must be a JSON object or an array of objects, got {_json_kind(value)}"
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
        raise _malformed(body, err) from None
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
        except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError) as err:
            _decode(body)  # re-run on the whole body for an absolute position
            raise BadInput(400, f"item {i}: malformed JSON: {err}") from None
        if not isinstance(value, dict):
            raise BadInput(400, f"item {i} is not a JSON object, got {_json_kind(value)}")
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
        if not isinstance(value, dict):
            raise BadInput(400, f"line {n} is not a JSON object, got {_json_kind(value)}")
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
_ID_RE = re.compile(rf"^[\x21-\x7e]{{1,{MAX_ID_CHARS}}}$")
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
    events: list[Event] = []
    for i, item in enumerate(items):
        given = item.get("id")
        if given is None:
            eid = new_event_id()
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
    return f"{head}, got {_json_kind(given)}"


# --------------------------------------------------------------------------- logic config


@dataclass(frozen=True, slots=True)
class LogicResult:
    """What `StreamLogic.apply` made of a batch: every input event is in exactly one list."""

    kept: list[Event]  # processed=True, subject routed, data enriched
    dropped: list[Event]  # filtered out (as received)
    invalid: list[tuple[Event, str]]  # (event as received, reason) for deadletter.{stream}


Data = dict[str, Any]
Getter = Callable[[Data], Any]


def _getter(path: Sequence[str]) -> Getter:
    """Value at a dotted path; None when any step is missing or not an object."""
    keys = tuple(path)
    if len(keys) == 1:
        key = keys[0]
        return lambda data: data.get(key)

    def get(data: Data) -> Any:
        node: Any = data
        for key in keys:
            if not isinstance(node, dict):
                return None
            node = node.get(key)
        return node

    return get


def _split_path(path: str, key: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in path.split("."))
    if not path.strip() or any(not p for p in parts):
        raise ConfigError(f"{key}: bad field path {path!r}")
    return parts


_TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "any": lambda v: True,
}


def _flatten_schema(table: dict[str, Any], key: str, prefix: str = "") -> dict[str, str]:
    """`{"group": {"city": "str"}}` (TOML dotted keys) and `{"group.city": "str"}` alike."""
    out: dict[str, str] = {}
    for name, value in table.items():
        path = f"{prefix}{name}"
        if isinstance(value, dict):
            out.update(_flatten_schema(value, key, f"{path}."))
        elif isinstance(value, str) and value.removesuffix("?") in _TYPE_CHECKS:
            out[path] = value
        else:
            raise ConfigError(
                f"{key}.{path}: expected one of {', '.join(_TYPE_CHECKS)} (optionally with"
                f" '?'), got {value!r}"
            )
    return out


def _compile_schema(table: dict[str, Any], key: str) -> Callable[[Data], str | None]:
    checks = []
    for path, type_name in _flatten_schema(table, key).items():
        optional = type_name.endswith("?")
        base = type_name.removesuffix("?")
        checks.append((path, _getter(_split_path(path, key)), _TYPE_CHECKS[base], base, optional))

    def check(data: Data) -> str | None:
        problems = []
        for path, get, ok, base, optional in checks:
            value = get(data)
            if value is None:
                if not optional:
                    problems.append(f"missing field {path}")
            elif not ok(value):
                problems.append(f"field {path}: expected {base}, got {_json_kind(value)}")
        return "; ".join(problems) or None

    return check


_HOOK_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _is_hook(spec: str) -> bool:
    return bool(_HOOK_RE.match(spec.strip()))


def load_hook(spec: str, key: str) -> Callable[..., Any]:
    """Import a user's `"package.module:function"` once; ConfigError naming `key` if not."""
    spec = spec.strip()
    if not _is_hook(spec):
        raise ConfigError(f"{key}: expected 'module:function', got {spec!r}")
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as err:
        raise ConfigError(f"{key}: cannot import {module_name!r}: {err}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{key}: {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ConfigError(f"{key}: {spec!r} is not callable")
    return obj


# --------------------------------------------------------------------------- WHERE filter

_SUPPORTED = "=, !=, <, <=, >, >=, AND, OR, NOT, IN (...), IS [NOT] NULL"
_ORDER = {exp.LT: operator.lt, exp.LTE: operator.le, exp.GT: operator.gt, exp.GTE: operator.ge}
_NUMBER = re.compile(r"^[0-9]+$")
_SQLGLOT_CLASS = re.compile(r"<class '(?:\w+\.)*(\w+)'>")


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "num"
    if isinstance(value, str):
        return "str"
    return "other"


def _equal(a: Any, b: Any) -> bool | None:
    """SQL `=` over JSON values: NULL if either is null; different kinds are unequal."""
    if a is None or b is None:
        return None
    return _kind(a) == _kind(b) and a == b


def _ordered(op: Callable[[Any, Any], bool], a: Any, b: Any) -> bool | None:
    """SQL `<` etc.: only numbers with numbers and strings with strings; else NULL."""
    if a is None or b is None:
        return None
    ka = _kind(a)
    if ka != _kind(b) or ka not in ("num", "str"):
        return None
    return op(a, b)


def _position(clause: str, node: exp.Expression) -> str:
    """Where `node` sits in `clause`: its operator's token if found, else its first token."""
    starts = [n.meta["start"] for n in node.walk() if "start" in n.meta]
    offset = min(starts) if starts else 0
    word = type(node).__name__.upper()
    try:
        tokens = sqlglot.tokenize(clause)
    except SqlglotError:
        tokens = []
    for tok in tokens:  # the node's own operator is the first such token from its start
        if tok.start >= offset and tok.token_type.name == word:
            offset = tok.start
            break
    return _text_where(clause, offset)


def _text_where(text: str, offset: int) -> str:
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return f"line {line}, column {column}"


def _unterminated(clause: str) -> int | None:
    """Offset of the quote that opens an unterminated string or quoted name."""
    quote, start = "", 0
    for i, ch in enumerate(clause):
        if quote:
            if ch == quote:
                quote = ""  # a doubled quote re-opens at the next char: same result
        elif ch in "'\"`":
            quote, start = ch, i
    return start if quote else None


class _WhereCompiler:
    """SQL WHERE clause -> closure over a JSON object, with SQL's three-valued logic."""

    def __init__(self, clause: str, key: str) -> None:
        self.clause = clause
        self.key = key

    def compile(self) -> Callable[[Data], bool]:
        """The condition as a predicate; every failure is a ConfigError naming the key."""
        try:
            return self._compile()
        except RecursionError:  # the parser's limit: ~55+ nested parentheses
            raise ConfigError(f"{self.key}: the condition is nested too deeply") from None

    def _compile(self) -> Callable[[Data], bool]:
        try:
            tree = sqlglot.parse_one(self.clause)
        except ParseError as err:
            info = err.errors[0] if err.errors else {}
            where = f"line {info.get('line', 1)}, column {info.get('col', 1)}"
            what = _SQLGLOT_CLASS.sub(r"\1", info.get("description") or str(err))
            raise ConfigError(
                f"{self.key}: cannot parse {self.clause!r} at {where}: {what}"
            ) from None
        except TokenError:
            start = _unterminated(self.clause)
            where = _text_where(self.clause, start) if start is not None else "its end"
            raise ConfigError(
                f"{self.key}: cannot parse {self.clause!r} at {where}: unterminated quote"
            ) from None
        except SqlglotError as err:
            raise ConfigError(f"{self.key}: cannot parse {self.clause!r}: {err}") from None
        test = self.condition(tree)
        return lambda data: test(data) is True

    def unsupported(self, node: exp.Expression, why: str = "") -> ConfigError:
        alias = node.args.get("alias") if isinstance(node, exp.Alias) else None
        if isinstance(alias, exp.Identifier):  # `a = 0x10` parses as `a = 0 AS x10`
            node, why = alias, f"unexpected {alias.name!r}"
        why = why or f"unsupported syntax {type(node).__name__.upper()}"
        return ConfigError(
            f"{self.key}: {why} at {_position(self.clause, node)} in {self.clause!r}"
            f" (supported: {_SUPPORTED})"
        )

    def condition(self, node: exp.Expression) -> Callable[[Data], bool | None]:
        if isinstance(node, exp.Paren):
            return self.condition(node.this)
        if isinstance(node, exp.And | exp.Or):
            left, right = self.condition(node.this), self.condition(node.expression)
            return _and(left, right) if isinstance(node, exp.And) else _or(left, right)
        if isinstance(node, exp.Not):
            inner = self.condition(node.this)

            def negate(data: Data) -> bool | None:
                value = inner(data)
                return None if value is None else not value

            return negate
        if isinstance(node, exp.EQ | exp.NEQ):
            a, b = self.operand(node.this), self.operand(node.expression)
            if isinstance(node, exp.EQ):
                return lambda data: _equal(a(data), b(data))

            def differ(data: Data) -> bool | None:
                same = _equal(a(data), b(data))
                return None if same is None else not same

            return differ
        if type(node) in _ORDER:
            op = _ORDER[type(node)]
            a, b = self.operand(node.this), self.operand(node.expression)
            return lambda data: _ordered(op, a(data), b(data))
        if isinstance(node, exp.In):
            return self.in_list(node)
        if isinstance(node, exp.Is):
            if not isinstance(node.expression, exp.Null):
                raise self.unsupported(node, "only IS NULL / IS NOT NULL are supported")
            value = self.operand(node.this)
            return lambda data: value(data) is None
        if isinstance(node, exp.Column | exp.Dot | exp.Literal | exp.Boolean):
            raise self.unsupported(node, "expected a comparison (e.g. flag = TRUE)")
        raise self.unsupported(node)

    def in_list(self, node: exp.In) -> Callable[[Data], bool | None]:
        extra = [k for k in ("query", "unnest", "field") if node.args.get(k)]
        if extra or not node.expressions:
            raise self.unsupported(node, "IN needs a non-empty list of values")
        value = self.operand(node.this)
        options = [self.operand(e) for e in node.expressions]

        def member(data: Data) -> bool | None:
            v = value(data)
            if v is None:
                return None
            unknown = False
            for option in options:
                same = _equal(v, option(data))
                if same:
                    return True
                unknown = unknown or same is None
            return None if unknown else False

        return member

    def operand(self, node: exp.Expression) -> Getter:
        if isinstance(node, exp.Column | exp.Dot):
            path = self.path(node)
            return _getter(path)
        if isinstance(node, exp.Literal):
            const = self.literal(node)
            return lambda data: const
        if isinstance(node, exp.Neg) and isinstance(node.this, exp.Literal):
            const = self.literal(node.this)
            if not isinstance(const, int | float):
                raise self.unsupported(node, "'-' applies to numbers only")
            neg = -const
            return lambda data: neg
        if isinstance(node, exp.Boolean):
            flag = bool(node.this)
            return lambda data: flag
        if isinstance(node, exp.Null):
            return lambda data: None
        raise self.unsupported(node)

    def literal(self, node: exp.Literal) -> Any:
        text = str(node.this)
        if node.is_string:
            return text
        if _NUMBER.match(text):
            return int(text)
        try:
            return float(text)
        except ValueError:  # sqlglot reads `0E` as a number
            raise self.unsupported(node, f"{text!r} is not a number") from None

    def path(self, node: exp.Expression) -> list[str]:
        if isinstance(node, exp.Dot):
            if not isinstance(node.expression, exp.Identifier):
                raise self.unsupported(node)
            return [*self.path(node.this), node.expression.name]
        parts = node.parts if isinstance(node, exp.Column) else None  # `''.a`: Dot on a literal
        if not parts or any(not isinstance(p, exp.Identifier) for p in parts):
            raise self.unsupported(node, "expected a field name")
        return [p.name for p in parts]


def _and(left: Callable[[Data], bool | None], right: Callable[[Data], bool | None]) -> Any:
    def both(data: Data) -> bool | None:
        a = left(data)
        if a is False:
            return False
        b = right(data)
        if b is False:
            return False
        return None if a is None or b is None else True

    return both


def _or(left: Callable[[Data], bool | None], right: Callable[[Data], bool | None]) -> Any:
    def either(data: Data) -> bool | None:
        a = left(data)
        if a is True:
            return True
        b = right(data)
        if b is True:
            return True
        return None if a is None or b is None else False

    return either


def compile_where(clause: str, key: str = "filter") -> Callable[[Data], bool]:
    """A SQL WHERE clause as a predicate over a JSON object: True keeps the event.

    Fields are dotted paths (`group.group_country`; quote reserved words: `"select"`).
    A missing field or JSON null is SQL NULL, and a comparison with NULL is not true.
    `=`/`!=` between different JSON kinds are false/true (`1 = '1'` is false; true is
    not 1); `<` etc. compare numbers with numbers and strings with strings only.
    Anything else raises ConfigError naming the line and column.
    """
    return _WhereCompiler(clause, key).compile()


# --------------------------------------------------------------------------- route

_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
_TOKEN_BAD = re.compile(r"[^A-Za-z0-9_-]")
_TOKEN_OK = re.compile(r"^[A-Za-z0-9_-]+$")
MAX_ROUTE_TOKEN = 128


def _valid_subject(subject: str) -> bool:
    tokens = subject.split(".")
    return all(t and not any(c.isspace() or c in "*>{}" for c in t) for t in tokens)


def _route_token(value: Any, default: str) -> str:
    """A field value made safe as (part of) one subject token."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str | int | float):
        text = str(value)
    else:
        return default
    text = _TOKEN_BAD.sub("_", text)[:MAX_ROUTE_TOKEN]
    return text or default


def _compile_route(template: str, default: str, key: str) -> Callable[[Data], str] | None:
    """None for a template without fields; else a function of the event's JSON."""
    if not _TOKEN_OK.match(default):
        raise ConfigError(f"{key}_default: {default!r} must be letters, digits, '_' or '-'")
    parts: list[str | Getter] = []
    pos = 0
    for m in _PLACEHOLDER.finditer(template):
        parts.append(template[pos : m.start()])
        parts.append(_getter(_split_path(m.group(1), key)))
        pos = m.end()
    parts.append(template[pos:])
    sample = "".join(p if isinstance(p, str) else "x" for p in parts)
    if any(isinstance(p, str) and ("{" in p or "}" in p) for p in parts):
        raise ConfigError(f"{key}: unbalanced braces in {template!r}")
    if not _valid_subject(sample):
        raise ConfigError(
            f"{key}: {template!r} does not make a subject (dot-separated non-empty tokens,"
            " no spaces or wildcards)"
        )
    if len(parts) == 1:
        return None
    compiled = [p for p in parts if p != ""]

    def route(data: Data) -> str:
        return "".join(
            p if isinstance(p, str) else _route_token(p(data), default) for p in compiled
        )

    return route


# --------------------------------------------------------------------------- StreamLogic

Hook = Callable[[Data, Event], Data | None]
ENRICH_BUILTINS = ("received_at", "collector")


def _received_at(data: Data, event: Event) -> None:
    data["received_at"] = event.received_ms


def _describe(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"


class StreamLogic:
    """A stream's compiled logic; build it with `compile_logic`.

    `apply` runs validate -> enrich -> filter -> route on each event's JSON, never
    raises for a bad event, and passes events already `processed` through unchanged
    (so an SBML replay cannot run logic twice). A stream with no logic skips decoding.
    Picklable: it pickles as its config and recompiles on load.
    """

    def __init__(
        self,
        stream: str,
        cfg: LogicConfig,
        default_subject: str,
        collector: str,
        *,
        schema: Callable[[Data], str | None] | None,
        validate_hook: Callable[[Data], Any] | None,
        enrich: list[tuple[str, Hook]],
        keep: Callable[[Data], Any] | None,
        route: Callable[[Data], str] | None,
        subject: str,
    ) -> None:
        self.stream = stream
        self.cfg = cfg
        self.default_subject = default_subject
        self.collector = collector
        self._schema = schema
        self._validate_hook = validate_hook
        self._enrich = enrich
        self._keep = keep
        self._route = route
        self._subject = subject
        self._needs_data = any((schema, validate_hook, enrich, keep, route))

    def _fixed_subject(self, event: Event) -> str:
        """A constant route wins; else the subject the event came with, else the default."""
        return self._subject or event.subject or self.default_subject

    def __reduce__(self) -> tuple[Any, ...]:
        return (_recompile, (self.stream, self.cfg, self.default_subject, self.collector))

    def apply(self, events: Sequence[Event]) -> LogicResult:
        kept: list[Event] = []
        dropped: list[Event] = []
        invalid: list[tuple[Event, str]] = []
        replace = msgspec.structs.replace
        for event in events:
            if event.processed:
                kept.append(event)
            elif not self._needs_data:
                kept.append(replace(event, subject=self._fixed_subject(event), processed=True))
            else:
                outcome = self._one(event)
                if isinstance(outcome, Event):
                    kept.append(outcome)
                elif outcome is None:
                    dropped.append(event)
                else:
                    invalid.append((event, outcome))
        return LogicResult(kept, dropped, invalid)

    def _one(self, event: Event) -> Event | str | None:
        """The processed event, None if filtered out, or the reason it is invalid."""
        try:
            data = _decode_any(event.data)
        except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError) as err:
            return f"data is not JSON: {err}"
        if not isinstance(data, dict):
            return f"data is not a JSON object, got {_json_kind(data)}"
        if self._schema is not None:
            problem = self._schema(data)
            if problem:
                return problem
        if self._validate_hook is not None:
            try:
                verdict = self._validate_hook(data)
            except Exception as err:
                return f"validate_hook raised {_describe(err)}"
            if verdict is False:
                return "rejected by validate_hook"
            if isinstance(verdict, str) and verdict:
                return verdict
        for name, hook in self._enrich:
            try:
                new = hook(data, event)
            except Exception as err:
                return f"enrich {name} raised {_describe(err)}"
            if isinstance(new, dict):
                data = new
            elif new is not None:
                return f"enrich {name} returned {type(new).__name__}, expected dict or None"
        if self._keep is not None:
            try:
                if not self._keep(data):
                    return None
            except Exception as err:
                return f"filter raised {_describe(err)}"
        subject = self._route(data) if self._route is not None else self._fixed_subject(event)
        payload = event.data
        if self._enrich:
            try:
                payload = _encode(data)
            except Exception as err:
                return f"enriched event cannot be encoded: {_describe(err)}"
        return msgspec.structs.replace(event, subject=subject, data=payload, processed=True)


def _recompile(stream: str, cfg: LogicConfig, default_subject: str, collector: str) -> StreamLogic:
    return compile_logic(stream, cfg, default_subject, collector=collector)


def _wrap_user_enrich(fn: Callable[[Data], Any]) -> Hook:
    return lambda data, event: fn(data)


def compile_logic(
    stream_name: str, cfg: LogicConfig, default_subject: str, *, collector: str = ""
) -> StreamLogic:
    """Compile a stream's logic once; ConfigError naming `streams.NAME.logic.KEY` if bad.

    `collector` is the name the `collector` enrichment writes (default host:pid).
    """
    key = f"streams.{stream_name}.logic"
    collector = collector or f"{socket.gethostname()}:{os.getpid()}"
    schema = _compile_schema(cfg.validate, f"{key}.validate") if cfg.validate else None
    validate_hook = (
        load_hook(cfg.validate_hook, f"{key}.validate_hook") if cfg.validate_hook else None
    )
    enrich: list[tuple[str, Hook]] = []
    for i, spec in enumerate(cfg.enrich):
        if spec == "received_at":
            enrich.append((spec, _received_at))
        elif spec == "collector":
            enrich.append((spec, _collector_hook(collector)))
        elif _is_hook(spec):
            enrich.append((spec, _wrap_user_enrich(load_hook(spec, f"{key}.enrich[{i}]"))))
        else:
            raise ConfigError(
                f"{key}.enrich[{i}]: {spec!r} is neither a built-in"
                f" ({', '.join(ENRICH_BUILTINS)}) nor 'module:function'"
            )
    keep: Callable[[Data], Any] | None = None
    if cfg.filter.strip():
        if _is_hook(cfg.filter):
            keep = load_hook(cfg.filter, f"{key}.filter")
        else:
            keep = compile_where(cfg.filter, f"{key}.filter")
    subject = ""  # a constant route; "" keeps each event's own subject
    route = None
    if cfg.route:
        route = _compile_route(cfg.route, cfg.route_default, f"{key}.route")
        if route is None:
            subject = cfg.route
    elif not _TOKEN_OK.match(cfg.route_default):
        raise ConfigError(f"{key}.route_default: {cfg.route_default!r} is not a subject token")
    return StreamLogic(
        stream_name,
        cfg,
        default_subject,
        collector,
        schema=schema,
        validate_hook=validate_hook,
        enrich=enrich,
        keep=keep,
        route=route,
        subject=subject,
    )


def _collector_hook(name: str) -> Hook:
    def add(data: Data, event: Event) -> None:
        data["collector"] = name

    return add


def dead_letters(invalid: Sequence[tuple[Event, str]]) -> list[Event]:
    """Records for `deadletter.{stream}`: the reason plus the event as received.

    Each keeps its event's id (JetStream dedups per stream, so a replayed dead letter
    is not stored twice) and is marked processed (no logic runs on it again).
    """
    out = []
    for event, reason in invalid:
        try:
            _decode_any(event.data)
            original: Any = msgspec.Raw(event.data)
        except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
            original = event.data.decode("utf-8", "replace")
        record = {
            "id": event.id,
            "stream": event.stream,
            "reason": reason,
            "received_ms": event.received_ms,
            "event": original,
        }
        out.append(
            msgspec.structs.replace(
                event,
                subject=f"deadletter.{event.stream}",
                data=_encode(record),
                processed=True,
            )
        )
    return out


# --------------------------------------------------------------------------- group commit


class Overloaded(Exception):
    """Too many events already waiting to be flushed, or the committer is closing.

    The caller answers 503 with Retry-After; nothing of the refused request was taken.
    """


def event_bytes(event: Event) -> int:
    """An event's approximate size in a batch (what `max_bytes` counts)."""
    return len(event.data) + len(event.id) + len(event.subject) + len(event.token) + 16


class GroupCommitPolicy(msgspec.Struct, frozen=True):
    """When an open batch is flushed: count, size, or the oldest member's wait.

    `max_delay_ms = 0` means natural batching: flush as soon as the flusher is free,
    so batches grow only while a flush is in flight.
    """

    max_events: int = 1000
    max_bytes: int = 4 << 20
    max_delay_ms: float = 2.0

    def __post_init__(self) -> None:
        if self.max_events < 1 or self.max_bytes < 1 or self.max_delay_ms < 0:
            raise ValueError(f"bad group commit policy {self!r}")

    def should_flush(self, pending_events: int, pending_bytes: int, oldest_wait_ms: float) -> bool:
        """True if a batch this big, whose oldest member has waited this long, must go."""
        if pending_events <= 0:
            return False
        return (
            pending_events >= self.max_events
            or pending_bytes >= self.max_bytes
            or oldest_wait_ms >= self.max_delay_ms
        )

    def wait_ms(self, oldest_wait_ms: float) -> float:
        """How much longer the oldest member may wait before its batch is due."""
        return max(0.0, self.max_delay_ms - oldest_wait_ms)


R = TypeVar("R")


class _Batch:
    __slots__ = ("events", "nbytes", "opened", "future")

    def __init__(self, future: asyncio.Future[Any], opened: float) -> None:
        self.events: list[Event] = []
        self.nbytes = 0
        self.opened = opened
        self.future = future


def _consume_exception(fut: asyncio.Future[Any]) -> None:
    """Mark a batch's error as seen even if every submitter was cancelled."""
    if not fut.cancelled():
        fut.exception()


class GroupCommitter(Generic[R]):
    """Concurrent submitters share one `flush` call; each gets that call's result.

    Guarantees:
    - A submission is never split: its events are in one flush, contiguous, in
      submission order. A submission of `policy.max_events` or more is flushed alone.
    - Flushes start in the order their batches closed; at most `max_in_flight` run at
      once (1: strictly one after another). While they run, the next batch keeps
      filling (up to the policy's size bounds).
    - Every submitter of a batch gets `flush`'s return value, or its exception.
    - At most `max_pending_events` events are held (waiting or in flight); past that,
      `submit` raises `Overloaded` at once. A single request larger than the bound
      can never be accepted, so keep the per-request limit at or below it.
    - A cancelled submitter does not withdraw its events: they may still be flushed.

    Example::

        committer = GroupCommitter(logger_group.append, GroupCommitPolicy(500, 4 << 20, 2))
        await committer.submit(events)   # returns when this batch is on every replica
    """

    def __init__(
        self,
        flush: Callable[[list[Event]], Awaitable[R]],
        policy: GroupCommitPolicy,
        *,
        max_pending_events: int = 100_000,
        max_in_flight: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_pending_events < 1 or max_in_flight < 1:
            raise ValueError("max_pending_events and max_in_flight must be >= 1")
        self._flush = flush
        self.policy = policy
        self.max_pending_events = max_pending_events
        self.max_in_flight = max_in_flight
        self._clock = clock
        self._open: _Batch | None = None
        self._ready: deque[_Batch] = deque()
        self._pending = 0
        self._in_flight = 0
        self._closing = False
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.flushes = 0
        self.rejected = 0

    @property
    def pending_events(self) -> int:
        """Events accepted and not yet answered (waiting or being flushed)."""
        return self._pending

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def submit(self, events: Sequence[Event]) -> R:
        """Flush `events` with whatever else arrives in the window; return the flush result.

        Raises `Overloaded` (nothing taken) or whatever the batch's flush raised.
        """
        n = len(events)
        if n == 0:
            raise ValueError("submit needs at least one event")
        if self._closing:
            raise Overloaded("group committer is closing")
        if self._pending + n > self.max_pending_events:
            self.rejected += 1
            raise Overloaded(
                f"{self._pending} events pending, {n} more would pass {self.max_pending_events}"
            )
        loop = asyncio.get_running_loop()
        self._start(loop)
        size = sum(event_bytes(e) for e in events)
        policy = self.policy
        batch = self._open
        if batch is not None and (
            len(batch.events) + n > policy.max_events or batch.nbytes + size > policy.max_bytes
        ):
            self._seal()
            batch = None
        if batch is None:
            batch = self._open = _Batch(loop.create_future(), self._clock())
            batch.future.add_done_callback(_consume_exception)
        batch.events.extend(events)
        batch.nbytes += size
        self._pending += n
        if len(batch.events) >= policy.max_events or batch.nbytes >= policy.max_bytes:
            self._seal()
        assert self._wake is not None
        self._wake.set()
        return await asyncio.shield(batch.future)

    async def aclose(self) -> None:
        """Flush what is pending, wait for it, and refuse further submits."""
        self._closing = True
        if self._driver is None:
            return
        assert self._wake is not None
        self._wake.set()
        await asyncio.shield(self._driver)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._driver is None or self._driver.done():
            self._wake = asyncio.Event()
            self._driver = loop.create_task(self._drive(), name="group-commit")

    def _seal(self) -> None:
        if self._open is not None:
            self._ready.append(self._open)
            self._open = None

    async def _drive(self) -> None:
        """Close batches when the policy says so and start flushes while slots are free."""
        wake = self._wake
        assert wake is not None
        try:
            while True:
                wake.clear()
                timeout: float | None = None
                batch = self._open
                if batch is not None and self._in_flight < self.max_in_flight:
                    waited = (self._clock() - batch.opened) * 1000.0
                    if self._closing or self.policy.should_flush(
                        len(batch.events), batch.nbytes, waited
                    ):
                        self._seal()
                    else:
                        timeout = self.policy.wait_ms(waited) / 1000.0
                while self._ready and self._in_flight < self.max_in_flight:
                    self._launch(self._ready.popleft())
                if self._closing and self._open is None and not self._ready and not self._in_flight:
                    return
                if timeout is None or timeout > 0:
                    try:
                        async with asyncio.timeout(timeout):
                            await wake.wait()
                    except TimeoutError:
                        pass
        except BaseException as err:
            self._fail_all(err)
            raise

    def _launch(self, batch: _Batch) -> None:
        self._in_flight += 1
        task = asyncio.get_running_loop().create_task(self._run(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: _Batch) -> None:
        try:
            result = await self._flush(batch.events)
        except asyncio.CancelledError:
            batch.future.cancel()
            raise
        except Exception as err:
            if not batch.future.done():
                batch.future.set_exception(err)
        else:
            if not batch.future.done():
                batch.future.set_result(result)
        finally:
            self._in_flight -= 1
            self._pending -= len(batch.events)
            self.flushes += 1
            if self._wake is not None:
                self._wake.set()

    def _fail_all(self, err: BaseException) -> None:
        """The driver died: answer every waiting submitter instead of leaving it hanging."""
        failure = err if isinstance(err, Exception) else Overloaded("group committer stopped")
        batches = list(self._ready) + ([self._open] if self._open is not None else [])
        self._ready.clear()
        self._open = None
        for batch in batches:
            self._pending -= len(batch.events)
            if not batch.future.done():
                batch.future.set_exception(failure)
