"""RaySupervisor on a real local Ray instance, children checkpointing to real LevelDB."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray import cloudpickle
from ray.exceptions import ActorDiedError, RayActorError

from runtime.state.checkpoint import CheckpointStore
from runtime.supervision.policy import Backoff, ChildSpec, Exit, Intensity, Restart, Strategy
from runtime.supervision.ray_actors import (
    SupervisedActor,
    exit_from_death,
    start_supervisor,
    supervised_options,
)
from runtime.waiting import wait_until
from tests.support import fresh_ray

NS = f"test-ray-supervisor-{uuid.uuid4().hex[:8]}"
FAST = Backoff(base_s=0.05, factor=2.0, cap_s=0.5, jitter=0.0)
BEAT = {"heartbeat_interval_s": 0.2, "heartbeat_deadline_s": 5.0}  # generous: a loaded box

# the test actors live in this module, which Ray workers cannot import by name
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Counter(SupervisedActor):
    """Counts increments, each one a synced LevelDB write, restored in __init__."""

    def restore(self, store: CheckpointStore) -> None:
        self.ns = store.namespace("counter")
        raw = self.ns.get(b"count")
        self.count = int(raw) if raw is not None else 0

    def incr(self) -> int:
        self.count += 1
        self.ns.put(b"count", str(self.count).encode(), sync=True)
        return self.count

    def get(self) -> int:
        return self.count

    def crash(self) -> None:
        # exit after returning: with max_task_retries=-1 a call that kills its own process
        # would be retried on the restarted actor and kill it again
        threading.Timer(0.05, os._exit, (1,)).start()

    def hang(self) -> None:
        time.sleep(60)

    def quit(self) -> None:
        ray.actor.exit_actor()


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    with fresh_ray(NS):
        yield


@pytest.fixture
def supervisors(ray_local: None) -> Iterator[list[Any]]:
    """Supervisors a test started; stopped (children too) and killed afterwards."""
    started: list[Any] = []
    yield started
    for sup in started:
        with contextlib.suppress(RayActorError):
            ray.get(sup.stop.remote(), timeout=10)
        ray.kill(sup, no_restart=True)


def counter_spec(cid: str, state_dir: Path, restart: Restart = Restart.PERMANENT) -> ChildSpec:
    return ChildSpec(
        cid,
        Counter,
        kwargs={"state_dir": str(state_dir)},
        restart=restart,
        ray_options={"num_cpus": 0},
    )


def status(sup: Any) -> dict[str, Any]:
    return ray.get(sup.status.remote(), timeout=10)


def child(sup: Any, cid: str) -> dict[str, Any]:
    return status(sup)["children"][cid]


def running_handle(sup: Any, cid: str) -> tuple[Any, dict[str, Any]]:
    """Wait until the supervisor sees the child answering; its handle and heartbeat."""
    wait_until(swallow=True, pred=lambda: child(sup, cid)["state"] == "running")
    handle = ray.get_actor(cid, namespace=NS)
    return handle, ray.get(handle.heartbeat.remote(), timeout=10)


def restarted(sup: Any, cid: str, old_incarnation: str, restarts: int) -> bool:
    c = child(sup, cid)
    return c["restarts"] == restarts and c["incarnation"] not in (None, old_incarnation)


def start(
    supervisors: list[Any], name: str, children: list[ChildSpec], tmp: Path, **kw: Any
) -> Any:
    kw = {"intensity": Intensity(5, 30.0), "backoff": FAST, **BEAT, **kw}
    sup = start_supervisor(
        name, children, state_dir=tmp, namespace=NS, ray_options={"num_cpus": 0}, **kw
    )
    supervisors.append(sup)
    return sup


@pytest.mark.unit
def test_supervised_options_are_the_role_defaults_plus_extras() -> None:
    assert supervised_options("x", num_cpus=0.5) == {
        "name": "x",
        "namespace": "tierflow",
        "lifetime": "detached",
        "max_restarts": -1,
        "max_task_retries": -1,
        "get_if_exists": True,
        "num_cpus": 0.5,
    }
    assert supervised_options("x", "ns", max_restarts=0)["max_restarts"] == 0


@pytest.mark.unit
def test_exit_from_death_reads_rays_cause() -> None:
    assert exit_from_death(ActorDiedError()) is Exit.ABNORMAL


def test_crashed_child_comes_back_with_its_checkpointed_state(
    supervisors: list[Any], tmp_path: Path
) -> None:
    sup = start(supervisors, "sup-a", [counter_spec("counter-a", tmp_path)], tmp_path)
    counter, before = running_handle(sup, "counter-a")
    assert [ray.get(counter.incr.remote()) for _ in range(3)] == [1, 2, 3]

    ray.get(counter.crash.remote())

    wait_until(swallow=True, pred=lambda: restarted(sup, "counter-a", before["incarnation"], 1))
    after = ray.get(counter.heartbeat.remote(), timeout=10)
    assert after["pid"] != before["pid"]
    assert after["incarnation"] != before["incarnation"]
    assert ray.get(counter.get.remote()) == 3  # restored from LevelDB
    assert ray.get(counter.incr.remote()) == 4
    st = status(sup)
    assert len(st["history"]) == 1
    assert not st["escalated"]
    assert (tmp_path / "checkpoints" / "counter-a").is_dir()


def test_sigkilled_child_comes_back_with_its_checkpointed_state(
    supervisors: list[Any], tmp_path: Path
) -> None:
    sup = start(supervisors, "sup-b", [counter_spec("counter-b", tmp_path)], tmp_path)
    counter, before = running_handle(sup, "counter-b")
    for _ in range(5):
        ray.get(counter.incr.remote())

    os.kill(before["pid"], signal.SIGKILL)

    wait_until(swallow=True, pred=lambda: restarted(sup, "counter-b", before["incarnation"], 1))
    assert ray.get(counter.heartbeat.remote(), timeout=10)["pid"] != before["pid"]
    assert ray.get(counter.get.remote()) == 5
    assert child(sup, "counter-b")["restarts"] == 1


def test_exceeding_intensity_escalates_to_the_parent(
    supervisors: list[Any], tmp_path: Path
) -> None:
    inner = ChildSpec(
        "sup-c",
        "runtime.supervision.ray_actors:RaySupervisor",
        args=([counter_spec("counter-c", tmp_path)],),
        kwargs={
            "state_dir": str(tmp_path),
            "namespace": NS,
            "parent": "parent-c",
            "intensity": Intensity(2, 30.0),
            "backoff": FAST,
            **BEAT,
        },
        ray_options={"num_cpus": 0},
    )
    parent = start(supervisors, "parent-c", [inner], tmp_path)
    wait_until(swallow=True, pred=lambda: child(parent, "sup-c")["state"] == "running")
    sup = ray.get_actor("sup-c", namespace=NS)
    supervisors.insert(0, sup)
    counter, hb = running_handle(sup, "counter-c")

    for n in (1, 2):  # two restarts within 30 s are allowed
        os.kill(hb["pid"], signal.SIGKILL)
        wait_until(
            swallow=True, pred=lambda n=n, hb=hb: restarted(sup, "counter-c", hb["incarnation"], n)
        )
        hb = ray.get(counter.heartbeat.remote(), timeout=10)
    os.kill(hb["pid"], signal.SIGKILL)  # the third is one too many

    st = wait_until(swallow=True, pred=lambda: (s := status(sup))["escalated"] and s)
    assert "more than 2 restarts in 30.0s" in st["escalation_reason"]
    assert st["children"]["counter-c"]["state"] == "stopped"
    assert st["children"]["counter-c"]["restarts"] == 2
    with pytest.raises(RayActorError):
        ray.get(counter.get.remote(), timeout=10)  # stopped for good, not restarted by Ray
    escalations = wait_until(swallow=True, pred=lambda: status(parent)["escalations"])
    assert escalations[0]["child"] == "sup-c"
    assert "more than 2 restarts" in escalations[0]["reason"]
    assert child(parent, "sup-c")["state"] == "running"  # the escalated supervisor still reports


def test_one_for_all_restarts_the_sibling_too(supervisors: list[Any], tmp_path: Path) -> None:
    specs = [counter_spec("oa-1", tmp_path), counter_spec("oa-2", tmp_path)]
    sup = start(supervisors, "sup-d", specs, tmp_path, strategy=Strategy.ONE_FOR_ALL)
    one, hb1 = running_handle(sup, "oa-1")
    two, hb2 = running_handle(sup, "oa-2")
    ray.get(two.incr.remote())

    os.kill(hb1["pid"], signal.SIGKILL)

    wait_until(swallow=True, pred=lambda: restarted(sup, "oa-1", hb1["incarnation"], 1))
    wait_until(swallow=True, pred=lambda: restarted(sup, "oa-2", hb2["incarnation"], 1))
    assert ray.get(two.heartbeat.remote(), timeout=10)["pid"] != hb2["pid"]
    assert ray.get(two.get.remote()) == 1
    st = status(sup)
    assert len(st["history"]) == 1  # one failure, one decision: the sibling's restart is ours
    assert not st["escalated"]


def test_hung_child_is_killed_and_restarted(supervisors: list[Any], tmp_path: Path) -> None:
    # the default 5 s deadline: a shorter one lets a ping slowed by a loaded box count as a
    # hang of its own before the real one: two restarts (a suspect for a CI failure at 1.5 s)
    sup = start(supervisors, "sup-e", [counter_spec("counter-e", tmp_path)], tmp_path)
    counter, before = running_handle(sup, "counter-e")
    ray.get(counter.incr.remote())

    stuck = counter.hang.options(max_task_retries=0).remote()  # not retried after the kill

    wait_until(
        swallow=True,
        timeout=60.0,  # the deadline, then a Ray worker process started on a loaded box
        pred=lambda: restarted(sup, "counter-e", before["incarnation"], 1),
    )
    assert ray.get(counter.heartbeat.remote(), timeout=10)["pid"] != before["pid"]
    assert ray.get(counter.get.remote()) == 1
    with pytest.raises(RayActorError):
        ray.get(stuck, timeout=10)


def test_exit_actor_recreates_permanent_and_drops_transient(
    supervisors: list[Any], tmp_path: Path
) -> None:
    specs = [
        counter_spec("perm-f", tmp_path),
        counter_spec("tran-f", tmp_path, Restart.TRANSIENT),
    ]
    sup = start(supervisors, "sup-f", specs, tmp_path)
    perm, hb_perm = running_handle(sup, "perm-f")
    tran, _ = running_handle(sup, "tran-f")
    ray.get(perm.incr.remote())

    for handle in (perm, tran):
        with pytest.raises(RayActorError):
            ray.get(handle.quit.options(max_task_retries=0).remote(), timeout=10)

    # Ray does not restart an actor that exits on purpose: the supervisor creates a new one
    wait_until(swallow=True, pred=lambda: restarted(sup, "perm-f", hb_perm["incarnation"], 1))
    wait_until(swallow=True, pred=lambda: child(sup, "tran-f")["state"] == "dropped")
    new_perm = ray.get_actor("perm-f", namespace=NS)
    new_hb = ray.get(new_perm.heartbeat.remote(), timeout=10)
    assert new_hb["actor_id"] != hb_perm["actor_id"]
    assert ray.get(new_perm.get.remote()) == 1  # restored from LevelDB
    assert child(sup, "tran-f")["restarts"] == 0
    with pytest.raises(ValueError):
        ray.get_actor("tran-f", namespace=NS)


def test_restarted_supervisor_resumes_its_history_and_keeps_the_child(
    supervisors: list[Any], tmp_path: Path
) -> None:
    sup = start(supervisors, "sup-g", [counter_spec("counter-g", tmp_path)], tmp_path)
    counter, before = running_handle(sup, "counter-g")
    ray.get(counter.crash.remote())
    wait_until(swallow=True, pred=lambda: restarted(sup, "counter-g", before["incarnation"], 1))
    child_hb = ray.get(counter.heartbeat.remote(), timeout=10)
    sup_hb = ray.get(sup.heartbeat.remote(), timeout=10)

    os.kill(sup_hb["pid"], signal.SIGKILL)  # Ray restarts the supervisor itself

    st = wait_until(
        swallow=True, pred=lambda: (s := status(sup))["incarnation"] != sup_hb["incarnation"] and s
    )
    assert st["children"]["counter-g"]["restarts"] == 1  # checkpointed, not reset
    assert len(st["history"]) == 1
    wait_until(swallow=True, pred=lambda: child(sup, "counter-g")["state"] == "running")
    # it found the running child by name instead of starting a second one
    assert ray.get(counter.heartbeat.remote(), timeout=10)["incarnation"] == child_hb["incarnation"]
    assert child(sup, "counter-g")["restarts"] == 1
