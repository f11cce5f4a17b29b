"""Scaling: ingest events/s against collector replicas 1..4, scaled while the tier runs.

Prints numbers, asserts no speed (`make bench`). One collection tier (HML, k=0, four
logger groups so each collector has its own log, one bridge) on a real nats-server and the
session's Ray; `CollectionTier.scale("collector", n)` grows it between points. At each
point the known-id producer sends the same load (NDJSON batches of 100, 8 requests in
flight per replica, each point on fresh connections so SO_REUSEPORT spreads them). The
ceiling of n replicas is n times the 1-replica figure. A profile pass at 4 replicas
(py-spy on the collectors, loggers and the producer) follows, not measured.

Run alone:
`.venv/bin/python -m pytest -s -o python_files='bench_*.py' tests/bench/bench_scaling.py`
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from cluster.loadgen import drive, known_events
from cluster.pipeline import start_collection_tier
from runtime.config import load
from runtime.nats.server import NatsServer
from tests.bench.common import Profiler, print_profile, summary, write_report

EVENTS = int(os.environ.get("TIERFLOW_BENCH_EVENTS", "20000"))
PROFILE = os.environ.get("TIERFLOW_BENCH_PROFILE", "1") != "0"
PROFILE_S = 8.0
REPLICAS = (1, 2, 3, 4)
BATCH, PER_REPLICA = 100, 8
PAYLOAD = "x" * 400


@pytest.mark.timeout(900)
def test_ingest_against_collector_replicas(bench_ray: Any, tmp_path: Path) -> None:
    import ray

    cfg = load(
        environ={},
        overrides={
            "state_dir": str(tmp_path / "state"),
            "ray": {"namespace": "bench-scaling"},
            "roles": {
                "logger": {"k": 0, "replicas": max(REPLICAS)},
                "collector": {"port": 0, "replicas": 1},
            },
            "logging": {"mode": "hml"},
            "streams": {"bench": {"subjects": ["raw.bench.scaling"]}},
        },
    )
    rows: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    with NatsServer(store_dir=tmp_path / "nats").start() as server:
        tier = start_collection_tier(cfg, nats_url=server.url)
        try:
            for n in REPLICAS:
                tier.scale("collector", n)
                events = known_events(EVENTS, f"s{n}", make=lambda i: {"pad": PAYLOAD})
                report = asyncio.run(
                    drive(tier.url, "bench", events, batch=BATCH, concurrency=PER_REPLICA * n)
                )
                assert len(report.acknowledged) == EVENTS, "the benchmark lost events"
                rows.append({"replicas": n, "rate": report.rate, **summary(report.latencies_ms)})
            if PROFILE:
                pids = {
                    name: ray.get(tier.actor(name).heartbeat.remote(), timeout=30)["pid"]
                    for name in tier.collectors
                }
                for i, group in enumerate(tier.logger_groups):
                    pid = ray.get(group.replicas[0].heartbeat.remote(), timeout=30)["pid"]
                    pids[f"logger-{i}"] = pid
                pids["producer"] = os.getpid()
                events = known_events(10 * EVENTS, "sp", make=lambda i: {"pad": PAYLOAD})
                spy = Profiler(pids, PROFILE_S)
                asyncio.run(
                    drive(
                        tier.url,
                        "bench",
                        events,
                        batch=BATCH,
                        concurrency=PER_REPLICA * max(REPLICAS),
                        deadline_s=PROFILE_S,
                    )
                )
                profiles = spy.results()
        finally:
            tier.stop()
    base = rows[0]["rate"]
    print(
        f"\nscaling, HML k=0, {EVENTS} events of ~500 B per point, batches of {BATCH}, "
        f"{PER_REPLICA} requests in flight per replica, {os.cpu_count()} cores"
    )
    print(f"{'collectors':>10}{'accepted/s':>12}{'p50 ms':>8}{'p99 ms':>8}{'vs n x 1':>10}")
    for r in rows:
        r["vs_linear"] = r["rate"] / (base * r["replicas"])
        print(
            f"{r['replicas']:>10}{r['rate']:>12,.0f}{r['p50_ms']:>8.1f}{r['p99_ms']:>8.1f}"
            f"{r['vs_linear']:>10.2f}"
        )
    if profiles:
        print_profile(f"scaling at {max(REPLICAS)} collectors, {PROFILE_S:g} s", profiles)
    write_report(
        "scaling",
        {
            "events": EVENTS,
            "batch": BATCH,
            "per_replica_concurrency": PER_REPLICA,
            "points": rows,
            "profiles": profiles,
        },
    )
