"""Supervision of Ray actors: what Ray's own restarts do not give.

Ray restarts a dead actor process (`max_restarts=-1`) and retries its calls
(`max_task_retries=-1`); it has no restart strategies, no restart intensity, no backoff, no
escalation and no notion of a hung actor. A `RaySupervisor` adds those, OTP style, deciding
only through the pure functions of `runtime.supervision.policy`:

- it pings each child's `heartbeat()` every `heartbeat_interval_s`, each ping bounded by
  `heartbeat_deadline_s`;
- a changed incarnation id means Ray restarted the child: a restart in the history;
- a missed deadline while Ray reports the actor ALIVE means it hangs: it is killed with
  `no_restart=False` so Ray restarts it (a restart, counted when the kill is made);
- `ActorDiedError` means Ray gave up (or the child exited on purpose): the child is created
  again after the backoff delay, unless its restart type says otherwise;
- ONE_FOR_ALL: when one child restarts, the others are killed (`no_restart=False`) so they all
  restart from a common point;
- past the restart intensity it escalates: it stops its children (`no_restart=True`), records
  why in `status()`, and calls its parent supervisor's `child_escalated(name, reason)`.

A supervised actor subclasses `SupervisedActor`, which gives it an incarnation id, a
`heartbeat()` and a LevelDB `CheckpointStore` restored in `__init__` (Ray reruns `__init__`
on restart and keeps nothing else). Ray delays restarting a crashed process by nothing, so
backoff applies to what the supervisor does itself: creating a dead child again.

Example:
    ```py
    @ray.remote
    class Counter(SupervisedActor):
        def restore(self, store): self.ns = store.namespace("c"); ...

    sup = start_supervisor(
        "collector-sup",
        [ChildSpec("counter", Counter, kwargs={"state_dir": "/var/tierflow"})],
        state_dir="/var/tierflow",
        intensity=Intensity(3, 60.0),
    )
    ray.get(sup.status.remote())
    ```
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import ray
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    ActorUnschedulableError,
    RayActorError,
)

from runtime.state import placement
from runtime.state.checkpoint import CheckpointLockedError, CheckpointStore
from runtime.supervision.policy import (
    Backoff,
    ChildSpec,
    Exit,
    HeartbeatState,
    Intensity,
    Restart,
    RestartHistory,
    Seen,
    Strategy,
    attribute_restart,
    decide,
    hung,
    index_specs,
    load_start,
    observe,
    recent_restarts,
)

__all__ = [
    "RaySupervisor",
    "SupervisedActor",
    "actor_state",
    "exit_from_death",
    "gcs_actor_info",
    "start_supervisor",
    "supervised_options",
]

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "tierflow"
_MAX_ESCALATIONS = 100  # received escalations kept for status()
_NOT_HUNG_STATES = frozenset({"RESTARTING", "PENDING_CREATION", "DEPENDENCIES_UNREADY", "DEAD"})


def node_ip() -> str:
    """The address of the Ray node this process runs on (what other hosts reach it by)."""
    return str(ray.util.get_node_ip_address())


def supervised_options(
    name: str, namespace: str = DEFAULT_NAMESPACE, **extra: Any
) -> dict[str, Any]:
    """Ray options every role actor uses: named and detached in a fixed namespace (so a
    supervisor or a restarted driver finds it again), restarted and its calls retried forever
    by Ray, and `get_if_exists` so starting it twice yields the running one. `extra`
    (num_cpus, scheduling_strategy, ...) is added and may override any of these."""
    return {
        "name": name,
        "namespace": namespace,
        "lifetime": "detached",
        "max_restarts": -1,
        "max_task_retries": -1,
        "get_if_exists": True,
        **extra,
    }


def _check_name(name: str) -> str:
    """The name becomes a directory under `state_dir/checkpoints`, so it must be one path part."""
    if not name or name in {".", ".."} or "/" in name or os.sep in name or "\x00" in name:
        raise ValueError(f"actor name {name!r} cannot be used as a checkpoint directory name")
    return name


def _open_store(path: Path, timeout_s: float) -> CheckpointStore:
    """Open the store, waiting (bounded) while the LOCK is still held: after a kill the dying
    process may hold it for a moment after Ray has already started the replacement."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return CheckpointStore(path)
        except CheckpointLockedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class SupervisedActor:
    """Base class for Ray actors under a `RaySupervisor`.

    Subclass it, then apply `ray.remote` to the subclass. `__init__` records a fresh
    incarnation id (new on every Ray restart), the pid, node and start time, opens the
    LevelDB store at `state_dir/checkpoints/<name>` and calls `restore(store)`, where the
    subclass reloads its state. `name` defaults to the Ray actor name. Write state through
    `self.store` with synced writes (the default) so a crash loses nothing acknowledged.
    """

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        *,
        name: str | None = None,
        open_timeout_s: float = 10.0,
        open_store: bool = True,
    ) -> None:
        ctx = ray.get_runtime_context()
        actor_name = name or ctx.get_actor_name()
        if not actor_name:
            raise ValueError("SupervisedActor needs a name: pass name=... or start it named")
        self.name = _check_name(actor_name)
        self.incarnation = uuid.uuid4().hex
        self.pid = os.getpid()
        self.node_id = ctx.get_node_id()
        self.actor_id = ctx.get_actor_id()
        self.started_at = time.time()
        self.state_dir = Path(state_dir)
        self.store: CheckpointStore  # set here, or by `adopt_store` when opened later
        if open_store:
            self.adopt_store(_open_store(self.store_path, open_timeout_s))

    @property
    def store_path(self) -> Path:
        return self.state_dir / "checkpoints" / self.name

    def adopt_store(self, store: CheckpointStore) -> None:
        """Use `store` (opened at `store_path`) from now on and `restore` from it; for a
        subclass that opens it later than `__init__` (`open_store=False`: a standby)."""
        self.store = store
        self.restore(store)

    def restore(self, store: CheckpointStore) -> None:
        """Reload state from `store`; runs in every `__init__`, first start included."""

    def heartbeat(self) -> dict[str, Any]:
        """Who is answering: a changed `incarnation` tells the supervisor the process was
        restarted even if it never saw it down."""
        return {
            "name": self.name,
            "incarnation": self.incarnation,
            "pid": self.pid,
            "node_id": self.node_id,
            "actor_id": self.actor_id,
            "started_at": self.started_at,
        }


def exit_from_death(error: RayActorError) -> Exit:
    """How a Ray child ended, from the `ActorDiedError` Ray gives for it: `exit_actor()` is a
    NORMAL exit (Ray does not restart it), `ray.kill` is KILLED, anything else ABNORMAL."""
    text = str(error)
    if "INTENDED_USER_EXIT" in text or "exit_actor()" in text:
        return Exit.NORMAL
    if "killed by `ray.kill`" in text:
        return Exit.KILLED
    return Exit.ABNORMAL


def gcs_actor_info(actor_id: str) -> dict[str, Any] | None:
    """Ray's own record of an actor (`State`: ALIVE, RESTARTING, DEAD, ...; `NumRestarts`),
    or None if it cannot be read.

    Uses `ray._private.state.actors`, the call behind the public (and deprecated)
    `RuntimeContext.was_current_actor_reconstructed`. It tells a hung actor (ALIVE, silent)
    from one Ray is restarting (calls to it queue silently meanwhile)."""
    try:
        from ray._private import state as ray_state

        info = ray_state.actors(actor_id=actor_id)
    except Exception:  # noqa: BLE001 - unknown: callers fall back to a safe default
        return None
    return info or None


def actor_state(handle: Any) -> str | None:
    """Ray's `State` of the actor behind `handle` (ALIVE, RESTARTING, DEAD, ...), or None
    when Ray's record cannot be read."""
    info = gcs_actor_info(handle._actor_id.hex())
    return info.get("State") if info else None


class _Saved(msgspec.Struct, kw_only=True):
    """What a supervisor keeps across its own Ray restarts."""

    history: list[float] = []
    restarts: dict[str, int] = {}
    incarnations: dict[str, str] = {}
    dropped: list[str] = []
    escalated: str | None = None
    parent_notified: bool = False
    stopped: bool = False
    escalations: list[dict[str, Any]] = []
    added: dict[str, bytes] = {}  # ChildSpecs added at run time (pickled: they hold handles)


@dataclass
class _Child:
    """Live view of one child; only touched from the supervisor's event loop."""

    handle: Any = None
    beat: HeartbeatState | None = None
    pid: int | None = None
    killed_at: float | None = None  # a kill we made whose restart is still to be seen
    recreating: bool = False


class RaySupervisor(SupervisedActor):
    """A supervisor for Ray actors; itself an async, detached, named Ray actor.

    One concept: OTP's supervisor (the policy is `runtime.supervision.policy`; this applies
    it to Ray actors and checkpoints what it decided).

    Start it with `start_supervisor(...)` (or as a child of another supervisor with
    ``start="runtime.supervision.ray_actors:RaySupervisor"``). Each `ChildSpec.id` is also the Ray
    actor name of the child, in the supervisor's namespace; `spec.ray_options` are merged
    into `supervised_options`, and a TEMPORARY child gets no Ray restarts at all.

    The restart history, counts, escalation and received escalations are checkpointed, so
    a Ray restart of the supervisor resumes them (a crash loop cannot reset its own count);
    a supervisor created afresh under the same name starts clean, as in OTP.

    Args:
        children: the child specs, in start order.
        state_dir: root of the checkpoint stores (`<state_dir>/checkpoints/<name>`).
        strategy, intensity, backoff: the policy, see `runtime.supervision.policy`.
        heartbeat_interval_s: pause between monitoring rounds.
        heartbeat_deadline_s: how long one heartbeat may take before the child counts as
            hung (if Ray reports it ALIVE); keep it above the child's longest blocking call.
        restart_grace_s: how long a kill made by the supervisor may take to show up as a
            new incarnation before later incarnations count as new failures again.
        parent: name of the parent supervisor (same namespace) told of an escalation.
        name, namespace: default to the Ray actor's own name and the job's namespace.
    """

    def __init__(
        self,
        children: Sequence[ChildSpec],
        *,
        state_dir: str | os.PathLike[str],
        strategy: Strategy = Strategy.ONE_FOR_ONE,
        intensity: Intensity = Intensity(3, 60.0),  # noqa: B008 - frozen value
        backoff: Backoff = Backoff(base_s=0.5, cap_s=30.0),  # noqa: B008 - frozen value
        heartbeat_interval_s: float = 1.0,
        heartbeat_deadline_s: float = 5.0,
        restart_grace_s: float = 60.0,
        parent: str | None = None,
        name: str | None = None,
        namespace: str | None = None,
    ) -> None:
        self._specs = index_specs(children)
        self._strategy = strategy
        self._intensity = intensity
        self._backoff = backoff
        self._interval_s = heartbeat_interval_s
        self._deadline_s = heartbeat_deadline_s
        self._grace_s = restart_grace_s
        self._parent = parent
        self._saved = _Saved()
        super().__init__(state_dir, name=name)  # calls restore()
        for cid, blob in self._saved.added.items():  # children added by scaling, kept
            self._specs.setdefault(cid, ray.cloudpickle.loads(blob))
        self._namespace = namespace or ray.get_runtime_context().namespace
        self._children = {cid: _Child() for cid in self._specs}
        self._lost_nodes: set[str] = set()  # pinned-to nodes Ray found gone (ids never return)
        now = time.time()
        for cid, inc in self._saved.incarnations.items():
            if cid in self._children:
                self._children[cid].beat = HeartbeatState(inc, now)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task = asyncio.get_running_loop().create_task(self._run())

    # ---------------------------------------------------------------- persistence

    def restore(self, store: CheckpointStore) -> None:
        self._ns = store.namespace("supervisor")
        info = gcs_actor_info(self.actor_id)
        if not info or not info.get("NumRestarts"):
            # created afresh (not restarted by Ray): a new supervisor gets a clean history,
            # as in OTP; if Ray's record is unreadable, a clean start is the safer guess
            self._ns.delete(b"state")
            return
        raw = self._ns.get(b"state")
        if raw is not None:
            self._saved = msgspec.json.decode(raw, type=_Saved)

    def _save(self) -> None:
        self._ns.put(b"state", msgspec.json.encode(self._saved))

    @property
    def _order(self) -> list[str]:
        return [cid for cid in self._specs if cid not in self._saved.dropped]

    @property
    def _active(self) -> bool:
        return self._saved.escalated is None and not self._saved.stopped

    # ---------------------------------------------------------------- remote methods

    async def status(self) -> dict[str, Any]:
        """Children (state, restarts, incarnation, pid), history and escalation."""
        children = {}
        for cid in self._specs:
            child = self._children[cid]
            if cid in self._saved.dropped:
                state = "dropped"
            elif not self._active:
                state = "stopped"
            elif child.recreating:
                state = "restarting"
            elif child.beat is None:
                state = "starting"
            else:
                state = "running"
            children[cid] = {
                "state": state,
                "restarts": self._saved.restarts.get(cid, 0),
                "incarnation": child.beat.incarnation if child.beat else None,
                "last_seen": child.beat.last_seen if child.beat else None,
                "pid": child.pid,
            }
        return {
            "name": self.name,
            "incarnation": self.incarnation,
            "strategy": self._strategy.value,
            "escalated": self._saved.escalated is not None,
            "escalation_reason": self._saved.escalated,
            "stopped": self._saved.stopped,
            "history": list(self._saved.history),
            "escalations": list(self._saved.escalations),
            "children": children,
        }

    async def child_escalated(self, name: str, reason: str) -> None:
        """A child supervisor gave up; recorded (and kept across restarts) for the operator."""
        log.error("child supervisor %s escalated: %s", name, reason)
        self._saved.escalations.append({"child": name, "reason": reason, "at": time.time()})
        del self._saved.escalations[:-_MAX_ESCALATIONS]
        self._save()

    async def child_spec(self, cid: str) -> ChildSpec:
        """The spec a child runs with (a template for one more like it)."""
        if cid not in self._specs:
            raise ValueError(f"{self.name}: no child {cid!r}")
        return self._specs[cid]

    async def add_child(self, spec: ChildSpec) -> str:
        """Start and supervise one more child (scaling up); kept across this actor's restarts."""
        if spec.id in self._specs and spec.id not in self._saved.dropped:
            raise ValueError(f"{self.name}: child {spec.id!r} already exists")
        if spec.id in self._saved.dropped:
            self._saved.dropped.remove(spec.id)
        self._specs[spec.id] = spec
        self._children[spec.id] = _Child()
        self._saved.added[spec.id] = ray.cloudpickle.dumps(spec)
        self._save()
        self._children[spec.id].handle = self._create(spec.id)
        return spec.id

    async def remove_child(
        self, cid: str, *, drain: str | None = "shutdown", timeout_s: float = 60.0
    ) -> bool:
        """Scale down by one child: stop supervising it, let it drain (call its `drain`
        method: stop taking work, finish what it holds), then kill it for good.
        Returns whether the drain finished in time."""
        if cid not in self._specs or cid in self._saved.dropped:
            raise ValueError(f"{self.name}: no child {cid!r}")
        self._saved.dropped.append(cid)  # the monitor stops watching it first
        self._save()
        drained = True
        handle = self._children[cid].handle
        if drain and handle is not None:
            try:
                drained = bool(await asyncio.wait_for(getattr(handle, drain).remote(), timeout_s))
            except Exception as exc:  # noqa: BLE001 - a dead child has nothing left to drain
                log.warning("%s: drain of %s failed: %r", self.name, cid, exc)
                drained = False
        self._kill(cid, no_restart=True)
        self._saved.added.pop(cid, None)
        self._save()
        return drained

    async def stop(self) -> None:
        """Stop supervising and kill the children for good; survives a restart of this actor."""
        self._saved.stopped = True
        self._save()
        self._loop_task.cancel()
        self._kill_all()

    # ---------------------------------------------------------------- monitoring loop

    async def _run(self) -> None:
        if self._saved.escalated is not None and not self._saved.parent_notified:
            self._spawn(self._notify_parent(self._saved.escalated))
        if not self._active:
            return
        for cid in self._order:
            try:
                self._children[cid].handle = self._create(cid)
            except Exception as exc:  # noqa: BLE001 - a child that cannot start escalates
                self._escalate(f"child {cid!r} failed to start: {exc!r}")
                return
        while self._active:
            try:
                await self._check_round()
            except Exception:
                log.exception("supervisor %s: monitoring round failed", self.name)
            await asyncio.sleep(self._interval_s)

    async def _check_round(self) -> None:
        """Ping every live child at once, then judge the answers in start order."""
        ids = [
            cid
            for cid in self._order
            if self._children[cid].handle is not None and not self._children[cid].recreating
        ]
        answers = await asyncio.gather(*(self._ping(cid) for cid in ids))
        for cid, answer in zip(ids, answers, strict=True):
            if not self._active:
                return
            if cid in self._order and not self._children[cid].recreating:
                self._judge(cid, answer)

    async def _ping(self, cid: str) -> dict[str, Any] | BaseException:
        handle = self._children[cid].handle
        try:
            ref = handle.heartbeat.options(max_task_retries=0).remote()
            return await asyncio.wait_for(ref, timeout=self._deadline_s)
        except Exception as exc:  # noqa: BLE001 - judged by _judge, like a silence
            return exc

    def _judge(self, cid: str, answer: dict[str, Any] | BaseException) -> None:
        child = self._children[cid]
        now = time.time()
        if isinstance(answer, ActorDiedError):
            child.handle = None
            self._on_exit(cid, exit_from_death(answer), now, dead=True)
        elif isinstance(answer, ActorUnschedulableError):  # its pinned node is gone
            hint = (self._specs[cid].ray_options or {}).get(placement.NODE_HINT)
            if hint:
                self._lost_nodes.add(hint)
            child.handle = None
            self._on_exit(cid, Exit.ABNORMAL, now, dead=True)
        elif isinstance(answer, ActorUnavailableError):
            return  # Ray is restarting it; the next answer carries the new incarnation
        elif isinstance(answer, BaseException):
            self._on_silent(cid, now)
        else:
            self._on_answer(cid, answer, now)

    def _on_answer(self, cid: str, hb: dict[str, Any], now: float) -> None:
        child = self._children[cid]
        seen, child.beat = observe(child.beat, hb["incarnation"], now)
        child.pid = hb.get("pid")
        if seen is Seen.SAME:
            return
        self._saved.incarnations[cid] = hb["incarnation"]
        self._save()
        if seen is Seen.FIRST:
            return
        ours, child.killed_at = attribute_restart(
            child.killed_at, hb.get("started_at", now), now, self._grace_s
        )
        if not ours:
            log.warning("child %s was restarted by Ray (new incarnation)", cid)
            self._on_exit(cid, Exit.ABNORMAL, now, dead=False)

    def _on_silent(self, cid: str, now: float) -> None:
        """No answer within the deadline: hung, unless Ray says it is (re)starting or gone."""
        child = self._children[cid]
        state = actor_state(child.handle)
        if not hung(
            ray_alive=state not in _NOT_HUNG_STATES,  # DEAD: the next ping raises ActorDiedError
            last_seen=child.beat.last_seen if child.beat else None,
            killed_at=child.killed_at,
            now=now,
            deadline_s=self._deadline_s,
            grace_s=self._grace_s,
        ):
            return
        log.warning("child %s missed its heartbeat deadline (Ray state %s)", cid, state)
        self._on_exit(cid, Exit.KILLED, now, dead=False)

    # ---------------------------------------------------------------- applying decisions

    def _on_exit(self, cid: str, exit: Exit, now: float, *, dead: bool) -> None:
        """Apply `decide()` for child `cid`; `dead` means Ray will not bring it back itself."""
        history = RestartHistory(tuple(self._saved.history))
        decision = decide(
            self._order,
            cid,
            exit,
            self._specs,
            self._strategy,
            history,
            self._intensity,
            now=now,
            attempt=recent_restarts(history, now, self._intensity.period_s),
            rand=random.random(),
            backoff=self._backoff,
        )
        self._saved.history = list(decision.history.times)
        if decision.escalate:
            self._escalate(decision.reason)
            return
        for sid in decision.drop:
            self._kill(sid, no_restart=True)
            self._saved.dropped.append(sid)
        for sid in decision.stop:
            if sid not in decision.drop:
                self._kill(sid, no_restart=False, now=now)  # Ray restarts it: all restart
        for rid in decision.restart:
            self._saved.restarts[rid] = self._saved.restarts.get(rid, 0) + 1
        if cid in decision.restart:
            if dead:
                self._children[cid].recreating = True
                self._spawn(self._recreate(cid, decision.delay_s))
            elif exit is Exit.KILLED:
                self._kill(cid, no_restart=False, now=now)  # hung: make Ray restart it
        self._save()
        log.info("supervisor %s: %s", self.name, decision.reason)

    async def _recreate(self, cid: str, delay_s: float) -> None:
        """Create a dead child again after the backoff (`recreating` was set by the caller,
        so no ping goes to the dead handle meanwhile)."""
        child = self._children[cid]
        await asyncio.sleep(delay_s)
        child.recreating = False
        if not self._active or cid not in self._order:
            return
        child.killed_at = time.time()  # its first answer is the restart we made
        try:
            child.handle = self._create(cid)
        except Exception as exc:  # noqa: BLE001 - a failed start is a failed child
            log.warning("recreating %s failed: %r", cid, exc)
            self._on_exit(cid, Exit.ABNORMAL, time.time(), dead=True)

    def _escalate(self, reason: str) -> None:
        log.error("supervisor %s escalates: %s", self.name, reason)
        self._saved.escalated = reason
        self._save()
        self._kill_all()
        self._spawn(self._notify_parent(reason))

    async def _notify_parent(self, reason: str) -> None:
        """Tell the parent supervisor, retrying a few times (it may be restarting)."""
        if self._parent is None:
            return
        for attempt in range(5):
            try:
                parent = ray.get_actor(self._parent, namespace=self._namespace)
                await asyncio.wait_for(parent.child_escalated.remote(self.name, reason), 10.0)
            except Exception as exc:  # noqa: BLE001 - retried, then logged
                log.warning(
                    "notifying parent %s failed (%r), attempt %d", self._parent, exc, attempt
                )
                await asyncio.sleep(0.5 * 2**attempt)
            else:
                self._saved.parent_notified = True
                self._save()
                return
        log.error("could not tell parent %s that %s escalated: %s", self._parent, self.name, reason)

    # ---------------------------------------------------------------- Ray plumbing

    def _create(self, cid: str) -> Any:
        spec = self._specs[cid]
        target = load_start(spec.start)
        actor_cls = target if isinstance(target, ray.actor.ActorClass) else ray.remote(target)
        opts = supervised_options(cid, self._namespace, **dict(spec.ray_options or {}))
        if opts.get(placement.NODE_HINT):
            opts.update(placement.strategy(self._place(cid, opts.pop(placement.NODE_HINT))))
        if spec.restart is Restart.TEMPORARY:
            opts.update(max_restarts=0, max_task_retries=0)
        return actor_cls.options(**opts).remote(*spec.args, **dict(spec.kwargs))

    def _place(self, cid: str, hint: str) -> str | None:
        """The child's hinted node while it lives; else a live node with the fewest of its
        siblings (same start target), remembered as its new hint for later restarts."""
        spec = self._specs[cid]
        siblings = [
            (s.ray_options or {}).get(placement.NODE_HINT)
            for other, s in self._specs.items()
            if other != cid and s.start == spec.start and other not in self._saved.dropped
        ]
        alive = [n for n in placement.alive_nodes() if n not in self._lost_nodes]
        node = placement.resolve(hint, alive, siblings)
        if node != hint:
            log.warning("%s: node %s of %s is gone; placing it on %s", self.name, hint, cid, node)
            opts = {**(spec.ray_options or {}), placement.NODE_HINT: node}
            self._specs[cid] = dataclasses.replace(spec, ray_options=opts)
            if cid in self._saved.added:
                self._saved.added[cid] = ray.cloudpickle.dumps(self._specs[cid])
                self._save()
        return node

    def _kill(self, cid: str, *, no_restart: bool, now: float | None = None) -> None:
        child = self._children[cid]
        if child.handle is None:
            return
        try:
            ray.kill(child.handle, no_restart=no_restart)
        except Exception as exc:  # noqa: BLE001 - already gone is fine
            log.info("kill of %s: %r", cid, exc)
        if no_restart:
            child.handle = None
        else:
            child.killed_at = now if now is not None else time.time()

    def _kill_all(self) -> None:
        for cid in reversed(list(self._specs)):
            self._kill(cid, no_restart=True)

    def _spawn(self, coro: Any) -> None:
        """Run a background coroutine, keeping a reference so it is not collected."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def start_supervisor(
    name: str,
    children: Sequence[ChildSpec],
    *,
    state_dir: str | os.PathLike[str],
    namespace: str = DEFAULT_NAMESPACE,
    ray_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """Start (or get, if it runs) the named, detached supervisor; `kwargs` go to
    `RaySupervisor.__init__` (strategy, intensity, backoff, heartbeat_*, parent). Its
    children live in the same namespace."""
    opts = supervised_options(name, namespace, **(ray_options or {}))
    remote_cls = ray.remote(RaySupervisor)
    return remote_cls.options(**opts).remote(
        children, state_dir=str(state_dir), namespace=namespace, **kwargs
    )
