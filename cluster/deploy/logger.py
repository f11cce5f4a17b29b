"""The logger role: MessageLogger replica groups (a primary and k copies on distinct
nodes), as a `RoleSpec` built from the config, and how one group is started."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

import ray

from actors.queue.logger import LoggerGroup, catch_up_all
from cluster.deploy.spec import RoleSpec, Start, replica_name
from runtime.config import Config
from runtime.replication import ReplicaGroup
from runtime.supervision import ChildSpec, load_start

ROLE = "logger"
REPLICA = "actors.queue.logger:LoggerReplica"


def logger_child(
    name: str,
    k: int,
    state_dir: str | os.PathLike[str],
    max_events: int = 1_000_000,
    max_bytes: int = 1 << 30,
    **replica_kwargs: Any,
) -> ChildSpec:
    """Logger group `name`: the arguments every one of its k+1 replicas is built with."""
    return ChildSpec(
        id=name,
        start=REPLICA,
        kwargs={
            "state_dir": str(state_dir),
            "group": name,
            "max_events": max_events,
            "max_bytes": max_bytes,
            "replicas": k + 1,
            **replica_kwargs,
        },
    )


def logger_group_child(cfg: Config, i: int) -> ChildSpec:
    """Group `logger-<i>` as the config sizes it."""
    return logger_child(
        replica_name(ROLE, i),
        cfg.roles.logger.k,
        cfg.state_path,
        max_events=cfg.logging.max_pending_events,
        max_bytes=cfg.logging.max_pending_bytes,
    )


def logger_role(cfg: Config, groups: Sequence[int] | None = None) -> RoleSpec:
    """`roles.logger.replicas` groups (or the groups numbered `groups`) of
    `roles.logger.k` + 1 replicas each."""
    numbers = range(cfg.roles.logger.replicas) if groups is None else groups
    return RoleSpec(
        role=ROLE,
        children=tuple(logger_group_child(cfg, i) for i in numbers),
        start=Start.REPLICA_GROUPS,
        k=cfg.roles.logger.k,
    )


def start_group(
    spec: ChildSpec,
    k: int,
    namespace: str | None = None,
    *,
    deadline_s: float = 5.0,
    cpu_per_replica: float = 0.01,
    call_timeout_s: float = 30.0,
) -> tuple[ReplicaGroup, LoggerGroup]:
    """Start the k+1 replicas of logger group `spec` and return (controller, client).

    Blocking (call it through an executor from async code). Replicas reopen what their
    directories hold. If some came up empty (`catching_up`) while others hold data, the
    empty ones are caught up from a replica with data (promoted first if the primary is one
    of the empty ones); if all are empty the group is simply new.
    """
    group = ReplicaGroup(
        spec.id,
        k,
        ray.remote(load_start(spec.start)),
        spec.args,
        kwargs=spec.kwargs,
        namespace=namespace,
        cpu_per_replica=cpu_per_replica,
        ready_timeout=max(30.0, call_timeout_s),
        call_timeout=call_timeout_s,  # covers worker start-up and the stores' open
    )
    try:
        statuses = ray.get([r.status.remote() for r in group.replicas], timeout=60)
        ready = [i for i, s in enumerate(statuses) if not s["catching_up"]]
        behind = [i for i, s in enumerate(statuses) if s["catching_up"]]
        if behind and not ready:  # a new group: nothing to copy
            ray.get([group.replicas[i].finish_catch_up.remote(group.epoch) for i in behind])
        elif behind:
            if group.primary not in ready:
                group.promote(ready[0])
            client = LoggerGroup.of(group, deadline_s=deadline_s)
            _run(catch_up_all(client, behind))
    except BaseException:
        group.shutdown()
        raise
    return group, LoggerGroup.of(group, deadline_s=deadline_s)


def start_logger_group(
    name: str,
    k: int,
    state_dir: str | os.PathLike[str],
    namespace: str | None = None,
    max_events: int = 1_000_000,
    max_bytes: int = 1 << 30,
    *,
    deadline_s: float = 5.0,
    cpu_per_replica: float = 0.01,
    call_timeout_s: float = 30.0,
    **replica_kwargs: Any,
) -> tuple[ReplicaGroup, LoggerGroup]:
    """One logger group on its own (tests, tools): `start_group` of `logger_child`."""
    spec = logger_child(name, k, state_dir, max_events, max_bytes, **replica_kwargs)
    return start_group(
        spec,
        k,
        namespace,
        deadline_s=deadline_s,
        cpu_per_replica=cpu_per_replica,
        call_timeout_s=call_timeout_s,
    )


def _run(coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError("start_group blocks: call it via run_in_executor from async code")
