"""What a bridge counts and what its `stats` answers (the chaos runner, `tierflow` roles and
the benchmarks read it).

Its own part so the counters are named and explained in one place, while the parts that
bump them (`bridge_path`, `replayer`, `bridge_link`) share one dict.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from actors.queue.forgetter import Forgetter
from runtime.nats.publisher import JetStreamPublisher

COUNTERS = (
    "batches",  # publish calls (one Ray call a batch)
    "published",  # events JetStream stored (acks that were not duplicates)
    "duplicates",  # acks as duplicates, and entries found stored past the horizon
    "failed",  # events a publish did not land (retryable, or poison to dead-letter)
    "replayed",  # entries a replay pass published again
    "deadlettered",  # dead-letter records published (or found already stored)
    "dropped",  # events the stream's filter dropped (forgotten unpublished)
    "reconnects",  # NATS clients replaced after staying down
    "verified",  # entries past the blind-retry horizon a scan settled
    "found_stored",  # of those, found in the stream (forgotten, not resent)
    "unverified",  # entries past the horizon a scan could not settle
    "parked",  # entries parked in the log (see bridge_path)
    "replay_errors",  # replay passes of one logger group that failed
)


def new_counters() -> dict[str, int]:
    return dict.fromkeys(COUNTERS, 0)


def bridge_stats(
    counters: Mapping[str, int],
    pub: JetStreamPublisher | None,
    *,
    atomic: bool,
    forgetters: Iterable[Forgetter],
    loggers: Iterable[str],
) -> dict[str, Any]:
    """The counters, the publisher's acks in flight and latency, the forgets' progress."""
    forgetters = list(forgetters)
    return {
        **counters,
        "in_flight": pub.in_flight if pub else 0,
        "ack_p50_ms": _ms(pub.latency.quantile(0.5)) if pub else None,
        "ack_p99_ms": _ms(pub.latency.quantile(0.99)) if pub else None,
        "atomic_batches": atomic,
        "forgets_pending": sum(f.pending for f in forgetters),
        "forget_calls": sum(f.calls for f in forgetters),
        "forget_errors": sum(f.errors for f in forgetters),
        "forgets_left": sum(f.left for f in forgetters),
        "loggers": sorted(loggers),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)
