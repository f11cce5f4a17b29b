"""MessageLogger without Ray: LogStore on real LevelDB, the supervised LogWriter, inspect."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pykka
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.queue.logger import (
    PARKED_MS,
    LogFull,
    LogStore,
    LogUnavailable,
    WriterClient,
    inspect,
    settle_parked,
)
from actors.queue.logger.records import _key
from actors.queue.logger.writer import WriterOp, _Crash
from runtime.clock import now_ms
from runtime.data.events import Event, encode_batch, encode_event
from runtime.state.checkpoint import CheckpointError, CheckpointStore
from runtime.supervision.policy import Intensity
from runtime.waiting import wait_until

pytestmark = pytest.mark.unit

BIG = 1 << 40


def ev(i: int | str, *, token: str = "", ms: int = 1_000, data: bytes = b'{"x":1}') -> Event:
    return Event(
        id=f"e{i}" if isinstance(i, int) else i,
        stream="s",
        subject="s.raw",
        data=data,
        received_ms=ms,
        token=token,
    )


def delay(attempts: int) -> int:
    return 100 * attempts


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LogStore]:
    s = LogStore(tmp_path / "log", max_events=1000, max_bytes=BIG)
    yield s
    s.close()


def consistent(s: LogStore) -> dict[str, int]:
    """counts() equals a full scan and the indexes match their stores."""
    scan = s.scan_counts()
    counts = {k: v for k, v in s.counts().items() if k != "logged"}  # kept on disk only
    assert {k: scan[k] for k in counts} == counts
    assert scan["by_time"] == scan["transient"]
    assert scan["by_retry"] == scan["failed"]
    assert scan["index_mismatches"] == 0  # the in-memory index agrees with the disk
    return counts


# ----------------------------------------------------------------------------- state machine


def test_append_then_forget_drops_the_entry(store: LogStore) -> None:
    assert store.append([ev(1), ev(2)]) == 2
    assert store.where(("s", "e1")) == "transient"
    assert consistent(store)["transient"] == 2
    assert store.forget([_key("s", "e1"), _key("s", "missing")]) == 1
    assert store.where(("s", "e1")) is None
    assert store.where(("s", "e2")) == "transient"
    assert consistent(store) == {
        "transient": 1,
        "failed": 0,
        "bytes": len(encode_event(ev(2))),
        "tokens": 0,
    }


def test_fail_moves_to_failed_and_again_increments_attempts(store: LogStore) -> None:
    store.append([ev(1), ev(2)])
    assert store.fail([(ev(1), "timeout")], now_ms=10_000, retry_delay_ms=delay) == 1
    assert store.where(("s", "e1")) == "failed"
    fe = store.failed_entry(("s", "e1"))
    assert (fe.error, fe.attempts, fe.next_retry_ms) == ("timeout", 1, 10_100)
    assert store.fail([(ev(1), "nak")], now_ms=20_000, retry_delay_ms=delay) == 1
    fe = store.failed_entry(("s", "e1"))
    assert (fe.error, fe.attempts, fe.next_retry_ms) == ("nak", 2, 20_200)
    assert consistent(store)["failed"] == 1
    assert store.counts()["transient"] == 1
    # failed --ack--> gone
    assert store.forget([_key("s", "e1")]) == 1
    assert store.where(("s", "e1")) is None
    assert consistent(store)["failed"] == 0


def test_fail_of_an_unknown_or_acked_id_changes_nothing(store: LogStore) -> None:
    store.append([ev(1)])
    store.forget([_key("s", "e1")])
    assert store.fail([(ev(1), "late"), (ev(9), "never")], 0, delay) == 0
    assert store.where(("s", "e1")) is None
    assert consistent(store) == {"transient": 0, "failed": 0, "bytes": 0, "tokens": 0}


def test_fail_stores_the_processed_form_and_adjusts_bytes(store: LogStore) -> None:
    store.append([ev(1, data=b"{}")])
    processed = Event("e1", "s", "s.routed", b'{"enriched": true}', 1_000, processed=True)
    store.fail([(processed, "x")], 0, delay)
    got = store.due_failed(now_ms=BIG, limit=10)
    assert got == [processed]
    assert consistent(store)["bytes"] == len(encode_event(processed))


def test_pending_returns_old_transient_entries_oldest_first(store: LogStore) -> None:
    store.append([ev("late", ms=5_000), ev("early", ms=1_000), ev("mid", ms=3_000)])
    assert [e.id for e in store.pending(older_than_ms=1_000, now_ms=4_500, limit=10)] == [
        "early",
        "mid",
    ]
    assert [e.id for e in store.pending(1_000, 4_500, limit=1)] == ["early"]
    assert store.pending(older_than_ms=10_000, now_ms=4_500, limit=10) == []
    store.fail([(ev("early", ms=1_000), "x")], 0, delay)  # failed entries are not pending
    assert [e.id for e in store.pending(0, 10_000, 10)] == ["mid", "late"]


def test_due_failed_respects_next_retry(store: LogStore) -> None:
    store.append([ev(1), ev(2)])
    store.fail([(ev(1), "a")], now_ms=1_000, retry_delay_ms=lambda n: 500)
    store.fail([(ev(2), "b")], now_ms=1_000, retry_delay_ms=lambda n: 100)
    assert store.due_failed(now_ms=1_099, limit=10) == []
    assert [e.id for e in store.due_failed(1_100, 10)] == ["e2"]
    assert [e.id for e in store.due_failed(1_500, 10)] == ["e2", "e1"]


# ----------------------------------------------------------------------------- bounds


def test_logfull_refuses_the_whole_batch_and_keeps_counts(tmp_path: Path) -> None:
    s = LogStore(tmp_path / "log", max_events=5, max_bytes=BIG)
    s.append([ev(i) for i in range(4)])
    before = consistent(s)
    with pytest.raises(LogFull) as err:
        s.append([ev(i) for i in range(4, 6)])  # 4 + 2 > 5
    assert (err.value.events, err.value.max_events) == (4, 5)
    assert s.where(("s", "e4")) is None and s.where(("s", "e5")) is None  # nothing partial
    assert consistent(s) == before
    # ids already present do not count against the bound
    assert s.append([ev(0), ev(1), ev(4)]) == 1
    assert consistent(s)["transient"] == 5
    s.close()


def test_logfull_by_bytes(tmp_path: Path) -> None:
    size = len(encode_event(ev(0)))
    s = LogStore(tmp_path / "log", max_events=100, max_bytes=3 * size)
    s.append([ev(0), ev(1)])
    with pytest.raises(LogFull) as err:
        s.append([ev(2), ev(3)])
    assert err.value.bytes == 2 * size
    assert "full" in str(err.value)
    assert consistent(s)["transient"] == 2
    s.close()


def test_append_is_idempotent(store: LogStore) -> None:
    assert store.append([ev(1), ev(1), ev(2)]) == 2  # a repeat inside the batch
    assert store.append([ev(1), ev(2)]) == 0  # and across batches
    store.fail([(ev(1), "x")], 0, delay)
    assert store.append([ev(1)]) == 0  # a failed entry is held too: not logged twice
    assert store.where(("s", "e1")) == "failed"
    assert consistent(store) == {
        "transient": 1,
        "failed": 1,
        "bytes": 2 * len(encode_event(ev(1))),
        "tokens": 0,
    }


def test_counters_survive_reopen_and_match_a_scan(tmp_path: Path) -> None:
    s = LogStore(tmp_path / "log", max_events=1000, max_bytes=BIG)
    s.append([ev(i, token="t" if i < 3 else "") for i in range(10)])
    s.fail([(ev(5), "x")], 0, delay)
    s.forget([_key("s", "e0"), _key("s", "e7")], {_key("s", "e0"): ("s", 1)})
    counts = consistent(s)
    s.close()
    again = LogStore(tmp_path / "log", max_events=1000, max_bytes=BIG)
    assert again.created is False
    assert again.counts() == {**counts, "logged": 0}  # `logged` counts this process's appends
    assert consistent(again) == {"transient": 7, "failed": 1, "bytes": counts["bytes"], "tokens": 1}
    again.close()


def test_a_failed_entry_is_held_after_a_reopen_and_a_full_forget(tmp_path: Path) -> None:
    # appends read the failed store only while the counters say it holds something: the
    # counters must come back from disk with the entries they count
    s = LogStore(tmp_path / "log", max_events=1000, max_bytes=BIG)
    s.append([ev(1), ev(2)])
    s.fail([(ev(1), "x")], 0, delay)
    s.close()
    s = LogStore(tmp_path / "log", max_events=1000, max_bytes=BIG)
    assert s.append([ev(1), ev(3)]) == 1
    assert s.where(("s", "e1")) == "failed"
    assert s.forget([_key("s", "e1"), _key("s", "e1")]) == 1  # a repeat inside the call is one
    assert s.append([ev(1)]) == 1  # forgotten: logged again
    assert consistent(s)["transient"] == 3
    s.close()


# ----------------------------------------------------------------------------- tokens


def test_token_goes_logged_failed_queued_with_seqs(store: LogStore) -> None:
    store.append([ev(1, token="T"), ev(2, token="T"), ev(3)])
    assert store.token_status("T")["state"] == "logged"
    assert store.token_status("nope") is None
    store.fail([(ev(2, token="T"), "nak")], 0, delay)
    status = store.token_status("T")
    assert (status["state"], status["errors"]) == ("failed", {"e2": "nak"})
    store.forget([_key("s", "e1")], {_key("s", "e1"): ("s", 7)})
    assert store.token_status("T")["state"] == "failed"
    store.forget([_key("s", "e2")], {_key("s", "e2"): ("s", 9)})
    status = store.token_status("T")
    assert status["state"] == "queued"
    assert status["seqs"] == {"e1": ["s", 7], "e2": ["s", 9]}
    assert (status["events"], status["acked"], status["errors"]) == (2, 2, {})


def test_fail_keeps_the_logged_token(store: LogStore) -> None:
    store.append([ev(1, token="T")])
    store.fail([(ev(1), "x")], 0, delay)  # the bridge's processed event lost the token
    store.forget([_key("s", "e1")], {_key("s", "e1"): ("s", 1)})
    assert store.token_status("T")["state"] == "queued"


def test_only_the_newest_completed_tokens_are_kept(tmp_path: Path) -> None:
    s = LogStore(tmp_path / "log", max_events=100, max_bytes=BIG, max_done_tokens=2)
    s.append([ev(i, token=f"T{i}") for i in range(4)])
    for i in range(4):
        s.forget([_key("s", f"e{i}")])
    assert s.token_status("T0") is None and s.token_status("T1") is None
    assert s.token_status("T2")["state"] == "queued"
    assert s.token_status("T3")["state"] == "queued"
    assert consistent(s)["tokens"] == 2
    # several completions in one call past the bound
    s.append([ev(i, token=f"U{i}") for i in range(10, 15)])
    s.forget([_key("s", f"e{i}") for i in range(10, 15)])
    assert [s.token_status(f"U{i}") is not None for i in range(10, 15)] == [False] * 3 + [True] * 2
    assert s.token_status("T3") is None
    scan = s.scan_counts()
    assert (scan["tokens"], scan["tokens_done"], s.counts()["tokens"]) == (2, 2, 2)
    s.close()


def test_open_tokens_never_expire(tmp_path: Path) -> None:
    s = LogStore(tmp_path / "log", max_events=100, max_bytes=BIG, max_done_tokens=0)
    s.append([ev(1, token="open"), ev(2, token="done")])
    s.forget([_key("s", "e2")])
    assert s.token_status("open")["state"] == "logged"
    assert s.token_status("done") is None
    s.close()


# ----------------------------------------------------------------------------- catch-up


def fill(s: LogStore, n: int) -> None:
    s.append([ev(i, token=f"T{i % 7}", ms=1_000 + i) for i in range(n)])
    s.fail([(ev(i, token=f"T{i % 7}"), f"err{i}") for i in range(0, n, 5)], 50, delay)
    s.forget(
        [_key("s", f"e{i}") for i in range(1, n, 3)],
        {_key("s", f"e{i}"): ("s", i) for i in range(1, n, 3)},
    )


def export_all(s: LogStore, chunk: int) -> list[tuple[str, bytes, bytes]]:
    out: list[tuple[str, bytes, bytes]] = []
    cursor = None
    for _ in range(10_000):
        entries, cursor = s.export(cursor, chunk)
        out += entries
        if cursor is None:
            return out
    raise AssertionError("export did not finish")


def test_export_import_copies_everything_in_chunks(tmp_path: Path) -> None:
    src = LogStore(tmp_path / "a", max_events=1000, max_bytes=BIG)
    dst = LogStore(tmp_path / "b", max_events=1000, max_bytes=BIG)
    fill(src, 100)
    cursor = None
    for _ in range(100):
        entries, cursor = src.export(cursor, 7)
        assert len(entries) <= 7
        dst.import_(entries)
        if cursor is None:
            break
    assert export_all(dst, 1000) == export_all(src, 1000)
    assert consistent(dst) == consistent(src)
    assert dst.pending(0, BIG, 1000) == src.pending(0, BIG, 1000)
    assert dst.due_failed(BIG, 1000) == src.due_failed(BIG, 1000)
    for t in range(7):
        assert dst.token_status(f"T{t}") == src.token_status(f"T{t}")
    # idempotent: a second import changes nothing
    dst.import_(export_all(src, 13))
    assert consistent(dst) == consistent(src)
    src.close()
    dst.close()


def test_import_overwrites_a_differing_entry(tmp_path: Path) -> None:
    src = LogStore(tmp_path / "a", max_events=10, max_bytes=BIG)
    dst = LogStore(tmp_path / "b", max_events=10, max_bytes=BIG)
    src.append([ev(1)])
    src.fail([(ev(1), "x")], 0, delay)
    dst.append([ev(1)])  # dst still has it transient
    dst.import_(export_all(src, 10))
    assert dst.where(("s", "e1")) == "failed"
    assert consistent(dst) == consistent(src)
    src.close()
    dst.close()


def test_meta_and_reset(tmp_path: Path) -> None:
    s = LogStore(tmp_path / "log", max_events=10, max_bytes=BIG)
    s.append([ev(1)])
    s.put_meta({b"fence": b"F", b"other": b"O"})
    with pytest.raises(ValueError):
        s.put_meta({b"counts": b"x"})
    s.reset({b"fence": b"F"})
    assert s.get_meta(b"fence") == b"F"
    assert s.get_meta(b"other") is None
    assert s.where(("s", "e1")) is None
    assert consistent(s) == {"transient": 0, "failed": 0, "bytes": 0, "tokens": 0}
    s.close()


# ----------------------------------------------------------------------------- property


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("append"),
            st.lists(st.tuples(st.integers(0, 11), st.sampled_from(["", "A", "B"])), max_size=5),
        ),
        st.tuples(st.just("forget"), st.lists(st.integers(0, 11), max_size=5)),
        st.tuples(st.just("fail"), st.lists(st.integers(0, 11), max_size=5)),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_random_operations_keep_counts_equal_to_a_scan_and_a_model(
    program: list[tuple[str, list]],
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        s = LogStore(Path(tmp) / "log", max_events=8, max_bytes=BIG, max_done_tokens=1)
        model: dict[str, tuple[str, int]] = {}  # id -> (where, attempts)
        now = 0
        for op, args in program:
            now += 10
            if op == "append":
                batch = [ev(i, token=t, ms=now) for i, t in args]
                new = {e.id for e in batch} - set(model)
                try:  # every other append as the replica sends it: encoded
                    s.append(encode_batch(batch) if now % 20 else batch)
                except LogFull:
                    assert len(model) + len(new) > 8
                else:
                    assert len(model) + len(new) <= 8
                    model.update({i: ("transient", 0) for i in new})
            elif op == "forget":
                s.forget([_key("s", f"e{i}") for i in args])
                for i in args:
                    model.pop(f"e{i}", None)
            else:
                s.fail([(ev(i, ms=now), "x") for i in args], now, delay)
                for i in dict.fromkeys(args):
                    if f"e{i}" in model:
                        model[f"e{i}"] = ("failed", model[f"e{i}"][1] + 1)
            counts = consistent(s)
            assert counts["transient"] == sum(1 for w, _ in model.values() if w == "transient")
            assert counts["failed"] == sum(1 for w, _ in model.values() if w == "failed")
        for id_, (where, attempts) in model.items():
            assert s.where(("s", id_)) == where
            if where == "failed":
                assert s.failed_entry(("s", id_)).attempts == attempts
        counts = consistent(s)
        s.close()
        reopened = LogStore(Path(tmp) / "log", max_events=8, max_bytes=BIG, max_done_tokens=1)
        assert consistent(reopened) == counts
        reopened.close()


# ----------------------------------------------------------------------------- LogWriter


def test_writer_answers_logfull_and_lives_on(tmp_path: Path) -> None:
    client = WriterClient(tmp_path / "log", {"max_events": 1, "max_bytes": BIG})
    try:
        ref = client.current(5.0)
        client.call("append", [ev(1)])
        with pytest.raises(LogFull):
            client.call("append", [ev(2)])
        assert client.current(5.0) is ref and ref.is_alive()
        with pytest.raises(ValueError):
            ref.ask(WriterOp("close"), timeout=5)
    finally:
        client.stop()


def test_writer_crash_is_restarted_and_the_store_reopened(tmp_path: Path) -> None:
    client = WriterClient(tmp_path / "log", {"max_events": 100, "max_bytes": BIG})
    try:
        first = client.current(5.0)
        client.call("append", [ev(1), ev(2)])
        first.tell(_Crash("test"))
        wait_until(lambda: not first.is_alive(), 5, what="writer stopped")
        second = client.current(10.0)  # waits for the supervisor's restart
        assert second is not first
        assert client.call("counts")["transient"] == 2
        assert client.call("append", [ev(3)]) == 1
        status = client.supervisor.proxy().status().get(timeout=5)
        assert status["children"]["writer"]["restarts"] == 1
    finally:
        client.stop()
    assert not client.supervisor.is_alive()


def test_writer_call_on_a_dead_ref_retries_on_the_new_one(tmp_path: Path) -> None:
    client = WriterClient(tmp_path / "log", {"max_events": 100, "max_bytes": BIG})
    try:
        first = client.current(5.0)
        first.stop(block=True)  # a NORMAL exit of a permanent child: restarted too
        with pytest.raises(pykka.ActorDeadError):
            first.ask(WriterOp("counts"), timeout=1)
        assert client.call("append", [ev(1)]) == 1
    finally:
        client.stop()


def test_a_store_error_crashes_the_writer_which_reopens_the_store(tmp_path: Path) -> None:
    client = WriterClient(tmp_path / "log", {"max_events": 100, "max_bytes": BIG})
    try:
        first = client.current(5.0)
        client.call("append", [ev(1)])
        first._actor_weakref().store.close()  # the store breaks under the writer
        with pytest.raises(CheckpointError):
            first.ask(WriterOp("append", ([ev(2)],)), timeout=5)
        wait_until(lambda: not first.is_alive(), 5, what="writer crashed")
        assert client.call("append", [ev(2)]) == 1  # a new writer on the reopened store
        assert client.call("counts")["transient"] == 2
    finally:
        client.stop()


def test_writer_crash_loop_escalates_and_calls_fail_fast(tmp_path: Path) -> None:
    reasons: list[str] = []
    client = WriterClient(
        tmp_path / "log",
        {"max_events": 100, "max_bytes": BIG},
        label="lg-0",
        on_escalate=reasons.append,
        intensity=Intensity(0, 10.0),
    )
    try:
        client.current(5.0).tell(_Crash("test"))
        wait_until(lambda: reasons, 5, what="escalation")
        with pytest.raises(LogUnavailable) as err:
            client.call("counts", timeout=2.0)
        assert err.value.replica == "lg-0"
    finally:
        client.stop()


# ----------------------------------------------------------------------------- inspect


def test_inspect_reports_counts_and_locked_stores(tmp_path: Path) -> None:
    assert inspect(tmp_path) == []
    a = LogStore(tmp_path / "logger" / "lg-0", max_events=10, max_bytes=BIG)
    a.append([ev(1), ev(2)])
    a.fail([(ev(2), "x")], 0, delay)
    a.close()
    running = LogStore(tmp_path / "logger" / "lg-1", max_events=10, max_bytes=BIG)
    try:
        rows = {r["replica"]: r for r in inspect(tmp_path)}
        assert rows["lg-1"]["state"] == "locked (running)"
        assert rows["lg-0"]["state"] == "ok"
        assert (rows["lg-0"]["transient"], rows["lg-0"]["failed"]) == (1, 1)
        assert rows["lg-0"]["bytes"] == 2 * len(encode_event(ev(1)))
        assert rows["lg-0"]["epoch"] == 0 and rows["lg-0"]["catching_up"] is False
    finally:
        running.close()
    # inspect released its handle: the store opens again
    CheckpointStore(tmp_path / "logger" / "lg-0").close()


def test_settle_parked_without_a_time_uses_the_clock(tmp_path: Path) -> None:
    """`tierflow logger settle` passes no time: "retry" makes the entries due now."""
    for i in range(2):
        s = LogStore(tmp_path / "logger" / f"lg-{i}", max_events=10, max_bytes=BIG)
        s.append([ev(1), ev(2)])
        s.fail([(ev(1), "parked: test")], 0, lambda n: PARKED_MS)
        s.close()
    before = now_ms()
    assert settle_parked(tmp_path, "lg", "retry", [("s", "e1")]) == {"lg-0": 1, "lg-1": 1}
    after = now_ms()
    for i in range(2):
        s = LogStore(tmp_path / "logger" / f"lg-{i}", max_events=10, max_bytes=BIG)
        try:
            fe = s.failed_entry(("s", "e1"))
            assert fe is not None and before <= fe.next_retry_ms <= after
            assert s.parked_count() == 0 and s.where(("s", "e2")) == "transient"
        finally:
            s.close()


def test_settle_parked_without_keys_settles_every_parked_entry(tmp_path: Path) -> None:
    """`tierflow logger settle GROUP --forget` with no keys: whatever any replica parked."""
    for i in range(2):
        s = LogStore(tmp_path / "logger" / f"lg-{i}", max_events=10, max_bytes=BIG)
        s.append([ev(1), ev(2), ev(3)])
        s.fail([(ev(i + 1), "parked: test")], 0, lambda n: PARKED_MS)  # lg-0: e1, lg-1: e2
        s.fail([(ev(3), "timeout")], 0, delay)  # failed, not parked: left alone
        s.close()
    assert settle_parked(tmp_path, "lg", "forget", now_ms=5) == {"lg-0": 1, "lg-1": 1}
    for i in range(2):
        s = LogStore(tmp_path / "logger" / f"lg-{i}", max_events=10, max_bytes=BIG)
        try:
            assert s.parked_count() == 0 and s.where(("s", f"e{i + 1}")) is None
            assert s.where(("s", "e3")) == "failed"
        finally:
            s.close()


@pytest.mark.unit
def test_forget_wire_round_trip() -> None:
    """A forget crosses Ray as one blob: keys in order, and only the known sequences."""
    from actors.queue.logger.records import _enc, _split_key, decode_forget, encode_forget

    keys = [("s", "a"), ("s", "b\x00c"), ("t", "a"), ("s", "é ")]
    seqs = {("s", "a"): ("S", 7), ("t", "a"): None, ("s", "é "): ("S", 2**40)}
    stored = [_key(*k) for k in keys]  # keys travel as the store's own keys
    assert decode_forget(encode_forget(keys, seqs)) == (
        stored,
        {_key("s", "a"): ("S", 7), _key("s", "é "): ("S", 2**40)},
    )
    assert decode_forget(encode_forget(keys, None)) == (stored, {})
    assert [_split_key(k) for k in stored] == keys
    # a blob of the earlier form, keys as (stream, id) pairs, is still read: as storage keys
    earlier = _enc.encode(([list(k) for k in keys], [("s", "a", "S", 7)]))
    assert decode_forget(earlier) == (stored, {_key("s", "a"): ("S", 7)})
    with pytest.raises(TypeError, match="stream, id"):
        encode_forget(["a"], None)  # type: ignore[list-item]


@pytest.mark.unit
def test_an_append_batch_is_cut_into_parts_ray_sends_inline() -> None:
    """Every part under the per-argument inline limit, joined back byte for byte; a small
    batch, or one past a call's inline bytes, stays one part (put in the object store)."""
    from runtime.inline import INLINE_CALL_BYTES, INLINE_PART_BYTES, inline_parts

    pad = b'{"pad": "%s"}' % (b"x" * 1000)
    blob = encode_batch([Event(f"e{i}", "s", "s.raw", pad, 1) for i in range(500)])
    parts = inline_parts(blob)
    assert len(parts) == -(-len(blob) // INLINE_PART_BYTES) > 1
    assert all(len(p) <= INLINE_PART_BYTES for p in parts) and b"".join(parts) == blob
    assert inline_parts(b"small") == (b"small",)
    assert inline_parts(blob[:INLINE_PART_BYTES]) == (blob[:INLINE_PART_BYTES],)
    huge = b"x" * (INLINE_CALL_BYTES + 1)
    assert inline_parts(huge) == (huge,)
