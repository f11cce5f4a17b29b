"""Gateway benchmark: delivery latency to 1,000 concurrent WebSocket, then SSE, clients.

Prints numbers, asserts no speed (`make bench`). One gateway replica (a real Ray actor) on a
real nats-server; a publisher writes events carrying their publish time at a fixed rate to
one stream; every client subscribes from "new" and records, per event, the time from
publish to its own receipt (one machine, so one clock). That is the whole path: JetStream
append and ack, the gateway's one consumer, the fan-out, the socket, and the client's
parsing, all on the same 2 cores, so the clients' own CPU is part of the figure.

Run alone: `.venv/bin/python -m pytest -s -o python_files='bench_*.py' tests/bench/bench_gateway.py`
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import ray

from actors.gateway import Gateway
from runtime.config import load
from runtime.nats import NatsServer, connect, free_port
from runtime.ray_supervisor import supervised_options
from runtime.services import ensure_streams
from runtime.waiting import await_until

CLIENTS = int(os.environ.get("TIERFLOW_BENCH_GW_CLIENTS", "1000"))
RATE = float(os.environ.get("TIERFLOW_BENCH_GW_RATE", "10"))  # events/s published
SECONDS = float(os.environ.get("TIERFLOW_BENCH_GW_SECONDS", "15"))
NS = "bench-gateway"


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
    got = 0
    async with s.ws_connect(url) as ws:
        await ws.send_str('{"op":"subscribe","id":"b","stream":"bench","from":"new"}')
        await ws.receive()  # subscribed
        stats.ready += 1
        while got < n and not stop.is_set():
            try:
                msg = await ws.receive(timeout=2)
            except TimeoutError:
                continue
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


async def phase(kind: str, gw_url: str, nats_url: str) -> dict[str, Any]:
    stats = Stats()
    n = int(RATE * SECONDS)
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0)
    headers = {"Authorization": "Bearer bench"}
    async with aiohttp.ClientSession(connector=connector, headers=headers) as s:
        if kind == "ws":
            url = f"{gw_url}/v1/ws"
            tasks = [asyncio.create_task(ws_client(url, stats, n, stop, s)) for _ in range(CLIENTS)]
        else:
            url = f"{gw_url}/v1/sse/bench?from=new"
            tasks = [
                asyncio.create_task(sse_client(url, stats, n, stop, s)) for _ in range(CLIENTS)
            ]
        await await_until(lambda: stats.ready >= CLIENTS, timeout=120, what="clients ready")
        nc = await connect(nats_url)
        js = nc.jetstream()
        t0 = time.perf_counter()
        for i in range(n):  # a fixed rate, not as fast as possible
            await js.publish("raw.bench", msgspec.json.encode({"i": i, "t": time.time()}))
            await asyncio.sleep(max(0.0, t0 + (i + 1) / RATE - time.perf_counter()))
        await nc.close()
        done, pending = await asyncio.wait(tasks, timeout=30)
        stop.set()
        await asyncio.gather(*pending, return_exceptions=True)
    lat = sorted(stats.latencies)

    def q(x: float) -> float:
        return lat[min(len(lat) - 1, int(x * len(lat)))] * 1000 if lat else float("nan")

    return {
        "protocol": kind,
        "clients": CLIENTS,
        "rate": RATE,
        "events": n,
        "deliveries": len(lat),
        "expected": n * CLIENTS,
        "complete_clients": sum(1 for g in stats.per_client if g >= n),
        "p50_ms": q(0.5),
        "p99_ms": q(0.99),
        "max_ms": lat[-1] * 1000 if lat else float("nan"),
    }


def test_gateway_delivery_latency(tmp_path: Path) -> None:
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg = load(
        environ={},
        overrides={
            "state_dir": str(tmp_path / "state"),
            "ray": {"namespace": NS},
            "auth": {"consumer_tokens": ["bench"]},
            "streams": {"bench": {"subjects": ["raw.bench"]}},
        },
    )
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
            rows = [asyncio.run(phase(kind, url, server.url)) for kind in ("ws", "sse")]
            stats = ray.get(gw.stats.remote(), timeout=30)
        finally:
            ray.get(gw.shutdown.remote(), timeout=60)
            ray.kill(gw, no_restart=True)
    print(
        f"\ngateway delivery latency, {CLIENTS} clients per protocol, {RATE:g} events/s for "
        f"{SECONDS:g} s, one replica, {os.cpu_count()} cores (clients on the same cores)"
    )
    print(
        f"{'protocol':<10}{'deliveries':>12}{'expected':>10}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"
    )
    for r in rows:
        print(
            f"{r['protocol']:<10}{r['deliveries']:>12,}{r['expected']:>10,}{r['p50_ms']:>9.1f}"
            f"{r['p99_ms']:>9.1f}{r['max_ms']:>9.1f}"
        )
    print(
        f"gateway: events_sent {stats['events_sent']:,}, lag warnings {stats['lag_warnings']}, "
        f"dropped {stats['dropped']}, cut off {stats['slow_disconnects']}"
    )
    out = Path("reports")
    out.mkdir(exist_ok=True)
    (out / "bench_gateway.json").write_text(
        json.dumps(
            {"cores": os.cpu_count(), "phases": rows, "gateway": stats}, indent=2, default=str
        )
    )
