"""Retention of an archived stream: JetStream drops only what the archive already holds.

With `[streams.X.archive]` the archive is the system of record (book ch. 6), so the stream
is made with no `max_age` and ``discard: new`` (runtime/engines/services.py `ensure_streams`), and
its configured limits are kept here instead, by purging from the front:

- events older than `max_age_s` go, once archived;
- above `HIGH_WATER` of `max_bytes`, the oldest archived events go until `LOW_WATER`.

Never past the *floor*: the first sequence someone still needs, the lowest of the
archive's position, each replicating copy's sourced position on another site (a copy that
does not answer holds at the last position it confirmed) and each live reader's lease
(jobs/read_lease.py). Those are `Hold`s, gathered by jobs/retention_holds.py. If a holder
lags so far that the stream fills up, JetStream refuses new events; the bridge keeps
retrying them and they wait, acknowledged and logged, in the message logger, and `warning`
says so loudly, naming the holder: refuse, and warn.

`floor_of`, `purge_below` and `warning` are the policy, pure; `enforce` does the reads and
the purge.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nats.js.client import JetStreamContext

__all__ = [
    "ARCHIVE",
    "HIGH_WATER",
    "LOW_WATER",
    "Hold",
    "Purge",
    "Usage",
    "enforce",
    "floor_of",
    "purge_below",
    "warning",
]

HIGH_WATER = 0.9
LOW_WATER = 0.8
SEARCH_STEPS = 64  # a binary search over sequences: 2**64 is past any stream
ARCHIVE = "archive"


@dataclass(frozen=True)
class Usage:
    """A stream's state as JetStream reports it (`stream_info().state`)."""

    first_seq: int
    last_seq: int
    messages: int
    bytes: int


@dataclass(frozen=True)
class Hold:
    """Someone who still needs the stream from `next_seq` on: the archive (neither `site`
    nor `reader`), a copy on another site (`site`), or a reader (`reader`, its lease's id)."""

    next_seq: int
    site: str = ""
    reader: str = ""

    @property
    def holder(self) -> str:
        return (
            f"site:{self.site}"
            if self.site
            else f"reader:{self.reader}"
            if self.reader
            else ARCHIVE
        )

    def describe(self) -> str:
        if self.site:
            return f"site {self.site!r} (its copy has not sourced them)"
        if self.reader:
            return f"reader {self.reader!r} (it reads from sequence {self.next_seq})"
        return "its archive"


@dataclass(frozen=True)
class Purge:
    """What one `enforce` did: sequences below `below` are gone (`purged` events);
    `held_by` the holds at the floor that kept the rest (none: only the limits did)."""

    stream: str
    below: int
    purged: int
    warning: str | None
    held_by: tuple[Hold, ...] = ()


def floor_of(archived_next: int, holds: Iterable[Hold] = ()) -> tuple[int, tuple[Hold, ...]]:
    """The first sequence anyone still needs (the lowest hold, the archive's position among
    them) and the holds at it."""
    every = [Hold(archived_next), *holds]
    floor = min(h.next_seq for h in every)
    return floor, tuple(h for h in every if h.next_seq == floor)


def purge_below(usage: Usage, floor: int, *, aged_below: int, max_bytes: int) -> int:
    """The sequence every event below which may be purged now: those past the age limit
    (`aged_below`: the first sequence still young enough) and, over `HIGH_WATER` of
    `max_bytes`, the oldest down to `LOW_WATER` (estimated by the mean event size), but
    never an event at or past `floor` (`floor_of`: the archive's first missing sequence,
    or lower if a copy elsewhere or a reader still needs more)."""
    if usage.messages == 0:
        return usage.first_seq
    limit = max(usage.first_seq, aged_below)
    if max_bytes > 0 and usage.bytes > HIGH_WATER * max_bytes:
        mean = usage.bytes / usage.messages
        limit = max(
            limit, usage.first_seq + math.ceil((usage.bytes - LOW_WATER * max_bytes) / mean)
        )
    return max(usage.first_seq, min(limit, floor, usage.last_seq + 1))


def warning(
    stream: str, usage: Usage, archived_next: int, max_bytes: int, holds: Iterable[Hold] = ()
) -> str | None:
    """A loud line when the stream is full because a holder lags (new events are being
    refused and wait in the message logger), naming the holder; None otherwise."""
    if max_bytes <= 0 or usage.bytes < HIGH_WATER * max_bytes:
        return None
    floor, at = floor_of(archived_next, holds)
    behind = max(0, usage.last_seq + 1 - max(floor, usage.first_seq))
    if behind == 0:
        return None
    full = round(100 * usage.bytes / max_bytes)
    if all(h.holder == ARCHIVE for h in at):
        return (
            f"stream {stream!r} is {full}% of max_bytes and its archive is {behind} events "
            f"behind: JetStream refuses new events until the archive catches up (they wait, "
            f"acknowledged, in the message logger); check `tierflow archive status`"
        )
    who = " and ".join(h.describe() for h in at)
    return (
        f"stream {stream!r} is {full}% of max_bytes and {who} still needs its last {behind} "
        f"events: nothing from sequence {floor} on is purged, so JetStream refuses new events "
        f"until that holder catches up (they wait, acknowledged, in the message logger); "
        f"check `tierflow site status` for a site, `tierflow archive status` for the archive"
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
    holds: Iterable[Hold] = (),
) -> Purge:
    """Purge what the stream's limits let go and nobody still needs (see the module doc):
    below the archive's position `archived_next` and below every hold in `holds`."""
    holds = tuple(holds)
    floor, at = floor_of(archived_next, holds)
    state = (await js.stream_info(stream)).state
    usage = Usage(state.first_seq, state.last_seq, state.messages, state.bytes)
    aged_below = usage.first_seq
    if max_age_s > 0 and usage.messages:
        now = now or dt.datetime.now(dt.UTC)
        aged_below = await first_since(js, stream, now - dt.timedelta(seconds=max_age_s), usage)
    below = purge_below(usage, floor, aged_below=aged_below, max_bytes=max_bytes)
    purged = 0
    if below > usage.first_seq:
        before = usage.messages
        await js.purge_stream(stream, seq=below)
        after = (await js.stream_info(stream)).state
        purged = before - after.messages
    held = at if below == floor and floor <= usage.last_seq else ()
    text = warning(stream, usage, archived_next, max_bytes, holds)
    return Purge(stream, below, purged, text, held)
