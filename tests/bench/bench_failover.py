"""Failover: time from a SIGKILL to the next successful acknowledgement, per role.

Prints numbers, asserts no speed (`make bench`); asserts that every probe acknowledged
is in JetStream exactly once at the end. The whole pipeline (tests/bench/pipeline.py: HML,
logger k=1, one collector, bridge and gateway, the top-N Spark query) under a steady
probe load: a new one-event POST every 20 ms, each in its own request, so a stalled
request never hides the recovery. Two probe streams run side by side: plain (answered
once logged on both logger replicas) and, every 100 ms, `?wait=queued` (answered once
JetStream acked).

Per role, one SIGKILL of its process (Ray restarts it; the supervisors see it); the figure
is the time from the kill to the first 2xx of a probe sent after the kill. For the gateway
it is the time to the first event delivered to a `actors.access.client.TierflowClient` (its
own reconnect and resume), for Spark the time to the first top-N update counting new
events: by default the analysis driver runs as a warm pair (`spark.standby`,
jobs/standby.py) and the kill is of the active one, so that is the standby's takeover;
`TIERFLOW_BENCH_FAILOVER_STANDBY=0` measures one driver that Ray restarts (a new JVM and
Spark session first).
The floor, measured in the same run: Ray restarting a bare actor (`max_restarts=-1`) to
its first answered call.

A profile pass (`TIERFLOW_BENCH_FAILOVER_PROFILE=1`: no performance goal is a failover
figure, and its three extra kills cost about 40 s of `make bench`'s 20-minute budget), after
the measured kills so py-spy's own CPU is not in their figures: the collector and the logger
primary are killed once more (and a bare actor, for the floor) with py-spy recording the
raylet and every worker it starts (`--subprocesses --idle`, timestamped), so the restarted
process is sampled from its interpreter's start; `common.startup_phases` splits its wall-
clock time from birth to the end of `__init__` into phases. What remains of the next
acknowledgement after that is the first calls of the new process (or, for a logger, the
retried write).

Run alone:
`.venv/bin/python -m pytest -s -o python_files='bench_*.py' tests/bench/bench_failover.py`
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from actors.access.client import TierflowClient
from cluster.verify import judge, stream_ids
from runtime.nats.server import connect
from runtime.waiting import WaitTimeout, await_until
from tests.bench.common import (
    BirthProfiler,
    birth_s,
    restart_lines,
    startup_phases,
    write_report,
)
from tests.bench.pipeline import TOPN_SUBJECT, Pipeline, Watcher, pipeline

INTERVAL_S = 0.02
QUEUED_INTERVAL_S = 0.1  # `wait=queued` answers take longer: fewer, so none queue up
SETTLE_S = 2.0  # probes answered normally this long before each kill
RECOVERY_S = 60.0
PROFILE = os.environ.get("TIERFLOW_BENCH_FAILOVER_PROFILE", "0") == "1"
# the analysis driver as a warm pair (spark.standby, jobs/standby.py); 0: one driver that
# Ray restarts (a new JVM and Spark session ahead of its first batch)
STANDBY = os.environ.get("TIERFLOW_BENCH_FAILOVER_STANDBY", "1") == "1"
PROFILE_S = 8.0  # py-spy's window: attach, the kill, and the whole restart
ATTACH_S = 1.5  # py-spy attached to every running worker before the kill


class Prober:
    """A new one-event POST every `interval_s`; keeps (sent, answered, ok, id) per probe."""

    def __init__(
        self, url: str, tag: str, query: str = "", interval_s: float = 0.02, cap: int = 300
    ) -> None:
        self.interval_s, self.cap = interval_s, cap
        self.url = f"{url}/v1/streams/meetup/events" + (f"?{query}" if query else "")
        self.tag = tag
        self.results: list[tuple[float, float, bool, str]] = []
        self.pending: set[asyncio.Task[None]] = set()
        self.statuses: dict[int | str, int] = {}  # answers and errors, counted
        self.task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    def start(self) -> Prober:
        self.task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        self._stop.set()
        if self.task is not None:
            await self.task

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=60)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as s:
            i = 0
            while not self._stop.is_set():
                if len(self.pending) < self.cap:
                    task = asyncio.create_task(self._one(s, f"{self.tag}-{i}"))
                    self.pending.add(task)
                    task.add_done_callback(self.pending.discard)
                    i += 1
                await asyncio.sleep(self.interval_s)
            await asyncio.gather(*self.pending, return_exceptions=True)

    async def _one(self, s: aiohttp.ClientSession, eid: str) -> None:
        t0 = time.monotonic()
        body = b'{"id": "%s", "probe": true}' % eid.encode()
        try:
            async with s.post(
                self.url, data=body, headers={"Content-Type": "application/json"}
            ) as r:
                await r.read()
                ok = r.status == 200
                self.statuses[r.status] = self.statuses.get(r.status, 0) + 1
        except (TimeoutError, aiohttp.ClientError) as err:
            ok = False
            self.statuses[type(err).__name__] = self.statuses.get(type(err).__name__, 0) + 1
        self.results.append((t0, time.monotonic(), ok, eid))

    def recovered_after(self, kill: float) -> float | None:
        """Seconds from `kill` to the first 2xx of a probe sent after it."""
        done = [end for sent, end, ok, _ in self.results if ok and sent >= kill]
        return min(done) - kill if done else None

    def healthy_since(self, t: float) -> bool:
        return any(ok and sent >= t for sent, _, ok, _ in self.results)

    @property
    def acknowledged(self) -> set[str]:
        return {eid for _, _, ok, eid in self.results if ok}


class Reader:
    """A TierflowClient on the raw stream (fast reconnects): when did deliveries arrive."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: list[float] = []
        self.task: asyncio.Task[None] | None = None

    def start(self) -> Reader:
        self.task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        async with TierflowClient(self.url, backoff_base=0.02, backoff_cap=0.1) as c:
            async for _ in c.subscribe("meetup", start="new"):
                self.seen.append(time.monotonic())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task

    def first_after(self, kill: float) -> float | None:
        later = [t for t in self.seen if t > kill]
        return later[0] - kill if later else None


def ray_floor() -> tuple[float, float]:
    """Seconds for Ray to restart a bare actor after SIGKILL and answer a call, and when
    the process that answers was born relative to the kill (< 0: an idle worker reused)."""
    import ray

    @ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=0)
    class Bare:
        def pid(self) -> int:
            return os.getpid()

    bare = Bare.remote()
    try:
        took, _, born = _restart(bare)
        return took, born
    finally:
        ray.kill(bare, no_restart=True)


def profile_floor() -> dict[str, Any]:
    """The floor's restart under py-spy: a bare actor whose `__init__` lingers 100 ms, so
    its end is sampled (it takes no arguments, like the measured one)."""
    import ray

    @ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=0)
    class Lingering:
        def __init__(self) -> None:
            time.sleep(0.1)

        def pid(self) -> int:
            return os.getpid()

    actor = Lingering.remote()
    try:
        pid = ray.get(actor.pid.remote(), timeout=60)
        spy = BirthProfiler(psutil.Process(pid).ppid(), PROFILE_S)
        time.sleep(ATTACH_S)
        took, new, born = _restart(actor)
        return restart_profile(spy, new, "Lingering.__init__", took, born)
    finally:
        ray.kill(actor, no_restart=True)


def _restart(actor: Any) -> tuple[float, int, float]:
    """SIGKILL `actor`; (seconds to its first answer, new pid, its birth after the kill)."""
    import ray

    pid = ray.get(actor.pid.remote(), timeout=60)
    t0 = time.monotonic()
    boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    os.kill(pid, signal.SIGKILL)
    deadline = t0 + 120
    new = pid
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            new = ray.get(actor.pid.remote(), timeout=10)
            if new != pid:
                break
        time.sleep(0.01)
    took = time.monotonic() - t0
    return took, new, birth_s(new) - boot if new != pid else float("nan")


def restart_profile(
    spy: BirthProfiler, pid: int, init: str, ack_s: float | None, born_s: float
) -> dict[str, Any]:
    """Where the restart of `pid` went: born after the kill, start-up phases (from py-spy),
    and what is left until the next acknowledgement."""
    events = spy.trace()
    if isinstance(events, str):
        return {"error": events}
    out = {"pid": pid, "ack_s": ack_s, "born_s": round(born_s, 3)}
    out.update(startup_phases(events, pid, init, reused=born_s < 0))
    if ack_s is not None and "span_s" in out and born_s >= 0:  # else no common clock
        out["after_init_s"] = round(ack_s - born_s - out["span_s"], 3)
    return out


async def kill_and_time(
    name: str, pid_of: Callable[[], int], probes: list[Prober], reader: Reader
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    t = time.monotonic()
    healthy = True
    try:  # bounded: after RECOVERY_S the kill goes ahead, and the row says it was not healthy
        await await_until(
            lambda: all(p.healthy_since(t) for p in probes),
            timeout=RECOVERY_S,
            what=f"healthy before {name}",
        )
    except WaitTimeout:
        healthy = False
    await asyncio.sleep(SETTLE_S)
    pid = await loop.run_in_executor(None, pid_of)
    kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    # bounded: a path not recovered by RECOVERY_S is reported as such (None), not waited for
    with contextlib.suppress(WaitTimeout):
        await await_until(
            lambda: (
                all(p.recovered_after(kill) is not None for p in probes)
                and reader.first_after(kill) is not None
            ),
            timeout=RECOVERY_S,
            interval=0.05,
            what=f"recovery after killing {name}",
        )
    ack, queued = (p.recovered_after(kill) for p in probes)
    return {
        "role": name,
        "pid": pid,
        "ack_s": ack,
        "queued_s": queued,
        "delivered_s": reader.first_after(kill),
        "healthy_before": healthy,
    }


async def profile_restart(
    name: str, pid_of: Callable[[], int], init: str, probes: list[Prober]
) -> dict[str, Any]:
    """Kill `name` once more, under py-spy from the raylet down (see the module doc)."""
    loop = asyncio.get_running_loop()
    t = time.monotonic()
    with contextlib.suppress(WaitTimeout):  # bounded; the profile says what it saw
        await await_until(
            lambda: all(p.healthy_since(t) for p in probes), timeout=RECOVERY_S, what="healthy"
        )
    await asyncio.sleep(SETTLE_S)
    pid = await loop.run_in_executor(None, pid_of)
    spy = BirthProfiler(psutil.Process(pid).ppid(), PROFILE_S)
    await asyncio.sleep(ATTACH_S)
    kill = time.monotonic()
    boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(WaitTimeout):
        await await_until(
            lambda: probes[0].recovered_after(kill) is not None,
            timeout=RECOVERY_S,
            interval=0.05,
            what=f"recovery after killing {name}",
        )
    new = await loop.run_in_executor(None, pid_of)
    born = birth_s(new) - boot
    ack = probes[0].recovered_after(kill)
    return await loop.run_in_executor(None, restart_profile, spy, new, init, ack, born)


async def spark_recovery(p: Pipeline) -> dict[str, Any]:
    """A fresh top-N watcher (the gateway was killed before: a plain one does not reconnect)."""
    topn = Watcher(p.gateway_url, "results", f"WHERE _subject = '{TOPN_SUBJECT}'").start()
    try:
        return await _spark_recovery(p, topn)
    finally:
        await topn.stop()


async def _spark_recovery(p: Pipeline, topn: Watcher) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    await await_until(lambda: topn.seen, timeout=300, what="a first top-N update")
    if STANDBY:  # the kill is of a pair whose standby is ready: warmed up and waiting
        await await_until(
            lambda: loop.run_in_executor(None, p.standby_ready),
            timeout=300,
            swallow=True,
            what="the standby driver ready",
        )
    standby = await loop.run_in_executor(None, p.standby_info) if STANDBY else {}
    active = await loop.run_in_executor(None, p.active_driver)
    pid = active["pid"]
    before = topn.last
    kill, killed_at = time.monotonic(), time.time()
    os.kill(pid, signal.SIGKILL)
    took_over: dict[str, Any] = {}

    def running_again() -> bool:
        """Another process runs the queries: the standby's takeover (asked by the survivor's
        name: a call to the killed one's waits for Ray to restart it), or Ray's restart."""
        st = p.active_driver(survivor_of=active["actor_id"] if STANDBY else None)
        took_over.update(st.get("took_over") or {})
        return st["pid"] != pid and st["state"] == "running"

    await await_until(
        lambda: loop.run_in_executor(None, running_again),
        timeout=180,
        swallow=True,
        what="the queries running again",
    )
    back = time.monotonic() - kill
    await await_until(
        lambda: any(t > kill and n > before for t, n in topn.seen),
        timeout=300,
        what="a top-N update after the driver's restart",
    )
    first = next(t for t, n in topn.seen if t > kill and n > before)
    return {
        "role": "spark driver",
        "standby": STANDBY,
        # the standby's start-up: seconds from its start to its Spark up and its warm-up done
        "standby_phases": standby.get("phases"),
        "pid": pid,
        "restarted_s": back,
        # the standby's own record: SIGKILL to its holding the store (the bench's polls of
        # its status add their own latency to `restarted_s`)
        "took_over_s": round(took_over["at"] - killed_at, 3) if "at" in took_over else None,
        "topn_s": first - kill,
    }


async def scenario(
    p: Pipeline,
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    tier = p.tier
    probes = [
        Prober(tier.url, "ack").start(),
        Prober(tier.url, "queued", "wait=queued", QUEUED_INTERVAL_S, cap=50).start(),
    ]
    reader = Reader(p.gateway_url).start()
    group = tier.logger_groups[0]
    roles: list[tuple[str, Callable[[], int]]] = [
        ("collector", lambda: p.pid(p.actor(tier.collectors[0]))),
        ("logger primary", lambda: p.pid(group.replicas[group.primary])),
        ("logger backup", lambda: p.pid(group.replicas[1 - group.primary])),
        ("bridge", lambda: p.pid(p.actor(tier.bridges[0]))),
        ("gateway", lambda: p.pid(p.actor(p.gateways[0]))),
    ]
    profiles: dict[str, Any] = {}
    try:
        rows = [await kill_and_time(name, pid_of, probes, reader) for name, pid_of in roles]
        if PROFILE:
            loop = asyncio.get_running_loop()
            profiles["bare actor (floor)"] = await loop.run_in_executor(None, profile_floor)
            inits = {"collector": "Collector.__init__", "logger primary": "LoggerReplica.__init__"}
            for name, pid_of in roles:
                if name in inits:
                    profiles[name] = await profile_restart(name, pid_of, inits[name], probes)
        # last: the analysis driver's standby gets ready (its JVM start and warm-up, minutes
        # under this load) while the kills and profiles above run, not after them
        spark = await spark_recovery(p)
    finally:
        for probe in probes:
            await probe.stop()
        await reader.stop()
    acked = set().union(*(probe.acknowledged for probe in probes))

    async def drained() -> bool:
        c = await tier.loggers[0].counts()
        return c["transient"] == 0 and c["failed"] == 0

    await await_until(drained, timeout=120, interval=0.2, swallow=True, what="log drained")
    nc = await connect(p.server.url)
    try:
        verdict = judge(acked, await stream_ids(nc, "meetup"))
    finally:
        await nc.close()
    assert verdict.ok, str(verdict)
    answers = {probe.tag: {str(k): v for k, v in probe.statuses.items()} for probe in probes}
    spark = {**spark, "probes_acknowledged": len(acked), "probe_answers": answers}
    return rows, spark, profiles


def secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


@pytest.mark.timeout(900)
def test_failover_per_role(bench_ray: Any, tmp_path: Path) -> None:
    floor, floor_born = ray_floor()
    with pipeline(tmp_path, "bench-failover", overrides={"spark": {"standby": STANDBY}}) as p:
        rows, spark, profiles = asyncio.run(scenario(p))
    print(
        f"\nfailover after SIGKILL, HML k=1, probes every {INTERVAL_S * 1000:g} ms, "
        f"{os.cpu_count()} cores; Ray's own restart of a bare actor: {floor:.2f} s "
        f"(its new process born {floor_born:+.2f} s from the kill)"
    )
    print(f"{'role':<16}{'ack s':>8}{'queued s':>10}{'delivered s':>13}{'ack / floor':>13}")
    for r in rows:
        cells = [secs(r["ack_s"]), secs(r["queued_s"]), secs(r["delivered_s"])]
        ratio = f"{r['ack_s'] / floor:.1f}" if r["ack_s"] is not None else "-"
        print(f"{r['role']:<16}{cells[0]:>8}{cells[1]:>10}{cells[2]:>13}{ratio:>13}")
    print(f"-: not within {RECOVERY_S:g} s")
    for r in rows:
        if not r["healthy_before"]:
            print(f"{r['role']}: probes were not all answering before the kill (see above)")
    answers = spark["probe_answers"]
    print(f"probe answers: {answers}")
    how = "the warm standby took over" if STANDBY else "Ray restarted it"
    print(
        f"spark driver: {how} (queries running again) in {spark['restarted_s']:.1f} s, "
        f"(the standby's start: {spark.get('standby_phases')}; it held the store "
        f"{spark.get('took_over_s')} s after the kill), first top-N update counting "
        f"new events {spark['topn_s']:.1f} s after the kill; {spark['probes_acknowledged']} "
        "probes acknowledged, all in JetStream once"
    )
    if profiles:
        print("py-spy, restarts from the new process's birth (wall-clock):")
        for line in restart_lines(profiles):
            print(f"  {line}")
    write_report(
        "failover",
        {
            "interval_s": INTERVAL_S,
            "ray_floor_s": floor,
            "ray_floor_born_s": floor_born,
            "roles": rows,
            "spark": spark,
            "restart_profiles": profiles,
        },
    )
