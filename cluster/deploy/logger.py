"""Starting a MessageLogger group (primary and k replicas) under its supervisor."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from actors.queue.logger import LoggerGroup, LoggerReplica, catch_up_all
from runtime.replication import ReplicaGroup


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
    """Start k+1 replicas of logger group `name` and return (controller, client).

    Blocking (call it through an executor from async code). Replicas reopen what their
    directories hold. If some came up empty (`catching_up`) while others hold data, the
    empty ones are caught up from a replica with data (promoted first if the primary is one
    of the empty ones); if all are empty the group is simply new.
    """
    import ray

    remote = ray.remote(LoggerReplica)
    group = ReplicaGroup(
        name,
        k,
        remote,
        kwargs={
            "state_dir": str(state_dir),
            "group": name,
            "max_events": max_events,
            "max_bytes": max_bytes,
            "replicas": k + 1,
            **replica_kwargs,
        },
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


def _run(coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError("start_logger_group blocks: call it via run_in_executor from async code")
