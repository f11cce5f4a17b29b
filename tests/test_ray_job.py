"""The pipeline as a Ray job: `ray start --head` on loopback, `ray job submit --working-dir .`,
events in through the collector, results out through the gateway, `ray job stop`.

Everything is real and started here: a Ray head (its own temp dir, free ports), an external
nats-server (the configured NATS), and the job itself, which runs `python -m cluster.demo`
from the uploaded working dir. Teardown stops exactly the processes of that head (found by
its temp dir) and the nats-server pid, and checks none is left.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import psutil
import pytest

from cluster.demo.meetup import reference
from cluster.demo.rsvps import RsvpGenerator
from cluster.lab.services import ray_cli
from cluster.loadgen import drive
from cluster.verify import judge, stream_ids
from runtime.nats.server import PORT_ATTEMPTS, NatsServer, connect, free_port, free_ports
from runtime.waiting import await_until, wait_until

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _ray(*args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    return ray_cli(*args, timeout=timeout, cwd=REPO)


def _head_processes(temp_dir: str) -> list[psutil.Process]:
    """The head's daemons (their command lines name its temp dir) and all their children."""
    found: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in arg for arg in p.info["cmdline"] or ()):
                found[p.pid] = p
                for c in p.children(recursive=True):
                    found[c.pid] = c
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return list(found.values())


def _stop_processes(procs: list[psutil.Process], grace_s: float = 5.0) -> list[int]:
    """SIGTERM these pids, SIGKILL what outlives the grace; returns the pids still alive."""
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    _, alive = psutil.wait_procs(alive, timeout=10)
    return [p.pid for p in alive]


def _held(port: int) -> bool:
    """Another process listens on `port` (binding it as a server would fails)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no holder
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


class Head:
    def __init__(self) -> None:
        # short: Ray's AF_UNIX socket paths under it must stay under 108 bytes
        self.temp_dir = tempfile.mkdtemp(prefix="tfj", dir="/tmp")
        self.dashboard_port = 0
        self.dashboard = ""

    def start(self) -> None:
        """`ray start --head` on ports chosen now. Another process may take one before
        Ray binds it (Ray refuses a taken dashboard port; the GCS fails on its own): then
        this head's processes are stopped and it starts again on new ports, at most
        `PORT_ATTEMPTS` times."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            gcs, self.dashboard_port, client, agent = ports = free_ports(4)
            self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
            out = _ray(
                "start",
                "--head",
                "--node-ip-address=127.0.0.1",
                f"--port={gcs}",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard_port}",
                f"--ray-client-server-port={client}",
                f"--dashboard-agent-listen-port={agent}",
                "--num-cpus=2",
                f"--temp-dir={self.temp_dir}",
                "--include-dashboard=true",
                "--disable-usage-stats",
            )
            if out.returncode == 0:
                return
            left = self.stop()
            assert not left, f"processes of a failed Ray head outlived SIGKILL: {left}"
            text = out.stdout + out.stderr
            taken = [p for p in ports if _held(p)]
            said = "already occupied" in text or "address already in use" in text.lower()
            if not ((taken or said) and attempt < PORT_ATTEMPTS):
                raise AssertionError(
                    f"ray start failed (ports {ports}, taken by another process: {taken}):\n"
                    + out.stdout[-3000:]
                    + out.stderr[-3000:]
                )

    def stop(self) -> list[int]:
        return _stop_processes(_head_processes(self.temp_dir))


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    h = Head()
    try:
        h.start()
        yield h
    finally:
        left = h.stop()
        assert not left, f"processes of the Ray head outlived SIGKILL: {left}"
        assert not _head_processes(h.temp_dir)
        shutil.rmtree(h.temp_dir, ignore_errors=True)


def _job_status(head: Head, job_id: str) -> str:
    out = _ray("job", "status", "--address", head.dashboard, job_id, timeout=60)
    text = out.stdout + out.stderr
    if "' was stopped" in text:  # how the CLI reports STOPPED
        return "STOPPED"
    for state in ("PENDING", "RUNNING", "SUCCEEDED", "FAILED"):
        if f": {state}" in text:
            return state
    return f"UNKNOWN: {text[-500:]}"


def _job_logs(head: Head, job_id: str) -> str:
    out = _ray("job", "logs", "--address", head.dashboard, job_id, timeout=60)
    return (out.stdout + out.stderr)[-6000:]


def _role_processes(temp_dir: str) -> dict[int, str]:
    """pid -> name of every tierflow actor process and Spark JVM under the head."""
    roles = ("Collector", "LoggerReplica", "BrokerBridge", "Gateway", "AnalysisDriver")
    found: dict[int, str] = {}
    for p in _head_processes(temp_dir):
        try:
            name = p.name()
            title = " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            continue
        if name == "java" or any(f"ray::{r}" in title for r in roles):
            found[p.pid] = "java" if name == "java" else _role_title(title)
    return found


def _role_title(title: str) -> str:
    """``ray::<Class>`` from a worker's process title: a busy worker's title also names the
    method it runs (``ray::Collector.heartbeat``), an idle one's only the class."""
    return title.split()[0].split(".", 1)[0]


@pytest.mark.unit
def test_a_busy_worker_title_still_names_its_role() -> None:
    """Ray titles a worker running a call ``ray::Collector.heartbeat`` (a fresh clone's
    `make test` failed on it once): the role is the class, whatever the worker is doing."""
    assert _role_title("ray::Collector") == "ray::Collector"
    assert _role_title("ray::Collector.heartbeat") == "ray::Collector"
    assert _role_title("ray::AnalysisDriver.status --flag x") == "ray::AnalysisDriver"
    assert _role_title("ray::IDLE") == "ray::IDLE"


async def _kv(session: aiohttp.ClientSession, gateway: str) -> dict[str, Any]:
    async with session.get(f"{gateway}/v1/kv/results") as resp:
        assert resp.status == 200, await resp.text()
        body = msgspec.json.decode(await resp.read())
    return {e["key"]: e["value"] for e in body["entries"]}


async def test_ray_job_submit_runs_the_pipeline_and_job_stop_leaves_nothing(
    head: Head, nats_server: NatsServer, tmp_path: Path
) -> None:
    collector, gateway, admin = free_port(), free_port(), free_port()
    config = tmp_path / "tierflow.toml"
    config.write_text(
        f'state_dir = "{tmp_path / "state"}"\n'
        f'[nats]\nurl = "{nats_server.url}"\n'
        f'[ray]\nnamespace = "tierflow-job-{uuid.uuid4().hex[:6]}"\n'
        f"[roles.collector]\nport = {collector}\n"
        f"[roles.gateway]\nport = {gateway}\n"
        f"[admin]\nport = {admin}\n"
        '[spark]\nmaster = "local[1]"\n'
    )
    job_id = f"tierflow-test-{uuid.uuid4().hex[:8]}"
    submitted = _ray(
        "job",
        "submit",
        "--address",
        head.dashboard,
        "--submission-id",
        job_id,
        "--working-dir",
        ".",
        "--no-wait",
        "--runtime-env-json",
        '{"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "90"}}',
        "--",
        "python",
        "-m",
        "cluster.demo",
        "--config",
        str(config),
    )
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    gateway_url = f"http://127.0.0.1:{gateway}"
    collector_url = f"http://127.0.0.1:{collector}"

    def serving() -> bool:
        state = _job_status(head, job_id)
        assert state in ("PENDING", "RUNNING"), f"job {state}:\n{_job_logs(head, job_id)}"
        return _healthy(f"{gateway_url}/healthz")

    try:
        wait_until(serving, timeout=240, interval=2.0, what="the job's gateway serving")
        rsvps = RsvpGenerator(seed=7).take(300)
        events = [{**r, "id": f"job-rsvp-{i}"} for i, r in enumerate(rsvps)]
        load = await drive(collector_url, "meetup", events, batch=50, concurrency=4)
        assert len(load.acknowledged) == len(events), load
        want = reference(rsvps)["meetup_topn"]["all"]

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:

            async def topn_done() -> dict[str, Any] | None:
                row = (await _kv(session, gateway_url)).get("meetup_topn.all")
                return row if row and row.get("events") == len(events) else None

            got = await await_until(topn_done, timeout=240, interval=1.0, what="top-N of the RSVPs")
        assert [t["item"] for t in got["top"]] == [t["item"] for t in want["top"]]
        assert [t["count"] for t in got["top"]] == [t["count"] for t in want["top"]]

        nc = await connect(nats_server.url)
        try:
            verdict = judge(load.acknowledged, await stream_ids(nc, "meetup"))
        finally:
            await nc.close()
        assert verdict.ok, verdict

        actors = _role_processes(head.temp_dir)
        names = set(actors.values())
        for role in ("Collector", "LoggerReplica", "BrokerBridge", "Gateway", "AnalysisDriver"):
            assert f"ray::{role}" in names, names
        assert "java" in names, names
    except BaseException:
        print(_job_logs(head, job_id))
        raise
    finally:
        stopped = _ray("job", "stop", "--address", head.dashboard, job_id, timeout=180)
    assert stopped.returncode == 0, stopped.stdout[-2000:] + stopped.stderr[-2000:]
    assert _job_status(head, job_id) == "STOPPED"
    logs = _job_logs(head, job_id)
    assert '"tierflow": "stopped"' in logs, logs  # the clean path ran, not SIGKILL

    def all_gone() -> bool:
        return not any(psutil.pid_exists(p) for p in actors)

    wait_until(all_gone, timeout=60, what=f"actor processes {sorted(actors)} gone")
    for port in (collector, gateway, admin):
        assert not _listening(port), f"port {port} still open after job stop"


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_head_processes_are_found_by_temp_dir_only() -> None:
    """The pid finder must not match other processes: a fresh temp dir names none."""
    none = tempfile.mkdtemp(prefix="tfj-none-", dir="/tmp")
    assert _head_processes(none) == []
    os.rmdir(none)
    # and finds a process whose command line names it (no directory needed)
    tmp = f"/tmp/tfj-{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", tmp])
    try:
        # until the child has exec'd, its command line is still the parent's
        found = wait_until(lambda: _head_processes(tmp), timeout=30, what="the child exec'd")
        assert [p.pid for p in found] == [proc.pid]
        assert _stop_processes(_head_processes(tmp), grace_s=5) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(5)
