"""Windows over event time (book ch. 5): trigger and eviction policies, in Spark.

* Time windows, sliding (trigger and eviction by time) and tumbling (by time): Spark's
  own `window()` with a watermark, `time_windows()`. A window `[start, end)` holds events
  with `start <= t < end`; sliding windows start every `slide` (offset 0 from the epoch),
  so with length 2 s / slide 1 s an event at t belongs to two windows and one window
  ends every second, covering the last 2 s. Windows with no events are not emitted.
  In append mode a window is emitted once, when the watermark passes its end.
* Count windows, tumbling (trigger by count N, eviction when full): not native in Spark;
  `count_windows()` keeps a per-key buffer of < N events in `applyInPandasWithState`
  state and emits a window every N events, however much time that takes.
* Pure-Python references (`*_reference`) with the same semantics, used as test oracles.

Late-event policy (time windows with a watermark). The watermark is Spark's: max event
time seen in earlier micro-batches minus `watermark`. An event whose time is <= the
watermark is late: it is dropped before windowing, whole (never counted into some of its
sliding windows), and counted. The drop is done by `dropDuplicatesWithinWatermark` on
the event id, a stateful operator that sees raw rows, so Spark's
`numRowsDroppedByWatermark` for that operator (named "dedupeWithinWatermark") counts
dropped *events* exactly; `late_count()` reads it from query progress and
`LateEventCounter` accumulates it for long-running queries. We do not use the metric of
the window aggregation itself: that operator sees partially aggregated rows, so it
counts (window, key, partition) groups, not events. The same operator also drops
redelivered duplicates (same id) while their time is above the watermark, which the
at-least-once broker needs anyway; without an id column a random uuid is used (no dedup).
Its state holds each id until the watermark passes the event's time plus the delay.
Spark (>= 3.4) filters late rows with the *previous* micro-batch's watermark and evicts
state with the current one (observed on 4.3), so lateness lags one batch behind the
watermark a progress record reports; `late_reference` models exactly this.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from pyspark.sql.streaming import StreamingQueryListener

if TYPE_CHECKING:
    import pandas as pd
    from pyspark.sql import Column, DataFrame
    from pyspark.sql.streaming.state import GroupState

LATE_OPERATOR = "dedupeWithinWatermark"

# --------------------------------------------------------------------------- time (Spark)


def time_windows(
    df: DataFrame,
    time_col: str,
    length: str,
    slide: str | None = None,
    *,
    watermark: str | None = None,
    keys: Sequence[str] = (),
    aggs: Sequence[Column] = (),
    id_col: str | None = None,
) -> DataFrame:
    """Event-time windows: tumbling (`slide=None`) or sliding, with Spark's `window()`.

    Output columns: `window_start`, `window_end`, *keys, `events` (count), then `aggs`.
    Durations are Spark interval strings ("2 seconds"). With `watermark` the late policy
    of the module doc applies (needs a streaming DataFrame for the drop to happen; on a
    static DataFrame nothing is late). Use output mode "append" for one final row per
    window, "update" for running values.
    """
    from pyspark.sql import functions as F

    if watermark is not None:
        df = df.withWatermark(time_col, watermark)
        ids = [id_col] if id_col else ["_tf_event_id"]
        if id_col is None:
            df = df.withColumn("_tf_event_id", F.expr("uuid()"))
        df = df.dropDuplicatesWithinWatermark(ids)
    w = F.window(time_col, length, slide) if slide else F.window(time_col, length)
    out = df.groupBy(w.alias("window"), *keys).agg(F.count(F.lit(1)).alias("events"), *aggs)
    rest = [c for c in out.columns if c != "window"]
    return out.select(
        F.col("window.start").alias("window_start"), F.col("window.end").alias("window_end"), *rest
    )


def late_count(progress: Iterable[Any]) -> int:
    """Late events dropped, summed over query progress records (dicts or progress objects).

    `query.recentProgress` keeps only the last 100 batches by default; for long-running
    queries use `LateEventCounter`.
    """
    total = 0
    for p in progress:
        ops = p["stateOperators"] if isinstance(p, dict) else p.stateOperators
        for op in ops:
            name = op["operatorName"] if isinstance(op, dict) else op.operatorName
            if name == LATE_OPERATOR:
                total += (
                    op["numRowsDroppedByWatermark"]
                    if isinstance(op, dict)
                    else op.numRowsDroppedByWatermark
                )
    return total


class LateEventCounter(StreamingQueryListener):
    """A StreamingQueryListener accumulating late events per query id.

    Register with `spark.streams.addListener(counter)`. Progress events arrive
    asynchronously on Spark's listener bus, so poll `count(query.id)` with a deadline.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._late: dict[str, int] = defaultdict(int)
        self._batches: dict[str, int] = defaultdict(int)

    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        qid = str(event.progress.id)
        late = late_count([event.progress])
        with self._lock:
            self._late[qid] += late
            self._batches[qid] += 1

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        pass

    def count(self, query_id: Any) -> int:
        with self._lock:
            return self._late.get(str(query_id), 0)

    def batches(self, query_id: Any) -> int:
        """Progress records seen for the query (to wait until all batches are in)."""
        with self._lock:
            return self._batches.get(str(query_id), 0)


# --------------------------------------------------------------------------- count (Spark)


def count_windows(
    df: DataFrame,
    key: str,
    time_col: str,
    n: int,
    value: str,
    order_col: str | None = None,
) -> DataFrame:
    """Count-tumbling windows per key: a window every `n` events, whatever the time.

    Emits `[key, seq, first_time, last_time, values]` (seq counts windows per key from 0;
    values is an array in window order). Events fill windows in arrival order across
    micro-batches; within one micro-batch Spark does not keep arrival order through the
    shuffle, so they are taken in (time, `order_col` or value) order. The < n buffered
    events of a key live in state (NoTimeout: a partial window waits for its n-th event
    and is never emitted early). The buffer is msgpack in a binary state column, so values
    must be strings, numbers or booleans. Output mode "append"; the streaming DataFrame needs no
    watermark. Static DataFrames work too (one batch).
    """
    from pyspark.sql import functions as F
    from pyspark.sql.streaming.state import GroupStateTimeout

    if n < 1:
        raise ValueError("n must be >= 1")
    key_t = df.schema[key].dataType.simpleString()
    val_t = df.schema[value].dataType.simpleString()
    tie = order_col or value

    def step(
        key_value: tuple[Any, ...], pdfs: Iterator[pd.DataFrame], state: GroupState
    ) -> Iterator[pd.DataFrame]:
        import pandas as pd

        seq, times, vals = (state.get[0], *_unpack(state.get[1])) if state.exists else (0, [], [])
        batch = pd.concat(list(pdfs), ignore_index=True)
        batch = batch.sort_values(["_tf_ms", "_tf_tie"], kind="stable")
        times += batch["_tf_ms"].tolist()
        vals += batch[value].tolist()
        out: dict[str, list[Any]] = {key: [], "seq": [], "first": [], "last": [], value: []}
        while len(times) >= n:
            out[key].append(key_value[0])
            out["seq"].append(seq)
            out["first"].append(times[0])
            out["last"].append(times[n - 1])
            out[value].append(vals[:n])
            seq, times, vals = seq + 1, times[n:], vals[n:]
        state.update((seq, _pack(times, vals)))
        if out["seq"]:
            yield pd.DataFrame(out)

    source = df.select(
        key,
        value,
        F.unix_millis(F.col(time_col)).alias("_tf_ms"),
        F.col(tie).alias("_tf_tie"),
    )
    emitted = source.groupBy(key).applyInPandasWithState(
        step,
        f"{key} {key_t}, seq long, first long, last long, {value} array<{val_t}>",
        "seq long, buffer binary",
        "append",
        GroupStateTimeout.NoTimeout,
    )
    return emitted.select(
        key,
        "seq",
        F.timestamp_millis("first").alias("first_time"),
        F.timestamp_millis("last").alias("last_time"),
        F.col(value).alias("values"),
    )


def _pack(times: list[int], vals: list[Any]) -> bytes:
    # A binary state column: PySpark 4.3 cannot read array types in a state schema.
    return msgspec.msgpack.encode([times, vals])


def _unpack(blob: bytes) -> tuple[list[int], list[Any]]:
    times, vals = msgspec.msgpack.decode(bytes(blob))
    return times, vals


# --------------------------------------------------------------------------- references


@dataclass(frozen=True, order=True)
class WindowResult:
    """One emitted window: `[start_ms, end_ms)` and its values in (time, value) order."""

    start_ms: int
    end_ms: int
    values: tuple[Any, ...]


Event = tuple[int, Any]  # (event time in ms since the epoch, value)


def sliding_reference(events: Iterable[Event], length_ms: int, slide_ms: int) -> list[WindowResult]:
    """Windows `[s, s + length)` for every s that is a multiple of `slide_ms` (Spark's rule)."""
    if length_ms <= 0 or slide_ms <= 0 or length_ms % slide_ms:
        raise ValueError("length must be a positive multiple of slide")
    buckets: dict[int, list[Event]] = defaultdict(list)
    for t, v in events:
        last_start = t - t % slide_ms  # latest window start <= t
        for start in range(last_start, t - length_ms, -slide_ms):
            buckets[start].append((t, v))
    return [
        WindowResult(s, s + length_ms, tuple(v for _, v in sorted(evs)))
        for s, evs in sorted(buckets.items())
    ]


def tumbling_time_reference(events: Iterable[Event], length_ms: int) -> list[WindowResult]:
    """Tumbling by time: a window every `length_ms`, however many events it holds."""
    return sliding_reference(events, length_ms, length_ms)


def tumbling_count_reference(
    batches: Iterable[Iterable[tuple[Any, int, Any]]], n: int
) -> list[tuple[Any, int, int, int, tuple[Any, ...]]]:
    """Tumbling by count per key over micro-batches of (key, time_ms, value) events.

    Returns `(key, seq, first_ms, last_ms, values)` for every full window, in emission
    order per key; within a batch events are taken in (time, value) order, as
    `count_windows` does. Events beyond the last full window stay buffered (not emitted).
    """
    buffers: dict[Any, list[tuple[int, Any]]] = defaultdict(list)
    seqs: dict[Any, int] = defaultdict(int)
    out = []
    for batch in batches:
        per_key: dict[Any, list[tuple[int, Any]]] = defaultdict(list)
        for k, t, v in batch:
            per_key[k].append((t, v))
        for k in sorted(per_key, key=repr):
            buf = buffers[k]
            buf.extend(sorted(per_key[k]))
            while len(buf) >= n:
                win, buffers[k] = buf[:n], buf[n:]
                buf = buffers[k]
                out.append((k, seqs[k], win[0][0], win[-1][0], tuple(v for _, v in win)))
                seqs[k] += 1
    return out


def late_reference(
    batches: Sequence[Sequence[tuple[Any, int]]], delay_ms: int
) -> tuple[list[list[tuple[Any, int]]], list[tuple[Any, int]]]:
    """Split micro-batches of (id, time_ms) into kept and late as `time_windows` does.

    Batch i filters with the watermark of batch i-1, i.e. max time over batches < i-1
    minus the delay; an event is late when its time is <= that. Ids already kept and
    not yet below the watermark are duplicates and dropped silently (not late).
    """
    kept: list[list[tuple[Any, int]]] = []
    late: list[tuple[Any, int]] = []
    maxima: list[int] = []
    seen: dict[Any, int] = {}
    for i, batch in enumerate(batches):
        limit = max(maxima[: i - 1], default=None) if i >= 2 else None
        threshold = None if limit is None else limit - delay_ms
        keep = []
        for ev_id, t in batch:
            if threshold is not None and t <= threshold:
                late.append((ev_id, t))
            elif ev_id in seen:
                continue
            else:
                seen[ev_id] = t
                keep.append((ev_id, t))
        kept.append(keep)
        maxima.append(max((t for _, t in batch), default=-(2**62)))
    return kept, late
