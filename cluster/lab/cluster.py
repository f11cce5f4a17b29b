"""tierflow on a lab, as a user runs it on a cluster: NATS and Ray nodes on every host, the
pipeline submitted from the laptop with `ray job submit`, its endpoints asked of Ray.

`LabCluster` owns the engines it starts; the job's actors live in the hosts' Ray nodes and
end with them (`Lab.down` stops every process inside the hosts).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from cluster.demo.meetup import meetup_jobs
from cluster.lab.hosts import Lab, LabError
from cluster.lab.services import RayNodes, lab_nats, ray_cli, ray_env
from runtime.config import toml_text
from runtime.nats.server import NatsServer

__all__ = ["LabCluster", "REPO"]

REPO = Path(__file__).resolve().parents[2]


@dataclass
class LabCluster:
    lab: Lab
    work: Path
    namespace: str = field(default_factory=lambda: f"lab-{uuid.uuid4().hex[:6]}")
    nats: list[NatsServer] = field(default_factory=list)
    ray: RayNodes | None = None
    job_id: str = ""

    # ---- engines ------------------------------------------------------------------------------

    def start_engines(self, timeout: float = 180.0) -> None:
        self.nats = lab_nats(self.lab, self.work / "nats")
        for server in self.nats:
            server.start(timeout=60)
        self.ray = RayNodes(self.lab, self.work)
        self.ray.start(timeout)
        self.wait_ray_nodes(len(self.lab.hosts()), timeout)
        self.ray.keep(lambda host: self.nats_on(host).running)

    def close(self) -> None:
        """Stop keeping the Ray nodes (the lab's `down` stops the processes)."""
        if self.ray is not None:
            self.ray.unkeep()

    @property
    def nats_url(self) -> str:
        return ",".join(s.url for s in self.nats)

    def nats_on(self, host: str) -> NatsServer:
        return next(s for s in self.nats if s.server_name == host)

    def ask_ray(self, code: str, timeout: float = 120.0) -> Any:
        """Run `code` in a Ray driver on the laptop (a process of its own: this one may hold
        another Ray); `code` sets `out`, returned as JSON."""
        assert self.ray is not None
        script = (
            "import json, ray\n"
            f"ray.init(address={self.ray.address!r}, namespace={self.namespace!r}, "
            "log_to_driver=False)\n"
            "out = None\n" + textwrap.dedent(code) + "\nprint('@@' + json.dumps(out))\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script],
            env=ray_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        marks = [line for line in done.stdout.splitlines() if line.startswith("@@")]
        if done.returncode != 0 or not marks:
            raise LabError(f"Ray driver failed: {done.stderr[-2000:]}")
        return json.loads(marks[-1][2:])

    def wait_ray_nodes(self, n: int, timeout: float) -> list[str]:
        """Until `n` Ray nodes are alive; their addresses."""
        code = f"""
        import time
        deadline = time.time() + {timeout}
        while time.time() < deadline:
            out = sorted(x["NodeManagerAddress"] for x in ray.nodes() if x["Alive"])
            if len(out) >= {n}:
                break
            time.sleep(0.5)
        """
        alive = list(self.ask_ray(code, timeout=timeout + 60))
        if len(alive) < n:
            raise LabError(f"only {len(alive)} of {n} Ray nodes alive: {alive}")
        return alive

    # ---- the pipeline as a Ray job --------------------------------------------------------------

    def config(self, extra: str = "", *, watermark: str = "10 minutes") -> Path:
        """The job's tierflow.toml: every role on its node's address, NATS on every host,
        streams R3 (of up to three hosts); the logger's extra replica is the default's
        ("auto": one on three hosts, so one host cut off leaves each group writable). The
        Meetup queries keyed by event time get a `watermark` longer than any fault holds an
        event back: their answers then equal an exact recount unless something was lost."""
        path = self.work / "tierflow.toml"
        windowed = [msgspec.to_builtins(j) for j in meetup_jobs(watermark=watermark) if j.window]
        path.write_text(
            f'state_dir = "{self.work / "state"}"\n'
            + toml_text({"jobs": windowed})
            + '[streams.meetup]\nsubjects = ["raw.meetup"]\n'
            + f'[nats]\nurl = "{self.nats_url}"\nstream_replicas = {min(3, len(self.nats))}\n'
            f'[ray]\nnamespace = "{self.namespace}"\n'
            '[roles.collector]\nhost = "node"\nreplicas = 3\n'
            '[roles.gateway]\nhost = "node"\nreplicas = 2\n'
            '[spark]\nmaster = "local[1]"\n' + extra
        )
        return path

    def submit(self, config: Path) -> str:
        assert self.ray is not None
        self.job_id = f"tierflow-lab-{uuid.uuid4().hex[:8]}"
        done = self._ray_cli(
            "job",
            "submit",
            "--address",
            self.ray.dashboard,
            "--submission-id",
            self.job_id,
            "--working-dir",
            str(REPO),
            "--no-wait",
            "--",
            "python",
            "-m",
            "cluster.demo",
            "--config",
            str(config),
        )
        if done.returncode != 0:
            raise LabError(f"ray job submit: {done.stderr[-2000:]}")
        return self.job_id

    def job_logs(self) -> str:
        assert self.ray is not None
        done = self._ray_cli("job", "logs", "--address", self.ray.dashboard, self.job_id)
        return (done.stdout + done.stderr)[-6000:]

    def stop_job(self) -> None:
        if self.ray is not None and self.job_id:
            self._ray_cli("job", "stop", "--address", self.ray.dashboard, self.job_id)

    def _ray_cli(self, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        return ray_cli(*args, timeout=timeout, cwd=REPO)

    def endpoints(self, names: Mapping[str, int], timeout: float = 300.0) -> dict[str, Any]:
        """Each role's replicas' `endpoints()` (role -> replica count), once all answer."""
        wanted = [f"{role}-{i}" for role, n in names.items() for i in range(n)]
        code = f"""
        import time
        deadline = time.time() + {timeout}
        while time.time() < deadline:
            try:
                out = {{n: ray.get(ray.get_actor(n).endpoints.remote(), timeout=10)
                        for n in {wanted!r}}}
                break
            except Exception:
                time.sleep(1)
        """
        found = self.ask_ray(code, timeout=timeout + 60)
        if not found:
            raise LabError(f"the pipeline's {wanted} did not answer in {timeout}s")
        return dict(found)

    def addresses(self, collectors: int = 3, gateways: int = 2) -> tuple[list[str], list[str]]:
        """Every collector's and every gateway's URL as the actors report them now (an
        actor Ray restarted on another node moved), the way a producer or a client is
        given them (`tierflow status`)."""
        found = self.endpoints({"collector": collectors, "gateway": gateways})

        def urls(role: str) -> list[str]:
            return sorted({e["url"] for n, e in found.items() if n.startswith(role)})

        return urls("collector"), urls("gateway")

    def hosts_of(self, names: list[str]) -> dict[str, str]:
        """The address of the node each named actor runs on."""
        assert self.ray is not None
        code = f"""
        from ray.util.state import list_actors
        nodes = {{x["NodeID"]: x["NodeManagerAddress"] for x in ray.nodes()}}
        # the state API finds "the" Ray instance by itself, and this machine may run others
        alive = list_actors(
            address={self.ray.dashboard!r}, filters=[("state", "=", "ALIVE")], limit=10000
        )
        out = {{a.name: nodes.get(a.node_id, "?") for a in alive if a.name in {names!r}}}
        """
        return dict(self.ask_ray(code))

    # ---- faults ---------------------------------------------------------------------------------

    def restart_host(self, host: str) -> None:
        """After a crash: the host's NATS node on its own store, its Ray node again."""
        assert self.ray is not None
        if host == self.ray.head_host:
            raise LabError("restarting the Ray head is not supported by the lab")
        self.nats_on(host).restart(timeout=60)
        self.ray.ensure_worker(host)


@contextmanager
def pipeline_lab(work: Path, hosts: int = 3) -> Iterator[LabCluster]:
    """A lab of `hosts` hosts with its engines and the pipeline submitted as a Ray job;
    the job stopped, the engines and the lab taken down on the way out."""
    with Lab.up(hosts, work / "records") as lab:
        lc = LabCluster(lab, work)
        lc.start_engines()
        lc.submit(lc.config())
        try:
            yield lc
        finally:
            lc.stop_job()
            lc.close()
