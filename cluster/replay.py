"""A WebSocket replay server standing in for the retired Meetup RSVP stream.

Endpoints (all on one aiohttp app, bound to 127.0.0.1 by default):

- `GET /` (WebSocket): each text frame is one RSVP JSON object, exactly the book's stream.
- `GET /v1/stream` (WebSocket): each text frame is `{"pos": N, "event": {...}}`, so a
  client knows the position of what it holds.
- `GET /stats` (JSON): events sent, connections, per-client positions, malformed lines.

Both WebSocket endpoints take `?from=N`, the 0-based position of the first event wanted,
so a reconnecting or standby collector resumes where the last one stopped: events
N, N+1, ... with no gap and no repeat. Positions are stable across server restarts: a file
is read the same way each time, and generator mode regenerates event N from the seed.

Each connection is paced on its own: event k of a connection is due `k / rate` seconds after
the connection opened (a schedule from the start, not a sleep per frame, so pacing does not
drift), and never before. A client that falls behind catches up at most `burst` events at
once. After `count` events the connection stays open and quiet, like a live stream with
nothing to say, or is closed with code 1000 when `close_at_end` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
from aiohttp import web

from cluster.demo.rsvps import RsvpGenerator

log = logging.getLogger(__name__)
_ENCODER = msgspec.json.Encoder()
_MAX_CLOSED_KEPT = 1000  # closed connections kept in stats


# --------------------------------------------------------------------------- pacing


@dataclass
class Pacer:
    """A token-bucket schedule: event k is due at `start + k / rate`, never earlier.

    Pure policy: the clock is an argument. `rate <= 0` means unpaced. When the sender has
    fallen more than `burst` events behind (a slow client, a busy loop), the debt beyond
    `burst` is forgiven by moving the schedule later: catching up never floods the client,
    and moving later can only slow the stream down, never run it ahead.
    """

    rate: float
    burst: int
    start: float
    sent: int = 0

    def due(self, now: float) -> int:
        """How many events may be sent at `now` (0 means wait `delay(now)`)."""
        if self.rate <= 0:
            return self.burst
        allowed = math.floor((now - self.start) * self.rate) + 1 - self.sent
        if allowed > self.burst:
            self.start = now - (self.sent + self.burst - 1) / self.rate
            allowed = self.burst
        return max(0, allowed)

    def delay(self, now: float) -> float:
        """Seconds until the next event is due."""
        if self.rate <= 0:
            return 0.0
        return max(0.0, self.start + self.sent / self.rate - now)

    def consume(self, n: int = 1) -> None:
        self.sent += n


def default_burst(rate: float) -> int:
    """A quarter second of events (at least 16): big enough for 20k/s with a 1 ms loop tick."""
    return max(16, math.ceil(rate * 0.25)) if rate > 0 else 512


# --------------------------------------------------------------------------- sources


class Reader(Protocol):
    """A cursor over a source: `read(n)` returns up to n encoded events from `position`."""

    position: int

    def read(self, n: int) -> list[str]: ...


class ReplaySource(Protocol):
    """Where events come from. Event N is the same every time it is asked for."""

    length: int | None  # None: endless
    malformed: int

    def reader(self, start: int) -> Reader: ...

    def describe(self) -> dict[str, Any]: ...


class _ListReader:
    def __init__(self, frames: list[str], start: int) -> None:
        self._frames = frames
        self.position = start

    def read(self, n: int) -> list[str]:
        out = self._frames[self.position : self.position + n]
        self.position += len(out)
        return out


class NdjsonSource:
    """Events from an NDJSON file, read once: event N is the N-th well-formed line.

    A line that is not a JSON object (bad JSON, bad UTF-8, an array, a number) is skipped
    and counted in `malformed` (its 1-based line number in `malformed_lines`, first 100);
    blank lines are ignored. A good line is sent as written, byte for byte.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.frames: list[str] = []
        self.malformed = 0
        self.malformed_lines: list[int] = []
        decoder = msgspec.json.Decoder()
        with self.path.open("rb") as f:
            for lineno, raw in enumerate(f, start=1):
                line = raw.strip()
                if not line:
                    continue
                try:
                    ok = isinstance(decoder.decode(line), dict)
                    text = line.decode("utf-8") if ok else ""
                except (msgspec.DecodeError, UnicodeDecodeError):
                    ok = False
                if ok:
                    self.frames.append(text)
                else:
                    self.malformed += 1
                    if len(self.malformed_lines) < 100:
                        self.malformed_lines.append(lineno)
        self.length: int | None = len(self.frames)

    def reader(self, start: int) -> Reader:
        return _ListReader(self.frames, start)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "ndjson",
            "path": str(self.path),
            "events": len(self.frames),
            "malformed": self.malformed,
            "malformed_lines": self.malformed_lines,
        }


class GeneratorSource:
    """Events from `RsvpGenerator(seed, **kwargs)`, encoded once and shared by all clients.

    The last `cache_size` events generated live in a ring (None: keep all). A reader asking
    for an event older than the ring regenerates it privately from the seed (cost: about
    30 us per skipped event), then joins the shared ring when it catches up. Asking far ahead
    generates everything up to there once.
    """

    malformed = 0
    length: int | None = None

    def __init__(self, seed: int, *, cache_size: int | None = 100_000, **kwargs: Any) -> None:
        if cache_size is not None and cache_size < 1:
            raise ValueError(f"cache_size must be >= 1 or None, got {cache_size}")
        self.seed = seed
        self._kwargs = kwargs
        self._gen = RsvpGenerator(seed, **kwargs)
        self._cap = cache_size
        self._ring: list[str] = []
        self._base = 0  # position of the oldest cached event
        self._next = 0  # position the shared generator makes next

    def new_generator(self) -> RsvpGenerator:
        return RsvpGenerator(self.seed, **self._kwargs)

    def _extend_to(self, end: int) -> None:
        """Generate shared events up to position `end` (exclusive)."""
        while self._next < end:
            text = _ENCODER.encode(self._gen.next()).decode()
            if self._cap is None or len(self._ring) < self._cap:
                self._ring.append(text)
            else:
                self._ring[self._next % self._cap] = text
                self._base = self._next + 1 - self._cap
            self._next += 1

    def _cached(self, pos: int, n: int) -> list[str]:
        """Events [pos, pos+n) from the ring; needs pos >= the oldest cached and n <= the ring."""
        assert pos >= self._base and (self._cap is None or n <= self._cap)
        self._extend_to(pos + n)
        if self._cap is None:
            return self._ring[pos : pos + n]
        return [self._ring[p % self._cap] for p in range(pos, pos + n)]

    def reader(self, start: int) -> Reader:
        return _GeneratorReader(self, start)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "generator",
            "seed": self.seed,
            "generated": self._next,
            "cached_from": self._base,
        }


class _GeneratorReader:
    def __init__(self, source: GeneratorSource, start: int) -> None:
        self._src = source
        self.position = start
        self._private: RsvpGenerator | None = None
        self._private_pos = 0

    def read(self, n: int) -> list[str]:
        src = self._src
        if self.position >= src._base:
            self._private = None
            out = src._cached(self.position, n if src._cap is None else min(n, src._cap))
        else:
            if self._private is None or self._private_pos > self.position:
                self._private, self._private_pos = src.new_generator(), 0
            while self._private_pos < self.position:
                self._private.next()
                self._private_pos += 1
            n = min(n, src._base - self.position)
            out = [_ENCODER.encode(self._private.next()).decode() for _ in range(n)]
            self._private_pos += n
        self.position += len(out)
        return out


def as_source(source: ReplaySource | int | str | Path) -> ReplaySource:
    """An int is a generator seed; a str or Path is an NDJSON file."""
    if isinstance(source, bool):
        raise TypeError("source must be a seed (int), an NDJSON path or a ReplaySource")
    if isinstance(source, int):
        return GeneratorSource(source)
    if isinstance(source, str | Path):
        return NdjsonSource(source)
    return source


# --------------------------------------------------------------------------- server


@dataclass
class ConnectionStats:
    """What the server did for one WebSocket connection."""

    id: int
    path: str
    start: int  # the `from` position asked for
    sent: int = 0  # frames handed to the transport without error
    highest_position: int | None = None  # position of the last frame sent
    reached_end: bool = False
    open: bool = True
    remote: str | None = None
    opened_at: float = 0.0  # wall-clock time, for humans
    closed_at: float | None = None


def parse_from(query: Any) -> int:
    """The `from` query parameter as a position >= 0 (default 0); ValueError with a reason."""
    raw = query.get("from", "0")
    try:
        pos = int(raw)
    except ValueError:
        raise ValueError(f"'from' must be an integer position, got {raw!r}") from None
    if pos < 0:
        raise ValueError(f"'from' must be >= 0, got {pos}")
    return pos


class ReplayServer:
    """Streams a source over WebSocket at `rate` events/s per connection (see module doc).

        server = ReplayServer(GeneratorSource(seed=1), rate=1000, count=10_000)
        await server.start()
        ...  # connect to server.url or f"{server.base_url}/v1/stream?from=N"
        await server.stop()

    `source` may also be an int (a generator seed) or a path (an NDJSON file). `rate <= 0`
    sends as fast as the client reads. `count` bounds the stream to positions < count
    (None: the source's own length, endless for a generator). `port=0` picks a free port.
    """

    def __init__(
        self,
        source: ReplaySource | int | str | Path,
        rate: float = 100.0,
        count: int | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        close_at_end: bool = False,
        burst: int | None = None,
        max_batch: int = 512,
        close_timeout: float = 3.0,
        heartbeat: float | None = 30.0,
    ) -> None:
        if count is not None and count < 0:
            raise ValueError(f"count must be >= 0 or None, got {count}")
        self.source = as_source(source)
        self.rate = float(rate)
        self.count = count
        self.host = host
        self._port = port
        self.close_at_end = close_at_end
        self.burst = burst if burst is not None else default_burst(self.rate)
        self.max_batch = max(1, max_batch)
        self.close_timeout = close_timeout
        self.heartbeat = heartbeat
        self._runner: web.AppRunner | None = None
        self._ids = itertools.count(1)
        self._conns: dict[int, ConnectionStats] = {}
        # per open connection: (set to ask its handler to close, set when it has finished)
        self._handlers: dict[int, tuple[asyncio.Event, asyncio.Event]] = {}
        self._events_sent = 0
        self._connections = 0
        self._highest: int | None = None
        self._started_at: float | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def end(self) -> int | None:
        """One past the last position served (None: endless)."""
        length = self.source.length
        if self.count is None:
            return length
        return self.count if length is None else min(self.count, length)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/", self._plain)
        app.router.add_get("/v1/stream", self._framed)
        app.router.add_get("/stats", self._stats)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self._port)
        await site.start()
        self._port = self._runner.addresses[0][1]
        self._started_at = time.time()

    async def stop(self, timeout: float = 5.0) -> None:
        """Close every client with 1001 (going away) and release the port."""
        if self._runner is None:
            return
        handlers = list(self._handlers.values())
        for stopping, _ in handlers:
            stopping.set()
        if handlers:
            waits = [asyncio.ensure_future(done.wait()) for _, done in handlers]
            _, pending = await asyncio.wait(waits, timeout=timeout)
            for task in pending:
                task.cancel()
        await self._runner.cleanup()
        self._runner = None

    @property
    def port(self) -> int:
        if self._runner is None and self._started_at is None:
            raise RuntimeError("call start() first")
        return self._port

    @property
    def base_url(self) -> str:
        return f"ws://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The book-compatible stream: plain RSVP frames."""
        return f"{self.base_url}/"

    @property
    def stream_url(self) -> str:
        """The positioned stream: `{"pos": N, "event": {...}}` frames."""
        return f"{self.base_url}/v1/stream"

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        """A JSON-ready snapshot; `events_sent` counts frames handed to the transport."""
        clients = [asdict(c) for c in self._conns.values()]
        return {
            "events_sent": self._events_sent,
            "highest_position": self._highest,
            "connections": self._connections,
            "active": len(self._handlers),
            "malformed": self.source.malformed,
            "end": self.end,
            "rate": self.rate,
            "close_at_end": self.close_at_end,
            "source": self.source.describe(),
            "started_at": self._started_at,
            "clients": clients,
        }

    def sent_positions(self) -> dict[int, int | None]:
        """Highest position sent, per connection id."""
        return {c.id: c.highest_position for c in self._conns.values()}

    async def _stats(self, _: web.Request) -> web.Response:
        return web.Response(body=_ENCODER.encode(self.stats()), content_type="application/json")

    # ------------------------------------------------------------------ streaming

    async def _plain(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, framed=False)

    async def _framed(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, framed=True)

    async def _serve(self, request: web.Request, *, framed: bool) -> web.StreamResponse:
        try:
            start = parse_from(request.query)
        except ValueError as err:
            return web.Response(status=400, text=f"{err}\n")
        ws = web.WebSocketResponse(timeout=self.close_timeout, heartbeat=self.heartbeat)
        if not ws.can_prepare(request).ok:
            return web.Response(
                status=400, text="WebSocket endpoint: connect with ws:// (see /stats)\n"
            )
        await ws.prepare(request)
        conn = ConnectionStats(
            id=next(self._ids),
            path=request.path,
            start=start,
            remote=request.remote,
            opened_at=time.time(),
        )
        self._remember(conn)
        self._connections += 1
        stopping, finished = asyncio.Event(), asyncio.Event()
        self._handlers[conn.id] = (stopping, finished)
        try:
            await self._run_connection(ws, conn, framed, stopping)
        finally:
            conn.open = False
            conn.closed_at = time.time()
            self._handlers.pop(conn.id, None)
            finished.set()
        return ws

    async def _run_connection(
        self,
        ws: web.WebSocketResponse,
        conn: ConnectionStats,
        framed: bool,
        stopping: asyncio.Event,
    ) -> None:
        """Pump events while draining client frames, until the client, the end or a stop.

        A server-side close runs only after the receive loop is cancelled, so aiohttp does a
        full closing handshake (the client sees our code, not an abnormal 1006).
        """
        pump = asyncio.create_task(self._pump(ws, conn, framed))
        listen = asyncio.create_task(_drain(ws))
        stop = asyncio.create_task(stopping.wait())
        tasks = (pump, listen, stop)
        close: tuple[int, bytes] | None = None
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if pump.done() and not (listen.done() or stop.done()):
                if conn.reached_end and self.close_at_end:
                    close = (1000, b"end of stream")
                else:  # idle like a quiet live stream
                    await asyncio.wait((listen, stop), return_when=asyncio.FIRST_COMPLETED)
            if close is None and stop.done() and not listen.done():
                close = (1001, b"server shutdown")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if not pump.cancelled() and pump.exception() is not None:
                log.error("replay connection %d failed", conn.id, exc_info=pump.exception())
        if close is not None and not ws.closed:
            await ws.close(code=close[0], message=close[1])

    def _remember(self, conn: ConnectionStats) -> None:
        self._conns[conn.id] = conn
        closed = [c.id for c in self._conns.values() if not c.open]
        for cid in closed[: max(0, len(closed) - _MAX_CLOSED_KEPT)]:
            del self._conns[cid]

    async def _pump(self, ws: web.WebSocketResponse, conn: ConnectionStats, framed: bool) -> None:
        """Send events from `conn.start` on schedule; returns at the end or when the client goes."""
        loop = asyncio.get_running_loop()
        pacer = Pacer(self.rate, self.burst, loop.time())
        reader = self.source.reader(conn.start)
        end = self.end
        try:
            while True:
                if ws.closed:
                    return
                remaining = self.max_batch if end is None else end - reader.position
                if remaining <= 0:
                    break
                n = min(pacer.due(loop.time()), self.max_batch, remaining)
                if n <= 0:
                    await asyncio.sleep(pacer.delay(loop.time()))
                    continue
                pos = reader.position
                frames = reader.read(n)
                if not frames:
                    break
                for text in frames:
                    if framed:
                        text = f'{{"pos":{pos},"event":{text}}}'
                    await ws.send_str(text)
                    pacer.consume()
                    conn.sent += 1
                    conn.highest_position = pos
                    self._events_sent += 1
                    if self._highest is None or pos > self._highest:
                        self._highest = pos
                    pos += 1
                await asyncio.sleep(0)  # let other connections and the reader run
            conn.reached_end = True
        except ConnectionError:
            return  # the client went away; the receive loop sees the close


async def _drain(ws: web.WebSocketResponse) -> None:
    """Read (and ignore) client frames so pings and the client's close are handled."""
    async for _ in ws:
        pass


# --------------------------------------------------------------------------- entry points


async def serve_replay(
    *,
    seed: int = 0,
    ndjson: str | Path | None = None,
    rate: float = 100.0,
    count: int | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    close_at_end: bool = False,
    start_ms: int | None = None,
    on_ready: Callable[[ReplayServer], None] | None = None,
) -> None:
    """Serve until cancelled: an NDJSON file if `ndjson` is given, else the seeded generator.

    `on_ready(server)` is called once the port is bound (e.g. to print `server.url`).
    """
    source: ReplaySource
    if ndjson is not None:
        source = NdjsonSource(ndjson)
    else:
        source = GeneratorSource(seed, start_ms=start_ms)
    server = ReplayServer(source, rate, count, host, port, close_at_end=close_at_end)
    await server.start()
    try:
        if on_ready is not None:
            on_ready(server)
        await asyncio.Event().wait()  # until cancelled
    finally:
        await server.stop()


def run_replay(**kwargs: Any) -> None:
    """`serve_replay(**kwargs)` in a fresh event loop until Ctrl-C, which returns cleanly."""
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_replay(**kwargs))
