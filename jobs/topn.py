"""Top-N on Spark's own state: exact counts per item in Spark, the top list on the driver.

Spark keeps one count per item (per window when windowed) with a plain streaming
``groupBy(item[, window]).count()`` in update mode: no Python per event. Each event also
adds one row whose item is null, so the same aggregation counts the events (an event's
items count once; an event with none still counts). A micro-batch's output is only the
(item, total) rows it updated.

Counts only grow, so the top N after a batch is the top N of (the previous top N together
with the items the batch updated); `merge_top` computes it on the driver, ordered by count
desc, then item asc. Merging is idempotent (the batch's totals merged into a top list that
already holds them give the same list), and the list the driver starts a batch from is the
one saved for the latest earlier batch id (`TopStore`, a small file per batch under the
query's checkpoint). So a micro-batch Spark replays after a crash, whose rows are the same
since Spark restores its state to the previous batch, publishes the same result ids with
the same values.

Windowed: the same per window; the driver forgets a window once no event can reach it
any more (its end at or before the newest window start seen minus the watermark delay:
Spark's watermark is at least that, and events at or before it are dropped as late).

Sliding windows of a streaming query are counted per *pane* (gcd of length and slide) in
Spark's state, not per window: a 5-minute window sliding every 10 s put each event in 30
windows, so 30 state updates per (event, item); per pane it is one (`pane_ms`). The driver
keeps every item's count per pane while a window holding the pane is open, and a window's
total for an item is the sum over its panes (`apply_panes`): the same exact counts, top
lists and result rows as counting per window, with the panes' counts saved with the top
lists. A recompute (a static DataFrame, one batch) still counts per window.
"""

from __future__ import annotations

import contextlib
import heapq
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from jobs.event_time import window_column, windowed_events
from jobs.paths import extract_values
from jobs.sketch_state import pane_windows
from runtime.errors import JobError
from runtime.job_specs import JobSpec, duration_ms
from runtime.state.files import write_atomic

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

ITEM, COUNT, START, END = "_tf_it", "_tf_n", "_tf_start", "_tf_end"
STATE_DIR = "tierflow-topn"
Ranked = list[tuple[str, int]]
BatchRows = Callable[[list[dict[str, Any]], int], list[dict[str, Any]]]


def pane_ms(spec: JobSpec, streaming: bool) -> int | None:
    """The pane a windowed top-N counts by in Spark's state: gcd(length, slide) for sliding
    windows of a streaming query; None to count per window (all time, tumbling windows,
    whose panes are the windows, and a recompute's single batch)."""
    if spec.window is None or not spec.window.slide or not streaming:
        return None
    length, slide = duration_ms(spec.window.length), duration_ms(spec.window.slide)
    return math.gcd(length, slide) if slide < length else None


def topn_counts(spec: JobSpec, events: DataFrame, pane: int | None = None) -> DataFrame:
    """The running counts a top-N job keeps in Spark state, as update-mode rows:
    ``_tf_it`` (null: the per-event row, its count the events so far), ``_tf_n``, and
    ``_tf_start``/``_tf_end`` (epoch ms) when windowed: of the window, or of the pane when
    `pane` (`pane_ms`, the one `topn_batches` sums into windows with `apply_panes`)."""
    from pyspark.sql import functions as F

    if spec.window is not None:
        events = windowed_events(events, spec)
    items = extract_values(events, "_tf_its", spec.field)
    marker = F.array(F.lit(None).cast("string"))
    exploded = F.explode(F.concat(marker, F.col("_tf_its"))).alias(ITEM)
    n = F.count(F.lit(1)).alias(COUNT)
    if spec.window is None:
        return items.select(exploded).groupBy(ITEM).agg(n)
    if pane is not None:
        w = F.window("_tf_time", f"{pane} milliseconds").alias("_tf_w")
    else:
        w = window_column(spec).alias("_tf_w")
    return (
        items.select("_tf_time", exploded)
        .groupBy(w, ITEM)
        .agg(n)
        .select(
            F.unix_millis(F.col("_tf_w.start")).alias(START),
            F.unix_millis(F.col("_tf_w.end")).alias(END),
            ITEM,
            COUNT,
        )
    )


def rank(counts: Iterable[tuple[str, int]], n: int) -> Ranked:
    """The n heaviest (item, count), count desc then item asc: a total, deterministic order."""
    return heapq.nsmallest(n, counts, key=lambda kv: (-kv[1], kv[0]))


def merge_top(top: Ranked, updated: dict[str, int], n: int) -> Ranked:
    """The top n after a batch: `top` (before it) with the batch's updated totals.

    Exact as long as counts only grow: an item outside `top` that the batch did not
    update ranked below all of `top`, which it still does.
    """
    counts = dict(top)
    counts.update(updated)
    return rank(counts.items(), n)


def as_top(ranked: Ranked) -> list[dict[str, Any]]:
    """The book's ``[{"item","count","error"}]`` (counts exact: error 0)."""
    return [{"item": item, "count": count, "error": 0} for item, count in ranked]


def still_open(end: int, newest_start: int, delay_ms: int) -> bool:
    """Whether an event can still reach a window ending at `end`: its end is after the
    newest window start seen minus the watermark delay (Spark's watermark is at least
    that, and drops events at or before it as late)."""
    return end > newest_start - delay_ms


class WindowTop(msgspec.Struct, array_like=True):
    end: int
    top: Ranked


class TopState(msgspec.Struct, kw_only=True):
    """What the driver keeps between batches: the top list (all time) or one per open
    window, and the batch it is after; counting by pane, every item's count per pane
    (`panes`, pane start -> item -> count) while a window holding the pane is open."""

    batch: int = -1
    events: int = 0
    top: Ranked = []
    windows: dict[int, WindowTop] = {}
    newest_start: int | None = None
    pane_ms: int = 0  # 0: Spark counts per window (no `panes`)
    panes: dict[int, dict[str, int]] = {}


def apply_batch(
    state: TopState, rows: list[dict[str, Any]], batch_id: int, n: int, delay_ms: int | None
) -> tuple[TopState, dict[int | None, Any]]:
    """(state after the batch, per key the new top list) from the batch's updated rows.

    Keys: None for all time (the top list and the events so far), else each updated
    window's start (``WindowTop``). `delay_ms` is the watermark delay (windowed only).
    """
    if delay_ms is None:
        updated = {r[ITEM]: int(r[COUNT]) for r in rows if r[ITEM] is not None}
        events = [int(r[COUNT]) for r in rows if r[ITEM] is None]
        if not rows:
            return msgspec.structs.replace(state, batch=batch_id), {}
        top = merge_top(state.top, updated, n)
        total = events[0] if events else state.events
        new = TopState(batch=batch_id, events=total, top=top)
        return new, {None: (top, total)}
    per_window: dict[int, tuple[int, dict[str, int]]] = {}
    for r in rows:
        start = int(r[START])
        _, counts = per_window.setdefault(start, (int(r[END]), {}))
        if r[ITEM] is not None:
            counts[r[ITEM]] = int(r[COUNT])
    windows = dict(state.windows)
    out: dict[int | None, Any] = {}
    for start in sorted(per_window):
        end, counts = per_window[start]
        before = windows.get(start)
        top = merge_top(before.top if before else [], counts, n)
        windows[start] = out[start] = WindowTop(end, top)
    starts = [*per_window, *([] if state.newest_start is None else [state.newest_start])]
    newest = max(starts) if starts else None
    if newest is not None:  # no event can reach a window ending at or before this any more
        windows = {s: w for s, w in windows.items() if still_open(w.end, newest, delay_ms)}
    return TopState(batch=batch_id, windows=windows, newest_start=newest), out


class PaneGeometry(msgspec.Struct, frozen=True):
    """Sliding windows of `length_ms` every `slide_ms`, counted in panes of `pane_ms`."""

    length_ms: int
    slide_ms: int
    pane_ms: int

    @classmethod
    def of(cls, spec: JobSpec, pane: int) -> PaneGeometry:
        assert spec.window is not None and spec.window.slide
        return cls(duration_ms(spec.window.length), duration_ms(spec.window.slide), pane)

    def windows(self, pane: int) -> list[int]:
        """Starts of the windows holding `pane`."""
        return pane_windows(pane, self.pane_ms, self.length_ms, self.slide_ms)


def apply_panes(
    state: TopState,
    rows: list[dict[str, Any]],
    batch_id: int,
    n: int,
    delay_ms: int,
    geometry: PaneGeometry,
    base: TopBase | None = None,
) -> tuple[TopState, dict[int | None, Any]]:
    """`apply_batch` for windows counted by pane: `rows` are the batch's updated (pane,
    item) totals. Per window holding an updated pane, the updated items' window totals
    (the sum over the window's panes, plus a batch view's `base` counts) are merged into
    its top list: the same lists and keys as `apply_batch` over per-window rows. A pane is
    forgotten with the last window holding it."""
    if state.batch >= 0 and state.pane_ms != geometry.pane_ms:
        raise JobError(
            f"top-N: the saved state before batch {batch_id} counts "
            f"{f'by panes of {state.pane_ms} ms' if state.pane_ms else 'per window'}, this "
            f"job by panes of {geometry.pane_ms} ms; its checkpoint was made by another "
            "version of this job: give the job a new name, or reset its checkpoint"
        )
    updated: dict[int, dict[str, int]] = {}
    for r in rows:
        counts = updated.setdefault(int(r[START]), {})
        if r[ITEM] is not None:
            counts[r[ITEM]] = int(r[COUNT])
    panes = dict(state.panes)
    for p, counts in updated.items():
        panes[p] = {**panes.get(p, {}), **counts}  # new dicts: `state` stays as it was
    item_windows: dict[str, set[int]] = {}
    touched: set[int] = set()
    for p, counts in updated.items():
        starts = geometry.windows(p)
        touched.update(starts)
        for item in counts:
            item_windows.setdefault(item, set()).update(starts)
    totals: dict[int, dict[str, int]] = {s: {} for s in touched}
    if touched:
        step, k = geometry.pane_ms, geometry.length_ms // geometry.pane_ms
        lo = min(touched)
        grid = [panes.get(q) for q in range(lo, max(touched) + geometry.length_ms, step)]
        for item, starts in item_windows.items():
            prefix, acc = [0], 0
            for held in grid:
                if held is not None:
                    acc += held.get(item, 0)
                prefix.append(acc)
            for s in starts:
                i = (s - lo) // step
                extra = base.windows.get(s, (0, {}))[1].get(item, 0) if base is not None else 0
                totals[s][item] = prefix[i + k] - prefix[i] + extra
    windows = dict(state.windows)
    out: dict[int | None, Any] = {}
    for start in sorted(touched):
        before = windows.get(start)
        top = merge_top(before.top if before else [], totals[start], n)
        windows[start] = out[start] = WindowTop(start + geometry.length_ms, top)
    starts = [*touched, *([] if state.newest_start is None else [state.newest_start])]
    newest = max(starts) if starts else None
    if newest is not None:  # no event can reach a window ending at or before this any more
        windows = {s: w for s, w in windows.items() if still_open(w.end, newest, delay_ms)}
        panes = {
            p: c
            for p, c in panes.items()
            if still_open(geometry.windows(p)[-1] + geometry.length_ms, newest, delay_ms)
        }
    new = TopState(
        batch=batch_id, windows=windows, newest_start=newest, pane_ms=geometry.pane_ms, panes=panes
    )
    return new, out


class TopBase(msgspec.Struct, kw_only=True):
    """A batch view's exact counts (jobs/batch_view.py): the speed layer, which counts only
    the events after the batch's high-water sequence, adds these to its own.

    `counts` all time; `windows` per window start (epoch ms): (end, counts); `events` the
    events counted (all time).
    """

    events: int = 0
    counts: dict[str, int] = {}
    windows: dict[int, tuple[int, dict[str, int]]] = {}
    newest_start: int | None = None

    @classmethod
    def from_rows(cls, rows: list[dict[str, Any]], windowed: bool) -> TopBase:
        """The base from a batch run's count rows (`topn_counts` over the whole history)."""
        if not windowed:
            counts = {r[ITEM]: int(r[COUNT]) for r in rows if r[ITEM] is not None}
            events = sum(int(r[COUNT]) for r in rows if r[ITEM] is None)
            return cls(events=events, counts=counts)
        windows: dict[int, tuple[int, dict[str, int]]] = {}
        for r in rows:
            _, counts = windows.setdefault(int(r[START]), (int(r[END]), {}))
            if r[ITEM] is not None:
                counts[r[ITEM]] = int(r[COUNT])
        return cls(windows=windows, newest_start=max(windows) if windows else None)

    def added(self, rows: list[dict[str, Any]], windowed: bool) -> list[dict[str, Any]]:
        """The speed layer's count rows with the base's counts added: merged totals."""
        out = []
        for r in rows:
            item = r[ITEM]
            if windowed:
                _, counts = self.windows.get(int(r[START]), (0, {}))
                extra = counts.get(item, 0) if item is not None else 0
            else:
                extra = self.counts.get(item, 0) if item is not None else self.events
            out.append({**r, COUNT: int(r[COUNT]) + extra})
        return out

    def state(self, n: int, delay_ms: int | None) -> TopState:
        """The top lists the merged view starts from: the batch view's own."""
        if delay_ms is None:
            return TopState(events=self.events, top=rank(self.counts.items(), n))
        newest = self.newest_start
        windows = {
            start: WindowTop(end, rank(counts.items(), n))
            for start, (end, counts) in self.windows.items()
            if newest is None or still_open(end, newest, delay_ms)
        }
        return TopState(windows=windows, newest_start=newest)


class TopStore:
    """The driver's `TopState` per batch id: in memory, and durably under `directory`
    (``<batch id>.json``, written atomically) so a restarted query resumes from it.

    `before(b)` is the state saved for the latest batch id below b: what batch b started
    from the first time it ran, whether or not b itself was saved before a crash. Before
    batch 0 it is `initial` (a batch view's top lists, or nothing).
    """

    def __init__(
        self, directory: Path | None, keep: int = 10, initial: TopState | None = None
    ) -> None:
        self.directory = directory
        self.keep = keep
        self.initial = initial or TopState()
        self._last: TopState | None = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    def _ids(self) -> list[int]:
        assert self.directory is not None
        return sorted(int(p.stem) for p in self.directory.glob("*.json") if p.stem.isdigit())

    def before(self, batch_id: int) -> TopState:
        if self._last is not None and self._last.batch == batch_id - 1:
            return self._last
        if self.directory is None:
            if batch_id == 0 or self._last is None:
                return self.initial
            raise JobError(f"top-N: no saved state before batch {batch_id}")
        earlier = [i for i in self._ids() if i < batch_id]
        if not earlier:
            if batch_id == 0:
                return self.initial
            raise JobError(
                f"top-N: batch {batch_id} has no saved top list before it in "
                f"{self.directory}; the checkpoint was made by another version of this job "
                "or part of it was deleted: give the job a new name, or reset its checkpoint"
            )
        path = self.directory / f"{earlier[-1]}.json"
        return msgspec.json.decode(path.read_bytes(), type=TopState)

    def save(self, state: TopState) -> None:
        self._last = state
        if self.directory is None:
            return
        write_atomic(self.directory / f"{state.batch}.json", msgspec.json.encode(state))
        for old in self._ids()[: -self.keep]:
            with contextlib.suppress(FileNotFoundError):
                (self.directory / f"{old}.json").unlink()


def topn_batches(
    spec: JobSpec,
    shape: Callable[[int | None, Any], dict[str, Any]],
    base: TopBase | None = None,
    pane: int | None = None,
) -> Callable[[Path | None], BatchRows]:
    """The driver side of a top-N job: given the query's checkpoint directory, a function
    from a batch's updated count rows (and batch id) to its result rows; `shape` makes a
    result row from a key and its `apply_batch` value. With a batch view's `base`, the
    rows are merged totals (`TopBase.added`) and the lists start from the batch view's.
    With `pane` (`pane_ms`), the rows are per pane and windows are summed from them
    (`apply_panes`)."""
    delay = duration_ms(spec.window.watermark) if spec.window is not None else None
    windowed = spec.window is not None
    geometry = PaneGeometry.of(spec, pane) if pane is not None else None

    def make(checkpoint: Path | None) -> BatchRows:
        initial = base.state(spec.n, delay) if base is not None else None
        directory = checkpoint / STATE_DIR if checkpoint is not None else None
        store = TopStore(directory, initial=initial)

        def batch(rows: list[dict[str, Any]], batch_id: int) -> list[dict[str, Any]]:
            before = store.before(batch_id)
            if geometry is not None:
                assert delay is not None
                state, out = apply_panes(before, rows, batch_id, spec.n, delay, geometry, base)
            else:
                if base is not None:
                    rows = base.added(rows, windowed)
                state, out = apply_batch(before, rows, batch_id, spec.n, delay)
            store.save(state)
            return [shape(key, value) for key, value in out.items()]

        return batch

    return make
