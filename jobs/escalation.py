"""When the analysis driver stops restarting queries one by one and restarts itself.

A query that dies is restarted alone, with backoff (`jobs.driver.backoff_s`): one bad job must
not disturb the others. But some faults live in the driver's JVM, not in a query: Spark's
streaming source runner once corrupted the source's shared env map, after which every task of
that JVM failed to deserialize, and restarting the queries (13 times each in four minutes)
could never help. As an OTP supervisor escalates when its restart intensity is exceeded, the
driver then exits so that Ray starts it in a fresh process; its checkpoints make the restart
exact. The policy is a pure function of the failure counts and the clock."""

from __future__ import annotations

from collections.abc import Mapping

ESCALATE_AFTER = 5
"""Failures in a row of every query before the driver restarts itself: 15 s of backoff (1, 2,
4, 8 s) and five starts, so a NATS restart or a stream recreated under the jobs does not."""

ESCALATE_EVERY_S = 300.0
"""At most one self-restart per this many seconds: a fault outside the driver (NATS down for an
hour) makes every query fail too, and a fresh process cannot mend it."""


def should_escalate(
    failures: Mapping[str, int],
    last_escalation: float | None,
    now: float,
    *,
    after: int = ESCALATE_AFTER,
    every_s: float = ESCALATE_EVERY_S,
) -> bool:
    """True when every wanted query has failed `after` times in a row and the driver has not
    restarted itself in the last `every_s` seconds (`last_escalation`: wall-clock seconds of
    the last self-restart, kept across restarts; None if never)."""
    if not failures or min(failures.values()) < after:
        return False
    return last_escalation is None or now - last_escalation >= every_s
