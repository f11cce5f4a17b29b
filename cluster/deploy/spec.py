"""A role as data: which actors it runs, how they are started and supervised, and when a
replica counts as serving. `RoleSpec` is to a role what `runtime.supervision.policy.ChildSpec`
is to one actor; `cluster.deploy.deployer` is the one place that starts, resizes and stops
what it describes.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from runtime.state.placement import affinity
from runtime.supervision.policy import ChildSpec, Intensity, Strategy, index_specs


class Start(enum.Enum):
    """How a role's children are started and kept alive."""

    # Children of a `RaySupervisor` (restart intensity, heartbeats, escalation on top of
    # Ray's restarts), one per node while nodes last: collector, bridge, gateway.
    SUPERVISED = "supervised"
    # Named, detached actors that Ray alone restarts: stream ingest (k+1 of a stream, Ray
    # spreads them), the analysis driver.
    DETACHED = "detached"
    # Each child a replica group: k+1 copies on distinct nodes, fenced by epoch and caught
    # up from a copy with data (`runtime.state.replication`): the MessageLogger.
    REPLICA_GROUPS = "replica_groups"


@dataclass(frozen=True)
class SupervisorSpec:
    """A role supervisor: its actor name, restart strategy and restart intensity."""

    name: str
    strategy: Strategy = Strategy.ONE_FOR_ONE
    intensity: Intensity = Intensity(max_restarts=20, period_s=60.0)
    ray_options: Mapping[str, Any] = field(default_factory=lambda: {"num_cpus": 0})


@dataclass(frozen=True)
class RoleSpec:
    """One role of the pipeline, as data.

    `children` are its replicas' specs in start order (their ids are the actors' names).
    `start` says how they run (`Start`); SUPERVISED roles name their `supervisor` (two
    roles may share one: bridges and collectors both live under ``collection``).
    `ready` names the actor method that answers something other than None once a replica
    serves (None: no wait). `k` is the copies beyond the first of each REPLICA_GROUPS
    child.
    """

    role: str
    children: tuple[ChildSpec, ...]
    start: Start = Start.SUPERVISED
    supervisor: SupervisorSpec | None = None
    ready: str | None = None
    k: int = 0
    # REPLICA_GROUPS: keyword arguments of each group's start (`deploy.logger.start_group`)
    group_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.role:
            raise ValueError("RoleSpec.role must be a non-empty name")
        object.__setattr__(self, "children", tuple(self.children))
        index_specs(self.children)  # a duplicate name would make two replicas one actor
        if (self.start is Start.SUPERVISED) != (self.supervisor is not None):
            raise ValueError(
                f"role {self.role!r}: a supervisor goes with Start.SUPERVISED, and only with it"
            )
        if self.k < 0:
            raise ValueError(f"role {self.role!r}: k must be >= 0, got {self.k}")

    @property
    def names(self) -> list[str]:
        return [c.id for c in self.children]


def replica_name(role: str, i: int) -> str:
    """The actor name of replica `i` of `role` (``collector-0``; `next_index` reads it)."""
    return f"{role}-{i}"


def on_node(spec: ChildSpec, node: str | None) -> ChildSpec:
    """`spec` with a placement hint for `node` (the supervisor pins it there while the
    node lives); unchanged for no preference."""
    if not node:
        return spec
    return dataclasses.replace(spec, ray_options={**(spec.ray_options or {}), **affinity(node)})
