"""The analysis driver's parts, each without Ray, Spark or NATS: the copy decision made once
for jobs, dead-letter scans and the archive (jobs/copy_tracker.py), how the dead-letter
scan and the archive act on it (jobs/query_starts.py), which queries run and how a dead one
is restarted (jobs/queries.py), the wanted set kept in the checkpoint store
(jobs/wanted.py) and the status rows (jobs/driver_status.py).

The actor with all of them, real Spark and nats-server is tests/test_analysis_driver.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from jobs.archive import archive_query_name
from jobs.copies import Action, CopyError, CopyId, read_copy, record_copy
from jobs.copy_tracker import CopyTracker
from jobs.deadletter_book import DeadLetterBook
from jobs.driver_status import behind, query_rows
from jobs.queries import Query, QuerySet, keep_running
from jobs.sink import BatchReport
from jobs.wanted import WantedJobs
from runtime.config import load
from runtime.job_specs import JobSpec, deadletter_query_name, decode_spec
from runtime.nats.server import NatsEndpoint
from runtime.state.checkpoint import CheckpointStore

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


# --------------------------------------------------------------------------- acting on it


def _cfg(tmp: Path) -> Any:
    return load(
        environ={},
        overrides={
            "state_dir": str(tmp / "state"),
            "streams": {STREAM: {"subjects": ["shop.>"], "archive": {"path": str(tmp / "arch")}}},
        },
    )


def test_an_archive_of_another_copy_refuses_to_start_and_says_what_to_do(
    tmp_path: Path,
) -> None:
    from jobs.query_starts import QueryStarts

    starts = QueryStarts(
        _cfg(tmp_path),
        NOWHERE,
        tmp_path,
        lambda: object(),
        tracker(B),
        None,
        None,  # type: ignore[arg-type]
    )
    q = query(tmp_path, archive_query_name(STREAM), "archive")
    record_copy(q.checkpoint, A)
    with pytest.raises(CopyError, match="sequences of copy") as err:
        starts.archive(q)
    assert f"{tmp_path / 'arch'}/site=site-a/stream={STREAM}" in str(err.value)
    assert read_copy(q.checkpoint) == A  # its positions are left as they are


def test_a_deadletter_scan_on_another_copy_starts_over_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jobs import query_starts

    started: list[int] = []

    class Scan:
        def __init__(self, nats: Any, stream: str, start: int, on_pass: Any) -> None:
            started.append(start)

        def start(self) -> Scan:
            return self

    monkeypatch.setattr(query_starts, "DeadLetterScan", Scan)
    with CheckpointStore(tmp_path / "store") as store:
        book = DeadLetterBook(store.namespace("deadletters"))
        copies = tracker(A)
        starts = query_starts.QueryStarts(
            _cfg(tmp_path),
            NOWHERE,
            tmp_path,
            lambda: None,
            copies,
            None,
            lambda: book,  # type: ignore[arg-type]
        )
        q = query(tmp_path, deadletter_query_name(STREAM), "deadletter")
        starts.deadletters(q)
        book.count(STREAM, 120, BatchReport(published=3, duplicates=0))
        starts.deadletters(q)  # same copy: resumes
        assert started == [0, 120] and book.totals() == {STREAM: 3}
        copies.copy_of = lambda stream: B
        starts.deadletters(q)  # another copy: from its first sequence, counted afresh
        assert started == [0, 120, 0] and book.totals() == {}
        assert read_copy(q.checkpoint) == B
        assert copies.changes[q.name]["action"] == "started over"


# --------------------------------------------------------------------------- which queries run


class FakeQuery:
    def __init__(self) -> None:
        self.isActive, self.error, self.stopped = True, None, False

    def exception(self) -> Any:
        return self.error

    def stop(self) -> None:
        self.stopped, self.isActive = True, False


class FakeStarts:
    def __init__(self) -> None:
        self.started: list[str] = []

    def _go(self, q: Query) -> FakeQuery:
        self.started.append(q.name)
        return FakeQuery()

    def job(self, q: Query, spec: JobSpec, trigger_s: float) -> FakeQuery:
        return self._go(q)

    def deadletters(self, q: Query) -> FakeQuery:
        return self._go(q)

    def archive(self, q: Query) -> FakeQuery:
        return self._go(q)


def test_each_wanted_job_runs_with_a_scan_per_stream_and_an_archive_per_archived_stream(
    tmp_path: Path,
) -> None:
    starts = FakeStarts()
    queries = QuerySet(starts, tmp_path, lambda name: tmp_path / f"{name}-g", ["clicks"])
    wanted = {s.name: s for s in (spec("a"), spec("b"), spec("c", stream="pay"))}
    failing = queries.reconcile(wanted, set())
    dl_orders, dl_pay = deadletter_query_name(STREAM), deadletter_query_name("pay")
    archive = archive_query_name("clicks")
    assert sorted(starts.started) == sorted(["a", "b", "c", dl_orders, dl_pay, archive])
    assert queries.queries["a"].checkpoint == tmp_path / "a-g"
    assert queries.queries[dl_pay].checkpoint == tmp_path / dl_pay
    assert set(failing.values()) == {0}
    queries.reconcile(wanted, set())
    assert len(starts.started) == 6  # running: not started again
    b, c = queries.queries["b"].query, queries.queries["c"].query
    failing = queries.reconcile({"a": wanted["a"], "c": wanted["c"]}, {"c"})  # c recomputing
    assert b.stopped and c.stopped  # b no longer wanted, c paused: its stream's scan stays
    kept = {"a", dl_orders, dl_pay, archive}
    assert set(queries.queries) == set(failing) == kept


def test_a_sql_job_gets_a_scan_per_stream_it_reads_but_none_for_its_kv_table(
    tmp_path: Path,
) -> None:
    starts = FakeStarts()
    queries = QuerySet(starts, tmp_path, lambda name: tmp_path / name, [], kv_tables=["prices"])
    job = decode_spec(
        {
            "name": "priced",
            "kind": "sql",
            "sql": "SELECT o.id, p.price FROM orders o JOIN prices p ON p.key = o.item",
        }
    )
    queries.reconcile({"priced": job}, set())
    assert sorted(starts.started) == sorted(["priced", deadletter_query_name("orders")])
    assert queries.queries["priced"].stream == "orders"


def test_a_query_that_died_is_restarted_after_its_backoff_and_a_failed_start_counts(
    tmp_path: Path,
) -> None:
    q = Query("top", STREAM, "topn", tmp_path / "top")
    q.query = dead = FakeQuery()
    dead.isActive, dead.error = False, RuntimeError("boom")
    keep_running(q, FakeQuery)
    assert (q.failures, q.error, q.query) == (1, "boom", None)  # backing off (1 s)
    q.next_try = 0.0  # its backoff is over
    keep_running(q, FakeQuery)
    assert q.query is not None and q.restarts == 1

    def refused() -> Any:
        raise RuntimeError("no stream")

    q.query, q.next_try = None, 0.0
    keep_running(q, refused)
    assert q.failures == 2 and q.error == "could not start: no stream" and q.next_try > 0


# --------------------------------------------------------------------------- the wanted set


def test_started_and_stopped_jobs_are_wanted_the_same_after_a_restart(tmp_path: Path) -> None:
    configured = {"a": spec("a"), "b": spec("b")}
    with CheckpointStore(tmp_path / "store") as store:
        wanted = WantedJobs(configured)
        wanted.restore(store)
        assert set(wanted.snapshot()[0]) == {"a", "b"}
        assert wanted.want(spec("c", "sample")) is None
        assert wanted.unwant("a") and not wanted.unwant("nope")
        changed = decode_spec({"name": "c", "kind": "count", "stream": STREAM, "by": ["x"]})
        assert wanted.want(changed) == spec("c", "sample")  # refused: another spec
    with CheckpointStore(tmp_path / "store") as store:
        again = WantedJobs(configured)
        again.restore(store)
        assert set(again.snapshot()[0]) == {"b", "c"}
        assert again.jobs["c"] == spec("c", "sample")


# --------------------------------------------------------------------------- status


def test_status_rows_say_what_each_query_is_doing_and_how_far_it_is(tmp_path: Path) -> None:
    with CheckpointStore(tmp_path / "store") as store:
        book = DeadLetterBook(store.namespace("deadletters"))
        book.count(STREAM, 77, BatchReport(published=2, duplicates=1))
        running = FakeQuery()
        failed = Query("cnt", STREAM, "count", tmp_path / "cnt", error="could not start: x")
        dl = Query(
            deadletter_query_name(STREAM), STREAM, "deadletter", tmp_path / "dl", query=running
        )
        top = Query("top", STREAM, "topn", tmp_path / "top", query=running, copy=A)
        view = SimpleNamespace(high_water=41, generation=3)
        queries = {q.name: q for q in (failed, dl, top)}
        rows = query_rows(
            queries,
            views={"top": view},
            changes={"top": {"action": "recomputed"}},
            late=None,
            deadletters=book,
        )
        assert rows["cnt"]["state"] == "failed" and rows["cnt"]["error"].endswith("x")
        assert rows[dl.name]["committed_seq"] == 77
        assert rows["top"]["state"] == "running" and "committed_seq" not in rows["top"]
        assert (rows["top"]["view_high_water"], rows["top"]["generation"]) == (41, 3)
        assert rows["top"]["copy"] == A.describe()
        assert rows["top"]["copy_change"] == {"action": "recomputed"}
        late = behind({"cnt", "new"}, queries, {STREAM: 78}, book)
        assert late == {
            "new": "not started",
            "cnt": "not running",
            dl.name: 77,
            "top": 1,
        }
