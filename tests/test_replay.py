"""The replay server: a real aiohttp server and real WebSocket clients on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from cluster.demo.rsvps import RsvpGenerator
from cluster.replay import (
    GeneratorSource,
    NdjsonSource,
    Pacer,
    ReplayServer,
    serve_replay,
)
from runtime.waiting import await_until

pytestmark = pytest.mark.timeout(60)

RECV_TIMEOUT = 10.0  # every receive is bounded


@asynccontextmanager
async def running(server: ReplayServer) -> AsyncIterator[ReplayServer]:
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@asynccontextmanager
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def read_n(ws: aiohttp.ClientWebSocketResponse, n: int) -> list[str]:
    """Exactly n text frames (fails on close or timeout)."""
    out = []
    for _ in range(n):
        msg = await ws.receive(timeout=RECV_TIMEOUT)
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        out.append(msg.data)
    return out


async def read_to_close(ws: aiohttp.ClientWebSocketResponse, limit: int = 100_000) -> list[str]:
    """All text frames until the server closes (bounded by `limit` frames and timeouts)."""
    out = []
    for _ in range(limit + 1):
        msg = await ws.receive(timeout=RECV_TIMEOUT)
        if msg.type != aiohttp.WSMsgType.TEXT:
            assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), msg
            return out
        out.append(msg.data)
    raise AssertionError(f"more than {limit} frames")


def positioned(frames: list[str]) -> tuple[list[int], list[dict[str, Any]]]:
    decoded = [json.loads(f) for f in frames]
    assert all(set(d) == {"pos", "event"} for d in decoded)
    return [d["pos"] for d in decoded], [d["event"] for d in decoded]


def expected(seed: int, n: int) -> list[dict[str, Any]]:
    """The generator's sequence as the wire carries it."""
    return [msgspec.json.decode(msgspec.json.encode(r)) for r in RsvpGenerator(seed).take(n)]


# --------------------------------------------------------------------------- pacer (pure)


@pytest.mark.unit
def test_pacer_never_runs_ahead_of_schedule() -> None:
    pacer = Pacer(rate=100.0, burst=10, start=0.0)
    now, sent_at = 0.0, []
    for _ in range(10_000):  # bounded simulation with a fake clock
        n = pacer.due(now)
        for _ in range(n):
            sent_at.append(now)
            pacer.consume()
        now += 0.0037 if n else max(pacer.delay(now), 1e-4)
        if len(sent_at) >= 300:
            break
    assert len(sent_at) >= 300
    for k, t in enumerate(sent_at):
        assert t >= k / 100.0 - 1e-9, (k, t)


@pytest.mark.unit
def test_pacer_forgives_debt_beyond_burst() -> None:
    pacer = Pacer(rate=1000.0, burst=50, start=0.0)
    assert pacer.due(0.0) == 1
    pacer.consume()
    assert pacer.due(10.0) == 50  # ten seconds late: at most one burst at once
    pacer.consume(50)
    assert pacer.due(10.0) == 0
    assert pacer.delay(10.0) == pytest.approx(0.001)
    unpaced = Pacer(rate=0.0, burst=64, start=0.0)
    assert unpaced.due(0.0) == 64 and unpaced.delay(0.0) == 0.0


# --------------------------------------------------------------------------- streaming


@pytest.mark.unit
async def test_plain_frames_are_rsvps_in_order() -> None:
    server = ReplayServer(GeneratorSource(3), rate=0, count=40, close_at_end=True)
    async with running(server), session() as s, s.ws_connect(server.url) as ws:
        frames = await read_to_close(ws)
        assert ws.close_code == 1000
    assert [json.loads(f) for f in frames] == expected(3, 40)


@pytest.mark.unit
async def test_v1_stream_resumes_exactly_at_from() -> None:
    server = ReplayServer(GeneratorSource(8), rate=2000)  # endless
    async with running(server), session() as s:
        async with s.ws_connect(server.stream_url) as ws:
            first = await read_n(ws, 50)
        async with s.ws_connect(f"{server.stream_url}?from=50") as ws:
            second = await read_n(ws, 50)
    positions, events = positioned(first + second)
    assert positions == list(range(100))
    assert events == expected(8, 100)


@pytest.mark.unit
async def test_plain_endpoint_accepts_from() -> None:
    server = ReplayServer(GeneratorSource(4), rate=0, count=30, close_at_end=True)
    async with running(server), session() as s, s.ws_connect(f"{server.url}?from=20") as ws:
        frames = await read_to_close(ws)
    assert [json.loads(f) for f in frames] == expected(4, 30)[20:]


@pytest.mark.unit
async def test_restarted_server_serves_the_same_positions() -> None:
    got = []
    for _ in range(2):
        server = ReplayServer(GeneratorSource(21), rate=0, count=45, close_at_end=True)
        async with (
            running(server),
            session() as s,
            s.ws_connect(f"{server.stream_url}?from=40") as ws,
        ):
            got.append(positioned(await read_to_close(ws)))
    assert got[0] == got[1]
    assert got[0] == (list(range(40, 45)), expected(21, 45)[40:])


@pytest.mark.unit
async def test_positions_older_than_cache_are_regenerated() -> None:
    source = GeneratorSource(5, cache_size=10)
    server = ReplayServer(source, rate=0, count=60, close_at_end=True)
    async with running(server), session() as s:
        async with s.ws_connect(server.stream_url) as ws:
            pos_a, events_a = positioned(await read_to_close(ws))
        assert source.describe()["cached_from"] == 50  # position 5 is no longer cached
        async with s.ws_connect(f"{server.stream_url}?from=5") as ws:
            pos_b, events_b = positioned(await read_to_close(ws))
    want = expected(5, 60)
    assert (pos_a, events_a) == (list(range(60)), want)
    assert (pos_b, events_b) == (list(range(5, 60)), want[5:])


@pytest.mark.unit
async def test_concurrent_clients_have_their_own_positions() -> None:
    server = ReplayServer(GeneratorSource(6), rate=1000, count=80, close_at_end=True)
    async with running(server), session() as s:

        async def client(start: int) -> tuple[list[int], list[dict[str, Any]]]:
            async with s.ws_connect(f"{server.stream_url}?from={start}") as ws:
                return positioned(await read_to_close(ws))

        a, b, c = await asyncio.wait_for(
            asyncio.gather(client(0), client(30), client(75)), RECV_TIMEOUT
        )
    want = expected(6, 80)
    assert a == (list(range(80)), want)
    assert b == (list(range(30, 80)), want[30:])
    assert c == (list(range(75, 80)), want[75:])


@pytest.mark.unit
async def test_rate_pacing_does_not_run_ahead() -> None:
    server = ReplayServer(GeneratorSource(1), rate=500, count=250, close_at_end=True)
    async with running(server), session() as s:
        started = time.monotonic()
        async with s.ws_connect(server.url) as ws:
            frames = await read_to_close(ws)
        elapsed = time.monotonic() - started
    assert len(frames) == 250
    # Event 249 is due 249/500 = 0.498 s after the connection opened, not before.
    assert elapsed >= 0.4, elapsed


@pytest.mark.unit
async def test_ndjson_file_mode_skips_malformed_lines(tmp_path: Path) -> None:
    good = [json.dumps(r, separators=(",", ":")) for r in RsvpGenerator(12).take(10)]
    lines = [*good[:4], '{"venue": {"venue_name": ', "", "[1, 2]", *good[4:], "not json"]
    path = tmp_path / "rsvps.ndjson"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    server = ReplayServer(NdjsonSource(path), rate=0, close_at_end=True)
    async with running(server), session() as s:
        async with s.ws_connect(server.url) as ws:
            plain = await read_to_close(ws)
            assert ws.close_code == 1000
        async with s.ws_connect(f"{server.stream_url}?from=3") as ws:
            pos, events = positioned(await read_to_close(ws))
        stats = server.stats()
    assert plain == good  # sent as written, malformed lines not sent
    assert pos == list(range(3, 10))
    assert events == [json.loads(g) for g in good[3:]]
    assert stats["malformed"] == 3
    assert stats["source"]["malformed_lines"] == [5, 7, 14]
    assert stats["end"] == 10


@pytest.mark.unit
async def test_count_limit_closes_with_1000_when_asked() -> None:
    server = ReplayServer(GeneratorSource(2), rate=0, count=30, close_at_end=True)
    async with running(server), session() as s:
        async with s.ws_connect(f"{server.stream_url}?from=25") as ws:
            pos, _ = positioned(await read_to_close(ws))
            assert ws.close_code == 1000
        async with s.ws_connect(f"{server.stream_url}?from=40") as ws:
            assert await read_to_close(ws) == []
            assert ws.close_code == 1000
    assert pos == [25, 26, 27, 28, 29]


@pytest.mark.unit
async def test_count_limit_then_idle_but_open() -> None:
    server = ReplayServer(GeneratorSource(2), rate=0, count=10)
    async with running(server), session() as s, s.ws_connect(server.stream_url) as ws:
        pos, _ = positioned(await read_n(ws, 10))
        with pytest.raises(asyncio.TimeoutError):
            await ws.receive(timeout=0.3)  # quiet like a live stream, not closed
        assert not ws.closed
        await await_until(lambda: server.stats()["clients"][0]["reached_end"])
        assert server.stats()["active"] == 1
    assert pos == list(range(10))


@pytest.mark.unit
async def test_stats_match_what_clients_received() -> None:
    server = ReplayServer(GeneratorSource(7), rate=2000, count=160, close_at_end=True)
    async with running(server), session() as s:

        async def client(start: int) -> list[int]:
            async with s.ws_connect(f"{server.stream_url}?from={start}") as ws:
                return positioned(await read_to_close(ws))[0]

        got = await asyncio.wait_for(asyncio.gather(client(0), client(100)), RECV_TIMEOUT)
        await await_until(lambda: server.stats()["active"] == 0)
        async with s.get(f"http://127.0.0.1:{server.port}/stats") as resp:
            assert resp.status == 200
            over_http = await resp.json()
    stats = server.stats()
    assert over_http == json.loads(json.dumps(stats))
    by_start = {c["start"]: c for c in stats["clients"]}
    for positions in got:
        conn = by_start[positions[0]]
        assert conn["sent"] == len(positions)
        assert conn["highest_position"] == positions[-1]
        assert conn["reached_end"] and not conn["open"]
    assert stats["events_sent"] == sum(len(p) for p in got) == 160 + 60
    assert stats["highest_position"] == 159
    assert stats["connections"] == 2
    assert server.sent_positions() == {c["id"]: 159 for c in stats["clients"]}


@pytest.mark.unit
async def test_bad_from_is_a_400() -> None:
    server = ReplayServer(GeneratorSource(0), rate=10)
    async with running(server), session() as s:
        for query in ("from=-1", "from=abc"):
            with pytest.raises(aiohttp.WSServerHandshakeError) as err:
                await s.ws_connect(f"{server.stream_url}?{query}")
            assert err.value.status == 400
        async with s.get(f"http://127.0.0.1:{server.port}/v1/stream?from=x") as resp:
            assert resp.status == 400 and "from" in await resp.text()
        async with s.get(f"http://127.0.0.1:{server.port}/") as resp:  # plain HTTP, no upgrade
            assert resp.status == 400 and "WebSocket" in await resp.text()
        assert server.stats()["connections"] == 0


@pytest.mark.unit
async def test_stop_closes_clients_with_going_away() -> None:
    server = ReplayServer(GeneratorSource(0), rate=50)
    await server.start()
    try:
        async with session() as s, s.ws_connect(server.url) as ws:
            await read_n(ws, 1)
            stopping = asyncio.create_task(server.stop())
            await read_to_close(ws)  # a live client keeps reading: frames in flight, the close
            assert ws.close_code == 1001
            await asyncio.wait_for(stopping, RECV_TIMEOUT)
    finally:
        await server.stop()


@pytest.mark.unit
async def test_serve_replay_runs_until_cancelled() -> None:
    ready: asyncio.Future[ReplayServer] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve_replay(seed=31, rate=1000, count=5, close_at_end=True, on_ready=ready.set_result)
    )
    try:
        server = await asyncio.wait_for(ready, RECV_TIMEOUT)
        async with session() as s, s.ws_connect(server.url) as ws:
            frames = await read_to_close(ws)
        assert [json.loads(f) for f in frames] == expected(31, 5)
    finally:
        task.cancel()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), RECV_TIMEOUT)
    port = server.port
    async with session() as s:
        with pytest.raises(aiohttp.ClientConnectionError):
            await s.get(f"http://127.0.0.1:{port}/stats")


RUN_REPLAY = """
from cluster.replay import run_replay
run_replay(seed=9, rate=200, on_ready=lambda s: print(s.url, flush=True))
print("clean exit", flush=True)
"""


async def test_run_replay_stops_cleanly_on_ctrl_c() -> None:
    proc = subprocess.Popen([sys.executable, "-c", RUN_REPLAY], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        assert line.startswith("ws://127.0.0.1:"), line
        async with session() as s, s.ws_connect(line.strip()) as ws:
            (frame,) = await read_n(ws, 1)
        assert json.loads(frame) == expected(9, 1)[0]
        proc.send_signal(signal.SIGINT)
        rest = await asyncio.wait_for(asyncio.to_thread(proc.stdout.read), 15)
        assert proc.wait(timeout=15) == 0
        assert "clean exit" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
