"""LocalSupervisor with real pykka actors and threads; conditions waited on with deadlines."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pykka
import pytest

from runtime.supervision.local import LocalSupervisor, Supervised
from runtime.supervision.policy import Backoff, ChildSpec, Intensity, Restart, Strategy
from runtime.waiting import wait_until

pytestmark = pytest.mark.unit

FAST = Backoff(base_s=0.01, factor=2.0, cap_s=0.05, jitter=0.0)
WIDE = Intensity(10, 60.0)


class Events:
    """Thread-safe record of what the test actors did."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.items: list[tuple[str, str]] = []

    def add(self, kind: str, name: str) -> None:
        with self._lock:
            self.items.append((kind, name))

    def count(self, kind: str, name: str) -> int:
        with self._lock:
            return self.items.count((kind, name))


class Worker(Supervised, pykka.ThreadingActor):
    def __init__(self, name: str, events: Events) -> None:
        super().__init__()
        self.name = name
        self.events = events
        events.add("init", name)

    def on_receive(self, message: Any) -> Any:
        if message == "crash":
            raise RuntimeError(f"{self.name} crashed on a tell")
        if message == "quit":
            self.stop()
        return None

    def on_stop(self) -> None:
        self.events.add("stop", self.name)
        super().on_stop()

    def ping(self) -> str:
        return f"pong from {self.name}"

    def fail(self) -> None:
        raise ValueError("refused")


class FailsFirstStart(Supervised, pykka.ThreadingActor):
    def __init__(self, events: Events) -> None:
        super().__init__()
        self.events = events
        events.add("init", "flaky")

    def on_start(self) -> None:
        if self.events.count("init", "flaky") == 1:
            raise RuntimeError("first on_start fails")

    def ping(self) -> str:
        return "pong"


@pytest.fixture(autouse=True)
def _stop_all_actors() -> Iterator[None]:
    yield
    pykka.ActorRegistry.stop_all()


@pytest.fixture
def events() -> Events:
    return Events()


def _spec(cid: str, events: Events, restart: Restart = Restart.PERMANENT) -> ChildSpec:
    return ChildSpec(cid, Worker, args=(cid,), kwargs={"events": events}, restart=restart)


def _start(children: list[ChildSpec], **kwargs: Any) -> pykka.ActorProxy[LocalSupervisor]:
    kwargs.setdefault("intensity", WIDE)
    kwargs.setdefault("backoff", FAST)
    return LocalSupervisor.start(children, **kwargs).proxy()


def _urn(sup: pykka.ActorProxy[LocalSupervisor], cid: str) -> str | None:
    return sup.status().get()["children"][cid]["urn"]


def _restarted(sup: pykka.ActorProxy[LocalSupervisor], cid: str, old_urn: str) -> bool:
    child = sup.status().get()["children"][cid]
    return child["state"] == "running" and child["urn"] not in (None, old_urn)


def test_child_crashing_on_tell_is_restarted_with_a_working_ref(events: Events) -> None:
    sup = _start([_spec("a", events), _spec("b", events)])
    old_a = sup.get_child("a").get()
    b_urn = _urn(sup, "b")

    old_a.tell("crash")

    wait_until(lambda: _restarted(sup, "a", old_a.actor_urn))
    new_a = sup.get_child("a").get()
    assert new_a.proxy().ping().get(timeout=2) == "pong from a"
    assert not old_a.is_alive()
    assert sup.restarts("a").get() == 1
    assert events.count("init", "a") == 2
    assert sup.restarts("b").get() == 0
    assert _urn(sup, "b") == b_urn  # one_for_one leaves the sibling alone


def test_one_for_all_restarts_the_siblings_too(events: Events) -> None:
    sup = _start([_spec(c, events) for c in "abc"], strategy=Strategy.ONE_FOR_ALL)
    old = {c: sup.get_child(c).get() for c in "abc"}

    old["b"].tell("crash")

    for c in "abc":
        wait_until(lambda c=c: _restarted(sup, c, old[c].actor_urn))
        assert sup.restarts(c).get() == 1
        assert not old[c].is_alive()
        assert sup.get_child(c).get().proxy().ping().get(timeout=2) == f"pong from {c}"
    assert events.count("stop", "a") == 1  # siblings were stopped cleanly, not abandoned
    assert events.count("stop", "c") == 1


def test_transient_child_exiting_normally_is_dropped(events: Events) -> None:
    sup = _start([_spec("t", events, Restart.TRANSIENT), _spec("p", events)])
    sup.get_child("t").get().tell("quit")
    wait_until(lambda: sup.status().get()["children"]["t"]["state"] == "dropped")
    assert sup.get_child("t").get() is None
    assert sup.restarts("t").get() == 0
    assert events.count("init", "t") == 1


def test_permanent_child_exiting_normally_is_restarted(events: Events) -> None:
    sup = _start([_spec("p", events)])
    old = sup.get_child("p").get()
    old.tell("quit")
    wait_until(lambda: _restarted(sup, "p", old.actor_urn))
    assert sup.restarts("p").get() == 1


def test_transient_child_crashing_is_restarted(events: Events) -> None:
    sup = _start([_spec("t", events, Restart.TRANSIENT)])
    old = sup.get_child("t").get()
    old.tell("crash")
    wait_until(lambda: _restarted(sup, "t", old.actor_urn))
    assert sup.restarts("t").get() == 1


def test_temporary_child_is_never_restarted(events: Events) -> None:
    sup = _start([_spec("tmp", events, Restart.TEMPORARY), _spec("p", events)])
    sup.get_child("tmp").get().tell("crash")
    wait_until(lambda: sup.status().get()["children"]["tmp"]["state"] == "dropped")
    assert sup.get_child("tmp").get() is None
    assert events.count("init", "tmp") == 1
    assert sup.status().get()["children"]["p"]["state"] == "running"


def test_exceeding_intensity_escalates_and_stops_the_children(events: Events) -> None:
    escalated: list[str] = []
    done = threading.Event()

    def on_escalate(reason: str) -> None:
        escalated.append(reason)
        done.set()

    sup_ref = LocalSupervisor.start(
        [_spec("a", events), _spec("b", events)],
        intensity=Intensity(2, 60.0),
        backoff=FAST,
        on_escalate=on_escalate,
    )
    sup = sup_ref.proxy()
    sibling = sup.get_child("b").get()
    for n in (1, 2):
        old = sup.get_child("a").get()
        old.tell("crash")
        wait_until(lambda old=old: _restarted(sup, "a", old.actor_urn))
        assert sup.restarts("a").get() == n
    last = sup.get_child("a").get()
    last.tell("crash")  # the third restart within 60 s: more than 2

    assert done.wait(5.0)
    assert "more than 2 restarts in 60.0s" in escalated[0]
    assert not sibling.is_alive()
    assert not last.is_alive()
    assert events.count("stop", "b") == 1
    wait_until(lambda: not sup_ref.is_alive())
    assert events.count("init", "a") == 3  # not restarted a third time


def test_exception_in_an_ask_does_not_restart(events: Events) -> None:
    sup = _start([_spec("a", events)], sweep_interval_s=0.02)
    ref = sup.get_child("a").get()
    with pytest.raises(ValueError, match="refused"):
        ref.proxy().fail().get(timeout=2)
    assert ref.is_alive()
    assert ref.proxy().ping().get(timeout=2) == "pong from a"
    assert sup.get_child("a").get().actor_urn == ref.actor_urn
    assert sup.restarts("a").get() == 0
    assert events.count("init", "a") == 1


def test_restart_waits_for_backoff_without_blocking_the_supervisor(events: Events) -> None:
    sup = _start([_spec("a", events)], backoff=Backoff(base_s=0.5, factor=1.0, cap_s=0.5, jitter=0))
    old = sup.get_child("a").get()
    old.tell("crash")
    # during the backoff the supervisor still answers, and shows the child as restarting
    wait_until(lambda: sup.status().get(timeout=1)["children"]["a"]["state"] == "restarting")
    assert sup.get_child("a").get(timeout=1) is None
    wait_until(lambda: _restarted(sup, "a", old.actor_urn))


def test_failure_in_on_start_is_found_by_the_sweep(events: Events) -> None:
    sup = _start([ChildSpec("flaky", FailsFirstStart, args=(events,))], sweep_interval_s=0.02)
    wait_until(lambda: sup.restarts("flaky").get() == 1)
    wait_until(lambda: sup.status().get()["children"]["flaky"]["state"] == "running")
    assert sup.get_child("flaky").get().proxy().ping().get(timeout=2) == "pong"


def test_escalation_reaches_the_parent_supervisor_which_restarts_the_subtree(
    events: Events,
) -> None:
    inner = ChildSpec(
        "inner",
        LocalSupervisor,
        args=([_spec("w", events)],),
        kwargs={"intensity": Intensity(0, 60.0), "backoff": FAST},
    )
    parent = _start([inner])
    old_inner = parent.get_child("inner").get()
    worker = old_inner.proxy().get_child("w").get()

    worker.tell("crash")  # Intensity(0, ...): the inner supervisor gives up at once

    wait_until(lambda: _restarted(parent, "inner", old_inner.actor_urn))
    assert parent.restarts("inner").get() == 1
    assert not old_inner.is_alive()
    new_worker = parent.get_child("inner").get().proxy().get_child("w").get()
    assert new_worker.proxy().ping().get(timeout=2) == "pong from w"
    assert events.count("init", "w") == 2


def test_stop_stops_children_cleanly_in_reverse_order(events: Events) -> None:
    sup_ref = LocalSupervisor.start([_spec("a", events), _spec("b", events)], backoff=FAST)
    refs = [sup_ref.proxy().get_child(c).get() for c in "ab"]
    assert sup_ref.stop(timeout=5)
    assert not any(r.is_alive() for r in refs)
    stops = [item for item in events.items if item[0] == "stop"]
    assert stops == [("stop", "b"), ("stop", "a")]
    assert events.count("init", "a") == 1  # nothing was restarted on the way down


def test_unknown_child_id_is_an_error(events: Events) -> None:
    sup = _start([_spec("a", events)])
    with pytest.raises(KeyError, match="unknown child 'zz'"):
        sup.restarts("zz").get(timeout=2)
