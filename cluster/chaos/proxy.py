"""A TCP fault proxy on loopback, modelled on Toxiproxy's toxics, for chaos tests.

`FaultProxy` sits between a client and one upstream (an actor and NATS, a producer and a
collector) and forwards bytes both ways. Toxics change that while they are active:

- `Latency`: each chunk is held `ms` (+- `jitter_ms`) after it arrived.
- `Bandwidth`: at most `kbps` kilobytes (1000 bytes) per second, like Toxiproxy's `rate`.
- `ResetPeer`: the connection is reset (RST, SO_LINGER 0) `timeout_ms` after the toxic met it.
- `Blackhole`: data is read and dropped, never forwarded; the connection stays open
  (Toxiproxy's `timeout` toxic with timeout 0).
- `SlowClose`: a side's close (EOF) reaches the other side `delay_ms` late.

Every toxic has a `direction` ("upstream" = client to server, "downstream" = server to
client, or "both") and a `toxicity`: the probability that it applies to a given connection,
drawn once per (toxic, connection). Toxics act on existing and new connections while active;
removing one (explicitly, by `duration_s`, by `clear` or by `stop`) restores plain
forwarding at once, also for a chunk it is holding. Randomness (jitter, toxicity) comes
from `seed` and the toxic/connection/direction names only, so a seeded run replays the same
delays whatever the interleaving of connections.

`ProxyThread` is the same API for synchronous code: a `FaultProxy` on its own loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import secrets
import socket
import struct
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from runtime.loop_thread import LoopThread

__all__ = [
    "Bandwidth",
    "Blackhole",
    "DIRECTIONS",
    "FaultProxy",
    "Latency",
    "ProxyThread",
    "ResetPeer",
    "SlowClose",
    "Toxic",
    "latency_sampler",
]

T = TypeVar("T")
UP, DOWN = "upstream", "downstream"
DIRECTIONS = (UP, DOWN, "both")
_CHUNK = 64 * 1024
_QUEUE_CHUNKS = 64  # per direction: beyond this the reader waits (TCP backpressure)
_PACE_S = 0.02  # bandwidth: write in slices of this many seconds' worth of bytes


class Latency(msgspec.Struct, frozen=True):
    """Hold each chunk `ms` +- `jitter_ms` (uniform, never below 0) after it arrived."""

    ms: float
    jitter_ms: float = 0
    direction: str = "both"
    toxicity: float = 1.0


class Bandwidth(msgspec.Struct, frozen=True):
    """At most `kbps` kilobytes per second (1 KB = 1000 bytes, Toxiproxy's `rate`)."""

    kbps: float
    direction: str = "both"
    toxicity: float = 1.0


class ResetPeer(msgspec.Struct, frozen=True):
    """Reset the connection (RST) `timeout_ms` after the toxic meets it. "downstream"
    resets the client's side, "upstream" the server's, "both" each; the other side is
    closed normally."""

    timeout_ms: float = 0
    direction: str = "both"
    toxicity: float = 1.0


class Blackhole(msgspec.Struct, frozen=True):
    """Read and drop everything in `direction`; the connection stays open."""

    direction: str = "both"
    toxicity: float = 1.0


class SlowClose(msgspec.Struct, frozen=True):
    """A side's close reaches the other side `delay_ms` late."""

    delay_ms: float
    direction: str = "both"
    toxicity: float = 1.0


Toxic = Latency | Bandwidth | ResetPeer | Blackhole | SlowClose
_KINDS: dict[type, str] = {
    Latency: "latency",
    Bandwidth: "bandwidth",
    ResetPeer: "reset_peer",
    Blackhole: "blackhole",
    SlowClose: "slow_close",
}


def _validate(toxic: Toxic) -> None:
    if type(toxic) not in _KINDS:
        raise TypeError(f"not a toxic: {toxic!r}")
    if toxic.direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {toxic.direction!r}")
    if not 0.0 <= toxic.toxicity <= 1.0:
        raise ValueError(f"toxicity is a probability in [0, 1], got {toxic.toxicity}")
    numbers = {
        Latency: ("ms", "jitter_ms"),
        Bandwidth: ("kbps",),
        ResetPeer: ("timeout_ms",),
        SlowClose: ("delay_ms",),
    }.get(type(toxic), ())
    for name in numbers:
        if getattr(toxic, name) < 0:
            raise ValueError(f"{_KINDS[type(toxic)]}.{name} must be >= 0")
    if isinstance(toxic, Bandwidth) and toxic.kbps <= 0:
        raise ValueError("bandwidth.kbps must be > 0 (use Blackhole to stop data)")


def _rng(seed: int, *key: object) -> random.Random:
    """A generator fixed by the seed and a name: independent of any other draw's order."""
    return random.Random(":".join(str(k) for k in (seed, *key)))


def latency_sampler(toxic: Latency, seed: int, *key: object) -> Callable[[], float]:
    """Successive delays in seconds for one (toxic, connection, direction) stream."""
    rng = _rng(seed, "latency", *key)

    def sample() -> float:
        jitter = rng.uniform(-toxic.jitter_ms, toxic.jitter_ms) if toxic.jitter_ms else 0.0
        return max(0.0, toxic.ms + jitter) / 1000.0

    return sample


async def _hold(removed: asyncio.Event, seconds: float) -> bool:
    """Wait `seconds` unless the toxic is removed first; True when the full time passed."""
    if seconds <= 0:
        return not removed.is_set()
    try:
        await asyncio.wait_for(removed.wait(), seconds)
    except TimeoutError:
        return True
    return False


@dataclass(eq=False)
class _Active:
    id: str
    toxic: Toxic
    removed: asyncio.Event = field(default_factory=asyncio.Event)
    hits: int = 0
    timer: asyncio.TimerHandle | None = None

    @property
    def kind(self) -> str:
        return _KINDS[type(self.toxic)]

    def acts_on(self, direction: str) -> bool:
        return self.toxic.direction in (direction, "both")


class _Conn:
    """One proxied connection: the client's streams, the upstream's, and two pumps."""

    def __init__(
        self,
        proxy: FaultProxy,
        no: int,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        server: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.proxy = proxy
        self.no = no
        self.client_r, self.client_w = client
        self.server_r, self.server_w = server
        self.closed = False
        self.tasks: set[asyncio.Task[Any]] = set()
        self._applies: dict[str, bool] = {}
        self._samplers: dict[tuple[str, str], Callable[[], float]] = {}
        self._eof = {UP: False, DOWN: False}

    # ---- toxics as this connection sees them ------------------------------------------

    def applies(self, active: _Active) -> bool:
        """Whether `active` acts on this connection (toxicity, drawn once)."""
        got = self._applies.get(active.id)
        if got is None:
            p = active.toxic.toxicity
            got = p >= 1.0 or (p > 0 and _rng(self.proxy.seed, active.id, self.no).random() < p)
            self._applies[active.id] = got
        return got

    def toxics(self, direction: str) -> list[_Active]:
        return [
            a
            for a in self.proxy._toxics.values()
            if a.acts_on(direction) and not a.removed.is_set() and self.applies(a)
        ]

    def delay(self, active: _Active, direction: str) -> float:
        key = (active.id, direction)
        sample = self._samplers.get(key)
        if sample is None:
            assert isinstance(active.toxic, Latency)
            sample = latency_sampler(active.toxic, self.proxy.seed, active.id, self.no, direction)
            self._samplers[key] = sample
        return sample()

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        for direction in (UP, DOWN):
            queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(_QUEUE_CHUNKS)
            self.spawn(self._read(direction, queue))
            self.spawn(self._write(direction, queue))
        for active in list(self.proxy._toxics.values()):
            self.meet(active)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def meet(self, active: _Active) -> None:
        """A toxic that acts on its own schedule (reset) starts its clock here."""
        if isinstance(active.toxic, ResetPeer) and self.applies(active):
            self.spawn(self._reset_after(active))

    async def _reset_after(self, active: _Active) -> None:
        assert isinstance(active.toxic, ResetPeer)
        if not await _hold(active.removed, active.toxic.timeout_ms / 1000.0):
            return
        if self.closed:
            return
        active.hits += 1
        self.proxy._counts["resets"] += 1
        direction = active.toxic.direction
        self.abort(rst_client=direction in (DOWN, "both"), rst_server=direction in (UP, "both"))

    def abort(self, *, rst_client: bool = False, rst_server: bool = False) -> None:
        """Close both sides now (RST where asked); the pumps end."""
        if self.closed:
            return
        self.closed = True
        for writer, rst in ((self.client_w, rst_client), (self.server_w, rst_server)):
            if rst:
                _set_rst(writer)
                writer.transport.abort()
            else:
                writer.close()
        for task in list(self.tasks):
            if task is not asyncio.current_task():
                task.cancel()
        self.proxy._conns.discard(self)

    async def wait(self) -> None:
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    # ---- pumps -------------------------------------------------------------------------

    def _ends(self, direction: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return (self.client_r, self.server_w) if direction == UP else (self.server_r, self.client_w)

    async def _read(self, direction: str, queue: asyncio.Queue[tuple[float, bytes]]) -> None:
        reader, _ = self._ends(direction)
        try:
            while True:
                data = await reader.read(_CHUNK)
                await queue.put((time.monotonic(), data))
                if not data:
                    return
        except (ConnectionError, OSError):
            self.abort()

    async def _write(self, direction: str, queue: asyncio.Queue[tuple[float, bytes]]) -> None:
        _, writer = self._ends(direction)
        try:
            while True:
                stamp, data = await queue.get()
                if not data:
                    await self._close_side(direction, writer)
                    return
                await self._forward(direction, writer, stamp, data)
        except (ConnectionError, OSError):
            self.abort()

    async def _forward(
        self, direction: str, writer: asyncio.StreamWriter, stamp: float, data: bytes
    ) -> None:
        toxics = self.toxics(direction)
        for active in toxics:
            if isinstance(active.toxic, Blackhole):
                active.hits += 1
                self.proxy._counts[f"dropped_{direction}"] += len(data)
                return
        for active in toxics:
            if isinstance(active.toxic, Latency):
                active.hits += 1
                wait = stamp + self.delay(active, direction) - time.monotonic()
                await _hold(active.removed, wait)
        limit = next(
            (a for a in self.toxics(direction) if isinstance(a.toxic, Bandwidth)),
            None,
        )
        if limit is None:
            writer.write(data)
        else:
            await self._paced(limit, writer, data)
        await writer.drain()
        self.proxy._counts[f"bytes_{direction}"] += len(data)

    async def _paced(self, limit: _Active, writer: asyncio.StreamWriter, data: bytes) -> None:
        """Write at the toxic's rate: each slice waits its share of time before it goes."""
        assert isinstance(limit.toxic, Bandwidth)
        rate = limit.toxic.kbps * 1000.0
        step = max(1, int(rate * _PACE_S))
        limit.hits += 1
        view = memoryview(data)
        for start in range(0, len(view), step):
            piece = view[start : start + step]
            if not limit.removed.is_set():
                await _hold(limit.removed, len(piece) / rate)
            writer.write(bytes(piece))
            await writer.drain()

    async def _close_side(self, direction: str, writer: asyncio.StreamWriter) -> None:
        """The source side closed: pass the EOF on (late under SlowClose)."""
        for active in self.toxics(direction):
            if isinstance(active.toxic, SlowClose):
                active.hits += 1
                await _hold(active.removed, active.toxic.delay_ms / 1000.0)
        self._eof[direction] = True
        if writer.can_write_eof() and not writer.is_closing():
            with contextlib.suppress(OSError):
                writer.write_eof()
        if all(self._eof.values()):
            self.closed = True
            self.client_w.close()
            self.server_w.close()
            self.proxy._conns.discard(self)


def _set_rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class FaultProxy:
    """A TCP proxy to one upstream with toxics; runs on the caller's event loop.

    Guarantees: every toxic is bounded (removed by `remove`, `clear`, its `duration_s`, or
    `stop`); `stop` closes the listener and every connection and cancels every timer.
    The sync methods (`add`, `remove`, `clear`, `disable`, `enable`, `stats`) must be called
    on the proxy's loop; use `ProxyThread` from other threads.
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        seed: int | None = None,
    ) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.listen_host = listen_host
        self.port = listen_port
        self.seed = seed if seed is not None else secrets.randbits(63)  # logged for replay
        self.enabled = True
        self._server: asyncio.base_events.Server | None = None
        self._toxics: dict[str, _Active] = {}
        self._history: dict[str, _Active] = {}
        self._conns: set[_Conn] = set()
        self._pending: set[asyncio.Task[Any]] = set()
        self._ids = itertools.count(1)
        self._conn_nos = itertools.count(1)
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "connections_total",
                "refused_upstream",
                "resets",
                f"bytes_{UP}",
                f"bytes_{DOWN}",
                f"dropped_{UP}",
                f"dropped_{DOWN}",
            ),
            0,
        )

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.port}"

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Listen (on `listen_port`, or a free port that `port` then names)."""
        await self._listen()

    def _listen(self) -> asyncio.Task[None]:
        """Bind and listen now (synchronously), so `enable` needs no await: connections
        that arrive before the server task runs wait in the backlog, never refused."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.listen_host, self.port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._serve(sock))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def _serve(self, sock: socket.socket) -> None:
        try:
            server = await asyncio.start_server(self._accept, sock=sock)
        except BaseException:
            sock.close()
            raise
        if not self.enabled or self._server is not None:  # disabled meanwhile
            server.close()
            return
        self._server = server

    async def stop(self) -> None:
        """Close the listener and every connection; drop every toxic. Idempotent."""
        self.enabled = False
        self.clear()
        for task in list(self._pending):
            task.cancel()
        await asyncio.gather(*list(self._pending), return_exceptions=True)
        self._close_listener()
        conns = list(self._conns)
        for conn in conns:
            conn.abort()
        for conn in conns:
            await conn.wait()

    def _close_listener(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def disable(self) -> None:
        """Like Toxiproxy's enabled=false: new connections are refused, open ones dropped."""
        self.enabled = False
        for task in list(self._pending):
            task.cancel()
        self._close_listener()
        for conn in list(self._conns):
            conn.abort()

    def enable(self) -> None:
        """Listen again on the same port."""
        if self.enabled:
            return
        self.enabled = True
        self._listen()

    # ---- toxics ------------------------------------------------------------------------

    def add(self, toxic: Toxic, *, duration_s: float | None = None) -> str:
        """Activate `toxic` on existing and new connections; its id. With `duration_s`
        it is removed by itself after that long."""
        _validate(toxic)
        if duration_s is not None and duration_s < 0:
            raise ValueError("duration_s must be >= 0")
        active = _Active(f"{_KINDS[type(toxic)]}-{next(self._ids)}", toxic)
        self._toxics[active.id] = active
        self._history[active.id] = active
        if duration_s is not None:
            active.timer = asyncio.get_running_loop().call_later(duration_s, self.remove, active.id)
        for conn in list(self._conns):
            conn.meet(active)
        return active.id

    def remove(self, toxic_id: str) -> None:
        """Deactivate a toxic (unknown or already removed ids are ignored)."""
        active = self._toxics.pop(toxic_id, None)
        if active is None:
            return
        active.removed.set()
        if active.timer is not None:
            active.timer.cancel()

    def clear(self) -> None:
        for toxic_id in list(self._toxics):
            self.remove(toxic_id)

    def stats(self) -> dict[str, Any]:
        """Connections, bytes forwarded/dropped per direction, resets, and per toxic (also
        removed ones) its kind, whether active, and how often it acted."""
        return {
            "enabled": self.enabled,
            "port": self.port,
            "seed": self.seed,
            "connections_open": len(self._conns),
            **self._counts,
            "toxics": {
                tid: {
                    "kind": a.kind,
                    "active": tid in self._toxics,
                    "hits": a.hits,
                    "toxic": msgspec.structs.asdict(a.toxic),
                }
                for tid, a in self._history.items()
            },
        }

    # ---- connections -------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.enabled:
            _set_rst(writer)
            writer.transport.abort()
            return
        self._counts["connections_total"] += 1
        try:
            server = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError:
            self._counts["refused_upstream"] += 1
            _set_rst(writer)
            writer.transport.abort()
            return
        if not self.enabled:  # disabled while connecting upstream
            server[1].transport.abort()
            _set_rst(writer)
            writer.transport.abort()
            return
        conn = _Conn(self, next(self._conn_nos), (reader, writer), server)
        self._conns.add(conn)
        conn.start()


class ProxyThread:
    """A `FaultProxy` on its own event loop thread: the same API, callable from any thread.

    `start`/`stop` (or `with ProxyThread(...) as p:`) run and end it; every other method
    runs on the proxy's loop and returns its result.
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        seed: int | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.proxy = FaultProxy(upstream_host, upstream_port, listen_host, listen_port, seed)
        self.timeout_s = timeout_s
        self._thread = LoopThread(f"fault-proxy-{upstream_host}:{upstream_port}")
        self._started = False

    @property
    def port(self) -> int:
        return self.proxy.port

    @property
    def address(self) -> str:
        return self.proxy.address

    @property
    def seed(self) -> int:
        return self.proxy.seed

    def start(self) -> None:
        async def main(stop: asyncio.Event, ready: Callable[[], None]) -> None:
            await self.proxy.start()
            ready()
            try:
                await stop.wait()
            finally:
                await self.proxy.stop()

        self._thread.start(main, self.timeout_s)
        self._started = True

    def stop(self) -> None:
        if self._started:
            self._started = False
            self._thread.stop(self.timeout_s)

    def _on_loop(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        async def call() -> T:
            return fn(*args, **kw)

        return self._thread.call(call()).result(self.timeout_s)

    def add(self, toxic: Toxic, *, duration_s: float | None = None) -> str:
        return self._on_loop(self.proxy.add, toxic, duration_s=duration_s)

    def remove(self, toxic_id: str) -> None:
        self._on_loop(self.proxy.remove, toxic_id)

    def clear(self) -> None:
        self._on_loop(self.proxy.clear)

    def disable(self) -> None:
        self._on_loop(self.proxy.disable)

    def enable(self) -> None:
        self._on_loop(self.proxy.enable)

    def stats(self) -> dict[str, Any]:
        return self._on_loop(self.proxy.stats)

    def __enter__(self) -> ProxyThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
