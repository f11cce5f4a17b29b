"""Geo replication: sites joined by leaf nodes, `[streams.X.replicate]` copies,
dedup across sites, replication lag, and the short form of the `site-loss` scenario.

Real nats-servers (two sites of three nodes each); no Ray or Spark.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats.js.errors
import pytest

from cluster.chaos.site_loss import judge, read_copy, run_site_loss
from runtime.config import ConfigError, validate
from runtime.engines.services import ensure_streams
from runtime.geo.config import ReplicateConfig
from runtime.geo.replication import (
    SourceWatch,
    copy_config,
    kick_copy,
    kick_due,
    lag_rows,
    link_deny,
    origin_subject,
    replication_lag,
    stalled_copies,
    stream_copy_info,
)
from runtime.geo.sites import NatsSites, leaf_block, site_names
from runtime.nats.server import connect, nats_server_binary
from runtime.waiting import await_until

pytestmark = pytest.mark.timeout(180)

STREAM, SUBJECT = "orders", "raw.orders"


def _cfg(tmp: Path, to: list[str] | None = None, replicas: int = 3) -> Any:
    body: dict[str, Any] = {"subjects": [SUBJECT], "replicas": replicas}
    if to is not None:
        body["replicate"] = {"to": to}
    return validate({"state_dir": str(tmp), "streams": {STREAM: body}})


# --------------------------------------------------------------------------- pure


@pytest.mark.unit
def test_replicate_config_parses_and_rejects_bad_groups(tmp_path: Path) -> None:
    rep = _cfg(tmp_path, ["site-b"]).streams[STREAM].replicate
    assert rep == ReplicateConfig(to=["site-b"], site="site-a")
    assert rep.sites == ["site-a", "site-b"]
    for bad in ([], ["site-a"], ["site-b", "site-b"], ["no.dots"]):
        with pytest.raises(ConfigError):
            _cfg(tmp_path, bad)
    assert _cfg(tmp_path).streams[STREAM].replicate is None


@pytest.mark.unit
def test_each_copy_sources_the_others_local_writes_under_their_origin() -> None:
    from nats.js.api import StreamConfig

    rep = ReplicateConfig(to=["site-b", "site-c"])
    base = StreamConfig(name=STREAM, subjects=[SUBJECT, "raw.more.>"])
    b = copy_config(base, "site-b", rep)
    assert b.subjects == base.subjects and base.sources is None
    assert [s.external.api for s in b.sources] == ["$JS.site-a.API", "$JS.site-c.API"]
    tr = b.sources[0].subject_transforms
    assert [(t.src, t.dest) for t in tr] == [
        (SUBJECT, "geo.site-a.raw.orders"),
        ("raw.more.>", "geo.site-a.raw.more.>"),
    ]
    assert origin_subject("site-c", SUBJECT) == "geo.site-c.raw.orders"


@pytest.mark.unit
def test_site_names_leaf_block_and_link_deny(tmp_path: Path) -> None:
    assert site_names(3) == ["site-a", "site-b", "site-c"]
    hub = "\n".join(leaf_block("127.0.0.1:7422", []))
    assert "remotes" not in hub and "127.0.0.1:7422" in hub
    leaf = "\n".join(leaf_block("127.0.0.1:7423", ["127.0.0.1:7422"], ["raw.x"]))
    assert '"nats-leaf://127.0.0.1:7422"' in leaf
    assert 'deny_imports: ["raw.x"]' in leaf and 'deny_exports: ["raw.x"]' in leaf
    deny = link_deny(_cfg(tmp_path, ["site-b"]))
    assert SUBJECT in deny and "raw.meetup" not in deny  # every configured stream's subjects


@pytest.mark.unit
def test_lag_rows_name_the_origin_of_each_source() -> None:
    info = {
        "state": {"messages": 7},
        "sources": [{"name": STREAM, "external": {"api": "$JS.site-a.API"}, "lag": 3,
                     "active": 1_500_000_000}],
    }  # fmt: skip
    assert lag_rows(STREAM, "site-b", info) == [
        {"stream": STREAM, "site": "site-b", "from": "site-a", "lag": 3, "active_s": 1.5,
         "error": None, "up": True, "messages": 7, "replicas": 1}
    ]  # fmt: skip
    assert lag_rows(STREAM, "site-a", None)[0]["up"] is False


@pytest.mark.unit
def test_judge_counts_lost_duplicated_changed_and_unknown() -> None:
    acked = {"a": "h1", "b": "h2", "c": "h3"}
    sent = {**acked, "d": "h4"}
    ok = judge("site-b", acked, sent, [("a", "h1"), ("b", "h2"), ("c", "h3"), ("d", "h4")])
    assert ok.ok and ok.stored == 4
    bad = judge("site-b", acked, sent, [("a", "h1"), ("a", "h1"), ("b", "hX"), ("z", "h9")])
    assert (bad.lost, bad.duplicated, bad.hash_mismatch, bad.unknown) == (
        ["c"],
        ["a"],
        ["b"],
        ["z"],
    )
    assert not bad.ok


# --------------------------------------------------------------------------- two real sites


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsSites]:
    cfg = _cfg(tmp_path_factory.mktemp("geo-cfg"), ["site-b"])
    with NatsSites(tmp_path_factory.mktemp("sites"), sites=2, nodes=3, deny=link_deny(cfg)) as s:
        yield s


async def _subjects(url: str, site: str) -> dict[str, int]:
    nc = await connect(url)
    try:
        info = await nc.jetstream().stream_info(STREAM, subjects_filter=">")
        return dict(info.state.subjects or {})
    finally:
        await nc.close()


async def test_sites_are_separate_domains_joined_by_leaf_links(sites: NatsSites) -> None:
    a, b = sites.site("site-a"), sites.site("site-b")
    assert len(a.servers) == len(b.servers) == 3 and sites.leafs_up()
    nc = await connect(b.url)
    try:
        assert (await nc.jetstream().account_info()).domain == "site-b"
        # site A's JetStream answers across the leaf link, under its domain's prefix
        assert (await nc.jetstream(domain="site-a").account_info()).domain == "site-a"
    finally:
        await nc.close()
    for server in a.servers + b.servers:  # the strict check: warnings fail it too
        check = subprocess.run(
            [nats_server_binary(), "-t", "-c", str(server.config_path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert check.returncode == 0, check.stdout + check.stderr
    state = msgspec.json.decode(sites.write_state().read_bytes())
    assert [s["name"] for s in state["sites"]] == ["site-a", "site-b"]
    assert all(len(s["pids"]) == 3 for s in state["sites"])


async def _publish_retrying_in_process(js: Any, data: bytes, msg_id: str) -> Any:
    """Publish, retrying while the server says the same id is being stored (err 10158)."""
    for _ in range(50):
        try:
            return await js.publish(SUBJECT, data, headers={"Nats-Msg-Id": msg_id})
        except nats.js.errors.APIError as err:
            if err.err_code != 10158:
                raise
            await asyncio.sleep(0.05)
    raise AssertionError(f"{msg_id} still in process after 50 tries")


async def test_replicated_stream_is_copied_both_ways_and_dedups_across_sites(
    sites: NatsSites, tmp_path: Path
) -> None:
    a, b = sites.site("site-a"), sites.site("site-b")
    cfg = _cfg(tmp_path, ["site-b"])
    nca, ncb = await connect(a.url), await connect(b.url)
    try:
        await ensure_streams(nca, cfg)  # one call, from site A, makes both copies
        info_b = await stream_copy_info(nca, "site-b", STREAM)
        assert info_b is not None and info_b["config"]["sources"][0]["external"]["api"] == (
            "$JS.site-a.API"
        )
        await ensure_streams(nca, cfg)  # idempotent: an update keeps the sources
        jsa, jsb = nca.jetstream(), ncb.jetstream()
        for i in range(40):
            await jsa.publish(SUBJECT, b"A%d" % i, headers={"Nats-Msg-Id": f"a-{i}"})
        for i in range(30):
            await jsb.publish(SUBJECT, b"B%d" % i, headers={"Nats-Msg-Id": f"b-{i}"})
        # the same id published on both sites: a producer's retry after a failover. A's
        # write may already be arriving on B through the source: B then answers 10158 ("in
        # process", retried) or a duplicate ack, and stores it once either way
        local_on_b = True
        for js in (jsa, jsb):
            ack = await _publish_retrying_in_process(js, b"same", "both-1")
            if js is jsa:
                assert not ack.duplicate
            else:
                local_on_b = not ack.duplicate

        async def converged() -> bool:
            sa, sb = await _subjects(a.url, "a"), await _subjects(b.url, "b")
            return sum(sa.values()) == sum(sb.values()) == 71

        await await_until(converged, 20, 0.1, "both copies hold all 71 events")
        # ...and each copy holds it once: the sourced copy was dropped as a duplicate
        on_b = 1 if local_on_b else 0  # where B holds both-1: its own write or A's copy
        assert await _subjects(a.url, "a") == {SUBJECT: 41, "geo.site-b.raw.orders": 30}
        assert await _subjects(b.url, "b") == {
            SUBJECT: 30 + on_b,
            "geo.site-a.raw.orders": 41 - on_b,
        }
        for site in (a, b):
            ids = Counter(i for i, _ in await read_copy(site.url, STREAM))
            assert ids["both-1"] == 1 and len(ids) == 71 and set(ids.values()) == {1}
        rows = await replication_lag(nca, cfg)
        assert {(r["site"], r["from"]) for r in rows} == {
            ("site-a", "site-b"),
            ("site-b", "site-a"),
        }
        assert all(r["up"] and r["lag"] == 0 and r["messages"] == 71 for r in rows)
    finally:
        await nca.close()
        await ncb.close()


async def test_a_publish_on_one_site_is_not_captured_directly_by_the_other(
    sites: NatsSites, tmp_path: Path
) -> None:
    """The leaf links deny the streams' subjects: B's copy gets A's events only by sourcing
    (under geo.site-a.*), never as its own publishes (which would store them twice)."""
    a = sites.site("site-a")
    nca = await connect(a.url)
    try:
        await ensure_streams(nca, _cfg(tmp_path, ["site-b"]))
        before = await _subjects(sites.site("site-b").url, "b")
        await nca.jetstream().publish(SUBJECT, b"x", headers={"Nats-Msg-Id": "only-a"})

        async def sourced() -> bool:
            now = await _subjects(sites.site("site-b").url, "b")
            return now.get("geo.site-a.raw.orders", 0) > before.get("geo.site-a.raw.orders", 0)

        await await_until(sourced, 10, 0.1, "B sourced A's event")
        assert (await _subjects(sites.site("site-b").url, "b")).get(SUBJECT) == before.get(SUBJECT)
    finally:
        await nca.close()


async def test_a_kicked_copy_changes_leader_and_sources_each_event_once(
    sites: NatsSites, tmp_path: Path
) -> None:
    """What `SourceWatch` asks of a stalled copy, done to a live one: its leader steps down,
    a new one takes over, and the events its origin takes before, during and after the
    change are each sourced once (the new leader resumes from the copy's own position)."""
    a, b = sites.site("site-a"), sites.site("site-b")
    nca = await connect(a.url)
    try:
        await ensure_streams(nca, _cfg(tmp_path, ["site-b"]))
        info = await stream_copy_info(nca, "site-b", STREAM)
        assert info is not None
        leader = info["cluster"]["leader"]
        js = nca.jetstream()
        ids = [f"kick-{i}" for i in range(60)]
        for i in ids[:20]:
            await js.publish(SUBJECT, i.encode(), headers={"Nats-Msg-Id": i})
        assert await kick_copy(nca, "site-b", STREAM) is None
        for i in ids[20:40]:  # while B's copy elects its new leader
            await js.publish(SUBJECT, i.encode(), headers={"Nats-Msg-Id": i})

        async def moved() -> bool:
            now = await stream_copy_info(nca, "site-b", STREAM)
            return bool(now) and now["cluster"].get("leader") not in (None, leader)

        await await_until(moved, 30, 0.1, "a new leader for B's copy")
        for i in ids[40:]:
            await js.publish(SUBJECT, i.encode(), headers={"Nats-Msg-Id": i})

        async def sourced() -> Counter[str]:
            got = Counter(i for i, _ in await read_copy(b.url, STREAM))
            return got if all(got[i] for i in ids) else Counter()

        got = await await_until(sourced, 30, 0.2, "B sourced all 60", swallow=True)
        assert [got[i] for i in ids] == [1] * 60 and set(got.values()) == {1}
    finally:
        await nca.close()


def _row(site: str, origin: str, active_s: float | None, up: bool = True) -> dict[str, Any]:
    return {"stream": STREAM, "site": site, "from": origin, "lag": 0, "active_s": active_s,
            "error": None, "up": up, "messages": 1, "replicas": 3}  # fmt: skip


@pytest.mark.unit
def test_a_copy_is_stalled_when_its_source_is_silent_and_the_origin_answers() -> None:
    a_up = _row("site-a", "site-b", 0.4)
    a_down = {"stream": STREAM, "site": "site-a", "from": "-", "lag": None, "up": False}
    # silent 12 s while A answers: waiting on nats-server's retry backoff
    assert stalled_copies([a_up, _row("site-b", "site-a", 12.0)]) == [(STREAM, "site-b")]
    # never heard from its origin (nats-server's -1 is None in the rows)
    assert stalled_copies([a_up, _row("site-b", "site-a", None)]) == [(STREAM, "site-b")]
    assert lag_rows(STREAM, "site-b", {"sources": [{"active": -1}]})[0]["active_s"] is None
    # heard within the last heartbeats: fine
    assert stalled_copies([a_up, _row("site-b", "site-a", 0.8)]) == []
    assert stalled_copies([a_up, _row("site-b", "site-a", 4.9)]) == []
    # the origin is down: nothing to kick the copy towards
    assert stalled_copies([a_down, _row("site-b", "site-a", 30.0)]) == []
    # both stalled: each copy named once
    rows = [_row("site-a", "site-b", 9.0), _row("site-b", "site-a", 9.0)]
    assert stalled_copies(rows) == [(STREAM, "site-a"), (STREAM, "site-b")]
    assert stalled_copies(rows, stall_s=10.0) == []
    # an R1 copy has no raft group: nats-server says yes to a leader change and does nothing
    assert stalled_copies([a_up, {**_row("site-b", "site-a", 12.0), "replicas": 1}]) == []


@pytest.mark.unit
def test_kicks_back_off_while_a_copy_stays_stalled() -> None:
    assert kick_due(0, None, 100.0)
    assert not kick_due(1, 100.0, 114.9) and kick_due(1, 100.0, 115.0)
    assert not kick_due(2, 100.0, 129.9) and kick_due(2, 100.0, 130.0)
    assert not kick_due(3, 100.0, 159.9) and kick_due(3, 100.0, 160.0)
    assert not kick_due(20, 100.0, 399.9) and kick_due(20, 100.0, 400.0)  # at most 5 min


class _Nc:
    """A NATS connection that records requests and answers STEPDOWN like nats-server."""

    def __init__(self, errors: dict[str, str] | None = None) -> None:
        self.subjects: list[str] = []
        self.errors = errors or {}

    async def request(self, subject: str, payload: bytes, timeout: float) -> Any:
        self.subjects.append(subject)
        site = subject.split(".")[1]
        body: dict[str, Any] = {"success": True}
        if site in self.errors:
            body = {"error": {"code": 400, "description": self.errors[site]}}
        return type("Msg", (), {"data": msgspec.json.encode(body)})()


@pytest.mark.unit
async def test_the_source_watch_kicks_its_sites_stalled_copies_on_schedule() -> None:
    down = "$JS.site-b.API.STREAM.LEADER.STEPDOWN." + STREAM
    stalled = [_row("site-a", "site-b", 0.3), _row("site-b", "site-a", 20.0)]
    nc = _Nc()
    watch = SourceWatch(sites=frozenset({"site-b"}))
    assert await watch.tick(nc, stalled, 0.0) == [f"site-b/{STREAM}"]
    assert nc.subjects == [down] and watch.kicked == 1
    assert await watch.tick(nc, stalled, 10.0) == []  # not again before 15 s
    assert await watch.tick(nc, stalled, 15.0) == [f"site-b/{STREAM}"]
    assert watch.kicks[(STREAM, "site-b")] == (2, 15.0)
    # it hears from its origin again: forgotten, so a later outage starts afresh
    assert (
        await watch.tick(nc, [_row("site-a", "site-b", 0.3), _row("site-b", "site-a", 0.2)], 16.0)
        == []
    )
    assert watch.kicks == {}
    assert await watch.tick(nc, stalled, 17.0) == [f"site-b/{STREAM}"]
    # another site's copy is that site's runtime's to kick
    other = SourceWatch(sites=frozenset({"site-a"}))
    assert await other.tick(nc, stalled, 0.0) == [] and len(nc.subjects) == 3
    # an R1 copy cannot change leader: said, not counted
    r1 = SourceWatch()
    assert await r1.tick(_Nc({"site-b": "stream not clustered"}), stalled, 0.0) == []
    assert r1.kicked == 0 and r1.kicks[(STREAM, "site-b")] == (1, 0.0)


# --------------------------------------------------------------------------- site-loss (short)


async def test_site_loss_short_form_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    rep = await run_site_loss(events=2000, rate=1000.0, nodes=3, workdir=tmp_path)
    assert rep.error == "", rep.error
    assert rep.acked >= 2000 and len(rep.killed_pids) == 3
    assert [c.site for c in rep.checks] == ["site-b", "site-a"]
    for c in rep.checks:
        assert c.ok, (c.site, c.lost[:5], c.duplicated[:5], c.hash_mismatch[:5], c.unknown[:5])
    assert rep.failover_ack_s is not None and rep.failover_ack_s > 0  # acked by B after the kill
    # the link was cut before the kill: B lacked A's last acknowledged events while A was
    # down, and has them (checks above) only because A returned
    assert rep.missing_on_b_during_outage > 0
    assert rep.ok


async def test_nats_up_sites_runs_joined_domains_until_sigterm(tmp_path: Path) -> None:
    """`tierflow nats up --sites 2`: sites.json names both sites, each answers in its own
    domain and reaches the other's; SIGTERM stops every server it started."""
    import os
    import signal
    import sys

    (tmp_path / "tierflow.toml").write_text(f'state_dir = "{tmp_path / "state"}"\n')
    cli = [sys.executable, "-m", "cluster.cli", "nats", "up", "--sites", "2", "--nodes", "1"]
    proc = subprocess.Popen(
        [*cli, "-c", str(tmp_path / "tierflow.toml")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    state_file = tmp_path / "state" / "nats" / "sites" / "sites.json"
    try:
        await await_until(state_file.exists, 30, 0.1, "sites.json written")
        state = msgspec.json.decode(state_file.read_bytes())
        assert [s["name"] for s in state["sites"]] == ["site-a", "site-b"]
        nc = await connect(",".join(state["sites"][1]["urls"]))
        try:
            assert (await nc.jetstream().account_info()).domain == "site-b"
            assert (await nc.jetstream(domain="site-a").account_info()).domain == "site-a"
        finally:
            await nc.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    for pid in (p for s in state["sites"] for p in s["pids"]):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# --------------------------------------------------------------------------- status, metrics


@pytest.mark.unit
def test_status_and_metrics_show_replication_lag_per_stream_and_site() -> None:
    from cluster.admin import StatusMetrics
    from cluster.cli.status import status_tables

    rows = [
        {"stream": STREAM, "site": "site-b", "from": "site-a", "lag": 12, "active_s": 0.2,
         "error": None, "up": True, "messages": 5},
        {"stream": STREAM, "site": "site-a", "from": "-", "lag": None, "up": False},
    ]  # fmt: skip
    snap = {"services": {}, "children": [], "replication": rows, "replication_kicks": 2}
    tables = status_tables(snap, wide=True, width=200)
    geo = [t for t in tables if t.title == "geo"]
    assert len(geo) == 1 and geo[0].row_count == 2
    metrics = StatusMetrics()
    metrics.update(snap)
    text = metrics.render().decode()
    assert (
        'tierflow_replication_lag_events{origin="site-a",site="site-b",stream="orders"} 12.0'
        in text
    )
    assert 'tierflow_replication_copy_up{site="site-a",stream="orders"} 0.0' in text
    assert "tierflow_replication_source_kicks 2.0" in text
    assert 'tierflow_replication_copy_up{site="site-b",stream="orders"} 1.0' in text


@pytest.mark.unit
def test_promotion_refuses_a_site_without_an_answering_copy(tmp_path: Path) -> None:
    from cluster.failover import plan_promotion, site_url

    cfg = _cfg(tmp_path, ["site-b"])
    state = {"sites": [{"name": "site-b", "urls": ["nats://h:1", "nats://h:2"]}]}
    assert site_url(state, "site-b") == "nats://h:1,nats://h:2" and site_url(state, "x") == ""
    down = [{"stream": STREAM, "site": "site-b", "from": "-", "lag": None, "up": False}]
    assert not plan_promotion(cfg, "site-b", "nats://h:1", down).ok
    assert not plan_promotion(cfg, "site-c", "nats://h:1", []).ok  # nothing replicated there
    a_lost = [
        {"stream": STREAM, "site": "site-b", "from": "site-a", "lag": 4, "up": True},
        {"stream": STREAM, "site": "site-a", "from": "-", "lag": None, "up": False},
    ]
    plan = plan_promotion(cfg, "site-b", "nats://h:1", a_lost)
    assert plan.ok and plan.streams == [STREAM]
    assert any("site-a is not reachable" in n and "lag last seen: 4" in n for n in plan.notes)


# --------------------------------------------------------------------------- failover (last:
# it kills site A of the module's sites)


async def test_site_promote_after_site_a_is_lost_then_a_catches_up(
    sites: NatsSites, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from cluster.cli import app

    a, b = sites.site("site-a"), sites.site("site-b")
    cfg_file = tmp_path / "tierflow.toml"
    cfg_file.write_text(
        f'state_dir = "{tmp_path}"\n[streams.{STREAM}]\nsubjects = ["{SUBJECT}"]\n'
        f'replicas = 3\n[streams.{STREAM}.replicate]\nto = ["site-b"]\n'
    )
    sites_file = sites.write_state(tmp_path / "sites.json")
    cfg = _cfg(tmp_path, ["site-b"])
    nca = await connect(a.url)
    await ensure_streams(nca, cfg)
    await nca.jetstream().publish(SUBJECT, b"before", headers={"Nats-Msg-Id": "f-before"})
    await nca.close()
    sites.kill_site("site-a")

    args = ["site", "promote", "site-b", "-c", str(cfg_file), "--sites-file", str(sites_file)]
    res = await asyncio.to_thread(CliRunner().invoke, app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    out = msgspec.json.decode(res.output.strip().splitlines()[-1])
    assert out["ok"] and out["streams"] == [STREAM] and out["url"] == b.url
    assert any("site-a is not reachable" in n for n in out["notes"])
    assert msgspec.json.decode(sites_file.read_bytes())["active"] == "site-b"

    ncb = await connect(b.url)
    try:
        ack = await ncb.jetstream().publish(SUBJECT, b"during", headers={"Nats-Msg-Id": "f-dur"})
        assert ack.stream == STREAM and not ack.duplicate  # B acknowledges with A down
        await asyncio.to_thread(sites.start_site, "site-a")

        async def both_have_both() -> bool:
            for site in (a, b):
                if not {"f-before", "f-dur"} <= {i for i, _ in await read_copy(site.url, STREAM)}:
                    return False
            return True

        # A gets B's write; B gets A's last write if A died before it was copied
        # a source whose origin was lost retries with a growing backoff (10 s per failed
        # attempt, at most 2 minutes: docs/geo.md), so catch-up may start that late
        await await_until(both_have_both, 150, 0.5, "both copies caught up", swallow=True)
        for site in (a, b):
            ids = Counter(i for i, _ in await read_copy(site.url, STREAM))
            assert ids["f-before"] == ids["f-dur"] == 1 and set(ids.values()) == {1}
    finally:
        await ncb.close()


@pytest.mark.unit
def test_no_two_servers_of_the_sites_share_a_port(tmp_path: Path) -> None:
    sites = NatsSites(tmp_path, sites=3, nodes=3)
    sites._build()  # ports chosen, nothing started
    ports = [
        p
        for site in sites.members
        for s in site.servers
        for p in (s.port, s.monitor_port, s.cluster_port)
    ] + [p for site in sites.members for p in site.leaf_ports]
    assert len(ports) == 36 and len(set(ports)) == 36
    # below the ephemeral range: a dial to a dead site's port cannot take it as its own
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(1024 <= p < low for p in ports)
