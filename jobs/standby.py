"""A warm standby for the analysis driver: a second driver with its Spark already up, on
the same node, that takes the queries over when the active driver's process dies.

A driver restarted by Ray needs a new JVM, a SparkContext and session and its source
registered before its first query can start (about 17 s of a 34-s recovery on an idle
2-core machine, docs/benchmarks.md). A standby has done all of that already.

Who is active is decided by the lock that LevelDB holds on the driver's checkpoint store
(``state_dir/checkpoints/<driver>``, an ``fcntl`` lock the kernel drops when the process
dies), not by a lease with a timeout: both drivers share the state directory, so the lock
is exact on a node, and a SIGKILLed driver's lock is free at once. Before it starts any
query the new active driver ends the old one's JVM (recorded next to the store by
`record_jvm`): two JVMs must never run one query over one checkpoint, and an orphaned JVM
leaves only about 1.5 s after its Python parent (it notices its closed stdin), running
its micro-batch meanwhile. The lock being free says its driver is gone (dead, or shut
down with its queries stopped), so nothing else runs in that JVM: it is killed at once.

The standby is placed on the active driver's node (cluster/deploy/analysis.py); across
nodes the lock cannot see the other driver, so a driver also asks its peer before it takes
over (`takeover`'s `peer_active`) and stands by while the peer says it is active.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from runtime.checkpoint import CheckpointLockedError, CheckpointStore

log = logging.getLogger(__name__)

__all__ = [
    "JVM_GRACE_S",
    "POLL_S",
    "WARM_UP_BATCHES",
    "end_old_jvm",
    "jvm_file",
    "record_jvm",
    "should_yield",
    "standby_name",
    "takeover",
    "try_take",
]

POLL_S = 0.1  # how often a standby tries the lock
YIELD_MAX_S = 120.0  # the longest a standby waits for its peer before starting Spark
# micro-batches of the top-N plan a standby runs before it waits: a fresh JVM's first
# batches are the slow ones (quiet, 10 batches: 18.7 s the first time, 6.1 s the next)
WARM_UP_BATCHES = 3
JVM_GRACE_S = 10.0  # how long a killed JVM may take to be gone


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
    peer_active: Callable[[], bool],
    *,
    poll_s: float = POLL_S,
) -> CheckpointStore | None:
    """Block until this driver holds the store's lock while its peer is not active; the
    open store, or None once `closing` is set. Every wait is on `closing`, so a shutdown
    ends it at once."""
    while not closing.is_set():
        opened = try_take(store, peer_active)
        if opened is not None:
            return opened
        closing.wait(poll_s)
    return None


def try_take(store: Path, peer_active: Callable[[], bool]) -> CheckpointStore | None:
    """One try of `takeover`: the open store if its lock is free and the peer is not
    active, else None."""
    try:
        opened = CheckpointStore(store)
    except CheckpointLockedError:
        return None
    if not peer_active():
        return opened
    opened.close()  # the peer is active on another node: stand by
    return None
