"""Retention of an archived stream: JetStream drops only what the archive already holds.

With `[streams.X.archive]` the archive is the system of record (book ch. 6), so the stream
is made with no `max_age` and ``discard: new`` (runtime/services.py `ensure_streams`), and
its configured limits are kept here instead, by purging from the front:

- events older than `max_age_s` go, once archived;
- above `HIGH_WATER` of `max_bytes`, the oldest archived events go until `LOW_WATER`.

Never past the archive's position. If the archive lags so far that the stream fills up,
JetStream refuses new events; the bridge keeps retrying them and they wait, acknowledged
and logged, in the message logger, and `warning` says so loudly. That is the choice the
issue offered ("refuse to age out what is not archived, or warn"): refuse, and warn.

`purge_below` is the policy, pure; `enforce` does the reads and the purge.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nats.js.client import JetStreamContext

__all__ = ["HIGH_WATER", "LOW_WATER", "Purge", "Usage", "enforce", "purge_below", "warning"]

HIGH_WATER = 0.9
LOW_WATER = 0.8
SEARCH_STEPS = 64  # a binary search over sequences: 2**64 is past any stream


@dataclass(frozen=True)
class Usage:
    """A stream's state as JetStream reports it (`stream_info().state`)."""

    first_seq: int
    last_seq: int
    messages: int
    bytes: int


@dataclass(frozen=True)
class Purge:
    """What one `enforce` did: sequences below `below` are gone (`purged` events)."""

    stream: str
    below: int
    purged: int
    warning: str | None


def purge_below(usage: Usage, archived_next: int, *, aged_below: int, max_bytes: int) -> int:
    """The sequence every event below which may be purged now: those past the age limit
    (`aged_below`: the first sequence still young enough) and, over `HIGH_WATER` of
    `max_bytes`, the oldest down to `LOW_WATER` (estimated by the mean event size), but
    never an event at or past `archived_next`, the archive's first missing sequence."""
    if usage.messages == 0:
        return usage.first_seq
    floor = max(usage.first_seq, aged_below)
    if max_bytes > 0 and usage.bytes > HIGH_WATER * max_bytes:
        mean = usage.bytes / usage.messages
        floor = max(
            floor, usage.first_seq + math.ceil((usage.bytes - LOW_WATER * max_bytes) / mean)
        )
    return max(usage.first_seq, min(floor, archived_next, usage.last_seq + 1))


def warning(stream: str, usage: Usage, archived_next: int, max_bytes: int) -> str | None:
    """A loud line when the stream is full because the archive lags (new events are being
    refused and wait in the message logger); None otherwise."""
    if max_bytes <= 0 or usage.bytes < HIGH_WATER * max_bytes:
        return None
    behind = max(0, usage.last_seq + 1 - archived_next)
    if behind == 0:
        return None
    full = round(100 * usage.bytes / max_bytes)
    return (
        f"stream {stream!r} is {full}% of max_bytes and its archive is {behind} events behind: "
        f"JetStream refuses new events until the archive catches up (they wait, acknowledged, "
        f"in the message logger); check `tierflow archive status`"
    )


async def first_since(js: JetStreamContext, stream: str, cutoff: dt.datetime, usage: Usage) -> int:
    """The boundary at `cutoff`: every event below the sequence returned was stored before
    it, none at or after it was (``last_seq + 1`` if all were). A binary search over the
    stream's timestamps; sequences may have gaps, so each probe asks for the next message
    at or after a sequence, and the boundary may be a deleted sequence."""
    # invariant: every event below lo is older than cutoff; the first event at or after hi
    # is not (stream timestamps grow with sequences)
    lo, hi = usage.first_seq, usage.last_seq + 1
    for _ in range(SEARCH_STEPS):
        if lo >= hi:
            break
        mid = (lo + hi) // 2
        msg = await js.get_msg(stream, seq=mid, subject=">", next=True)
        if msg.time is not None and msg.time >= cutoff:
            hi = mid
        else:
            lo = (msg.seq or mid) + 1
    return lo


async def enforce(
    js: JetStreamContext,
    stream: str,
    archived_next: int,
    *,
    max_age_s: float,
    max_bytes: int,
    now: dt.datetime | None = None,
) -> Purge:
    """Purge what the stream's limits let go and the archive holds (see the module doc)."""
    state = (await js.stream_info(stream)).state
    usage = Usage(state.first_seq, state.last_seq, state.messages, state.bytes)
    aged_below = usage.first_seq
    if max_age_s > 0 and usage.messages:
        now = now or dt.datetime.now(dt.UTC)
        aged_below = await first_since(js, stream, now - dt.timedelta(seconds=max_age_s), usage)
    below = purge_below(usage, archived_next, aged_below=aged_below, max_bytes=max_bytes)
    purged = 0
    if below > usage.first_seq:
        before = usage.messages
        await js.purge_stream(stream, seq=below)
        after = (await js.stream_info(stream)).state
        purged = before - after.messages
    return Purge(stream, below, purged, warning(stream, usage, archived_next, max_bytes))
