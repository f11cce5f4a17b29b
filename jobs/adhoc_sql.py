"""Ad-hoc SQL in the analysis driver's Spark: the gateway's ``/v1/sql`` answered as a status
and rows, and the table a batch reads a stream's history from on this copy.

Exists so that everything an ad-hoc query needs besides the Spark session (the check and
the caller's tables, admission with a 429 when `sql_slots` queries run, a session of its
own settings, the archive of this copy only, each failure as its HTTP status) is one part
the driver's `sql` method hands the call to, apart from the streaming queries. It runs on
the driver's SQL threads (a Ray concurrency group), never on the control methods'; it
makes no Spark control call (jobs/driver.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.archive import owned_root
from jobs.read_lease import HistoryGap
from jobs.spark_session import SQL_POOL
from jobs.sql import SqlTimeout, StreamTable, json_result, run_sql, tables_for
from jobs.sql_admission import SqlAdmission, sql_slots
from runtime.data.sql_check import SqlRefused, check_select

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from jobs.copies import CopyId
    from runtime.config import Config
    from runtime.nats.server import NatsEndpoint

log = logging.getLogger(__name__)

__all__ = ["AdhocSql"]


class AdhocSql:
    """Answers ad-hoc queries; `table` is also what recomputes read (jobs/generations.py).

    Args:
        cfg: the streams (their tables and archives) and `spark.sql_slots`.
        nats: where the streams are.
        checkpoint_root: where the archives' checkpoints (their positions) are.
        copy_of: the copy of a stream the driver reads now (jobs/copy_tracker.py).
    """

    def __init__(
        self,
        cfg: Config,
        nats: NatsEndpoint,
        checkpoint_root: Path,
        copy_of: Callable[[str], CopyId],
    ) -> None:
        self.cfg, self.nats, self.checkpoint_root, self.copy_of = (
            cfg,
            nats,
            checkpoint_root,
            copy_of,
        )
        self.gate = SqlAdmission(sql_slots(cfg))
        self._init = threading.Lock()
        self._sessions: tuple[SparkSession, SparkSession] | None = None

    def table(self, stream: str, here: CopyId, spark: SparkSession | None) -> StreamTable:
        """The stream's table on copy `here`: with the archive in `here`'s own directory,
        and only if the archive is of this copy (an archive's position is a sequence of the
        copy it archived) and its checkpoint owns that directory (jobs/archive.py)."""
        table = tables_for(self.cfg, self.checkpoint_root).get(stream) or StreamTable(stream)
        if table.archive_root is None:
            return table
        at = owned_root(table.archive_root, stream, self.checkpoint_root, here, spark)
        if at is None:
            return StreamTable(stream, schema=table.schema)
        return StreamTable(stream, at, table.checkpoint_root, table.schema)

    def answer(
        self,
        spark: SparkSession,
        sql: str,
        limit: int,
        timeout_s: float,
        allowed: Sequence[str] | None,
    ) -> dict[str, Any]:
        """``{"status": 200, "columns", "rows", "truncated", "tables"}``, or ``{"status":
        400|503|504|500, "error"}``, or ``{"status": 429, "retry_after_s"}`` while
        `sql_slots` queries run already (a refusal is a 400 whatever the load). `allowed`:
        the streams the caller may read (None: all; a query naming no table needs all)."""
        gate = self.gate
        allow = set(allowed) if allowed is not None else None
        ticket: int | None = None
        try:
            tables = tables_for(self.cfg, self.checkpoint_root)
            readable = sorted(t for t in tables if allow is None or t in allow)
            check_select(sql, tables, listed=readable)  # a refusal is a 400 whatever the load
            ticket = gate.enter(timeout_s)
            if ticket is None:
                wait = gate.retry_after_s()
                return {
                    "status": 429,
                    "retry_after_s": wait,
                    "error": f"{gate.slots} SQL queries run already: retry after {wait} s",
                }
            for stream, table in tables.items():  # an archive of another copy is left out
                if table.archive_root is not None:
                    tables[stream] = self.table(stream, self.copy_of(stream), spark)
            result = run_sql(
                self._session(spark),
                self.nats,
                sql,
                tables,
                limit=limit,
                timeout_s=timeout_s,
                allowed=lambda stream: allow is None or stream in allow,
                pool=SQL_POOL,
            )
        except SqlRefused as err:
            return {"status": 400, "error": str(err)}
        except SqlTimeout as err:
            return {"status": 504, "error": str(err)}
        except HistoryGap as err:  # retention got past the read: the same query answers next
            return {"status": 503, "error": str(err), "retry_after_s": 1}
        except Exception as err:
            log.exception("analysis driver: sql")
            return {"status": 500, "error": f"the query failed: {err}"[:1000]}
        finally:
            if ticket is not None:
                gate.leave(ticket)
        return {"status": 200, **json_result(result)}

    def _session(self, spark: SparkSession) -> SparkSession:
        """The session ad-hoc SQL runs in: `sql_session` of `spark`, one per Spark session
        (made on first use, by whichever SQL thread)."""
        with self._init:
            made = self._sessions
            if made is None or made[0] is not spark:
                from jobs.jetstream import register
                from jobs.spark_session import sql_session

                own = sql_session(spark)
                register(own)
                made = self._sessions = (spark, own)
            return made[1]
