"""LogStore's in-memory index and encoded appends: the index always agrees with the disk
(after reopen, after a call that failed before writing; after a SIGKILL in
test_logger_crash), and an append of
`encode_batch` bytes logs exactly what an append of the events does."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pykka
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.queue.logger import LogFull, LogStore
from actors.queue.logger.records import NS_TRANSIENT, _Head, _key
from actors.queue.logger.replica import _answers
from actors.queue.logger.writer import WakingFuture, WriterClient, WriterOp
from runtime.data.events import Event, encode_batch, encode_event
from runtime.state.checkpoint import CheckpointError

pytestmark = pytest.mark.unit

BIG = 1 << 40


def ev(i: int, *, token: str = "", ms: int = 1_000, stream: str = "s") -> Event:
    return Event(f"e{i}", stream, f"{stream}.raw", b'{"x":%d}' % i, ms, token=token)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LogStore]:
    s = LogStore(tmp_path / "log", max_events=1000, max_bytes=BIG)
    yield s
    s.close()


def test_the_index_head_reads_the_fields_of_an_event() -> None:
    assert _Head.__struct_fields__ == Event.__struct_fields__
    e = ev(1, token="T", ms=123)
    head = msgspec.msgpack.decode(encode_event(e), type=_Head)
    assert (head.id, head.stream, head.received_ms, head.token) == ("e1", "s", 123, "T")


def test_an_encoded_batch_is_logged_as_the_events_would_be(tmp_path: Path) -> None:
    events = [ev(1), ev(2, token="T"), ev(1, ms=9), ev(3, stream="t")]  # e1 twice: the first
    a = LogStore(tmp_path / "a", max_events=10, max_bytes=BIG)
    b = LogStore(tmp_path / "b", max_events=10, max_bytes=BIG)
    try:
        assert a.append(events) == b.append(encode_batch(events)) == 3
        assert a.append(encode_batch(events)) == b.append(events) == 0  # all held already
        assert (
            a.counts()
            == b.counts()
            == {
                "transient": 3,
                "failed": 0,
                "bytes": sum(
                    len(encode_event(e)) for e in (ev(1), ev(2, token="T"), ev(3, stream="t"))
                ),
                "tokens": 1,
                "logged": 3,  # this process's appends: the 3 new ones each
            }
        )
        assert list(a._ns[NS_TRANSIENT].scan()) == list(b._ns[NS_TRANSIENT].scan())
        assert b.pending(0, 10_000, 10) == [ev(1), ev(2, token="T"), ev(3, stream="t")]
        assert b.token_status("T")["state"] == "logged"
        assert b.forget([_key("s", "e2")], {_key("s", "e2"): ("S", 7)}) == 1
        assert b.token_status("T")["seqs"] == {"e2": ["S", 7]}
        assert b.scan_counts()["index_mismatches"] == 0
    finally:
        a.close()
        b.close()


def test_an_encoded_batch_past_the_bound_is_refused_whole(tmp_path: Path) -> None:
    s = LogStore(tmp_path / "log", max_events=3, max_bytes=BIG)
    try:
        s.append(encode_batch([ev(1), ev(2)]))
        with pytest.raises(LogFull):
            s.append(encode_batch([ev(2), ev(3), ev(4)]))  # e2 held: two new, one too many
        assert s.counts()["transient"] == 2 and s.where(("s", "e3")) is None
        assert s.scan_counts()["index_mismatches"] == 0
    finally:
        s.close()


def test_a_malformed_encoded_batch_logs_nothing(store: LogStore) -> None:
    bad = msgspec.msgpack.encode([["e1", "s", "s.raw", "not bytes", 1]])
    with pytest.raises(msgspec.ValidationError):
        store.append(bad)
    assert store.counts()["transient"] == 0 and store.where(("s", "e1")) is None


def test_the_index_is_read_back_from_disk_at_open(tmp_path: Path) -> None:
    s = LogStore(tmp_path / "log", max_events=100, max_bytes=BIG)
    s.append(
        [ev(1), ev(2, token="T"), ev(3, ms=-5), ev(4, ms=(1 << 64) - 1), ev(5), ev(6, token="U")]
    )
    s.fail([(ev(5), "nak")], 1_000, lambda n: 10)
    s.fail([(ev(6), "nak")], 1_000, lambda n: 10)
    s.forget([_key("s", "e1")])
    before = dict(s._idx)
    s.close()
    again = LogStore(tmp_path / "log", max_events=100, max_bytes=BIG)
    try:
        assert again._idx == before
        assert again.scan_counts()["index_mismatches"] == 0
        assert [again.where(("s", f"e{i}")) for i in range(1, 7)] == [
            None,
            "transient",
            "transient",
            "transient",
            "failed",
            "failed",
        ]
        # entries known only from the reopened index are forgotten with their time keys
        assert again.forget([_key("s", f"e{i}") for i in range(1, 7)]) == 5
        scan = again.scan_counts()
        assert scan["transient"] == scan["failed"] == scan["by_time"] == scan["by_retry"] == 0
        assert again.token_status("T")["state"] == "queued"
        assert again.token_status("U")["state"] == "queued"
    finally:
        again.close()


def test_a_call_that_fails_before_writing_leaves_the_index_as_the_disk(
    tmp_path: Path, store: LogStore
) -> None:
    store.append([ev(1), ev(2)])
    fault = store.path.with_name(store.path.name + ".fault")
    fault.write_text("io")
    with pytest.raises(CheckpointError):
        store.forget([_key("s", "e1")])
    with pytest.raises(CheckpointError):
        store.append(encode_batch([ev(3)]))
    fault.unlink()
    assert store.where(("s", "e1")) == "transient" and store.where(("s", "e3")) is None

    def boom(attempts: int) -> int:
        raise RuntimeError("delay policy failed")

    with pytest.raises(RuntimeError):
        store.fail([(ev(1), "x"), (ev(2), "y")], 5, boom)
    assert store.where(("s", "e1")) == store.where(("s", "e2")) == "transient"
    assert store.scan_counts()["index_mismatches"] == 0
    assert store.forget([_key("s", "e1"), _key("s", "e2"), _key("s", "e3")]) == 2


def test_pending_finds_an_entry_older_than_any_it_saw_before(store: LogStore) -> None:
    """`pending` from LevelDB's time index scans from the oldest time it knows to be live;
    an append, an import or a reopen with an older entry must still be seen."""
    store.pending_from_index_max = 0
    store.append([ev(1, ms=100), ev(2, ms=200)])
    store.forget([_key("s", "e1")])
    assert [e.id for e in store.pending(0, 1_000, 10)] == ["e2"]
    store.append(encode_batch([ev(3, ms=50)]))
    assert [e.id for e in store.pending(0, 1_000, 10)] == ["e3", "e2"]
    store.forget([_key("s", "e2"), _key("s", "e3")])
    assert store.pending(0, 1_000, 10) == []
    store.append([ev(4, ms=10)])
    assert [e.id for e in store.pending(0, 1_000, 10)] == ["e4"]
    exported, _ = store.export(None, 10)
    store.forget([_key("s", "e4")])
    assert store.pending(0, 2_000, 10) == []
    store.import_(exported)
    assert [e.id for e in store.pending(0, 2_000, 1)] == ["e4"]


def test_pending_after_reopen_starts_from_the_beginning(tmp_path: Path) -> None:
    s = LogStore(tmp_path / "log", max_events=100, max_bytes=BIG)
    s.pending_from_index_max = 0
    s.append([ev(1, ms=5_000)])
    assert s.pending(0, 9_000, 10) == [ev(1, ms=5_000)]
    s.forget([_key("s", "e1")])
    assert s.pending(0, 9_000, 10) == []
    s.close()
    # written by another handle behind this one's back: a new store's floor is 0
    other = LogStore(tmp_path / "log", max_events=100, max_bytes=BIG)
    other.append([ev(2, ms=1)])
    other.close()
    again = LogStore(tmp_path / "log", max_events=100, max_bytes=BIG)
    again.pending_from_index_max = 0
    try:
        assert [e.id for e in again.pending(0, 9_000, 10)] == ["e2"]
    finally:
        again.close()


# ------------------------------------------------------------------- the writer's answers


def test_a_waking_future_wakes_once_whether_set_before_or_after() -> None:
    calls: list[str] = []
    before = WakingFuture()
    before.set(1)
    before.when_set(lambda: calls.append("before"))
    after = WakingFuture()
    after.when_set(lambda: calls.append("after"))
    assert calls == ["before"]
    try:
        raise ValueError("boom")
    except ValueError:
        after.set_exception()
    assert calls == ["before", "after"]
    assert before.get(timeout=0) == 1
    with pytest.raises(ValueError, match="boom"):
        after.get(timeout=0)


async def test_answers_are_awaited_without_an_executor(tmp_path: Path) -> None:
    client = WriterClient(tmp_path / "log", {"max_events": 10, "max_bytes": BIG})
    try:
        ref = client.current(10.0)
        futures = [
            ref.ask(WriterOp("append", (encode_batch([ev(1), ev(2)]),)), block=False),
            ref.ask(WriterOp("counts"), block=False),
        ]
        assert all(isinstance(f, WakingFuture) for f in futures)
        assert await _answers(futures, 10.0) == [2, client.call("counts")]
        refused = ref.ask(WriterOp("append", ([ev(i) for i in range(20)],)), block=False)
        with pytest.raises(LogFull):
            await _answers([refused], 10.0)
        ref.stop()  # a dead writer answers ActorDeadError, awaited the same way
        with pytest.raises(pykka.ActorDeadError):
            await _answers([ref.ask(WriterOp("counts"), block=False)], 10.0)
    finally:
        client.stop()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, 30), st.integers(0, 50), st.sampled_from(["", "T"]))),
    st.lists(st.integers(0, 30)),
    st.lists(st.integers(0, 30)),
    st.integers(0, 60),
    st.integers(1, 12),
)
def test_pending_from_the_index_is_pending_from_the_time_index(
    appended: list[tuple[int, int, str]],
    failed: list[int],
    forgotten: list[int],
    cutoff: int,
    limit: int,
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        s = LogStore(Path(tmp) / "log", max_events=100, max_bytes=BIG)
        try:
            s.append([ev(i, ms=ms, token=t) for i, ms, t in appended])
            s.fail([(ev(i), "x") for i in failed], 0, lambda n: 10)
            s.forget([_key("s", f"e{i}") for i in forgotten])
            from_index = s.pending(0, cutoff, limit)
            s.pending_from_index_max = 0
            assert s.pending(0, cutoff, limit) == from_index
            assert all(e.received_ms < cutoff for e in from_index)
        finally:
            s.close()


def test_a_store_written_with_compressed_blocks_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Log stores are now written uncompressed; one written before (snappy, the LevelDB
    default), with its blocks on disk in table files, opens and reads whole."""
    import actors.queue.logger.store as store_module

    monkeypatch.setattr(store_module, "COMPRESSION", "snappy")
    monkeypatch.setattr(store_module, "WRITE_BUFFER_BYTES", 64 << 10)  # flush to tables
    path = tmp_path / "log"
    old = LogStore(path, max_events=10_000, max_bytes=BIG)
    events = [ev(i, ms=i) for i in range(3000)]
    for i in range(0, 3000, 500):
        old.append(encode_batch(events[i : i + 500]))
    old.forget([_key("s", f"e{i}") for i in range(0, 3000, 3)])
    old.close()
    assert list(path.glob("*.ldb")), "nothing was flushed to a table file"
    monkeypatch.undo()
    s = LogStore(path, max_events=10_000, max_bytes=BIG)
    try:
        kept = [e for e in events if int(e.id[1:]) % 3]
        assert s.pending(0, 10_000, 5000) == kept
        scan = s.scan_counts()
        assert scan["index_mismatches"] == 0 and scan["transient"] == len(kept) == scan["by_time"]
        assert s.forget([_key("s", e.id) for e in kept]) == len(kept)
    finally:
        s.close()
