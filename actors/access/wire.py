"""Deliveries taken off the NATS wire before nats-py builds anything for them.

A feed's reader gets thousands of JetStream deliveries a second. Through nats-py each one
costs a regex parse of its control line, a header dict, a `Msg`, a trip through its
subscription's queue and a callback task wake-up: most of a gateway's CPU at 5k events/s.
`tap(nc).register(sid, take)` offers every ``MSG``/``HMSG`` frame for subscription `sid`
to `take(subject, reply, headers, payload)` first, in wire order, straight from the
parser; what `take` declines (returns False for), and every frame of any other
subscription, goes on through nats-py's own parsing unchanged.

The fast lane itself is `runtime.nats.wire.FastLaneParser`, shared with the Spark source
(jobs/jetstream_read.py); it relies on internals of the pinned nats-py (see there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from runtime.nats.wire import install

__all__ = ["Take", "Tap", "tap"]

Take = Callable[[bytes, bytes, "bytes | None", bytes], bool]
"""(subject, reply, headers or None, payload) -> True when taken."""


class Tap:
    """One connection's takers, by subscription id."""

    def __init__(self, nc: Any) -> None:
        self.nc = nc
        self.takers: dict[int, Take] = {}

    def register(self, sid: int, take: Take) -> None:
        self.takers[sid] = take

    def unregister(self, sid: int) -> None:
        self.takers.pop(sid, None)

    def take(
        self, sid: int, subject: bytes, reply: bytes, headers: bytes | None, data: bytes
    ) -> bool:
        taker = self.takers.get(sid)
        if taker is None or not taker(subject, reply, headers, data):
            return False
        stats = self.nc.stats  # as nats-py counts every message it processes
        stats["in_msgs"] += 1
        stats["in_bytes"] += len(data)
        return True


def tap(nc: Any) -> Tap:
    """`nc`'s tap, installed on first use (one per connection; idempotent)."""
    existing = getattr(nc, "_tierflow_tap", None)
    if existing is not None:
        return existing
    t = Tap(nc)
    install(nc, t.take)
    nc._tierflow_tap = t
    return t
