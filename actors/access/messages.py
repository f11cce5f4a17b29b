"""A stream message as the access tier serves it, and where such messages come from.

Every protocol (WebSocket, SSE, polling, webhooks) sends the same `StreamMessage` objects
out of a feed's ring (actors/access/fanout.py): the payload's objects are kept only for a
filter that needs them (and built once then), it is rendered once per distinct filter,
and each protocol's frame is built once per distinct frame shape (`frame`), so a
thousand clients with one filter cost one render and one frame.
A `Reader` yields them in sequence order (actors/access/reader.py reads JetStream; the
fan-out tests read memory). Not the collection tier's envelope (runtime/data/events.py): this
is what a stream holds, as a client is sent it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Protocol, TypeVar

import msgspec

from runtime.data.events import skippable_json
from runtime.data.query import Filter

__all__ = [
    "KV_OP_HEADER",
    "KV_PREFIX",
    "MAX_SHAPES",
    "OpenReader",
    "Reader",
    "StreamMessage",
    "kv_message",
    "surely_json",
]

KV_PREFIX = "KV_"
KV_OP_HEADER = "KV-Operation"
_json = msgspec.json.Encoder()
_decode = msgspec.json.Decoder()
_skim = msgspec.json.Decoder(msgspec.Raw)  # checks the syntax, builds nothing
# msgspec raises UnicodeDecodeError, not DecodeError, for bad UTF-8 inside a string
_NOT_JSON = (msgspec.DecodeError, UnicodeDecodeError)
_MISS: Any = object()
T = TypeVar("T")
# frame shapes kept per message: a ring of 8,192 messages stays bounded however many
# distinct shapes (subscription ids x filters) its clients ask for; past this a frame is
# built per client, as if there were no cache
MAX_SHAPES = 16


class StreamMessage:
    """One stream message, decoded at most once and rendered once per distinct filter."""

    __slots__ = ("_data", "_frames", "_json", "_views", "raw", "seq", "subject")

    def __init__(self, seq: int, subject: str, raw: bytes, data: Any = ...) -> None:
        self.seq = seq
        self.subject = subject
        self.raw = raw
        self._data = data
        self._json: bytes | None = None
        self._views: dict[Filter, bytes | None] | None = None
        self._frames: dict[Hashable, Any] | None = None

    @property
    def data(self) -> Any:
        """The payload as JSON; a payload that is not JSON is its text."""
        if self._data is ...:
            try:
                self._data = _decode.decode(self.raw)
                raw = self.raw.strip()
                if raw and b"\n" not in raw and b"\r" not in raw:
                    self._json = raw  # valid, one line: reuse the producer's bytes
            except _NOT_JSON:
                self._data = self.raw.decode("utf-8", "replace")
        return self._data

    @property
    def json(self) -> bytes:
        """The payload as one line of JSON.

        A payload that is one line of valid JSON is served as stored, so a subscriber with no
        filter never keeps its objects: `surely_json` checks it without building any (a
        quarter of a decode's CPU on a 1 KB event); only what it cannot vouch for is
        checked by a decode whose objects are dropped at once. Anything else gets the
        bytes `data` re-encoded.
        """
        if self._json is None:
            if self._data is ...:
                raw = self.raw.strip()
                if raw and b"\n" not in raw and b"\r" not in raw:
                    if surely_json(self.raw):
                        self._json = raw
                        return raw
                    try:
                        _decode.decode(self.raw)  # the whole payload, as `data` decodes it
                    except _NOT_JSON:
                        self._data = self.raw.decode("utf-8", "replace")  # served as text
                    else:
                        self._json = raw
                        return raw
            data = self.data
            if self._json is None:
                self._json = _json.encode(data)
        return self._json

    def view(self, flt: Filter) -> bytes | None:
        """The payload as `flt` selects it (JSON, one line), or None if it does not match."""
        if flt.match_all and flt.select_all:
            return self.json
        views = self._views
        if views is None:
            views = self._views = {}
        elif flt in views:
            return views[flt]
        data = self.data
        out: bytes | None = None
        if flt.matches(data, self.subject):
            out = self.json if flt.select_all else _json.encode(flt.select(data, self.subject))
        views[flt] = out
        return out

    def frame(self, shape: Hashable, build: Callable[[StreamMessage], T]) -> T:
        """What `build` makes of this message, built once per distinct `shape` (protocol,
        subscription id, filter: whatever the bytes depend on besides the message) and the
        same object for every client that asks with an equal shape. At most MAX_SHAPES
        shapes are kept; past that `build` runs for each call."""
        frames = self._frames
        if frames is None:
            frames = self._frames = {}
        else:
            hit = frames.get(shape, _MISS)
            if hit is not _MISS:
                return hit
        out = build(self)
        if len(frames) < MAX_SHAPES:
            frames[shape] = out
        return out

    def __repr__(self) -> str:
        return f"StreamMessage(seq={self.seq}, subject={self.subject!r})"


def surely_json(raw: bytes) -> bool:
    """True only if msgspec's full decode (as `StreamMessage.data` runs it) accepts `raw`;
    False when it refuses it or may (the full decode decides then).

    The raw decode checks the syntax (strings, escapes, numbers' grammar, nesting); what
    the full decode checks on top when it builds values (UTF-8 inside strings, numbers past
    a double's range) is the collector's rule, `runtime.data.events.skippable_json`."""
    try:
        _skim.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return False
    return skippable_json(raw)


def kv_message(seq: int, subject: str, raw: bytes, headers: dict[str, str] | None) -> StreamMessage:
    """A KV bucket message as the change it is: `{"key","op","value","revision"}`."""
    op = ((headers or {}).get(KV_OP_HEADER) or "PUT").lower()
    key = subject.split(".", 2)[2] if subject.count(".") >= 2 else subject
    value: Any = None
    if op == "put":
        try:
            value = _decode.decode(raw)
        except _NOT_JSON:
            value = raw.decode("utf-8", "replace")
    return StreamMessage(seq, subject, raw, {"key": key, "op": op, "value": value, "revision": seq})


class Reader(Protocol):
    """A source of stream messages from a start sequence on, in sequence order."""

    async def fetch(self, max_events: int, timeout: float) -> list[StreamMessage]:
        """Up to `max_events` next messages; [] when none came within `timeout`."""
        ...

    async def close(self) -> None: ...


OpenReader = Callable[[int], Awaitable[Reader]]
