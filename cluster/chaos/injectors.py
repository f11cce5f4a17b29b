"""Fault injectors: each applies one `Fault` to a running deployment and undoes it.

Guarantees: every injector is bounded in time (its fault's `duration_s`, then bounded
waits) and in count (`Fault.count`), and undoes what it did in a `finally` (SIGCONT after
SIGSTOP, the fault file removed, the NATS node restarted, a replacement Ray node added,
the proxy toxic removed), also when cancelled. Signals go only to pids of actors this
deployment created (read from their `heartbeat()` / `status()`) or of servers it
started; nothing is looked up by process name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from cluster.chaos import schedule as s
from cluster.chaos.proxy import Blackhole, Latency, ResetPeer
from runtime.nats.server import connect
from runtime.waiting import await_until

log = logging.getLogger(__name__)

BACK_TIMEOUT_S = 120.0  # a killed target must be back (new pid answering) within this
FAULT_SUFFIX = ".fault"  # actors.queue.logger.FAULT_SUFFIX: the LogStore's injected-fault file
REPEAT_GAP_S = 1.2  # between repeated kills: the supervisor heartbeats once a second


@dataclass
class Deployment:
    """The live parts a scenario runs against (filled by the runner)."""

    cfg: Any
    tier: Any  # cluster.pipeline.CollectionTier
    nats: Any  # NatsServer or NatsCluster
    stream: str
    cluster: Any = None  # ray.cluster_utils.Cluster for Ray node loss
    proxy: Any = None  # cluster.chaos.proxy.ProxyThread between the tier and NATS
    gateways: list[str] = field(default_factory=list)
    driver: Any = None  # jobs.driver.AnalysisDriver handle
    restart_tier: Callable[[], None] | None = None  # blocking: stop + start the tier
    notes: list[str] = field(default_factory=list)


@dataclass
class FaultRecord:
    """What one fault did: times in seconds since the load started."""

    label: str
    started_s: float
    ended_s: float = 0.0  # the fault undone (kills: the signal sent)
    recovered_s: float | None = None  # the target healthy again, since `started_s`
    detail: str = ""
    error: str = ""


# ------------------------------------------------------------------------- targets


async def _ray(ref: Any, timeout: float = 10.0) -> Any:
    return await asyncio.to_thread(ray.get, ref, timeout=timeout)


async def logger_statuses(d: Deployment) -> list[dict[str, Any]]:
    return await d.tier.loggers[0].status()


async def _logger_index(d: Deployment, which: str) -> tuple[int, dict[str, Any]]:
    statuses = await logger_statuses(d)
    primary = next((st["primary"] for st in statuses if "error" not in st), None)
    if primary is None:
        raise RuntimeError(f"no logger replica answers: {statuses}")
    if which == "logger-primary":
        idx = primary
    else:
        idx = next(i for i in range(len(statuses)) if i != primary)
    if "error" in statuses[idx]:
        raise RuntimeError(f"logger replica {idx} down: {statuses[idx]['error']}")
    return idx, statuses[idx]


def _handle(d: Deployment, target: str) -> Any:
    return d.driver if target == "driver" else d.tier.actor(target)


async def serving_gateway(d: Deployment) -> str:
    """The gateway replica holding the run's WebSocket subscriber (replicas share a port,
    so the kernel chose it); the first one if none reports an open WebSocket."""
    for name in d.gateways:
        stats = await _ray(d.tier.actor(name).stats.remote())
        if stats.get("open", {}).get("ws"):
            return name
    return d.gateways[0]


async def target_process(d: Deployment, target: str) -> tuple[str, int, str]:
    """(actor name, pid, node id) of a role target, read from the actor itself."""
    if target.startswith("logger-"):
        idx, st = await _logger_index(d, target)
        return d.tier.loggers[0].replica_name(idx), int(st["pid"]), st.get("node_id", "")
    if target == "gateway-client":
        target = await serving_gateway(d)
    beat = await _ray(_handle(d, target).heartbeat.remote())
    return beat["name"], int(beat["pid"]), beat.get("node_id", "")


async def _resolve(d: Deployment, target: str) -> tuple[str, int, str]:
    """`target_process`, waiting (bounded) while the target is itself restarting."""
    return await await_until(
        lambda: target_process(d, target),
        timeout=BACK_TIMEOUT_S,
        interval=0.2,
        what=f"{target} reachable",
        swallow=True,
    )


async def _back(d: Deployment, target: str, old_pid: int | None) -> None:
    """Wait until the target answers again (from a new process when `old_pid` is set)."""

    async def answers() -> bool:
        _, pid, _ = await target_process(d, target)
        return old_pid is None or pid != old_pid

    await await_until(
        answers, timeout=BACK_TIMEOUT_S, interval=0.2, what=f"{target} back", swallow=True
    )


async def logger_healthy(d: Deployment) -> bool:
    """Every replica of every logger group answers and none is catching up."""
    for group in d.tier.loggers:
        for st in await group.status():
            if "error" in st or st.get("catching_up"):
                return False
    return True


# ------------------------------------------------------------------------- primitives


def _concrete(target: str, name: str) -> str:
    """The target to watch for recovery: the chosen gateway stays the one that was hit
    (the subscriber moves to the other replica at once)."""
    return name if target == "gateway-client" else target


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


async def _kill(d: Deployment, f: s.Fault, rec: FaultRecord, t0: float) -> None:
    name, pid, _ = await _resolve(d, f.target)
    _signal(pid, signal.SIGKILL)
    rec.ended_s = time.monotonic() - t0
    rec.detail = f"SIGKILL {name} pid {pid}"
    await _back(d, _concrete(f.target, name), pid)


async def _pause(d: Deployment, f: s.Fault, rec: FaultRecord, t0: float) -> None:
    name, pid, _ = await _resolve(d, f.target)
    _signal(pid, signal.SIGSTOP)
    try:
        rec.detail = f"SIGSTOP {name} pid {pid} for {f.duration_s:g}s"
        await asyncio.sleep(f.duration_s)  # the fault's length, not a wait for a result
    finally:
        _signal(pid, signal.SIGCONT)
        rec.ended_s = time.monotonic() - t0
    await _back(d, _concrete(f.target, name), None)


async def _supervisor_escalated(d: Deployment) -> bool:
    try:
        return bool((await _ray(d.tier.supervisor.status.remote()))["escalated"])
    except Exception:  # noqa: BLE001 - unknown counts as not (yet) escalated
        return False


async def _resolve_unless_escalated(d: Deployment, target: str) -> tuple[str, int, str] | None:
    """`_resolve`, or None once the supervisor has escalated: a slow machine can let the
    escalation land after a round's check, and then the target never comes back."""

    async def found() -> tuple[str, int, str] | str:
        if await _supervisor_escalated(d):
            return "escalated"
        return await target_process(d, target)

    got = await await_until(
        found, timeout=BACK_TIMEOUT_S, interval=0.2, what=f"{target} reachable", swallow=True
    )
    return None if got == "escalated" else got  # type: ignore[return-value]


async def _kill_repeat(d: Deployment, f: s.Fault, rec: FaultRecord, t0: float) -> None:
    """Up to `count` kills; "collection" kills every collector and bridge each round (the
    restarts of all its children count toward the supervisor's intensity, so several per
    round cross it within its period even where a restart takes seconds). Stops at
    escalation."""
    whole = f.target == "collection"
    targets = [*d.tier.collectors, *d.tier.bridges] if whole else [f.target]
    kills, escalated = 0, False
    while kills < f.count and not escalated:
        victims = []
        for t in targets[: f.count - kills]:
            found = await _resolve_unless_escalated(d, t)
            if found is None:  # escalated since the last round: the tier is stopped
                escalated = True
                break
            victims.append(found)
        if escalated:
            break
        for _, pid, _ in victims:
            _signal(pid, signal.SIGKILL)
        kills += len(victims)

        async def back_or_escalated(old: list[Any] = victims) -> bool:
            if await _supervisor_escalated(d):
                return True
            now = [await target_process(d, t) for t in targets[: len(old)]]
            return all(n[1] != o[1] for n, o in zip(now, old, strict=True))

        await await_until(
            back_or_escalated, BACK_TIMEOUT_S, 0.2, what=f"{f.target} back", swallow=True
        )
        escalated = await _supervisor_escalated(d)
        if not escalated:
            await asyncio.sleep(REPEAT_GAP_S)  # let the supervisor's heartbeat see them
    rec.ended_s = time.monotonic() - t0
    rec.detail = f"{kills} kills of {f.target}; supervisor escalated: {escalated}"
    if escalated and d.restart_tier is not None:
        await asyncio.to_thread(d.restart_tier)  # the operator's restart: the log replays
        rec.detail += "; tier restarted"


async def _nats_down(d: Deployment, f: s.Fault, rec: FaultRecord, t0: float) -> None:
    server = d.nats
    await _down_for(
        server, f, rec, t0, f"SIGKILL nats-server pid {server.pid}, down {f.duration_s:g}s"
    )


async def _down_for(server: Any, f: s.Fault, rec: FaultRecord, t0: float, detail: str) -> None:
    """SIGKILL one nats-server for the fault's duration, then start it again (same ports
    and store), also when cancelled."""
    server.kill()
    try:
        rec.detail = detail
        await asyncio.sleep(f.duration_s)
    finally:
        rec.ended_s = time.monotonic() - t0
        await asyncio.to_thread(server.start, 60.0)


async def _stream_leader(d: Deployment) -> str | None:
    nc = await connect(d.nats.url)
    try:
        info = await nc.jetstream(timeout=5).stream_info(d.stream)
        return info.cluster.leader if info.cluster else None
    finally:
        await nc.close()


async def _nats_node(d: Deployment, f: s.Fault, rec: FaultRecord, t0: float) -> None:
    cluster = d.nats
    leader = await _stream_leader(d)
    server = cluster.server(leader) if leader else cluster.servers[0]
    detail = f"SIGKILL {server.server_name} (stream leader) pid {server.pid}"
    await _down_for(server, f, rec, t0, detail)
    await await_until(
        lambda: cluster.meta_leader() is not None, 60, 0.2, what="meta leader", swallow=True
    )


async def _ray_node(d: Deployment, f: s.Fault, rec: FaultRecord, t0: float) -> None:
    cluster = d.cluster
    _, _, node_id = await _resolve(d, f.target)
    workers = {n.node_id: n for n in cluster.worker_nodes}
    # the head (GCS, this driver) is never removed: if the target lives there, take the
    # worker node of another logger replica instead
    others = [st.get("node_id") for st in await logger_statuses(d)]
    victim = next((n for n in [node_id, *others] if n in workers), next(iter(workers)))
    node = workers[victim]
    hosted = f"hosting {f.target}" if victim == node_id else "hosting another logger replica"
    await asyncio.to_thread(cluster.remove_node, node)
    rec.detail = f"removed Ray node {node.node_id[:12]} {hosted}"
    try:
        await asyncio.sleep(f.duration_s)
    finally:
        # capacity back; on this thread: Ray's node start installs signal handlers (the
        # load, on the same loop, stalls for those seconds)
        cluster.add_node(num_cpus=1)
        rec.ended_s = time.monotonic() - t0
    await await_until(
        lambda: logger_healthy(d), BACK_TIMEOUT_S, 0.5, what="loggers healthy", swallow=True
    )


async def _disk(d: Deployment, f: s.Fault, rec: FaultRecord, t0: float) -> None:
    idx, st = await _logger_index(d, f.target)
    fault_file = Path(st["path"]).with_name(Path(st["path"]).name + FAULT_SUFFIX)
    fault_file.write_text("full" if f.action == s.DISK_FULL else "error")
    try:
        kind = "ENOSPC" if f.action == s.DISK_FULL else "EIO"
        rec.detail = f"{kind} on every write of logger replica {idx} for {f.duration_s:g}s"
        await asyncio.sleep(f.duration_s)
    finally:
        fault_file.unlink(missing_ok=True)
        rec.ended_s = time.monotonic() - t0
    await await_until(
        lambda: logger_healthy(d), BACK_TIMEOUT_S, 0.5, what="loggers healthy", swallow=True
    )


async def _link(d: Deployment, f: s.Fault, rec: FaultRecord, t0: float) -> None:
    toxic: Any = {
        s.LATENCY: Latency(200, 100),
        s.RESETS: ResetPeer(0),
        s.ACK_LOSS: Blackhole(direction="downstream"),  # publishes land, acks never return
    }[f.action]
    toxic_id = await asyncio.to_thread(d.proxy.add, toxic)
    try:
        rec.detail = f"{toxic} between collection tier and NATS for {f.duration_s:g}s"
        await asyncio.sleep(f.duration_s)
    finally:
        await asyncio.to_thread(d.proxy.remove, toxic_id)
        rec.ended_s = time.monotonic() - t0


_INJECTORS = {
    s.KILL: _kill,
    s.KILL_REPEAT: _kill_repeat,
    s.PAUSE: _pause,
    s.NATS_DOWN: _nats_down,
    s.NATS_NODE: _nats_node,
    s.RAY_NODE: _ray_node,
    s.DISK_ERROR: _disk,
    s.DISK_FULL: _disk,
    s.LATENCY: _link,
    s.RESETS: _link,
    s.ACK_LOSS: _link,
}


async def inject(fault: s.Fault, d: Deployment, t0: float) -> FaultRecord:
    """Apply `fault` now, undo it, wait (bounded) until its target is healthy again.

    Never raises for a fault that could not be applied or healed in time: the record
    carries the error, and the run's verdict (not the injector) decides pass or fail.
    """
    rec = FaultRecord(fault.label, started_s=time.monotonic() - t0)
    try:
        await _INJECTORS[fault.action](d, fault, rec, t0)
        rec.recovered_s = round(time.monotonic() - t0 - rec.started_s, 3)
    except Exception as err:  # noqa: BLE001 - reported in the run's report
        log.warning("fault %s: %r", fault.label, err)
        rec.error = repr(err)[:300]
    rec.ended_s = rec.ended_s or time.monotonic() - t0
    return rec
