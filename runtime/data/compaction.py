"""Per-key compaction (`[streams.X.compact]`): the latest event per key, as Kafka's compacted
topics keep it, on JetStream's own per-subject limit.

Each event's key (the JSON value at `key`, a dotted path) becomes the last token of its
subject, and the stream is made with `max_msgs_per_subject = keep`, so JetStream keeps the
last `keep` events of every key and lets older ones go. The subject is derived by the
stream's logic (`CompactingLogic`, in the collector, or in the bridge for events logged
before their logic ran): a pure function of the event's JSON, so an event replayed from the
message logger gets the same subject again, and `Nats-Msg-Id` dedup (per stream, whatever
the subject) keeps exactly-once into the stream, as on any stream.

Key tokens (`key_token`), stable and subject-safe for any scalar JSON value:

- a string of letters, digits, `_` and `-` (1 to 128 characters) is its own token: `N10156`;
- an integer (a number with an integral value: 1, 1.0 and 1e0 are one key) is `=` and its
  decimal digits: `=42`, `=-7`;
- any other string, number or boolean is `~` and the base64url (no padding) of its JSON
  text: `"a.b"` is `~ImEuYiI`, 1.5 is `~MS41`, true is `~dHJ1ZQ`;
- a token that would pass 128 characters is `~~` and the base64url of the SHA-256 of the
  JSON text (45 characters): still one token per key, but not readable back (`token_key`
  answers it as unknown).

Numbers key by their exact value as written, never by the nearest binary float: JSON text is
decoded with its fractional numbers as `Decimal`, so `9007199254740993.0` is the integer
9007199254740993 (`=9007199254740993`), not the float 9007199254740992 another key has. A
fraction a float holds exactly as written (1.5, 0.1 as its shortest repr) keeps the float's
JSON text; one with more digits than a float holds is keyed by its normalised decimal text,
which no float's text equals.

The four forms cannot meet (`=`, `~` are not in the plain alphabet, `~` not in base64url),
so two distinct keys never share a token but by a SHA-256 collision. An event whose key is
missing, null, an object or an array is invalid: it goes to `deadletter.<stream>` with the
reason (`compaction key ...`), never dropped.

Compaction is per subject: with a `route` template the key is kept once per routed subject
(`latest` answers the newest of them). Subjects ending in `>` cannot hold a key token and
are refused for a compacted stream.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from runtime.data.events import Event, json_kind
from runtime.data.logic import LogicResult, StreamLogic, compile_logic
from runtime.data.query import getter
from runtime.errors import ConfigError, TierflowError

if TYPE_CHECKING:
    from runtime.config import StreamConfig

__all__ = [
    "MAX_TOKEN",
    "check_update",
    "CompactConfig",
    "CompactingLogic",
    "KeyReader",
    "NoKey",
    "Scalar",
    "compacted_subject",
    "describe",
    "event_token",
    "decode_exact",
    "key_filters",
    "key_token",
    "key_value",
    "lookup_subjects",
    "max_msgs_per_subject",
    "stream_logic",
    "stream_subjects",
    "target_subject",
    "token_key",
    "token_of",
]

MAX_TOKEN = 128
MAX_DIGITS = 4_000  # an integral number past this many digits keys by its decimal text
_PLAIN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_INT_TOKEN = re.compile(r"^=-?(0|[1-9][0-9]*)$")
_INT_PREFIX, _JSON_PREFIX, _HASH_PREFIX = "=", "~", "~~"
_json = msgspec.json.Encoder()
# fractional numbers as written: a float would merge keys that differ past its 53 bits
decode_exact = msgspec.json.Decoder(float_hook=Decimal).decode
_decode = decode_exact
Scalar = str | int | float | bool | Decimal


class CompactConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """`[streams.X.compact]`: `key` is the dotted JSON path of each event's key; JetStream
    keeps the last `keep` events of every key (`max_msgs_per_subject`)."""

    key: str
    keep: Annotated[int, msgspec.Meta(ge=1)] = 1

    def __post_init__(self) -> None:
        parts = self.key.split(".")
        if not self.key or any(not p.strip() or p != p.strip() for p in parts):
            raise ValueError(f"key: {self.key!r} is not a dotted field path (e.g. 'user.id')")

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.key.split("."))


class NoKey(TierflowError, ValueError):
    """An event has no usable compaction key; the message is the dead-letter reason."""


# --------------------------------------------------------------------------- keys and tokens


def key_value(data: Any, path: Sequence[str]) -> Scalar:
    """The scalar key at `path` of a decoded event; NoKey saying why there is none."""
    if not isinstance(data, dict):
        raise NoKey(f"the event is a JSON {json_kind(data)}, not an object")
    value = getter(path)(data)
    if value is None:
        raise NoKey(f"missing (or null) field {'.'.join(path)}")
    if isinstance(value, dict | list):
        raise NoKey(f"field {'.'.join(path)} is a JSON {json_kind(value)}, not a scalar")
    return value


def key_token(value: Scalar) -> str:
    """The subject token of a key value (see the module doc for the forms)."""
    if isinstance(value, str) and _PLAIN.match(value):
        return value
    value = _exact(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 1.0 and 1 are one key; NaN and infinities are not integers
    if isinstance(value, int) and not isinstance(value, bool):
        text = f"{_INT_PREFIX}{value}"
        if len(text) <= MAX_TOKEN:
            return text
    raw = _number_text(value) if isinstance(value, Decimal) else _json.encode(value)
    token = _JSON_PREFIX + _b64(raw)
    if len(token) <= MAX_TOKEN:
        return token
    return _HASH_PREFIX + _b64(hashlib.sha256(raw).digest())


def _exact(value: Scalar) -> Scalar:
    """A decoded number in the form its token is made from: an integral one as an int, a
    fraction a float holds exactly as written as that float, any other as a Decimal."""
    if not isinstance(value, Decimal) or not value.is_finite():
        return value
    if value.adjusted() > MAX_DIGITS:  # 1e999999999 as an int would take the memory
        return value
    if value == value.to_integral_value():
        return int(value)
    as_float = float(value)
    if Decimal(repr(as_float)) == value:
        return as_float
    return value


def _number_text(value: Decimal) -> bytes:
    """The JSON text of a number no float holds, canonical (digits without trailing zeros,
    then the exponent), so 0.10000000000000000001 and 1.0000000000000000001e-1 are one key.
    By hand: `Decimal.normalize` rounds to the context's precision, merging long keys."""
    sign, digits, exponent = value.as_tuple()
    text = "".join(map(str, digits)).rstrip("0") or "0"
    exponent = int(exponent) + len(digits) - len(text)
    return f"{'-' if sign else ''}{text}e{exponent}".encode()


def token_key(token: str) -> tuple[bool, Any]:
    """(True, the key value) of a token, or (False, None) for a hashed (or foreign) one."""
    if token.startswith(_HASH_PREFIX):
        return False, None
    if token.startswith(_JSON_PREFIX):
        try:
            body = token[1:]
            return True, _exact(_decode(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))))
        except (ValueError, msgspec.DecodeError):
            return False, None
    if _INT_TOKEN.match(token):
        return True, int(token[1:])
    if _PLAIN.match(token):
        return True, token
    return False, None


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def event_token(data: bytes, path: Sequence[str]) -> str:
    """The key token of an event's JSON body; NoKey saying why there is none."""
    try:
        decoded = _decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as err:
        raise NoKey(f"data is not JSON: {err}") from None
    return key_token(key_value(decoded, path))


class KeyReader:
    """`event_token` for one key path, fast: the body is decoded into a struct holding only
    the path's fields (the rest is skipped, not built), about a third of a full decode on
    a flight; anything unusual (no key, not an object, not JSON) goes the full way, which
    says why."""

    def __init__(self, path: Sequence[str]) -> None:
        self.path = tuple(path)
        node: Any = Any
        for i, name in reversed(list(enumerate(self.path))):
            field = msgspec.field(default=msgspec.UNSET, name=name)
            inner = node if i == len(self.path) - 1 else node | None
            node = msgspec.defstruct(f"_Key{i}", [("v", inner, field)])
        self._decoder = msgspec.json.Decoder(node, float_hook=Decimal)

    def token(self, data: bytes) -> str:
        try:
            node: Any = self._decoder.decode(data)
            for _ in self.path[1:]:
                node = node.v
            value = node.v
        except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError, AttributeError):
            value = None  # the full way says why (or finds it fine after all)
        if isinstance(value, str | int | Decimal):  # bool is an int; UNSET, None are not
            return key_token(value)
        return event_token(data, self.path)


# --------------------------------------------------------------------------- subjects


def compacted_subject(subject: str, token: str) -> str:
    return f"{subject}.{token}"


def token_of(subject: str) -> str:
    """The key token of a compacted stream's subject: its last token."""
    return subject.rsplit(".", 1)[-1]


def _check_subjects(stream: str, subjects: Sequence[str]) -> None:
    for s in subjects:
        if s.endswith(">"):
            raise ConfigError(
                f"streams.{stream}.compact: subject {s!r} ends in '>', which leaves no place "
                "for the key token; use subjects without '>' ('raw.x' or 'raw.x.*')"
            )


def stream_subjects(sc: StreamConfig, name: str = "") -> list[str]:
    """The subjects JetStream captures for a configured stream: each with one more token
    (the key) when the stream is compacted."""
    if sc.compact is None:
        return list(sc.subjects)
    _check_subjects(name or "?", sc.subjects)
    return [f"{s}.*" for s in sc.subjects]


def describe(sc: StreamConfig | None) -> str:
    """How a stream keeps its events, for listings: "" or "compacted by <key>[, keep N]"."""
    if sc is None or sc.compact is None:
        return ""
    keep = f", keep {sc.compact.keep}" if sc.compact.keep != 1 else ""
    return f"compacted by {sc.compact.key}{keep}"


def check_update(name: str, sc: StreamConfig, per_subject: int | None, messages: int) -> None:
    """Refuse to turn compaction on for a stream that already holds events: JetStream
    would trim the events stored without a key down to the last one (checked on
    nats-server 2.15.1), silently. ConfigError saying what to do instead."""
    if sc.compact is None or (per_subject or 0) > 0 or not messages:
        return
    raise ConfigError(
        f"streams.{name}.compact: stream {name!r} holds {messages} events stored without a "
        "key; turning compaction on would keep only the last of them. Compact a new stream "
        "(another name), or purge this one first"
    )


def max_msgs_per_subject(sc: StreamConfig) -> int:
    """JetStream's per-subject limit for a configured stream (-1: none)."""
    return sc.compact.keep if sc.compact is not None else -1


def lookup_subjects(subjects: Sequence[str], token: str) -> list[str]:
    """The subjects (patterns when the stream's have wildcards) a key's events are on."""
    return [compacted_subject(s, token) for s in subjects]


def key_filters(subjects: Sequence[str]) -> list[str]:
    """Subject filters matching every key of a compacted stream with these subjects."""
    return [f"{s}.*" for s in subjects]


def target_subject(event: Event, compacted: frozenset[str]) -> str:
    """A subject standing for `event`'s when asking which stream captures it: on a
    compacted stream every key's subject has the same answer, so lookups (and their cache)
    go by one placeholder key instead of one per key."""
    if event.stream in compacted and "." in event.subject:
        return compacted_subject(event.subject.rsplit(".", 1)[0], "_")
    return event.subject


# --------------------------------------------------------------------------- the logic


class CompactingLogic:
    """A stream's logic followed by the key: every event the logic keeps gets its key token
    as one more subject token, or becomes invalid (dead letter) when it has no key. Events
    already processed pass unchanged (their subject was derived when they were), except one
    still on a bare configured subject (logged before compaction was configured)."""

    def __init__(self, inner: StreamLogic, compact: CompactConfig, subjects: Sequence[str]) -> None:
        _check_subjects(inner.stream, subjects)
        self.inner = inner
        self.stream = inner.stream
        self.compact = compact
        self.subjects = tuple(subjects)
        self._key = KeyReader(compact.path)
        self._bare = frozenset(s for s in subjects if "*" not in s)

    def __reduce__(self) -> tuple[Any, ...]:
        return (CompactingLogic, (self.inner, self.compact, self.subjects))

    def apply(self, events: Sequence[Event]) -> LogicResult:
        result = self.inner.apply(events)
        if not result.kept:
            return result
        passed = {id(e) for e in events if e.processed and e.subject not in self._bare}
        received = {e.id: e for e in events if not e.processed}
        kept: list[Event] = []
        invalid = list(result.invalid)
        for e in result.kept:
            if id(e) in passed:
                kept.append(e)
                continue
            try:
                token = self._key.token(e.data)
            except NoKey as why:
                invalid.append((received.get(e.id, e), f"compaction key: {why}"))
                continue
            subject = f"{e.subject}.{token}"  # compacted_subject
            kept.append(Event(e.id, e.stream, subject, e.data, e.received_ms, True, e.token))
        return LogicResult(kept, result.dropped, invalid)


def stream_logic(name: str, sc: StreamConfig) -> StreamLogic | CompactingLogic:
    """A configured stream's whole logic: `[streams.X.logic]`, then its compaction key."""
    logic = compile_logic(name, sc.logic, sc.subjects[0])
    if sc.compact is None:
        return logic
    return CompactingLogic(logic, sc.compact, sc.subjects)
