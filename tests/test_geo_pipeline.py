"""Geo replication through the tierflow pipeline: the `site-loss` scenario's
short form, and `tierflow status` / `/metrics` of a real running runtime on real sites.

Two sites of 3 nats-servers each, a tierflow runtime on each (collector, logger group
k=1, bridge, gateway, admin endpoint) on one local Ray, HTTP load into both collectors,
every node of site A SIGKILLed at 40% of the load and restarted after it
(cluster/chaos/site_loss_pipeline.py). While A is down, B's runtime reports A's copy down;
once the copies converged, A's runtime reports both copies up with lag 0, then, site B
killed, B's copy down while A's still answers. The long form (20,000 events) is in
tests/test_geo_chaos.py (`make chaos`).
"""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from cluster.chaos.site_loss import STREAM, SiteLossReport
from cluster.chaos.site_loss_pipeline import GeoPipeline, plan_events, run_site_loss_pipeline
from cluster.cli.common import fetch_status
from cluster.cli.status import status_tables
from runtime.waiting import await_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

EVENTS, RATE = 1000, 500.0
GAUGE = re.compile(r"^(tierflow_replication_\w+)\{([^}]*)\} (\S+)$", re.M)


def _status(p: GeoPipeline, site: str) -> dict[str, Any]:
    """The admin /status snapshot, fetched as `tierflow status` fetches it."""
    return fetch_status(p.configs[site], {"admin": {"url": p.admin_url(site)}})


def _gauges(p: GeoPipeline, site: str) -> dict[tuple[str, str], float]:
    """(metric, labels) -> value of the replication gauges on the runtime's /metrics."""
    with urllib.request.urlopen(p.admin_url(site) + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(m, labels): float(v) for m, labels, v in GAUGE.findall(text)}


def _up(site: str) -> tuple[str, str]:
    return ("tierflow_replication_copy_up", f'site="{site}",stream="{STREAM}"')


def _lag(site: str, origin: str) -> tuple[str, str]:
    labels = f'origin="{origin}",site="{site}",stream="{STREAM}"'
    return ("tierflow_replication_lag_events", labels)


async def _a_is_down_seen_from_b(p: GeoPipeline) -> None:
    """Site A is down: B's runtime says so, and its own copy answers."""

    async def a_down() -> bool:
        g = await asyncio.to_thread(_gauges, p, "site-b")
        return g.get(_up("site-a")) == 0.0 and g.get(_up("site-b")) == 1.0

    await await_until(a_down, 30, 0.5, "B's /metrics: A's copy down, B's up")
    rows = (await asyncio.to_thread(_status, p, "site-b"))["replication"]
    up = {r["site"]: r["up"] for r in rows}
    assert up == {"site-a": False, "site-b": True}, rows


async def _status_on_live_sites(p: GeoPipeline, rep: SiteLossReport) -> None:
    """A's runtime: both copies up with lag 0 and every event; then site B killed: B's copy
    down, A's still answering with every event."""
    snap = await asyncio.to_thread(_status, p, "site-a")
    rows = snap["replication"]
    assert {(r["stream"], r["site"], r["from"]) for r in rows} == {
        (STREAM, "site-a", "site-b"),
        (STREAM, "site-b", "site-a"),
    }, rows
    assert all(r["up"] and r["lag"] == 0 and r["messages"] == rep.acked for r in rows), rows
    # the runtime watches its site's copies (runtime/geo/replication.py SourceWatch) and counts the
    # leader changes it asked for (0 when nats-server's own retry came first)
    assert isinstance(snap.get("replication_kicks"), int), snap.get("replication_kicks")
    geo = [t for t in status_tables(snap, wide=True, width=200) if t.title == "geo"]
    assert len(geo) == 1 and geo[0].row_count == 2
    g = await asyncio.to_thread(_gauges, p, "site-a")
    assert g[_up("site-a")] == g[_up("site-b")] == 1.0
    assert g[_lag("site-a", "site-b")] == g[_lag("site-b", "site-a")] == 0.0

    killed = await asyncio.to_thread(p.sites.kill_site, "site-b")
    assert len(killed) == 3

    async def b_down() -> bool:
        g = await asyncio.to_thread(_gauges, p, "site-a")
        return g.get(_up("site-b")) == 0.0 and g.get(_up("site-a")) == 1.0

    await await_until(b_down, 30, 0.5, "A's /metrics: B's copy down, A's up")
    rows = (await asyncio.to_thread(_status, p, "site-a"))["replication"]
    by_site = {r["site"]: r for r in rows}
    assert not by_site["site-b"]["up"]
    assert by_site["site-a"]["up"] and by_site["site-a"]["messages"] == rep.acked


@pytest.mark.unit
def test_site_loss_scenarios_run_with_all_and_report_per_copy() -> None:
    from cluster.chaos import report, scenarios
    from cluster.chaos.site_loss import judge

    names = [s.name for s in scenarios.resolve("all")]
    assert "site-loss" in names and "site-loss-nats" in names
    assert "SIGKILL" in scenarios.schedule_text(scenarios.get("site-loss"), 1)
    assert plan_events(200, 1)[1][:3] == [  # B's producer also sends A's 1st, 51st, ...
        {"id": "b-0", "site": "b", "n": 0, "seed": 1, "pad": "x" * 64},
        {"id": "a-0", "site": "a", "n": 0, "seed": 1, "pad": "x" * 64},
        {"id": "b-1", "site": "b", "n": 1, "seed": 1, "pad": "x" * 64},
    ]
    rep = SiteLossReport(events=3, form="pipeline", acked=3, killed_pids=[1, 2, 3])
    rep.killed_at, rep.kill_after_s, rep.kill_to_first_ack_s = 5.0, 1.2, 0.1
    acked = {"a-0": "h0", "b-0": "h1", "b-1": "h2"}
    whole = [("a-0", "h0"), ("b-0", "h1"), ("b-1", "h2")]
    rep.checks = [
        judge("site-b", acked, acked, whole),
        judge("site-a", acked, acked, [("a-0", "h0"), ("b-0", "h1"), ("b-0", "h1")]),
    ]
    row = report.from_site_loss("site-loss", 1, 500.0, rep, 40.0)
    assert row.lost == ["site-a/b-1"] and row.duplicated == {"site-a/b-0": 2}
    assert row.faults[0].label == "kill site-a x3" and row.faults[0].recovered_s == 0.1
    assert not row.ok and row.site is not None and row.site["lost"] == 1
    rep.checks[1] = judge("site-a", acked, acked, whole)
    assert report.from_site_loss("site-loss", 1, 500.0, rep, 40.0).ok


async def test_site_loss_through_the_pipeline_and_geo_status(tmp_path: Path) -> None:
    rep = await run_site_loss_pipeline(
        events=EVENTS,
        rate=RATE,
        workdir=tmp_path,
        during=_a_is_down_seen_from_b,
        after=_status_on_live_sites,
    )
    assert rep.error == "", rep.error
    assert rep.form == "pipeline" and len(rep.killed_pids) == 3
    assert rep.acked == EVENTS  # the 1 in 50 sent to both sites counted once
    # A's collector acknowledged with A's NATS down (persisted in its message log)...
    assert rep.failover_ack_s is not None
    # ...so B lacked those events while A was away, and has them only because A returned
    assert rep.missing_on_b_during_outage > 0
    assert rep.kill_to_first_ack_s is not None  # B's producer kept being acknowledged
    assert [c.site for c in rep.checks] == ["site-b", "site-a"]
    for c in rep.checks:
        assert c.ok, (c.site, c.lost[:5], c.duplicated[:5], c.hash_mismatch[:5], c.unknown[:5])
        assert c.stored == EVENTS
    assert rep.ok
