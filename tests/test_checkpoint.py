"""CheckpointStore / SnapshotLog against real LevelDB directories."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.state.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointLockedError,
    CheckpointStore,
    SnapshotLog,
)

REPO = pathlib.Path(__file__).resolve().parents[1]


def wait_for(cond, timeout: float = 20.0, interval: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def run_child(code: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def store(tmp_path: pathlib.Path):
    s = CheckpointStore(tmp_path / "db")
    yield s
    s.close()


# --- namespaces -------------------------------------------------------------------------------


@pytest.mark.unit
def test_put_get_delete(store: CheckpointStore) -> None:
    ns = store.namespace("state")
    assert ns.get(b"k") is None
    assert ns.get(b"k", b"dflt") == b"dflt"
    ns.put(b"k", b"v1")
    assert ns.get(b"k") == b"v1"
    ns.put(b"k", b"v2", sync=False)
    assert ns.get(b"k") == b"v2"
    ns.delete(b"k")
    assert ns.get(b"k") is None
    ns.delete(b"never-there")  # deleting a missing key is not an error


@pytest.mark.unit
def test_namespaces_isolated_including_prefix_names(store: CheckpointStore) -> None:
    a, ab, b = store.namespace("a"), store.namespace("ab"), store.namespace("b")
    a.put(b"x", b"from-a")
    a.put(b"bx", b"a-bx")  # raw key b"a\0bx" must not show up under "ab"
    ab.put(b"x", b"from-ab")
    assert a.get(b"x") == b"from-a"
    assert ab.get(b"x") == b"from-ab"
    assert b.get(b"x") is None
    assert list(a.scan()) == [(b"bx", b"a-bx"), (b"x", b"from-a")]
    assert list(ab.scan()) == [(b"x", b"from-ab")]
    assert ab.count() == 1 and b.count() == 0
    a.delete_range()
    assert a.count() == 0
    assert ab.get(b"x") == b"from-ab"


@pytest.mark.unit
def test_bad_namespace_names(store: CheckpointStore) -> None:
    for bad in ("", "a\x00b"):
        with pytest.raises(ValueError):
            store.namespace(bad)


@pytest.mark.unit
def test_scan_filters(store: CheckpointStore) -> None:
    ns = store.namespace("s")
    keys = [b"a1", b"a2", b"a3", b"b1", b"b2", b"c\xff", b"c\xff\x01", b"d"]
    ns.put_many((k, k.upper()) for k in keys)
    assert [k for k, _ in ns.scan()] == keys
    assert dict(ns.scan())[b"a2"] == b"A2"
    assert list(ns.keys(b"a2", b"b2")) == [b"a2", b"a3", b"b1"]  # stop exclusive
    assert list(ns.keys(start=b"b")) == [b"b1", b"b2", b"c\xff", b"c\xff\x01", b"d"]
    assert list(ns.keys(stop=b"a3")) == [b"a1", b"a2"]
    assert list(ns.keys(prefix=b"a")) == [b"a1", b"a2", b"a3"]
    assert list(ns.keys(prefix=b"c\xff")) == [b"c\xff", b"c\xff\x01"]
    assert list(ns.keys(prefix=b"a", start=b"a2")) == [b"a2", b"a3"]
    assert list(ns.keys(prefix=b"a", stop=b"a3")) == [b"a1", b"a2"]
    assert list(ns.keys(prefix=b"a", start=b"b")) == []
    assert list(ns.keys(reverse=True, limit=3)) == [b"d", b"c\xff\x01", b"c\xff"]
    assert list(ns.keys(prefix=b"b", reverse=True)) == [b"b2", b"b1"]
    assert list(ns.keys(b"a2", b"b2", reverse=True)) == [b"b1", b"a3", b"a2"]
    assert list(ns.scan(prefix=b"a", limit=2)) == [(b"a1", b"A1"), (b"a2", b"A2")]
    assert list(ns.keys(limit=0)) == []
    assert ns.count() == len(keys)
    assert ns.count(prefix=b"a") == 3
    assert ns.count(b"a3", b"c") == 3
    assert list(ns.keys(prefix=b"zz")) == []


@pytest.mark.unit
def test_delete_range_and_many(store: CheckpointStore) -> None:
    ns, other = store.namespace("n"), store.namespace("n2")
    assert ns.put_many([(b"%03d" % i, b"v") for i in range(50)]) == 50
    other.put(b"010", b"keep")
    assert ns.delete_range(b"010", b"020") == 10
    assert ns.count() == 40
    assert ns.get(b"009") == b"v" and ns.get(b"010") is None and ns.get(b"020") == b"v"
    assert ns.delete_range(prefix=b"04") == 10
    assert ns.delete_range(b"010", b"020") == 0
    # delete_many counts the deletes it issued: LevelDB cannot tell whether a key existed
    assert ns.delete_many([b"000", b"001", b"missing"]) == 3
    assert ns.count() == 28
    assert other.get(b"010") == b"keep"


@pytest.mark.unit
def test_write_batch_atomic_across_namespaces(store: CheckpointStore) -> None:
    a, b = store.namespace("a"), store.namespace("b")
    a.put(b"old", b"1")
    with store.write_batch() as batch:
        batch.put(a, b"k", b"va")
        batch.put("b", b"k", b"vb")
        batch.delete(a, b"old")
        assert a.get(b"k") is None  # nothing visible before commit
    assert a.get(b"k") == b"va" and b.get(b"k") == b"vb" and a.get(b"old") is None

    with pytest.raises(RuntimeError, match="boom"), store.write_batch(sync=True) as batch:
        batch.put(a, b"k2", b"x")
        batch.put(b, b"k2", b"x")
        batch.delete(a, b"k")
        raise RuntimeError("boom")
    assert a.get(b"k2") is None and b.get(b"k2") is None
    assert a.get(b"k") == b"va"


@pytest.mark.unit
def test_batch_rejects_namespace_of_other_store(tmp_path: pathlib.Path) -> None:
    with CheckpointStore(tmp_path / "x") as s1, CheckpointStore(tmp_path / "y") as s2:
        ns2 = s2.namespace("n")
        with pytest.raises(ValueError), s1.write_batch() as batch:
            batch.put(ns2, b"k", b"v")
        assert ns2.get(b"k") is None


# --- lifecycle --------------------------------------------------------------------------------


@pytest.mark.unit
def test_survives_close_and_reopen(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "nested" / "db"
    with CheckpointStore(path, sync=False) as s:
        assert s.sync is False and s.path == path
        s.namespace("a").put(b"k", b"v")
        with s.write_batch() as b:
            b.put("b", b"k2", b"v2")
    assert s.closed
    with CheckpointStore(path, create=False) as s:
        assert s.namespace("a").get(b"k") == b"v"
        assert s.namespace("b").get(b"k2") == b"v2"


@pytest.mark.unit
def test_create_false_missing_path(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError, match=str(missing)):
        CheckpointStore(missing, create=False)
    assert not missing.exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty"):
        CheckpointStore(tmp_path / "empty", create=False)


@pytest.mark.unit
def test_use_after_close_raises(tmp_path: pathlib.Path) -> None:
    s = CheckpointStore(tmp_path / "db")
    ns = s.namespace("n")
    ns.put_many([(b"a", b"1"), (b"b", b"2"), (b"c", b"3")])
    it = ns.scan()
    assert next(it) == (b"a", b"1")
    log = SnapshotLog(s, "log")
    s.close()
    s.close()  # idempotent
    assert s.closed
    for op in (
        lambda: ns.get(b"a"),
        lambda: ns.get_many([b"a"]),
        lambda: ns.put(b"a", b"x"),
        lambda: ns.delete(b"a"),
        lambda: list(ns.scan()),
        lambda: ns.count(),
        lambda: ns.delete_range(),
        lambda: ns.put_many([(b"z", b"z")]),
        lambda: next(it),
        lambda: s.namespace("other"),
        lambda: log.append(b"e"),
        lambda: log.restore(),
    ):
        with pytest.raises(CheckpointError):
            op()
    with pytest.raises(CheckpointError), s.write_batch() as b:
        b.put(ns, b"a", b"x")


@pytest.mark.unit
def test_get_many_and_batch_apply_keep_namespaces_apart(store: CheckpointStore) -> None:
    a, ab = store.namespace("a"), store.namespace("a.b")
    with store.write_batch() as b:
        b.apply([(a.key(b"k"), b"1"), (ab.key(b"k"), b"2"), (a.key(b"gone"), b"x")])
        b.apply([(a.key(b"gone"), None)])  # in order: put, then delete
    assert a.get_many([b"k", b"gone", b"nope", b"k"]) == [b"1", None, None, b"1"]
    assert ab.get_many([b"k"]) == [b"2"]
    assert a.get_many([]) == []
    assert list(a.scan()) == [(b"k", b"1")]


@pytest.mark.unit
def test_batch_commit_after_close_raises(tmp_path: pathlib.Path) -> None:
    s = CheckpointStore(tmp_path / "db")
    with pytest.raises(CheckpointError, match="closed"), s.write_batch() as b:
        b.put("n", b"a", b"x")
        s.close()
    with CheckpointStore(tmp_path / "db") as s2:
        assert s2.namespace("n").get(b"a") is None


@pytest.mark.unit
def test_second_open_same_process_is_locked(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "db"
    with CheckpointStore(path):
        with pytest.raises(CheckpointLockedError) as ei:
            CheckpointStore(path)
        msg = str(ei.value)
        assert str(path) in msg
        assert "own directory" in msg
    CheckpointStore(path).close()  # released on close


def test_open_locked_by_other_process(tmp_path: pathlib.Path) -> None:
    path, ready = tmp_path / "db", tmp_path / "ready"
    code = f"""
        import pathlib, sys
        from runtime.state.checkpoint import CheckpointStore
        s = CheckpointStore({str(path)!r})
        pathlib.Path({str(ready)!r}).write_text("ok")
        sys.stdin.read()  # hold the store until the parent closes our stdin
        s.close()
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None)
        assert ready.exists(), proc.stderr.read() if proc.stderr else ""
        with pytest.raises(CheckpointLockedError, match=str(path)):
            CheckpointStore(path)
    finally:
        proc.communicate(input="", timeout=30)
    assert proc.returncode == 0
    CheckpointStore(path).close()


def test_child_crash_without_close_keeps_synced_batch(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "db"
    code = f"""
        import os
        from runtime.state.checkpoint import CheckpointStore, SnapshotLog
        s = CheckpointStore({str(path)!r})
        with s.write_batch(sync=True) as b:
            for i in range(1000):
                b.put("events", b"%06d" % i, b"payload-%d" % i)
            b.put("meta", b"count", b"1000")
        SnapshotLog(s, "log").append_many([b"e1", b"e2"])
        os._exit(0)  # no close(): LOCK and memtable are left as a crash leaves them
    """
    res = run_child(code)
    assert res.returncode == 0, res.stderr
    with CheckpointStore(path, create=False) as s:
        events = s.namespace("events")
        assert events.count() == 1000
        assert events.get(b"000999") == b"payload-999"
        assert s.namespace("meta").get(b"count") == b"1000"
        log = SnapshotLog(s, "log")
        assert log.last_seq == 2
        assert log.restore() == (None, [(1, b"e1"), (2, b"e2")])


# --- corruption -------------------------------------------------------------------------------


def _filled(path: pathlib.Path, n: int = 200) -> None:
    with CheckpointStore(path) as s:
        ns = s.namespace("n")
        for i in range(n):
            ns.put(b"%04d" % i, b"v" * 100)


@pytest.mark.unit
def test_corrupt_manifest(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "db"
    _filled(path)
    (manifest,) = path.glob("MANIFEST-*")
    manifest.write_bytes(b"garbage" * 100)
    with pytest.raises(CheckpointCorruptError) as ei:
        CheckpointStore(path)
    msg = str(ei.value)
    assert str(path) in msg and "repair" in msg and "delete the directory" in msg
    CheckpointStore.repair(path)
    with CheckpointStore(path) as s:  # the data lives in the log/tables, repair rebuilds it
        assert s.namespace("n").count() == 200


@pytest.mark.unit
def test_corrupt_current(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "db"
    _filled(path, 10)
    (path / "CURRENT").write_bytes(b"MANIFEST-999999\n")  # points at nothing
    with pytest.raises(CheckpointCorruptError, match=str(path)):
        CheckpointStore(path)


@pytest.mark.unit
def test_corrupt_log_fails_loudly_instead_of_dropping(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "db"
    _filled(path)
    (log,) = path.glob("*.log")
    data = bytearray(log.read_bytes())
    for i in range(1000, 1100):
        data[i] ^= 0xFF
    log.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=str(path)):
        CheckpointStore(path)
    CheckpointStore.repair(path)  # salvages what it can; the damaged records are gone
    with CheckpointStore(path) as s:
        assert 0 < s.namespace("n").count() < 200


@pytest.mark.unit
def test_torn_log_tail_is_accepted(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "db"
    _filled(path)
    (log,) = path.glob("*.log")
    os.truncate(log, log.stat().st_size - 50)  # what a crash mid-append leaves
    with CheckpointStore(path) as s:
        assert s.namespace("n").count() == 199


# --- SnapshotLog ------------------------------------------------------------------------------


@pytest.mark.unit
def test_snapshot_log_sequence(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "db"
    with CheckpointStore(path) as s:
        log = SnapshotLog(s, "actor")
        assert log.last_seq == 0
        assert log.restore() == (None, [])
        assert log.append(b"e1") == 1
        assert log.append_many([b"e2", b"e3"]) == [2, 3]
        assert log.append_many([]) == []
        assert log.restore() == (None, [(1, b"e1"), (2, b"e2"), (3, b"e3")])
        log.snapshot(b"S3")
        assert log.restore() == (b"S3", [])
        assert s.namespace("actor.log").count() == 0
        assert log.append(b"e4", sync=False) == 4
        assert log.restore() == (b"S3", [(4, b"e4")])
        # other logs on the same store are independent
        other = SnapshotLog(s, "actor2")
        assert other.append(b"x") == 1
        assert other.restore() == (None, [(1, b"x")])

    with CheckpointStore(path) as s:
        log = SnapshotLog(s, "actor")
        assert log.last_seq == 4
        assert log.restore() == (b"S3", [(4, b"e4")])
        assert log.append(b"e5") == 5
        log.snapshot(b"")  # an empty state is still a snapshot, not None
        assert log.restore() == (b"", [])

    with CheckpointStore(path) as s:  # log empty: last_seq comes from the snapshot
        log = SnapshotLog(s, "actor")
        assert log.last_seq == 5
        assert log.append(b"e6") == 6
        assert log.restore() == (b"", [(6, b"e6")])


@pytest.mark.unit
def test_snapshot_upto_keeps_later_entries(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "db"
    with CheckpointStore(path) as s:
        log = SnapshotLog(s, "a")
        log.append_many([b"e%d" % i for i in range(1, 11)])
        log.snapshot(b"S6", upto=6)
        assert log.restore() == (b"S6", [(i, b"e%d" % i) for i in range(7, 11)])
        assert s.namespace("a.log").count() == 4
        with pytest.raises(ValueError):
            log.snapshot(b"bad", upto=11)  # beyond last_seq
        with pytest.raises(ValueError):
            log.snapshot(b"bad", upto=5)  # behind the previous snapshot
        assert log.restore()[0] == b"S6"
    with CheckpointStore(path) as s:
        log = SnapshotLog(s, "a")
        assert log.last_seq == 10
        assert log.restore() == (b"S6", [(i, b"e%d" % i) for i in range(7, 11)])
        log.snapshot(b"S8", upto=8)
        assert log.append(b"e11") == 11
        assert log.restore() == (b"S8", [(9, b"e9"), (10, b"e10"), (11, b"e11")])


@pytest.mark.unit
def test_snapshot_log_seq_sorts_past_byte_boundaries(tmp_path: pathlib.Path) -> None:
    with CheckpointStore(tmp_path / "db", sync=False) as s:
        log = SnapshotLog(s, "a")
        seqs = log.append_many([b"x"] * 300)  # crosses 255 -> 256
        assert seqs == list(range(1, 301))
        log.snapshot(b"S", upto=250)
        assert [seq for seq, _ in log.restore()[1]] == list(range(251, 301))


@pytest.mark.unit
def test_snapshot_log_concurrent_appends_get_unique_ordered_seqs(tmp_path: pathlib.Path) -> None:
    with CheckpointStore(tmp_path / "db", sync=False) as s:
        log = SnapshotLog(s, "a")
        got: list[int] = []

        def worker(tid: int) -> None:
            for i in range(50):
                got.append(log.append(b"%d:%d" % (tid, i)))

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert sorted(got) == list(range(1, 201))
        _, entries = log.restore()
        assert [seq for seq, _ in entries] == list(range(1, 201))
        by_thread: dict[bytes, list[int]] = {}
        for _, entry in entries:
            tid, i = entry.split(b":")
            by_thread.setdefault(tid, []).append(int(i))
        assert all(v == list(range(50)) for v in by_thread.values())  # per-thread order kept


# --- property ---------------------------------------------------------------------------------

_keys = st.binary(min_size=0, max_size=4)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), _keys, st.binary(max_size=8)),
        st.tuples(st.just("del"), _keys, st.just(b"")),
        st.tuples(st.just("reopen"), st.just(b""), st.just(b"")),
    ),
    max_size=40,
)


@pytest.mark.unit
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=_ops)
def test_random_put_delete_matches_dict_after_reopen(ops: list[tuple[str, bytes, bytes]]) -> None:
    with tempfile.TemporaryDirectory() as d:
        model: dict[bytes, bytes] = {}
        s = CheckpointStore(pathlib.Path(d) / "db", sync=False)
        neighbour = s.namespace("p2")
        neighbour.put(b"", b"n")  # a neighbour namespace must never leak in
        try:
            for op, key, value in ops:
                ns = s.namespace("p")
                if op == "put":
                    ns.put(key, value)
                    model[key] = value
                elif op == "del":
                    ns.delete(key)
                    model.pop(key, None)
                else:
                    s.close()
                    s = CheckpointStore(pathlib.Path(d) / "db")
            s.close()
            s = CheckpointStore(pathlib.Path(d) / "db")
            ns = s.namespace("p")
            assert dict(ns.scan()) == model
            assert [k for k, _ in ns.scan()] == sorted(model)
            assert ns.count() == len(model)
            assert s.namespace("p2").get(b"") == b"n"
        finally:
            s.close()
