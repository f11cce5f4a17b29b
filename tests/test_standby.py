"""jobs/standby.py: who of a warm pair of analysis drivers runs the queries (the checkpoint
store's LevelDB lock, then the peer's word), and the fence on the previous driver's JVM.

The takeover itself, with two real drivers, Spark and a SIGKILL, is in
tests/test_analysis_driver.py (`test_results_survive_sigkills_of_the_driver`)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from jobs.standby import (
    end_old_jvm,
    jvm_file,
    record_jvm,
    should_yield,
    standby_name,
    takeover,
)
from runtime.state.checkpoint import CheckpointStore
from runtime.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


def a_standby_pair(name: str, peer: str, error: Any) -> Any:
    """A standby's `WarmPair` (jobs/warm_pair.py) with nothing behind it: no NATS, no store,
    no JVM; its peer's handle is the test's to give."""
    from jobs.warm_pair import WarmPair
    from runtime.nats.server import NatsEndpoint

    return WarmPair(
        name=name,
        peer=peer,
        namespace="tierflow",
        nats=NatsEndpoint("nats://127.0.0.1:1"),
        incarnation="test",
        store_path=Path("/nonexistent"),
        closing=threading.Event(),
        adopt=lambda store: None,
        jvm_pid=lambda: None,
        error=error,
    )


class Taking(threading.Thread):
    """`takeover` on its own thread, as the driver's reconcile thread runs it."""

    def __init__(self, store: Path, peer_active: list[bool]) -> None:
        super().__init__(daemon=True)
        self.path, self.peer_active = store, peer_active
        self.closing = threading.Event()
        self.got: CheckpointStore | None = None

    def run(self) -> None:
        self.got = takeover(self.path, self.closing, lambda: self.peer_active[0], poll_s=0.01)


@pytest.mark.unit
def test_a_standby_takes_the_store_only_once_its_holder_lets_go(tmp_path: Path) -> None:
    path = tmp_path / "checkpoints" / "driver"
    holder = CheckpointStore(path)
    holder.namespace("jobs").put(b"k", b"from the active driver")
    standby = Taking(path, [False])
    standby.start()
    standby.join(0.3)
    assert standby.is_alive() and standby.got is None  # locked: it waits
    holder.close()  # the active driver's process died (the kernel drops its lock)
    standby.join(10)
    assert not standby.is_alive() and standby.got is not None
    assert standby.got.namespace("jobs").get(b"k") == b"from the active driver"
    standby.got.close()


@pytest.mark.unit
def test_a_free_store_is_not_taken_while_the_peer_says_it_is_active(tmp_path: Path) -> None:
    """Across nodes the lock cannot see the peer: its own word keeps this one standing by."""
    path = tmp_path / "driver"
    peer_active = [True]
    standby = Taking(path, peer_active)
    standby.start()
    standby.join(0.3)
    assert standby.is_alive() and standby.got is None  # free, but the peer is active
    peer_active[0] = False
    standby.join(10)
    assert standby.got is not None
    standby.got.close()


@pytest.mark.unit
def test_a_waiting_standby_stops_at_once_when_shut_down(tmp_path: Path) -> None:
    path = tmp_path / "driver"
    holder = CheckpointStore(path)
    standby = Taking(path, [False])
    standby.start()
    standby.closing.set()
    standby.join(10)
    assert not standby.is_alive() and standby.got is None
    holder.close()


@pytest.mark.unit
def test_the_standby_has_its_own_actor_name() -> None:
    assert standby_name("tierflow-analysis") == "tierflow-analysis-standby"


def test_the_previous_drivers_jvm_is_ended_and_only_that_process(tmp_path: Path) -> None:
    store = tmp_path / "driver"
    assert end_old_jvm(store) == "none"  # nothing recorded: a first start
    old = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record_jvm(store, old.pid)
        assert end_old_jvm(store) == "killed"
        wait_until(lambda: old.poll() is not None, 10, 0.01, what="the old JVM gone")
        assert old.returncode == -9
        assert end_old_jvm(store) == "none"  # gone already: nothing to do
        # a record whose pid now belongs to another process (its start time differs)
        record_jvm(store, other.pid)
        text = jvm_file(store).read_text().replace('"create_time": ', '"create_time": 1')
        jvm_file(store).write_text(text)
        assert end_old_jvm(store) == "none"
        assert other.poll() is None, "a process that is not the recorded JVM was killed"
    finally:
        for p in (old, other):
            p.kill()
            p.wait(10)


@pytest.mark.unit
def test_a_standby_starts_its_spark_when_the_peer_is_not_starting_its_queries() -> None:
    active = {"role": "active", "caught_up": True}
    # after a takeover: the restarted driver waits for the new active one's first batches
    assert should_yield({"role": "active", "caught_up": False}, restarted=True)
    assert not should_yield(active, restarted=True)
    # the pair's first start: both start at once, whatever the other says
    for peer in (None, {"role": "standby", "state": "starting", "phases": {}}):
        assert not should_yield(peer, restarted=False)
    assert not should_yield(
        {"role": "standby", "state": "starting", "phases": {"yielded_s": 0.0}}, restarted=False
    )
    # a restarted driver: the standby that outlived it starts its Spark, warms up or takes
    # over; the restarted one starts its own JVM once that takeover has caught up
    for state in ("starting", "warming up", "standby"):
        past_wait = {"role": "standby", "state": state, "phases": {"yielded_s": 3.0}}
        assert should_yield(past_wait, restarted=True)
    # a standby still waiting (both restarted) may wait for this one: not waited for
    assert not should_yield({"role": "standby", "state": "starting", "phases": {}}, restarted=True)
    assert not should_yield(None, restarted=True)  # the peer is down: this one may be needed


@pytest.mark.unit
@pytest.mark.parametrize("state", ["RESTARTING", "DEAD", "ALIVE"])
def test_a_standby_hands_a_call_on_only_to_a_peer_that_is_up(
    state: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call handed to a peer Ray is restarting waits, unanswered, for the restart (seconds
    after a SIGKILL): the standby answers at once that no driver is active yet instead,
    and a call to a peer that dies under it is not retried on the restarted peer."""
    from types import SimpleNamespace

    from jobs import warm_pair
    from jobs.driver import AnalysisDriver, AnalysisDriverError

    sent: list[str] = []
    options: list[dict[str, object]] = []
    call = SimpleNamespace(remote=lambda method, a, kw: sent.append(method) or "ref")
    peer = SimpleNamespace(
        _actor_id=SimpleNamespace(hex=lambda: "ab12"),
        from_standby=SimpleNamespace(options=lambda **o: options.append(o) or call),
    )
    standby = AnalysisDriver.__new__(AnalysisDriver)
    standby.name = "tierflow-analysis-standby"
    standby._pair = a_standby_pair(standby.name, "tierflow-analysis", AnalysisDriverError)
    monkeypatch.setattr(standby._pair, "peer_handle", lambda: peer)
    monkeypatch.setattr(warm_pair, "actor_state", lambda handle: state)
    monkeypatch.setattr(warm_pair.ray, "get", lambda ref, timeout: {"answered": ref})
    if state == "ALIVE":
        assert standby._forward("local_status", (), {}) == {"answered": "ref"}
        assert sent == ["local_status"]
        assert options == [{"max_task_retries": 0}]  # a peer dying under it: no wait
    else:
        with pytest.raises(
            AnalysisDriverError, match=f"is {state.lower()}: no driver is active yet"
        ):
            standby._forward("local_status", (), {})
        assert sent == []
