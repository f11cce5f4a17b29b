"""A warm standby for the analysis driver: a second driver with its Spark already up that
takes the queries over when the active driver is gone.

A driver restarted by Ray needs a new JVM, a SparkContext and session and its source
registered before its first query can start (about 17 s of a 34-s recovery on an idle
2-core machine, docs/benchmarks.md). A standby has done all of that already.

Who is active is decided by a lease all hosts see: a key per driver pair (`lease_key`) in
tierflow's internal lease bucket (runtime/nats/lease.py), holding the active driver's identity
and its epoch (the revision of its term's first write). The active driver takes it before
it starts any query and renews it every ttl/3 (`LEASE_TTL_S`); a standby takes it only
when it is free: expired on the server (its holder stopped renewing `LEASE_TTL_S` ago:
dead, partitioned, or paused), released, or held by a process of this host and pid
namespace that no longer runs (a SIGKILLed driver on the node: no wait for the TTL). A
peer that is merely slow to answer keeps the queries (`takeover_action`). A driver whose
lease is lost stops writing at once (the result sink checks the lease's freshness before
every write, and puts KV values with the epoch: jobs/sink.py) and steps down.

The checkpoint store's LevelDB lock (``state_dir/checkpoints/<driver>``, an ``fcntl`` lock
the kernel drops when the process dies) stays as a second, local guard: a standby tries
the lease only while it holds the lock, so on one node the two never even race for it.
Before it starts any query the new active driver ends the old one's JVM (recorded next to
the store by `record_jvm`): two JVMs must never run one query over one checkpoint, and an
orphaned JVM leaves only about 1.5 s after its Python parent (it notices its closed
stdin), running its micro-batch meanwhile.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import psutil

from runtime.nats.lease import LeaseState
from runtime.state.checkpoint import CheckpointLockedError, CheckpointStore

log = logging.getLogger(__name__)

__all__ = [
    "EXIT_FENCED",
    "JVM_GRACE_S",
    "LEASE_TTL_S",
    "POLL_S",
    "WARM_UP_BATCHES",
    "Take",
    "end_old_jvm",
    "holder_info",
    "holder_running",
    "host_id",
    "jvm_file",
    "lease_key",
    "record_jvm",
    "should_yield",
    "standby_name",
    "step_down",
    "takeover",
    "takeover_action",
    "try_take",
]

POLL_S = 0.1  # how often a standby tries the lock
YIELD_MAX_S = 120.0  # the longest a standby waits for its peer before starting Spark
# micro-batches of the top-N plan a standby runs before it waits: a fresh JVM's first
# batches are the slow ones (quiet, 10 batches: 18.7 s the first time, 6.1 s the next)
WARM_UP_BATCHES = 3
JVM_GRACE_S = 10.0  # how long a killed JVM may take to be gone
# The pair's lease: a paused or partitioned active driver keeps the queries this long after
# its last renewal (every ttl/3), and stops writing after 2/3 of it (runtime/nats/lease.py)
LEASE_TTL_S = 10
EXIT_FENCED = 71  # a driver's exit status when it lost the pair's lease (`step_down`)
_KEY_TOKEN = re.compile(r"[^-_A-Za-z0-9]")


def lease_key(name: str) -> str:
    """The pair's lease key (both drivers of a pair share `name`)."""
    return f"analysis.{_KEY_TOKEN.sub('_', name)}"


class Take(enum.Enum):
    """What a driver may do about the pair's lease (`takeover_action`)."""

    ACQUIRE = "acquire"  # free (expired, released, never held) or still this driver's
    TAKE_FROM_GONE = "take from gone"  # its holder's process is gone: take it at its revision
    WAIT = "wait"  # another driver holds it and may still run


def takeover_action(seen: LeaseState | None, me: str, here: str, running: bool | None) -> Take:
    """Whether driver `me`, on host `here` (`host_id`), may take the pair's lease now.

    `seen` is the lease as the bucket holds it (None: free); `running` whether its
    holder's process still runs, as far as this host can tell (`holder_running`: None when
    it is on another host). The server's TTL is the only clock: a holder that is slow to
    answer, paused or cut off keeps the lease until it expired there, so two drivers never
    both hold it. Only a holder on this very host (same kernel, same pid namespace) can be
    seen to be gone, and then there is nothing to wait for."""
    if seen is None or seen.holder == me:
        return Take.ACQUIRE
    if running is False and seen.info.get("host") == here and here:
        return Take.TAKE_FROM_GONE
    return Take.WAIT


def host_id() -> str:
    """Where a pid means one process: this kernel's boot and pid namespace ("" when
    unknown, e.g. not Linux: then no holder is ever judged gone by its pid)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


def holder_info(pid: int) -> dict[str, Any]:
    """What a lease holder says about itself, so that a driver on its host can tell
    whether its process still runs (`holder_running`)."""
    try:
        started = psutil.Process(pid).create_time()
    except psutil.Error:
        started = 0.0
    return {"host": host_id(), "pid": pid, "pid_started": started}


def holder_running(info: Mapping[str, Any], here: str) -> bool | None:
    """Whether the lease holder's process (`holder_info`) still runs; None when it is not
    on this host (or did not say), so nobody here can tell."""
    if not here or info.get("host") != here or not info.get("pid"):
        return None
    try:
        proc = psutil.Process(int(info["pid"]))
        if abs(proc.create_time() - float(info.get("pid_started") or 0.0)) > 0.01:
            return False  # the pid was reused: the holder is gone
        return not _gone(proc)
    except psutil.NoSuchProcess:
        return False
    except (psutil.Error, ValueError, TypeError):
        return None


def standby_name(name: str) -> str:
    """The Ray actor name of driver `name`'s standby."""
    return f"{name}-standby"


def should_yield(peer: Mapping[str, Any] | None, *, restarted: bool) -> bool:
    """Whether a driver of the pair waits before starting its JVM and Spark session (about
    15 s of CPU; on two cores that doubled a takeover's first batch). `peer` is the other
    driver's `role_info` (None: it does not answer); `restarted`: Ray restarted this one.

    Wait while the peer is active but has not yet finished a batch of every query (the
    takeover that followed this one's death). A restarted driver also waits while the
    peer is a standby past its own wait: starting its Spark, warming up, or about to take
    over the store this one's previous process let go (SIGKILL to every query's progress
    in `test_analysis_driver`: 30 s with the two JVMs starting together, 22 s without). A
    peer still waiting may be waiting for this one, so it is not waited for. At the
    pair's first start neither waits: the standby's JVM start and warm-up overlap the first
    driver's start-up, which under `bench_failover`'s load put the standby's readiness
    about 40 s later. The caller bounds the wait (`YIELD_MAX_S`), so a peer that never
    gets there does not keep it down."""
    if peer is None:
        return False
    if peer.get("role") == "active":
        return not peer.get("caught_up")
    return restarted and "yielded_s" in (peer.get("phases") or {})


def step_down(jvm_pid: int | None) -> NoReturn:
    """End a driver that lost the pair's lease, now: its JVM first (SIGKILL, so none of
    its queries runs a moment longer), then its own process; Ray restarts the driver,
    which comes back as the standby."""
    if jvm_pid is not None:
        with contextlib.suppress(OSError):
            os.kill(jvm_pid, signal.SIGKILL)
    logging.shutdown()
    os._exit(EXIT_FENCED)


def jvm_file(store: Path) -> Path:
    """Where the active driver records its JVM, next to its checkpoint store."""
    return store.with_name(store.name + ".jvm")


def record_jvm(store: Path, pid: int) -> None:
    """Record the active driver's JVM (pid and start time, so a reused pid is not taken
    for it)."""
    proc = psutil.Process(pid)
    body = json.dumps({"pid": pid, "create_time": proc.create_time()})
    tmp = jvm_file(store).with_suffix(".tmp")
    tmp.write_text(body)
    os.replace(tmp, jvm_file(store))


def _recorded_jvm(store: Path) -> psutil.Process | None:
    """The recorded JVM if it still runs (same pid and start time), else None."""
    try:
        seen = json.loads(jvm_file(store).read_text())
        proc = psutil.Process(int(seen["pid"]))
        if abs(proc.create_time() - float(seen["create_time"])) > 0.01:
            return None  # the pid was reused
        return None if _gone(proc) else proc
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        return None


def end_old_jvm(store: Path, grace_s: float = JVM_GRACE_S) -> str:
    """Kill the previous active driver's JVM if it still runs and wait (at most `grace_s`)
    until it is gone. Returns ``none`` (nothing recorded, or already gone) or ``killed``.
    Only for the lock's new holder: the recorded JVM's driver no longer holds it."""
    proc = _recorded_jvm(store)
    if proc is None:
        return "none"
    log.warning("analysis driver: ending the previous driver's JVM %d", proc.pid)
    with contextlib.suppress(psutil.Error, OSError):
        os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while not _gone(proc) and time.monotonic() < deadline:
        time.sleep(0.01)
    if not _gone(proc):
        raise RuntimeError(f"the previous driver's JVM {proc.pid} outlived SIGKILL")
    return "killed"


def _gone(proc: psutil.Process) -> bool:
    """Exited, or a zombie (dead; its new parent has not reaped it)."""
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def takeover(
    store: Path,
    closing: threading.Event,
    held_elsewhere: Callable[[], bool],
    *,
    poll_s: float = POLL_S,
) -> CheckpointStore | None:
    """Block until this driver holds the store's lock and `held_elsewhere()` is False (the
    driver took the pair's lease); the open store, or None once `closing` is set. Every
    wait is on `closing`, so a shutdown ends it at once."""
    while not closing.is_set():
        opened = try_take(store, held_elsewhere)
        if opened is not None:
            return opened
        closing.wait(poll_s)
    return None


def try_take(store: Path, held_elsewhere: Callable[[], bool]) -> CheckpointStore | None:
    """One try of `takeover`: the open store if its lock is free and then
    `held_elsewhere()` (which tries the lease) is False, else None."""
    try:
        opened = CheckpointStore(store)
    except CheckpointLockedError:
        return None
    if not held_elsewhere():
        return opened
    opened.close()  # another driver holds the lease (on another node): stand by
    return None
