"""Gateway fan-out: delivery latency to 1, 100 and 1,000 concurrent WebSocket clients (and
1,000 SSE clients); the figure is p99 against the 1-client p99 of the same run.

Prints numbers, asserts no speed (`make bench`); asserts every client got every event.
One gateway replica (a real Ray actor) on a
real nats-server; a publisher writes events carrying their publish time at a fixed rate to
one stream; every client subscribes from "new" and records, per event, the time from
publish to its own receipt (one machine, so one clock). That is the whole path: JetStream
append and ack, the gateway's one consumer, the fan-out, the socket, and the client's
parsing, all on the same 2 cores, so the clients' own CPU is part of the figure. The
gateway's own share is measured apart: `spread_*_ms` is, per batch of events, the time from
its arrival in the gateway's feed to the last subscriber's socket write (the feed's
`spread_recent_ms`, the batches of this phase only). Since other work on the same cores
stretches every wall-clock figure, each phase also reports CPU time per event published
(user + system, from the clients' subscription to the last delivery) of the gateway's
process (`gw_cpu_ms_per_event`) and of the clients' (`clients_cpu_ms_per_event`). A profile
pass (py-spy on the gateway and on the clients' process) at 1,000 WebSocket clients
follows, not measured; it samples from the moment every client is subscribed.

Run alone: `.venv/bin/python -m pytest -s -o python_files='bench_*.py' tests/bench/bench_gateway.py`
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import psutil
import pytest
import ray

from actors.access.gateway import Gateway
from runtime.config import load
from runtime.engines.services import ensure_streams
from runtime.nats.server import NatsServer, connect, free_port
from runtime.supervision.ray_actors import supervised_options
from runtime.waiting import await_until
from tests.bench.common import GcPauses, Profiler, print_profile, write_report

CLIENTS = tuple(
    int(c) for c in os.environ.get("TIERFLOW_BENCH_GW_CLIENTS", "1,100,1000").split(",")
)
RATE = float(os.environ.get("TIERFLOW_BENCH_GW_RATE", "10"))  # events/s published
SECONDS = float(os.environ.get("TIERFLOW_BENCH_GW_SECONDS", "10"))
PROFILE = os.environ.get("TIERFLOW_BENCH_PROFILE", "1") != "0"
PROFILE_S = 8.0
NS = "bench-gateway"
# 0: leave the clients' process's heap as earlier benches left it (see GcPauses)
FREEZE = os.environ.get("TIERFLOW_BENCH_GW_FREEZE", "1") != "0"


class _Data(msgspec.Struct):
    t: float


class _Frame(msgspec.Struct):
    op: str
    seq: int = 0
    data: _Data | None = None


_frame = msgspec.json.Decoder(_Frame)
_data = msgspec.json.Decoder(_Data)


class Stats:
    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.per_client: list[int] = []
        self.ready = 0


async def ws_client(url: str, stats: Stats, n: int, stop: asyncio.Event, s: Any) -> None:
    """Receives without a per-message timeout (a timer per message would be the client's
    own cost in the figure); a client still waiting when the phase ends is cancelled."""
    got = 0
    async with s.ws_connect(url) as ws:
        await ws.send_str('{"op":"subscribe","id":"b","stream":"bench","from":"new"}')
        await ws.receive()  # subscribed
        stats.ready += 1
        while got < n and not stop.is_set():
            msg = await ws.receive()
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            f = _frame.decode(msg.data)
            if f.op == "event" and f.data is not None:
                stats.latencies.append(time.time() - f.data.t)
                got += 1
    stats.per_client.append(got)


async def sse_client(url: str, stats: Stats, n: int, stop: asyncio.Event, s: Any) -> None:
    got = 0
    buf = b""
    async with s.get(url) as r:
        async for chunk in r.content.iter_any():
            buf += chunk
            *frames, buf = buf.split(b"\n\n")
            for frame in frames:
                if b"event: subscribed" in frame:
                    stats.ready += 1
                elif b"event: message" in frame:
                    data = frame[frame.index(b"data: ") + 6 :]
                    stats.latencies.append(time.time() - _data.decode(data).t)
                    got += 1
            if got >= n or stop.is_set():
                break
    stats.per_client.append(got)


def spread(gw: Any) -> tuple[int, list[float]]:
    """The bench feed's timed batches so far and the most recent spreads (ms)."""
    feed = ray.get(gw.stats.remote(), timeout=30).get("feeds", {}).get("bench", {})
    return feed.get("spread_batches", 0), list(feed.get("spread_recent_ms", []))


def cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def phase(
    kind: str,
    clients: int,
    gw_url: str,
    nats_url: str,
    gw_pid: int,
    seconds: float = SECONDS,
    on_ready: Callable[[], Any] = lambda: None,
) -> dict[str, Any]:
    stats = Stats()
    n = int(RATE * seconds)
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0)
    headers = {"Authorization": "Bearer bench"}
    gc_pauses = GcPauses()
    with gc_pauses.frozen(FREEZE):
        async with aiohttp.ClientSession(connector=connector, headers=headers) as s:
            if kind == "ws":
                url = f"{gw_url}/v1/ws"
                tasks = [
                    asyncio.create_task(ws_client(url, stats, n, stop, s)) for _ in range(clients)
                ]
            else:
                url = f"{gw_url}/v1/sse/bench?from=new"
                tasks = [
                    asyncio.create_task(sse_client(url, stats, n, stop, s)) for _ in range(clients)
                ]
            await await_until(lambda: stats.ready >= clients, timeout=120, what="clients ready")
            on_ready()  # e.g. start the profiler: the fan-out, not the connecting, is sampled
            cpu0 = cpu_s(gw_pid), cpu_s(os.getpid())
            nc = await connect(nats_url)
            js = nc.jetstream()
            t0 = time.perf_counter()
            for i in range(n):  # a fixed rate, not as fast as possible
                await js.publish("raw.bench", msgspec.json.encode({"i": i, "t": time.time()}))
                await asyncio.sleep(max(0.0, t0 + (i + 1) / RATE - time.perf_counter()))
            await nc.close()
            done, pending = await asyncio.wait(tasks, timeout=30)
            cpu1 = cpu_s(gw_pid), cpu_s(os.getpid())
            stop.set()
            for t in pending:
                t.cancel()  # incomplete: counted as such below
            await asyncio.gather(*pending, return_exceptions=True)
    lat = sorted(stats.latencies)

    def q(x: float) -> float:
        return lat[min(len(lat) - 1, int(x * len(lat)))] * 1000 if lat else float("nan")

    return {
        "protocol": kind,
        "clients": clients,
        "rate": RATE,
        "events": n,
        "deliveries": len(lat),
        "expected": n * clients,
        "complete_clients": sum(1 for g in stats.per_client if g >= n),
        "p50_ms": q(0.5),
        "p99_ms": q(0.99),
        "max_ms": lat[-1] * 1000 if lat else float("nan"),
        "gw_cpu_ms_per_event": (cpu1[0] - cpu0[0]) * 1000 / n,
        "clients_cpu_ms_per_event": (cpu1[1] - cpu0[1]) * 1000 / n,
        "clients_gc": {"frozen": FREEZE, **gc_pauses.summary()},
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


@pytest.mark.timeout(900)
def test_gateway_fan_out(bench_ray: Any, tmp_path: Path) -> None:
    cfg = load(
        environ={},
        overrides={
            "state_dir": str(tmp_path / "state"),
            "ray": {"namespace": NS},
            "auth": {"consumer_tokens": ["bench"]},
            "streams": {"bench": {"subjects": ["raw.bench"]}},
        },
    )
    profiles: dict[str, Any] = {}
    with NatsServer(store_dir=tmp_path / "nats").start() as server:

        async def streams() -> None:
            nc = await connect(server.url)
            await ensure_streams(nc, cfg)
            await nc.close()

        asyncio.run(streams())
        port = free_port()
        gw = (
            ray.remote(Gateway)
            .options(**supervised_options("gw-bench", NS, num_cpus=0))
            .remote(
                str(cfg.state_path),
                name="gw-bench",
                config=cfg.to_dict(),
                nats_url=server.url,
                port=port,
            )
        )
        try:
            ray.get(gw.endpoints.remote(), timeout=60)
            url = f"http://127.0.0.1:{port}"
            pid = ray.get(gw.heartbeat.remote(), timeout=30)["pid"]
            rows = []
            for kind, n in [*(("ws", c) for c in CLIENTS), ("sse", max(CLIENTS))]:
                before, _ = spread(gw)
                row = asyncio.run(phase(kind, n, url, server.url, pid))
                after, recent = spread(gw)
                mine = sorted(recent[-(after - before) :]) if after > before else []
                row["spread_batches"] = len(mine)
                row["spread_p50_ms"] = mine[len(mine) // 2] if mine else None
                row["spread_p99_ms"] = (
                    mine[min(len(mine) - 1, int(0.99 * len(mine)))] if mine else None
                )
                row["spread_max_ms"] = mine[-1] if mine else None
                rows.append(row)
            if PROFILE:
                spies: list[Profiler] = []

                def profile() -> None:
                    spies.append(Profiler({"gateway": pid, "clients": os.getpid()}, PROFILE_S))

                asyncio.run(
                    phase("ws", max(CLIENTS), url, server.url, pid, PROFILE_S, on_ready=profile)
                )
                profiles = spies[0].results()
            stats = ray.get(gw.stats.remote(), timeout=30)
        finally:
            ray.get(gw.shutdown.remote(), timeout=60)
            ray.kill(gw, no_restart=True)
    for r in rows:
        assert r["complete_clients"] == r["clients"], r
    one = next(r for r in rows if r["protocol"] == "ws" and r["clients"] == min(CLIENTS))
    print(
        f"\ngateway fan-out, {RATE:g} events/s for {SECONDS:g} s per point, one replica, "
        f"{os.cpu_count()} cores (clients on the same cores)"
    )
    print(
        f"{'protocol':<10}{'clients':>8}{'deliveries':>12}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'max ms':>9}{'1-client p99 / p99':>20}{'gw spread p50/p99 ms':>22}"
        f"{'cpu ms/event gw, clients':>26}"
    )
    for r in rows:
        r["vs_one"] = one["p99_ms"] / r["p99_ms"]
        print(
            f"{r['protocol']:<10}{r['clients']:>8,}{r['deliveries']:>12,}{r['p50_ms']:>9.1f}"
            f"{r['p99_ms']:>9.1f}{r['max_ms']:>9.1f}{r['vs_one']:>20.2f}"
            f"{_ms(r['spread_p50_ms']):>11}/{_ms(r['spread_p99_ms']):<10}"
            f"{r['gw_cpu_ms_per_event']:>16.2f}, {r['clients_cpu_ms_per_event']:<8.2f}"
        )
    for r in rows:
        g = r["clients_gc"]
        print(
            f"  {r['protocol']} {r['clients']:,} clients: the clients' process "
            f"{GcPauses.describe(g)}"
        )
    print(
        f"gateway: events_sent {stats['events_sent']:,}, lag warnings {stats['lag_warnings']}, "
        f"dropped {stats['dropped']}, cut off {stats['slow_disconnects']}"
    )
    if profiles:
        print_profile(f"gateway at {max(CLIENTS):,} WebSocket clients, {PROFILE_S:g} s", profiles)
    write_report(
        "gateway",
        {"rate": RATE, "seconds": SECONDS, "phases": rows, "gateway": stats, "profiles": profiles},
    )
