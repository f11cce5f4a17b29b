"""Windows: the pure references as oracles, then real Spark on deterministic event time.

Streaming tests read one JSON-lines file per micro-batch (file source, maxFilesPerTrigger=1,
trigger availableNow) and collect each batch's output with foreachBatch, so *when* a
window fires is observable, not only what it contains.
"""

from __future__ import annotations

import json
import random
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.windows import LateEventCounter, count_windows, late_count, time_windows
from runtime.waiting import poll
from tests.oracles import (
    WindowResult,
    late_reference,
    sliding_reference,
    tumbling_count_reference,
    tumbling_time_reference,
)
from tests.support import run_stream, write_batches

T0 = 1_700_000_000_000  # ms since the epoch, a multiple of every window length used here
SEC = 1000

# --------------------------------------------------------------------------- references


@pytest.mark.unit
def test_book_sliding_2s_every_1s() -> None:
    events = [(T0 + 500, "a"), (T0 + 1500, "b"), (T0 + 2500, "c"), (T0 + 3200, "d")]
    got = sliding_reference(events, 2 * SEC, 1 * SEC)
    assert got == [
        WindowResult(T0 - SEC, T0 + SEC, ("a",)),
        WindowResult(T0, T0 + 2 * SEC, ("a", "b")),
        WindowResult(T0 + SEC, T0 + 3 * SEC, ("b", "c")),
        WindowResult(T0 + 2 * SEC, T0 + 4 * SEC, ("c", "d")),
        WindowResult(T0 + 3 * SEC, T0 + 5 * SEC, ("d",)),
    ]
    ends = [w.end_ms for w in got]
    assert all(b - a == SEC for a, b in zip(ends, ends[1:], strict=False))  # fires every 1 s


@pytest.mark.unit
def test_book_tumbling_by_time_whatever_the_count() -> None:
    events = [(T0 + t, t) for t in (0, 100, 1999, 2000, 5999)]
    assert tumbling_time_reference(events, 2 * SEC) == [
        WindowResult(T0, T0 + 2 * SEC, (0, 100, 1999)),
        WindowResult(T0 + 2 * SEC, T0 + 4 * SEC, (2000,)),
        WindowResult(T0 + 4 * SEC, T0 + 6 * SEC, (5999,)),
    ]


@pytest.mark.unit
def test_book_tumbling_by_count_whatever_the_time() -> None:
    batches = [[("k", T0, "a")], [("k", T0 + 3_600 * SEC, "b"), ("k", T0 + 3_601 * SEC, "c")]]
    assert tumbling_count_reference(batches, 2) == [("k", 0, T0, T0 + 3_600 * SEC, ("a", "b"))]


timed = st.lists(st.tuples(st.integers(0, 20 * SEC), st.integers(0, 9)), max_size=60)


@pytest.mark.unit
@settings(max_examples=80, deadline=None)
@given(timed, st.sampled_from([(2, 1), (3, 1), (4, 2), (2, 2)]))
def test_sliding_reference_puts_each_event_in_length_over_slide_windows(
    events: list[tuple[int, int]], ls: tuple[int, int]
) -> None:
    length, slide = ls[0] * SEC, ls[1] * SEC
    wins = sliding_reference([(T0 + t, v) for t, v in events], length, slide)
    assert sum(len(w.values) for w in wins) == len(events) * (length // slide)
    for w in wins:
        assert w.end_ms - w.start_ms == length and w.start_ms % slide == 0 and w.values
        inside = sorted((T0 + t, v) for t, v in events if w.start_ms <= T0 + t < w.end_ms)
        assert w.values == tuple(v for _, v in inside)


@pytest.mark.unit
@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.lists(
            st.tuples(st.sampled_from("abc"), st.integers(0, 10**6), st.integers(0, 99)),
            max_size=8,
        ),
        max_size=6,
    ),
    st.integers(1, 4),
)
def test_count_reference_emits_every_n_and_buffers_the_rest(batches: list, n: int) -> None:
    out = tumbling_count_reference(batches, n)
    per_key: dict[str, list] = defaultdict(list)
    for b in batches:
        by_key: dict[str, list] = defaultdict(list)
        for k, t, v in b:
            by_key[k].append((t, v))
        for k, evs in by_key.items():
            per_key[k].extend(sorted(evs))
    for k, evs in per_key.items():
        wins = [w for w in out if w[0] == k]
        assert [w[1] for w in wins] == list(range(len(evs) // n))
        assert all(len(w[4]) == n for w in wins)
        assert [v for w in wins for v in w[4]] == [v for _, v in evs[: len(wins) * n]]


@pytest.mark.unit
def test_late_reference_lags_one_batch_like_spark() -> None:
    batches = [
        [("a", 0), ("b", 10_000)],
        [("c", 1_000)],
        [("d", 7_000), ("e", 8_000), ("b", 9_500)],
    ]
    kept, late = late_reference(batches, 2 * SEC)
    # Batch 1 filters with batch 0's watermark (still the epoch): "c" is kept.
    # Batch 2 filters with 10 s - 2 s = 8 s: "d" and "e" (<= 8 s) are late; "b" is a duplicate.
    assert kept == [[("a", 0), ("b", 10_000)], [("c", 1_000)], []]
    assert late == [("d", 7_000), ("e", 8_000)]


# --------------------------------------------------------------------------- Spark helpers


EVENT_SCHEMA = "id string, k string, v string, ms long"


def event_stream(spark: Any, src: str) -> Any:
    from pyspark.sql import functions as F

    raw = spark.readStream.schema(EVENT_SCHEMA).option("maxFilesPerTrigger", 1).json(src)
    return raw.withColumn("t", F.timestamp_millis("ms"))


def ev(ms: int, v: str, k: str = "k", id_: str | None = None) -> dict:
    return {"id": id_ or v, "k": k, "v": v, "ms": T0 + ms}


def ms(ts: Any) -> int:
    return int(ts.timestamp() * 1000)


def values_agg() -> Any:
    """A window's values in (time, value) order, the references' order."""
    from pyspark.sql import functions as F

    ordered = F.array_sort(F.collect_list(F.struct("ms", "v")))
    return F.transform(ordered, lambda e: e["v"]).alias("values")


def as_results(rows: list) -> list[WindowResult]:
    return sorted(
        WindowResult(ms(r.window_start), ms(r.window_end), tuple(r["values"])) for r in rows
    )


@pytest.fixture(scope="module")
def sp(spark: Any) -> Any:
    """The shared session with 2 shuffle partitions (state stores cost per partition)."""
    old = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", "2")
    yield spark
    spark.conf.set("spark.sql.shuffle.partitions", old)


# --------------------------------------------------------------------------- time windows


def test_static_time_windows_match_the_references(sp: Any) -> None:
    from pyspark.sql import functions as F

    rng = random.Random(7)
    rows = [(T0 + rng.randrange(0, 12 * SEC), f"e{i:03d}", "ab"[i % 2]) for i in range(120)]
    df = sp.createDataFrame(rows, "ms long, v string, k string")
    df = df.withColumn("t", F.timestamp_millis("ms"))
    events = [(t, v) for t, v, _ in rows]
    sliding = time_windows(df, "t", "2 seconds", "1 second", aggs=[values_agg()]).collect()
    assert as_results(sliding) == sliding_reference(events, 2 * SEC, SEC)
    keyed = time_windows(df, "t", "2 seconds", keys=["k"], aggs=[values_agg()]).collect()
    for key in "ab":
        mine = [r for r in keyed if r.k == key]
        ref = tumbling_time_reference([(t, v) for t, v, k in rows if k == key], 2 * SEC)
        assert as_results(mine) == ref
        assert all(r.events == len(r["values"]) for r in mine)
        assert len({r.events for r in mine}) > 1  # windows close whatever their count


def test_sliding_2s_1s_fires_each_window_when_the_watermark_passes_its_end(
    sp: Any, tmp_path: Path
) -> None:
    # One event per batch, 0.5 s apart; a zero delay makes the watermark the max time seen.
    times = [300, 800, 1300, 1800, 2300, 2800, 3300, 3800, 4300]
    batches = [[ev(t, f"e{t}")] for t in times]
    src = write_batches(tmp_path / "src", batches)
    df = time_windows(
        event_stream(sp, src),
        "t",
        "2 seconds",
        "1 second",
        watermark="0 seconds",
        id_col="id",
        aggs=[values_agg()],
    )
    emitted, q = run_stream(df, tmp_path / "ck", "append")
    watermark = {p["batchId"]: ms_from_iso(p["eventTime"]["watermark"]) for p in q.recentProgress}
    final = max(watermark.values())
    fired = {w: b for b, rows in emitted for w in as_results(rows)}
    expected = [
        w
        for w in sliding_reference([(T0 + t, f"e{t}") for t in times], 2 * SEC, SEC)
        if w.end_ms <= final
    ]
    assert sorted(fired) == expected
    ends = [w.end_ms for w in expected]
    assert ends == list(range(ends[0], ends[-1] + 1, SEC))  # one window closes every second
    for w, batch in fired.items():  # fired in the first batch whose watermark reached its end
        assert batch == min(b for b, wm in watermark.items() if wm >= w.end_ms)
    assert late_count(q.recentProgress) == 0


def ms_from_iso(s: str) -> int:
    from datetime import datetime

    return int(datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp() * 1000)


def test_tumbling_2s_drops_and_counts_late_events_and_duplicates(sp: Any, tmp_path: Path) -> None:
    batches = [
        [ev(0, "a"), ev(700, "b"), ev(1500, "c"), ev(10_000, "d")],
        [ev(2100, "e"), ev(10_500, "f")],  # filtered by batch 0's watermark (epoch): kept
        [ev(100, "late1"), ev(5000, "late2"), ev(8_000, "late3"), ev(11_000, "g")],
        [ev(10_500, "f"), ev(11_900, "h"), ev(12_100, "i")],  # "f" again: a redelivery
        [ev(30_000, "j"), ev(1_000, "late4")],
    ]
    src = write_batches(tmp_path / "src", batches)
    counter = LateEventCounter()
    sp.streams.addListener(counter)
    try:
        df = time_windows(
            event_stream(sp, src),
            "t",
            "2 seconds",
            watermark="2 seconds",
            id_col="id",
            aggs=[values_agg()],
        )
        emitted, q = run_stream(df, tmp_path / "ck", "append")
        kept, late = late_reference([[(e["v"], e["ms"] - T0) for e in b] for b in batches], 2 * SEC)
        assert sorted(v for v, _ in late) == ["late1", "late2", "late3", "late4"]
        assert late_count(q.recentProgress) == len(late) == 4
        n_batches = len(q.recentProgress)
        assert poll(lambda: counter.batches(q.id) >= n_batches, timeout=30)
        assert counter.count(q.id) == 4
        assert hasattr(counter, "_jlistenerobj")  # registered through its JSON callback
    finally:
        sp.streams.removeListener(counter)
    final = max(ms_from_iso(p["eventTime"]["watermark"]) for p in q.recentProgress)
    got = sorted(w for _, rows in emitted for w in as_results(rows))
    kept_events = sorted((T0 + t, v) for b in kept for v, t in b)
    assert got == [w for w in tumbling_time_reference(kept_events, 2 * SEC) if w.end_ms <= final]
    assert Counter(len(w.values) for w in got) == Counter({3: 1, 1: 2, 4: 1})  # any count
    assert len(got) == len(set(got))  # append mode: each window fires once


# --------------------------------------------------------------------------- count windows


def test_count_tumbling_n2_fires_every_2_events_whatever_the_elapsed_time(
    sp: Any, tmp_path: Path
) -> None:
    hour = 3_600 * SEC
    batches = [
        [ev(0, "a1", "a"), ev(1, "b1", "b")],
        [ev(hour, "a2", "a")],  # an hour later: completes a's first window
        [ev(hour + 1, "a3", "a"), ev(hour + 2, "a4", "a"), ev(hour + 3, "a5", "a")],
        [ev(5 * hour, "b2", "b"), ev(5 * hour + 1, "c1", "c")],
    ]
    src = write_batches(tmp_path / "src", batches)
    df = count_windows(event_stream(sp, src), "k", "t", 2, "v", order_col="id")
    emitted, _ = run_stream(df, tmp_path / "ck", "append")
    got = sorted(
        (r.k, r.seq, ms(r.first_time), ms(r.last_time), tuple(r["values"]))
        for _, rows in emitted
        for r in rows
    )
    ref = tumbling_count_reference([[(e["k"], e["ms"], e["v"]) for e in b] for b in batches], 2)
    assert got == sorted(ref)
    assert [w[4] for w in sorted(ref)] == [("a1", "a2"), ("a3", "a4"), ("b1", "b2")]
    fired_in = {(r.k, r.seq): b for b, rows in emitted for r in rows}
    assert fired_in[("a", 0)] == 1 and fired_in[("a", 1)] == 2 and fired_in[("b", 0)] == 3
    # a5 and c1 wait in state for their partner: nothing else was emitted.
    assert sum(len(rows) for _, rows in emitted) == 3


class _Progress:
    def __init__(self, text: str) -> None:
        self.text = text

    def json(self) -> str:
        return self.text


class _Event:
    def __init__(self, text: str) -> None:
        self._progress = _Progress(text)

    def progress(self) -> _Progress:
        return self._progress


def test_late_events_are_counted_from_a_progress_json() -> None:
    from jobs.windows import LATE_OPERATOR, _ProgressJson

    counter = LateEventCounter()
    ops = [
        {"operatorName": LATE_OPERATOR, "numRowsDroppedByWatermark": 3},
        {"operatorName": "stateStoreSave", "numRowsDroppedByWatermark": 7},  # not events
    ]
    callback = _ProgressJson(counter)
    callback.onQueryProgress(_Event(json.dumps({"id": "q1", "stateOperators": ops})))
    callback.onQueryProgress(_Event(json.dumps({"id": "q1", "stateOperators": ops[:1]})))
    callback.onQueryProgress(_Event(json.dumps({"id": "q2", "stateOperators": []})))
    assert (counter.count("q1"), counter.batches("q1")) == (6, 2)
    assert (counter.count("q2"), counter.batches("q2")) == (0, 1)
