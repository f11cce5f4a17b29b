"""Chaos scenario `site-loss` through the tierflow pipeline: a whole NATS site killed under
HTTP load, with a zero-loss verdict on both sites' copies.

Two sites (runtime/geo/sites.py), each a 3-node JetStream cluster (the stream R3: k=1 inside a
site), one stream copied both ways (`[streams.geo.replicate] to = ["site-b"]`). On one
local Ray, a tierflow runtime per site (cluster/launcher.py `Runtime`: collector, message
logger group with k=1, bridge, gateway, admin endpoint), each in its own Ray namespace and
state directory, each pointed at its own site's NATS. Two HTTP producers (cluster/loadgen.py
`drive`, known ids, retried with the same ids until acknowledged) write to their own site's
collector; every 50th event of A's producer is also sent to B's collector with the same id
and body. At `kill_at` of the load every server of site A is SIGKILLed (`kill_site`, only
the pids the scenario started). A's collector keeps acknowledging: an acknowledgement
means the event is persisted in A's message log (k=1), and A's bridge retries until A
returns. After the load, A restarts on its old stores; its bridge hands the log to A's
copy, and each copy sources what the other took meanwhile.

Verdict (`site_loss.judge`, by id and payload digest, `cluster.verify.payload_digest`):
every event acknowledged by either collector is in B's copy exactly once and in A's copy
exactly once after catch-up; nothing stored that nobody sent. `missing_on_b_during_outage`
counts acknowledged events B lacked while A was down (those in A's log or A's copy only:
the recovery point). B's producer is undisturbed: `kill_to_first_ack_s` is the time from
the kill to its first acknowledgement from B.

The NATS-level form (JetStream publishes, a producer that fails over from A to B, the
link cut before the kill) is cluster/chaos/site_loss.py, scenario `site-loss-nats`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.chaos.site_loss import (
    STREAM,
    SUBJECT,
    SiteLossReport,
    converged,
    judge,
    read_copy,
)
from cluster.loadgen import LoadReport, drive
from cluster.verify import payload_digest
from runtime.config import Config, load
from runtime.engines.services import local_ray
from runtime.geo.replication import link_deny, replication_lag
from runtime.geo.sites import NatsSites
from runtime.nats.server import connect
from runtime.waiting import WaitTimeout, await_until

log = logging.getLogger(__name__)

BOTH_SITES_EVERY = 50  # every 50th event of A's producer is also sent to B, same id
BATCH = 25  # events per HTTP request
CONCURRENCY = 4  # requests in flight per producer
CATCH_UP_S = 300.0  # sources retry a lost origin with a backoff of up to 2 minutes


@dataclass
class GeoPipeline:
    """What `geo_pipeline` started: the two sites and a runtime on each."""

    sites: NatsSites
    runtimes: dict[str, Any] = field(default_factory=dict)  # site -> cluster.launcher.Runtime
    configs: dict[str, Config] = field(default_factory=dict)  # site -> its runtime's config

    def collector_url(self, site: str) -> str:
        return str(self.runtimes[site].tier.url)

    def admin_url(self, site: str) -> str:
        return str(self.runtimes[site].admin_url)


def site_config(work: Path, site: str, url: str, namespace: str) -> Config:
    """A runtime's config on `site`: its own state dir and Ray namespace, its site's NATS,
    a logger group with k=1, one collector, the replicated stream R3."""
    return load(
        environ={},
        overrides={
            "state_dir": str(work / site),
            "ray": {"namespace": namespace},
            "nats": {"url": url, "stream_replicas": 3},
            "roles": {
                "logger": {"k": 1},
                "collector": {"replicas": 1, "port": 0},
                "gateway": {"port": 0},
            },
            "streams": {
                STREAM: {"subjects": [SUBJECT], "replicas": 3, "replicate": {"to": ["site-b"]}}
            },
        },
    )


def _init_ray(namespace: str) -> bool:
    """A local Ray for both runtimes (True when started here: shut down at the end)."""
    return local_ray(namespace, _node_ip_address="127.0.0.1")


@contextlib.asynccontextmanager
async def geo_pipeline(work: Path, nodes: int = 3) -> AsyncIterator[GeoPipeline]:
    """Two sites of `nodes` nodes and a running tierflow runtime on each; everything
    started here is stopped on exit (runtimes, then servers, then a Ray started here)."""
    import ray

    from cluster.launcher import Runtime

    token = secrets.token_hex(3)
    probe = site_config(work, "probe", "nats://127.0.0.1:1", "probe")
    sites = NatsSites(work / "sites", sites=2, nodes=nodes, deny=link_deny(probe))
    p = GeoPipeline(sites=sites)
    ours = False
    try:
        t0 = time.monotonic()
        await asyncio.to_thread(sites.start)
        ours = _init_ray(f"site-loss-{token}")
        log.info("site-loss: sites and Ray up in %.1f s", time.monotonic() - t0)
        for name in ("site-a", "site-b"):
            cfg = site_config(work, name, sites.site(name).url, f"geo-{name}-{token}")
            p.configs[name] = cfg
            p.runtimes[name] = Runtime(cfg)
        for rt in p.runtimes.values():  # one after the other: two `ensure_streams` at
            await rt.start()  # once, each updating both copies, time out on each other
        log.info("site-loss: runtimes up at %.1f s", time.monotonic() - t0)
        yield p
    finally:
        t0 = time.monotonic()
        for name in reversed(list(p.runtimes)):
            try:
                await asyncio.wait_for(p.runtimes[name].stop(), 240)
            except Exception as err:  # noqa: BLE001 - keep stopping the rest
                log.warning("site-loss: stopping the runtime on %s: %r", name, err)
        await asyncio.to_thread(sites.stop)
        if ours and ray.is_initialized():
            ray.shutdown()
        log.info("site-loss: stopped in %.1f s", time.monotonic() - t0)


def body(event_id: str, site: str, n: int, seed: int) -> dict[str, Any]:
    """A deterministic event (its `payload_digest` is what the verdict checks)."""
    return {"id": event_id, "site": site, "n": n, "seed": seed, "pad": "x" * 64}


def plan_events(events: int, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(A's producer's events, B's): half each; B's list also carries every 50th event of
    A's, same id and body, placed where A sends it."""
    half = events // 2
    a = [body(f"a-{i}", "a", i, seed) for i in range(half)]
    b: list[dict[str, Any]] = []
    own = [body(f"b-{i}", "b", i, seed) for i in range(events - half)]
    for i in range(max(len(a), len(own))):
        if i < len(own):
            b.append(own[i])
        if i < len(a) and i % BOTH_SITES_EVERY == 0:
            b.append(a[i])
    return a, b


async def _drained(rt: Any) -> bool:
    """The runtime's message log holds nothing JetStream lacks (every replica)."""
    for group in rt.tier.loggers:
        if not await group.drained():
            return False
    return True


async def _converged(url: str, cfg: Config) -> bool:
    nc = await connect(url, name="site-loss-watch")
    try:
        return converged(await replication_lag(nc, cfg))
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 2)


def _acked_times(events: list[dict[str, Any]], batch_times: dict[int, float]) -> dict[str, float]:
    """id -> when its batch was acknowledged (loadgen reports acknowledgements per batch)."""
    out = {}
    for idx, t in batch_times.items():
        for e in events[idx * BATCH : (idx + 1) * BATCH]:
            out[e["id"]] = t
    return out


async def _kill_at(p: GeoPipeline, rep: SiteLossReport, start: float, at_s: float) -> None:
    await asyncio.sleep(max(0.0, start + at_s - time.monotonic()))
    rep.killed_at = time.monotonic()
    rep.kill_after_s = round(rep.killed_at - start, 3)
    rep.killed_pids = await asyncio.to_thread(p.sites.kill_site, "site-a")
    log.info("site-a killed (pids %s)", rep.killed_pids)


async def run_pipeline_site_loss(
    p: GeoPipeline,
    events: int = 2000,
    rate: float = 500.0,
    kill_at: float = 0.4,
    seed: int = 1,
    during: Callable[[GeoPipeline], Awaitable[None]] | None = None,
) -> SiteLossReport:
    """Drive `events` (in all, at `rate`/s) into both sites' collectors, kill site A at
    `kill_at` of the load, restart it after, and judge both copies. `during` runs after
    the load while A is still down (a test's look at the runtimes then). Errors, also
    those of `during`, go into the report (`error`), never raised."""
    rep = SiteLossReport(events=events, form="pipeline", partition_s=0.0)
    a, b = p.sites.site("site-a"), p.sites.site("site-b")
    try:
        ev_a, ev_b = plan_events(events, seed)
        sent = {e["id"]: payload_digest(e) for e in ev_a + ev_b}
        span = len(ev_a) / (rate / 2)  # each producer at half the rate
        rate_b = len(ev_b) / span
        times_a: dict[int, float] = {}
        times_b: dict[int, float] = {}
        deadline = span + 600  # A's producer waits on no site: its collector logs
        t0 = time.monotonic()
        results = await asyncio.gather(
            drive(
                p.collector_url("site-a"),
                STREAM,
                ev_a,
                batch=BATCH,
                concurrency=CONCURRENCY,
                rate=rate / 2,
                deadline_s=deadline,
                on_batch=lambda i: times_a.__setitem__(i, time.monotonic()),
            ),
            drive(
                p.collector_url("site-b"),
                STREAM,
                ev_b,
                batch=BATCH,
                concurrency=CONCURRENCY,
                rate=rate_b,
                deadline_s=deadline,
                on_batch=lambda i: times_b.__setitem__(i, time.monotonic()),
            ),
            _kill_at(p, rep, t0, kill_at * span),
        )
        log.info("site-loss: load done in %.1f s", time.monotonic() - t0)
        load_a: LoadReport = results[0]
        load_b: LoadReport = results[1]
        acked = load_a.acknowledged | load_b.acknowledged
        rep.acked = len(acked)
        rep.resent = load_a.refused + load_a.errors + load_b.refused + load_b.errors
        acked_hash = {i: sent[i] for i in acked}
        killed_at = rep.killed_at
        at_a, at_b = _acked_times(ev_a, times_a), _acked_times(ev_b, times_b)
        if killed_at is not None:
            after_b = [t for t in at_b.values() if t > killed_at]
            rep.kill_to_first_ack_s = round(min(after_b) - killed_at, 3) if after_b else None
            after_a = [t for t in at_a.values() if t > killed_at]
            # A's own collector, acknowledging into its message log with A's NATS down
            rep.failover_ack_s = round(min(after_a) - killed_at, 3) if after_a else None
        if rep.acked < events:
            rep.error = f"only {rep.acked} of {events} events acknowledged"
        on_b = {i for i, _ in await read_copy(b.url, digest=payload_digest)}
        rep.missing_on_b_during_outage = sum(1 for i in acked if i not in on_b)
        if during is not None:
            await during(p)
        back = time.monotonic()
        await asyncio.to_thread(p.sites.start_site, "site-a")
        log.info("site-loss: site-a back in %.1f s", time.monotonic() - back)
        rt_a = p.runtimes["site-a"]
        try:
            await await_until(
                lambda: _drained(rt_a), CATCH_UP_S, 0.5, what="A's message log drained"
            )
            log.info("site-loss: A's log drained at %.1f s", time.monotonic() - back)
            await await_until(
                lambda: _converged(b.url, p.configs["site-b"]),
                CATCH_UP_S,
                0.5,
                what="both copies converged",
                swallow=True,
            )
        except WaitTimeout as err:  # judge what is stored anyway: a loss shows
            nc = await connect(b.url, name="site-loss-diagnose")
            try:
                rep.error = f"{err}: {await replication_lag(nc, p.configs['site-b'])}"[:800]
            finally:
                await nc.close()
        rep.catch_up_s = round(time.monotonic() - back, 3)
        rep.kicks = sum(rt.geo_watch.kicked for rt in p.runtimes.values() if rt.geo_watch)
        for site in (b, a):
            stored = await read_copy(site.url, digest=payload_digest)
            rep.checks.append(judge(site.name, acked_hash, sent, stored))
    except Exception as err:  # noqa: BLE001 - the report carries it
        log.exception("site-loss (pipeline) failed")
        rep.error = rep.error or repr(err)[:800]
    return rep


async def run_site_loss_pipeline(
    events: int = 2000,
    rate: float = 500.0,
    kill_at: float = 0.4,
    nodes: int = 3,
    seed: int = 1,
    workdir: Path | None = None,
    during: Callable[[GeoPipeline], Awaitable[None]] | None = None,
    after: Callable[[GeoPipeline, SiteLossReport], Awaitable[None]] | None = None,
) -> SiteLossReport:
    """The whole scenario: start two sites and a runtime on each, run the load, the kill
    and the verdict, then `after` (a test's further checks on the still-running pipeline;
    what it raises propagates), then stop everything."""
    work = Path(workdir or tempfile.mkdtemp(prefix="tierflow-site-loss-pipeline-"))
    async with geo_pipeline(work, nodes=nodes) as p:
        rep = await run_pipeline_site_loss(
            p, events=events, rate=rate, kill_at=kill_at, seed=seed, during=during
        )
        if after is not None:
            await after(p, rep)
    return rep


__all__ = [
    "GeoPipeline",
    "geo_pipeline",
    "plan_events",
    "run_pipeline_site_loss",
    "run_site_loss_pipeline",
    "site_config",
]
