"""Run a chaos scenario end to end: deploy, load with known ids, inject faults, verify.

For each scenario the runner starts its own deployment (NATS single node or a 3-node R3
cluster, a local Ray or a 3-node `ray.cluster_utils` cluster, the collection tier with a
k=1 logger and two collectors, two gateways, the Spark driver when the scenario checks
analysis), drives a mixed load (`cluster.loadgen.mixed_plan`: `events` valid events over
three streams, ids reused across them, a quarter without ids, near-limit events, and
invalid and oversized ones that must be refused) at `rate`, applies
`schedule.plan(scenario, seed)` on time, waits for the message log to drain, and judges:

- the queue, per stream by (id, payload digest) (`cluster.verify.judge_streams`): every
  acknowledged event exactly once with its bytes, no payload under two ids, nothing
  refused stored, every invalid/oversized event refused and every valid one accepted;
- the clients: a `TierflowClient` that subscribed (with a filter) before the load and
  resumed by cursor across faults got every matching stored event exactly once;
- the analysis (Spark scenarios): the results in KV equal `cluster.demo.meetup.reference` over
  exactly the stored events.

Everything it starts it stops, in reverse order, also on failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster

from actors.access.client import TierflowClient
from cluster.chaos.injectors import Deployment, FaultRecord, inject
from cluster.chaos.proxy import ProxyThread
from cluster.chaos.report import (
    DeliveryCheck,
    ScenarioReport,
    delivery_check,
    fault_reports,
    from_site_loss,
    rate_between,
)
from cluster.chaos.scenarios import SITE_LOSS, SITE_SCHEDULES
from cluster.chaos.schedule import Scenario, at_s, load_span, plan
from cluster.demo import SUBJECT
from cluster.demo.meetup import STREAM, meetup_jobs, reference
from cluster.demo.rsvps import RsvpGenerator
from cluster.deploy.analysis import start_driver, stop_driver, wait_running
from cluster.deploy.gateway import start_gateways, stop_gateways
from cluster.loadgen import EXPECT_ACCEPTED, drive_mixed, mixed_plan
from cluster.pipeline import start_collection_tier
from cluster.verify import judge_streams, stream_records
from jobs.sink import results_by_query
from jobs.sketches import Distinct
from runtime.config import load
from runtime.engines.services import local_ray
from runtime.nats.server import NatsCluster, NatsServer, connect
from runtime.waiting import WaitTimeout, await_until

log = logging.getLogger(__name__)

GENERIC_STREAM, GENERIC_SUBJECT = "chaos", "raw.chaos"
# The other streams of the mixed load (the same ids reused on each); the analysis
# scenario loads these two next to `meetup`.
EXTRA_STREAMS = ("chaos2", "chaos3")
GENERIC_FILTER = "WHERE k = 'a'"  # the gateway client's filter; matches every third event
MEETUP_FILTER = "WHERE response = 'yes'"


@dataclass
class RunOptions:
    events: int = 2000
    rate: float = 500.0
    seed: int = 1
    workdir: Path | None = None  # default: a fresh temporary directory per scenario
    batch: int = 50
    concurrency: int = 4
    drain_timeout_s: float = 180.0
    # test hook: runs after the log drained, before the stream is read (inject a real loss)
    before_verify: Callable[[Deployment], Awaitable[None]] | None = None


# ----------------------------------------------------------------------------- load


def load_streams(scn: Scenario) -> tuple[str, ...]:
    """The streams a scenario's load writes to; the first is the one the client reads."""
    return ("meetup" if scn.analysis else GENERIC_STREAM, *EXTRA_STREAMS)


def scenario_events(scn: Scenario, n: int, seed: int, max_payload: int) -> tuple[list[Any], Any]:
    """(the mixed load's `Planned` events, predicate of the gateway filter on a body).

    The analysis scenario's `meetup` events are Meetup RSVPs (no refusals or padding
    there, so the analysis sees plain RSVPs); the other streams get generic bodies and
    every kind of event that must be refused."""

    streams = load_streams(scn)
    make = None
    if scn.analysis:
        rsvps = iter(RsvpGenerator(seed=seed).take(n))

        def make(i: int, stream: str) -> dict[str, Any] | None:
            return next(rsvps) if stream == "meetup" else None

    plan_ = mixed_plan(
        n,
        streams,
        f"{scn.name}-{seed}",
        max_payload=max_payload,
        make=make,
        special_streams=EXTRA_STREAMS if scn.analysis else streams,
    )
    if scn.analysis:
        return plan_, lambda body: body.get("response") == "yes"
    return plan_, lambda body: body.get("k") == "a"


# ----------------------------------------------------------------------------- deployment


def _config(scn: Scenario, work: Path, namespace: str, nats_url: str) -> Any:
    streams: dict[str, Any] = (
        {STREAM: {"subjects": [SUBJECT]}}
        if scn.analysis
        else {GENERIC_STREAM: {"subjects": [GENERIC_SUBJECT]}}
    )
    streams.update({s: {"subjects": [f"raw.{s}"]} for s in EXTRA_STREAMS})
    if scn.duplicate_window_s:
        for name in load_streams(scn):
            streams[name]["duplicate_window_s"] = scn.duplicate_window_s
    overrides: dict[str, Any] = {
        "state_dir": str(work / "state"),
        "ray": {"namespace": namespace},
        "nats": {"url": nats_url, "stream_replicas": 3 if scn.nats_nodes > 1 else 1},
        "roles": {"logger": {"k": 1}, "collector": {"replicas": 2, "port": 0}},
        "streams": streams,
    }
    if scn.analysis:
        overrides["spark"] = {"master": "local[2]", "conf": {"spark.sql.shuffle.partitions": 2}}
    return load(environ={}, overrides=overrides)


class _Stack:
    """Undo actions run in reverse order, each bounded and isolated from the others."""

    def __init__(self) -> None:
        self._undo: list[tuple[str, Callable[[], Any], bool]] = []

    def push(self, what: str, fn: Callable[[], Any], *, inline: bool = False) -> None:
        """`inline` runs it on the caller's thread (Ray's own start/stop), else on a
        worker thread (blocking calls that may run their own event loop)."""
        self._undo.append((what, fn, inline))

    async def close(self) -> None:
        while self._undo:
            what, fn, inline = self._undo.pop()
            try:
                if inline:
                    fn()
                else:
                    await asyncio.to_thread(fn)
            except Exception as err:  # noqa: BLE001 - keep tearing down the rest
                log.warning("chaos teardown %s: %r", what, err)


def _start_ray(scn: Scenario, namespace: str, stack: _Stack) -> Any:
    """A 3-node `ray.cluster_utils.Cluster` for node loss, else the process's local Ray
    (started here if none is up and left up for the next scenario)."""

    if scn.ray_nodes <= 1:
        local_ray(namespace)
        return None

    if ray.is_initialized():
        ray.shutdown()  # one driver connection per process
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    stack.push("ray cluster", cluster.shutdown, inline=True)
    for _ in range(scn.ray_nodes - 1):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=namespace, log_to_driver=False)
    stack.push("ray driver", ray.shutdown, inline=True)
    return cluster


def _start_nats(scn: Scenario, work: Path, stack: _Stack) -> Any:
    if scn.nats_nodes > 1:
        nats: Any = NatsCluster(work / "nats", nodes=scn.nats_nodes).start(60)
    else:
        nats = NatsServer(store_dir=work / "nats").start()
    stack.push("nats", nats.stop)
    return nats


async def deploy(scn: Scenario, opts: RunOptions, work: Path, stack: _Stack) -> Deployment:
    """Start everything the scenario needs; each part registers its own undo."""

    namespace = f"chaos-{scn.name}-{secrets.token_hex(3)}"
    cluster = _start_ray(scn, namespace, stack)
    nats = _start_nats(scn, work, stack)
    tier_url = nats.url
    proxy = None
    if scn.proxy:
        proxy = ProxyThread(nats.host, nats.port, seed=opts.seed)
        proxy.start()
        stack.push("proxy", proxy.stop)
        tier_url = f"nats://127.0.0.1:{proxy.port}"
    cfg = _config(scn, work, namespace, nats.url)
    tier = await asyncio.to_thread(start_collection_tier, cfg, nats_url=tier_url)
    d = Deployment(
        cfg=cfg,
        tier=tier,
        nats=nats,
        stream="meetup" if scn.analysis else GENERIC_STREAM,
        cluster=cluster,
        proxy=proxy,
    )
    stack.push("collection tier", lambda: d.tier.stop())

    def restart_tier() -> None:
        port = d.tier.collector_port
        d.tier.stop()
        d.tier = start_collection_tier(cfg, nats_url=tier_url, collector_port=port)

    d.restart_tier = restart_tier
    if scn.gateway:
        d.gateways = await asyncio.to_thread(start_gateways, cfg, nats.url, 2, 0)
        stack.push("gateways", lambda: stop_gateways(cfg, d.gateways))
    if scn.analysis:
        d.driver = start_driver(cfg, nats.url, jobs=meetup_jobs(trigger_s=0.5))
        stack.push("analysis driver", lambda: stop_driver(d.driver))
        st = await asyncio.to_thread(wait_running, d.driver, 240)
        if st.get("state") != "running":
            raise RuntimeError(f"analysis driver not running: {st}")
    return d


async def gateway_url(d: Deployment) -> str:
    ep = await asyncio.to_thread(
        ray.get, d.tier.actor(d.gateways[0]).endpoints.remote(), timeout=30
    )
    return ep["url"]


# ----------------------------------------------------------------------------- verify


@dataclass
class Subscriber:
    """A gateway client that resumes by cursor; keeps every delivered id in order."""

    ids: list[str] = field(default_factory=list)
    client: Any = None
    task: asyncio.Task[None] | None = None
    error: str = ""

    async def start(self, url: str | Sequence[str], stream: str, filter_sql: str) -> None:
        self.client = TierflowClient(url, give_up_after=120.0)

        async def consume() -> None:
            try:
                async for delivery in self.client.subscribe(stream, filter=filter_sql, start=1):
                    self.ids.append(str(delivery.data.get("id")))
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - reported as the check's error
                self.error = repr(err)

        self.task = asyncio.create_task(consume())

    async def caught_up(self, want: set[str], timeout: float) -> DeliveryCheck:
        """Wait (at most `timeout` s) until every id of `want` arrived; what it got against
        `want`, whether it got there or not."""
        with contextlib.suppress(WaitTimeout):  # the check says what is missing
            await await_until(lambda: want <= set(self.ids), timeout, 0.5, what="client")
        return delivery_check(want, list(self.ids), self.client.stats.reconnects)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        if self.client is not None:
            await self.client.close()


async def drained(d: Deployment) -> bool:
    """Every logger group holds nothing more to send (all handed to JetStream)."""
    for group in d.tier.loggers:
        if not await group.drained():  # every replica, not only the primary
            return False
    return True


async def _diagnose(d: Deployment) -> str:
    """What the tier holds when it did not drain: log counts and bridge counters."""

    out = []
    group = d.tier.loggers[0]
    with contextlib.suppress(Exception):
        out.append(f"log {await group.counts()}")
    with contextlib.suppress(Exception):
        due = await group.due_failed(now_ms=1 << 62, limit=1)
        replica = ray.get_actor(group.replica_name(group.primary), namespace=group.namespace)
        key = (due[0].stream, due[0].id)
        entry = await asyncio.to_thread(ray.get, replica.failed_entry.remote(key), timeout=10)
        out.append(f"a failed entry: {entry}")
    for name in d.tier.bridges:
        with contextlib.suppress(Exception):
            stats = await asyncio.to_thread(ray.get, d.tier.actor(name).stats.remote(), timeout=10)
            out.append(f"{name} {stats}")
    return "; ".join(out)[:1500]


async def read_results(url: str) -> dict[str, dict[Any, Any]]:
    nc = await connect(url)
    try:
        return await results_by_query(nc.jetstream())
    finally:
        await nc.close()


def analysis_mismatches(got: dict[str, Any], rsvps: list[dict[str, Any]]) -> list[str]:
    """Queries whose results differ from the exact recomputation (HLL within its bound)."""
    return answers_off(got, reference(rsvps))


def answers_off(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Queries whose results differ from `want`, `reference`'s exact answers (HLL within
    its bound): for a caller that compares one recount more than once."""
    bad = [
        name
        for name in ("meetup_topn", "meetup_topn_window", "meetup_city_minute", "meetup_responses")
        if got.get(name) != want[name]
    ]
    exact = want["meetup_members"]["all"]["distinct"]
    est = (got.get("meetup_members") or {}).get("all", {}).get("distinct")
    if est is None or abs(est - exact) > Distinct(12).relative_error(3) * exact:
        bad.append("meetup_members")
    return bad


def mismatch_detail(got: dict[str, Any], want: dict[str, Any], name: str) -> str:
    """How query `name`'s results differ from `want` (`reference`'s exact answers): how
    many keys, and the first differing key's answer against the exact one (a failure
    message to act on)."""
    want, have = want[name], got.get(name) or {}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    differ = sorted(k for k in want if k in have and have[k] != want[k])
    out = f"{name}: {len(differ)} of {len(want)} keys differ, {len(missing)} missing, "
    out += f"{len(extra)} extra"
    if differ:
        k = differ[0]
        out += f"; first {k}: got {_brief(have[k])}, exact {_brief(want[k])}"
    elif missing:
        out += f"; first missing {missing[0]}"
    return out


def _brief(row: Any) -> str:
    if isinstance(row, dict) and isinstance(row.get("top"), list):
        return ", ".join(f"{r.get('item')} {r.get('count')}" for r in row["top"][:3])
    return str(row)[:200]


async def _verify_analysis(d: Deployment, bodies: list[dict[str, Any]]) -> list[str]:
    idle = await asyncio.to_thread(ray.get, d.driver.await_idle.remote(300), timeout=330)
    if not idle.get("idle"):
        return [f"driver not idle: {idle}"]
    got = await read_results(d.nats.url)
    return analysis_mismatches(got, bodies)


# ----------------------------------------------------------------------------- run


async def _faults(
    scn: Scenario, opts: RunOptions, d: Deployment, t0: float, span: float
) -> list[FaultRecord]:
    async def one(f: Any) -> FaultRecord:
        await asyncio.sleep(max(0.0, t0 + at_s(f, span) - time.monotonic()))
        return await inject(f, d, t0)

    return list(await asyncio.gather(*(one(f) for f in plan(scn, opts.seed))))


async def _max_payload(url: str) -> int:
    """The server's max_payload (what it takes per message, headers included)."""

    nc = await connect(url)
    try:
        return int(nc.max_payload)
    finally:
        await nc.close()


async def run_site_scenario(scn: Scenario, opts: RunOptions) -> ScenarioReport:
    """`site-loss` (a tierflow runtime on each of two NATS sites, HTTP load) or
    `site-loss-nats` (JetStream publishes to each site): they start their own sites and
    runtimes (cluster/chaos/site_loss_pipeline.py, cluster/chaos/site_loss.py)."""
    from cluster.chaos.site_loss import run_site_loss
    from cluster.chaos.site_loss_pipeline import run_site_loss_pipeline

    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if opts.workdir is None:
            tmp = tempfile.TemporaryDirectory(prefix=f"tierflow-chaos-{scn.name}-")
            work = Path(stack.enter_context(tmp))
        else:
            work = opts.workdir / f"{scn.name}-{opts.seed}-{secrets.token_hex(2)}"
        run = run_site_loss_pipeline if scn.name == SITE_LOSS else run_site_loss
        rep = await run(events=opts.events, rate=opts.rate, seed=opts.seed, workdir=work)
    return from_site_loss(scn.name, opts.seed, opts.rate, rep, time.monotonic() - started)


async def run_scenario(scn: Scenario, opts: RunOptions) -> ScenarioReport:
    """Deploy, load, inject, verify, tear down; the report says what happened."""

    if scn.name in SITE_SCHEDULES:  # two NATS sites: not one deployment
        return await run_site_scenario(scn, opts)
    span, rate = load_span(opts.events, opts.rate, scn)
    rep = ScenarioReport(scn.name, opts.seed, opts.events, round(rate, 1), 0, 0, 0)
    started = time.monotonic()
    stack = _Stack()
    tmp = None
    if opts.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix=f"tierflow-chaos-{scn.name}-")
        work = Path(tmp.name)
    else:
        work = opts.workdir / f"{scn.name}-{opts.seed}-{secrets.token_hex(2)}"
    sub = Subscriber()
    try:
        d = await deploy(scn, opts, work, stack)
        events, matches = scenario_events(
            scn, opts.events, opts.seed, await _max_payload(d.nats.url)
        )
        rep.events = sum(1 for p in events if p.kind in EXPECT_ACCEPTED)
        rep.expected_refused = len(events) - rep.events
        if d.gateways:
            await sub.start(
                await gateway_url(d), d.stream, MEETUP_FILTER if scn.analysis else GENERIC_FILTER
            )
        timeline: list[tuple[float, int]] = []
        t0 = time.monotonic()

        def on_batch(n: int) -> None:
            timeline.append((time.monotonic() - t0, n))

        log.info("%s: load of %d events at %.0f/s", scn.name, len(events), rate)
        faults = asyncio.create_task(_faults(scn, opts, d, t0, span))
        budget = span + sum(f.duration_s + 60 for f in plan(scn, opts.seed)) + 120
        load = await drive_mixed(
            d.tier.url,
            events,
            ws_every=4,  # every fourth valid request as a producer WebSocket frame
            batch=opts.batch,
            concurrency=opts.concurrency,
            rate=rate,
            deadline_s=budget,
            on_batch=on_batch,
        )
        log.info(
            "%s: load done (%d acknowledged); waiting for faults", scn.name, len(load.acknowledged)
        )
        records = await faults
        load_s = time.monotonic() - t0
        log.info("%s: faults done; waiting for the log to drain", scn.name)
        rep.sent, rep.acknowledged, rep.refused = load.sent, len(load.acknowledged), load.refused
        rep.rejected = dict(load.rejected)
        rep.wrongly_accepted, rep.wrongly_refused = load.wrongly_accepted, load.wrongly_refused
        rep.adopted_ids, rep.retried = load.adopted, dict(load.retried)
        rep.ws_requests = load.ws_requests
        rep.faults = fault_reports(records, timeline)
        rep.throughput_eps = rate_between(timeline, 0.0, load_s)
        try:
            await await_until(
                lambda: drained(d),
                opts.drain_timeout_s,
                0.5,
                what="message log drained to JetStream",
                swallow=True,
            )
        except WaitTimeout as err:  # still judge what is stored: the loss shows
            rep.notes.append(f"not drained: {await _diagnose(d)}")
            rep.error = repr(err)[:500]
        log.info("%s: drained; verifying", scn.name)
        if opts.before_verify is not None:
            await opts.before_verify(d)
        nc = await connect(d.nats.url)
        try:
            stored = {s: await stream_records(nc, s) for s in load_streams(scn)}
        finally:
            await nc.close()
        verdicts = judge_streams(load.acked, stored, refused=load.refused_digests, blind=load.blind)
        rep.add_verdicts(verdicts.values())
        body_of = {(p.stream, p.digest): p.body for p in events}
        kept = [body_of[(d.stream, h)] for _, h in stored[d.stream] if (d.stream, h) in body_of]
        if d.gateways:
            want = {
                i
                for i, h in stored[d.stream]
                if (d.stream, h) in body_of and matches(body_of[(d.stream, h)])
            }
            rep.gateway = await sub.caught_up(want, 90)
            if sub.error:
                rep.notes.append(f"gateway client: {sub.error}")
        if scn.analysis:
            rep.analysis_mismatches = await _verify_analysis(d, kept)
        rep.notes += d.notes
    except Exception as err:  # noqa: BLE001 - the report carries it; the run goes on
        log.exception("chaos scenario %s failed", scn.name)
        rep.error = repr(err)[:500]
    finally:
        await sub.stop()
        await stack.close()
        if tmp is not None:
            tmp.cleanup()
    rep.elapsed_s = round(time.monotonic() - started, 1)
    return rep


async def run_all(scenarios: list[Scenario], opts: RunOptions) -> list[ScenarioReport]:
    """Run scenarios one after another; a local Ray this started is shut down at the end."""

    ours = not ray.is_initialized()
    try:
        return [await run_scenario(s, opts) for s in scenarios]
    finally:
        if ours and ray.is_initialized():
            ray.shutdown()
