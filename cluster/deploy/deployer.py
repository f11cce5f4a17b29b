"""The one path every role is started, resized and stopped through.

`deploy` takes `RoleSpec`s and, for each, starts its supervisor (SUPERVISED, with the
children placed one per node while nodes last), its detached actors (DETACHED) or its
replica groups (REPLICA_GROUPS), then waits until every replica serves. `add_replica`
and `remove_replica` resize a supervised role one replica at a time (a new one serves
before it counts, a leaving one drains first); `drain` and `stop_supervisor` close a
role's replicas cleanly and stop them for good. All of it blocks on Ray calls: from
async code, call it through an executor.

A role whose replicas share one port (collector, gateway) starts through `deploy_on_port`.
The port is fixed before any replica binds it, so another process may take it in between:
a replica's bind then fails with `runtime.binding.PortTakenError` (its creation fails; Ray
does not restart an actor whose `__init__` raised), `wait_ready` recognises it in the
actor's death and `deploy` stops what it started. A port tierflow chose is then chosen
again, at most `PORT_ATTEMPTS` starts in all; a port it was given (the config's, the
caller's) is kept, and the error names it and the role.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError

from cluster.deploy.logger import start_group
from cluster.deploy.spec import RoleSpec, Start, SupervisorSpec, on_node
from runtime.binding import PortTakenError, taken_port
from runtime.nats.server import PORT_ATTEMPTS, PortChooser, choose_ports
from runtime.state.placement import actor_nodes, alive_nodes, plan
from runtime.supervision.policy import ChildSpec, load_start
from runtime.supervision.ray_actors import start_supervisor, supervised_options
from runtime.waiting import wait_until

log = logging.getLogger(__name__)


@dataclass
class Deployed:
    """A role that runs: its spec, its replicas' names (the live list that resizing
    changes), and the handles stopping it needs."""

    spec: RoleSpec
    namespace: str
    names: list[str]
    supervisor: Any = None  # SUPERVISED
    actors: list[Any] = field(default_factory=list)  # DETACHED: the actor handles
    groups: list[tuple[Any, Any]] = field(default_factory=list)  # (ReplicaGroup, client)
    answers: dict[str, Any] = field(default_factory=dict)  # name -> what `ready` answered


def deploy(
    specs: Sequence[RoleSpec], *, namespace: str, state_dir: str, timeout_s: float = 120.0
) -> list[Deployed]:
    """Start `specs` in order and return them (in that order) once every replica serves.

    Roles that name the same supervisor are started under it together (one supervisor
    start with all their children, each role placed on its own over the alive nodes);
    then each role's replicas are waited for, in the order given. A replica that found
    its port taken stops the supervisors started here (and their children) for good, and
    its `PortTakenError` is raised.
    """
    nodes = alive_nodes() if any(s.start is Start.SUPERVISED for s in specs) else []
    out: list[Deployed] = []
    supervisors: dict[str, tuple[SupervisorSpec, list[ChildSpec]]] = {}
    for spec in specs:
        d = Deployed(spec, namespace, spec.names)
        if spec.start is Start.SUPERVISED:
            assert spec.supervisor is not None
            placed = plan(len(spec.children), nodes)
            _, children = supervisors.setdefault(spec.supervisor.name, (spec.supervisor, []))
            children += [on_node(c, n) for c, n in zip(spec.children, placed, strict=True)]
        elif spec.start is Start.DETACHED:
            d.actors = [_start_detached(c, namespace) for c in spec.children]
        else:
            d.groups = [
                start_group(c, spec.k, namespace, **spec.group_options) for c in spec.children
            ]
        out.append(d)
    handles = {
        name: start_supervisor(
            name,
            children,
            state_dir=state_dir,
            namespace=namespace,
            ray_options=dict(sup.ray_options),
            strategy=sup.strategy,
            intensity=sup.intensity,
        )
        for name, (sup, children) in supervisors.items()
    }
    for d in out:
        if d.spec.supervisor is not None:
            d.supervisor = handles[d.spec.supervisor.name]
    try:
        for d in out:
            if d.spec.ready:
                for name in d.names:
                    d.answers[name] = wait_ready(namespace, name, d.spec.ready, timeout_s)
    except PortTakenError:
        for name, handle in handles.items():
            children = [c.id for c in supervisors[name][1]]
            stop_supervisor(handle)
            wait_gone(namespace, [name, *children])  # the names free for the next start
        raise
    return out


def deploy_on_port(
    build: Callable[[int], Sequence[RoleSpec]],
    *,
    role: str,
    port: int,
    given: str = "it was given",
    namespace: str,
    state_dir: str,
    timeout_s: float = 120.0,
    chooser: PortChooser | None = None,
    attempts: int = PORT_ATTEMPTS,
) -> tuple[list[Deployed], int]:
    """`deploy(build(p))` for roles whose replicas all serve one port `p`; returns what
    `deploy` returns and the port they serve.

    `port` 0: tierflow chooses it (`chooser`, default `free_ports`); when a replica finds
    it taken, what started is stopped and the roles start again on another, at most
    `attempts` starts in all. A nonzero `port` was given (`given` says by whom, such as
    ``roles.gateway.port in the config``): taken, it fails at once. Either failure is a
    `PortTakenError` naming the port and `role`."""
    tried: list[int] = []
    for attempt in range(1, attempts + 1):
        chosen = port or choose_ports(1, "127.0.0.1", tried, chooser)[0]
        try:
            return deploy(
                build(chosen), namespace=namespace, state_dir=state_dir, timeout_s=timeout_s
            ), chosen
        except PortTakenError as err:
            tried.append(chosen)
            if port:
                raise PortTakenError(
                    f"{role}: port {chosen} is taken (EADDRINUSE); {given}, so no other is "
                    f"tried: free it or choose another ({err})",
                    chosen,
                ) from err
            log.warning(
                "%s: chosen port %d is taken (%s); start %d of %d",
                role,
                chosen,
                err,
                attempt,
                attempts,
            )
    raise PortTakenError(
        f"{role}: port {tried[-1]} is taken (EADDRINUSE) after {attempts} start(s) on "
        f"chosen ports {tried}",
        tried[-1],
    )


def wait_gone(namespace: str, names: Sequence[str], timeout_s: float = 30.0) -> None:
    """Until no actor holds any of `names` (a killed one lets its name go a moment later)."""

    def gone() -> bool:
        for name in names:
            try:
                ray.get_actor(name, namespace=namespace)
            except ValueError:
                continue
            return False
        return True

    wait_until(gone, timeout=timeout_s, interval=0.1, what=f"{', '.join(names)} gone")


def _start_detached(child: ChildSpec, namespace: str) -> Any:
    """A named, detached actor Ray restarts forever (`supervised_options`); the running
    one if it exists."""
    opts = supervised_options(child.id, namespace, **(child.ray_options or {}))
    return ray.remote(load_start(child.start)).options(**opts).remote(*child.args, **child.kwargs)


def wait_ready(namespace: str, name: str, method: str, timeout_s: float = 120.0) -> Any:
    """What replica `name`'s `method` answers once it is not None (it serves); each call
    is bounded, and an actor not registered yet counts as not ready. A replica that died
    because its port is taken raises `PortTakenError` at once (its supervisor would only
    start it again on the same port)."""
    taken: list[PortTakenError] = []

    def answer() -> tuple[Any] | None:
        try:
            got = ray.get(
                getattr(ray.get_actor(name, namespace=namespace), method).remote(), timeout=30
            )
        except RayActorError as err:
            port = taken_port(str(err))
            if port is None:
                raise
            taken.append(PortTakenError(f"{name} could not bind port {port}: it is taken", port))
            return (None,)
        return None if got is None else (got,)

    got = wait_until(answer, timeout=timeout_s, what=f"{name} serving", swallow=True)[0]
    if taken:
        raise taken[0]
    return got


def add_replica(
    supervisor: Any,
    child: ChildSpec,
    *,
    namespace: str,
    siblings: Sequence[str],
    ready: str | None,
    timeout_s: float = 120.0,
) -> Any:
    """Start one more replica under `supervisor` on the alive node with the fewest of
    `siblings` (its role's other replicas), and return what it answers once it serves."""
    placed = actor_nodes({n: ray.get_actor(n, namespace=namespace) for n in siblings})
    spec = on_node(child, plan(1, alive_nodes(), placed.values())[0])
    ray.get(supervisor.add_child.remote(spec), timeout=60)
    return wait_ready(namespace, spec.id, ready, timeout_s) if ready else None


def remove_replica(supervisor: Any, name: str, timeout_s: float = 180.0) -> bool:
    """Stop supervising `name`, let it drain (`shutdown`: stop taking work, finish what
    it holds), then stop it for good; whether the drain finished in time."""
    return ray.get(supervisor.remove_child.remote(name, drain="shutdown"), timeout=timeout_s)


def drain(namespace: str, names: Sequence[str], method: str, timeout_s: float) -> None:
    """Call `method` (a clean close: drain, flush, hand over) on each named replica; one
    that is gone already has nothing left to close."""
    for name in names:
        try:
            ray.get(
                getattr(ray.get_actor(name, namespace=namespace), method).remote(),
                timeout=timeout_s,
            )
        except Exception as err:
            log.info("%s %s: %r", method, name, err)


def stop_supervisor(supervisor: Any, timeout_s: float = 60.0) -> None:
    """Stop supervising and kill the children for good, then the supervisor itself."""
    try:
        ray.get(supervisor.stop.remote(), timeout=timeout_s)
    except Exception as err:  # a dying cluster must not block the rest of shutdown
        log.warning("supervisor did not stop cleanly: %r", err)
    with contextlib.suppress(Exception):
        ray.kill(supervisor, no_restart=True)
