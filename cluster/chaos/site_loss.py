"""Chaos scenario `site-loss`: a whole NATS site killed under load, with a zero-loss verdict.

Two sites (runtime/geo/sites.py), each an N-node JetStream cluster (streams R3 at N=3, so k=1
inside a site), one replicated stream (`[streams.geo.replicate] to = ["site-b"]`). Two
producers publish events with known ids: one on site A, one on site B; every 50th event
of A's producer is also sent to B by B's producer (a client that writes both sites). At
`kill_at` of the load, every server of site A is SIGKILLed. A's producer then does what a
producer pointed at the other site does: it connects to B and resends, with the same ids,
what A had not acknowledged. After the load, A is restarted on its old stores.

Verdict (`judge`): every event acknowledged on either site is in B's copy exactly once, with
the payload hash it was sent with, and again in A's copy once A has caught up; no event
stored that nobody sent. Replication is asynchronous, so events A acknowledged but had not
yet copied to B when it died reach B only when A returns: `missing_on_b_during_outage`
counts them (the recovery point, informational).

Not the Ray pipeline of cluster/chaos/runner.py: the fault and the verdict are the NATS
layer's (the collectors' publish path is a JetStream publish with a Nats-Msg-Id like this).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from cluster.chaos.proxy import Blackhole, FaultProxy
from runtime.config import Config, validate
from runtime.engines.services import ensure_streams
from runtime.geo.replication import SourceWatch, link_deny, replication_lag
from runtime.geo.sites import NatsSites
from runtime.nats.server import connect, js_publish

log = logging.getLogger(__name__)
RETRY_MAX_S = 1.0  # the longest pause between a producer's rounds of resends
SITE_LOSS = "site-loss"  # the scenario's name for `tierflow chaos run --scenario`
STREAM, SUBJECT = "geo", "raw.geo"
PUBLISH_TIMEOUT_S = 1.0
BOTH_SITES_EVERY = 50
WINDOW = 32  # publishes in flight per producer


def digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()[:16]


def payload(event_id: str, seed: int) -> bytes:
    """A deterministic event body for `event_id` (its hash is what the verdict checks)."""
    return json.dumps({"id": event_id, "seed": seed, "pad": "x" * 64}).encode()


@dataclass
class CopyCheck:
    """One copy of the stream against the acknowledged events."""

    site: str
    stored: int
    lost: list[str]
    duplicated: list[str]
    hash_mismatch: list[str]
    unknown: list[str]

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.hash_mismatch or self.unknown)


def judge(
    site: str,
    acked: Mapping[str, str],
    sent: Mapping[str, str],
    stored: Iterable[tuple[str, str]],
) -> CopyCheck:
    """A copy's (id, payload hash) pairs against `acked` (id -> hash, must be there once)
    and `sent` (every id sent: an un-acknowledged one may be there, at most once)."""
    pairs = list(stored)
    count = Counter(i for i, _ in pairs)
    return CopyCheck(
        site=site,
        stored=len(pairs),
        lost=sorted(i for i in acked if i not in count),
        duplicated=sorted(i for i, n in count.items() if n > 1),
        hash_mismatch=sorted({i for i, h in pairs if i in sent and sent[i] != h}),
        unknown=sorted({i for i, _ in pairs if i not in sent}),
    )


@dataclass
class SiteLossReport:
    events: int
    form: str = "nats"  # "nats": JetStream publishes (this module); "pipeline": HTTP
    # into each site's tierflow runtime (cluster/chaos/site_loss_pipeline.py)
    acked: int = 0
    killed_pids: list[int] = field(default_factory=list)
    kill_to_first_ack_s: float | None = None  # first ack on B of an event published after
    failover_ack_s: float | None = None  # first ack A's producer got from B after the kill
    missing_on_b_during_outage: int = 0
    resent: int = 0  # publishes not acknowledged at first, sent again with the same id
    killed_at: float | None = None  # monotonic clock
    kill_after_s: float | None = None  # the kill, in seconds after the load started
    partition_s: float = 0.0  # the link between the sites cut this long before the kill
    catch_up_s: float | None = None  # A restarted -> both copies hold every acked event
    kicks: int = 0  # copies moved off nats-server's source retry backoff (SourceWatch)
    checks: list[CopyCheck] = field(default_factory=list)
    error: str = ""

    @property
    def lost(self) -> int:
        return sum(len(c.lost) for c in self.checks)

    @property
    def duplicated(self) -> int:
        return sum(len(c.duplicated) for c in self.checks)

    @property
    def ok(self) -> bool:
        return not self.error and len(self.checks) == 2 and all(c.ok for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for c in out["checks"]:
            for k in ("lost", "duplicated", "hash_mismatch", "unknown"):
                c[k] = {"count": len(c[k]), "first": c[k][:10]}
        return {**out, "lost": self.lost, "duplicated": self.duplicated, "ok": self.ok}


def geo_config(state_dir: Path, replicas: int) -> Config:
    return validate(
        {
            "state_dir": str(state_dir),
            "streams": {
                STREAM: {
                    "subjects": [SUBJECT],
                    "replicas": replicas,
                    "replicate": {"to": ["site-b"]},
                }
            },
        }
    )


class _Producer:
    """Publishes events with ids, `WINDOW` at a time; on a failure moves to `fallback` (if
    any) and resends what was not acknowledged, with the same ids."""

    def __init__(self, name: str, urls: str, fallback: str | None, out: dict[str, Any]) -> None:
        self.name, self.urls, self.fallback = name, urls, fallback
        self.acked: dict[str, float] = {}
        self.on_fallback = False
        self.out = out
        self.nc: Any = None

    async def open(self) -> None:
        self.nc = await connect(self.urls, name=self.name, allow_reconnect=True)

    async def _one(self, event_id: str, body: bytes) -> bool:
        try:
            await js_publish(
                self.nc.jetstream(),
                SUBJECT,
                body,
                timeout=PUBLISH_TIMEOUT_S,
                headers={"Nats-Msg-Id": event_id},
            )
        except Exception:
            return False
        self.acked[event_id] = time.monotonic()
        return True

    async def _fail_over(self) -> None:
        old, self.nc = self.nc, None
        asyncio.get_running_loop().create_task(_close_quietly(old))
        self.urls, self.on_fallback = self.fallback or self.urls, True
        for _ in range(100):  # bounded: ~50 s
            try:
                self.nc = await connect(self.urls, name=f"{self.name}-fallback")
                return
            except Exception:
                await asyncio.sleep(0.5)
        raise RuntimeError(f"{self.name}: fallback site unreachable")

    async def send(self, batch: list[tuple[str, bytes]]) -> None:
        """Every event of `batch` acknowledged (by the first site or, after a failover, the
        other), or raise after bounded retries. A timeout while still connected is retried
        on the same site (a slow acknowledgement, not a lost site); the move to the other
        site is for a lost connection."""
        todo = batch
        for attempt in range(60):
            oks = await asyncio.gather(*(self._one(i, b) for i, b in todo))
            todo = [e for e, ok in zip(todo, oks, strict=True) if not ok]
            if not todo:
                return
            self.out["resent"] = self.out.get("resent", 0) + len(todo)
            if self.fallback and not self.on_fallback and not self.nc.is_connected:
                await self._fail_over()
                if "failover_at" not in self.out:
                    self.out["failover_at"] = time.monotonic()
            # a refusal can come back at once (no responders while a new stream elects its
            # leader on a loaded machine): without a pause 60 rounds passed in 2 s
            await asyncio.sleep(min(RETRY_MAX_S, 0.05 * 2**attempt))
        raise RuntimeError(f"{self.name}: {len(todo)} events never acknowledged")


async def _kill_soon(
    sites: NatsSites,
    rep: SiteLossReport,
    proxies: list[FaultProxy],
    start: float,
    after_s: float = 0.002,
) -> None:
    await asyncio.sleep(after_s)
    rep.killed_at = time.monotonic()
    rep.kill_after_s = round(rep.killed_at - start, 3)
    rep.killed_pids = await asyncio.to_thread(sites.kill_site, "site-a")
    for px in proxies:  # the link heals; A is gone, so nothing crosses until it returns
        px.clear()
    log.info("site-a killed (pids %s)", rep.killed_pids)


async def _close_quietly(nc: Any) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), 2)


async def _read_once(
    js: Any, stream: str, hasher: Callable[[bytes], str] = digest
) -> tuple[list[tuple[str, str]], int, str]:
    """One pass over the copy with a new consumer: (pairs, messages in the copy, last
    error seen). A fetch that fails other than by timing out is retried within the bound."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    total = (await js.stream_info(stream)).state.messages
    name = f"verdict-{uuid.uuid4().hex[:12]}"
    config = ConsumerConfig(
        durable_name=name,
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.ALL,
        inactive_threshold=60,
    )
    await js.add_consumer(stream, config)
    sub = await js.pull_subscribe_bind(name, stream)
    out: list[tuple[str, str]] = []
    error = ""
    for _ in range(total // 100 + 50):  # bounded
        if len(out) >= total:
            break
        try:
            msgs = await sub.fetch(1000, timeout=2)
        except Exception as err:
            error = repr(err)
            await asyncio.sleep(0.1)
            continue
        out.extend(((m.headers or {}).get("Nats-Msg-Id", ""), hasher(m.data)) for m in msgs)
    with contextlib.suppress(Exception):
        await js.delete_consumer(stream, name)
    return out, total, error


async def read_copy(
    url: str,
    stream: str = STREAM,
    attempts: int = 5,
    digest: Callable[[bytes], str] = digest,
) -> list[tuple[str, str]]:
    """Every (Nats-Msg-Id, `digest` of the payload) in `stream` on the site `url` points
    at; raises rather than return a partial read (a partial read would look like lost
    events)."""
    nc = await connect(url, name="site-loss-reader")
    try:
        js = nc.jetstream()
        got, total, error = [], 0, ""
        for _ in range(attempts):
            try:
                got, total, error = await _read_once(js, stream, digest)
            except Exception as err:  # the copy's leader not elected yet, say
                error = repr(err)
                await asyncio.sleep(0.5)
                continue
            if len(got) >= total:
                return got
            await asyncio.sleep(0.5)
        raise RuntimeError(f"read {len(got)} of {total} events of {stream} at {url}: {error}")
    finally:
        await _close_quietly(nc)


def converged(rows: list[dict[str, Any]]) -> bool:
    """Every copy answers, lags no origin, and all copies hold the same number of events
    (`rows`: runtime/geo/replication.py `replication_lag`)."""
    ok = all(r["up"] and r["lag"] == 0 and not r.get("error") for r in rows)
    return bool(rows) and ok and len({r["messages"] for r in rows}) == 1


async def run_site_loss(
    events: int = 2000,
    rate: float = 1000.0,
    kill_at: float = 0.4,
    nodes: int = 3,
    seed: int = 1,
    workdir: Path | None = None,
    partition_s: float = 0.5,
) -> SiteLossReport:
    """Two sites, `events` events at `rate`/s in all, site A killed at `kill_at` of the load
    and restarted after it; the report holds the verdict on both copies.

    With `partition_s`, the link between the sites runs through fault proxies and is cut
    (blackholed) that long before the kill: A keeps acknowledging events B cannot copy,
    so B holds a known gap while A is down, which only A's return can fill."""
    rep = SiteLossReport(events=events, partition_s=partition_s)
    work = Path(workdir or tempfile.mkdtemp(prefix="tierflow-site-loss-"))
    cfg = geo_config(work / "state", replicas=min(3, nodes))
    sites = NatsSites(work / "sites", sites=2, nodes=nodes, deny=link_deny(cfg)).plan()
    proxies: list[FaultProxy] = []
    if partition_s > 0:
        proxies = [FaultProxy(sites.host, p) for p in sites.members[0].leaf_ports]
        for px in proxies:
            await px.start()
        sites.route_leafs_via([px.address for px in proxies])
    await asyncio.to_thread(sites.start)  # off the loop: the proxies forward on it
    a, b = sites.site("site-a"), sites.site("site-b")
    shared: dict[str, Any] = {}
    try:
        admin = await connect(a.url, name="site-loss-admin")
        await ensure_streams(admin, cfg)
        await _close_quietly(admin)
        prod_a = _Producer("producer-a", a.url, b.url, shared)
        prod_b = _Producer("producer-b", b.url, None, shared)
        await prod_a.open()
        await prod_b.open()
        half = events // 2
        ids_a = [f"a-{i}" for i in range(half)]
        ids_b = [f"b-{i}" for i in range(events - half)]
        sent = {i: digest(payload(i, seed)) for i in ids_a + ids_b}
        both = [i for n, i in enumerate(ids_a) if n % BOTH_SITES_EVERY == 0]
        kill_after = int(len(ids_a) * kill_at)
        cut_after = kill_after - int(partition_s * rate / 2)  # A's producer: rate/2 per s
        killing = cutting = False
        per_batch_s = 2 * WINDOW / rate
        start = time.monotonic()
        for k in range(0, max(len(ids_a), len(ids_b)), WINDOW):
            ba = [(i, payload(i, seed)) for i in ids_a[k : k + WINDOW]]
            bb = [(i, payload(i, seed)) for i in ids_b[k : k + WINDOW]]
            bb += [(i, payload(i, seed)) for i, _ in ba if i in both]
            sends = [prod_a.send(ba), prod_b.send(bb)]
            if proxies and not cutting and k >= cut_after:
                cutting = True
                for px in proxies:
                    px.add(Blackhole(direction="both"))
            if not killing and k >= kill_after:
                killing = True  # the kill lands while this batch is in flight
                sends.append(_kill_soon(sites, rep, proxies, start))
            await asyncio.gather(*sends)
            pause = start + (k // WINDOW + 1) * per_batch_s - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
        rep.resent = shared.get("resent", 0)
        acked = {**prod_a.acked, **prod_b.acked}
        rep.acked = len(acked)
        acked_hash = {i: sent[i] for i in acked}
        killed_at = rep.killed_at
        if killed_at is not None:
            after_b = [t for t in prod_b.acked.values() if t > killed_at]
            rep.kill_to_first_ack_s = round(min(after_b) - killed_at, 3) if after_b else None
            if "failover_at" in shared:
                since = max(shared["failover_at"], killed_at)
                on_b = [t for i, t in prod_a.acked.items() if t > since]
                rep.failover_ack_s = round(min(on_b) - killed_at, 3) if on_b else None
        await _close_quietly(prod_a.nc)
        await _close_quietly(prod_b.nc)
        during = {i for i, _ in await read_copy(b.url)}
        rep.missing_on_b_during_outage = sum(1 for i in acked if i not in during)
        back = time.monotonic()
        await asyncio.to_thread(sites.start_site, "site-a")
        nc = await connect(b.url, name="site-loss-watch")
        # What each site's tierflow runtime runs (cluster/launcher.py): without it the
        # copies wait 10-120 s on nats-server's source retry backoff.
        watch = SourceWatch()
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                rows = await replication_lag(nc, cfg)
                if converged(rows):
                    break
                rep.kicks += len(await watch.tick(nc, rows, time.monotonic()))
                await asyncio.sleep(0.2)
            else:
                rep.error = f"copies not converged: {await replication_lag(nc, cfg)}"
        finally:
            await _close_quietly(nc)
        rep.catch_up_s = round(time.monotonic() - back, 3)
        for site in (b, a):
            rep.checks.append(judge(site.name, acked_hash, sent, await read_copy(site.url)))
    except Exception as err:
        log.exception("site-loss failed")
        rep.error = rep.error or repr(err)
    finally:
        await asyncio.to_thread(sites.stop)
        for px in proxies:
            await px.stop()
    return rep


def summary(rep: SiteLossReport) -> str:
    return msgspec.json.encode(rep.to_dict()).decode()


def write_report(rep: SiteLossReport, directory: str | Path = "reports") -> Path:
    """<directory>/chaos_site_loss.json (the pipeline form, scenario `site-loss`) or
    chaos_site_loss_nats.json (this module's, `site-loss-nats`): the report and verdict."""
    name = "chaos_site_loss.json" if rep.form == "pipeline" else "chaos_site_loss_nats.json"
    path = Path(directory) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rep.to_dict(), indent=2))
    return path


__all__ = [
    "SITE_LOSS",
    "CopyCheck",
    "SiteLossReport",
    "judge",
    "read_copy",
    "run_site_loss",
    "summary",
    "write_report",
]
