"""End to end: from an accepted event to the updated top-N on a gateway WebSocket.

Prints numbers, asserts no speed (`make bench`). The whole Meetup pipeline as shipped (HML,
logger k=1, one collector, bridge and gateway, JetStream `sync_interval: always`, the
`meetup_topn` Spark query on the driver's default master (local[4]) with the trigger
`TIERFLOW_BENCH_E2E_TRIGGER_S`, default 0.5 s) on the session's Ray. Synthetic RSVPs are
POSTed by the known-id producer at a fixed rate (1k and 5k events/s, the goals' rates, a few
seconds each; `TIERFLOW_BENCH_E2E_RATES=1000,5000,10000` adds the overload row);
two WebSocket clients of the gateway watch:

- top-N: the `results` stream filtered to `results.meetup_topn`; each update carries the
  number of events it counts. An accepted batch counts as shown once an update counting at
  least every event accepted up to that batch arrives after it;
- raw (the ceiling): the `meetup` stream itself, i.e. collector -> logger -> bridge ->
  JetStream -> gateway -> client, per event.

Latency is from the producer receiving the 2xx to the client receiving the frame (one
machine, one clock). Each phase waits until both clients saw everything before the next.
The measured rates follow a warm-up phase (`WARMUP_S` at the first rate, reported as its
own row): a running pipeline's steady state, with the cold start shown apart.
A profile pass (py-spy on the Spark driver with its Python workers, the gateway and the
collection tier) follows, not measured.

With TIERFLOW_BENCH_SPARK_EVENTS=<dir>, Spark writes its event log there and each phase
prints, per query, how long its Spark jobs waited for a task slot against how long their
tasks ran (`Pipeline.slot_profile`).

Run alone: `.venv/bin/python -m pytest -s -o python_files='bench_*.py' tests/bench/bench_e2e.py`
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from cluster.demo.rsvps import RsvpGenerator
from cluster.loadgen import drive
from runtime.waiting import await_until
from tests.bench.common import GcPauses, Profiler, print_profile, summary, write_report
from tests.bench.pipeline import (
    TOPN_SUBJECT,
    Pipeline,
    Watcher,
    durations_summary,
    lag_growth,
    latency_parts,
    pipeline,
)

RATES = tuple(int(r) for r in os.environ.get("TIERFLOW_BENCH_E2E_RATES", "1000,5000").split(","))
# 12 s a rate: enough top-N updates at 5k/s for the lag's trend (`lag_growth`)
SECONDS = float(os.environ.get("TIERFLOW_BENCH_E2E_SECONDS", "12"))
TRIGGER_S = float(os.environ.get("TIERFLOW_BENCH_E2E_TRIGGER_S", "0.5"))
PROFILE = os.environ.get("TIERFLOW_BENCH_PROFILE", "1") != "0"
PROFILE_S = 8.0
LAG_SKIP_S = 1.0  # the lag's trend is taken after the first second (the query's first batch)
# A warm-up phase at the first rate before the measured ones, reported as its own row: a
# fresh Spark JVM runs each micro-batch's planning and tasks in interpreted and profiled
# code until HotSpot has compiled them, which on 2 cores takes tens of seconds of batches
# (docs/benchmarks.md: 1k/s top-N p99 4.1, 2.3, 1.4, 1.3, 1.2 s in five 12-s phases after
# the query's start). The measured rates are the steady state a running pipeline is in.
WARMUP_S = float(os.environ.get("TIERFLOW_BENCH_E2E_WARMUP_S", "45"))
BATCH, CONCURRENCY = 100, 16
WARM = 1000
# 0: leave the producer's and watchers' process heap as earlier benches left it (GcPauses)
FREEZE = os.environ.get("TIERFLOW_BENCH_E2E_FREEZE", "1") != "0"


class Rsvps:
    """RSVPs numbered `n` across the whole run (the raw watcher reports `n`)."""

    def __init__(self) -> None:
        self.gen = RsvpGenerator(seed=8)
        self.next_n = 0

    def take(self, count: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(count):
            out.append({**self.gen.next(), "n": self.next_n, "id": f"e2e-{self.next_n}"})
            self.next_n += 1
        return out


def topn_latencies(
    accepted: list[tuple[float, int]],
    sizes: dict[int, int],
    frames: list[tuple[float, int]],
    base: int,
) -> list[float]:
    """Per accepted batch (in answer order): ms until the first top-N update after it that
    counts every event accepted so far."""
    out: list[float] = []
    j, cum = 0, base
    for t, idx in sorted(accepted):
        cum += sizes[idx]
        while j < len(frames) and (frames[j][0] < t or frames[j][1] < cum):
            j += 1
        if j == len(frames):
            break
        out.append((frames[j][0] - t) * 1000)
    return out


async def phase(
    p: Pipeline, rsvps: Rsvps, rate: float, seconds: float, topn: Watcher, raw: Watcher
) -> dict[str, Any]:
    """One rate: its events POSTed, timed to both watchers. The producer and the watchers
    stand in for remote clients, so the bench process's heap (what earlier benches left)
    is frozen for the phase as in bench_gateway (`GcPauses`); the pauses left are reported."""
    events = rsvps.take(int(rate * seconds))
    gc_pauses = GcPauses()
    with gc_pauses.frozen(FREEZE):
        row = await _phase(p, events, rate, seconds, topn, raw)
    return {**row, "clients_gc": {"frozen": FREEZE, **gc_pauses.summary()}}


async def _phase(
    p: Pipeline,
    events: list[dict[str, Any]],
    rate: float,
    seconds: float,
    topn: Watcher,
    raw: Watcher,
) -> dict[str, Any]:
    first_n = events[0]["n"]
    base = topn.last
    accepted: list[tuple[float, int]] = []
    sizes = {
        i: len(events[i * BATCH : (i + 1) * BATCH])
        for i in range((len(events) + BATCH - 1) // BATCH)
    }
    driver_pid = await asyncio.get_running_loop().run_in_executor(None, p.pid, p.driver)
    cpu0 = tree_cpu_s(driver_pid)
    t0, wall0 = time.monotonic(), time.time()
    report = await drive(
        p.tier.url,
        "meetup",
        events,
        batch=BATCH,
        concurrency=CONCURRENCY,
        rate=rate,
        deadline_s=seconds + 120,
        on_batch=lambda idx: accepted.append((time.monotonic(), idx)),
    )
    assert len(report.acknowledged) == len(events), "the benchmark lost events"
    total = base + len(events)
    last_n = events[-1]["n"]
    await await_until(
        lambda: topn.last >= total, timeout=600, interval=0.05, what="top-N caught up"
    )
    topn_done = time.monotonic()
    driver_cpu = tree_cpu_s(driver_pid) - cpu0
    await await_until(
        lambda: sum(1 for _, n in raw.seen if first_n <= n <= last_n) >= len(events),
        timeout=120,
        interval=0.1,
        what="raw subscriber caught up",
    )
    accept_at = {idx: t for t, idx in accepted}
    raw_ms = [
        (t - accept_at[(n - first_n) // BATCH]) * 1000
        for t, n in raw.seen
        if first_n <= n <= last_n
    ]
    frames = [f for f in topn.seen if f[0] >= t0]
    top_ms = topn_latencies(accepted, sizes, frames, base)
    assert len(top_ms) == len(accepted)
    loop = asyncio.get_running_loop()
    progress = await loop.run_in_executor(None, p.progress, wall0)
    cum = cumulative(accepted, sizes, base)
    parts = latency_parts(cum, frames, topn_spans(progress, wall0 - t0))
    growth = lag_growth(cum, frames, t0 + LAG_SKIP_S, max(t for t, _ in accepted))
    return {
        "rate": rate,
        "seconds": seconds,
        "events": len(events),
        "accepted_rate": report.rate,
        "shown_rate": len(events) / (topn_done - t0),
        "lag_growth_per_s": growth,
        "topn": summary(top_ms),
        "raw": summary(raw_ms),
        "updates": len(frames),
        "driver_cpu_s": driver_cpu,
        "parts": {k: summary(v) for k, v in parts.items() if v},
        "batches": {name: durations_summary(rows) for name, rows in progress.items()},
        "slots": await loop.run_in_executor(None, p.slot_profile, wall0),
    }


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and its living descendants: the analysis
    driver with Spark's JVM and its Python workers (a worker gone meanwhile is missed)."""
    import psutil

    total = 0.0
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = proc.cpu_times()
                total += t.user + t.system
    return total


def cumulative(
    accepted: list[tuple[float, int]], sizes: dict[int, int], base: int
) -> list[tuple[float, int]]:
    """(time, events the top-N must count to include it) per accepted batch."""
    out, cum = [], base
    for t, idx in sorted(accepted):
        cum += sizes[idx]
        out.append((t, cum))
    return out


def topn_spans(
    progress: dict[str, list[dict[str, Any]]], offset: float
) -> list[tuple[float, float]]:
    """(start, end) on the monotonic clock (epoch - `offset`) of the top-N's batches with
    input."""
    rows = progress.get(TOPN_SUBJECT.removeprefix("results."), [])
    return [
        (r["at"] - offset, r["at"] - offset + r["durations"].get("triggerExecution", 0) / 1000)
        for r in rows
        if r.get("input_rows") and "at" in r
    ]


@contextlib.asynccontextmanager
async def warmed(p: Pipeline, rsvps: Rsvps) -> AsyncIterator[tuple[Watcher, Watcher]]:
    """The top-N and raw watchers, subscribed, once the first top-N counted a warm-up."""
    topn = Watcher(p.gateway_url, "results", f"WHERE _subject = '{TOPN_SUBJECT}'").start()
    raw = Watcher(p.gateway_url, "meetup", kind="raw").start()
    try:
        await asyncio.wait_for(asyncio.gather(topn.ready.wait(), raw.ready.wait()), 60)
        warm = await drive(p.tier.url, "meetup", rsvps.take(WARM), batch=BATCH, rate=500)
        assert len(warm.acknowledged) == WARM
        await await_until(lambda: topn.last >= WARM, timeout=300, what="the first top-N")
        yield topn, raw
    finally:
        await topn.stop()
        await raw.stop()


async def warm_up(
    p: Pipeline, rsvps: Rsvps, rate: float, topn: Watcher, raw: Watcher
) -> dict[str, Any] | None:
    """The `WARMUP_S` phase right after the query's start (cold JVM), measured like the rest
    and reported apart; None when it is turned off."""
    return await phase(p, rsvps, rate, WARMUP_S, topn, raw) if WARMUP_S > 0 else None


async def measure(
    p: Pipeline,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, dict[str, Any]]:
    rsvps = Rsvps()
    async with warmed(p, rsvps) as (topn, raw):
        cold = await warm_up(p, rsvps, RATES[0], topn, raw)
        rows = [await phase(p, rsvps, rate, SECONDS, topn, raw) for rate in RATES]
        profiles: dict[str, Any] = {}
        if PROFILE:
            loop = asyncio.get_running_loop()
            pids = await loop.run_in_executor(None, pids_of, p)
            spy = Profiler(pids, PROFILE_S, subprocesses=["spark-driver"])
            events = rsvps.take(int(RATES[len(RATES) // 2] * PROFILE_S))
            await drive(
                p.tier.url,
                "meetup",
                events,
                batch=BATCH,
                concurrency=CONCURRENCY,
                rate=RATES[len(RATES) // 2],
                deadline_s=PROFILE_S,
            )
            profiles = await loop.run_in_executor(None, spy.results)
        return rows, cold, profiles


def print_parts(rows: list[dict[str, Any]]) -> None:
    """The top-N latency split: accept -> its batch's start, the batch, its end -> frame."""
    for r in rows:
        parts = r.get("parts") or {}
        text = "; ".join(
            f"{k} p50 {v['p50_ms']:,.0f} p99 {v['p99_ms']:,.0f}" for k, v in parts.items()
        )
        print(f"  {r['rate']:,.0f}/s top-N latency, ms: {text}")
        if "driver_cpu_s" in r:
            print(
                f"  {r['rate']:,.0f}/s analysis driver (Spark, JVM, workers): "
                f"{r['driver_cpu_s']:.1f} CPU s, {r['driver_cpu_s'] * 1000 / r['events']:.2f} "
                "ms per event"
            )
        if "clients_gc" in r:
            g = r["clients_gc"]
            print(
                f"  {r['rate']:,.0f}/s the producer's and watchers' process {GcPauses.describe(g)}"
            )


def print_batches(label: str, batches: dict[str, dict[str, Any]]) -> None:
    """Where each query's micro-batches spent their time (medians of Spark's durationMs)."""
    for name, b in sorted(batches.items()):
        parts = ", ".join(
            f"{k} {v:,.0f}" for k, v in b.items() if k not in ("batches", "input_rows_p50") and v
        )
        print(
            f"  {label} {name}: {b['batches']} batches, {b['input_rows_p50'] or 0:,.0f} rows; "
            f"ms p50: {parts}"
        )


def print_slots(label: str, slots: dict[str, dict[str, Any]]) -> None:
    """Per query, its Spark jobs' wait for one of local[n]'s task slots against their run
    (medians, ms; from the event log with TIERFLOW_BENCH_SPARK_EVENTS)."""
    for name, j in sorted(slots.items()):
        print(
            f"  {label} {name}: {j['jobs']} Spark jobs; ms p50: wall {j['wall']:,.0f}, "
            f"waiting for a task slot {j['slot_wait']:,.0f} (max {j['slot_wait_max']:,.0f}), "
            f"tasks running {j['run']:,.0f} (JVM CPU {j['cpu']:,.0f})"
        )


def pids_of(p: Pipeline) -> dict[str, int]:
    group = p.tier.logger_groups[0]
    return {
        "spark-driver": p.pid(p.driver),
        "gateway": p.pid(p.actor(p.gateways[0])),
        "collector": p.pid(p.actor(p.tier.collectors[0])),
        "bridge": p.pid(p.actor(p.tier.bridges[0])),
        "logger-primary": p.pid(group.replicas[group.primary]),
        "producer+watchers": os.getpid(),
    }


@pytest.mark.timeout(1200)
def test_end_to_end_latency(bench_ray: Any, tmp_path: Path) -> None:
    with pipeline(tmp_path, "bench-e2e", trigger_s=TRIGGER_S) as p:
        rows, cold, profiles = asyncio.run(measure(p))
    print(
        f"\nend to end, HML k=1, Spark {p.cfg.spark.master} trigger {TRIGGER_S:g} s, "
        f"batches of {BATCH}, "
        f"{SECONDS:g} s per rate, {os.cpu_count()} cores"
    )
    print(
        f"{'offered/s':>10}{'accepted/s':>11}{'shown/s':>9}{'top-N p50':>11}{'p99 ms':>9}"
        f"{'raw p50':>9}{'p99 ms':>8}{'raw/top p99':>13}"
    )
    for r in [*([cold] if cold else []), *rows]:
        t, w = r["topn"], r["raw"]
        print(
            f"{r['rate']:>10,.0f}{r['accepted_rate']:>11,.0f}{r['shown_rate']:>9,.0f}"
            f"{t['p50_ms']:>11,.0f}{t['p99_ms']:>9,.0f}{w['p50_ms']:>9,.0f}{w['p99_ms']:>8,.0f}"
            f"{w['p99_ms'] / t['p99_ms']:>13.2f}" + ("  (warm-up)" if r is cold else "")
        )
    print(
        "shown/s: events over the time until the top-N counted them all; warm-up: the first "
        f"{WARMUP_S:g} s after the query's start, before the measured rates"
    )
    for r in rows:
        g = r["lag_growth_per_s"]
        shown = "-" if g is None else f"{g:+,.0f}/s ({g / r['accepted_rate']:+.2f} of accepted)"
        print(f"  {r['rate']:,.0f}/s top-N lag growth: {shown}")
    print_parts(rows)
    for r in rows:
        print_batches(f"{r['rate']:,.0f}/s", r["batches"])
        print_slots(f"{r['rate']:,.0f}/s", r["slots"])
    if profiles:
        print_profile(f"e2e at {RATES[len(RATES) // 2]:,} events/s, {PROFILE_S:g} s", profiles)
    write_report(
        "e2e",
        {
            "batch": BATCH,
            "concurrency": CONCURRENCY,
            "seconds": SECONDS,
            "logging": "hml",
            "k": 1,
            "trigger_s": TRIGGER_S,
            "warmup": cold,
            "rates": rows,
            "profiles": profiles,
        },
    )


DEMO_RATE = float(os.environ.get("TIERFLOW_BENCH_DEMO_RATE", "200"))
DEMO_SECONDS = float(os.environ.get("TIERFLOW_BENCH_DEMO_SECONDS", "20"))


async def measure_demo(p: Pipeline) -> tuple[dict[str, Any], dict[str, Any] | None]:
    rsvps = Rsvps()
    async with warmed(p, rsvps) as (topn, raw):
        cold = await warm_up(p, rsvps, DEMO_RATE, topn, raw)
        return await phase(p, rsvps, DEMO_RATE, DEMO_SECONDS, topn, raw), cold


@pytest.mark.timeout(900)
def test_demo_dashboard_lag(bench_ray: Any, tmp_path: Path) -> None:
    """`make demo`'s shape: the five Meetup queries at their own triggers, RSVPs at the
    demo's rate; how long after an RSVP is accepted the dashboard's top-N counts it."""
    with pipeline(tmp_path, "bench-demo", all_jobs=True) as p:
        row, cold = asyncio.run(measure_demo(p))
    if cold:
        print(
            f"\ndemo shape, warm-up (the first {WARMUP_S:g} s after the queries' start): top-N "
            f"p50 {cold['topn']['p50_ms']:,.0f} ms, p99 {cold['topn']['p99_ms']:,.0f} ms"
        )
    t, w = row["topn"], row["raw"]
    print(
        f"\ndemo shape (five Meetup queries), {DEMO_RATE:g} RSVPs/s for {DEMO_SECONDS:g} s: "
        f"top-N p50 {t['p50_ms']:,.0f} ms, p99 {t['p99_ms']:,.0f} ms; raw p50 "
        f"{w['p50_ms']:,.0f} ms, p99 {w['p99_ms']:,.0f} ms"
    )
    print_parts([row])
    print_batches("demo", row["batches"])
    print_slots("demo", row["slots"])
    write_report("demo", {"jobs": 5, "warmup": cold, **row})
