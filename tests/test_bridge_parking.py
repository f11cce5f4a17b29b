"""Parked log entries (an event whose absence from the stream cannot be proven, a poison
event's full body): never due, counted by `tierflow logger inspect`, listed and settled by
`tierflow logger settle` on the stopped stores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.queue.logger import PARKED_MS, LogStore
from runtime.data.events import Event

TIERFLOW = str(Path(sys.executable).with_name("tierflow"))
BIG = 1 << 40


def ev(i: int) -> Event:
    return Event(f"e{i:04d}", "s", "raw.s", b'{"n": %d}' % i, 1_000)


def park(store: LogStore, *events: Event) -> None:
    store.append(list(events))
    store.fail([(e, "parked: test") for e in events], 5_000, lambda n: PARKED_MS)


@pytest.mark.unit
def test_parked_entry_is_never_due_until_settled(tmp_path: Path) -> None:
    store = LogStore(tmp_path / "log", max_events=1000, max_bytes=BIG)
    try:
        park(store, ev(1), ev(2))
        store.append([ev(3)])
        store.fail([(ev(3), "timeout")], 5_000, lambda n: 100)
        assert [e.id for e in store.due_failed(PARKED_MS - 1, 100)] == ["e0003"]
        assert [p["id"] for p in store.parked(100)] == ["e0001", "e0002"]
        assert store.parked_count() == 2
        assert store.settle([("s", "e0001"), ("s", "e0003")], "retry", 9_000) == 1  # e3: not parked
        assert {e.id for e in store.due_failed(9_000, 100)} == {"e0001", "e0003"}
        assert store.settle([("s", "e0002")], "forget", 9_000) == 1
        assert store.where(("s", "e0002")) is None and store.parked_count() == 0
        scanned = store.scan_counts()
        assert scanned["failed"] == store.counts()["failed"] == 2 == scanned["by_retry"]
    finally:
        store.close()


def test_cli_inspect_counts_parked_and_settle_forgets_them(tmp_path: Path) -> None:
    state = tmp_path / "state"
    for i in range(2):  # a group of two replicas, stopped
        store = LogStore(state / "logger" / f"grp-{i}", max_events=1000, max_bytes=BIG)
        park(store, ev(1))
        store.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERFLOW_")}
    env["TIERFLOW_STATE_DIR"] = str(state)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [TIERFLOW, "logger", *args], env=env, capture_output=True, text=True, timeout=120
        )

    out = run("inspect", "--json")
    assert out.returncode == 0, out.stderr
    assert [r["parked"] for r in json.loads(out.stdout)] == [1, 1]
    table = run("inspect")
    assert "tierflow logger settle" in table.stdout, table.stdout
    listed = run("settle", "grp", "--list")
    assert listed.returncode == 0, listed.stderr
    assert {(r["replica"], r["id"]) for r in json.loads(listed.stdout)} == {
        ("grp-0", "e0001"),
        ("grp-1", "e0001"),
    }
    settled = run("settle", "grp", "s/e0001", "--forget")
    assert settled.returncode == 0, settled.stderr
    assert json.loads(settled.stdout) == {"grp-0": 1, "grp-1": 1}
    out = run("inspect", "--json")
    assert [(r["parked"], r["failed"]) for r in json.loads(out.stdout)] == [(0, 0), (0, 0)]
