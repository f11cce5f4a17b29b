"""Reader leases: a reader of a stream's history holds retention back while it reads.

A reader of an archived stream (`tierflow sql`, `/v1/sql`, `tierflow jobs recompute`: jobs/sql.py
`stream_events`) reads the archive below its position P and the live tail from P on. The
archive moves on while the reader reads, and retention (jobs/retention.py) purges below the
archive's position, so without a lease the tail from P could be purged before it is read.

Protocol, safe whatever the interleaving:

1. the reader writes its lease at 0 (hold everything) before it reads P;
2. it reads P and moves its lease to P; it reads the tail from P; it drops the lease;
3. retention reads the archive's position *before* it reads the leases, and purges below
   neither. A pass that missed the lease read the archive's position before the reader
   read P (positions only grow), so it purges below P at most.

A lease is a file ``<checkpoint root>/.readers/<stream>/<id>.json`` (the root the archive's
position is read from; the dot keeps it apart from job checkpoints), ``{"from", "expires",
"reader"}``, renewed by a thread every third of its TTL while held. A reader that dies stops
renewing and its lease lapses after `TTL_S`; a reader that stalls past its expiry is no
longer protected, which is why the tail read also checks for a gap and fails loudly.

Pure: `Lease`, `live_floor`. Files: `ReadLease`, `read_leases`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import TierflowError
from runtime.state.files import write_atomic

__all__ = [
    "READERS_DIR",
    "TTL_S",
    "HistoryGap",
    "Lease",
    "ReadLease",
    "live_floor",
    "read_leases",
]

log = logging.getLogger(__name__)

READERS_DIR = ".readers"
TTL_S = 60.0
FORGET_AFTER_S = 600.0  # an expired lease's file is deleted this long after its expiry


class HistoryGap(TierflowError, RuntimeError):
    """Events a reader was to read from the live tail were purged before it read them: its
    answer would be short, so there is none. Running it again reads them from the archive."""

    def __init__(self, stream: str, start: int, first: int) -> None:
        self.stream, self.start, self.first = stream, start, first
        super().__init__(
            f"stream {stream!r}: sequences {start}..{first - 1} were purged from JetStream "
            f"while this read needed them (the archive's position was {start}); the answer "
            f"would miss them, so there is none: run it again (they are in the archive now)"
        )


@dataclass(frozen=True)
class Lease:
    """A reader's claim: stream sequences from `next_seq` on are not purged before
    `expires` (wall-clock seconds)."""

    id: str
    stream: str
    next_seq: int
    expires: float
    reader: str = ""


def live_floor(leases: Iterable[Lease], now: float) -> Lease | None:
    """The unexpired lease reading from the lowest sequence, or None."""
    live = [x for x in leases if x.expires > now]
    return min(live, key=lambda x: x.next_seq) if live else None


def _dir(root: str | Path, stream: str) -> Path:
    return Path(root) / READERS_DIR / stream


def read_leases(root: str | Path, stream: str, now: float | None = None) -> list[Lease]:
    """Every lease file of `stream` under `root` (expired ones included: `live_floor`
    decides); deletes files expired long ago and skips unreadable ones (a write is atomic,
    so only a foreign file is)."""
    now = time.time() if now is None else now
    out: list[Lease] = []
    folder = _dir(root, stream)
    if not folder.is_dir():
        return out
    for path in folder.glob("*.json"):
        try:
            body = json.loads(path.read_bytes())
            lease = Lease(
                id=path.stem,
                stream=stream,
                next_seq=int(body["from"]),
                expires=float(body["expires"]),
                reader=str(body.get("reader") or ""),
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if lease.expires + FORGET_AFTER_S < now:
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        out.append(lease)
    return out


class ReadLease:
    """A held lease (a context manager): at 0 when entered, `move` it to the position
    actually read from; renewed until exit, then deleted. If the lease cannot be written
    (the root is not writable here) the read goes on unprotected, with a warning: the
    tail read's own gap check still refuses a short answer."""

    def __init__(
        self,
        root: str | Path,
        stream: str,
        reader: str = "",
        *,
        ttl_s: float = TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.id = uuid.uuid4().hex[:16]
        self.stream, self.reader, self.ttl_s, self.clock = stream, reader, ttl_s, clock
        self.path = _dir(root, stream) / f"{self.id}.json"
        self.next_seq = 0
        self.held = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _write(self) -> None:
        body = {"from": self.next_seq, "expires": self.clock() + self.ttl_s, "reader": self.reader}
        try:
            write_atomic(self.path, json.dumps(body).encode(), durable=False)
            self.held = True
        except OSError as err:
            self.held = False
            log.warning(
                "stream %s: reader lease %s not written (%r): reading without holding "
                "retention back",
                self.stream,
                self.path,
                err,
            )

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            with self._lock:
                if not self._stop.is_set():
                    self._write()

    def move(self, next_seq: int) -> None:
        """Hold from `next_seq` on (the position the reader reads from)."""
        with self._lock:
            self.next_seq = next_seq
            self._write()

    def __enter__(self) -> ReadLease:
        with self._lock:
            self._write()
        self._thread = threading.Thread(target=self._renew, name="read-lease", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock, contextlib.suppress(OSError):
            self.path.unlink()
