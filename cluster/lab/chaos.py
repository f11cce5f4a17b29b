"""One lab fault under load, judged: the pipeline on a `LabCluster`, a known-id load from
the laptop to every collector, the nemesis's fault at its time, then the verdict (every
acknowledged event stored exactly once, cluster/verify.py) and what the fault cost the
writers (`nemesis.recovery`)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from cluster.chaos.report import DeliveryCheck
from cluster.chaos.runner import Subscriber, answers_off, mismatch_detail, read_results
from cluster.demo.meetup import Recount
from cluster.demo.rsvps import RsvpGenerator
from cluster.lab.cluster import LabCluster
from cluster.lab.nemesis import (
    BRIDGE_PARTITION,
    HOST_CRASH,
    HOST_PAUSE,
    LabFault,
    Marks,
    Recovery,
    apply,
    recovery,
    resolve,
)
from cluster.loadgen import drive
from cluster.verify import StreamTally, Verdict, judge
from runtime.nats.server import connect
from runtime.roles import ANALYSIS_DRIVER
from runtime.waiting import WaitTimeout, await_until

__all__ = ["LabRun", "StreamBook", "holders", "logger_primary", "run_fault"]


class StreamBook:
    """What the lab's stream holds, carried from run to run: the ids (how often each is
    stored) and, for RSVPs, the exact recount of the analysis's answers. Each run reads only
    what the stream gained since, so a suite of many runs on one stream costs one read of
    it, not one per run."""

    def __init__(self, stream: str, rsvps: bool = True) -> None:
        self.recount = Recount() if rsvps else None
        self.tally = StreamTally(stream, on_new=self._add if rsvps else None)

    def _add(self, eid: str, data: bytes) -> None:
        assert self.recount is not None
        self.recount.add(_json(data))

    async def read(self, nats_url: str, timeout: float = 300.0) -> dict[str, int]:
        """Every id the stream holds so far and how often (a snapshot)."""
        nc = await connect(nats_url)
        try:
            return dict(await self.tally.read(nc, timeout=timeout))
        finally:
            await nc.close()


@dataclass
class LabRun:
    fault: LabFault
    hosts: tuple[str, ...]
    events: int
    acknowledged: int
    verdict: Verdict
    recovery: Recovery
    marks: Marks
    elapsed_s: float
    errors: int
    refused: int
    delivery: DeliveryCheck | None = None  # the gateway client's, when it had gateways
    diagnosis: dict[str, Any] = field(default_factory=dict)  # the gateways', when it failed
    analysis: list[str] | None = None  # queries off the exact recount; None: not checked
    whole_after_s: float | None = None  # the wait for whole logger groups before the fault

    @property
    def ok(self) -> bool:
        delivered = self.delivery is None or self.delivery.ok
        exact = not self.analysis
        return self.verdict.ok and self.acknowledged == self.events and delivered and exact

    def row(self) -> dict[str, Any]:
        r = self.recovery
        return {
            "fault": self.fault.kind,
            "hosts": "+".join(self.hosts),
            "events": self.events,
            "acknowledged": self.acknowledged,
            "lost": len(self.verdict.lost),
            "duplicated": len(self.verdict.duplicated),
            "to_next_ack_s": None if r.to_next_ack_s is None else round(r.to_next_ack_s, 2),
            "to_full_rate_s": None if r.to_full_rate_s is None else round(r.to_full_rate_s, 2),
            "errors": self.errors,
            "refused_503": self.refused,
            "elapsed_s": round(self.elapsed_s, 1),
            "loggers_whole_after_s": self.whole_after_s,
            "client": None if self.delivery is None else _delivered(self.delivery),
            "analysis": None if self.analysis is None else (", ".join(self.analysis) or "exact"),
            **({"diagnosis": self.diagnosis} if self.diagnosis else {}),
        }


def _delivered(d: DeliveryCheck) -> str:
    return (
        f"{d.received}/{d.expected}, missing {len(d.missing)}, duplicated {len(d.duplicated)}, "
        f"reconnects {d.reconnects}"
    )


def holders(lc: LabCluster, stream: str) -> dict[str, str]:
    """Which host holds what now: the stream's NATS leader, the Ray head, the Spark
    driver, collector-0, the primary of logger group 0."""
    out: dict[str, str] = {}
    assert lc.ray is not None
    out["ray-head"] = lc.ray.head_host
    by_address = {lc.lab.address(h): h for h in lc.lab.hosts()}
    primary = f"logger-0-{logger_primary(lc)}"
    for name, address in lc.hosts_of([ANALYSIS_DRIVER, "collector-0", primary]).items():
        if address in by_address:  # the ones alive now
            role = {ANALYSIS_DRIVER: "spark-driver", primary: "logger-primary"}.get(name, name)
            out[role] = by_address[address]

    async def leader() -> str | None:
        """The stream's leader, asked again while the cluster is too busy to answer in
        time (under load one request may time out), for up to 30 s."""
        nc = await connect(lc.nats_url)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    info = await nc.jetstream(timeout=5).stream_info(stream)
                    lead = info.cluster.leader if info.cluster else None
                    return str(lead) if lead else None
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
        finally:
            await nc.close()

    found = asyncio.run(leader())
    if found in lc.lab.hosts():
        out["nats-leader"] = found
    return out


async def recount(lc: LabCluster, book: StreamBook) -> list[str]:
    """The analysis's answers against an exact recount of every event the stream holds,
    once the driver has committed all of it; the queries that differ (none: exact)."""
    code = f"""
    d = ray.get_actor({ANALYSIS_DRIVER!r})
    out = ray.get(d.await_idle.remote(300), timeout=330)
    """
    idle = await asyncio.to_thread(lc.ask_ray, code, 400.0)
    if not idle.get("idle"):
        return [f"driver not idle: {idle}"]
    await book.read(lc.nats_url)
    assert book.recount is not None
    want = book.recount.answers()

    async def exact() -> bool:
        return not answers_off(await read_results(lc.nats_url), want)

    # idle means every query read the stream's end; a query the driver restarted after the
    # fault may still be writing its last windows: answers count once they stop changing
    # toward the recount, within a deadline
    try:
        await await_until(exact, timeout=180, interval=5.0, what="exact answers")
        return []
    except WaitTimeout:
        got = await read_results(lc.nats_url)
        return [mismatch_detail(got, want, q) for q in answers_off(got, want)]


def _json(body: str | bytes) -> dict[str, Any]:
    value = json.loads(body)
    return value if isinstance(value, dict) else {}


def _gateway_feeds(lc: LabCluster, n: int) -> dict[str, Any]:
    """Each gateway's connections and its feeds' counters (where a client stalls)."""
    code = f"""
    out = {{}}
    for i in range({n}):
        try:
            st = ray.get(ray.get_actor(f"gateway-{{i}}").stats.remote(), timeout=10)
            out[f"gateway-{{i}}"] = {{"open": st["open"], "feeds": st["feeds"]}}
        except Exception as err:
            out[f"gateway-{{i}}"] = repr(err)[:300]
    """
    try:
        return dict(lc.ask_ray(code))
    except Exception as err:  # noqa: BLE001 - a diagnosis must not hide the verdict
        return {"error": repr(err)[:300]}


def logger_primary(lc: LabCluster, group: str = "logger-0") -> int:
    """The index of `group`'s primary, as its replicas report it (the newest epoch's)."""
    code = f"""
    answers = []
    for i in range(8):
        try:
            h = ray.get_actor("{group}-" + str(i))
        except ValueError:
            break
        try:
            answers.append(ray.get(h.status.remote(), timeout=10))
        except Exception:
            pass
    best = max(answers, key=lambda a: a["epoch"]) if answers else {{"primary": 0}}
    out = best["primary"]
    """
    return int(lc.ask_ray(code))


def loggers_whole(lc: LabCluster, timeout: float = 180.0) -> dict[str, Any]:
    """Wait until every logger group is whole (each replica answers, in the set, caught
    up, on one epoch): a fault then starts from a healthy cluster, and the wait says how
    long the last one's repair took. Returns {"whole", "waited_s", "groups"}."""
    code = f"""
    import time
    t0 = time.time()
    deadline = t0 + {timeout}

    def status(name):
        try:
            return ray.get(ray.get_actor(name).status.remote(), timeout=5)
        except ValueError:
            return None
        except Exception as err:
            return {{"error": repr(err)[:200]}}

    while True:
        groups = {{}}
        for g in range(16):
            replicas = []
            for i in range(8):
                st = status(f"logger-{{g}}-{{i}}")
                if st is None:
                    break
                replicas.append(st)
            if not replicas:
                break
            groups[f"logger-{{g}}"] = [
                {{k: st.get(k) for k in ("epoch", "primary", "in_sync", "catching_up", "error")}}
                for st in replicas
            ]
        whole = bool(groups) and all(
            not st.get("error") and not st.get("catching_up")
            and st.get("in_sync") in (None, list(range(len(reps))))
            and st.get("epoch") == reps[0].get("epoch")
            for reps in groups.values() for st in reps
        )
        if whole or time.time() > deadline:
            break
        time.sleep(1)
    out = {{"whole": whole, "waited_s": round(time.time() - t0, 1), "groups": groups}}
    """
    return dict(lc.ask_ray(code, timeout=timeout + 120))


def run_fault(
    lc: LabCluster,
    fault: LabFault,
    urls: list[str],
    stream: str,
    *,
    events: int,
    rate: float,
    prefix: str,
    gateways: list[str] | None = None,
    rsvps: RsvpGenerator | None = None,
    book: StreamBook | None = None,
) -> LabRun:
    """`events` known-id events at `rate` to `urls`, `fault` at its fraction of the window
    (a role resolved to its host as the load starts; a crash or pause never hits the Ray head, which
    the lab does not restart), then the verdict once the stream holds every acknowledged
    event (or a deadline passes: the verdict says what is missing). With `gateways`, a
    client on the laptop subscribes through them (a third of the run's events, by a filter)
    and must get each stored one exactly once, across the fault. With `rsvps` (one
    generator for every run on the pipeline, so event times only move forward), the events
    are Meetup RSVPs and the analysis's answers must equal an exact recount of every RSVP
    the stream holds. `book` carries what the stream holds from run to run (one per stream
    for the suite; without it, this run reads the stream from its start)."""
    book = book or StreamBook(stream, rsvps is not None)
    window = events / rate
    acks: list[float] = []
    body = [
        {
            **(rsvps.next() if rsvps is not None else {"response": "yes"}),
            "id": f"{prefix}-{i}",
            "n": i,
            "k": "abc"[i % 3],
            "run": prefix,
        }
        for i in range(events)
    ]
    sub = Subscriber()
    batch = 50
    whole: dict[str, Any] = {}  # the logger groups before the fault (`loggers_whole`)

    async def run() -> tuple[
        Any, Marks, tuple[str, ...], Any, DeliveryCheck | None, list[str] | None
    ]:
        def acked(idx: int) -> None:
            now = time.monotonic()
            acks.extend([now] * min(batch, events - idx * batch))

        whole.update(await asyncio.to_thread(loggers_whole, lc))
        if gateways:  # a client on the laptop reading through the hosts' gateways
            await sub.start(gateways, stream, f"WHERE run = '{prefix}' AND k = 'a'")
        # who holds each role, asked before the load (Ray's answers take seconds, which
        # would push the fault past the window of a short run)
        hosts = resolve(fault, await asyncio.to_thread(holders, lc, stream))
        load = asyncio.create_task(
            drive(
                urls,
                stream,
                body,
                batch=batch,
                concurrency=8,
                rate=rate,
                deadline_s=window + 600,
                request_timeout_s=5.0,
                on_batch=acked,
            )
        )
        await asyncio.sleep(fault.at * window)
        if fault.kind in (HOST_CRASH, HOST_PAUSE) and lc.ray and lc.ray.head_host in hosts:
            others = [h for h in lc.lab.hosts() if h != lc.ray.head_host]
            hosts = (others[0],)
        if fault.kind == BRIDGE_PARTITION:
            hosts = hosts[:1]  # that host alone on one side, the rest on the other
        marks = await apply(lc.lab, fault, hosts, restart=lc.restart_host)
        report = await load
        got = await stored_all(report.acknowledged)
        delivery = None
        if gateways:  # on this loop still: the client has read all along
            want = {
                i for i in got if i.startswith(f"{prefix}-") and int(i.rsplit("-", 1)[1]) % 3 == 0
            }
            try:
                delivery = await sub.caught_up(want, 180)
            finally:
                await sub.stop()
        analysis = await recount(lc, book) if rsvps is not None else None
        return report, marks, hosts, got, delivery, analysis

    async def stored() -> Any:
        """This run's ids as the stream holds them (the book reads on from the last run)."""
        mine = f"{prefix}-"
        ids = await book.read(lc.nats_url)
        return Counter({i: n for i, n in ids.items() if i.startswith(mine)})

    async def stored_all(acknowledged: Any) -> Any:
        """The stream's ids once it holds every acknowledged one, or after 300 s as they
        are (the verdict says what is missing)."""

        async def settled() -> Any:
            got = await stored()
            return got if all(got[i] for i in acknowledged) else None

        try:
            return await await_until(settled, timeout=300, interval=2.0, what="stored")
        except WaitTimeout:
            return await stored()

    report, marks, hosts, got, delivery, analysis = asyncio.run(run())
    diagnosis: dict[str, Any] = {}
    if delivery is not None and not delivery.ok:  # what the gateways' feeds say
        diagnosis = _gateway_feeds(lc, len(gateways or ()))
        diagnosis["client"] = {"error": sub.error, "last": sub.client.stats.last_error}
    if not whole.get("whole"):
        diagnosis["loggers_before"] = whole.get("groups")
    return LabRun(
        fault=fault,
        hosts=hosts,
        events=events,
        acknowledged=len(report.acknowledged),
        verdict=judge(report.acknowledged, got),
        recovery=recovery(acks, marks),
        marks=marks,
        elapsed_s=report.elapsed_s,
        errors=report.errors,
        refused=report.refused,
        delivery=delivery,
        diagnosis=diagnosis,
        analysis=analysis,
        whole_after_s=whole.get("waited_s"),
    )
