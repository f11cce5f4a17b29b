"""The analysis driver's retention passes over its archived streams, and what each found.

Exists so that retention (jobs/retention.py's policy, jobs/retention_holds.py's holds,
jobs/archive.py's purge of old days) is one part with its own schedule (every
`RETENTION_S`) and its own event loop (a pass is async NATS work run with `asyncio.run`),
testable and readable apart from the queries. The driver's reconcile thread calls `tick`:
a pass reads the archive's ownership through Spark's file system, so it runs where Spark's
calls are made, and never beside a start or stop of the archive it reads.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from jobs.archive import archive_position, copy_root, owned_root, purge_archive
from jobs.copies import CopyId, acurrent_copy
from jobs.retention_holds import trim as trim_stream

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from jobs.retention import Purge
    from runtime.config import Config
    from runtime.nats.server import NatsEndpoint

log = logging.getLogger(__name__)

__all__ = ["RETENTION_S", "RetentionRunner"]

RETENTION_S = 10.0  # how often archived streams are trimmed (jobs/retention.py)


class RetentionRunner:
    """Trims archived streams; `purges` holds each stream's last pass (for `archives`).

    Args:
        cfg: the streams and their archives' settings.
        nats: where the streams are.
        checkpoint_root: where the archives' checkpoints (their positions) are.
        spark: the driver's Spark session, or None (the archive's file system).
    """

    def __init__(
        self,
        cfg: Config,
        nats: NatsEndpoint,
        checkpoint_root: Path,
        spark: Callable[[], SparkSession | None],
    ) -> None:
        self.cfg, self.nats, self.checkpoint_root, self._spark = cfg, nats, checkpoint_root, spark
        self.purges: dict[str, Purge] = {}
        self._next = 0.0

    def tick(self) -> None:
        """A pass, if one is due (every `RETENTION_S`)."""
        if time.monotonic() >= self._next:
            self._next = time.monotonic() + RETENTION_S
            self.run()

    def archive_of(self, stream: str, here: CopyId) -> bool:
        """Whether the stream's archive positions are of copy `here` and its checkpoint owns
        the copy's archive directory: else nothing is read or purged for them."""
        root = self.cfg.archive_root(stream)
        return owned_root(root, stream, self.checkpoint_root, here, self._spark()) is not None

    def run(self) -> None:
        """Trim each archived stream to its limits, never past what is archived, what a
        copy on another site has not sourced, or what a reader is reading
        (jobs/retention_holds.py); a stream full because one of those lags is logged
        loudly, naming it (every pass until it is not). Drop archived days past
        `retention_days` from the copy's own archive directory (jobs/archive.py
        `copy_root`). A pass that fails (NATS restarting) is logged; the next tries again."""
        archived_streams = {n: s for n, s in self.cfg.streams.items() if s.archive is not None}
        if not archived_streams:
            return
        now = dt.datetime.now(dt.UTC)

        async def trim() -> None:
            nc = await self.nats.connect(name="analysis-retention")
            try:
                for name, s in archived_streams.items():
                    here = await acurrent_copy(nc, name)
                    if not self.archive_of(name, here):
                        continue  # its positions are another copy's: purge nothing here
                    assert s.archive is not None
                    if s.archive.retention_days > 0:
                        root = copy_root(self.cfg.archive_root(name), here)
                        for gone in purge_archive(root, name, s.archive.retention_days, now):
                            log.info("analysis driver: archive of %s: dropped %s", name, gone)
                    if not (s.max_age_s > 0 or s.max_bytes > 0):
                        continue

                    def archived(name: str = name) -> int:
                        pos = archive_position(self.checkpoint_root, name)
                        return pos.next_seq if pos else 1

                    done = await trim_stream(nc, name, s, self.checkpoint_root, here, archived)
                    self.purges[name] = done
                    if done.warning:
                        log.warning("analysis driver: %s", done.warning)
            finally:
                await nc.close()

        try:
            asyncio.run(trim())
        except Exception as err:  # NATS may be restarting: the next pass tries again
            log.warning("analysis driver: retention: %r", err)
