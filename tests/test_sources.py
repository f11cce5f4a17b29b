"""actors/collection/sources.py: real aiohttp clients against a real ReplayServer (WebSocket)
and tiny aiohttp servers written here (chunked NDJSON, SSE), incl. a server restart on the
same port."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from aiohttp import web

from actors.collection.sources import (
    Frame,
    HttpNdjsonSource,
    SourceUnreachable,
    SseSource,
    StreamSource,
    WebSocketSource,
    _lines,
    estimate_missed,
    source_from_url,
)
from cluster.demo.rsvps import RsvpGenerator
from cluster.replay import GeneratorSource, ReplayServer
from runtime.nats.server import free_port
from runtime.supervision.policy import Backoff
from runtime.waiting import await_until

pytestmark = [pytest.mark.timeout(60), pytest.mark.unit]

FAST = Backoff(base_s=0.05, factor=2.0, cap_s=0.3, jitter=0.5)


# ---- a tiny streaming server: chunked NDJSON and SSE ---------------------------------------


class TinyServer:
    """Endless numbered events `{"n": i}` at `rate`/s on one port, for our HTTP connectors.

    - `/ndjson?from=N`: envelope lines `{"pos": i, "event": {"n": i}}`, from N (default 0);
    - `/plain`: bare lines of a live stream: what was "sent" while nobody listened is gone;
    - `/sse`: `id: i` + `data:` events resumed after `Last-Event-ID`, with keep-alive
      comments, CRLF line ends and every 5th event's data on two lines.
    Lines are written split across chunks, so clients must reassemble them.
    """

    def __init__(self, port: int, rate: float = 2000.0) -> None:
        self.port = port
        self.rate = rate
        self.live = 0  # the live stream's next number (shared, advances with time)
        self._runner: web.AppRunner | None = None
        self._stopping = asyncio.Event()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> TinyServer:
        app = web.Application()
        app.router.add_get("/ndjson", self._ndjson)
        app.router.add_get("/plain", self._plain)
        app.router.add_get("/sse", self._sse)
        self._stopping = asyncio.Event()
        self._runner = web.AppRunner(app, shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        self._stopping.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _pump(self, resp: web.StreamResponse, first: int, render: Any) -> None:
        """Write events first, first+1, ... paced at `rate`, each split into two chunks."""
        loop = asyncio.get_running_loop()
        t0, i = loop.time(), first
        while not self._stopping.is_set():
            due = first + int((loop.time() - t0) * self.rate) + 1
            while i < due:
                data = render(i)
                half = len(data) // 2
                await resp.write(data[:half])
                await resp.write(data[half:])
                i += 1
            self.live = max(self.live, i)
            await asyncio.sleep(0.005)

    async def _ndjson(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        first = int(request.query.get("from", "0"))
        with contextlib.suppress(ConnectionError):
            await self._pump(resp, first, lambda i: b'{"pos":%d,"event":{"n":%d}}\n' % (i, i))
        return resp

    async def _plain(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):
            await self._pump(resp, self.live, lambda i: b'{"n":%d}\n\n' % i)
        return resp

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        last = request.headers.get("Last-Event-ID")
        first = int(last) + 1 if last is not None else 0

        def render(i: int) -> bytes:
            data = b'data: {"n":\r\ndata: %d}\r\n' % i if i % 5 == 0 else b'data: {"n":%d}\r\n' % i
            return b": keep-alive\r\nid: %d\r\n%s\r\n" % (i, data)

        with contextlib.suppress(ConnectionError):
            await self._pump(resp, first, render)
        return resp


def n_of(frame: Frame) -> int:
    return msgspec.json.decode(frame.data.replace(b"\n", b""))["n"]


async def collect(source: StreamSource, n: int, timeout: float = 20.0) -> list[Frame]:
    """The first n frames of the source (bounded by `timeout`)."""
    out: list[Frame] = []

    async def run() -> None:
        async for frame in source:
            out.append(frame)
            if len(out) >= n:
                return

    await asyncio.wait_for(run(), timeout)
    return out


class Reader:
    """Iterates a source in a background task, keeping every frame."""

    def __init__(self, source: StreamSource) -> None:
        self.source = source
        self.frames: list[Frame] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for frame in self.source:
            self.frames.append(frame)

    async def stop(self) -> None:
        self.source.stop()
        await asyncio.wait_for(self.task, 10)


@contextlib.asynccontextmanager
async def tiny(port: int | None = None, rate: float = 2000.0) -> AsyncIterator[TinyServer]:
    server = await TinyServer(port or free_port(), rate).start()
    try:
        yield server
    finally:
        await server.stop()


# ---- pure parts ----------------------------------------------------------------------------


def test_estimate_missed() -> None:
    assert estimate_missed(1000, 1.0, 0.5) == pytest.approx(500.0)
    assert estimate_missed(0, 1.0, 0.5) == 0.0
    assert estimate_missed(10, 0.0, 0.5) == 0.0
    assert estimate_missed(10, 1.0, 0.0) == 0.0


class _Chunks:
    def __init__(self, chunks: list[bytes]) -> None:
        self._chunks = chunks

    async def iter_any(self) -> AsyncIterator[bytes]:
        for c in self._chunks:
            yield c


async def test_lines_reassembles_any_chunking_and_line_ends() -> None:
    text = b"a\r\nbb\ncc\rdd\r\n\r\nlast"
    want = [b"a", b"bb", b"cc", b"dd", b"", b"last"]
    for size in (1, 2, 3, 5, len(text)):
        chunks = [text[i : i + size] for i in range(0, len(text), size)]
        got = [line async for line in _lines(_Chunks(chunks), 100)]  # type: ignore[arg-type]
        assert got == want, size
    with pytest.raises(ValueError, match="longer than"):
        async for _ in _lines(_Chunks([b"x" * 50, b"y" * 60]), 100):  # type: ignore[arg-type]
            pass


def test_factory_kinds_and_positioned_defaults() -> None:
    assert isinstance(source_from_url("ws://h:1/v1/stream"), WebSocketSource)
    assert source_from_url("ws://h:1/v1/stream").positioned
    assert not source_from_url("ws://h:1/", "websocket").positioned
    assert isinstance(source_from_url("http://h:1/x", "ndjson"), HttpNdjsonSource)
    assert not source_from_url("http://h:1/x", "http").positioned
    assert source_from_url("http://h:1/x", "sse").positioned
    assert isinstance(source_from_url("http://h:1/x", "SSE", positioned=False), SseSource)
    with pytest.raises(ValueError, match="kind needed"):
        source_from_url("http://h:1/x")
    with pytest.raises(ValueError, match="unknown source kind"):
        source_from_url("ws://h:1/", "kafka")
    with pytest.raises(ValueError):
        WebSocketSource("ws://h:1/", start_pos=-1)


# ---- WebSocket against the real ReplayServer ------------------------------------------------


def expected_events(seed: int, n: int) -> list[bytes]:
    return [msgspec.json.encode(r) for r in RsvpGenerator(seed).take(n)]


async def test_websocket_positioned_from_start_pos() -> None:
    server = ReplayServer(GeneratorSource(7), rate=0, count=500)
    await server.start()
    try:
        src = WebSocketSource(server.stream_url, start_pos=100)
        frames = await collect(src, 50)
        src.stop()
    finally:
        await server.stop()
    assert [f.pos for f in frames] == list(range(100, 150))
    assert [f.data for f in frames] == expected_events(7, 150)[100:]  # the event, unwrapped
    st = src.stats()
    assert st["position"] == 150 and st["connects"] == 1 and st["gaps"] == 0


async def test_websocket_resumes_after_server_restart_on_same_port() -> None:
    """The acceptance case of the connector: a restart costs no frame and repeats none."""
    port, n = free_port(), 3000
    server = ReplayServer(GeneratorSource(3), rate=2000, count=n, port=port)
    await server.start()
    reader = Reader(WebSocketSource(server.stream_url, backoff=FAST))
    try:
        await await_until(lambda: len(reader.frames) >= 500, 20, what="500 frames")
        await server.stop()
        await await_until(
            lambda: reader.source.stats()["failures"] >= 1, 10, what="reconnect attempts"
        )
        server = ReplayServer(GeneratorSource(3), rate=2000, count=n, port=port)
        await server.start()
        await await_until(lambda: len(reader.frames) >= n, 30, what="all frames")
    finally:
        await reader.stop()
        await server.stop()
    assert [f.pos for f in reader.frames] == list(range(n))  # contiguous: no gap, no repeat
    assert [f.data for f in reader.frames] == expected_events(3, n)
    st = reader.source.stats()
    assert st["reconnects"] == 1 and st["gaps"] == 0 and st["repeats"] == 0
    assert len(st["frames_per_connection"]) == 2 and sum(st["frames_per_connection"]) == n
    # the second connection asked for exactly the next position
    assert [c["start"] for c in server.stats()["clients"]] == [st["frames_per_connection"][0]]


async def test_websocket_unpositioned_reconnect_is_measured() -> None:
    port = free_port()
    server = ReplayServer(GeneratorSource(1), rate=1000, port=port)
    await server.start()
    reader = Reader(WebSocketSource(server.url, backoff=FAST))
    try:
        await await_until(lambda: len(reader.frames) >= 200, 20, what="200 frames")
        await server.stop()
        server = ReplayServer(GeneratorSource(1), rate=1000, port=port)
        await server.start()
        before = len(reader.frames)
        await await_until(lambda: len(reader.frames) >= before + 100, 20, what="frames again")
    finally:
        await reader.stop()
        await server.stop()
    assert all(f.pos is None for f in reader.frames)
    st = reader.source.stats()
    assert st["reconnects"] == 1 and st["gaps"] == 1
    assert st["downtime_s"] > 0 and st["est_missed"] > 0
    assert st["frames_per_connection"][0] >= 200


# ---- chunked NDJSON and SSE against our tiny servers -----------------------------------------


@pytest.mark.parametrize(
    ("kind", "path"), [("ndjson", "/ndjson"), ("sse", "/sse")], ids=["ndjson", "sse"]
)
async def test_http_sources_resume_after_restart_on_same_port(kind: str, path: str) -> None:
    port = free_port()
    server = await TinyServer(port).start()
    src = source_from_url(server.base + path, kind, positioned=True, start_pos=10, backoff=FAST)
    reader = Reader(src)
    try:
        await await_until(lambda: len(reader.frames) >= 400, 20, what="400 frames")
        await server.stop()
        await await_until(lambda: src.stats()["failures"] >= 1, 10, what="reconnect attempts")
        server = await TinyServer(port).start()
        await await_until(lambda: len(reader.frames) >= 1500, 20, what="1500 frames")
    finally:
        await reader.stop()
        await server.stop()
    frames = reader.frames
    assert [f.pos for f in frames] == list(range(10, 10 + len(frames)))
    assert [n_of(f) for f in frames] == [f.pos for f in frames]
    st = src.stats()
    assert st["reconnects"] == 1 and st["gaps"] == 0 and st["repeats"] == 0
    assert st["malformed"] == 0


async def test_sse_multiline_data_is_joined() -> None:
    async with tiny() as server:
        src = SseSource(server.base + "/sse")
        frames = await collect(src, 12)
        src.stop()
    assert frames[5].data == b'{"n":\n5}' and frames[6].data == b'{"n":6}'


async def test_ndjson_unpositioned_gap_is_measured() -> None:
    port = free_port()
    server = await TinyServer(port, rate=1000).start()
    src = HttpNdjsonSource(server.base + "/plain", backoff=FAST)
    reader = Reader(src)
    try:
        await await_until(lambda: len(reader.frames) >= 300, 20, what="300 frames")
        await server.stop()
        await await_until(lambda: src.stats()["failures"] >= 1, 10, what="reconnect attempts")
        live = server.live
        server = TinyServer(port, rate=1000)
        server.live = live + 500  # the live stream moved on while we were away
        await server.start()
        before = len(reader.frames)
        await await_until(lambda: len(reader.frames) >= before + 50, 20, what="frames again")
    finally:
        await reader.stop()
        await server.stop()
    numbers = [n_of(f) for f in reader.frames]
    assert all(f.pos is None for f in reader.frames)
    first = src.stats()["frames_per_connection"][0]
    assert numbers[first] - numbers[first - 1] > 500  # the real gap the server caused
    st = src.stats()
    assert st["gaps"] == 1 and st["downtime_s"] > 0 and st["est_missed"] > 0


async def test_bounded_attempts_raise_source_error() -> None:
    src = WebSocketSource(f"ws://127.0.0.1:{free_port()}/", max_attempts=3, backoff=FAST)
    with pytest.raises(SourceUnreachable, match="3 connections in a row"):
        await collect(src, 1)
    st = src.stats()
    assert st["failures"] == 3 and st["connects"] == 0 and st["last_error"]


async def test_stop_ends_an_idle_connection_and_a_backoff() -> None:
    server = ReplayServer(GeneratorSource(1), rate=0, count=5)  # then quiet, connection open
    await server.start()
    try:
        reader = Reader(WebSocketSource(server.stream_url))
        await await_until(lambda: len(reader.frames) == 5, 10, what="5 frames")
        await reader.stop()  # bounded: fails if the iteration does not end
        assert reader.task.done() and reader.source.stats()["connects"] == 1
    finally:
        await server.stop()
    slow = Backoff(base_s=30.0, factor=2.0, cap_s=30.0, jitter=0.0)
    waiting = Reader(WebSocketSource(f"ws://127.0.0.1:{free_port()}/", backoff=slow))
    await await_until(lambda: waiting.source.stats()["failures"] >= 1, 10, what="a failure")
    await waiting.stop()  # ends the 30 s backoff at once
