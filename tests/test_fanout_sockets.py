"""The fan-out over real WebSocket connections, without NATS: one feed, many sockets.

An aiohttp server on 127.0.0.1 wires each connection as the gateway does (a `Subscriber`
with `WsSink`/`EventFrames` on a shared `Feed`) over an in-memory stream; clients are
aiohttp's WebSocket client and, for a client that never reads, a raw socket. Expected
frames are written out here from the contract (docs/contracts.md), not from the code.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import aiohttp
import msgspec
import pytest
from aiohttp import web
from aiohttp._websocket.writer import WebSocketWriter

from actors.access import websocket
from actors.access.fanout import Feed, LagPolicy, Subscriber
from actors.access.messages import MAX_SHAPES, StreamMessage
from actors.access.websocket import EventFrames, WsSink, ws_frame
from runtime.data.query import compile_filter
from runtime.waiting import await_until
from tests.test_fanout import MemStream

pytestmark = pytest.mark.unit

FILTERS = {
    "all": ("", lambda d: d),
    "ends": ("WHERE i < 20 OR i > 40", lambda d: d if d["i"] < 20 or d["i"] > 40 else None),
    "proj": ("SELECT i WHERE i > 25", lambda d: {"i": d["i"]} if d["i"] > 25 else None),
}


def payload(i: int) -> dict[str, Any]:
    return {"i": i, "pad": "x" * (i % 7), "nested": {"k": [i, "ü"]}}


def expected_frame(sid: str, seq: int, data: Any) -> bytes:
    """An event frame as docs/contracts.md writes it: compact JSON, this key order."""
    return (
        b'{"op":"event","id":"'
        + sid.encode()
        + b'","seq":'
        + str(seq).encode()
        + b',"subject":"raw.s","data":'
        + msgspec.json.encode(data)
        + b"}"
    )


@dataclass
class Server:
    feed: Feed
    mem: MemStream
    url: str
    counters: dict[str, int] = field(default_factory=lambda: {"events_sent": 0})
    subs: dict[str, Subscriber] = field(default_factory=dict)
    cut: list[str] = field(default_factory=list)
    lags: list[tuple[str, int]] = field(default_factory=list)


@contextlib.asynccontextmanager
async def serve(policy: LagPolicy | None = None, **feed_kw: Any) -> AsyncIterator[Server]:
    mem = MemStream()
    feed = Feed("s", mem.open, fetch_timeout_s=0.05, **feed_kw)
    srv = Server(feed, mem, "")  # its url once bound

    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(compress=False, autoclose=False)
        await ws.prepare(request)
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        name = request.query["name"]
        sid = request.query.get("id", "s")
        flt = compile_filter(request.query.get("filter", ""))
        sink = WsSink(ws, request, EventFrames(sid, flt), srv.counters)

        def overflow(behind: int) -> None:
            srv.cut.append(name)
            if request.transport is not None:
                request.transport.abort()

        sub = Subscriber(
            sid,
            flt,
            policy or LagPolicy(),
            deliver=sink.deliver,
            deliver_now=sink.deliver_now,
            on_lag=lambda behind: srv.lags.append((name, behind)),
            on_overflow=overflow,
            batch=16,
        )
        srv.subs[name] = sub
        feed.attach(sub, 1)
        pump = asyncio.get_running_loop().create_task(sub.pump(feed, mem.open))
        await ws.send_str("ready")
        try:
            async for _ in ws:
                pass
        finally:
            feed.detach(sub)
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
        return ws

    app = web.Application()
    app.router.add_get("/ws", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)  # no port to lose between choice and bind
    await site.start()
    srv.url = f"http://127.0.0.1:{runner.addresses[0][1]}/ws"
    try:
        yield srv
    finally:
        await feed.stop()
        await runner.cleanup()


async def read_frames(ws: aiohttp.ClientWebSocketResponse, n: int) -> list[bytes]:
    out: list[bytes] = []
    while len(out) < n:
        msg = await ws.receive(timeout=10)
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        out.append(msg.data.encode())
    return out


async def test_many_subscribers_each_get_their_events_in_order_encoded_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """30 sockets, three filters and two subscription ids: every client gets exactly the
    events its filter passes, in order, each frame the contract's bytes; each event's frame
    is encoded once per shape (id x projection) that wants it, not once per socket, and the
    feed serves the sockets in its pass (no pump woken)."""
    encodes: list[tuple[bytes, bytes, int]] = []
    real = websocket.event_payload

    def spy(prefix: bytes, ev: StreamMessage, body: bytes) -> bytes:
        encodes.append((prefix, body, ev.seq))
        return real(prefix, ev, body)

    monkeypatch.setattr(websocket, "event_payload", spy)
    n = 60
    async with serve() as srv, aiohttp.ClientSession() as session:
        clients = []
        for k in range(30):
            key = list(FILTERS)[k % 3]
            sid = "a" if k < 15 else "b/é"  # a non-ASCII id is escaped the same way
            url = f"{srv.url}?name=c{k}&id={quote(sid)}&filter={quote(FILTERS[key][0])}"
            ws = await session.ws_connect(url)
            assert (await ws.receive(timeout=10)).data == "ready"
            clients.append((key, sid, ws))
        for burst in (1, 9, 20, 30):  # batches of several sizes
            srv.mem.publish(burst, payload)
            await asyncio.sleep(0.02)
        for key, sid, ws in clients:
            want = []
            for seq in range(1, n + 1):
                data = FILTERS[key][1](payload(seq))
                if data is not None:
                    want.append(expected_frame(sid, seq, data))
            got = await read_frames(ws, len(want))
            assert got == want
            with pytest.raises(TimeoutError):
                await ws.receive(timeout=0.05)  # nothing more: the rest was filtered out
        # a shape is (id, projection): filters that keep whole events share their frames
        per_event = [
            {
                (sid, key == "proj")
                for key, sid, _ in clients
                if FILTERS[key][1](payload(seq)) is not None
            }
            for seq in range(1, n + 1)
        ]
        assert len(encodes) == sum(map(len, per_event))  # once per (event, shape)
        assert len(set(encodes)) == len(encodes)
        assert srv.feed.counters["pump_wakes"] == 0
        assert srv.feed.counters["served_inline"] >= 30
        # each batch is timed from its arrival to the last socket's write
        stats = srv.feed.stats()
        assert stats["spread_batches"] == len(stats["spread_recent_ms"]) >= 1
        assert stats["spread_unfinished"] == 0 and min(stats["spread_recent_ms"]) >= 0
        assert srv.counters["events_sent"] == sum(
            1
            for key, _, _ in clients
            for seq in range(1, n + 1)
            if FILTERS[key][1](payload(seq)) is not None
        )
        for _, _, ws in clients:
            await ws.close()


async def test_a_socket_that_never_reads_is_cut_off_without_delaying_the_others() -> None:
    """A client that stops reading fills its socket: the feed stops serving it in place, its
    pump waits on the socket, the lag policy cuts it off, and the readers got every event
    in order all along."""
    policy = LagPolicy(max_lag=150, warn_lag=50, warn_every_s=0.0)
    big = "y" * 2000
    async with serve(policy, lag_every_s=0) as srv, aiohttp.ClientSession() as session:
        readers = []
        for k in range(5):
            ws = await session.ws_connect(f"{srv.url}?name=r{k}")
            assert (await ws.receive(timeout=10)).data == "ready"
            readers.append(ws)
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.connect(("127.0.0.1", int(srv.url.rsplit(":", 1)[1].split("/")[0])))
        key = base64.b64encode(os.urandom(16)).decode()
        raw.sendall(
            (
                "GET /ws?name=stuck HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        await await_until(lambda: "stuck" in srv.subs, timeout=10, what="stuck subscribed")
        got: list[list[int]] = [[] for _ in readers]

        async def drain(i: int, ws: aiohttp.ClientWebSocketResponse) -> None:
            while len(got[i]) < 400:
                msg = await ws.receive(timeout=10)
                assert msg.type == aiohttp.WSMsgType.TEXT, (msg, len(got[i]), srv.cut)
                got[i].append(msgspec.json.decode(msg.data)["seq"])

        readers_done = asyncio.gather(*(drain(i, ws) for i, ws in enumerate(readers)))
        for _ in range(40):
            srv.mem.publish(10, lambda i: {"i": i, "big": big})
            await asyncio.sleep(0.02)
        await asyncio.wait_for(readers_done, 20)
        await await_until(lambda: srv.cut == ["stuck"], timeout=10, what="stuck cut off")
        assert all(g == list(range(1, 401)) for g in got)
        assert all(name == "stuck" for name, _ in srv.lags) and srv.lags  # warned first
        assert srv.subs["stuck"].closed and srv.subs["stuck"].sent < 400
        assert srv.feed.counters["pump_wakes"] >= 1  # the stuck one served itself
        raw.close()
        for ws in readers:
            await ws.close()


def test_prebuilt_frames_are_the_bytes_aiohttp_writes() -> None:
    """`ws_frame` is what aiohttp's own writer puts on the wire for a server text frame,
    at each of the three length encodings."""

    class Transport:
        def __init__(self) -> None:
            self.out = b""

        def write(self, data: bytes) -> None:
            self.out += bytes(data)

        def is_closing(self) -> bool:
            return False

    for size in (0, 125, 126, 65535, 65536, 70000):
        transport = Transport()
        writer = WebSocketWriter(None, transport)  # type: ignore[arg-type]
        writer._write_websocket_frame(b"z" * size, aiohttp.WSMsgType.TEXT, 0)
        assert ws_frame(b"z" * size) == transport.out, size


def test_frame_cache_is_bounded_per_message() -> None:
    ev = StreamMessage(7, "raw.s", b'{"i":7}')
    built: list[str] = []
    for k in range(MAX_SHAPES + 5):
        shape = ("ws", str(k))
        assert ev.frame(shape, lambda e, k=k: built.append(str(k)) or str(k)) == str(k)
    assert len(built) == MAX_SHAPES + 5
    assert ev.frame(("ws", "0"), lambda e: "rebuilt") == "0"  # kept
    assert ev.frame(("ws", str(MAX_SHAPES + 1)), lambda e: "rebuilt") == "rebuilt"  # not kept
