"""Pure-Python references the tests check the product against (test oracles).

The window references have the semantics of jobs/windows.py and of the windowed jobs of
jobs/plans.py, written the plain way: every window an event falls in, every count window of
a key, and which events Spark's watermark drops as late.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


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
