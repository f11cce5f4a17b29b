"""A stream's malformed events to dead letter, read by the driver without Spark.

Why not a Spark query (`jobs.running.start_deadletters`, kept for a user's own Spark
code): that query reads every event a second time only to find the rare malformed one,
and each of its micro-batches pays Spark's fixed cost on the cores the jobs' batches
need. At 5k events/s on two cores it took about a fifth of the analysis tier's CPU and
most of the top-N p99 gap (docs/benchmarks.md, "the dead-letter query's cost").

`DeadLetterScan` reads the sequences past its position every `every_s` with the jetstream
source's own reader (`read_range` with ``invalidOnly``: the same validation as the jobs'
rows, and valid events never become rows), publishes the malformed ones with ids
``dl:<stream>:<seq>``, and only then hands its next position and the count of dead
letters JetStream newly stored to `on_pass`, which the driver writes to its checkpoint in
one put. A crash between the publish and that put sends the same ids again after the
restart, and JetStream drops them as duplicates within the stream's duplicate window, as
it did for a replayed Spark batch; the count adds only what was newly stored.

It looks like a `StreamingQuery` to the driver (`isActive`, `exception`, `stop`,
`lastProgress`, `recentProgress`, `id`), so it is supervised, restarted with backoff and
reported like the jobs: a pass that fails ends the scan with its error.
"""

from __future__ import annotations

import collections
import datetime as dt
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from jobs.jetstream_options import SeqRange, SourceOptions
from jobs.jetstream_read import StreamControl, read_range
from jobs.sink import BatchReport, ResultSink
from runtime.job_specs import deadletter_query_name
from runtime.nats.endpoint import NatsEndpoint

log = logging.getLogger(__name__)

DEADLETTER_SCAN_S = 2.0  # how often a scan looks for new events (no Spark batch to amortize)
SCAN_MAX_EVENTS = 20_000  # per pass: a backlog is read in bounded steps, each recorded
PROGRESS_KEPT = 100  # recent passes kept for `progress()`, as Spark keeps 100 batches

OnPass = Callable[[int, BatchReport], None]  # (next sequence, what the pass published)

__all__ = ["DEADLETTER_SCAN_S", "SCAN_MAX_EVENTS", "DeadLetterScan", "next_range"]


def next_range(position: int, first: int, latest: int, most: int) -> SeqRange:
    """The pass's sequences: from `position` (or the stream's `first` when the events
    before it are gone: aged out or compacted, nothing left to dead-letter), up to
    `latest` (exclusive) and at most `most` of them; empty when caught up."""
    start = max(position, first, 1)
    return SeqRange(start, max(start, min(latest, start + most)))


class DeadLetterScan:
    """One stream's dead-letter scan on a thread of its own (see the module docstring)."""

    def __init__(
        self,
        nats: NatsEndpoint,
        stream: str,
        position: int,
        on_pass: OnPass,
        *,
        every_s: float = DEADLETTER_SCAN_S,
        max_events: int = SCAN_MAX_EVENTS,
    ) -> None:
        self.stream = stream
        self.name = deadletter_query_name(stream)
        self.id = str(uuid.uuid4())
        self.position = position
        self._every_s = every_s
        self._max_events = max_events
        self._on_pass = on_pass
        options = {**nats.to_options(), "stream": stream, "invalidOnly": "true"}
        self._opts = SourceOptions.parse({**options, "onAgedOut": "skip"})
        self._sink = ResultSink.for_query(nats, self.name)
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._passes = 0
        self._progress: collections.deque[dict[str, Any]] = collections.deque(maxlen=PROGRESS_KEPT)
        self._thread = threading.Thread(target=self._run, name=f"scan-{self.name}", daemon=True)

    def start(self) -> DeadLetterScan:
        self._thread.start()
        return self

    # ---- the StreamingQuery face the driver supervises ---------------------------------

    @property
    def isActive(self) -> bool:  # noqa: N802 (StreamingQuery's name)
        return self._thread.is_alive() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def lastProgress(self) -> dict[str, Any] | None:  # noqa: N802
        return self._progress[-1] if self._progress else None

    @property
    def recentProgress(self) -> list[dict[str, Any]]:  # noqa: N802
        return list(self._progress)

    # ---- the scan ----------------------------------------------------------------------

    def _run(self) -> None:
        control = StreamControl(self._opts)
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                read = self.scan_once(control)
                if read < self._max_events:  # caught up: wait for more; a backlog goes on
                    self._stop.wait(max(0.0, self._every_s - (time.monotonic() - started)))
        except BaseException as err:  # the driver reports it and restarts the scan
            self._error = err
            log.error("dead letters of %s: %r", self.stream, err)
        finally:
            control.close()

    def scan_once(self, control: StreamControl) -> int:
        """Read, publish and record one pass; the number of sequences it covered."""
        at = time.time()
        started = time.monotonic()
        bounds = control.bounds()
        part = next_range(self.position, bounds.first, bounds.latest, self._max_events)
        rows: list[dict[str, Any]] = []
        for batch in read_range(self._opts, part):
            rows.extend(batch.to_pylist())
        report = self._sink.dead_letter(rows, self.stream)
        if part.end != self.position or report.published:
            self._on_pass(part.end, report)
        self.position = part.end
        self._progress.append(
            {
                "batchId": self._passes,
                "numInputRows": len(rows),
                "timestamp": dt.datetime.fromtimestamp(at, dt.UTC).isoformat(),
                "durationMs": {"triggerExecution": round((time.monotonic() - started) * 1000)},
                "sources": [{"startOffset": {"seq": part.start}, "endOffset": {"seq": part.end}}],
            }
        )
        self._passes += 1
        return part.end - part.start
