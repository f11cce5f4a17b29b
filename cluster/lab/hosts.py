"""`Lab`: a lab of network-namespace hosts, made, used and unmade by pid.

Every lab writes its record (`LabRecord`: its plan, the pid and start time of the process
that owns it, and every pid it started) under `RECORDS` before it makes anything, so a lab
whose owner was killed is found and unmade by the next `Lab.up`; a lab whose owner still
runs is left alone (another test's). Processes started in a host are recorded; at the end
every process still inside one of the lab's namespaces is stopped too (`ip netns pids`:
a daemon that `ray start` forked is in the namespace whoever its parent is). Nothing is
ever stopped by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

import psutil

from cluster.lab.plan import LabPlan, LabPlanError
from runtime.errors import TierflowError

__all__ = [
    "RECORDS",
    "Lab",
    "LabError",
    "LabRecord",
    "lab_on_record",
    "lab_unavailable",
    "labs_on_record",
]

RECORDS = Path(os.environ.get("TIERFLOW_LAB_RECORDS", "/run/tierflow-lab"))
PREFIX_BASE = "10.213"  # labs take 10.213.<k>.0/24, k the first free
STOP_GRACE_S = 5.0


class LabError(TierflowError, RuntimeError):
    """A lab command failed; the message has the command and its error output."""


@dataclass
class LabRecord:
    plan: dict[str, object]
    owner_pid: int
    owner_started: float
    pids: list[int] = field(default_factory=list)

    def owner_alive(self) -> bool:
        """Whether the lab's owner still runs; a kept lab (owner 0: `tierflow lab up`) always
        counts as owned until `lab down`."""
        if self.owner_pid == 0:
            return True
        try:
            p = psutil.Process(self.owner_pid)
            return abs(p.create_time() - self.owner_started) < 1.0
        except psutil.Error:
            return False


def lab_unavailable() -> str | None:
    """Why this machine cannot make a lab (not root, no `ip`, namespaces refused), or None."""
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "the lab needs iproute2's `ip`"
    probe = f"tfl-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"network namespaces are refused here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def labs_on_record(records: Path = RECORDS) -> dict[str, LabRecord]:
    out: dict[str, LabRecord] = {}
    for path in sorted(records.glob("*.json")) if records.is_dir() else []:
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            out[path.stem] = LabRecord(**json.loads(path.read_text()))
    return out


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(cmd)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def namespace_pids(netns: str) -> list[int]:
    """Every process inside `netns` now (none when it is gone)."""
    done = _run(["ip", "netns", "pids", netns], check=False)
    return [int(x) for x in done.stdout.split() if x.isdigit()] if done.returncode == 0 else []


class Lab:
    """One lab; `Lab.up(hosts)` makes it, `down()` unmakes it (also as a context manager)."""

    def __init__(self, plan: LabPlan, records: Path = RECORDS, *, keep: bool = False) -> None:
        self.plan = plan
        self.records = records
        self.keep = keep
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    # ---- making and unmaking --------------------------------------------------------------

    @classmethod
    def up(
        cls, hosts: int, records: Path = RECORDS, lab_id: str | None = None, *, keep: bool = False
    ) -> Lab:
        """Clean up labs whose owners are gone, then make a new one on the first free /24.
        `keep`: the lab outlives this process (until `down`), as `tierflow lab up` makes it."""
        records.mkdir(parents=True, exist_ok=True)
        for stale in clean_stale(records):
            print(f"lab: cleaned up lab {stale} left by a run that is gone")
        taken = {str(r.plan.get("prefix")) for r in labs_on_record(records).values()}
        prefix = next(
            (f"{PREFIX_BASE}.{k}" for k in range(256) if f"{PREFIX_BASE}.{k}" not in taken), None
        )
        if prefix is None:
            raise LabError("every 10.213.k.0/24 is taken by a running lab")
        plan = LabPlan(lab_id or secrets.token_hex(3)[:5], hosts, prefix)
        lab = cls(plan, records, keep=keep)
        lab._write()  # before anything exists: a kill from here on is cleaned up later
        try:
            for cmd in plan.up_commands():
                _run(cmd)
        except BaseException:
            lab.down()
            raise
        return lab

    def down(self) -> None:
        """Stop every process the lab started or holds, delete its namespaces and bridges,
        and its record."""
        stop_lab_processes(self.plan, list(self.procs))
        for proc in self.procs.values():
            with contextlib.suppress(Exception):
                proc.wait(timeout=1)
        for cmd in self.plan.down_commands():
            _run(cmd, check=False)
        with contextlib.suppress(FileNotFoundError):
            self._record_path().unlink()

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _record_path(self) -> Path:
        return self.records / f"{self.plan.lab_id}.json"

    def _write(self) -> None:
        me = psutil.Process()
        owner, started = (0, 0.0) if self.keep else (me.pid, me.create_time())
        rec = LabRecord(asdict(self.plan), owner, started, sorted(self.procs))
        tmp = self._record_path().with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(rec)))
        tmp.replace(self._record_path())

    # ---- processes in hosts ----------------------------------------------------------------

    def spawn(
        self,
        host: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
        cwd: str | Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` inside `host` (its own session, so a fault can stop its group);
        recorded for `down`. Output to `log` (appended), else discarded."""
        out: IO[bytes] | int = subprocess.DEVNULL
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            out = log.open("ab")
        try:
            proc = subprocess.Popen(
                [*self.plan.exec_prefix(host), *argv],
                env=dict(env) if env is not None else None,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=cwd,
                start_new_session=True,
            )
        finally:
            if not isinstance(out, int):
                out.close()
        self.procs[proc.pid] = proc
        self._write()
        return proc

    def run(self, host: str, argv: Sequence[str], timeout: float = 60.0) -> str:
        """Run `argv` inside `host` to its end; its output, or LabError."""
        done = subprocess.run(
            [*self.plan.exec_prefix(host), *argv], capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise LabError(f"{host}: {' '.join(argv)}: {done.stderr.strip()}")
        return done.stdout

    def pids(self, host: str) -> list[int]:
        """Every process inside `host` now."""
        return namespace_pids(self.plan.netns(host))

    def address(self, host: str) -> str:
        return self.plan.address(host)

    def hosts(self) -> list[str]:
        return self.plan.host_names()

    # ---- network ----------------------------------------------------------------------------

    def link(self, host: str, up: bool) -> None:
        for cmd in self.plan.link_commands(host, up):
            _run(cmd)

    def isolate(self, group: Sequence[str]) -> None:
        for cmd in self.plan.isolate_commands(group):
            _run(cmd)

    def rejoin(self, group: Sequence[str]) -> None:
        for cmd in self.plan.rejoin_commands(group):
            _run(cmd, check=False)

    def signal_host(self, host: str, sig: signal.Signals) -> list[int]:
        """Send `sig` to every process inside `host`; the pids it reached."""
        hit = []
        for pid in self.pids(host):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                hit.append(pid)
        return hit

    def status(self) -> dict[str, object]:
        return {
            "lab": self.plan.lab_id,
            "laptop": self.plan.laptop,
            "hosts": {
                h: {"address": self.address(h), "netns": self.plan.netns(h), "pids": self.pids(h)}
                for h in self.hosts()
            },
        }


def stop_lab_processes(plan: LabPlan, started: Iterable[int] = ()) -> None:
    """SIGTERM `started` (this run's own children) and every process inside the lab's
    namespaces, SIGKILL what outlives the grace (bounded). A gone run's recorded pids are
    never signalled: the system may have given them to others since; its processes are
    found inside its namespaces instead."""
    targets: set[int] = set(started)
    for ns in plan.namespaces():
        targets.update(namespace_pids(ns))
    for pid in targets:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and any(_alive(p) for p in targets):
        time.sleep(0.1)
    for ns in plan.namespaces():
        targets.update(namespace_pids(ns))
    for pid in targets:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def clean_stale(records: Path = RECORDS) -> list[str]:
    """Unmake every lab on record whose owner is gone; their ids."""
    cleaned = []
    for lab_id, rec in labs_on_record(records).items():
        if rec.owner_alive():
            continue
        try:
            plan = LabPlan(**rec.plan)  # type: ignore[arg-type]
        except (LabPlanError, TypeError):
            (records / f"{lab_id}.json").unlink(missing_ok=True)
            continue
        stop_lab_processes(plan)
        for cmd in plan.down_commands():
            _run(cmd, check=False)
        (records / f"{lab_id}.json").unlink(missing_ok=True)
        cleaned.append(lab_id)
    return cleaned


def lab_on_record(lab_id: str, records: Path = RECORDS) -> Lab:
    """The lab `lab_id` as its record describes it (to stop, inspect or fault it)."""
    rec = labs_on_record(records).get(lab_id)
    if rec is None:
        raise LabError(f"no lab {lab_id!r} on record in {records}")
    return Lab(LabPlan(**rec.plan), records, keep=rec.owner_pid == 0)  # type: ignore[arg-type]
