"""Stream-pattern source connectors: we are the CLIENT of a long-lived source (book ch. 2).

Three aiohttp clients share one interface: iterate a source and get `Frame(pos, data)`
until it is stopped or runs out of reconnect attempts.

    source = source_from_url("ws://127.0.0.1:9000/v1/stream", "ws", start_pos=1200)
    async for frame in source:      # reconnects by itself, with backoff and jitter
        buffer.append(frame)
    source.stop()                   # from anywhere: the iteration ends cleanly

- `WebSocketSource`: one frame per WebSocket message.
- `HttpNdjsonSource`: one frame per line of a chunked HTTP response.
- `SseSource`: one frame per `text/event-stream` event; `id:` is the position.

Positions. A positioned source numbers its frames: tierflow's envelope
`{"pos": N, "event": {...}}` (the replay server's `/v1/stream`, resumed with `?from=N`) for
WebSocket and NDJSON, the integer `id:` field for SSE (resumed with `Last-Event-ID: N-1`).
Every (re)connect asks for the next position not yet yielded, and frames are yielded in
position order with none repeated: a frame below the next position is dropped (`repeats`),
a jump ahead is counted (`gaps`, `missed`). An unpositioned source yields `pos=None`; what a
reconnect loses cannot be known, so it is measured instead: frames per connection, time
disconnected, and an estimate of the frames missed (the last connection's rate times the
downtime). `stats()` reports all of it.

Reconnects use `runtime.supervision.policy.backoff_delay`: the attempt count grows with each
connection that fails or ends without a frame and falls back to zero after one that
delivered; with `max_attempts` set, that many failures in a row end the iteration with
`SourceUnreachable`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import aiohttp
import msgspec
from yarl import URL

from runtime.errors import TierflowError
from runtime.supervision.policy import Backoff, backoff_delay

__all__ = [
    "Frame",
    "HttpNdjsonSource",
    "SourceStats",
    "SourceUnreachable",
    "SseSource",
    "StreamSource",
    "WebSocketSource",
    "source_from_url",
]

log = logging.getLogger(__name__)

DEFAULT_BACKOFF = Backoff(base_s=0.1, factor=2.0, cap_s=5.0, jitter=0.5)
MAX_LINE_BYTES = 1 << 20  # one NDJSON line or SSE event; a longer one is a broken source
_KEPT_CONNECTIONS = 100  # per-connection frame counts kept in stats


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame as the source sent it: `data` is the event's bytes (the envelope's `event`
    for a positioned source), `pos` its position or None."""

    pos: int | None
    data: bytes


class SourceUnreachable(TierflowError, RuntimeError):
    """The source failed or carried nothing `max_attempts` connections in a row."""


class _Envelope(msgspec.Struct):
    pos: int
    event: msgspec.Raw


_decode_envelope = msgspec.json.Decoder(_Envelope).decode


@dataclass
class SourceStats:
    """What a source did. `gaps` counts breaks in continuity: positioned, a jump ahead (with
    `missed` positions); unpositioned, every reconnect (with `downtime_s` and `est_missed`
    frames, the measured size of what may be lost). `repeats`: positioned frames dropped as already
    yielded. `malformed`: frames of a positioned source without a readable position."""

    frames: int = 0
    connects: int = 0
    reconnects: int = 0
    failures: int = 0
    gaps: int = 0
    missed: int = 0
    repeats: int = 0
    malformed: int = 0
    downtime_s: float = 0.0
    est_missed: float = 0.0
    position: int | None = None
    last_error: str | None = None
    frames_per_connection: list[int] = field(default_factory=list)


def estimate_missed(frames: int, connected_s: float, downtime_s: float) -> float:
    """Frames an unpositioned source probably sent while we were away: the rate of the last
    connection times the downtime (0 when the connection carried nothing or lasted no time)."""
    if frames <= 0 or connected_s <= 0 or downtime_s <= 0:
        return 0.0
    return frames / connected_s * downtime_s


class StreamSource(ABC):
    """Base of the connectors: reconnect loop, positions, stats and stopping.

    Args:
        url: where the source lives.
        start_pos: first position wanted (positioned sources); None: wherever the source
            starts when asked for nothing in particular.
        positioned: whether frames carry positions (see the module doc); each subclass has
            its default.
        stop: an event that ends the iteration when set (`stop()` sets it too).
        max_attempts: failures in a row before `SourceUnreachable`; None: retry until stopped.
        backoff: the reconnect delays; `rng` draws their jitter.
        connect_timeout_s: bound on opening a connection.
        read_timeout_s: a connection silent this long is dropped and reopened (None: never;
            WebSocket pings detect a dead peer anyway).
    """

    kind: ClassVar[str] = ""

    def __init__(
        self,
        url: str,
        *,
        start_pos: int | None = None,
        positioned: bool | None = None,
        stop: asyncio.Event | None = None,
        max_attempts: int | None = None,
        backoff: Backoff = DEFAULT_BACKOFF,
        rng: random.Random | None = None,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if start_pos is not None and start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {start_pos}")
        if max_attempts is not None and max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1 or None, got {max_attempts}")
        self.url = url
        self.positioned = self._default_positioned(url) if positioned is None else positioned
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._stop = stop if stop is not None else asyncio.Event()
        self._rng = rng or random.Random()
        self._clock = clock
        self._stats = SourceStats(position=start_pos)
        self._per_conn: deque[int] = deque(maxlen=_KEPT_CONNECTIONS)
        self._closer: Callable[[], Awaitable[Any]] | None = None
        self._closing: set[asyncio.Future[Any]] = set()  # close calls in progress
        self._last_id: str | None = None  # SSE: the raw id of the last event
        self._opened_at: float | None = None  # when the current connection opened
        self._lost_at: float | None = None  # when the last connection ended
        self._last_rate: tuple[int, float] = (0, 0.0)  # (frames, seconds) of the last busy one

    # ---- public -------------------------------------------------------------------------

    @property
    def position(self) -> int | None:
        """The next position to yield (None until known, and always for unpositioned)."""
        return self._stats.position

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def seek(self, pos: int | None) -> None:
        """Set the next position wanted (before iterating): a positioned source's next
        connection asks for it, and frames below it are dropped as repeats."""
        if pos is not None and pos < 0:
            raise ValueError(f"position must be >= 0, got {pos}")
        self._stats.position = pos

    def stop(self) -> None:
        """End the iteration: the current connection is closed and no reconnect follows."""
        self._stop.set()
        if self._closer is not None:
            self._close_soon(self._closer)

    def _close_soon(self, closer: Callable[[], Awaitable[Any]]) -> None:
        fut = asyncio.ensure_future(closer())
        self._closing.add(fut)
        fut.add_done_callback(self._closing.discard)

    def stats(self) -> dict[str, Any]:
        s = self._stats
        s.frames_per_connection = list(self._per_conn)
        return {"kind": self.kind, "url": self.url, "positioned": self.positioned, **asdict(s)}

    def __aiter__(self) -> AsyncIterator[Frame]:
        return self._frames()

    # ---- subclass hooks -----------------------------------------------------------------

    @staticmethod
    def _default_positioned(url: str) -> bool:
        return False

    @abstractmethod
    def _read(
        self,
        session: aiohttp.ClientSession,
        on_open: Callable[[Callable[[], Awaitable[Any]]], None],
    ) -> AsyncIterator[tuple[int | None, bytes]]:
        """Open one connection (resuming at `self.position`), call `on_open(closer)` once it
        is established, then yield (pos, data) until it ends; raise on failure."""

    # ---- the loop -----------------------------------------------------------------------

    async def _frames(self) -> AsyncIterator[Frame]:
        st = self._stats
        attempt = 0
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.connect_timeout_s, sock_read=self.read_timeout_s
        )
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not self._stop.is_set():
                got = 0
                self._opened_at = None
                error: str | None = None
                try:
                    async with contextlib.aclosing(self._read(session, self._on_open)) as conn:
                        async for pos, data in conn:
                            frame = self._admit(pos, data)
                            if frame is not None:
                                got += 1
                                st.frames += 1
                                yield frame
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as err:
                    error = f"{type(err).__name__}: {err}"
                finally:
                    self._closer = None
                self._on_end(got)
                if self._stop.is_set():
                    break
                if error is not None:
                    st.failures += 1
                    st.last_error = error
                    log.info("%s source %s: %s", self.kind, self.url, error)
                attempt = 0 if got else attempt + 1
                if self.max_attempts is not None and attempt >= self.max_attempts:
                    raise SourceUnreachable(
                        f"{self.kind} source {self.url}: {attempt} connections in a row "
                        f"failed or carried nothing; last error: {st.last_error}"
                    )
                await self._pause(attempt)

    def _on_open(self, closer: Callable[[], Awaitable[Any]]) -> None:
        """A connection is established: count it, and measure the downtime before it."""
        st = self._stats
        now = self._clock()
        self._opened_at = now
        self._closer = closer
        st.connects += 1
        if st.connects > 1:
            st.reconnects += 1
            if not self.positioned:
                st.gaps += 1  # whatever the source sent meanwhile is lost
        if self._lost_at is not None:
            down = now - self._lost_at
            st.downtime_s += down
            if not self.positioned:
                st.est_missed += estimate_missed(*self._last_rate, down)
            self._lost_at = None
        if self._stop.is_set():  # stopped while connecting
            self._close_soon(closer)

    def _on_end(self, got: int) -> None:
        """A connection (or an attempt at one) is over after yielding `got` frames."""
        if self._opened_at is None:
            return  # never connected: the downtime simply goes on
        now = self._clock()
        self._per_conn.append(got)
        if got:
            self._last_rate = (got, now - self._opened_at)
        self._lost_at = now

    def _admit(self, pos: int | None, data: bytes) -> Frame | None:
        """Position bookkeeping for one frame; None drops it (a repeat)."""
        st = self._stats
        if pos is None:
            return Frame(None, data)
        nxt = st.position
        if nxt is not None:
            if pos < nxt:
                st.repeats += 1
                return None
            if pos > nxt:
                st.gaps += 1
                st.missed += pos - nxt
        st.position = pos + 1
        return Frame(pos, data)

    async def _pause(self, attempt: int) -> None:
        """The backoff before the next connect; returns early when stopped."""
        b = self.backoff
        delay = backoff_delay(
            max(0, attempt - 1),
            base=b.base_s,
            factor=b.factor,
            cap=b.cap_s,
            jitter=b.jitter,
            rand=self._rng.random(),
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), delay)

    def _unwrap(self, raw: bytes) -> tuple[int | None, bytes] | None:
        """(pos, event bytes) of a tierflow envelope, (None, raw) when unpositioned, None for a
        positioned frame without a readable position (counted in `malformed`)."""
        if not self.positioned:
            return None, raw
        try:
            env = _decode_envelope(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._stats.malformed += 1
            return None
        return env.pos, bytes(env.event)

    def _resume_url(self) -> str:
        """The URL with `from=<next position>` when positioned and the position is known."""
        pos = self._stats.position
        if not self.positioned or pos is None:
            return self.url
        return str(URL(self.url).update_query({"from": str(pos)}))


class WebSocketSource(StreamSource):
    """A WebSocket stream, one frame per text or binary message. Positioned by default when the
    URL path ends with `/v1/stream` (the replay server's envelope stream)."""

    kind = "ws"

    def __init__(self, url: str, *, heartbeat_s: float = 10.0, **kw: Any) -> None:
        super().__init__(url, **kw)
        self.heartbeat_s = heartbeat_s

    @staticmethod
    def _default_positioned(url: str) -> bool:
        return URL(url).path.rstrip("/").endswith("/v1/stream")

    async def _read(
        self,
        session: aiohttp.ClientSession,
        on_open: Callable[[Callable[[], Awaitable[Any]]], None],
    ) -> AsyncIterator[tuple[int | None, bytes]]:
        async with session.ws_connect(
            self._resume_url(), heartbeat=self.heartbeat_s, autoping=True, max_msg_size=0
        ) as ws:
            on_open(ws.close)
            while True:
                msg = await ws.receive(timeout=self.read_timeout_s)
                if msg.type == aiohttp.WSMsgType.TEXT:
                    raw = msg.data.encode()
                elif msg.type == aiohttp.WSMsgType.BINARY:
                    raw = msg.data
                elif msg.type == aiohttp.WSMsgType.ERROR:
                    raise aiohttp.ClientError(f"websocket error: {ws.exception()!r}")
                else:  # CLOSE, CLOSING, CLOSED: the connection is over
                    return
                item = self._unwrap(raw)
                if item is not None:
                    yield item


async def _lines(content: aiohttp.StreamReader, max_line: int) -> AsyncIterator[bytes]:
    """Lines of a byte stream without their terminator (\\n, \\r\\n or a lone \\r), however the
    chunks fall; a line longer than `max_line` is an error."""
    buf = bytearray()
    async for chunk in content.iter_any():
        buf += chunk
        start = 0
        while True:
            nl = buf.find(b"\n", start)
            cr = buf.find(b"\r", start)
            if nl < 0 and cr < 0:
                break
            if cr >= 0 and (nl < 0 or cr < nl):
                if cr == len(buf) - 1:
                    break  # a \r at the end of the chunk may be half of \r\n
                end, nxt = cr, cr + (2 if buf[cr + 1 : cr + 2] == b"\n" else 1)
            else:
                end, nxt = nl, nl + 1
            yield bytes(buf[start:end])
            start = nxt
        del buf[:start]
        if len(buf) > max_line:
            raise ValueError(f"line longer than {max_line} bytes")
    if buf:
        yield bytes(buf.rstrip(b"\r"))


class HttpNdjsonSource(StreamSource):
    """An endless HTTP response (chunked transfer) of NDJSON, one frame per non-blank line.
    Unpositioned by default; `positioned=True` reads envelope lines and resumes with
    `?from=N`."""

    kind = "ndjson"

    async def _read(
        self,
        session: aiohttp.ClientSession,
        on_open: Callable[[Callable[[], Awaitable[Any]]], None],
    ) -> AsyncIterator[tuple[int | None, bytes]]:
        headers = {"Accept": "application/x-ndjson, application/json"}
        async with session.get(self._resume_url(), headers=headers) as resp:
            if resp.status != 200:
                raise aiohttp.ClientResponseError(
                    resp.request_info, (), status=resp.status, message=resp.reason or ""
                )

            async def close() -> None:
                resp.close()

            on_open(close)
            async for line in _lines(resp.content, MAX_LINE_BYTES):
                line = line.strip()
                if not line:
                    continue
                item = self._unwrap(line)
                if item is not None:
                    yield item


class SseSource(StreamSource):
    """A `text/event-stream`, one frame per event with data (its `data:` lines joined by \\n).

    Positioned by default: an integer `id:` is the event's position, and a reconnect sends
    `Last-Event-ID: <next position - 1>`. An event without an integer id has pos None. With
    `positioned=False` ids are opaque and a reconnect sends the last id seen, as browsers do.
    The `event:` type and `retry:` hints are ignored: reconnect pacing is our backoff.
    """

    kind = "sse"

    @staticmethod
    def _default_positioned(url: str) -> bool:
        return True

    def _last_event_id(self) -> str | None:
        pos = self._stats.position
        if self.positioned and pos is not None:
            return str(pos - 1) if pos > 0 else None
        return self._last_id

    async def _read(
        self,
        session: aiohttp.ClientSession,
        on_open: Callable[[Callable[[], Awaitable[Any]]], None],
    ) -> AsyncIterator[tuple[int | None, bytes]]:
        headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
        last = self._last_event_id()
        if last is not None:
            headers["Last-Event-ID"] = last
        async with session.get(self.url, headers=headers) as resp:
            ctype = resp.headers.get("Content-Type", "")
            if resp.status != 200 or not ctype.startswith("text/event-stream"):
                raise aiohttp.ClientResponseError(
                    resp.request_info,
                    (),
                    status=resp.status,
                    message=f"not an event stream ({resp.status} {ctype!r})",
                )

            async def close() -> None:
                resp.close()

            on_open(close)
            data: list[bytes] = []
            ev_id: str | None = None
            async for line in _lines(resp.content, MAX_LINE_BYTES):
                if not line:  # blank line: dispatch
                    if data:
                        yield self._event(ev_id, b"\n".join(data))
                    data, ev_id = [], None
                    continue
                if line.startswith(b":"):
                    continue  # comment / keep-alive
                name, _, value = line.partition(b":")
                if value.startswith(b" "):
                    value = value[1:]
                if name == b"data":
                    data.append(value)
                elif name == b"id" and b"\x00" not in value:
                    ev_id = value.decode("utf-8", "replace")

    def _event(self, ev_id: str | None, data: bytes) -> tuple[int | None, bytes]:
        if ev_id is not None:
            self._last_id = ev_id
        if not self.positioned or ev_id is None:
            return None, data
        try:
            return int(ev_id), data
        except ValueError:
            self._stats.malformed += 1
            return None, data


_KINDS: dict[str, type[StreamSource]] = {
    "ws": WebSocketSource,
    "websocket": WebSocketSource,
    "ndjson": HttpNdjsonSource,
    "http": HttpNdjsonSource,
    "sse": SseSource,
}


def source_from_url(url: str, kind: str = "auto", **kw: Any) -> StreamSource:
    """A connector for `url`. `kind`: ws | websocket | ndjson | http | sse, or auto (only for
    ws:// and wss:// URLs: an http URL could be NDJSON or SSE, so it must be named). Keywords
    go to the connector (start_pos, positioned, stop, max_attempts, backoff, ...)."""
    kind = kind.lower()
    if kind == "auto":
        if URL(url).scheme in ("ws", "wss"):
            kind = "ws"
        else:
            raise ValueError(f"source kind needed for {url!r}: one of {sorted(_KINDS)}")
    try:
        cls = _KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown source kind {kind!r}: one of {sorted(_KINDS)}") from None
    return cls(url, **kw)
