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

Both are for custom jobs (``kind = "custom"``, jobs/plans.py); the built-in windowed jobs
apply the same late policy in jobs/event_time.py. The pure-Python references with the same
semantics, the tests' oracles, are in tests/oracles.py.

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
watermark a progress record reports; `tests.oracles.late_reference` models exactly this.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
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

    Spark hands it each progress as its JSON (`_ProgressJson`), one py4j call, instead of
    the object pyspark's own listener wrapper builds for every progress of every query with
    a round trip per field, map key and nested operator (a profile of the analysis driver
    at 1k events/s: most of its py4j traffic, on the same two cores as the batches).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._late: dict[str, int] = defaultdict(int)
        self._batches: dict[str, int] = defaultdict(int)

    @property
    def _jlistener(self) -> Any:
        # what pyspark's `addListener`/`removeListener` register: our lean py4j callback
        from pyspark import SparkContext

        if not hasattr(self, "_jlistenerobj"):
            jvm = SparkContext._jvm
            assert jvm is not None, "register with spark.streams.addListener"
            self._jlistenerobj = jvm.PythonStreamingQueryListenerWrapper(_ProgressJson(self))
        return self._jlistenerobj

    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        self.count_progress(event.progress)

    def count_progress(self, progress: Any) -> None:
        """Count one progress record (a dict of its JSON, or pyspark's object)."""
        qid = str(progress["id"] if isinstance(progress, dict) else progress.id)
        late = late_count([progress])
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


class _ProgressJson:
    """The py4j side of `LateEventCounter`: Spark calls it with each listener event; it
    reads a progress as one JSON string."""

    def __init__(self, counter: LateEventCounter) -> None:
        self.counter = counter

    def onQueryStarted(self, jevent: Any) -> None:
        pass

    def onQueryProgress(self, jevent: Any) -> None:
        self.counter.count_progress(json.loads(jevent.progress().json()))

    def onQueryIdle(self, jevent: Any) -> None:
        pass

    def onQueryTerminated(self, jevent: Any) -> None:
        pass

    class Java:
        implements = ["org.apache.spark.sql.streaming.PythonStreamingQueryListener"]


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
