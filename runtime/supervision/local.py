"""Supervision of pykka actors inside one process (pykka has none of its own).

Blocking work inside a Ray actor (a LevelDB writer, a source reader, a webhook sender) runs
in pykka actors; a `LocalSupervisor` restarts them by the policy in `runtime.supervision.policy`
and escalates a crash loop to its `on_escalate` callback and to its own supervisor.

How pykka 4.5 ends an actor, and what the supervisor makes of it:
- an exception in a `tell` (or a proxy call sent with `.defer()`) stops the actor and calls
  `on_failure`: an ABNORMAL exit;
- an exception in an `ask` (or a proxy call awaited with `.get()`) goes to the caller's future
  and the actor lives on: not an exit at all;
- `stop()` runs `on_stop`: a NORMAL exit, unless the supervisor asked for it;
- an exception in `on_start` stops the actor without `on_failure`; the supervisor's liveness
  sweep finds it (a child seen dead on two sweeps in a row is an ABNORMAL exit).

Example:
    ```py
    class Writer(Supervised, pykka.ThreadingActor):
        def on_receive(self, message): ...

    sup = LocalSupervisor.start(
        [ChildSpec("writer", Writer, args=(path,))],
        strategy=Strategy.ONE_FOR_ONE,
        intensity=Intensity(3, 5.0),
        on_escalate=lambda reason: os._exit(1),  # let Ray restart the whole actor
    )
    writer = sup.proxy().get_child("writer").get()  # the current ref, after any restart
    ```
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import pykka

from runtime.supervision.policy import (
    Backoff,
    ChildSpec,
    Exit,
    Intensity,
    RestartHistory,
    Strategy,
    decide,
    index_specs,
    load_start,
    recent_restarts,
)

__all__ = ["LocalSupervisor", "Supervised"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Link:
    """Where a child reports its exit: set by the supervisor while it constructs the child."""

    supervisor: pykka.ActorRef[Any]
    child_id: str


_current_link: contextvars.ContextVar[_Link | None] = contextvars.ContextVar(
    "tierflow_supervisor_link", default=None
)


@dataclass(frozen=True)
class _ChildExited:
    child_id: str
    urn: str
    exit: Exit
    reason: str


@dataclass(frozen=True)
class _RestartDue:
    ids: tuple[str, ...]
    token: int


@dataclass(frozen=True)
class _Sweep:
    pass


class Supervised:
    """Mixin for a pykka actor run by a `LocalSupervisor`: it reports its own exit at once.

    Put it before the pykka base (`class W(Supervised, pykka.ThreadingActor)`). If you override
    `on_failure` or `on_stop`, call `super()` last, after your cleanup: the report may start
    the replacement, which must find resources (files, LevelDB locks) already released.
    Without the mixin a child is still supervised, but only noticed by the liveness sweep.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._supervisor_link: _Link | None = _current_link.get()
        self._exit_reported = False

    def on_failure(
        self,
        exception_type: type[BaseException] | None,
        exception_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        name = exception_type.__name__ if exception_type else "failure"
        self.report_exit(Exit.ABNORMAL, f"{name}: {exception_value}")

    def on_stop(self) -> None:
        self.report_exit(Exit.NORMAL, "stopped")

    def report_exit(self, exit: Exit, reason: str) -> None:
        """Tell the supervisor how this actor ended; only the first report counts."""
        link = self._supervisor_link
        if self._exit_reported or link is None:
            return
        self._exit_reported = True
        urn = self.actor_urn  # type: ignore[attr-defined]
        try:
            link.supervisor.tell(_ChildExited(link.child_id, urn, exit, reason))
        except pykka.ActorDeadError:
            log.debug("%s exited (%s) after its supervisor stopped", link.child_id, reason)


class LocalSupervisor(Supervised, pykka.ThreadingActor):
    """A pykka actor that starts, watches and restarts child actors.

    Decisions come from `runtime.supervision.policy.decide`; restarts wait for the backoff on a
    timer, never in the actor loop, so the supervisor keeps answering `get_child`/`status`
    meanwhile. Past the restart intensity it stops its children, calls `on_escalate(reason)`,
    reports an ABNORMAL exit to its own supervisor (if it is a child of one) and stops.
    Stopping it stops its children, in reverse start order.
    """

    def __init__(
        self,
        children: Sequence[ChildSpec],
        *,
        strategy: Strategy = Strategy.ONE_FOR_ONE,
        intensity: Intensity = Intensity(3, 5.0),  # noqa: B008 - frozen value
        backoff: Backoff = Backoff(),  # noqa: B008 - frozen value
        on_escalate: Callable[[str], None] | None = None,
        sweep_interval_s: float | None = 1.0,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        super().__init__()
        self._specs = index_specs(children)
        self._strategy = strategy
        self._intensity = intensity
        self._backoff = backoff
        self._on_escalate = on_escalate
        self._sweep_interval_s = sweep_interval_s
        self._clock = clock
        self._rand = rand
        self._order: list[str] = list(self._specs)  # supervised ids, start order
        self._refs: dict[str, pykka.ActorRef[Any] | None] = dict.fromkeys(self._order)
        self._restarts: dict[str, int] = dict.fromkeys(self._order, 0)
        self._pending: dict[str, int] = {}  # child id -> token of its scheduled restart
        self._tokens = itertools.count(1)
        self._dropped: set[str] = set()
        self._dead_seen: dict[str, str] = {}  # child id -> urn found dead by the last sweep
        self._history = RestartHistory()
        self._timers: list[threading.Timer] = []
        self._escalated: str | None = None

    # ---------------------------------------------------------------- public (via proxy)

    def get_child(self, child_id: str) -> pykka.ActorRef[Any] | None:
        """The child's current ref (a new one after each restart); None while it is down."""
        self._known(child_id)
        return self._refs.get(child_id)

    def restarts(self, child_id: str) -> int:
        """How many times this supervisor has started the child again."""
        self._known(child_id)
        return self._restarts[child_id]

    def status(self) -> dict[str, Any]:
        """Strategy, escalation and, per child, state / restarts / current actor urn."""
        children = {}
        for cid in self._specs:
            ref = self._refs.get(cid)
            if cid in self._dropped:
                state = "dropped"
            elif cid in self._pending:
                state = "restarting"
            elif ref is not None and ref.is_alive():
                state = "running"
            else:
                state = "stopped"
            children[cid] = {
                "state": state,
                "restarts": self._restarts[cid],
                "urn": ref.actor_urn if ref is not None else None,
            }
        return {
            "strategy": self._strategy.value,
            "escalated": self._escalated,
            "children": children,
        }

    # ---------------------------------------------------------------- pykka hooks

    def on_start(self) -> None:
        for cid in list(self._order):
            try:
                self._start_child(cid)
            except Exception as exc:  # noqa: BLE001 - any start failure escalates
                self._escalate(f"child {cid!r} failed to start: {exc!r}")
                return
        self._schedule(self._sweep_interval_s, _Sweep())

    def on_receive(self, message: Any) -> Any:
        if self._escalated is not None:
            return None
        if isinstance(message, _ChildExited):
            return self._on_child_exited(message)
        if isinstance(message, _RestartDue):
            return self._on_restart_due(message)
        if isinstance(message, _Sweep):
            return self._on_sweep()
        return super().on_receive(message)

    def on_stop(self) -> None:
        self._shutdown()
        super().on_stop()

    def on_failure(
        self,
        exception_type: type[BaseException] | None,
        exception_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._shutdown()  # a crashed supervisor must not leave orphans running
        super().on_failure(exception_type, exception_value, traceback)

    # ---------------------------------------------------------------- message handlers

    def _on_child_exited(self, msg: _ChildExited) -> None:
        ref = self._refs.get(msg.child_id)
        if ref is None or ref.actor_urn != msg.urn:
            return  # an old incarnation, or a child we stopped ourselves
        self._refs[msg.child_id] = None
        log.info("child %s exited (%s): %s", msg.child_id, msg.exit.value, msg.reason)
        self._apply(msg.child_id, msg.exit)

    def _on_restart_due(self, msg: _RestartDue) -> None:
        for cid in msg.ids:
            if self._pending.get(cid) != msg.token:
                continue  # superseded by a later decision, or dropped/stopped meanwhile
            del self._pending[cid]
            self._restarts[cid] += 1
            try:
                self._start_child(cid)
            except Exception as exc:  # noqa: BLE001 - a failed start is a failed child
                log.warning("restart of %s failed: %r", cid, exc)
                self._apply(cid, Exit.ABNORMAL)
                if self._escalated is not None:
                    return

    def _on_sweep(self) -> None:
        for cid in list(self._order):
            ref = self._refs.get(cid)
            if ref is None or ref.is_alive():
                self._dead_seen.pop(cid, None)
                continue
            if self._dead_seen.get(cid) != ref.actor_urn:
                self._dead_seen[cid] = ref.actor_urn  # give its own report one sweep to arrive
                continue
            del self._dead_seen[cid]
            self._refs[cid] = None
            log.warning("child %s died without reporting (failed on_start?)", cid)
            self._apply(cid, Exit.ABNORMAL)
            if self._escalated is not None:
                return
        self._schedule(self._sweep_interval_s, _Sweep())

    # ---------------------------------------------------------------- applying decisions

    def _apply(self, child_id: str, exit: Exit) -> None:
        now = self._clock()
        decision = decide(
            self._order,
            child_id,
            exit,
            self._specs,
            self._strategy,
            self._history,
            self._intensity,
            now=now,
            attempt=recent_restarts(self._history, now, self._intensity.period_s),
            rand=self._rand(),
            backoff=self._backoff,
        )
        self._history = decision.history
        if decision.escalate:
            self._escalate(decision.reason)
            return
        for cid in decision.stop:
            self._stop_child(cid)
        for cid in decision.drop:
            self._stop_child(cid)
            self._order.remove(cid)
            self._dropped.add(cid)
        if decision.restart:
            token = next(self._tokens)
            for cid in decision.restart:
                self._pending[cid] = token
            self._schedule(decision.delay_s, _RestartDue(decision.restart, token))
            log.info("%s (in %.3fs)", decision.reason, decision.delay_s)

    def _escalate(self, reason: str) -> None:
        self._escalated = reason
        log.error("supervisor escalates: %s", reason)
        self._shutdown()
        if self._on_escalate is not None:
            try:
                self._on_escalate(reason)
            except Exception:
                log.exception("on_escalate callback failed")
        self.report_exit(Exit.ABNORMAL, f"escalated: {reason}")
        self.stop()

    def _start_child(self, child_id: str) -> None:
        spec = self._specs[child_id]
        actor_cls = load_start(spec.start)
        token = _current_link.set(_Link(self.actor_ref, child_id))
        try:
            self._refs[child_id] = actor_cls.start(*spec.args, **dict(spec.kwargs))
        finally:
            _current_link.reset(token)

    def _stop_child(self, child_id: str) -> None:
        """Stop a child on purpose; forgetting its ref first makes its exit report stale."""
        self._pending.pop(child_id, None)
        ref = self._refs.get(child_id)
        self._refs[child_id] = None
        if ref is None:
            return
        timeout = self._specs[child_id].shutdown_s
        try:
            ref.stop(block=True, timeout=timeout)
        except pykka.Timeout:
            # pykka cannot kill a thread: the child is abandoned and may finish on its own
            log.warning("child %s did not stop within %ss; abandoned", child_id, timeout)

    def _shutdown(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        for cid in reversed(self._order):
            self._stop_child(cid)

    def _schedule(self, delay_s: float | None, message: Any) -> None:
        """Send ourselves `message` after `delay_s` from a timer thread (None: never)."""
        if delay_s is None:
            return
        self._timers = [t for t in self._timers if t.is_alive()]
        timer = threading.Timer(delay_s, self._tell_self, (message,))
        timer.daemon = True
        self._timers.append(timer)
        timer.start()

    def _tell_self(self, message: Any) -> None:
        with contextlib.suppress(pykka.ActorDeadError):  # stopped meanwhile: nothing to do
            self.actor_ref.tell(message)

    def _known(self, child_id: str) -> None:
        if child_id not in self._specs:
            raise KeyError(f"unknown child {child_id!r}; children: {list(self._specs)}")
