"""Chaos: pure parts (schedule, report, verdicts), the logger's disk-fault hook, and the
short form of the suite (a few scenarios at small N, real Ray, NATS and LevelDB).

`make chaos` runs every scenario at full size (tests/test_chaos_full.py).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import plyvel
import pytest
from typer.testing import CliRunner

from actors.queue.logger import FAULT_SUFFIX, LogStore
from actors.queue.logger.records import _key
from cluster.chaos import report, scenarios
from cluster.chaos.injectors import FaultRecord
from cluster.chaos.report import DeliveryCheck, ScenarioReport, delivery_check
from cluster.chaos.runner import analysis_mismatches, load_streams, mismatch_detail
from cluster.chaos.schedule import (
    ACK_LOSS,
    ACTIONS,
    KILL,
    NATS_DOWN,
    NEMESIS_MENU,
    Fault,
    Scenario,
    at_s,
    load_span,
    plan,
)
from cluster.verify import judge
from runtime.data.events import Event
from runtime.state.checkpoint import CheckpointError

# --------------------------------------------------------------------------- schedule


@pytest.mark.unit
def test_same_scenario_and_seed_give_the_same_schedule() -> None:
    for scn in scenarios.SCENARIOS.values():
        assert plan(scn, 7) == plan(scn, 7), scn.name


def test_schedule_is_the_same_in_another_process() -> None:
    """A pure function of (scenario, seed): no hash seed, clock or global RNG in it."""
    code = (
        "import json; from cluster.chaos import scenarios; from cluster.chaos.schedule import "
        "plan; print(json.dumps({s.name: [[f.at, f.action, f.target, f.duration_s, f.count] "
        "for f in plan(s, 3)] for s in scenarios.SCENARIOS.values()}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    ).stdout
    here = {
        s.name: [[f.at, f.action, f.target, f.duration_s, f.count] for f in plan(s, 3)]
        for s in scenarios.SCENARIOS.values()
    }
    assert json.loads(out) == here


@pytest.mark.unit
def test_seeds_change_the_schedule_within_bounds() -> None:
    nemesis = scenarios.get("nemesis")
    schedules = {plan(nemesis, seed) for seed in range(5)}
    assert len(schedules) == 5  # different seeds, different nemesis runs
    for faults in schedules:
        assert len(faults) == nemesis.nemesis_faults
        assert [f.at for f in faults] == sorted(f.at for f in faults)
        assert all(0.1 <= f.at <= 0.9 for f in faults)
        menu = {(a, t, d) for a, t, d in NEMESIS_MENU}
        assert all((f.action, f.target, f.duration_s) in menu for f in faults)
    kills = scenarios.get("kill-each-role")
    for seed in range(20):
        got = plan(kills, seed)
        assert sorted(f.target for f in got) == sorted(f.target for f in kills.faults)
        for f in got:  # jittered, never outside the window's usable part
            base = next(b for b in kills.faults if b.target == f.target)
            assert abs(f.at - base.at) <= 0.05 + 1e-9 and 0.05 <= f.at <= 0.9


@pytest.mark.unit
def test_faults_are_bounded_and_validated() -> None:
    with pytest.raises(ValueError, match="unknown fault action"):
        Fault(0.5, "meteor", "collector-0")
    with pytest.raises(ValueError, match="out of bounds"):
        Fault(1.5, KILL, "collector-0")
    with pytest.raises(ValueError, match="out of bounds"):
        Fault(0.5, KILL, "collector-0", count=0)
    f = Fault(0.25, KILL, "collector-0", 2.0, 3)
    assert f.label == "kill collector-0 x3 2s"
    assert at_s(f, 40.0) == 10.0


@pytest.mark.unit
def test_load_span_slows_the_load_to_fit_the_faults() -> None:
    scn = Scenario("x", "x", min_span_s=10.0)
    assert load_span(2000, 500.0, scn) == (10.0, 200.0)
    assert load_span(10_000, 500.0, scn) == (20.0, 500.0)
    with pytest.raises(ValueError):
        load_span(0, 500.0, scn)


@pytest.mark.unit
def test_the_issue_scenarios_exist() -> None:
    names = set(scenarios.SCENARIOS)
    assert {
        "kill-each-role",
        "kill-logger-primary",
        "kill-logger-backup",
        "kill-past-intensity",
        "ray-node-loss",
        "nats-r3-node-loss",
        "nats-down-10s",
        "pause-each-role",
        "link-latency-resets",
        "logger-disk-errors",
        "spark-driver-kill",
        "nemesis",
    } <= names
    assert set(scenarios.SHORT) <= names
    # outages (NATS down; acks lost on the link) outlast a shortened duplicate window
    past = {
        f.action: s.name
        for s in scenarios.SCENARIOS.values()
        for f in s.faults
        if s.duplicate_window_s and f.duration_s > s.duplicate_window_s
    }
    assert past == {
        NATS_DOWN: "nats-down-past-dup-window",
        ACK_LOSS: "acks-lost-past-dup-window",
    }
    assert "acks-lost-past-dup-window" in scenarios.SHORT
    assert {f.action for s in scenarios.SCENARIOS.values() for f in s.faults} <= set(ACTIONS)
    assert [s.name for s in scenarios.resolve("all")] == list(scenarios.SCENARIOS)
    with pytest.raises(KeyError, match="unknown scenario"):
        scenarios.resolve("nope")
    assert scenarios.get("nats-down-10s").faults[0].duration_s == 10.0


# --------------------------------------------------------------------------- report


def _report(**kw: Any) -> ScenarioReport:
    base = {"scenario": "s", "seed": 1, "events": 3, "rate_eps": 1.0, "sent": 3}
    return ScenarioReport(**{**base, "acknowledged": 3, "stored": 3, **kw})


@pytest.mark.unit
def test_verdict_and_report_fail_on_loss_duplicates_and_misses() -> None:
    v = judge({"a", "b", "c"}, Counter({"a": 1, "b": 2, "x": 1}))
    assert v.lost == ["c"] and v.duplicated == {"b": 2} and v.unexpected == 1
    assert _report().ok
    assert not _report(lost=["c"]).ok
    assert not _report(duplicated={"b": 2}).ok
    assert not _report(altered=["s/c"]).ok
    assert not _report(duplicated_payloads={"s/h": ["s/a", "s/b"]}).ok
    assert not _report(refused_stored=["s/r"]).ok
    assert not _report(wrongly_accepted=["s/oversized/x"]).ok
    assert not _report(wrongly_refused=["s/a: 413"]).ok
    assert _report(expected_refused=6, blind_duplicates=1, unacknowledged_stored=1).ok
    assert not _report(acknowledged=2).ok  # the producer gave up on an event
    assert not _report(gateway=delivery_check({"a", "b"}, ["a"])).ok
    assert not _report(gateway=delivery_check({"a"}, ["a", "a"])).ok
    assert _report(gateway=delivery_check({"a"}, ["a"])).ok
    assert not _report(analysis_mismatches=["meetup_topn"]).ok
    assert _report(analysis_mismatches=[]).ok
    bad_fault = report.FaultReport("kill x", 1.0, 1.0, None, 0.0, error="TimeoutError()")
    assert not _report(faults=[bad_fault]).ok
    assert not _report(error="boom").ok


@pytest.mark.unit
def test_report_folds_stream_verdicts_with_stream_qualified_ids() -> None:
    from cluster.verify import judge_streams

    verdicts = judge_streams(
        {"s1": {"x": "h1", "y": "h2"}, "s2": {"x": "h3"}},
        {"s1": [("x", "h1"), ("y", "hX")], "s2": [("x", "h3"), ("x", "h3"), ("r", "hr")]},
        refused={"s2": {"hr"}},
    )
    rep = _report(events=3, acknowledged=3, stored=0)
    rep.add_verdicts(verdicts.values())
    assert rep.stored == 5 and rep.altered == ["s1/y"] and rep.duplicated == {"s2/x": 2}
    assert rep.refused_stored == ["s2/r"] and rep.unacknowledged_stored == 1
    assert set(rep.streams) == {"s1", "s2"} and not rep.ok
    d = rep.to_dict()
    assert d["altered_count"] == 1 and d["refused_stored_count"] == 1


@pytest.mark.unit
def test_delivery_check_names_missing_and_duplicated_ids() -> None:
    got = delivery_check(["a", "b", "c"], ["a", "c", "c", "z"], reconnects=2)
    assert got == DeliveryCheck(
        expected=3, received=4, missing=["b"], duplicated={"c": 2}, reconnects=2
    )
    assert not got.ok


@pytest.mark.unit
def test_throughput_during_a_fault_window() -> None:
    timeline = [(0.5, 50), (1.0, 50), (2.5, 50), (3.0, 50), (9.0, 50)]
    assert report.rate_between(timeline, 0.0, 4.0) == 50.0
    assert report.rate_between(timeline, 4.0, 4.0) == 0.0
    recs = [
        FaultRecord("kill a", started_s=2.0, ended_s=2.0, recovered_s=1.5),
        FaultRecord("pause b", started_s=8.5, ended_s=11.5, recovered_s=3.5),
    ]
    rows = report.fault_reports(recs, timeline)
    assert [r.throughput_eps for r in rows] == [50.0, round(50 / 3.5, 1)]
    assert rows[0].recovered_s == 1.5


@pytest.mark.unit
def test_report_is_written_as_json_and_table(tmp_path: Path) -> None:
    reps = [_report(scenario="good"), _report(scenario="bad", lost=["c"])]
    path = report.write(reps, tmp_path)
    body = json.loads(path.read_text())
    assert body["ok"] is False
    assert [(s["scenario"], s["ok"], s["lost_count"]) for s in body["scenarios"]] == [
        ("good", True, 0),
        ("bad", False, 1),
    ]
    text = path.with_suffix(".txt").read_text()
    assert "good" in text and "PASS" in text and "FAIL" in text


@pytest.mark.unit
def test_cli_lists_scenarios_and_refuses_unknown_ones() -> None:
    from cluster.cli import app

    out = CliRunner().invoke(app, ["chaos", "list", "--seed", "2"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    for name in [*scenarios.SCENARIOS, "site-loss"]:
        assert name in out.output
    bad = CliRunner().invoke(app, ["chaos", "run", "--scenario", "nope"])
    assert bad.exit_code == 2 and "unknown scenario" in bad.output


# --------------------------------------------------------------------------- disk faults


def _ev(i: int) -> Event:
    return Event(id=f"e{i}", stream="s", subject="raw.s", data=b"{}", received_ms=i)


@pytest.mark.unit
@pytest.mark.parametrize(("kind", "errno_text"), [("error", "Input/output"), ("full", "No space")])
def test_logstore_refuses_writes_while_the_disk_fault_file_exists(
    tmp_path: Path, kind: str, errno_text: str
) -> None:
    path = tmp_path / "logger" / "logger-0-0"
    store = LogStore(path, max_events=100, max_bytes=1 << 20)
    try:
        assert store.append([_ev(1)]) == 1
        fault = path.with_name(path.name + FAULT_SUFFIX)
        fault.write_text(kind)
        with pytest.raises(CheckpointError, match=errno_text) as err:
            store.append([_ev(2)])
        assert isinstance(err.value.__cause__, plyvel.IOError)
        with pytest.raises(CheckpointError):
            store.forget([_key("s", "e1")])
        with pytest.raises(CheckpointError):
            store.put_meta({b"x": b"1"})
        assert store.counts()["transient"] == 1  # nothing of the failed writes landed
        assert store.where(("s", "e2")) is None and store.where(("s", "e1")) == "transient"
        fault.unlink()
        assert store.append([_ev(2)]) == 1
        assert store.scan_counts()["transient"] == 2
    finally:
        store.close()


# --------------------------------------------------------------------------- short form


def _explain(rep: ScenarioReport) -> str:
    return json.dumps(rep.to_dict(), indent=1, default=str)[:4000]


@pytest.mark.parametrize("name", scenarios.SHORT)
async def test_short_scenario_loses_and_duplicates_nothing(
    ray_module: Any, tmp_path: Path, name: str
) -> None:
    from cluster.chaos.runner import RunOptions, run_scenario

    scn = scenarios.get(name)
    rep = await run_scenario(scn, RunOptions(events=600, rate=200.0, seed=1, workdir=tmp_path))
    assert rep.ok, _explain(rep)
    # 600 valid events over three streams (ids reused, a quarter without ids, near-limit
    # ones), every one acknowledged and stored once; every unacknowledged stored copy is
    # one a blind resend explains; the 6 invalid/oversized ones refused and absent.
    assert rep.events == rep.acknowledged == 600 and set(rep.streams) == set(load_streams(scn))
    assert rep.stored == 600 + rep.unacknowledged_stored
    assert rep.unacknowledged_stored == rep.blind_duplicates
    assert rep.expected_refused == 6 and rep.rejected == {400: 4, 413: 2}, _explain(rep)
    assert rep.ws_requests > 0  # some batches went as producer WebSocket frames
    assert len(rep.faults) == len(scn.faults)
    assert all(f.recovered_s is not None for f in rep.faults), _explain(rep)
    assert rep.gateway is not None and rep.gateway.received == rep.gateway.expected > 0
    if name == "logger-disk-errors":
        assert rep.refused > 0  # the logger refused (503) rather than ack unpersisted data
        # the 503s named the ids they assigned: producers without ids resent under them
        assert rep.adopted_ids > 0, _explain(rep)
    if name == "nats-down-10s":
        assert rep.faults[0].recovered_s >= 10.0


async def _tamper(d: Any, stream: str, forged: bytes | None) -> str:
    """Delete the 18th message of `stream`; with `forged`, store those bytes under its id
    again (past the stream's duplicate window, shortened here). Returns `stream/id`."""
    from cluster.verify import MSG_ID
    from runtime.nats.server import connect
    from runtime.waiting import await_until

    nc = await connect(d.nats.url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        seq = info.state.first_seq + 17
        eid = (await js.get_msg(stream, seq)).headers[MSG_ID]
        assert await js.delete_msg(stream, seq)
        if forged is not None:
            cfg = info.config
            await js.update_stream(dataclasses.replace(cfg, duplicate_window=1.0))
            subject = cfg.subjects[0]

            async def stored() -> bool:
                ack = await js.publish(subject, forged, headers={MSG_ID: eid})
                return not ack.duplicate

            await await_until(stored, 60, 0.3, what="forged copy stored")
        return f"{stream}/{eid}"
    finally:
        await nc.close()


async def test_the_verifier_reports_a_real_loss_and_an_altered_payload(
    ray_module: Any, tmp_path: Path
) -> None:
    """After the run and before the check, delete one acknowledged event from one stream
    (JetStream's delete-msg API) and replace another, in another stream, by other bytes
    under the same id: the verdict must name the first lost and the second altered (its
    id alone still matches), each as exactly that one, and fail the run. One run for both
    tamperings: each scenario run is a whole deployment (~40 s of make test)."""
    from cluster.chaos.runner import RunOptions, run_scenario

    deleted: list[str] = []
    altered: list[str] = []

    async def tamper(d: Any) -> None:
        deleted.append(await _tamper(d, "chaos2", None))
        forged = b'{"id": "forged", "n": -99, "k": "b"}'
        altered.append(await _tamper(d, "chaos3", forged))

    scn = scenarios.get("kill-logger-backup")
    opts = RunOptions(events=300, rate=100.0, seed=2, workdir=tmp_path, before_verify=tamper)
    rep = await run_scenario(scn, opts)
    assert len(deleted) == len(altered) == 1 and deleted != altered
    assert rep.lost == deleted, _explain(rep)
    assert rep.altered == altered, _explain(rep)
    # the altered one is stored (other bytes), the lost one is not
    assert rep.stored == 299 + rep.unacknowledged_stored, _explain(rep)
    assert not rep.duplicated
    assert not rep.ok
    assert "FAIL" in report.render_text([rep])


@pytest.mark.unit
def test_a_recount_mismatch_names_the_first_window_and_both_answers() -> None:
    from cluster.demo.meetup import reference
    from cluster.demo.rsvps import RsvpGenerator

    rsvps = RsvpGenerator(seed=5).take(300)
    got = reference(rsvps)
    assert analysis_mismatches(got, rsvps) == []
    first = sorted(got["meetup_topn_window"])[0]
    top = got["meetup_topn_window"][first]["top"]
    top[0] = {**top[0], "count": top[0]["count"] - 1}  # one event's topic short
    assert analysis_mismatches(got, rsvps) == ["meetup_topn_window"]
    detail = mismatch_detail(got, reference(rsvps), "meetup_topn_window")
    assert detail.startswith("meetup_topn_window: 1 of ")
    assert f"first {first}: got {top[0]['item']} {top[0]['count']}" in detail
    assert f"exact {top[0]['item']} {top[0]['count'] + 1}" in detail
