"""Sketches kept in Spark state: one per key, or one per pane of sliding/tumbling windows.

For what has no native Spark form: the `sample` jobs' reservoirs (Python per event, in
`applyInPandasWithState`). Top-N jobs no longer come here: they count on Spark's own state
(jobs/topn.py); the Space-Saving kind stays for custom use.

Windowed top-N and samples keep one mergeable summary (jobs/sketches.py) per pane (gcd of
length and slide) and emit each changed window as the merge of its panes, so an event reaches
Python once, not once per sliding window. Rows are put in a fixed order before a sketch sees
them, so a micro-batch Spark replays after a crash rebuilds the same sketch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from jobs.sketches import merge_bytes, update_bytes

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import DataFrame
    from pyspark.sql.streaming.state import GroupState


def _apply(kind: str, blob: bytes | None, pdf: pd.DataFrame, params: Mapping[str, Any]) -> bytes:
    """Add a group's rows (``_tf_item``, ``_tf_order``) to a sketch, in a fixed order.

    Top-N items go in as this batch's counts (weights), lightest first, so the purges of a
    full summary fall on light items; a reservoir sees the rows in (order, item) order.
    """
    items = pdf[pdf["_tf_item"].notna()]
    if kind == "topn":
        counts = items["_tf_item"].astype(str).value_counts()
        ranked = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]))
        return update_bytes(
            kind, blob, [k for k, _ in ranked], [int(c) for _, c in ranked], **params
        )
    items = items.sort_values(["_tf_order", "_tf_item"], kind="stable")
    return update_bytes(kind, blob, items["_tf_item"].astype(str).tolist(), **params)


def sketch_state(
    df: DataFrame,
    *,
    key: str,
    item: str,
    kind: Literal["topn", "reservoir"],
    params: Mapping[str, Any],
    order: str,
    event: str | None = None,
) -> DataFrame:
    """A sketch per key kept in Spark state: ``[key, sketch, events, n]`` per changed key.

    Rows are applied in a fixed order (`_apply`), so a replayed micro-batch rebuilds the
    same sketch. `events` counts distinct `event` values (an event's exploded rows count
    once; a null item still counts its event), `n` the items. Keys never expire: suited to
    bounded key sets. Use output mode "update".
    """
    from pyspark.sql import functions as F
    from pyspark.sql.streaming.state import GroupStateTimeout

    key_type = df.schema[key].dataType.simpleString()
    args = dict(params)

    def step(
        key_value: tuple[Any, ...], pdfs: Iterator[pd.DataFrame], state: GroupState
    ) -> Iterator[pd.DataFrame]:
        import pandas as pd

        frames = [p for p in pdfs if len(p)]
        if not frames:
            return
        pdf = pd.concat(frames, ignore_index=True)
        blob, events, n = state.get if state.exists else (None, 0, 0)
        if event is not None:
            events += int(pdf["_tf_event"].nunique())
        blob = _apply(kind, blob, pdf, args)
        n += int(pdf["_tf_item"].notna().sum())
        state.update((blob, events, n))
        yield pd.DataFrame({key: [key_value[0]], "sketch": [blob], "events": [events], "n": [n]})

    cols = [
        F.col(key),
        F.col(item).alias("_tf_item"),
        F.col(order).alias("_tf_order"),
        (F.col(event) if event else F.lit(None).cast("bigint")).alias("_tf_event"),
    ]
    return (
        df.select(*cols)
        .groupBy(key)
        .applyInPandasWithState(
            step,
            f"{key} {key_type}, sketch binary, events long, n long",
            "sketch binary, events long, n long",
            "update",
            GroupStateTimeout.NoTimeout,
        )
    )


def pane_windows(pane: int, pane_ms: int, length_ms: int, slide_ms: int) -> list[int]:
    """Starts of the windows ``[s, s + length)`` (s a multiple of `slide_ms`, Spark's rule)
    that contain the pane ``[pane, pane + pane_ms)``; `pane_ms` divides length and slide."""
    last = pane - pane % slide_ms
    return list(range(last, pane - length_ms, -slide_ms))[::-1]


def window_sketch_state(
    df: DataFrame,
    *,
    item: str,
    kind: Literal["topn", "reservoir"],
    params: Mapping[str, Any],
    order: str,
    length_ms: int,
    slide_ms: int,
) -> DataFrame:
    """Sliding or tumbling windows of mergeable sketches, built from panes.

    A pane is gcd(length, slide) of event time (``_tf_time``; the input needs a watermark).
    Each pane's sketch is kept in state; every micro-batch updates the panes it touches and
    emits ``[start, end_ms, sketch]`` for each window holding one of them, the window's
    sketch being the merge of its panes (Space-Saving and reservoir summaries are
    mergeable). An event therefore reaches Python once, not once per window it falls in.
    Panes whose last window ended at or before the watermark are dropped: such windows are
    final (late events never reach them). Use output mode "update".
    """
    from pyspark.sql import functions as F
    from pyspark.sql.streaming.state import GroupStateTimeout

    pane_ms = math.gcd(length_ms, slide_ms)
    args = dict(params)
    sketch_kind = kind

    def step(
        _key: tuple[Any, ...], pdfs: Iterator[pd.DataFrame], state: GroupState
    ) -> Iterator[pd.DataFrame]:
        import pandas as pd

        frames = [p for p in pdfs if len(p)]
        panes: dict[int, bytes] = dict(msgspec.msgpack.decode(state.get[0])) if state.exists else {}
        touched: set[int] = set()
        if frames:
            pdf = pd.concat(frames, ignore_index=True)
            for pane, group in pdf.groupby("_tf_pane", sort=True):
                p = int(pane)
                panes[p] = _apply(sketch_kind, panes.get(p), group, args)
                touched.add(p)
        starts = sorted({s for p in touched for s in pane_windows(p, pane_ms, length_ms, slide_ms)})
        out: dict[str, list[Any]] = {"start": [], "end_ms": [], "sketch": []}
        for s in starts:
            parts = [panes.get(p) for p in range(s, s + length_ms, pane_ms)]
            out["start"].append(s)
            out["end_ms"].append(s + length_ms)
            out["sketch"].append(merge_bytes(sketch_kind, parts))
        wm = state.getCurrentWatermarkMs()
        panes = {p: b for p, b in panes.items() if p + length_ms > wm}
        state.update((msgspec.msgpack.encode(panes),))
        if starts:
            yield pd.DataFrame(out)

    ms = F.unix_millis(F.col("_tf_time"))
    cols = [
        F.lit(0).alias("_tf_group"),
        (ms - F.pmod(ms, F.lit(pane_ms))).alias("_tf_pane"),
        F.col(item).alias("_tf_item"),
        F.col(order).alias("_tf_order"),
        F.col("_tf_time"),  # the watermark's column must reach the stateful operator
    ]
    return (
        df.where(F.col("_tf_time").isNotNull())
        .select(*cols)
        .groupBy("_tf_group")
        .applyInPandasWithState(
            step,
            "start long, end_ms long, sketch binary",
            "panes binary",
            "update",
            GroupStateTimeout.NoTimeout,
        )
    )
