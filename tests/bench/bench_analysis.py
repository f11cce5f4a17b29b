"""Analysis benchmark: events/s through the Meetup top-N job on Spark local[2].

Prints numbers, asserts no speed (`make bench`). The same top-N query (all-time Space-Saving
of ``group.group_topics[].topic_name``, results through the idempotent sink to the results
stream and KV) runs twice over the same synthetic RSVPs, in the same Spark session: once
reading the JetStream stream through the ``jetstream`` source, once reading the same events
from JSON-lines files (Spark's file source), in micro-batches of equal size. A small
warm-up query per source first pays the Python workers' start-up, so neither measured run
does (for JetStream also a batch read in two partitions, so both cores' source workers
are started). Then `WARM_PAIRS` unmeasured pairs of the same top-N (jetstream, files) let
HotSpot compile the query code both share, so the measured pair compares the sources, not
which ran first; their ratios are printed. Micro-batch latency (p50/p99) is each batch's
``triggerExecution`` from query progress.

The same top-N job also runs with its own default scheduling over the same backlog (the
spec's trigger, every 0.5 s, and no ``maxEventsPerTrigger``: a micro-batch takes every event
that has arrived, here the whole backlog in one batch), from each source; it runs until it
has counted every event and its time ends with the batch that did. That row, not the fixed
batches of 5,000, is the measure of the "events/s for one topn job" goal: it is
what a job does when it starts behind. Its wall clock includes the query's start, which
for the jetstream source means Spark starting new Python processes for the source (its
offsets, the plan of its reads) before the first batch; they import pyspark from the
installed package rather than Spark's zip (`jobs.spark_session.worker_python`), and the
offsets' process is forked from the source zygote (`jobs/source_zygote.py`).

The sources alone, with no query, show how far each is from the query's rate: the same
micro-batches written to Spark's ``noop`` sink (every column of every row materialised,
nothing computed), and one batch ``spark.read`` of the whole stream (``count`` over every
row's ``data``), which reads its partitions in parallel.
The dead-letter query (`jobs.running.start_deadletters`, which reads every event to find
the malformed ones) runs over a stream of the same RSVPs with a few malformed payloads
among them, in one batch each time (a new checkpoint each); its ``addBatch`` is the time
it takes from the cores the jobs share. The driver's own dead-letter scan
(`jobs.deadletter_scan.DeadLetterScan`, no Spark) then reads the same stream from its
start, DL_RUNS times: its wall time and this process's CPU (the scan, its reads' loop thread).
A profile pass (py-spy on this process and its Spark Python workers, reading JetStream)
follows, not measured.

Run alone:
`.venv/bin/python -m pytest -s -o python_files='bench_*.py' tests/bench/bench_analysis.py`
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest

from cluster.demo.meetup import meetup_jobs, topic_counts
from cluster.demo.rsvps import RsvpGenerator
from jobs.deadletter_scan import DeadLetterScan
from jobs.jetstream import register
from jobs.running import start_deadletters, start_job
from runtime.config import load
from runtime.engines.services import spark_session
from runtime.job_specs import JobSpec
from runtime.nats.server import NatsEndpoint, NatsServer, connect
from runtime.waiting import wait_until
from tests.bench.common import Profiler, print_profile, write_report

EVENTS = int(os.environ.get("TIERFLOW_BENCH_ANALYSIS_EVENTS", "40000"))
PROFILE = os.environ.get("TIERFLOW_BENCH_PROFILE", "1") != "0"
PROFILE_S = 8.0
BATCH = int(os.environ.get("TIERFLOW_BENCH_BATCH", "5000"))
WARM = 10_000  # two partitions of a batch read: warms two source workers
DL_EVENTS = int(os.environ.get("TIERFLOW_BENCH_DL_EVENTS", "10000"))  # ~5 s at 2k events/s
DL_RUNS = 3
DL_BAD = (b'{"rsvp": ', b"\xff not utf-8", b"not json")
# Unmeasured top-N pairs (jetstream, then files, over the same events) before the measured
# pair: Spark's query code is shared by both sources, and HotSpot compiles it over the first
# dozens of batches, so whichever source ran first paid that warm-up. Three pairs in a row
# on a quiet machine: jetstream / files 0.69, 0.76, 0.85 (docs/benchmarks.md).
WARM_PAIRS = int(os.environ.get("TIERFLOW_BENCH_ANALYSIS_WARM_PAIRS", "2"))


def runs_ms(values: list[float]) -> str:
    """Each run's ms, sorted, and their median."""
    v = sorted(values)
    return f"{', '.join(f'{x:.0f}' for x in v)} ms (median {v[len(v) // 2]:.0f})"


def scan_deadletters(nats: NatsEndpoint, stream: str, events: int) -> dict[str, Any]:
    """One `DeadLetterScan` over `stream` from its start, in one pass: wall and CPU ms
    until its position passes the last event, and the dead letters it published."""
    published: list[int] = []
    cpu0, t0 = time.process_time(), time.perf_counter()
    scan = DeadLetterScan(
        nats, stream, 0, lambda _seq, r: published.append(r.published), max_events=events + 1
    ).start()
    try:
        wait_until(lambda: scan.position > events or not scan.isActive, 120, 0.005)
        assert scan.exception() is None, scan.exception()
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        scan.stop()
    return {
        "events": events,
        "wall_ms": wall * 1000,
        "cpu_ms": cpu * 1000,
        "letters": sum(published),
    }


async def publish(url: str, rsvps: list[bytes], warm: list[bytes], dl: list[bytes]) -> float:
    """Fill streams `meetup`, `warm` and `dl`; returns the seconds `meetup` took (not
    measured)."""
    nc = await connect(url)
    js = nc.jetstream()
    for name, subjects in (
        ("meetup", ["raw.meetup"]),
        ("warm", ["raw.warm"]),
        ("dl", ["raw.dl"]),
        ("results", ["results.>"]),
        ("deadletter", ["deadletter.>"]),
    ):
        await js.add_stream(name=name, subjects=subjects)
    await asyncio.gather(*[await js.publish_async("raw.warm", body) for body in warm])
    await asyncio.gather(*[await js.publish_async("raw.dl", body) for body in dl])
    t = time.perf_counter()
    for start in range(0, len(rsvps), 1000):
        acks = [
            await js.publish_async("raw.meetup", body, headers={"Nats-Msg-Id": f"b{start + i}"})
            for i, body in enumerate(rsvps[start : start + 1000])
        ]
        await asyncio.gather(*acks)
    elapsed = time.perf_counter() - t
    await nc.close()
    return elapsed


def quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def measure(query: Any, started: float, events: int) -> dict[str, Any]:
    assert query.awaitTermination(1800), "the benchmark query did not finish"
    wall = time.perf_counter() - started
    assert query.exception() is None, query.exception()
    progress = [json.loads(p.json) for p in query.recentProgress]
    return summarize(progress, wall, events)


def measure_until_counted(
    query: Any, started_epoch: float, events: int, timeout: float = 600.0
) -> dict[str, Any]:
    """A query on its own trigger, stopped once its batches hold `events`; its time ends
    when the batch that completed the count ended (from progress, not from polling)."""
    deadline = time.monotonic() + timeout
    progress: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        assert query.exception() is None, query.exception()
        progress = [json.loads(p.json) for p in query.recentProgress]
        if sum(p["numInputRows"] for p in progress) >= events:
            break
        time.sleep(0.05)
    query.stop()
    batches = [p for p in progress if p["numInputRows"]]
    assert batches and sum(p["numInputRows"] for p in batches) >= events, "not all counted"
    last = batches[-1]
    began = datetime.fromisoformat(last["timestamp"].replace("Z", "+00:00")).timestamp()
    ended = began + last["durationMs"]["triggerExecution"] / 1000
    return summarize(progress, ended - started_epoch, events)


def summarize(progress: list[dict[str, Any]], wall: float, events: int) -> dict[str, Any]:
    batches = [p for p in progress if p["numInputRows"]]
    lat = [float(p["durationMs"]["triggerExecution"]) for p in batches]
    rows = sum(p["numInputRows"] for p in batches)
    phases = sorted({k for p in batches for k in p["durationMs"]} - {"triggerExecution"})
    return {
        # median ms per batch of each part of triggerExecution (addBatch: the query's work)
        "phases_p50_ms": {
            k: quantile([float(p["durationMs"].get(k, 0)) for p in batches], 0.5) for k in phases
        },
        "events": rows,
        "batches": len(batches),
        "wall_s": wall,
        "events_per_s": events / wall,
        "processing_events_per_s": rows / (sum(lat) / 1000) if lat else 0.0,
        "p50_ms": quantile(lat, 0.5),
        "p99_ms": quantile(lat, 0.99),
    }


@pytest.mark.timeout(900)
def test_topn_events_per_second_jetstream_vs_files(tmp_path: Path) -> None:
    gen = RsvpGenerator(seed=1)
    rsvps = [gen.next() for _ in range(EVENTS)]
    bodies = [json.dumps(r).encode() for r in rsvps]
    files = tmp_path / "files"
    files.mkdir()
    for i, start in enumerate(range(0, EVENTS, BATCH)):
        (files / f"part-{i:04d}.json").write_bytes(b"\n".join(bodies[start : start + BATCH]))
    warm = tmp_path / "warm"
    warm.mkdir()
    (warm / "part.json").write_bytes(b"\n".join(bodies[:WARM]))

    cfg = load(
        environ={},
        overrides={
            "state_dir": str(tmp_path / "state"),
            "spark": {"conf": {"spark.ui.showConsoleProgress": False}},  # no progress bars
        },
    )
    cfg = msgspec.structs.replace(cfg, spark=msgspec.structs.replace(cfg.spark, master="local[2]"))
    spark = spark_session(cfg, app_name="tierflow-bench-analysis")
    register(spark)
    master = spark.sparkContext.master
    topn: JobSpec = meetup_jobs()[0]

    def files_source(path: Path) -> Any:
        return (
            spark.readStream.option("maxFilesPerTrigger", 1)
            .text(str(path))
            .withColumnRenamed("value", "data")
        )

    with NatsServer(store_dir=tmp_path / "nats", sync_interval="2m").start() as server:
        dl_bodies = bodies[:DL_EVENTS]
        for i, bad in enumerate(DL_BAD):
            dl_bodies.insert((i + 1) * DL_EVENTS // (len(DL_BAD) + 1), bad)
        publish_s = asyncio.run(publish(server.url, bodies, bodies[:WARM], dl_bodies))
        nats = NatsEndpoint(server.url)
        once = {"availableNow": True}

        def run(name: str, events: int = EVENTS, stream: str = "meetup", **kw: Any) -> Any:
            spec = msgspec.structs.replace(
                topn, name=name, stream=stream, max_events_per_trigger=BATCH
            )
            t = time.perf_counter()
            q = start_job(spark, spec, nats, tmp_path / "ckpt", trigger=once, **kw)
            return measure(q, t, events)

        def run_default(name: str, **kw: Any) -> dict[str, Any]:
            """The job with its spec's own trigger and read limit over the backlog."""
            spec = msgspec.structs.replace(topn, name=name, stream="meetup")
            t = time.time()
            q = start_job(spark, spec, nats, tmp_path / "ckpt", **kw)
            return measure_until_counted(q, t, EVENTS)

        def read_only(name: str, source: Any) -> dict[str, Any]:
            """The source alone: its micro-batches into the noop sink."""
            t = time.perf_counter()
            q = (
                source.writeStream.queryName(name)
                .format("noop")
                .option("checkpointLocation", str(tmp_path / "ckpt" / name))
                .trigger(availableNow=True)
                .start()
            )
            return measure(q, t, EVENTS)

        def js_source(stream: str) -> Any:
            reader = spark.readStream.format("jetstream").options(**nats.to_options())
            return reader.option("stream", stream).option("maxEventsPerTrigger", BATCH).load()

        run("bench_warm_files", WARM, source=files_source(warm))
        run("bench_warm_jetstream", WARM, stream="warm")
        # micro-batches of 5,000 are one partition each: a batch read in two partitions
        # starts the second source worker too, which the backlog ("own") rows use
        warm_df = spark.read.format("jetstream").options(**nats.to_options())
        warm_df = warm_df.option("stream", "warm").option("minPartitions", "2").load()
        assert warm_df.rdd.getNumPartitions() == 2
        assert warm_df.selectExpr("count(data)").collect()[0][0] == WARM
        warming = [
            (
                run(f"bench_warm{i}_jetstream"),
                run(f"bench_warm{i}_files", source=files_source(files)),
            )
            for i in range(WARM_PAIRS)
        ]
        from_js = run("bench_topn_jetstream")
        from_files = run("bench_topn_files", source=files_source(files))
        js_default = run_default("bench_topn_jetstream_default")
        files_default = run_default(
            "bench_topn_files_default",
            source=spark.readStream.text(str(files)).withColumnRenamed("value", "data"),
        )
        js_alone = read_only("bench_read_jetstream", js_source("meetup"))
        files_alone = read_only("bench_read_files", files_source(files))
        batch_df = spark.read.format("jetstream").options(**nats.to_options())
        batch_df = batch_df.option("stream", "meetup").load()
        t = time.perf_counter()
        counted = batch_df.selectExpr("count(data)").collect()[0][0]
        js_batch = {
            "events": counted,
            "partitions": batch_df.rdd.getNumPartitions(),
            "events_per_s": counted / (time.perf_counter() - t),
        }
        dead: list[dict[str, Any]] = []
        for i in range(DL_RUNS):
            letters: dict[int, int] = {}
            q = start_deadletters(
                spark,
                "dl",
                nats,
                tmp_path / f"ckpt-dl-{i}",
                trigger=once,
                on_batch=lambda b, r, seen=letters: seen.__setitem__(b, r.published),
            )
            assert q.awaitTermination(600) and q.exception() is None, q.exception()
            (last,) = [json.loads(p.json) for p in q.recentProgress if p.numInputRows]
            dead.append(
                {
                    **last["durationMs"],
                    "rows": last["numInputRows"],
                    "letters": sum(letters.values()),
                }
            )
        scans = [scan_deadletters(nats, "dl", len(dl_bodies)) for _ in range(DL_RUNS)]
        profiles: dict[str, Any] = {}
        if PROFILE:
            spy = Profiler(
                {"spark (driver + python workers)": os.getpid()},
                PROFILE_S,
                subprocesses=["spark (driver + python workers)"],
            )
            run("bench_topn_profile")
            profiles = spy.results()

        async def top_of(query: str) -> list[dict[str, Any]]:
            nc = await connect(server.url)
            kv = await nc.jetstream().key_value("results")
            value = json.loads((await kv.get(f"{query}.all")).value)
            await nc.close()
            return value["top"]

        queries = ("bench_topn_jetstream", "bench_topn_files", "bench_topn_jetstream_default")
        tops = [asyncio.run(top_of(q)) for q in queries]
    spark.stop()

    exact = [t for t, _ in topic_counts(rsvps).most_common(10)]
    assert all([t["item"] for t in top] == exact for top in tops)
    assert from_js["events"] == from_files["events"] == EVENTS
    assert js_default["events"] == files_default["events"] == EVENTS
    assert js_alone["events"] == files_alone["events"] == js_batch["events"] == EVENTS
    assert [d["letters"] for d in dead] == [len(DL_BAD)] * DL_RUNS
    assert [d["letters"] for d in scans] == [len(DL_BAD)] * DL_RUNS

    print(
        f"\nanalysis: Meetup top-N (Space-Saving, capacity 100000), {EVENTS} RSVPs, "
        f"micro-batches of {BATCH}, Spark {master}, {os.cpu_count()} cores "
        f"(stream filled in {publish_s:.1f} s, not measured)"
    )
    head = f"{'events/s':>10}{'proc ev/s':>11}{'batches':>9}{'p50 ms':>9}{'p99 ms':>9}"
    print(f"{'source':<24}{head}{'vs files':>10}")
    for label, r, files_r in (
        ("top-N, jetstream", from_js, from_files),
        ("top-N, files", from_files, from_files),
        ("top-N, jetstream, own", js_default, files_default),
        ("top-N, files, own", files_default, files_default),
        ("read only, jetstream", js_alone, files_alone),
        ("read only, files", files_alone, files_alone),
    ):
        print(
            f"{label:<24}{r['events_per_s']:>10,.0f}{r['processing_events_per_s']:>11,.0f}"
            f"{r['batches']:>9}{r['p50_ms']:>9.0f}{r['p99_ms']:>9.0f}"
            f"{r['events_per_s'] / files_r['events_per_s']:>10.2f}"
        )
    for label, r in (("top-N, jetstream", from_js), ("top-N, files", from_files)):
        parts = ", ".join(f"{k} {v:.0f}" for k, v in r["phases_p50_ms"].items() if v >= 1)
        print(f"{label}: p50 ms per batch of {parts}")
    if warming:
        ratios = ", ".join(f"{j['events_per_s'] / f['events_per_s']:.2f}" for j, f in warming)
        print(
            f"top-N jetstream / files in the {len(warming)} unmeasured pairs before (the JVM "
            f"warming): {ratios}"
        )
    print(
        f"batch read of the stream, count(data): {js_batch['events_per_s']:,.0f} events/s "
        f"over {js_batch['partitions']} partitions"
    )
    print(
        "events/s: wall clock from query start to its end; proc ev/s: events over the sum of "
        "batch durations; p50/p99: triggerExecution per micro-batch; own: the job's own "
        "trigger and read limit (the whole backlog in a batch), the goal's one topn job; "
        "read only: the same micro-batches into the noop sink, no query"
    )
    print(
        f"dead-letter query, one batch of {len(dl_bodies)} events ({len(DL_BAD)} malformed), "
        f"{DL_RUNS} runs: addBatch {runs_ms([d['addBatch'] for d in dead])}; "
        f"triggerExecution {runs_ms([d['triggerExecution'] for d in dead])}; "
        f"rows into Spark {dead[0]['rows']}"
    )
    print(
        f"dead-letter scan (no Spark), the same {len(dl_bodies)} events, {DL_RUNS} runs: "
        f"wall {runs_ms([d['wall_ms'] for d in scans])}; "
        f"CPU {runs_ms([d['cpu_ms'] for d in scans])}"
    )
    if profiles:
        print_profile(f"analysis from JetStream, {PROFILE_S:g} s", profiles)
    write_report(
        "analysis",
        {
            "events": EVENTS,
            "batch": BATCH,
            "master": master,
            "jetstream": from_js,
            "files": from_files,
            "warm_pairs": [{"jetstream": j, "files": f} for j, f in warming],
            "jetstream_default": js_default,
            "files_default": files_default,
            "jetstream_source": js_alone,
            "files_source": files_alone,
            "jetstream_batch_read": js_batch,
            "deadletters": dead,
            "deadletter_scans": scans,
            "profiles": profiles,
        },
    )
