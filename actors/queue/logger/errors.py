"""What the message log answers instead of an acknowledgement.

Both are plain picklable exceptions (their args are the constructor's): a replica raises
them inside Ray and `LoggerGroup` re-raises them as themselves; the collector answers 503.
"""

from __future__ import annotations

from runtime.errors import TierflowError


class LogFull(TierflowError):
    """The log is at its bound (backpressure): the whole batch was refused, nothing written.

    `events`/`bytes` are the log's counts when it refused; the collector answers 503.
    """

    def __init__(self, events: int, nbytes: int, max_events: int = 0, max_bytes: int = 0) -> None:
        super().__init__(events, nbytes, max_events, max_bytes)  # args = ctor args: picklable
        self.events = events
        self.bytes = nbytes
        self.max_events = max_events
        self.max_bytes = max_bytes

    def __str__(self) -> str:
        return (
            f"message log full: {self.events}/{self.max_events} events, "
            f"{self.bytes}/{self.max_bytes} bytes"
        )


class LogUnavailable(TierflowError):
    """A replica did not take a write (down, restarting, too slow, catching up).

    The write may still have landed on the others: the caller answers 503 and the producer
    retries (with its own ids to make the retry idempotent). `replica` names the replica.
    """

    def __init__(self, replica: str, reason: str) -> None:
        super().__init__(replica, reason)
        self.replica = replica
        self.reason = reason

    def __str__(self) -> str:
        return f"logger replica {self.replica} unavailable: {self.reason}"
