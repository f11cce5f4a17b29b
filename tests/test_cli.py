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


def test_up_detach_status_down_leaves_no_process(cli_env: dict[str, str], tmp_path: Path) -> None:
    cfg = load(environ=cli_env)
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

        # The collection tier runs: an event posted to the collector is counted by the
        # live logger replicas that `logger inspect` asks.
        req = urllib.request.Request(
            state["collector"]["url"] + "/v1/streams/meetup/events",
            data=b'{"id": "cli-1"}',
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert json.loads(resp.read())["ids"] == ["cli-1"]
        inspect = run(["logger", "inspect", "--json"], cli_env)
        assert inspect.returncode == 0, inspect.stderr
        replicas = json.loads(inspect.stdout)
        assert len(replicas) == 2 and all(r["state"] == "running" for r in replicas)
        assert {r["epoch"] for r in replicas} == {1}

        # The data access tier runs too: the dashboard is served at the gateway's root.
        with urllib.request.urlopen(state["gateway"]["url"] + "/", timeout=30) as resp:
            assert resp.status == 200 and b"tierflow" in resp.read()

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
        # Everything that runtime spawned by now is ours to stop.
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

    from runtime.nats import connect

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
            nc = await connect(urls)
            js = nc.jetstream()
            await js.add_stream(name="r3", subjects=["r3.>"], num_replicas=3)
            for i in range(20):
                await js.publish("r3.x", str(i).encode(), headers={"Nats-Msg-Id": str(i)})
            info = await js.stream_info("r3")
            await nc.close()
            assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2
            return info.state.messages

        assert asyncio.run(r3_round_trip()) == 20
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    assert runstate.wait_gone(servers, 10) == []


def test_jobs_start_list_stop_against_a_detached_runtime(cli_env: dict[str, str]) -> None:
    """`tierflow jobs` joins the running runtime's Ray, starts the analysis driver on
    demand, and a real Spark query consumes what the collector accepted."""
    from cluster.demo.rsvps import RsvpGenerator
    from runtime.waiting import wait_until

    assert run(["up", "--detach"], cli_env).returncode == 0
    try:
        listed = run(["jobs", "list", "--json"], cli_env)
        assert listed.returncode == 0, listed.stderr
        assert {"name": "meetup_responses", "state": "available"}.items() <= next(
            r for r in json.loads(listed.stdout) if r["name"] == "meetup_responses"
        ).items()
        started = run(["jobs", "start", "meetup_responses", "--json"], cli_env, timeout=300)
        assert started.returncode == 0, started.stderr
        state = runstate.read_state(load(environ=cli_env))
        rsvps = RsvpGenerator(3).take(50)
        body = "\n".join(json.dumps(r) for r in rsvps).encode()
        req = urllib.request.Request(
            state["collector"]["url"] + "/v1/streams/meetup/events",
            data=body,
            headers={"Content-Type": "application/x-ndjson"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert json.loads(resp.read())["accepted"] == 50

        def processed() -> bool:
            rows = json.loads(run(["jobs", "list", "--json"], cli_env).stdout)
            row = next(r for r in rows if r["name"] == "meetup_responses")
            # committed_seq is the next stream sequence the query will read
            return (row.get("committed_seq") or 0) > 50 and row.get("results", 0) > 0

        wait_until(processed, timeout=240, interval=2, what="the job processed the RSVPs")
        stopped = run(["jobs", "stop", "meetup_responses", "--json"], cli_env)
        assert stopped.returncode == 0 and json.loads(stopped.stdout)[0]["stopped"]
    finally:
        assert run(["down"], cli_env).returncode == 0
