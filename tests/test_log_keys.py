"""The message log is keyed by (stream, id): the same event id sent to
two streams is two events, logged twice and completed one by one. LogStore on real
LevelDB, without Ray; the end-to-end check through a real collector is in
tests/test_log_keys_e2e.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.queue.logger import FailedEntry, LogStore
from actors.queue.logger.records import (
    COUNTS_KEY,
    NS_BY_RETRY,
    NS_BY_TIME,
    NS_FAILED,
    NS_META,
    NS_TRANSIENT,
    _be,
    _Counts,
    _enc,
    _key,
)
from runtime.data.events import Event, encode_event
from runtime.state.checkpoint import CheckpointStore

pytestmark = pytest.mark.unit

BIG = 1 << 40


def ev(stream: str, id_: str = "1", *, token: str = "", ms: int = 1_000) -> Event:
    return Event(id_, stream, f"raw.{stream}", b'{"s":"%s"}' % stream.encode(), ms, token=token)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LogStore]:
    s = LogStore(tmp_path / "log", max_events=1000, max_bytes=BIG)
    yield s
    s.close()


def test_same_id_in_two_streams_is_logged_twice(store: LogStore) -> None:
    assert store.append([ev("a"), ev("b")]) == 2
    assert store.append([ev("b")]) == 0  # the same (stream, id) again: already held
    assert store.counts()["transient"] == 2
    assert store.where(("a", "1")) == "transient" and store.where(("b", "1")) == "transient"
    pend = store.pending(0, now_ms=10_000, limit=10)
    assert sorted((e.stream, e.id) for e in pend) == [("a", "1"), ("b", "1")]
    assert store.scan_counts()["by_time"] == 2


def test_forget_of_one_stream_keeps_the_other_streams_entry(store: LogStore) -> None:
    store.append([ev("a"), ev("b")])
    assert store.forget([_key("a", "1")], {_key("a", "1"): ("A", 7)}) == 1
    assert store.where(("a", "1")) is None
    assert store.where(("b", "1")) == "transient"
    assert [(e.stream, e.id) for e in store.pending(0, 10_000, 10)] == [("b", "1")]
    assert store.counts()["transient"] == 1


def test_fail_of_one_stream_leaves_the_other_transient(store: LogStore) -> None:
    store.append([ev("a"), ev("b")])
    assert store.fail([(ev("a"), "nak")], now_ms=0, retry_delay_ms=lambda n: 10) == 1
    assert store.where(("a", "1")) == "failed" and store.where(("b", "1")) == "transient"
    fe = store.failed_entry(("a", "1"))
    assert fe is not None and fe.event.stream == "a" and fe.attempts == 1
    assert store.failed_entry(("b", "1")) is None
    assert [(e.stream, e.id) for e in store.due_failed(now_ms=100, limit=10)] == [("a", "1")]
    assert store.forget([_key("a", "1")]) == 1
    assert store.counts() == {
        "transient": 1,
        "failed": 0,
        "bytes": store.counts()["bytes"],
        "tokens": 0,
        "logged": 2,
    }


def test_tokens_of_two_streams_with_the_same_id_complete_separately(store: LogStore) -> None:
    store.append([ev("a", token="TA"), ev("b", token="TB")])
    store.forget([_key("a", "1")], {_key("a", "1"): ("A", 3)})
    a, b = store.token_status("TA"), store.token_status("TB")
    assert a is not None and a["state"] == "queued" and a["seqs"] == {"1": ["A", 3]}
    assert b is not None and b["state"] == "logged"


def test_forget_by_storage_keys_as_a_forget_blob_carries_them(store: LogStore) -> None:
    """`decode_forget` hands the store its own keys: transient, tokened and failed entries
    are all dropped by them, and a token still learns its event's sequence."""
    from actors.queue.logger.records import decode_forget, encode_forget

    store.append([ev("a", "1"), ev("b", "1", token="TB"), ev("a", "2"), ev("a", "3")])
    store.fail([(ev("a", "2"), "nak")], now_ms=0, retry_delay_ms=lambda n: 10)
    keys = [("a", "1"), ("b", "1"), ("a", "2"), ("a", "9")]  # ("a", "9") is not held
    listed, known = decode_forget(encode_forget(keys, {("b", "1"): ("B", 4)}))
    assert all(isinstance(k, bytes) for k in listed)
    assert store.forget(listed, known) == 3
    assert [store.where(k) for k in keys] == [None, None, None, None]
    assert store.where(("a", "3")) == "transient"
    status = store.token_status("TB")
    assert status is not None and status["state"] == "queued" and status["seqs"] == {"1": ["B", 4]}
    assert store.counts()["transient"] == 1 and store.counts()["failed"] == 0
    assert store.scan_counts()["by_time"] == 1 and store.scan_counts()["by_retry"] == 0


def test_a_forget_blob_of_the_earlier_form_forgets_by_storage_keys(store: LogStore) -> None:
    """A blob written with (stream, id) pairs (before keys crossed as storage keys) still
    drops its entries and tells a token its event's sequence."""
    from actors.queue.logger.records import decode_forget

    store.append([ev("a", "1"), ev("b", "1", token="TB"), ev("a", "2")])
    earlier = _enc.encode(([["a", "1"], ["b", "1"]], [("b", "1", "B", 4)]))
    listed, known = decode_forget(earlier)
    assert listed == [_key("a", "1"), _key("b", "1")] and known == {_key("b", "1"): ("B", 4)}
    assert store.forget(listed, known) == 2
    assert store.where(("a", "2")) == "transient" and store.where(("b", "1")) is None
    status = store.token_status("TB")
    assert status is not None and status["seqs"] == {"1": ["B", 4]}


def test_a_bare_id_or_a_pair_is_refused_as_a_key(store: LogStore) -> None:
    """The store takes storage keys only: anything else could match nothing, silently."""
    store.append([ev("a")])
    for wrong in ("1", ("a", "1")):
        with pytest.raises(TypeError, match="stream, id"):
            store.forget([wrong])  # type: ignore[list-item]
    assert store.where(("a", "1")) == "transient"
    assert store.scan_counts()["index_mismatches"] == 0


def test_export_import_keeps_both_streams(tmp_path: Path, store: LogStore) -> None:
    store.append([ev("a"), ev("b")])
    store.fail([(ev("b"), "x")], 0, lambda n: 5)
    dst = LogStore(tmp_path / "dst", max_events=1000, max_bytes=BIG)
    try:
        entries, cursor = store.export(None, 100)
        assert cursor is None
        dst.import_(entries)
        assert dst.where(("a", "1")) == "transient" and dst.where(("b", "1")) == "failed"
        assert dst.scan_counts()["by_retry"] == 1 and dst.counts()["transient"] == 1
    finally:
        dst.close()


def test_a_store_keyed_by_id_alone_is_migrated_at_open(tmp_path: Path) -> None:
    """A checkpoint written before (stream, id) keys opens with every entry readable
    under its new key, indexes and counters consistent."""
    path = tmp_path / "old"
    old = CheckpointStore(path)
    t, f = ev("a", "e1", ms=5), ev("b", "e2", ms=6)
    raw_t = encode_event(t)
    fe = FailedEntry(encode_event(f), "nak", 2, 900)
    c = _Counts(transient=1, failed=1, bytes=len(raw_t) + len(fe.raw))
    with old.write_batch() as b:
        b.put(old.namespace(NS_TRANSIENT), b"e1", raw_t)
        b.put(old.namespace(NS_BY_TIME), _be(5) + b"e1", b"")
        b.put(old.namespace(NS_FAILED), b"e2", _enc.encode(fe))
        b.put(old.namespace(NS_BY_RETRY), _be(900) + b"e2", b"")
        b.put(old.namespace(NS_META), COUNTS_KEY, _enc.encode(c))
    old.close()

    s = LogStore(path, max_events=1000, max_bytes=BIG)
    try:
        assert s.where(("a", "e1")) == "transient" and s.where(("b", "e2")) == "failed"
        assert [e.id for e in s.pending(0, 10_000, 10)] == ["e1"]
        assert [e.id for e in s.due_failed(1_000, 10)] == ["e2"]
        scan = s.scan_counts()
        assert scan["by_time"] == 1 and scan["by_retry"] == 1
        assert scan["index_mismatches"] == 0
        assert {k: scan[k] for k in ("transient", "failed", "bytes")} == {
            "transient": 1,
            "failed": 1,
            "bytes": c.bytes,
        }
        assert s.forget([_key("a", "e1"), _key("b", "e2")]) == 2
        assert s.scan_counts()["transient"] == 0 and s.counts()["failed"] == 0
    finally:
        s.close()
    reopened = LogStore(path, max_events=1000, max_bytes=BIG)  # idempotent: nothing to redo
    try:
        assert reopened.counts()["transient"] == 0
    finally:
        reopened.close()
