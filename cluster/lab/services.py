"""Engines on a lab's hosts, started as on real machines: one NATS JetStream node and one
Ray node per host, each bound to its host's address.

NATS: a cluster of every host (full routes, streams R3 where there are three hosts), ports
fixed (each host has its own port space, as a machine has). Ray: the head on the first
host, workers on the others (`ray start --node-ip-address <host>`, token auth, a temp dir
per host), each kept in the foreground (`--block`) so its pid is the lab's; the daemons it
forks stay in the host's namespace, where `Lab.down` finds them. Ray's own stop command is
never run: it ends every Ray process on the machine.

A worker node the Ray head declared dead (cut off past its health checks) ends itself when
it hears so: `RayNodes.keep` starts it again, as a cluster's node manager (KubeRay, the
autoscaler, systemd) does on real machines.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cluster.lab.hosts import Lab, LabError
from runtime.nats.server import PORT_SLICE_ENV, NatsServer

__all__ = ["NATS_PORT", "RAY_PORT", "RayNodes", "lab_nats", "ray_cli", "ray_env"]

NATS_PORT, NATS_MONITOR_PORT, NATS_ROUTE_PORT = 4222, 8222, 6222
RAY_PORT, RAY_DASHBOARD_PORT = 6379, 8265
# every port of a Ray node fixed (each host has its own port space, as a machine has): a
# node told its agents' ports does not wait for them to write port files, which a loaded
# machine lets time out ("Timed out waiting for file ... metrics_agent_port")
RAY_NODE_PORTS = (
    "--node-manager-port=6380",
    "--object-manager-port=6381",
    "--dashboard-agent-grpc-port=6382",
    "--dashboard-agent-listen-port=6383",
    "--metrics-export-port=6384",
    "--runtime-env-agent-port=6385",
    "--min-worker-port=11000",
    "--max-worker-port=11999",
)
BIN = Path(sys.executable).parent


def lab_nats(lab: Lab, base_dir: Path, *, sync_interval: str = "always") -> list[NatsServer]:
    """One nats-server per host in one JetStream cluster (not started: `start()` each, then
    wait for the cluster with `wait_healthy`)."""
    hosts = lab.hosts()
    routes = [f"nats-route://{lab.address(h)}:{NATS_ROUTE_PORT}" for h in hosts]
    return [
        NatsServer(
            store_dir=base_dir / h,
            host=lab.address(h),
            port=NATS_PORT,
            monitor_port=NATS_MONITOR_PORT,
            sync_interval=sync_interval,
            server_name=h,
            cluster_name="lab" if len(hosts) > 1 else None,
            cluster_port=NATS_ROUTE_PORT if len(hosts) > 1 else 0,
            routes=[r for r, other in zip(routes, hosts, strict=True) if other != h],
            exec_prefix=lab.plan.exec_prefix(h),
        )
        for h in hosts
    ]


# The head declares a node dead after this many missed health checks, 3 s apart (Ray's
# default is 5: a cut of 25-30 s). A node declared dead ends itself when the cut heals,
# with every actor on it, and on a cut of the head's host that is every worker. tierflow's
# own failover acts within seconds (the logger's in-sync set, producers and clients moving
# to another address, NATS's election), so Ray's heavy one waits out a cut of a minute;
# cluster/ray-cluster.yaml starts the head the same way.
RAY_PARTITION_TOLERANCE = {"RAY_health_check_failure_threshold": "20"}


def ray_env() -> dict[str, str]:
    """The environment of Ray's CLI, Ray's nodes and drivers on the laptop: this venv first
    on PATH; no `TIERFLOW_*` config override (another host has its own environment, and a
    job reads its own config); token auth (Ray 2.60's default for a new head; the token file
    is shared, as the hosts share this machine's file system)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TIERFLOW_") or k == PORT_SLICE_ENV  # test workers' port shares
    }
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["RAY_AUTH_MODE"] = "token"
    env.update(RAY_PARTITION_TOLERANCE)
    env.pop("RAY_ADDRESS", None)
    return env


def ray_cli(
    *args: str, timeout: float = 300.0, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """This venv's `ray` command (`ray job submit`, `ray job logs` ...) with `ray_env`."""
    return subprocess.run(
        [str(BIN / "ray"), *args],
        env=ray_env(),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@dataclass
class RayNodes:
    """A Ray cluster over the lab: head on `lab.hosts()[0]`."""

    lab: Lab
    base_dir: Path
    cpus_per_host: int = 1
    temp_dirs: dict[str, Path] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)  # by the keeper, per host
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _keeper: threading.Thread | None = field(default=None, repr=False)

    @property
    def head_host(self) -> str:
        return self.lab.hosts()[0]

    @property
    def address(self) -> str:
        return f"{self.lab.address(self.head_host)}:{RAY_PORT}"

    @property
    def dashboard(self) -> str:
        return f"http://{self.lab.address(self.head_host)}:{RAY_DASHBOARD_PORT}"

    def _temp_dir(self, host: str) -> Path:
        # short: Ray's AF_UNIX socket paths under it must stay under 108 bytes
        path = Path("/tmp") / f"tfl{self.lab.plan.lab_id}{host}"
        path.mkdir(parents=True, exist_ok=True)
        self.temp_dirs[host] = path
        return path

    def _start_node(self, host: str, *role: str) -> None:
        """`ray start` inside `host`, in the foreground (its pid the lab's), `role` being
        the head's or a worker's own options."""
        self.procs[host] = self.lab.spawn(
            host,
            [
                str(BIN / "ray"),
                "start",
                *role,
                f"--node-ip-address={self.lab.address(host)}",
                f"--temp-dir={self._temp_dir(host)}",
                f"--num-cpus={self.cpus_per_host}",
                *RAY_NODE_PORTS,
                "--disable-usage-stats",
                "--block",
            ],
            env=ray_env(),
            log=self.base_dir / f"ray-{host}.log",
        )

    def start_head(self, timeout: float = 180.0) -> None:
        addr = self.lab.address(self.head_host)
        self._start_node(
            self.head_host,
            "--head",
            f"--port={RAY_PORT}",
            f"--dashboard-host={addr}",
            f"--dashboard-port={RAY_DASHBOARD_PORT}",
        )
        self._wait_dashboard(timeout)

    def start_worker(self, host: str) -> None:
        self._start_node(host, f"--address={self.address}")

    def ensure_worker(self, host: str) -> bool:
        """Start `host`'s worker node unless it runs; True when it was started."""
        with self._lock:
            proc = self.procs.get(host)
            if proc is not None and proc.poll() is None:
                return False
            self.start_worker(host)
            return True

    def keep(self, up: Callable[[str], bool], every_s: float = 1.0) -> None:
        """Until `unkeep`: start again each worker node that ended while its host is `up`
        (a crashed host is not: its engines come back with the host)."""

        def watch() -> None:
            while not self._stop.wait(every_s):  # bounded by unkeep
                for host in self.lab.hosts()[1:]:
                    if up(host) and self.ensure_worker(host):
                        self.restarts[host] = self.restarts.get(host, 0) + 1

        self._stop.clear()
        self._keeper = threading.Thread(target=watch, name="lab-ray-keeper", daemon=True)
        self._keeper.start()

    def unkeep(self) -> None:
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=10)
            self._keeper = None

    def start(self, timeout: float = 180.0) -> None:
        self.start_head(timeout)
        for host in self.lab.hosts()[1:]:
            self.start_worker(host)

    def _wait_dashboard(self, timeout: float) -> None:
        """The head's dashboard answers (any HTTP status: with token auth an anonymous
        request gets 401, which is an answer)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.dashboard}/api/version", timeout=2):
                    return
            except urllib.error.HTTPError:
                return
            except (OSError, urllib.error.URLError):
                time.sleep(0.5)
        raise LabError(f"the Ray head's dashboard {self.dashboard} did not answer in {timeout}s")
