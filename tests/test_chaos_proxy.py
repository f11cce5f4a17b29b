"""The TCP fault proxy against a real echo server and a real nats-server.

Timing asserts are lower bounds only (a toxic must delay at least what it injects);
waits are bounded conditions, never sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import nats.errors
import pytest
import pytest_asyncio

from cluster.chaos.proxy import (
    Bandwidth,
    Blackhole,
    FaultProxy,
    Latency,
    ProxyThread,
    ResetPeer,
    SlowClose,
    latency_sampler,
)
from runtime.nats.server import NatsServer, connect
from runtime.waiting import await_until

# --------------------------------------------------------------------------- echo server


@pytest_asyncio.fixture
async def echo() -> AsyncIterator[int]:
    """An echo server on loopback that closes its side once the client sent EOF."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


@pytest_asyncio.fixture
async def proxy(echo: int) -> AsyncIterator[FaultProxy]:
    p = FaultProxy("127.0.0.1", echo, seed=7)
    await p.start()
    yield p
    await p.stop()


async def open_(p: FaultProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", p.port)


async def round_trip(
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], data: bytes, timeout: float = 10
) -> float:
    """Seconds from sending `data` to having all of it echoed back."""
    reader, writer = conn
    t0 = time.monotonic()
    writer.write(data)
    await writer.drain()
    got = await asyncio.wait_for(reader.readexactly(len(data)), timeout)
    assert got == data
    return time.monotonic() - t0


async def close(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
    conn[1].close()
    with contextlib.suppress(ConnectionError):
        await conn[1].wait_closed()


# --------------------------------------------------------------------------- pure parts


@pytest.mark.unit
def test_toxics_are_validated() -> None:
    p = FaultProxy("127.0.0.1", 1)
    for bad in (
        Latency(ms=-1),
        Latency(ms=1, direction="sideways"),
        Latency(ms=1, toxicity=1.5),
        Bandwidth(kbps=0),
        SlowClose(delay_ms=-5),
    ):
        with pytest.raises(ValueError):
            p.add(bad)
    with pytest.raises(TypeError):
        p.add("latency")  # type: ignore[arg-type]


@pytest.mark.unit
def test_jitter_is_deterministic_given_a_seed() -> None:
    toxic = Latency(ms=100, jitter_ms=40)
    a = latency_sampler(toxic, 42, "latency-1", 1, "upstream")
    b = latency_sampler(toxic, 42, "latency-1", 1, "upstream")
    c = latency_sampler(toxic, 43, "latency-1", 1, "upstream")
    sa, sb, sc = ([f() for _ in range(50)] for f in (a, b, c))
    assert sa == sb
    assert sa != sc
    assert all(0.06 <= d <= 0.14 for d in sa)
    assert len(set(sa)) > 40  # it does jitter
    floor = latency_sampler(Latency(ms=5, jitter_ms=50), 1, "x")
    assert all(floor() >= 0 for _ in range(100))  # never negative


# --------------------------------------------------------------------------- echo server


@pytest.mark.unit
async def test_plain_forwarding_and_stats(proxy: FaultProxy) -> None:
    conn = await open_(proxy)
    await round_trip(conn, b"hello")
    s = proxy.stats()
    assert s["connections_total"] == 1 and s["connections_open"] == 1
    assert s["bytes_upstream"] == 5 and s["bytes_downstream"] == 5
    assert proxy.address == f"127.0.0.1:{proxy.port}"
    await close(conn)
    await await_until(lambda: proxy.stats()["connections_open"] == 0, 10, what="closed")


@pytest.mark.unit
@pytest.mark.parametrize(("direction", "factor"), [("upstream", 1), ("downstream", 1), ("both", 2)])
async def test_latency_delays_each_way(proxy: FaultProxy, direction: str, factor: int) -> None:
    conn = await open_(proxy)
    await round_trip(conn, b"warm")
    tid = proxy.add(Latency(ms=150, direction=direction))  # an existing connection too
    assert await round_trip(conn, b"slow") >= 0.15 * factor
    assert await round_trip(await open_(proxy), b"new") >= 0.15 * factor
    proxy.remove(tid)
    await round_trip(conn, b"fast again")
    hits = proxy.stats()["toxics"][tid]
    assert hits["kind"] == "latency" and not hits["active"] and hits["hits"] == 2 * factor
    await close(conn)


@pytest.mark.unit
async def test_removing_a_toxic_releases_what_it_holds(proxy: FaultProxy) -> None:
    conn = await open_(proxy)
    tid = proxy.add(Latency(ms=600_000))
    conn[1].write(b"held")
    await conn[1].drain()
    await await_until(lambda: proxy.stats()["toxics"][tid]["hits"] == 1, 10, what="held")
    proxy.remove(tid)
    assert await asyncio.wait_for(conn[0].readexactly(4), 10) == b"held"
    await close(conn)


@pytest.mark.unit
async def test_jittered_latency_stays_above_its_floor(proxy: FaultProxy) -> None:
    proxy.add(Latency(ms=100, jitter_ms=50, direction="upstream"))
    conn = await open_(proxy)
    for i in range(3):
        assert await round_trip(conn, b"j%d" % i) >= 0.05
    await close(conn)


@pytest.mark.unit
async def test_toxicity_picks_connections_reproducibly(echo: int) -> None:
    async def applied(seed: int) -> int:
        p = FaultProxy("127.0.0.1", echo, seed=seed)
        await p.start()
        try:
            tid = p.add(Latency(ms=1, toxicity=0.5))
            for i in range(20):
                conn = await open_(p)
                await round_trip(conn, b"t%d" % i)
                await close(conn)
            return p.stats()["toxics"][tid]["hits"] // 2  # one chunk each way
        finally:
            await p.stop()

    first = await applied(3)
    assert 0 < first < 20
    assert await applied(3) == first
    never = FaultProxy("127.0.0.1", echo)
    await never.start()
    tid = never.add(Latency(ms=10_000, toxicity=0.0))
    await round_trip(await open_(never), b"untouched")
    assert never.stats()["toxics"][tid]["hits"] == 0
    await never.stop()


@pytest.mark.unit
async def test_bandwidth_limits_bytes_per_second(proxy: FaultProxy) -> None:
    size, kbps = 150_000, 300.0
    tid = proxy.add(Bandwidth(kbps=kbps, direction="upstream"))
    conn = await open_(proxy)
    elapsed = await round_trip(conn, b"x" * size, timeout=60)
    assert elapsed >= size / (kbps * 1000)
    assert proxy.stats()["bytes_upstream"] == size
    proxy.remove(tid)
    await round_trip(conn, b"y" * size, timeout=60)  # unthrottled: completes
    await close(conn)


@pytest.mark.unit
async def test_reset_peer_resets_existing_and_new_connections(proxy: FaultProxy) -> None:
    conn = await open_(proxy)
    await round_trip(conn, b"before")
    tid = proxy.add(ResetPeer(timeout_ms=0))
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(conn[0].read(10), 10)
    fresh = await open_(proxy)
    with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
        await round_trip(fresh, b"doomed")
    proxy.remove(tid)
    assert proxy.stats()["resets"] >= 2
    await round_trip(await open_(proxy), b"after")


@pytest.mark.unit
async def test_reset_peer_after_a_timeout(proxy: FaultProxy) -> None:
    proxy.add(ResetPeer(timeout_ms=200), duration_s=30)
    t0 = time.monotonic()
    conn = await open_(proxy)
    await round_trip(conn, b"still fine")  # within the timeout the connection works
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(conn[0].read(10), 10)
    assert time.monotonic() - t0 >= 0.2


@pytest.mark.unit
async def test_blackhole_drops_until_removed(proxy: FaultProxy) -> None:
    conn = await open_(proxy)
    tid = proxy.add(Blackhole())
    conn[1].write(b"lost")
    await conn[1].drain()
    await await_until(lambda: proxy.stats()["dropped_upstream"] == 4, 10, what="dropped")
    proxy.remove(tid)
    await round_trip(conn, b"kept")  # the dropped bytes never arrive: only these come back
    assert conn[0].at_eof() is False and proxy.stats()["bytes_downstream"] == 4
    await close(conn)


@pytest.mark.unit
async def test_slow_close_delays_the_close(proxy: FaultProxy) -> None:
    proxy.add(SlowClose(delay_ms=300, direction="upstream"))
    reader, writer = await open_(proxy)
    await round_trip((reader, writer), b"bye")
    t0 = time.monotonic()
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 10) == b""  # the server's close came back
    assert time.monotonic() - t0 >= 0.3
    writer.close()


@pytest.mark.unit
async def test_disable_refuses_and_drops_enable_serves_again(proxy: FaultProxy) -> None:
    conn = await open_(proxy)
    await round_trip(conn, b"up")
    proxy.disable()
    with contextlib.suppress(ConnectionResetError):
        assert await asyncio.wait_for(conn[0].read(10), 10) == b""
    with pytest.raises(ConnectionRefusedError):
        await open_(proxy)
    proxy.enable()
    await round_trip(await open_(proxy), b"again")
    assert proxy.stats()["enabled"]


@pytest.mark.unit
async def test_duration_bounds_a_toxic_and_stop_undoes_everything(echo: int) -> None:
    p = FaultProxy("127.0.0.1", echo)
    await p.start()
    tid = p.add(Blackhole(), duration_s=0.2)
    await await_until(lambda: not p.stats()["toxics"][tid]["active"], 10, what="expired")
    conn = await open_(p)
    await round_trip(conn, b"flows")
    p.add(Latency(ms=600_000))
    await p.stop()
    assert all(not t["active"] for t in p.stats()["toxics"].values())
    assert p.stats()["connections_open"] == 0
    with contextlib.suppress(ConnectionResetError):
        assert await asyncio.wait_for(conn[0].read(10), 10) == b""
    with pytest.raises(ConnectionRefusedError):
        await open_(p)


def _sync_echo(port: int, data: bytes) -> float:
    """Seconds for `data` to come back through the proxy; asserts it came back intact."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(data)
        got = b""
        while len(got) < len(data):
            chunk = s.recv(65536)
            assert chunk, "closed early"
            got += chunk
        assert got == data, f"echo through the proxy altered {data!r} into {got!r}"
        return time.monotonic() - t0


@pytest.mark.unit
async def test_proxy_thread_serves_sync_code(echo: int) -> None:
    def scenario() -> dict[str, Any]:
        with ProxyThread("127.0.0.1", echo, seed=1) as p:
            _sync_echo(p.port, b"plain")  # came back intact (asserted inside)
            tid = p.add(Latency(ms=120, direction="downstream"))
            assert _sync_echo(p.port, b"slow") >= 0.12  # the toxic's delay, a lower bound
            p.remove(tid)
            p.add(Blackhole())
            p.clear()
            _sync_echo(p.port, b"clear")
            p.disable()
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", p.port), timeout=5)
            p.enable()
            _sync_echo(p.port, b"on")
            return p.stats()

    stats = await asyncio.get_running_loop().run_in_executor(None, scenario)
    assert stats["connections_total"] == 4 and stats["seed"] == 1


# --------------------------------------------------------------------------- nats-server


@pytest_asyncio.fixture
async def nats_proxy(nats_server: NatsServer) -> AsyncIterator[FaultProxy]:
    p = FaultProxy(nats_server.host, nats_server.port, seed=11)
    await p.start()
    yield p
    await p.stop()


class Events:
    """The client's connection callbacks, as counters to wait on."""

    def __init__(self) -> None:
        self.disconnected = 0
        self.reconnected = 0

    async def on_disconnect(self) -> None:
        self.disconnected += 1

    async def on_reconnect(self) -> None:
        self.reconnected += 1


async def proxied_client(p: FaultProxy, events: Events | None = None) -> Any:
    events = events or Events()
    return await connect(
        f"nats://{p.address}",
        disconnected_cb=events.on_disconnect,
        reconnected_cb=events.on_reconnect,
        error_cb=_ignore,
        reconnect_time_wait=0.1,
    )


async def _ignore(_: Exception) -> None:
    return None


async def _echo(msg: Any) -> None:
    await msg.respond(msg.data)


async def _ok(msg: Any) -> None:
    await msg.respond(b"ok")


async def test_nats_request_round_trip_is_delayed(
    nats_server: NatsServer, nats_proxy: FaultProxy
) -> None:
    direct = await connect(nats_server.url)
    await direct.subscribe("chaos.echo", cb=_echo)
    await direct.flush()
    nc = await proxied_client(nats_proxy)
    try:
        assert (await nc.request("chaos.echo", b"a", timeout=10)).data == b"a"
        tid = nats_proxy.add(Latency(ms=200))
        t0 = time.monotonic()
        assert (await nc.request("chaos.echo", b"b", timeout=10)).data == b"b"
        assert time.monotonic() - t0 >= 0.4  # 200 ms each way
        nats_proxy.remove(tid)
        assert (await nc.request("chaos.echo", b"c", timeout=10)).data == b"c"
    finally:
        await nc.close()
        await direct.close()


async def test_nats_reset_disconnects_and_client_reconnects_after_removal(
    nats_server: NatsServer, nats_proxy: FaultProxy
) -> None:
    direct = await connect(nats_server.url)
    await direct.subscribe("chaos.reset", cb=_ok)
    await direct.flush()
    events = Events()
    nc = await proxied_client(nats_proxy, events)
    try:
        tid = nats_proxy.add(ResetPeer(timeout_ms=0))
        await await_until(lambda: events.disconnected >= 1, 20, what="client saw the reset")
        # While the toxic is active, every reconnect attempt is reset too.
        await await_until(lambda: nats_proxy.stats()["resets"] >= 2, 20, what="retries reset")
        assert not nc.is_connected
        nats_proxy.remove(tid)
        await await_until(lambda: events.reconnected >= 1, 20, what="reconnected")
        assert (await nc.request("chaos.reset", b"", timeout=10)).data == b"ok"
    finally:
        await nc.close()
        await direct.close()


async def test_nats_blackhole_times_out_publish_with_ack_then_recovers(
    nats_server: NatsServer, nats_proxy: FaultProxy
) -> None:
    direct = await connect(nats_server.url)
    djs = direct.jetstream()
    await djs.add_stream(name="CHAOS_BH", subjects=["chaos.bh"])
    nc = await proxied_client(nats_proxy)
    js = nc.jetstream()
    try:
        await js.publish("chaos.bh", b"1", headers={"Nats-Msg-Id": "bh-1"}, timeout=10)
        tid = nats_proxy.add(Blackhole())
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish("chaos.bh", b"2", headers={"Nats-Msg-Id": "bh-2"}, timeout=1)
        nats_proxy.remove(tid)

        async def published() -> bool:
            try:
                await js.publish("chaos.bh", b"3", headers={"Nats-Msg-Id": "bh-3"}, timeout=2)
            except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError):
                return False
            return True

        await await_until(published, 30, what="publish after blackhole", swallow=True)
        info = await djs.stream_info("CHAOS_BH")
        assert info.state.messages == 2  # bh-2 was swallowed, never forwarded
        assert nats_proxy.stats()["dropped_upstream"] > 0
    finally:
        await nc.close()
        await djs.delete_stream("CHAOS_BH")
        await direct.close()


async def test_nats_disable_enable(nats_server: NatsServer, nats_proxy: FaultProxy) -> None:
    direct = await connect(nats_server.url)
    await direct.subscribe("chaos.de", cb=_ok)
    await direct.flush()
    events = Events()
    nc = await proxied_client(nats_proxy, events)
    try:
        nats_proxy.disable()
        await await_until(lambda: events.disconnected >= 1, 20, what="dropped")
        assert nats_proxy.stats()["connections_open"] == 0
        nats_proxy.enable()
        await await_until(lambda: events.reconnected >= 1, 20, what="reconnected")
        assert (await nc.request("chaos.de", b"", timeout=10)).data == b"ok"
    finally:
        await nc.close()
        await direct.close()
