"""The analysis driver's copy tracking (geo replication, docs/geo.md): which copy of its
stream each query reads, decided once for every kind of query.

Exists because jobs, dead-letter scans and the archive all make the same decision when they
start (read the copy the driver reads now and the one recorded in the checkpoint, `decide`
with jobs/copies.py, record the copy of a new checkpoint, say and keep what changed) and
differ only in what a change costs them: a job is recomputed or starts a fresh generation
(jobs/generations.py), a dead-letter scan starts over, the archive refuses
(`archive_copy_error`). `CopyTracker.begin` makes the decision, the query's owner acts on
it, and `moved` records the new copy; `stale` finds running queries whose stream became
another copy (deleted and made again) so the reconcile thread restarts them.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.checkpoints import committed
from jobs.copies import Action, CopyId, current_copy, decide, read_copy, record_copy
from runtime.clock import now_ms

if TYPE_CHECKING:
    from jobs.queries import Query
    from runtime.nats.server import NatsEndpoint

log = logging.getLogger(__name__)

__all__ = ["COPY_CHECK_S", "CopyStart", "CopyTracker", "archive_copy_error"]

COPY_CHECK_S = 5.0  # how often running queries' copies are compared with the streams'
MOVES = {Action.RECOMPUTE: "recomputed", Action.FRESH: "started over"}
DOING = {Action.RECOMPUTE: "recomputing it over this copy", Action.FRESH: "starting over"}


def archive_copy_error(stream: str, recorded: CopyId, current: CopyId, archive: str) -> str:
    """Why an archive does not resume on another copy, and the fix."""
    return (
        f"archive of {stream}: its checkpoint holds sequences of copy {recorded.describe()}, "
        f"the driver reads copy {current.describe()}; sequences differ between copies, so "
        "resuming would skip or repeat events. Either run the driver on the archive's copy "
        "again, or archive this copy from its start: move aside both the archive's "
        f"checkpoint (archive-{stream} under the checkpoint root) and its directory "
        f"{archive}/stream={stream} (or set a new [streams.{stream}.archive] path); the old "
        "archive stays readable on its own, and the new one holds the events again (same ids)"
    )


@dataclass(frozen=True)
class CopyStart:
    """A query's start, as far as copies go: the copy read now, the one its positions are
    of (None: a new checkpoint, or one older than copy tracking), and what to do."""

    name: str
    here: CopyId
    recorded: CopyId | None
    action: Action

    @property
    def moved(self) -> bool:
        """The positions are of another copy and must not be resumed here."""
        return self.action in (Action.RECOMPUTE, Action.FRESH, Action.REFUSE)


class CopyTracker:
    """Decides, for each query start, whether its checkpoint's positions are of the copy
    the driver reads (`begin`); keeps the last change per query for `status` (`changes`).

    Args:
        nats: where the streams are.
        copy_of: the copy of a stream the driver reads now (default: STREAM.INFO through
            `nats`, jobs/copies.py `current_copy`); tests pass their own.
    """

    def __init__(self, nats: NatsEndpoint, copy_of: Callable[[str], CopyId] | None = None) -> None:
        self.copy_of = copy_of or functools.partial(current_copy, nats)
        self.changes: dict[str, dict[str, Any]] = {}  # query -> the last copy change
        self._next_check = 0.0

    def begin(self, q: Query, *, fallback: CopyId | None = None) -> CopyStart:
        """The copy decision for `q`'s start over its checkpoint `q.checkpoint`: `q.copy`
        becomes the copy read now. A checkpoint of this copy (or of none yet, then it is
        recorded) resumes; one of another copy is `moved`, and nothing is recorded: the
        owner acts on it (a new checkpoint, or a refusal) and calls `moved`. `fallback`:
        the copy to assume when the checkpoint names none (a job's batch view's copy)."""
        here = self.copy_of(q.stream)
        q.copy = here
        own = read_copy(q.checkpoint)
        recorded = own or fallback
        action = decide(q.kind, recorded, here)
        start = CopyStart(q.name, here, recorded, action)
        if not start.moved:
            if action is Action.RECORD and committed(q.checkpoint) is not None:
                log.warning(
                    "analysis driver: %s: its checkpoint names no copy (older than copy "
                    "tracking): taken to be of %s",
                    q.name,
                    here.describe(),
                )
            if own is None:
                record_copy(q.checkpoint, here)
        elif action in DOING:
            assert recorded is not None
            log.warning(
                "analysis driver: %s: its positions are of copy %s, the driver reads copy %s: %s",
                q.name,
                recorded.describe(),
                here.describe(),
                DOING[action],
            )
        return start

    def moved(self, start: CopyStart, checkpoint: Path, **detail: Any) -> None:
        """The owner of `start`'s query made it a new checkpoint (`checkpoint`) on the copy
        read now: record that copy there and keep the change for `status`."""
        assert start.recorded is not None and start.action in MOVES
        record_copy(checkpoint, start.here)
        self.changes[start.name] = {
            "from": start.recorded.describe(),
            "to": start.here.describe(),
            "action": MOVES[start.action],
            **detail,
            "at_ms": now_ms(),
        }
        log.warning("analysis driver: %s: %s", start.name, self.changes[start.name])

    def due(self) -> bool:
        """Whether it is time (every `COPY_CHECK_S`) to look for `stale` queries."""
        if time.monotonic() < self._next_check:
            return False
        self._next_check = time.monotonic() + COPY_CHECK_S
        return True

    def stale(self, queries: Iterable[Query]) -> list[str]:
        """The running queries whose stream is now another copy (deleted and made again
        under them): the reconcile thread stops them, and their next start decides what to
        do, as after a restart. A stream whose copy cannot be read now is left alone."""
        running = [q for q in queries if q.query is not None and q.copy]
        out = []
        for stream in sorted({q.stream for q in running}):
            try:
                here = self.copy_of(stream)
            except Exception as err:  # NATS away or the stream gone: the queries say so
                log.debug("analysis driver: copy of %s: %r", stream, err)
                continue
            for q in running:
                if q.stream == stream and q.copy != here:
                    log.warning(
                        "analysis driver: %s reads %s, which is now copy %s: restarting it",
                        q.name,
                        q.copy.describe() if q.copy else "?",
                        here.describe(),
                    )
                    out.append(q.name)
        return out
