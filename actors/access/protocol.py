"""The gateway's wire vocabulary (docs/contracts.md): close codes, refusals, stream names,
WebSocket client messages and start positions; how a refusal is answered over HTTP.

Positions are stream sequences. `"from": N` (and `from=N`) is inclusive: delivery starts AT
N; `"after": N` (and `after=N`, `Last-Event-ID: N`) starts after N. `"new"` is what comes
next, `"all"` the oldest held, `"last"` the newest one, `"cursor"` the server-side cursor
(actors/access/cursors.py). A sequence that aged out of the stream starts at the oldest
one still held. Nothing here does I/O.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec
from aiohttp import web

from actors.access.messages import KV_PREFIX
from runtime.config import Overflow
from runtime.data.query import FilterError
from runtime.errors import TierflowError

__all__ = [
    "CLOSE_BAD_MESSAGE",
    "CLOSE_FORBIDDEN",
    "CLOSE_GOING_AWAY",
    "CLOSE_TOO_SLOW",
    "CLOSE_UNAUTHORIZED",
    "CLOSE_UNKNOWN_STREAM",
    "Ack",
    "Problem",
    "SlowDown",
    "StartPosition",
    "StreamRef",
    "Subscribe",
    "Unsubscribe",
    "first_seq_to_deliver",
    "parse_start",
    "stream_ref",
]

CLOSE_BAD_MESSAGE = 4400
CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_UNKNOWN_STREAM = 4404
CLOSE_TOO_SLOW = 4408
CLOSE_GOING_AWAY = 1001
MAX_ID = 200  # characters of a subscription or client id

StartPosition = Literal["new", "all", "last", "cursor"] | int
_STREAM_NAME = re.compile(r"^[A-Za-z0-9_-]{1,200}$")
_json = msgspec.json.Encoder()


class Problem(TierflowError):
    """A request refused: HTTP `status` (WebSocket close 4000+status) and the reason."""

    def __init__(self, status: int, reason: str, **extra: Any) -> None:
        self.status = status
        self.reason = reason
        self.extra = extra
        super().__init__(reason)


def filter_problem(err: FilterError) -> Problem:
    return Problem(400, f"bad filter: {err.reason}", line=err.line, column=err.column)


def no_cursor(client: str, sid: str, first_seq: int | None) -> Problem:
    """410: the named cursor does not exist (for this token) or expired."""
    why = (
        f"no cursor for subscription {sid!r} of client {client!r} "
        "(none made with this token, or it expired)"
    )
    if first_seq is None:
        return Problem(410, f"{why}; give the stream to learn its oldest sequence")
    return Problem(
        410,
        f"{why}; the oldest sequence still available is {first_seq}: subscribe from it "
        "(or from a seq of your own) to read on",
        first_seq=first_seq,
    )


# --------------------------------------------------------------------------- streams


class StreamRef(msgspec.Struct, frozen=True):
    """A stream as clients name it (`results`, `kv:results`) and as JetStream does."""

    public: str
    js: str
    kv: bool


def stream_ref(name: str) -> StreamRef:
    """`kv:<bucket>` (or `KV_<bucket>`) is a KV bucket's change stream; else a stream."""
    if not isinstance(name, str) or not name:
        raise Problem(400, "stream is required")
    if name.startswith("kv:"):
        js, public = KV_PREFIX + name[3:], name
    elif name.startswith(KV_PREFIX):
        js, public = name, "kv:" + name[len(KV_PREFIX) :]
    else:
        js, public = name, name
    if not _STREAM_NAME.match(js):
        raise Problem(404, f"unknown stream {name!r}: not a valid stream name")
    return StreamRef(public, js, js.startswith(KV_PREFIX))


# --------------------------------------------------------------------------- start positions


def parse_start(value: Any) -> StartPosition:
    """A start position: "new" | "all" | "last" | "cursor" | a sequence >= 0 (inclusive)."""
    if isinstance(value, bool):
        raise Problem(400, f"from must be new, all, last, cursor or a sequence, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise Problem(400, f"from must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        if value in ("new", "all", "last", "cursor"):
            return value  # type: ignore[return-value]
        if value.isdigit():
            return int(value)
    raise Problem(400, f"from must be new, all, last, cursor or a sequence, got {value!r}")


def first_seq_to_deliver(start: StartPosition, first_seq: int, last_seq: int) -> int:
    """The first sequence a client's start position names (pure; "cursor" is looked up by
    the caller): new = after the last, all = the first, last = the last one, N = N (a
    sequence that aged out starts at the first held)."""
    if start == "new":
        return last_seq + 1
    if start == "all":
        return max(1, first_seq)
    if start == "last":
        return max(1, last_seq)
    assert isinstance(start, int)
    return max(1, start)


# --------------------------------------------------------------------------- WS messages


class _Op(msgspec.Struct, tag_field="op", forbid_unknown_fields=False):
    pass


class Subscribe(_Op, tag="subscribe"):
    id: str
    stream: str | None = None
    filter: str = ""
    start: int | str | None = msgspec.field(default=None, name="from")
    after: int | None = None
    client: str | None = None
    ack: bool = False
    policy: Overflow | None = None


class Ack(_Op, tag="ack"):
    id: str
    seq: int


class SlowDown(_Op, tag="slow_down"):
    id: str
    max_rate: float | None = None


class Unsubscribe(_Op, tag="unsubscribe"):
    id: str


ClientOp = Subscribe | Ack | SlowDown | Unsubscribe
_ops = msgspec.json.Decoder(ClientOp)
OPS_HINT = "expected {'op': 'subscribe'|'ack'|'slow_down'|'unsubscribe', 'id': ...}"


def decode_op(text: str) -> ClientOp:
    """One client frame; msgspec.DecodeError (not JSON) or ValidationError (bad message)."""
    return _ops.decode(text)


def id_of(text: str) -> str | None:
    """The `id` of a frame that failed to decode, if it has a readable one (for its error)."""
    try:
        raw = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return None
    sid = raw.get("id") if isinstance(raw, dict) else None
    return sid if isinstance(sid, str) else None


def close_reason(reason: str) -> bytes:
    """A close frame carries at most 123 bytes of reason; cut on a character boundary."""
    return reason.encode()[:123].decode("utf-8", "ignore").encode()


# --------------------------------------------------------------------------- HTTP answers


def reply(status: int, body: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status, body=_json.encode(body), content_type="application/json", headers=headers
    )


def refusal(p: Problem) -> web.Response:
    """A Problem as a JSON answer (`{"error", ...extra}`); a 401 names the Bearer scheme."""
    headers = {"WWW-Authenticate": "Bearer"} if p.status == 401 else None
    return reply(p.status, {"error": p.reason, **p.extra}, headers)


def int_param(request: web.Request, name: str, default: int | None, lo: int = 0) -> int | None:
    """A query parameter as an integer >= `lo`; Problem 400 otherwise."""
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise Problem(400, f"{name} must be an integer, got {raw!r}") from None
    if value < lo:
        raise Problem(400, f"{name} must be >= {lo}, got {value}")
    return value
