"""k-fault tolerant replica groups: epoch fencing, placement policy, and the driver-side group.

A role with fault tolerance k keeps its state on k+1 replicas placed on distinct nodes. One
replica is the primary; every promotion bumps an epoch and every write carries the writer's
epoch, so a returning old primary (older epoch) is refused by the replicas.

Pure parts (`Fence`, `placement_plan`, `bundle_for`, `count_fitting_nodes`) have no Ray I/O.
`ReplicaMixin` runs inside replica actors; `ReplicaGroup` runs in the driver or a supervisor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import msgspec
import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from runtime.errors import FencedError, TierflowError
from runtime.waiting import poll

logger = logging.getLogger(__name__)

T = TypeVar("T")

STRICT_SPREAD = "STRICT_SPREAD"
SPREAD = "SPREAD"


# --------------------------------------------------------------------------- fencing


class EpochFenced(FencedError):
    """A write or announcement carried an epoch older than the one this replica accepted.

    The kind a replica raises, with both epochs. Catch `FencedError` (runtime.errors; this
    module's callers may keep importing it from here) for every kind of fenced writer."""

    def __init__(self, current: int, offered: int) -> None:
        # args must be exactly the constructor arguments so the error survives pickling
        # (Ray ships it from the actor to the caller).
        super().__init__(current, offered)
        self.current = current
        self.offered = offered

    def __str__(self) -> str:
        return f"fenced: epoch {self.offered} is older than accepted epoch {self.current}"


class _FenceState(msgspec.Struct, forbid_unknown_fields=True):
    epoch: Annotated[int, msgspec.Meta(ge=0)]
    primary: Annotated[int, msgspec.Meta(ge=0)] | None = None
    in_sync: list[int] | None = None


class Fence:
    """The highest epoch a replica has accepted, the primary that epoch names and, when the
    group acknowledges writes on fewer than all its replicas, the in-sync set it names.

    Guarantees: the epoch never decreases; a write with an older epoch is never admitted;
    an epoch names one configuration (primary, in-sync set) and never another. Epoch 0
    means no primary was announced yet. `in_sync` None means every replica. Not
    thread-safe: replicas call it from one thread (Ray's default actor concurrency) or
    without awaiting between check and write.
    """

    __slots__ = ("_epoch", "_in_sync", "_primary")

    def __init__(
        self, epoch: int = 0, primary: int | None = None, in_sync: Sequence[int] | None = None
    ) -> None:
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self._epoch = epoch
        self._primary = primary
        self._in_sync = None if in_sync is None else tuple(sorted(in_sync))

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def primary(self) -> int | None:
        """Index of the primary named by the current epoch, None when not yet known."""
        return self._primary

    @property
    def in_sync(self) -> tuple[int, ...] | None:
        """The replicas whose acknowledgement a write of this epoch needs; None: all."""
        return self._in_sync

    def admit(self, epoch: int) -> bool:
        """True when a write with `epoch` may proceed.

        A newer epoch than ours proves a newer primary exists: adopt it (primary unknown
        until its announcement arrives) so older writers are refused from now on.
        """
        if epoch < self._epoch:
            return False
        if epoch > self._epoch:
            self._epoch = epoch
            self._primary = None
            self._in_sync = None
        return True

    def check(self, epoch: int) -> None:
        """Raise EpochFenced unless a write with `epoch` may proceed."""
        if not self.admit(epoch):
            raise EpochFenced(self._epoch, epoch)

    def advance(
        self, epoch: int, primary: int | None = None, in_sync: Sequence[int] | None = None
    ) -> None:
        """Accept the announcement of a new primary (and in-sync set). Idempotent for a
        repeated announcement.

        Raises EpochFenced for an older epoch (a stale controller) and ValueError when the
        same epoch is announced with another primary or in-sync set (two holders deciding
        at once: the first to reach this replica wins the epoch).
        """
        members = None if in_sync is None else tuple(sorted(in_sync))
        if epoch < self._epoch:
            raise EpochFenced(self._epoch, epoch)
        if epoch > self._epoch:
            self._epoch = epoch
            self._primary = primary
            self._in_sync = members
            return
        if primary is not None and primary != self._primary:
            if self._primary is not None:
                raise ValueError(
                    f"epoch {epoch} already names primary {self._primary}, not {primary}"
                )
            self._primary = primary
        if members is not None and members != self._in_sync:
            if self._in_sync is not None:
                raise ValueError(
                    f"epoch {epoch} already names in-sync {list(self._in_sync)}, "
                    f"not {list(members)}"
                )
            self._in_sync = members

    def to_bytes(self) -> bytes:
        """Serialized form for a replica's checkpoint (JSON, stable across versions)."""
        members = None if self._in_sync is None else list(self._in_sync)
        return msgspec.json.encode(
            _FenceState(epoch=self._epoch, primary=self._primary, in_sync=members)
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> Fence:
        """Inverse of to_bytes; raises ValueError on corrupt or foreign data."""
        try:
            state = msgspec.json.decode(data, type=_FenceState)
        except msgspec.DecodeError as exc:
            raise ValueError(f"not a fence record: {exc}") from exc
        return cls(state.epoch, state.primary, state.in_sync)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Fence):
            return NotImplemented
        mine = (self._epoch, self._primary, self._in_sync)
        return mine == (other._epoch, other._primary, other._in_sync)

    def __repr__(self) -> str:
        return f"Fence(epoch={self._epoch}, primary={self._primary}, in_sync={self._in_sync})"


# --------------------------------------------------------------------------- placement policy


@dataclass(frozen=True)
class Plan:
    """Where k+1 replicas go. `warning` is set when they cannot all be on distinct nodes."""

    strategy: str
    replicas: int
    nodes_alive: int
    warning: str | None = None

    @property
    def k(self) -> int:
        """Fault tolerance the user asked for."""
        return self.replicas - 1

    @property
    def tolerated_node_failures(self) -> int:
        """Node losses the placement survives with at least one replica left."""
        return min(self.k, self.nodes_alive - 1)


def placement_plan(num_nodes_alive: int, replicas: int, *, role: str = "replica group") -> Plan:
    """STRICT_SPREAD when every replica can have its own node, else SPREAD with a warning."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if num_nodes_alive < 1:
        raise ValueError(f"no alive node to place {role!r} on")
    if num_nodes_alive >= replicas:
        return Plan(STRICT_SPREAD, replicas, num_nodes_alive)
    k = replicas - 1
    tolerated = num_nodes_alive - 1
    node_word = "node is" if num_nodes_alive == 1 else "nodes are"
    if tolerated == 0:
        survives = "it cannot tolerate a node loss (0 node failures)"
    else:
        survives = f"it tolerates only {tolerated} node failure(s), not {k}"
    warning = (
        f"{role!r} asks for k={k} ({replicas} replicas on distinct nodes) but only "
        f"{num_nodes_alive} {node_word} alive: replicas share nodes, so {survives}. "
        f"Add {replicas - num_nodes_alive} node(s) or lower k to {tolerated}."
    )
    return Plan(SPREAD, replicas, num_nodes_alive, warning)


def bundle_for(
    cpu_per_replica: float, resources: Mapping[str, float] | None = None
) -> dict[str, float]:
    """The placement-group bundle of one replica: its CPU share plus any custom resources."""
    if cpu_per_replica < 0:
        raise ValueError(f"cpu_per_replica must be >= 0, got {cpu_per_replica}")
    bundle: dict[str, float] = {}
    if cpu_per_replica > 0:
        bundle["CPU"] = cpu_per_replica
    for name, amount in (resources or {}).items():
        if name == "CPU":
            raise ValueError("give the CPU share as cpu_per_replica, not in resources")
        bundle[name] = amount
    if not bundle:
        raise ValueError("a replica bundle needs at least one resource")
    return bundle


def count_fitting_nodes(nodes: Iterable[Mapping[str, Any]], bundle: Mapping[str, float]) -> int:
    """Alive nodes (as listed by `ray.nodes()`) whose total resources can hold one bundle."""
    count = 0
    for node in nodes:
        if not node.get("Alive"):
            continue
        total = node.get("Resources", {})
        if all(total.get(name, 0.0) >= amount for name, amount in bundle.items()):
            count += 1
    return count


def _actor_resource_options(bundle: Mapping[str, float]) -> dict[str, Any]:
    """Actor options that request exactly one bundle (Ray wants CPU/GPU as num_cpus/num_gpus)."""
    custom = {n: a for n, a in bundle.items() if n not in ("CPU", "GPU")}
    options: dict[str, Any] = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0)}
    if custom:
        options["resources"] = custom
    return options


# --------------------------------------------------------------------------- replica side


class ReplicaMixin:
    """Epoch fencing for a replica actor class; the group calls `set_epoch` on promotion.

    Subclasses that keep a checkpoint override `_load_fence`/`_save_fence` so a restarted
    replica (Ray reruns `__init__`) still refuses old epochs before the group re-announces.
    """

    _replication_fence: Fence | None = None

    def _load_fence(self) -> Fence | None:
        """Fence restored from the replica's checkpoint; None starts at epoch 0."""
        return None

    def _save_fence(self, fence: Fence) -> None:
        """Persist the fence (e.g. `namespace.put(b"fence", fence.to_bytes())`)."""

    @property
    def fence(self) -> Fence:
        if self._replication_fence is None:
            self._replication_fence = self._load_fence() or Fence()
        return self._replication_fence

    def set_epoch(
        self, epoch: int, primary_index: int, in_sync: Sequence[int] | None = None
    ) -> int:
        """Accept a promotion; returns the accepted epoch. EpochFenced if `epoch` is stale."""
        self.fence.advance(epoch, primary_index, in_sync)
        self._save_fence(self.fence)
        return self.fence.epoch

    def epoch(self) -> int:
        return self.fence.epoch

    def primary_index(self) -> int | None:
        return self.fence.primary

    def replica_index(self) -> int | None:
        """This replica's index, read from its actor name `"{role}-{i}"`."""
        name = ray.get_runtime_context().get_actor_name()
        if not name:
            return None
        _, _, suffix = name.rpartition("-")
        return int(suffix) if suffix.isdigit() else None

    def is_primary(self) -> bool:
        primary = self.fence.primary
        return primary is not None and primary == self.replica_index()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def fenced_write(self, epoch: int, write: Callable[[], T]) -> T:
        """Run `write` only if `epoch` is not older than the accepted one; else EpochFenced.

        A newer epoch is adopted and persisted first, so the old primary stays fenced even if
        this replica restarts before the announcement reaches it.
        """
        before = self.fence.epoch
        self.fence.check(epoch)
        if self.fence.epoch != before:
            self._save_fence(self.fence)
        return write()


# --------------------------------------------------------------------------- driver side


class PlacementError(TierflowError, RuntimeError):
    """The replicas' placement group could not be placed in time."""


class ReplicaGroupError(TierflowError, RuntimeError):
    """Replicas did not start or did not acknowledge an epoch in time."""


class ReplicaGroup:
    """k+1 named detached replicas of one role, on distinct nodes when the cluster allows.

    The group is the only allocator of epochs for its role: `promote` bumps the epoch and
    announces it to every reachable replica. Replicas that did not acknowledge are listed
    in `unacknowledged`; a call queued to a restarting replica still delivers later.
    """

    def __init__(
        self,
        role: str,
        k: int,
        actor_class: Any,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        namespace: str | None = None,
        cpu_per_replica: float = 0.01,
        resources: Mapping[str, float] | None = None,
        ready_timeout: float = 30.0,
        call_timeout: float = 10.0,
        choose_primary: Callable[[list[Any]], int] | None = None,
    ) -> None:
        """`choose_primary`: given the started replicas' handles, the index to promote
        first (default 0); the role's chance to read what its replicas reopened and to
        keep a replica that missed writes from leading."""
        if not role:
            raise ValueError("role must be a non-empty name")
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.role = role
        self.k = k
        self._actor_class = actor_class
        self._args = tuple(args)
        self._kwargs = dict(kwargs or {})
        self.namespace = namespace or ray.get_runtime_context().namespace
        self._bundle = bundle_for(cpu_per_replica, resources)
        self._ready_timeout = ready_timeout
        self._call_timeout = call_timeout
        self._epoch = 0
        self._primary: int | None = None
        self.unacknowledged: list[int] = []
        self.warnings: list[str] = []
        self._replicas: list[Any] = []
        self._pg: PlacementGroup | None = None

        fitting = count_fitting_nodes(ray.nodes(), self._bundle)
        if fitting == 0:
            raise PlacementError(f"no alive node can hold a {role!r} replica {self._bundle}")
        self.plan = placement_plan(fitting, k + 1, role=role)
        if self.plan.warning:
            self.warnings.append(self.plan.warning)
            logger.warning(self.plan.warning)

        self._pg = placement_group(
            [dict(self._bundle) for _ in range(k + 1)],
            strategy=self.plan.strategy,
            lifetime="detached",
        )
        if not self._pg.wait(ready_timeout):
            remove_placement_group(self._pg)
            self._pg = None
            raise PlacementError(
                f"could not place {k + 1} {role!r} replicas ({self._bundle} each, "
                f"{self.plan.strategy}) on {fitting} node(s) within {ready_timeout}s"
            )
        try:
            self._replicas = [self._start(i) for i in range(k + 1)]
            # a replica's first answer waits on its worker's start (seconds on a busy node):
            # that is the ready timeout's to bound, not a call's
            start_timeout = max(ready_timeout, call_timeout)
            first = 0 if choose_primary is None else choose_primary(list(self._replicas))
            self.promote(first, timeout=start_timeout)
            if self.unacknowledged:
                raise ReplicaGroupError(
                    f"{role!r} replicas {self.unacknowledged} did not start within {start_timeout}s"
                )
        except BaseException:
            self.shutdown()
            raise

    # -- read-only views

    @property
    def replicas(self) -> list[Any]:
        """Actor handles, index i is the actor named `"{role}-{i}"` in bundle i."""
        return list(self._replicas)

    @property
    def primary(self) -> int | None:
        return self._primary

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def placement_group(self) -> PlacementGroup | None:
        return self._pg

    def name(self, index: int) -> str:
        return f"{self.role}-{index}"

    # -- operations

    def promote(self, index: int, timeout: float | None = None) -> int:
        """Make replica `index` primary under a new epoch; returns that epoch.

        If a replica reports a newer epoch (an earlier controller allocated it), the group
        jumps past it, so the returned epoch is always the newest any replica has seen.
        A replica that does not answer within `timeout` (the call timeout by default) is
        listed in `unacknowledged`.
        """
        self._check_index(index)
        epoch = self._epoch + 1
        for _ in range(3):
            refs = [r.set_epoch.remote(epoch, index) for r in self._replicas]
            results = self._gather(refs, self._call_timeout if timeout is None else timeout)
            newer = [r.current for r in results if isinstance(r, EpochFenced)]
            if not newer:
                break
            epoch = max(newer) + 1
        else:
            raise ReplicaGroupError(f"{self.role!r}: epoch kept moving under promote({index})")
        self._epoch = epoch
        self._primary = index
        self.unacknowledged = [i for i, r in enumerate(results) if r != epoch]
        if self.unacknowledged:
            logger.warning(
                "%r epoch %d (primary %d) not acknowledged by replicas %s: %s",
                self.role,
                epoch,
                index,
                self.unacknowledged,
                [results[i] for i in self.unacknowledged],
            )
        return epoch

    def nodes(self, timeout: float | None = None) -> list[str | None]:
        """Node id each replica runs on; None for a replica that did not answer in time."""
        refs = [r.node_id.remote() for r in self._replicas]
        results = self._gather(refs, self._call_timeout if timeout is None else timeout)
        return [r if isinstance(r, str) else None for r in results]

    def replace(self, index: int, timeout: float | None = None) -> Any:
        """Kill replica `index` and start a fresh one in the same bundle; returns its handle.

        The new replica is told the current epoch before this returns. If its node was lost,
        Ray re-places the bundle on another node when one fits; `timeout` bounds the wait.
        Catching up its state from a live peer is the role's job.
        """
        self._check_index(index)
        timeout = self._ready_timeout if timeout is None else timeout
        name = self.name(index)
        self.sync(exclude=(index,), timeout=timeout)
        try:
            ray.kill(self._replicas[index], no_restart=True)
        except Exception as exc:  # already gone: nothing to kill
            logger.debug("kill %s: %s", name, exc)
        if not poll(lambda: not self._name_taken(name), timeout):
            raise ReplicaGroupError(f"actor name {name!r} still taken {timeout}s after kill")
        handle = self._start(index)
        self._replicas[index] = handle
        if self._primary is not None and self._epoch > 0:
            ref = handle.set_epoch.remote(self._epoch, self._primary)
            (result,) = self._gather([ref], timeout)
            if result != self._epoch:
                raise ReplicaGroupError(
                    f"replacement {name!r} did not acknowledge epoch {self._epoch} "
                    f"within {timeout}s: {result!r}"
                )
        if index in self.unacknowledged:
            self.unacknowledged.remove(index)
        return handle

    def sync(self, exclude: Iterable[int] = (), timeout: float | None = None) -> int:
        """Adopt the newest epoch (and the primary it names) the replicas accepted, when it
        is newer than this controller's: a holder of the group may have promoted a replica
        at run time (the logger's `heal`). Replicas in `exclude` or not answering within
        `timeout` are not asked. Returns the controller's epoch."""
        timeout = self._call_timeout if timeout is None else timeout
        asked = [i for i in range(len(self._replicas)) if i not in set(exclude)]
        epochs = self._gather([self._replicas[i].epoch.remote() for i in asked], timeout)
        primaries = self._gather([self._replicas[i].primary_index.remote() for i in asked], timeout)
        best: tuple[int, int] | None = None
        for epoch, primary in zip(epochs, primaries, strict=True):
            known = isinstance(epoch, int) and isinstance(primary, int)
            if known and (best is None or epoch > best[0]):
                best = (epoch, primary)
        if best is not None and best[0] > self._epoch:
            logger.info("%r: adopting epoch %d (primary %d) from the replicas", self.role, *best)
            self._epoch, self._primary = best
        return self._epoch

    def shutdown(self) -> None:
        """Kill every replica for good and release the placement group. Idempotent."""
        for handle in self._replicas:
            try:
                ray.kill(handle, no_restart=True)
            except Exception as exc:
                logger.debug("kill during shutdown: %s", exc)
        self._replicas = []
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception as exc:
                logger.debug("remove placement group: %s", exc)
            self._pg = None

    def __enter__(self) -> ReplicaGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- internals

    def _check_index(self, index: int) -> None:
        if not 0 <= index < len(self._replicas):
            raise IndexError(f"{self.role!r} has replicas 0..{len(self._replicas) - 1}")

    def _start(self, index: int) -> Any:
        return self._actor_class.options(
            name=self.name(index),
            namespace=self.namespace,
            lifetime="detached",
            max_restarts=-1,
            max_task_retries=-1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=index
            ),
            **_actor_resource_options(self._bundle),
        ).remote(*self._args, **self._kwargs)

    def _name_taken(self, name: str) -> bool:
        try:
            ray.get_actor(name, namespace=self.namespace)
        except ValueError:
            return False
        return True

    @staticmethod
    def _gather(refs: list[Any], timeout: float) -> list[Any]:
        """Each ref's value, or the exception it raised, or TimeoutError if not ready."""
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        done = set(ready)
        results: list[Any] = []
        for ref in refs:
            if ref not in done:
                results.append(TimeoutError(f"no answer within {timeout}s"))
                continue
            try:
                results.append(ray.get(ref))
            except Exception as exc:
                results.append(exc)
        return results
