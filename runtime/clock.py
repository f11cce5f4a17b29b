"""Wall-clock milliseconds, the unit of every timestamp tierflow writes (logs, leases, KV).

One function so every tier stamps time the same way; policies take the clock as an
argument and are tested with a fake one.
"""

from __future__ import annotations

import time

__all__ = ["now_ms"]


def now_ms() -> int:
    """Milliseconds since the epoch, as an int (`time.time_ns`, no float rounding)."""
    return time.time_ns() // 1_000_000
