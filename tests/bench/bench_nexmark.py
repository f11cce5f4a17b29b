"""Nexmark benchmark: every query tierflow runs, as a sql job on Spark local[2].

Prints numbers, asserts no speed (`make bench`); asserts every answer. The events
(`TIERFLOW_BENCH_NEXMARK_EVENTS`: 200,000 in `make bench`, 1,000,000 in
`make bench-nexmark`; 10,000 events/s of event time, emitted out of order within groups
of 100) are generated once, written to JetStream (the streams
`person`, `auction` and `bid`, plus the flush of tests/nexmark_oracle.py) and to JSON-lines
files, and each query then runs, in one Spark session, over the same events:

- ``jetstream``: from the jetstream source into Spark's ``noop`` sink (Nexmark measures
  engines with a discarding sink);
- ``files``: the same query over the same events as files into ``noop``: Spark's own
  ceiling here, and the ratio jetstream / files;
- ``exactly_once``: from the jetstream source through tierflow's result sink (results
  stream and KV, `jobs.running.start_job`); its answer is then compared with DuckDB's over
  the same events (tests/nexmark_oracle.py): equal, or the bench fails.

The noop runs go `TIERFLOW_BENCH_NEXMARK_ROUNDS` times (default 3) over both sources,
alternating, and the run of median events/s is the one reported (its CPU too): single runs
of a few seconds on two shared cores differ by a fifth from one to the next.
Each run reads its sources in micro-batches of at most `MAX_PER_TRIGGER` events per stream
with `availableNow`; events/s is the events read over the time from the first batch's start
to the last one's end (query progress). Per core counts as Nexmark does, every generated
event over the time the query took to process its share (q3 and q8 read only persons and
auctions, 8% of the events), divided by the 2 cores of local[2], beside Flink 1.13's
published per-core figures (`nexmark/nexmark` README). An unmeasured warm-up (q1 over both
sources) first starts the JVM's compiler. The jetstream runs read through the source jobs
use (`jobs.jvm_source.stream_format`: the JVM source when the session has its jar), given
each stream's schema as `fields`, as a job's are, so the source reads the plain events'
fields itself; the files runs parse them with Spark's `from_json` (docs/sql-jobs.md).

Then end-to-end latency for q5 and q7: events at a steady `TIERFLOW_BENCH_NEXMARK_RATE`
(default 10,000/s) for `TIERFLOW_BENCH_NEXMARK_SECONDS` (default 30), stamped with the wall
clock when sent, and the job on a 0.5 s trigger; a result's latency is when its message
reached a subscriber of ``results.<job>`` minus the event time it stands for (q7: the
newest bid the row counted, a column this run adds; q5: its sliding window's end, so the
5 s watermark is in it: a window is out only once the watermark passes).

Then q0-q2 once more with nats-server on one core and Spark (`local[1]`) on the other
(`test_stateless_queries_with_nats_server_on_a_core_of_its_own`): the source's cost to
Spark's own core when the server has a core of its own, as in a deployment.

Run alone:
`.venv/bin/python -m pytest -s -o python_files='bench_*.py' tests/bench/bench_nexmark.py`
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import pytest

from cluster.nexmark.generator import Generator
from cluster.nexmark.load import ensure_streams, load, paced, subjects
from cluster.nexmark.queries import NOT_RUN, QUERIES, nexmark_streams
from jobs.jetstream import register
from jobs.running import job_plan, read_stream, start_job
from runtime.config import StreamConfig
from runtime.config import load as load_config
from runtime.engines.services import spark_session
from runtime.job_specs import decode_spec
from runtime.nats.publisher import JetStreamPublisher, Outgoing
from runtime.nats.server import NatsEndpoint, NatsServer, connect
from tests.bench.common import CpuMeter, quantile, write_report
from tests.nexmark_oracle import FLUSH_GAP_MS, Oracle, load_events, spark_rows

# `make bench` runs 200,000; `make bench-nexmark` the full 1,000,000
EVENTS = int(os.environ.get("TIERFLOW_BENCH_NEXMARK_EVENTS", "200000"))
RATE = int(os.environ.get("TIERFLOW_BENCH_NEXMARK_RATE", "10000"))
SECONDS = float(os.environ.get("TIERFLOW_BENCH_NEXMARK_SECONDS", "30"))
ONLY = [q for q in os.environ.get("TIERFLOW_BENCH_NEXMARK_QUERIES", "").split(",") if q]
MAX_PER_TRIGGER = 100_000
# each query's noop runs over both sources, alternating; the median run is reported
ROUNDS = int(os.environ.get("TIERFLOW_BENCH_NEXMARK_ROUNDS", "3"))
CORES = 2
GEN = Generator(seed=11, rate=10_000, disorder=100)
# Flink 1.13, events/s per core (nexmark/nexmark README)
FLINK_PER_CORE = {
    "q0": 155_000,
    "q1": 158_000,
    "q2": 175_000,
    "q3": 152_000,
    "q4": 34_000,
    "q5": 22_000,
    "q7": 12_000,
    "q8": 146_000,
    "q9": 14_000,
    "q11": 40_000,
    "q12": 76_000,
    "q16": 19_000,
    "q20": 19_000,
}
STREAMS = {k: msgspec.convert(v, StreamConfig) for k, v in nexmark_streams().items()}
BID_FIELDS = STREAMS["bid"].schema


def rate(progress: list[dict[str, Any]]) -> dict[str, Any]:
    """Events/s from the first batch's start to the last one's end, and the batches."""
    batches = [p for p in progress if p["numInputRows"]]
    assert batches, "no batch read events"
    began = _epoch(batches[0]["timestamp"])
    last = batches[-1]
    ended = _epoch(last["timestamp"]) + last["durationMs"]["triggerExecution"] / 1000
    events = sum(p["numInputRows"] for p in batches)
    return {
        "events": events,
        "batches": len(batches),
        "seconds": round(ended - began, 2),
        "events_per_s": round(events / max(1e-9, ended - began)),
    }


def _epoch(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def finish(query: Any) -> list[dict[str, Any]]:
    assert query.awaitTermination(3600), "the query did not finish"
    assert query.exception() is None, query.exception()
    return [json.loads(p.json) for p in query.recentProgress]


def write_files(root: Path, events: list[tuple[str, dict[str, Any]]]) -> dict[str, Path]:
    """Each stream's events as JSON lines, `MAX_PER_TRIGGER` per file (one file a batch)."""
    by_stream: dict[str, list[bytes]] = {"person": [], "auction": [], "bid": []}
    for kind, fields in events:
        by_stream[kind].append(msgspec.json.encode(fields))
    out = {}
    for name, lines in by_stream.items():
        d = root / name
        d.mkdir(parents=True)
        for i in range(0, len(lines), MAX_PER_TRIGGER):
            (d / f"part-{i // MAX_PER_TRIGGER:05d}.json").write_bytes(
                b"\n".join(lines[i : i + MAX_PER_TRIGGER]) + b"\n"
            )
        out[name] = d
    return out


async def publish_all(url: str, flush: list[tuple[str, dict[str, Any]]]) -> float:
    nc = await connect(url)
    try:
        await ensure_streams(nc, nexmark_streams())
        js = nc.jetstream()
        for name, subject in (("results", "results.>"), ("deadletter", "deadletter.>")):
            await js.add_stream(name=name, subjects=[subject])
        began = time.perf_counter()
        report = await load(nc, GEN, 0, EVENTS)
        assert report.events == EVENTS
        topics = subjects()
        acked, failed = await JetStreamPublisher(nc).publish_batch(
            [Outgoing(f"flush:{k}", topics[k], msgspec.json.encode(f)) for k, f in flush]  # type: ignore[index]
        )
        assert not failed and len(acked) == len(flush)
        return time.perf_counter() - began
    finally:
        await nc.close()


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median events/s (the lower middle of an even count), with every run's
    events/s beside it."""
    ordered = sorted(runs, key=lambda run: run["events_per_s"])
    return {
        **ordered[(len(ordered) - 1) // 2],
        "rounds_events_per_s": [run["events_per_s"] for run in runs],
    }


def query_spec(q: str) -> Any:
    return decode_spec(
        {"name": q, "kind": "sql", "sql": QUERIES[q], "max_events_per_trigger": MAX_PER_TRIGGER}
    )


def sources(
    spark: Any, nats: NatsEndpoint, files: dict[str, Path]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every Nexmark stream read from JetStream, and from its files."""
    return (
        {
            s: read_stream(spark, nats, s, max_events=MAX_PER_TRIGGER, fields=cfg.schema)
            for s, cfg in STREAMS.items()
        },
        {s: _file_source(spark, files[s]) for s in STREAMS},
    )


def bench_spark(tmp_path: Path, master: str, app_name: str) -> Any:
    """A Spark session on `master` with the jetstream sources registered."""
    cfg = load_config(
        environ={},
        overrides={
            "state_dir": str(tmp_path / "state"),
            "spark": {"conf": {"spark.ui.showConsoleProgress": False}},
        },
    )
    cfg = msgspec.structs.replace(cfg, spark=msgspec.structs.replace(cfg.spark, master=master))
    spark = spark_session(cfg, app_name=app_name)
    register(spark)
    return spark


def warm_up(spark: Any, nats: NatsEndpoint, files: dict[str, Path], tmp_path: Path) -> None:
    """q1 over both sources once, unmeasured: the JVM's compiler and the source's Python
    workers start here, not in the first measured query."""
    spec = decode_spec({"name": "warm", "kind": "sql", "sql": QUERIES["q1"]})
    for label, source in (
        ("js", read_stream(spark, nats, "bid", max_events=MAX_PER_TRIGGER, fields=BID_FIELDS)),
        ("files", _file_source(spark, files["bid"])),
    ):
        noop_run(spark, spec, {"bid": source}, tmp_path / f"warm-{label}")


def _file_source(spark: Any, path: Path) -> Any:
    return (
        spark.readStream.option("maxFilesPerTrigger", 1)
        .text(str(path))
        .withColumnRenamed("value", "data")
    )


def noop_run(spark: Any, spec: Any, sources: dict[str, Any], ckpt: Path) -> dict[str, Any]:
    plan = job_plan(spark, spec, None, STREAMS, source=sources)  # type: ignore[arg-type]
    query = (
        plan.df.writeStream.format("noop")
        .outputMode(plan.output_mode)
        .option("checkpointLocation", str(ckpt))
        .trigger(availableNow=True)
        .start()
    )
    return rate(finish(query))


class Cores:
    """Where a run's CPU went, per event read: Spark's JVM (with the JVM jetstream source),
    its Python workers (the Python source, where it reads), nats-server, and this process
    (the exactly-once sink's batches)."""

    def __init__(self, spark: Any, nats_pid: int) -> None:
        jvm = spark.sparkContext._jvm
        self.jvm = int(jvm.java.lang.ProcessHandle.current().pid())
        self.nats = nats_pid

    def run(self, go: Any) -> dict[str, Any]:
        meter = CpuMeter(
            {"jvm": self.jvm, "nats": self.nats, "driver": os.getpid()}, {"workers": self.jvm}
        )
        out = go()
        cpu = meter.stop()
        events = max(1, out["events"])
        out["cpu_us_per_event"] = {
            k: round(v * 1e6 / events, 1) for k, v in cpu.items() if k != "seconds"
        }
        out["busy_cores"] = round(
            sum(v for k, v in cpu.items() if k != "seconds") / max(1e-9, cpu["seconds"]), 2
        )
        return out


def cpu_line(label: str, run: dict[str, Any]) -> str:
    parts = ", ".join(f"{k} {v}" for k, v in run["cpu_us_per_event"].items())
    return f"{label} CPU us/event: {parts} ({run['busy_cores']} cores busy)"


def kv_rows(url: str, query: str) -> list[dict[str, Any]]:
    """The query's live KV values, read from the bucket's stream (which keeps the latest
    value per key): a million keys read in one pass, not a request per key."""
    from cluster.verify import read_stream as read_messages

    rows: list[dict[str, Any]] = []

    async def go() -> None:
        nc = await connect(url)
        try:
            await read_messages(
                nc,
                "KV_results",
                lambda _seq, _id, data: rows.append(json.loads(data)) if data else None,
                f"$KV.results.{query}.>",
                timeout=1200,
            )
        finally:
            await nc.close()

    asyncio.run(go())
    return rows


@pytest.mark.timeout(7200)
def test_nexmark_queries_jetstream_vs_files_and_answers_vs_duckdb(tmp_path: Path) -> None:
    queries = [q for q in sorted(QUERIES, key=lambda q: int(q[1:])) if not ONLY or q in ONLY]
    began = time.perf_counter()
    events = load_events(GEN, EVENTS)
    flush_from = GEN.time_ms(EVENTS - 1) + FLUSH_GAP_MS
    files = write_files(tmp_path / "files", events)
    oracle = Oracle(events, flush_from)
    prepared_s = time.perf_counter() - began
    spark = bench_spark(tmp_path, "local[2]", "tierflow-bench-nexmark")
    rows: dict[str, dict[str, Any]] = {}
    with NatsServer(store_dir=tmp_path / "nats", sync_interval="2m").start() as server:
        nats = NatsEndpoint(server.url)
        publish_s = asyncio.run(publish_all(server.url, events[EVENTS:]))
        print(
            f"\nnexmark: {EVENTS:,} events generated in {prepared_s:.0f} s, "
            f"stored in {publish_s:.0f} s"
        )
        warm_up(spark, nats, files, tmp_path)
        cores = Cores(spark, server.pid or 0)
        for q in queries:
            spec = query_spec(q)
            js_sources, file_sources = sources(spark, nats, files)
            row: dict[str, Any] = {}
            noop: dict[str, list[dict[str, Any]]] = {"jetstream": [], "files": []}
            for r in range(ROUNDS):  # alternating, so a slow spell of the machine hits both
                for label, src in (("jetstream", js_sources), ("files", file_sources)):
                    ckpt = tmp_path / f"{q}-{label}-{r}"
                    noop[label].append(cores.run(partial(noop_run, spark, spec, src, ckpt)))
            row["jetstream"], row["files"] = (
                median_run(noop["jetstream"]),
                median_run(noop["files"]),
            )

            def exactly_once() -> dict[str, Any]:
                sink_query = start_job(
                    spark,
                    spec,  # noqa: B023
                    nats,
                    tmp_path / "sink",
                    trigger={"availableNow": True},
                    streams=STREAMS,
                )
                return rate(finish(sink_query))

            row["exactly_once"] = cores.run(exactly_once)
            got = spark_rows(q, kv_rows(server.url, q), flush_from)
            want = oracle.rows(q)
            missing, extra = want - got, got - want
            row["rows"] = sum(want.values())
            row["equal"] = not missing and not extra
            assert row["equal"], (
                f"{q}: {sum(missing.values())} rows missing, e.g. {list(missing)[:3]}; "
                f"{sum(extra.values())} extra, e.g. {list(extra)[:3]}"
            )
            js_rate, file_rate = row["jetstream"]["events_per_s"], row["files"]["events_per_s"]
            row["ratio"] = round(js_rate / file_rate, 2) if file_rate else None
            # as Nexmark counts: every generated event, over the time to process its share
            row["nexmark_events_per_s"] = round(EVENTS / row["jetstream"]["seconds"])
            row["per_core"] = round(row["nexmark_events_per_s"] / CORES)
            row["flink_per_core"] = FLINK_PER_CORE.get(q)
            rows[q] = row
            print(
                f"{q:>4}: jetstream {js_rate:>9,}/s  files {file_rate:>9,}/s  "
                f"ratio {row['ratio']}  exactly-once {row['exactly_once']['events_per_s']:>9,}/s"
                f"  per core {row['per_core']:>8,} (Flink {row['flink_per_core'] or '-'})  "
                f"rows {row['rows']:,} equal"
            )
            for label in ("jetstream", "files", "exactly_once"):
                print(f"      {cpu_line(label, row[label])}")
        latency = {q: measure_latency(spark, server.url, q, tmp_path) for q in ("q5", "q7")}
    spark.stop()
    write_report(
        "nexmark",
        {
            "events": EVENTS,
            "event_rate": GEN.rate,
            "disorder": GEN.disorder,
            "max_per_trigger": MAX_PER_TRIGGER,
            "cores": CORES,
            "queries": rows,
            "not_run": NOT_RUN,
            "latency": latency,
        },
    )


LATENCY_SQL = {
    "q7": "SELECT window(dateTime, '10 seconds') AS w, max(struct(price, auction, bidder)) "
    "AS top, max(dateTime) AS newest FROM bid GROUP BY window(dateTime, '10 seconds')",
    "q5": QUERIES["q5"].replace(
        "SELECT min(win.start)", "SELECT min(win.end) AS window_end, min(win.start)"
    ),
}


def measure_latency(spark: Any, url: str, q: str, tmp_path: Path) -> dict[str, Any]:
    """p50/p99 from event time to the result's message (see the module doc)."""
    name = f"{q}_live"
    spec = decode_spec({"name": name, "kind": "sql", "sql": LATENCY_SQL[q], "trigger_s": 0.5})
    seen: list[float] = []

    async def run() -> dict[str, Any]:
        nc = await connect(url)
        prefix = f"live{q}"
        live_cfg = {k: {**v, "subjects": [f"{prefix}.{k}"]} for k, v in nexmark_streams().items()}
        names = {k: f"{prefix}_{k}" for k in live_cfg}
        js = nc.jetstream()
        for k, v in live_cfg.items():
            await js.add_stream(name=names[k], subjects=v["subjects"])

        async def on_result(msg: Any) -> None:
            row = json.loads(msg.data)
            at = time.time() * 1000
            ref = row.get("newest") if q == "q7" else row.get("window_end")
            if ref:
                seen.append(at - _iso_ms(ref))

        sub = await nc.subscribe(f"results.{name}", cb=on_result)
        sql = LATENCY_SQL[q].replace("FROM bid", f"FROM {names['bid']}")
        live_spec = msgspec.structs.replace(spec, sql=sql)
        cfgs = {names[k]: msgspec.convert(v, StreamConfig) for k, v in live_cfg.items()}
        query = start_job(spark, live_spec, NatsEndpoint(url), tmp_path / "live", streams=cfgs)
        try:
            report = await paced(nc, GEN, RATE, SECONDS, prefix=prefix)
            await asyncio.sleep(8)  # the last windows close (watermark 5 s) and are published
        finally:
            query.stop()
            await sub.unsubscribe()
            await nc.close()
        return {"sent": report.events, "send_s": round(report.seconds, 1)}

    sent = asyncio.run(run())
    out = {
        **sent,
        "rate": RATE,
        "results": len(seen),
        "p50_ms": round(quantile(seen, 0.5) or 0),
        "p99_ms": round(quantile(seen, 0.99) or 0),
    }
    print(f"{q} at {RATE:,}/s: event time -> result p50 {out['p50_ms']} ms, p99 {out['p99_ms']} ms")
    return out


def _iso_ms(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000


@pytest.mark.timeout(1800)
def test_the_jvm_source_alone_cpu_per_event(tmp_path: Path) -> None:
    """The JVM source's own CPU per event, without Spark: one thread reads the bid stream
    whole (`RangeProbe.readAll`: frames, replies, the payload check), as a task does, with
    ``validate=none`` and ``json``; three rounds each, the last one counted (the first ones
    compile). nats-server's CPU over the same reads is measured beside it."""
    cfg = load_config(environ={}, overrides={"state_dir": str(tmp_path / "state")})
    spark = spark_session(cfg, app_name="tierflow-bench-jvm-source")
    jvm = spark.sparkContext._jvm
    events = load_events(GEN, EVENTS)
    with NatsServer(store_dir=tmp_path / "nats", sync_interval="2m").start() as server:
        asyncio.run(publish_all(server.url, events[EVENTS:]))
        out: dict[str, Any] = {}
        for validate in ("none", "json"):
            opts = {"url": server.url, "stream": "bid", "validate": validate}
            for _ in range(3):
                meter = CpuMeter({"nats": server.pid or 0})
                n, cpu_ns, size = jvm.io.tierflow.jetstream.RangeProbe.readAll(opts, 1, 2**40)
                nats_s = meter.stop()["nats"]
            out[validate] = {
                "events": n,
                "bytes_per_event": round(size / max(1, n)),
                "source_us_per_event": round(cpu_ns / 1000 / max(1, n), 2),
                "nats_us_per_event": round(nats_s * 1e6 / max(1, n), 2),
            }
            print(f"\njvm source alone, validate={validate}: {out[validate]}")
    assert out["json"]["events"] == out["none"]["events"] > 0


PINNED_QUERIES = ("q0", "q1", "q2")


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` onto `cpus` (threads it starts later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), cpus)


@pytest.mark.timeout(3600)
def test_stateless_queries_with_nats_server_on_a_core_of_its_own(tmp_path: Path) -> None:
    """q0-q2 again with nats-server on one core and Spark (`local[1]`: its JVM, and this
    process) on the other: what reading JetStream costs Spark's own core when the server
    does not share it, as in a deployment with NATS on hosts of its own (and as Flink's
    published figures keep their source apart from the job). `ROUNDS` runs of each over
    both sources, alternating; the median run."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two cores")
    nats_cpu, spark_cpu = {cpus[0]}, {cpus[1]}
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, spark_cpu)
    try:
        events = load_events(GEN, EVENTS)
        files = write_files(tmp_path / "files", events)
        spark = bench_spark(tmp_path, "local[1]", "tierflow-bench-nexmark-pinned")
        jvm_pid = int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        with NatsServer(store_dir=tmp_path / "nats", sync_interval="2m").start() as server:
            nats = NatsEndpoint(server.url)
            pin(server.pid or 0, nats_cpu)
            asyncio.run(publish_all(server.url, events[EVENTS:]))
            pin(jvm_pid, spark_cpu)  # a JVM an earlier test started keeps its own mask
            warm_up(spark, nats, files, tmp_path)
            cores = Cores(spark, server.pid or 0)
            for r in range(ROUNDS):
                for q in PINNED_QUERIES:
                    spec = query_spec(q)
                    js_sources, file_sources = sources(spark, nats, files)
                    for label, src in (("jetstream", js_sources), ("files", file_sources)):
                        pin(server.pid or 0, nats_cpu)
                        pin(jvm_pid, spark_cpu)
                        ckpt = tmp_path / f"{q}-{r}-{label}"
                        out = cores.run(partial(noop_run, spark, spec, src, ckpt))
                        runs.setdefault((q, label), []).append(out)
        spark.stop()
    finally:
        os.sched_setaffinity(0, before)
    rows: dict[str, Any] = {}
    for q in PINNED_QUERIES:
        row: dict[str, Any] = {}
        for label in ("jetstream", "files"):
            run = median_run(runs[(q, label)])
            row[label] = {
                "events_per_s": run["events_per_s"],
                "rounds_events_per_s": run["rounds_events_per_s"],
                "jvm_us_per_event": run["cpu_us_per_event"]["jvm"],
                "nats_us_per_event": run["cpu_us_per_event"]["nats"],
            }
        js, fs = row["jetstream"]["events_per_s"], row["files"]["events_per_s"]
        row["ratio"] = round(js / fs, 2)
        row["spark_core_events_per_s"] = js  # Spark had one core: this is per core
        row["of_flink"] = round(js / FLINK_PER_CORE[q], 2)
        rows[q] = row
        print(
            f"\npinned {q}: jetstream {js:,}/s (Spark JVM {row['jetstream']['jvm_us_per_event']}"
            f" us/event, nats-server {row['jetstream']['nats_us_per_event']}) files {fs:,}/s "
            f"(Spark JVM {row['files']['jvm_us_per_event']}) ratio {row['ratio']}, "
            f"{row['of_flink']} of Flink per core"
        )
    assert all(rows[q]["jetstream"]["events_per_s"] > 0 for q in PINNED_QUERIES)
    write_report(
        "nexmark_pinned",
        {
            "events": EVENTS,
            "rounds": ROUNDS,
            "cpus": {"nats": cpus[0], "spark": cpus[1]},
            "queries": rows,
        },
    )
