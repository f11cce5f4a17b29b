"""How many ad-hoc SQL queries the analysis driver runs at once, and when to come back.

The driver's Spark runs the streaming queries first: an ad-hoc query takes one of a fixed
number of slots (`sql_slots`) or is answered at once "busy, retry after N s" (an HTTP 429
with `Retry-After` at the gateway), never queued behind the others where it would hold a
thread and a caller for as long as they run. N is when the first running query's timeout
ends (it is cancelled then at the latest), at least 1 s. Pure: the clock is passed in.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["SQL_SLOTS", "SQL_WAITING", "SqlAdmission", "sql_slots"]

SQL_SLOTS = 2  # ad-hoc queries one driver runs at once (spark.sql_slots)
# calls beyond the slots that Ray runs at once to answer 429 (more wait in Ray's queue)
SQL_WAITING = 4
RETRY_MAX_S = 60


def sql_slots(cfg: Any) -> int:
    """The configured `spark.sql_slots` (`SQL_SLOTS` unless set)."""
    return max(1, int(cfg.spark.sql_slots))


class SqlAdmission:
    """At most `slots` queries at once; `enter` gives a ticket or None (full)."""

    def __init__(self, slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.slots = slots
        self.clock = clock
        self._lock = threading.Lock()
        self._deadlines: dict[int, float] = {}
        self._next = 0

    def enter(self, timeout_s: float) -> int | None:
        """A slot for a query that ends (or is cancelled) within `timeout_s`, or None."""
        with self._lock:
            if len(self._deadlines) >= self.slots:
                return None
            self._next += 1
            self._deadlines[self._next] = self.clock() + timeout_s
            return self._next

    def leave(self, ticket: int) -> None:
        with self._lock:
            self._deadlines.pop(ticket, None)

    def running(self) -> int:
        with self._lock:
            return len(self._deadlines)

    def retry_after_s(self) -> int:
        """Whole seconds until the first running query's timeout, 1 to `RETRY_MAX_S`."""
        with self._lock:
            first = min(self._deadlines.values(), default=self.clock())
        return min(RETRY_MAX_S, max(1, math.ceil(first - self.clock())))
