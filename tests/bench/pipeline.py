"""The whole Meetup pipeline for the benchmarks that need all of it (e2e, failover):
collection tier, one gateway, the analysis driver running the top-N query, on one
nats-server and the session's Ray. Started and stopped as a unit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from cluster.pipeline import CollectionTier, start_collection_tier
from runtime.config import Config, load
from runtime.nats.server import NatsServer, connect
from tests.support import MEETUP_STREAMS

TOPN_SUBJECT = "results.meetup_topn"


@dataclass
class Pipeline:
    cfg: Config
    server: NatsServer
    tier: CollectionTier
    gateways: list[str]
    gateway_url: str
    driver: Any
    spark_events: Path | None = None

    def actor(self, name: str) -> Any:
        import ray

        return ray.get_actor(name, namespace=self.cfg.ray.namespace)

    def progress(self, since: float) -> dict[str, list[dict[str, Any]]]:
        """Per query, its micro-batches since `since` (epoch s), as `AnalysisDriver.progress`."""
        import ray

        return dict(ray.get(self.driver.progress.remote(since), timeout=60))

    def batch_profile(self, since: float) -> dict[str, dict[str, Any]]:
        """Per query, where its micro-batches with input since `since` (epoch s) spent their
        time: batches, median input rows, and the median of each of Spark's ``durationMs``
        parts (ms)."""
        return {name: durations_summary(rows) for name, rows in self.progress(since).items()}

    def slot_profile(self, since: float) -> dict[str, dict[str, Any]]:
        """Per query, from Spark's event log (TIERFLOW_BENCH_SPARK_EVENTS set): how long its
        Spark jobs since `since` (epoch s) waited for a free task slot and ran; {} without."""
        if self.spark_events is None:
            return {}
        return slot_waits(self.spark_events, since)

    def pid(self, handle: Any) -> int:
        import ray

        return int(ray.get(handle.heartbeat.remote(), timeout=30)["pid"])

    def standby_info(self) -> dict[str, Any]:
        """The analysis driver's standby's (spark.standby) own `role_info`."""
        import ray

        from jobs.driver import DRIVER_NAME
        from jobs.standby import standby_name

        handle = self.actor(standby_name(DRIVER_NAME))
        return dict(ray.get(handle.role_info.remote(), timeout=10))

    def standby_ready(self) -> bool:
        """Whether the analysis driver's standby (spark.standby) has warmed up and waits."""
        info = self.standby_info()
        return info["role"] == "standby" and info["state"] == "standby"

    def active_driver(self, survivor_of: str | None = None) -> dict[str, Any]:
        """The analysis driver that runs the queries (with a standby, either name's status
        answers for it): its pid, actor id and `took_over`. `survivor_of`: a killed
        driver's actor id; the pair member asked is then the other one (a call to the
        killed one waits for Ray to restart it)."""
        import ray

        from jobs.driver import DRIVER_NAME
        from jobs.standby import standby_name

        handle = self.driver
        if survivor_of is not None:
            pair = [self.actor(n) for n in (DRIVER_NAME, standby_name(DRIVER_NAME))]
            handle = next(h for h in pair if h._actor_id.hex() != survivor_of)
        return ray.get(handle.status.remote(), timeout=30)


def demo_jobs() -> list[Any]:
    """The five Meetup queries as `make demo` runs them; TIERFLOW_BENCH_DEMO_TRIGGERS
    ("<top-N s>,<other panels s>") sets other triggers (to compare A/B)."""
    from cluster.demo.meetup import meetup_jobs

    given = os.environ.get("TIERFLOW_BENCH_DEMO_TRIGGERS", "")
    if not given:
        return meetup_jobs()
    topn, panels = (float(t) for t in given.split(","))
    return meetup_jobs(topn_trigger_s=topn, panel_trigger_s=panels)


def durations_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over a query's batches that read input (see `Pipeline.batch_profile`)."""
    busy = [r for r in rows if r.get("input_rows")]
    keys = sorted({k for r in busy for k in r["durations"]})
    return {
        "batches": len(busy),
        "input_rows_p50": median([r["input_rows"] for r in busy]),
        **{k: median([r["durations"].get(k, 0) for r in busy]) for k in keys},
    }


def lag_growth(
    accepted: list[tuple[float, int]],
    frames: list[tuple[float, int]],
    start: float,
    end: float,
) -> float | None:
    """How fast the top-N's lag grows while events arrive: the least-squares slope (events/s)
    of lag = events accepted - events counted, at each top-N update between `start` and
    `end`. About 0 when the analysis keeps up (each batch takes what arrived meanwhile);
    the shortfall of its rate when it falls behind. None with fewer than 3 updates.

    `accepted`: (time, events accepted up to then), rising; `frames`: (time, events counted).
    """
    import bisect

    times = [t for t, _ in accepted]
    points = []
    for t, counted in frames:
        if start <= t <= end and (i := bisect.bisect_right(times, t)):
            points.append((t, accepted[i - 1][1] - counted))
    if len(points) < 3:
        return None
    mt = sum(t for t, _ in points) / len(points)
    ml = sum(lag for _, lag in points) / len(points)
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (lag - ml) for t, lag in points) / var if var else None


def latency_parts(
    accepted: list[tuple[float, int]],
    frames: list[tuple[float, int]],
    batches: list[tuple[float, float]],
) -> dict[str, list[float]]:
    """Where each accepted event batch's top-N latency went (ms), on one clock.

    `accepted`: (time, events the top-N must count to include it), in answer order;
    `frames`: (time, events counted) of the top-N updates; `batches`: (start, end) of the
    query's micro-batches that read input. The update showing an accepted batch is the
    first frame after it counting enough; the micro-batch behind that update is, of those
    started before the frame, the one that ended nearest to it (its results are published
    just before Spark closes it; the next batch, started back to back, ends a batch later).
    Parts: ``wait`` from the accept to that batch's start
    (the trigger, or the batch before running), ``batch`` its run, ``deliver`` from its
    end to the frame (negative: the results were published before Spark closed the batch).
    Accepted batches with no such frame or micro-batch are left out.
    """
    out: dict[str, list[float]] = {"wait": [], "batch": [], "deliver": []}
    spans = sorted(batches)
    j = 0
    for t, need in sorted(accepted):
        while j < len(frames) and (frames[j][0] < t or frames[j][1] < need):
            j += 1
        if j == len(frames):
            break
        shown = frames[j][0]
        behind = [b for b in spans if b[0] <= shown]
        if not behind:
            continue
        start, end = min(behind, key=lambda b: abs(shown - b[1]))
        out["wait"].append((start - t) * 1000)
        out["batch"].append((end - start) * 1000)
        out["deliver"].append((shown - end) * 1000)
    return out


def event_log_conf(root: Path, namespace: str) -> tuple[Path, dict[str, str]]:
    """Spark settings writing one plain event log under `root` (its directory returned)."""
    where = root / f"{namespace}-{time.strftime('%Y%m%dT%H%M%S')}"
    where.mkdir(parents=True, exist_ok=True)
    return where, {
        "spark.eventLog.enabled": "true",
        "spark.eventLog.dir": where.resolve().as_uri(),
        "spark.eventLog.compress": "false",
        "spark.eventLog.rolling.enabled": "false",
    }


def slot_waits(events: Path, since: float) -> dict[str, dict[str, Any]]:
    """Per scheduler pool (one per query), over its Spark jobs submitted since `since`
    (epoch s): jobs, and medians (ms) of a job's wall time, its wait for task slots (per
    stage, first task launch minus stage submission, summed), its tasks' run time and
    their JVM CPU time (a Python source's worker not included); the longest slot wait."""
    pools: dict[int, str] = {}
    submitted: dict[int, int] = {}
    job_stages: dict[int, list[int]] = {}
    stage_job: dict[int, int] = {}
    stage_at: dict[int, int] = {}
    ended: dict[int, int] = {}
    first_launch: dict[int, int] = {}
    run: dict[int, float] = {}
    cpu: dict[int, float] = {}
    for path in events.glob("*"):
        with path.open(encoding="utf-8") as f:
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:  # the line being written
                    continue
                kind = e.get("Event")
                if kind == "SparkListenerJobStart":
                    job = e["Job ID"]
                    pools[job] = (e.get("Properties") or {}).get("spark.scheduler.pool", "?")
                    submitted[job] = e["Submission Time"]
                    job_stages[job] = e["Stage IDs"]
                    stage_job.update({s: job for s in e["Stage IDs"]})
                elif kind == "SparkListenerJobEnd":
                    ended[e["Job ID"]] = e["Completion Time"]
                elif kind == "SparkListenerStageSubmitted":
                    info = e["Stage Info"]
                    stage_at[info["Stage ID"]] = info.get("Submission Time", 0)
                elif kind == "SparkListenerTaskEnd":
                    stage, info = e["Stage ID"], e["Task Info"]
                    metrics = e.get("Task Metrics") or {}
                    launch = first_launch.get(stage)
                    first_launch[stage] = min(launch or info["Launch Time"], info["Launch Time"])
                    run[stage] = run.get(stage, 0) + metrics.get("Executor Run Time", 0)
                    cpu[stage] = cpu.get(stage, 0) + metrics.get("Executor CPU Time", 0) / 1e6
    rows: dict[str, list[dict[str, float]]] = {}
    for job, pool in pools.items():
        if job not in ended or submitted[job] < since * 1000:
            continue
        ran = [s for s in job_stages[job] if s in first_launch and s in stage_at]
        rows.setdefault(pool.removeprefix("query-"), []).append(
            {
                "wall": ended[job] - submitted[job],
                "slot_wait": sum(first_launch[s] - stage_at[s] for s in ran),
                "run": sum(run[s] for s in ran),
                "cpu": sum(cpu[s] for s in ran),
            }
        )
    return {
        pool: {
            "jobs": len(jobs),
            **{k: median([j[k] for j in jobs]) for k in jobs[0]},
            "slot_wait_max": max(j["slot_wait"] for j in jobs),
        }
        for pool, jobs in rows.items()
    }


def median(values: list[float]) -> float | None:
    data = sorted(values)
    return data[len(data) // 2] if data else None


@contextlib.contextmanager
def pipeline(
    state: Path,
    namespace: str,
    *,
    trigger_s: float = 0.5,
    overrides: dict[str, Any] | None = None,
    all_jobs: bool = False,
) -> Iterator[Pipeline]:
    """HML with k=1 (the defaults), one collector, bridge and gateway, the top-N job (or,
    with `all_jobs`, the five Meetup queries as `make demo` runs them)."""
    import ray

    from cluster.demo.meetup import meetup_jobs
    from cluster.deploy.analysis import start_driver, stop_driver, wait_running
    from cluster.deploy.gateway import start_gateways, stop_gateways
    from jobs.driver import DEFAULT_MASTER
    from runtime.engines.services import ensure_streams

    # TIERFLOW_BENCH_SPARK_CONF: extra Spark settings as JSON, TIERFLOW_BENCH_SPARK_MASTER
    # another master than the analysis driver's default (to compare settings A/B)
    spark_conf = json.loads(os.environ.get("TIERFLOW_BENCH_SPARK_CONF") or "{}")
    master = os.environ.get("TIERFLOW_BENCH_SPARK_MASTER") or DEFAULT_MASTER
    # TIERFLOW_BENCH_SPARK_EVENTS: a directory for Spark's event log (`slot_profile`)
    events_root = os.environ.get("TIERFLOW_BENCH_SPARK_EVENTS")
    events = None
    if events_root:
        events, log_conf = event_log_conf(Path(events_root), namespace)
        spark_conf = {**log_conf, **spark_conf}
    cfg = load(
        environ={},
        overrides={
            "state_dir": str(state / "state"),
            "ray": {"namespace": namespace},
            "roles": {"collector": {"port": 0}, "gateway": {"port": 0}},
            "streams": MEETUP_STREAMS,  # the Meetup RSVPs the benches send
            **(overrides or {}),
            "spark": {"master": master, "conf": spark_conf, **(overrides or {}).get("spark", {})},
        },
    )
    with NatsServer(store_dir=state / "nats").start() as server:

        async def streams() -> None:
            nc = await connect(server.url)
            await ensure_streams(nc, cfg)
            await nc.close()

        asyncio.run(streams())
        tier = start_collection_tier(cfg, nats_url=server.url)
        gateways: list[str] = []
        driver = None
        try:
            gateways = start_gateways(cfg, server.url, replicas=1, port=0)
            ends = ray.get(
                ray.get_actor(gateways[0], namespace=namespace).endpoints.remote(), timeout=30
            )
            jobs = demo_jobs() if all_jobs else meetup_jobs(trigger_s=trigger_s)[:1]
            driver = start_driver(cfg, server.url, jobs=jobs)
            status = wait_running(driver, 180)
            assert status.get("state") == "running", status
            yield Pipeline(cfg, server, tier, gateways, ends["url"], driver, events)
        finally:
            if driver is not None:
                stop_driver(driver)
            if gateways:
                stop_gateways(cfg, gateways)
            tier.stop()


class _Data(msgspec.Struct):
    events: int = 0
    n: int = -1


class _Frame(msgspec.Struct):
    op: str
    seq: int = 0
    data: _Data | None = None


_frame = msgspec.json.Decoder(_Frame)


@dataclass
class Watcher:
    """A gateway WebSocket subscriber that timestamps what it receives: the top-N counts
    (`events` of each top-N update) or the raw events' `n` field."""

    url: str
    stream: str
    filter: str = ""
    kind: str = "topn"  # or "raw"

    def __post_init__(self) -> None:
        self.seen: list[tuple[float, int]] = []  # (monotonic time, events or n)
        self.ready = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    @property
    def last(self) -> int:
        return self.seen[-1][1] if self.seen else 0

    def start(self) -> Watcher:
        self.task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task

    async def _run(self) -> None:
        import aiohttp

        sub: dict[str, Any] = {"op": "subscribe", "id": "w", "stream": self.stream, "from": "new"}
        if self.filter:
            sub["filter"] = self.filter
        async with aiohttp.ClientSession() as s, s.ws_connect(f"{self.url}/v1/ws") as ws:
            await ws.send_str(msgspec.json.encode(sub).decode())
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    break
                f = _frame.decode(msg.data)
                if f.op == "subscribed":
                    self.ready.set()
                elif f.op == "event" and f.data is not None:
                    value = f.data.events if self.kind == "topn" else f.data.n
                    self.seen.append((time.monotonic(), value))
