"""The `tierflow` CLI from a shell: up --detach, status, down, config show, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest

from runtime import runstate
from runtime.config import load
from tests.support import acked_publish

TIERFLOW = str(Path(sys.executable).with_name("tierflow"))


def run(args: list[str], env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [TIERFLOW, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERFLOW_")}
    env["TIERFLOW_STATE_DIR"] = str(tmp_path / "state")
    env["TIERFLOW_RAY__NUM_CPUS"] = "2"
    env["TIERFLOW_ROLES__COLLECTOR__PORT"] = "0"  # a free port, not the default 8000
    env["TIERFLOW_ROLES__GATEWAY__PORT"] = "0"
    return env


def test_config_show_prints_effective_values(cli_env: dict[str, str]) -> None:
    cli_env["TIERFLOW_ROLES__LOGGER__K"] = "2"
    out = run(["config", "show", "--json"], cli_env)
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["roles"]["logger"]["k"] == 2
    assert shown["nats"]["sync_interval"] == "always"


def test_bad_config_exits_2_naming_the_key(cli_env: dict[str, str]) -> None:
    cli_env["TIERFLOW_ROLES__COLLECTOR__PORT"] = "-3"
    out = run(["config", "show"], cli_env)
    assert out.returncode == 2
    assert "roles.collector.port" in out.stderr and ">= 0" in out.stderr


def test_status_when_not_running(cli_env: dict[str, str]) -> None:
    out = run(["status", "--json"], cli_env)
    assert out.returncode == 3
    assert json.loads(out.stdout) == {"running": False}


def test_detached_runtime_serves_every_tier_runs_a_job_and_down_leaves_no_process(
    cli_env: dict[str, str],
) -> None:
    """One detached runtime, driven the way a user does from a shell: `up --detach`, status,
    the collection and access tiers, `tierflow jobs` (which joins the runtime's Ray, starts
    the analysis driver on demand, and a real Spark query consumes what the collector
    accepted), scaling, metrics; then `down` leaves no process it started, the analysis
    driver's included. (One runtime for all of it: each `up` costs make test a Ray start.)"""
    from cluster.demo.rsvps import RsvpGenerator
    from runtime.waiting import wait_until

    cli_env["TIERFLOW_STREAMS__MEETUP__SUBJECTS"] = '["raw.meetup"]'  # the user's own stream
    cfg = load(environ=cli_env)
    assert cfg.streams["meetup"].subjects == ["raw.meetup"]
    up = run(["up", "--detach"], cli_env)
    assert up.returncode == 0, up.stdout + up.stderr
    state = runstate.read_state(cfg)
    assert state is not None and state["ready"]
    main_pid = state["process"]["pid"]
    started = [state["process"], *state["children"]]
    nats_pid = state["nats"]["pid"]
    assert psutil.pid_exists(main_pid) and psutil.pid_exists(nats_pid)
    # The NATS server and Ray's processes are children of the detached runtime.
    assert nats_pid in {p["pid"] for p in state["children"]}
    assert len(state["children"]) >= 3
    try:
        # A second `up` refuses rather than starting a twin on the same state dir.
        again = run(["up", "--detach"], cli_env)
        assert again.returncode == 1 and "already running" in again.stderr

        st = run(["status", "--json"], cli_env)
        assert st.returncode == 0, st.stderr
        snap = json.loads(st.stdout)
        assert snap["running"] and snap["pid"] == main_pid
        assert snap["services"]["nats"]["healthy"] is True
        assert snap["services"]["ray"]["healthy"] is True
        assert [n["alive"] for n in snap["services"]["ray"]["nodes"]] == [True]
        names = [c["name"] for c in snap["children"]]
        assert names[0] == "tierflow-root" and snap["children"][0]["alive"]
        assert len(snap["loggers"]) == 2  # k=1 by default: two replicas
        assert snap["escalated"] is None

        table = run(["status"], cli_env)
        assert table.returncode == 0 and "services" in table.stdout and "nats" in table.stdout

        # The collection tier runs: RSVPs posted to the collector are counted by the live
        # logger replicas that `logger inspect` asks.
        rsvps = RsvpGenerator(3).take(50)
        req = urllib.request.Request(
            state["collector"]["url"] + "/v1/streams/meetup/events",
            data="\n".join(json.dumps(r) for r in rsvps).encode(),
            headers={"Content-Type": "application/x-ndjson"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert json.loads(resp.read())["accepted"] == 50
        inspect = run(["logger", "inspect", "--json"], cli_env)
        assert inspect.returncode == 0, inspect.stderr
        replicas = json.loads(inspect.stdout)
        assert len(replicas) == 2 and all(r["state"] == "running" for r in replicas)
        assert {r["epoch"] for r in replicas} == {1}

        # The data access tier runs too: the operations console is served at its root.
        with urllib.request.urlopen(state["gateway"]["url"] + "/", timeout=30) as resp:
            assert resp.status == 200 and b"tierflow" in resp.read()

        # The analysis tier on demand: a catalog job starts and consumes the RSVPs.
        listed = run(["jobs", "list", "--json"], cli_env)
        assert listed.returncode == 0, listed.stderr
        assert {"name": "meetup_responses", "state": "available"}.items() <= next(
            r for r in json.loads(listed.stdout) if r["name"] == "meetup_responses"
        ).items()
        begun = run(["jobs", "start", "meetup_responses", "--json"], cli_env, timeout=300)
        assert begun.returncode == 0, begun.stderr

        def processed() -> bool:
            rows = json.loads(run(["jobs", "list", "--json"], cli_env).stdout)
            row = next(r for r in rows if r["name"] == "meetup_responses")
            # committed_seq is the next stream sequence the query will read
            return (row.get("committed_seq") or 0) > 50 and row.get("results", 0) > 0

        wait_until(processed, timeout=240, interval=2, what="the job processed the RSVPs")
        stopped = run(["jobs", "stop", "meetup_responses", "--json"], cli_env)
        assert stopped.returncode == 0 and json.loads(stopped.stdout)[0]["stopped"]

        scaled = run(["scale", "collector", "2"], cli_env)
        assert scaled.returncode == 0 and "2 replicas" in scaled.stdout, scaled.stderr
        scaled = run(["scale", "gateway", "2"], cli_env)
        assert scaled.returncode == 0 and "gateway-0, gateway-1" in scaled.stdout, scaled.stderr
        refused = run(["scale", "spark", "2"], cli_env)
        assert refused.returncode == 1 and "spark" in refused.stderr

        with urllib.request.urlopen(state["admin"]["url"] + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        assert 'tierflow_service_healthy{service="nats"} 1.0' in metrics
        assert "tierflow_ray_nodes_alive 1.0" in metrics
        # Everything that runtime spawned by now (the analysis driver's processes too) is
        # ours to stop.
        started += [runstate.process_identity(p) for p in runstate.descendants(main_pid)]
    finally:
        down = run(["down"], cli_env)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "down" in down.stdout
    assert "forced" not in down.stderr  # the runtime shut itself down cleanly on SIGTERM
    left = [p["pid"] for p in started if runstate.alive(p["pid"], p["create_time"])]
    assert left == []
    assert runstate.read_state(cfg) is None
    assert run(["status"], cli_env).returncode == 3


def test_detached_start_failure_reports_the_log(cli_env: dict[str, str], tmp_path: Path) -> None:
    import socket

    # Hold the NATS port so the embedded server cannot bind it.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        cli_env["TIERFLOW_NATS__PORT"] = str(sock.getsockname()[1])
        out = run(["up", "--detach", "--timeout", "120"], cli_env)
    assert out.returncode == 1
    assert "did not start" in out.stderr
    assert runstate.read_state(load(environ=cli_env)) is None


def test_nats_up_three_nodes_serves_jetstream_then_stops(cli_env: dict[str, str]) -> None:
    """`tierflow nats up --nodes 3` forms a cluster that takes R3 writes, and stops its pids."""
    import asyncio
    import re
    import signal
    import time

    from runtime.nats.server import connect

    proc = subprocess.Popen(
        [TIERFLOW, "nats", "up", "--nodes", "3"],
        env=cli_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline and "nats up" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "nats up exited early"
        urls = re.findall(r"nats://127\.0\.0\.1:\d+", line)
        assert len(urls) == 3
        servers = [runstate.process_identity(p) for p in runstate.descendants(proc.pid)]
        assert len(servers) == 3

        async def r3_round_trip() -> int:
            from runtime.waiting import await_until

            nc = await connect(urls)
            js = nc.jetstream(timeout=30)  # a loaded machine: the R3 group may elect slowly
            await js.add_stream(name="r3", subjects=["r3.>"], num_replicas=3)

            for i in range(20):
                # until the new stream's leader answers there are no responders
                await await_until(
                    lambda i=i: acked_publish(js, "r3.x", str(i).encode(), str(i)),
                    60,
                    0.2,
                    what=f"R3 publish {i} acked",
                )
            info = await js.stream_info("r3")
            await nc.close()
            assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2
            return info.state.messages

        assert asyncio.run(r3_round_trip()) == 20
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    assert runstate.wait_gone(servers, 10) == []


# --------------------------------------------------------------------------- tables at 80 columns

LONG_ERROR = (
    "StreamingQueryException: [STREAM_FAILED] Query [id = 3f1c, runId = 9a2e] terminated with "
    "exception: org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in "
    "stage 12.0 failed 1 times, most recent failure: Lost task 0.0: java.io.IOException: "
    "No space left on device"
)
NODE = "a3f9c2e4b1d07e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b"


def _job_rows() -> list[dict[str, object]]:
    """What `jobs_list` returns for a driver running three queries (one failed) and two
    catalog jobs not started: every field the driver's status rows carry."""
    running = {
        "kind": "topn",
        "stream": "meetup",
        "state": "running",
        "restarts": 0,
        "error": None,
        "results": 1204,
        "duplicates": 0,
        "last_batch_id": 311,
        "committed_seq": 48213,
        "batch_id": 312,
        "input_rows": 450,
        "input_rows_per_s": 412.7,
        "processed_rows_per_s": 398.1,
        "latency_ms": 1093,
        "watermark": "2016-09-06T10:51:00.000Z",
        "at": "2026-01-04T12:00:01.123Z",
        "late_events": 3,
    }
    failed = {**running, "kind": "count", "state": "failed", "restarts": 4, "error": LONG_ERROR}
    return [
        {"name": "meetup_topn", **running},
        {"name": "meetup_topn_window", **running},
        {"name": "meetup_city_minute", **failed},
        {"name": "meetup_members", "kind": "distinct", "stream": "meetup", "state": "available"},
        {"name": "meetup_responses", "kind": "custom", "stream": "meetup", "state": "available"},
    ]


def _snapshot() -> dict[str, object]:
    """A /status snapshot of a loaded two-node runtime with autoscaling and analysis."""
    nodes = [
        {"node_id": NODE, "alive": True, "address": "10.20.30.41", "cpus": 16.0},
        {"node_id": NODE[::-1], "alive": True, "address": "10.20.30.42", "cpus": 16.0},
    ]
    children = [{"name": "tierflow-root", "state": "running", "alive": True, "restarts": 0}]

    def replicas(role: str, n: int, **figures: object) -> list[dict[str, object]]:
        return [
            {"name": f"{role}-{i}", "node": (NODE, NODE[::-1])[i % 2], "pid": 4000 + i, **figures}
            for i in range(n)
        ]

    reason = "scale up 3 -> 5: mean load 412.5 requests_in_flight per replica over 30s > 100"
    collectors = replicas("collector", 3, requests_in_flight=1237)
    collectors.append({"name": "collector-3", "error": "GetTimeoutError"})
    return {
        "pid": 31337,
        "uptime_s": 86400.5,
        "services": {
            "nats": {"url": "nats://nats-0.nats.tierflow.svc.cluster.local:4222", "healthy": True},
            "ray": {"address": "10.20.30.41:6379", "healthy": True, "nodes": nodes},
            "spark": {"master": "spark://spark-master.tierflow.svc.cluster.local:7077"},
        },
        "children": children,
        "escalated": None,
        "roles": {
            "collector": {
                "replicas": collectors,
                "load": 1237.0,
                "rates": {"accepted": 20431.25, "rejected": 12.5, "overloaded": 0.0},
            },
            "logger": {"replicas": replicas("logger", 2, pending=88), "load": 88.0, "rates": {}},
            "bridge": {
                "replicas": replicas("bridge", 2, in_flight=64),
                "load": 64.0,
                "rates": {"published": 20418.75, "replayed": 0.0, "failed": 0.0},
            },
            "gateway": {
                "replicas": replicas("gateway", 2, clients=311),
                "load": 311.0,
                "rates": {"events_sent": 151234.5},
            },
        },
        "autoscaling": {"collector": {"desired": 5, "reason": reason, "error": None}},
        "analysis": {
            "state": "running",
            "queries": [
                {"name": "meetup_topn", "state": "running", "committed_seq": 48213, "lag": 12},
                {"name": "meetup_city_minute", "state": "failed", "committed_seq": 1, "lag": 9},
            ],
        },
    }


def _lines_fit(text: str, width: int = 80) -> None:
    long = [line for line in text.splitlines() if len(line) > width]
    assert not long, "\n".join(long)


@pytest.fixture
def fake_jobs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    from cluster import analysis

    monkeypatch.setattr(analysis, "jobs_list", lambda cfg: _job_rows())
    return {"TIERFLOW_STATE_DIR": str(tmp_path), "COLUMNS": "80"}


@pytest.mark.unit
def test_jobs_list_fits_80_columns_and_wide_or_json_show_everything(
    fake_jobs: dict[str, str],
) -> None:
    from typer.testing import CliRunner

    from cluster.cli import app

    narrow = CliRunner().invoke(app, ["jobs", "list"], env=fake_jobs)
    assert narrow.exit_code == 0, narrow.output
    _lines_fit(narrow.output)
    lines = narrow.output.splitlines()
    # one line a job (not one character a line), the error cut with an ellipsis
    failed = [line for line in lines if "meetup_city_minute" in line]
    assert len(failed) == 1 and "StreamingQueryException" in failed[0] and "…" in failed[0]
    assert LONG_ERROR not in narrow.output
    assert all(any(r["name"] in line for line in lines) for r in _job_rows())

    wide = CliRunner().invoke(app, ["jobs", "list", "--wide"], env=fake_jobs)
    assert wide.exit_code == 0, wide.output
    assert LONG_ERROR in wide.output
    for column in ("processed_rows_per_s", "late_events", "watermark", "duplicates"):
        assert column in wide.output

    as_json = CliRunner().invoke(app, ["jobs", "list", "--json"], env=fake_jobs)
    assert json.loads(as_json.output) == _job_rows()


@pytest.mark.unit
def test_status_fits_80_columns_and_wide_shows_everything(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from cluster.cli import app
    from cluster.cli import status as status_cmd

    snap = _snapshot()
    monkeypatch.setattr(status_cmd, "running_state", lambda cfg: {"admin": {"url": "-"}})
    monkeypatch.setattr(status_cmd, "fetch_status", lambda cfg, state, timeout=10.0: snap)
    env = {"TIERFLOW_STATE_DIR": str(tmp_path), "COLUMNS": "80"}
    reason = snap["autoscaling"]["collector"]["reason"]  # type: ignore[index]

    narrow = CliRunner().invoke(app, ["status"], env=env)
    assert narrow.exit_code == 0, narrow.output
    _lines_fit(narrow.output)
    out = narrow.output
    for title in ("services", "ray nodes", "supervised actors", "roles", "analysis"):
        assert title in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert {"collector", "logger", "bridge", "gateway", "meetup_topn"} <= set(rows)
    assert "4 (1 silent)" in rows["collector"] and "-> 5" in rows["collector"]
    assert NODE not in out and reason not in out

    wide = CliRunner().invoke(app, ["status", "--wide"], env=env)
    assert wide.exit_code == 0, wide.output
    assert NODE in wide.output and reason in wide.output and "per node" in wide.output
    assert "accepted 20431.2 rejected 12.5 overloaded 0" in wide.output

    as_json = CliRunner().invoke(app, ["status", "--json"], env=env)
    assert json.loads(as_json.output) == {"running": True, **snap}


@pytest.mark.unit
def test_fit_widths_gives_way_with_the_flexible_columns_first() -> None:
    from cluster.tables import fit_widths, truncate

    # room enough: nothing changes
    assert fit_widths([10, 5, 40], [4, 3, 5], [False, False, True], 60) == [10, 5, 40]
    # the flexible column shrinks alone while it can
    assert fit_widths([10, 5, 40], [4, 3, 5], [False, False, True], 30) == [10, 5, 15]
    # then the others, widest first, never below their minimum
    assert fit_widths([10, 5, 40], [4, 3, 5], [False, False, True], 14) == [4, 5, 5]
    assert fit_widths([10, 5, 40], [4, 3, 5], [False, False, True], 1) == [4, 3, 5]
    assert truncate("abcdef", 4) == "abc…" and truncate("abc", 4) == "abc"
