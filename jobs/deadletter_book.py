"""The dead-letter scans' book in the analysis driver's checkpoint store: per stream, where
its scan (jobs/deadletter_scan.py) goes on from and how many dead letters it has stored.

Exists so that a scan's position and its exact count are kept in one put per pass (a pass
resent after a crash finds its ids in JetStream already and adds nothing), read back by a
restarted driver and by `status`, and so that where a scan starts (`deadletter_position`)
can be tested without the driver.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from jobs.checkpoints import committed

if TYPE_CHECKING:
    from jobs.sink import BatchReport
    from runtime.state.checkpoint import Namespace

__all__ = ["DeadLetterBook", "DeadLetterCount", "deadletter_position"]


class DeadLetterCount(msgspec.Struct, array_like=True):
    """A stream's dead letters in the checkpoint: `next_seq` is the scan's position (0 in
    a record written by the Spark dead-letter query before it, whose checkpoint then has
    the position); `last_batch` is that query's last counted batch, kept for the record."""

    last_batch: int
    total: int
    next_seq: int = 0


def deadletter_position(record: DeadLetterCount | None, spark_checkpoint: Path) -> int:
    """Where a stream's dead-letter scan starts: its recorded position; after the Spark
    dead-letter query it replaces (a record without one), the end of that query's last
    committed batch, so an upgrade neither skips nor resends; else 0, the stream's first."""
    if record is not None and record.next_seq:
        return record.next_seq
    done = committed(spark_checkpoint)
    if done is not None and done[1] is not None:
        return int(done[1].get("seq", 0))
    return 0


class DeadLetterBook:
    """The ``deadletters`` namespace of the driver's checkpoint store, one record a stream."""

    def __init__(self, ns: Namespace) -> None:
        self._ns = ns

    def record(self, stream: str) -> DeadLetterCount | None:
        raw = self._ns.get(stream.encode())
        return msgspec.msgpack.decode(raw, type=DeadLetterCount) if raw else None

    def position(self, stream: str, checkpoint: Path) -> int:
        """Where `stream`'s scan starts (`deadletter_position`)."""
        return deadletter_position(self.record(stream), checkpoint)

    def count(self, stream: str, next_seq: int, report: BatchReport) -> None:
        """A scan's pass is durable: its position and the dead letters JetStream newly
        stored (a pass resent after a crash finds its ids there already), in one put."""
        seen = self.record(stream)
        last_batch, total = (seen.last_batch, seen.total) if seen else (-1, 0)
        total += report.published - report.duplicates
        record = DeadLetterCount(last_batch, total, next_seq)
        self._ns.put(stream.encode(), msgspec.msgpack.encode(record))

    def forget(self, stream: str) -> None:
        """`stream`'s scan starts over (on another copy): its position and count too."""
        self._ns.delete(stream.encode())

    def totals(self) -> dict[str, int]:
        """Dead letters per stream, exact, over all incarnations."""
        out = {}
        for key, raw in self._ns.scan():
            out[key.decode()] = msgspec.msgpack.decode(raw, type=DeadLetterCount).total
        return out
