"""The analysis driver's parts, each without Ray, Spark or NATS: the copy decision made once
for jobs, dead-letter scans and the archive (jobs/copy_tracker.py).

The actor with all of them, real Spark and nats-server is tests/test_analysis_driver.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from jobs.copies import Action, CopyError, CopyId, read_copy, record_copy
from jobs.copy_tracker import CopyTracker
from jobs.driver import _Query as Query
from jobs.specs import JobSpec, decode_spec
from runtime.nats import NatsEndpoint

pytestmark = pytest.mark.unit

STREAM = "orders"
A = CopyId(domain="site-a", stream=STREAM, created="2026-11-24T10:00:00.1Z")
B = CopyId(domain="site-b", stream=STREAM, created="2026-11-24T10:00:01.5Z")
NOWHERE = NatsEndpoint("nats://127.0.0.1:1")


def tracker(*copies: CopyId) -> CopyTracker:
    """A tracker that reads `copies[0]` as the stream's copy (no NATS)."""
    return CopyTracker(NOWHERE, copy_of=lambda stream: copies[0])


def query(tmp: Path, name: str, kind: str, stream: str = STREAM) -> Query:
    return Query(name, stream, kind, tmp / name)


def spec(name: str, kind: str = "count", stream: str = STREAM) -> JobSpec:
    fields = {"count": {"by": ["region"]}, "sample": {"field": "sku"}}[kind]
    return decode_spec({"name": name, "kind": kind, "stream": stream, **fields})


# --------------------------------------------------------------------------- the copy decision


def test_a_new_checkpoint_records_the_copy_it_reads_and_resumes_on_it_after(
    tmp_path: Path,
) -> None:
    for kind in ("count", "sample", "deadletter", "archive"):
        q = query(tmp_path, f"q-{kind}", kind)
        first = tracker(A).begin(q)
        assert (first.action, first.moved, q.copy) == (Action.RECORD, False, A), kind
        assert read_copy(q.checkpoint) == A, kind
        again = tracker(A).begin(q)
        assert (again.action, again.moved) == (Action.RESUME, False), kind


def test_positions_of_another_copy_are_never_resumed_whatever_the_kind(tmp_path: Path) -> None:
    expected = {
        "count": Action.RECOMPUTE,
        "sample": Action.FRESH,
        "deadletter": Action.FRESH,
        "archive": Action.REFUSE,
    }
    for kind, action in expected.items():
        q = query(tmp_path, f"q-{kind}", kind)
        record_copy(q.checkpoint, A)
        start = tracker(B).begin(q)
        assert (start.action, start.moved, start.recorded, start.here) == (action, True, A, B)
        assert q.copy == B  # the copy it reads now
        assert read_copy(q.checkpoint) == A, "nothing recorded before the owner acted"


def test_a_job_checkpoint_without_a_record_is_taken_to_be_of_its_views_copy(
    tmp_path: Path,
) -> None:
    q = query(tmp_path, "cnt", "count")
    assert tracker(B).begin(q, fallback=A).action is Action.RECOMPUTE
    assert read_copy(q.checkpoint) is None
    same = tracker(A).begin(q, fallback=A)
    assert same.action is Action.RESUME and read_copy(q.checkpoint) == A


def test_a_move_is_recorded_in_the_new_checkpoint_and_kept_for_status(tmp_path: Path) -> None:
    copies = tracker(B)
    q = query(tmp_path, "cnt", "count")
    record_copy(q.checkpoint, A)
    start = copies.begin(q)
    new = tmp_path / "cnt-g2"
    copies.moved(start, new, generation=2, high_water=41)
    assert read_copy(new) == B
    change = copies.changes["cnt"]
    assert (change["from"], change["to"], change["action"]) == (
        A.describe(),
        B.describe(),
        "recomputed",
    )
    assert (change["generation"], change["high_water"]) == (2, 41) and change["at_ms"] > 0


def test_running_queries_on_a_stream_made_again_are_found_stale(tmp_path: Path) -> None:
    now = {STREAM: B, "gone": None}

    def copy_of(stream: str) -> CopyId:
        if now[stream] is None:
            raise CopyError(f"stream {stream!r} does not exist")
        return now[stream]  # type: ignore[return-value]

    copies = CopyTracker(NOWHERE, copy_of=copy_of)
    running = SimpleNamespace(isActive=True)
    old = Query("top", STREAM, "topn", tmp_path / "top", query=running, copy=A)
    fresh = Query("cnt", STREAM, "count", tmp_path / "cnt", query=running, copy=B)
    stopped = Query("smp", STREAM, "sample", tmp_path / "smp", copy=A)  # not running
    unknown = Query("x", "gone", "count", tmp_path / "x", query=running, copy=A)
    assert copies.stale([old, fresh, stopped, unknown]) == ["top"]
    assert copies.due() and not copies.due()  # every COPY_CHECK_S
