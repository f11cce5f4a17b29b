"""The logger role: MessageLogger replica groups (a primary and k copies on distinct
nodes), as a `RoleSpec` built from the config, and how one group is started."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

import ray

from actors.queue.logger import LoggerGroup, catch_up_all
from actors.queue.logger.in_sync import extra_replicas, newest
from cluster.deploy.spec import RoleSpec, Start, replica_name
from runtime.config import Config
from runtime.state.placement import alive_nodes
from runtime.state.replication import ReplicaGroup
from runtime.supervision.policy import ChildSpec, load_start

ROLE = "logger"
REPLICA = "actors.queue.logger:LoggerReplica"


def logger_child(
    name: str,
    k: int,
    state_dir: str | os.PathLike[str],
    max_events: int = 1_000_000,
    max_bytes: int = 1 << 30,
    *,
    extra: int = 0,
    **replica_kwargs: Any,
) -> ChildSpec:
    """Logger group `name`: the arguments every one of its k+1+`extra` replicas is built
    with."""
    if extra > k:
        raise ValueError(
            f"logger group {name!r}: {extra} extra replicas need k >= {extra} (k={k}): two "
            "in-sync sets of k+1 would not share a replica"
        )
    return ChildSpec(
        id=name,
        start=REPLICA,
        kwargs={
            "state_dir": str(state_dir),
            "group": name,
            "max_events": max_events,
            "max_bytes": max_bytes,
            "replicas": k + 1 + extra,
            **replica_kwargs,
        },
    )


def logger_group_child(cfg: Config, i: int, extra: int = 0) -> ChildSpec:
    """Group `logger-<i>` as the config sizes it, with `extra` replicas beyond k+1."""
    return logger_child(
        replica_name(ROLE, i),
        cfg.roles.logger.k,
        cfg.state_path,
        max_events=cfg.logging.max_pending_events,
        max_bytes=cfg.logging.max_pending_bytes,
        extra=extra,
    )


def logger_role(cfg: Config, groups: Sequence[int] | None = None) -> RoleSpec:
    """`roles.logger.replicas` groups (or the groups numbered `groups`) of
    `roles.logger.k` + 1 replicas each, and `logging.extra_replicas` more ("auto": as many
    as the alive nodes allow, `in_sync.extra_replicas`)."""
    numbers = range(cfg.roles.logger.replicas) if groups is None else groups
    k = cfg.roles.logger.k
    nodes = len(alive_nodes()) if ray.is_initialized() else 1  # a plan drawn without Ray
    extra = extra_replicas(cfg.logging.extra_replicas, k, nodes)
    return RoleSpec(
        role=ROLE,
        children=tuple(logger_group_child(cfg, i, extra) for i in numbers),
        start=Start.REPLICA_GROUPS,
        k=cfg.roles.logger.k,
        group_options={"drop_after_s": cfg.logging.drop_after_s},
    )


def start_group(
    spec: ChildSpec,
    k: int,
    namespace: str | None = None,
    *,
    deadline_s: float = 5.0,
    cpu_per_replica: float = 0.01,
    call_timeout_s: float = 30.0,
    drop_after_s: float | None = None,
) -> tuple[ReplicaGroup, LoggerGroup]:
    """Start the replicas of logger group `spec` (k+1, or more: `logger_child`'s `extra`)
    and return (controller, client).

    Blocking (call it through an executor from async code). Replicas reopen what their
    directories hold. A replica the last in-sync set left out missed writes: it is emptied
    and never leads. If some came up empty (`catching_up`) while others hold data, the
    empty ones are caught up from a replica with data (promoted first if the primary is one
    of the empty ones); if all are empty the group is simply new.
    """
    copies = int(spec.kwargs.get("replicas", k + 1))
    group = ReplicaGroup(
        spec.id,
        copies - 1,
        ray.remote(load_start(spec.start)),
        spec.args,
        kwargs=spec.kwargs,
        namespace=namespace,
        cpu_per_replica=cpu_per_replica,
        ready_timeout=max(30.0, call_timeout_s),
        call_timeout=call_timeout_s,  # covers worker start-up and the stores' open
        choose_primary=_last_in_sync,
    )
    need = k + 1 if copies > k + 1 else None
    options = {"deadline_s": deadline_s, "need": need, "drop_after_s": drop_after_s}
    try:
        statuses = ray.get([r.status.remote() for r in group.replicas], timeout=60)
        ready = [i for i, s in enumerate(statuses) if not s["catching_up"]]
        behind = [i for i, s in enumerate(statuses) if s["catching_up"]]
        if behind and not ready:  # a new group: nothing to copy
            ray.get([group.replicas[i].finish_catch_up.remote(group.epoch) for i in behind])
        elif behind:
            if group.primary not in ready:
                group.promote(ready[0])
            client = LoggerGroup.of(group, **options)
            _run(catch_up_all(client, behind))
    except BaseException:
        group.shutdown()
        raise
    return group, LoggerGroup.of(group, **options)


def _last_in_sync(handles: list[Any]) -> int:
    """The primary of the newest whole configuration the reopened replicas hold (0 for a
    new group); replicas its in-sync set left out are emptied first (`begin_catch_up`),
    so they are copied before they count."""
    statuses = ray.get([h.status.remote() for h in handles], timeout=60)
    config = newest(statuses, len(handles))
    if config is None or config.in_sync is None:
        return 0 if config is None else config.primary
    left_out = [i for i in range(len(handles)) if i not in config.in_sync]
    ray.get([handles[i].begin_catch_up.remote(config.epoch) for i in left_out], timeout=60)
    return config.primary


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
    extra: int = 0,
    drop_after_s: float | None = None,
    **replica_kwargs: Any,
) -> tuple[ReplicaGroup, LoggerGroup]:
    """One logger group on its own (tests, tools): `start_group` of `logger_child`."""
    spec = logger_child(name, k, state_dir, max_events, max_bytes, extra=extra, **replica_kwargs)
    return start_group(
        spec,
        k,
        namespace,
        deadline_s=deadline_s,
        cpu_per_replica=cpu_per_replica,
        call_timeout_s=call_timeout_s,
        drop_after_s=drop_after_s,
    )


def _run(coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError("start_group blocks: call it via run_in_executor from async code")
