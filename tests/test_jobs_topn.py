"""Top-N on Spark's native state (jobs/topn.py): exact against a plain-Python recount after
every micro-batch (all time and windowed, with ties), the same results when a batch is
replayed after a crash between publish and commit, and counts that continue exactly after
a restart from the checkpoint.

The Spark tests read JSON-lines files (one file a micro-batch) and shape each batch with
the plan's own driver side (`Plan.batch_rows`), recording what would be published: the
sink's idempotence is tested in test_sink.py and test_jobs_library.py.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs.event_time import iso_ms
from jobs.paths import extract_values
from jobs.plans import build_plan
from jobs.topn import (
    COUNT,
    END,
    ITEM,
    START,
    STATE_DIR,
    PaneGeometry,
    TopState,
    TopStore,
    WindowTop,
    apply_batch,
    apply_panes,
    merge_top,
    pane_ms,
    rank,
)
from runtime.errors import JobError
from runtime.job_specs import JobSpec, decode_spec
from tests.oracles import sliding_reference

pytestmark = pytest.mark.timeout(300)

T0 = 1_700_000_000_000
ITEMS = [f"i{k:02d}" for k in range(12)]


def recount(item_lists: list[list[str]], n: int) -> list[tuple[str, int]]:
    counts = Counter(i for items in item_lists for i in items)
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


def as_top(ranked: list[tuple[str, int]]) -> list[dict[str, Any]]:
    return [{"item": i, "count": c, "error": 0} for i, c in ranked]


# --------------------------------------------------------------------------- pure


batches_of_items = st.lists(
    st.lists(st.lists(st.sampled_from(ITEMS[:6]), max_size=4), max_size=8), max_size=12
)


@pytest.mark.unit
@settings(max_examples=150, deadline=None)
@given(batches_of_items, st.integers(1, 8))
def test_merging_batch_totals_equals_a_recount(batches: list[list[list[str]]], n: int) -> None:
    """Each batch hands over the running totals of the items it touched (what Spark's update
    mode emits); the merged top list equals a recount of everything so far, ties by item."""
    totals: Counter[str] = Counter()
    state, seen, events = TopState(), [], 0
    for b, batch in enumerate(batches):
        touched: set[str] = set()
        for items in batch:
            totals.update(items)
            touched.update(items)
        events += len(batch)
        rows = [{ITEM: i, COUNT: totals[i]} for i in sorted(touched)]
        rows += [{ITEM: None, COUNT: events}] if batch else []
        seen += batch
        state, out = apply_batch(state, rows, b, n, None)
        assert state.top == recount(seen, n)
        if batch:
            assert out == {None: (recount(seen, n), events)}
        else:
            assert out == {}
        again, out2 = apply_batch(state, rows, b, n, None)  # the same totals merged twice
        assert again.top == state.top and (not batch or out2 == out)


@pytest.mark.unit
def test_rank_breaks_ties_by_item_and_merge_keeps_grown_counts() -> None:
    assert rank([("b", 2), ("a", 2), ("c", 3)], 2) == [("c", 3), ("a", 2)]
    assert merge_top([("c", 3), ("a", 2)], {"b": 2, "a": 4}, 3) == [("a", 4), ("c", 3), ("b", 2)]


@pytest.mark.unit
def test_windows_are_merged_apart_and_forgotten_past_the_watermark() -> None:
    rows = [
        {START: 0, END: 20, ITEM: "x", COUNT: 2},
        {START: 0, END: 20, ITEM: None, COUNT: 2},
        {START: 10, END: 30, ITEM: None, COUNT: 1},  # a window with events but no items
    ]
    state, out = apply_batch(TopState(), rows, 0, 3, delay_ms=5)
    assert out[0].top == [("x", 2)] and out[10].top == [] and state.newest_start == 10
    later = [{START: 40, END: 60, ITEM: "y", COUNT: 1}]
    state, out = apply_batch(state, later, 1, 3, delay_ms=5)
    # newest start 40 - delay 5 = 35: windows ending at 20 and 30 can get no event any more
    assert set(out) == {40} and set(state.windows) == {40}


def _windows_of(t: int, g: PaneGeometry) -> list[int]:
    """Starts s (multiples of slide) with s <= t < s + length: where Spark counts t."""
    first = (t - g.length_ms) - (t - g.length_ms) % g.slide_ms
    return [s for s in range(first, t + 1, g.slide_ms) if s <= t < s + g.length_ms]


timed_batches = st.lists(
    st.lists(
        st.tuples(st.integers(0, 400), st.lists(st.sampled_from(ITEMS[:5]), max_size=3)),
        max_size=10,
    ),
    max_size=10,
)


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(
    timed_batches,
    st.sampled_from([(20, 10), (30, 10), (30, 20), (50, 20), (60, 15)]),
    st.integers(1, 4),
    st.sampled_from([5, 30, 1000]),
)
def test_windows_summed_from_panes_equal_windows_counted_apart(
    batches: list[list[tuple[int, list[str]]]],
    length_slide: tuple[int, int],
    n: int,
    delay_s: int,
) -> None:
    """What Spark emits in update mode, counted per window (each event in every window it
    falls in) and per pane, gives the same top lists, keys and state after every batch,
    with late events dropped as Spark does (at or before the previous batch's watermark)."""
    length, slide = (x * 1000 for x in length_slide)
    g = PaneGeometry(length, slide, math.gcd(length, slide))
    delay = delay_s * 1000
    per_window: Counter[tuple[int, str | None]] = Counter()
    per_pane: Counter[tuple[int, str | None]] = Counter()
    by_window, by_pane = TopState(), TopState()
    watermark, newest_t = None, None
    for b, batch in enumerate(batches):
        w_keys: set[tuple[int, str | None]] = set()
        p_keys: set[tuple[int, str | None]] = set()
        for t_s, items in batch:
            t = T0 + t_s * 250
            if watermark is not None and t <= watermark:
                continue  # late
            newest_t = t if newest_t is None else max(newest_t, t)
            pane = t - t % g.pane_ms
            for item in [None, *items]:
                per_pane[pane, item] += 1
                p_keys.add((pane, item))
                for s in _windows_of(t, g):
                    per_window[s, item] += 1
                    w_keys.add((s, item))
        w_rows = [{START: s, END: s + length, ITEM: i, COUNT: per_window[s, i]} for s, i in w_keys]
        p_rows = [{START: p, ITEM: i, COUNT: per_pane[p, i]} for p, i in p_keys]
        by_window, want = apply_batch(by_window, w_rows, b, n, delay)
        by_pane, got = apply_panes(by_pane, p_rows, b, n, delay, g)
        assert list(got) == list(want)
        assert got == want and by_pane.windows == by_window.windows
        assert by_pane.newest_start == by_window.newest_start
        if newest_t is not None:
            watermark = newest_t - delay


@pytest.mark.unit
def test_a_window_checkpoint_is_refused_by_the_pane_form() -> None:
    g = PaneGeometry(20_000, 10_000, 10_000)
    old = TopState(batch=4, windows={0: WindowTop(20_000, [("x", 2)])}, newest_start=0)
    with pytest.raises(JobError, match="another version of this job"):
        apply_panes(old, [], 5, 3, 5_000, g)
    state, _ = apply_panes(TopState(), [{START: 0, ITEM: "x", COUNT: 1}], 0, 3, 5_000, g)
    assert state.pane_ms == 10_000 and state.panes == {0: {"x": 1}}


@pytest.mark.unit
def test_a_batch_starts_from_the_state_saved_before_it(tmp_path: Path) -> None:
    store = TopStore(tmp_path / "s", keep=3)
    for b in range(6):
        store.save(TopState(batch=b, events=b * 10))
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["3.json", "4.json", "5.json"]
    fresh = TopStore(tmp_path / "s")  # a restarted driver
    assert fresh.before(5).events == 40  # batch 5 replayed: starts where it first started
    assert fresh.before(6).events == 50
    assert TopStore(tmp_path / "new").before(0) == TopState()
    with pytest.raises(JobError, match="no saved top list"):
        TopStore(tmp_path / "new").before(3)


# --------------------------------------------------------------------------- Spark


def event_items(i: int, rng: random.Random) -> list[str]:
    """0-3 items of a small alphabet: many ties in the counts."""
    return [rng.choice(ITEMS) for _ in range(rng.randint(0, 3))]


def make_events(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        items = event_items(i, rng)
        jitter = rng.randint(-3000, 0)  # out of order, but well within the watermark
        out.append({"tags": [{"name": t} for t in items], "t": T0 + i * 700 + jitter})
    return out


def write_files(directory: Path, batches: list[list[dict[str, Any]]], first: int = 0) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    base = time.time() - 10_000
    for i, events in enumerate(batches, start=first):
        path = directory / f"b-{i:04d}.json"
        path.write_text("".join(json.dumps(e) + "\n" for e in events))
        os.utime(path, (base + i, base + i))


class Crash(RuntimeError):
    pass


def run(
    spark: Any, spec: JobSpec, src: Path, ckpt: Path, fail_at: int | None = None
) -> tuple[dict[int, list[dict[str, Any]]], Exception | None]:
    """Run to the end of `src` (a file a batch); the shaped rows of every batch by id, and
    the error the query died of.
    With `fail_at`, that batch is shaped (its results would be published), then the
    query dies before Spark commits it."""
    source = (
        spark.readStream.option("maxFilesPerTrigger", 1)
        .text(str(src))
        .withColumnRenamed("value", "data")
    )
    plan = build_plan(spec, source)
    shape = plan.batch_rows(ckpt)
    published: dict[int, list[dict[str, Any]]] = {}

    def write(df: Any, batch_id: int) -> None:
        published[batch_id] = shape([r.asDict() for r in df.collect()], batch_id)
        if batch_id == fail_at:
            raise Crash(f"killed between publish and commit of batch {batch_id}")

    q = (
        plan.df.writeStream.foreachBatch(write)
        .outputMode(plan.output_mode)
        .option("checkpointLocation", str(ckpt))
        .trigger(availableNow=True)
        .start()
    )
    try:
        finished = q.awaitTermination(180)
    except Exception as err:  # the query died: Spark raises its error here
        return published, err
    assert finished, "the query did not finish"
    return published, q.exception()


def windows_of(events: list[dict[str, Any]]) -> set[int]:
    """Starts of the 20 s windows sliding every 10 s that hold one of `events`."""
    return {w.start_ms for w in sliding_reference([(e["t"], 0) for e in events], 20_000, 10_000)}


def spec_of(**kw: Any) -> JobSpec:
    return decode_spec({"name": "t", "kind": "topn", "stream": "s", "field": "tags[].name", **kw})


def test_extract_values_flattens_every_array_without_exploding(spark: Any) -> None:
    rows = [
        (json.dumps({"a": [{"b": [{"c": 1}, {"c": "x"}]}, {"b": None}, {"b": [{"c": None}]}]}),),
        (json.dumps({"a": []}),),
        (json.dumps({"z": 1}),),
        ("not json",),
    ]
    from pyspark.sql import functions as F

    df = spark.createDataFrame(rows, "data string").withColumn("subject", F.lit("raw.s"))
    got = extract_values(df, "v", "a[].b[].c").select("v").collect()
    assert [r.v for r in got] == [["1", "x"], [], [], []]  # one row per event, nulls dropped
    one = extract_values(df, "v", "z").select("v").collect()
    assert [r.v for r in one] == [[], [], ["1"], []]
    pseudo = extract_values(df, "v", "_subject").select("v").collect()
    assert [r.v for r in pseudo] == [["raw.s"]] * 4


def test_all_time_top_n_equals_a_recount_after_every_batch(spark: Any, tmp_path: Path) -> None:
    events = make_events(600, seed=3)
    batches = [events[i : i + 50] for i in range(0, 600, 50)]
    write_files(tmp_path / "src", batches)
    spec = spec_of(n=5, capacity=4)  # fewer counters than items: counts stay exact
    published, err = run(spark, spec, tmp_path / "src", tmp_path / "ck")
    assert err is None
    assert sorted(published) == list(range(len(batches)))
    for b in range(len(batches)):
        so_far = [[t["name"] for t in e["tags"]] for batch in batches[: b + 1] for e in batch]
        want = {"key": "all", "top": as_top(recount(so_far, 5)), "events": len(so_far)}
        assert published[b] == [want], b


def test_windowed_top_n_equals_a_recount_per_window(spark: Any, tmp_path: Path) -> None:
    events = make_events(400, seed=5)
    batches = [events[i : i + 40] for i in range(0, 400, 40)]
    write_files(tmp_path / "src", batches)
    window = {"length": "20s", "slide": "10s", "watermark": "10s"}
    spec = spec_of(n=3, window=window, time_field="t")
    published, err = run(spark, spec, tmp_path / "src", tmp_path / "ck")
    assert err is None
    latest: dict[str, dict[str, Any]] = {}
    for b in sorted(published):
        so_far = [e for batch in batches[: b + 1] for e in batch]
        touched = (
            {
                w.start_ms
                for e in batches[b]
                for w in sliding_reference([(e["t"], 0)], 20_000, 10_000)
            }
            if b < len(batches)
            else set()
        )
        keys = {r["key"] for r in published[b]}
        assert keys == {iso_ms(s) for s in touched}, b  # exactly the windows the batch reached
        for row in published[b]:
            start = next(s for s in touched if iso_ms(s) == row["key"])
            inside = [
                [t["name"] for t in e["tags"]] for e in so_far if start <= e["t"] < start + 20_000
            ]
            assert row == {
                "key": iso_ms(start),
                "window_start": iso_ms(start),
                "window_end": iso_ms(start + 20_000),
                "top": as_top(recount(inside, 3)),
            }
            latest[row["key"]] = row
    assert len(latest) == len(
        {w.start_ms for e in events for w in sliding_reference([(e["t"], 0)], 20_000, 10_000)}
    )
    saved = msgspec.json.decode(
        max((tmp_path / "ck" / STATE_DIR).glob("*.json"), key=lambda p: int(p.stem)).read_bytes(),
        type=TopState,
    )
    assert saved.newest_start is not None and saved.windows
    assert all(w.end > saved.newest_start - 10_000 for w in saved.windows.values())
    assert len(saved.windows) < len(latest)  # closed windows were forgotten


def test_sliding_windows_from_panes_equal_sparks_own_window_counts(
    spark: Any, tmp_path: Path
) -> None:
    """The streaming form counts per pane (gcd of 30 s and 20 s: 10 s) in Spark's state;
    after every micro-batch, each window it publishes has the top list of Spark's own
    per-window counts (`window()`, a batch over the files read so far)."""
    events = make_events(300, seed=11)
    batches = [events[i : i + 30] for i in range(0, 300, 30)]
    src = tmp_path / "src"
    write_files(src, batches)
    window = {"length": "30s", "slide": "20s", "watermark": "10s"}
    spec = spec_of(n=3, window=window, time_field="t")
    source = spark.readStream.option("maxFilesPerTrigger", 1).text(str(src))
    plan = build_plan(spec, source.withColumnRenamed("value", "data"))
    assert pane_ms(spec, True) == 10_000 and pane_ms(spec, False) is None
    shape = plan.batch_rows(tmp_path / "ck")
    published: dict[int, list[dict[str, Any]]] = {}
    panes: set[int] = set()

    def write(df: Any, batch_id: int) -> None:
        rows = [r.asDict() for r in df.collect()]
        panes.update(int(r[START]) for r in rows)
        published[batch_id] = shape(rows, batch_id)

    q = (
        plan.df.writeStream.foreachBatch(write)
        .outputMode(plan.output_mode)
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(availableNow=True)
        .start()
    )
    assert q.awaitTermination(180) and q.exception() is None
    assert panes and all(p % 10_000 == 0 for p in panes)  # Spark's rows were per pane
    assert sorted(published)[: len(batches)] == list(range(len(batches)))  # then no-data ones
    for b in sorted(published):
        static = spark.read.text([str(p) for p in sorted(src.iterdir())[: b + 1]])
        exact = build_plan(spec, static.withColumnRenamed("value", "data")).df.collect()
        counts: dict[int, dict[str, int]] = {}
        for r in exact:  # per window, as `window()` counts: each event in every window
            per_item = counts.setdefault(int(r[START]), {})
            if r[ITEM] is not None:
                per_item[r[ITEM]] = int(r[COUNT])
        assert published[b] or b >= len(batches), b
        for row in published[b]:
            start = next(s for s in counts if iso_ms(s) == row["key"])
            assert row == {
                "key": iso_ms(start),
                "window_start": iso_ms(start),
                "window_end": iso_ms(start + 30_000),
                "top": as_top(rank(counts[start].items(), 3)),
            }, (b, row["key"])


def test_a_replayed_batch_publishes_the_same_and_a_restart_continues_exactly(
    spark: Any, tmp_path: Path
) -> None:
    events = make_events(500, seed=9)
    batches = [events[i : i + 50] for i in range(0, 500, 50)]
    src, ck = tmp_path / "src", tmp_path / "ck"
    write_files(src, batches[:6])
    spec = spec_of(n=4)

    first, err = run(spark, spec, src, ck, fail_at=3)
    assert err is not None and "killed between publish" in str(err)
    assert sorted(first) == [0, 1, 2, 3]

    second, err = run(spark, spec, src, ck)  # Spark replays batch 3 from its checkpoint
    assert err is None
    assert sorted(second) == [3, 4, 5]
    assert second[3] == first[3]  # the same rows, so the same result ids and values

    write_files(src, batches[6:], first=6)
    third, err = run(spark, spec, src, ck)  # a restart over more data
    assert err is None and sorted(third) == [6, 7, 8, 9]
    published = {**first, **second, **third}
    for b in range(len(batches)):
        so_far = [[t["name"] for t in e["tags"]] for batch in batches[: b + 1] for e in batch]
        want = {"key": "all", "top": as_top(recount(so_far, 4)), "events": len(so_far)}
        assert published[b] == [want], b
