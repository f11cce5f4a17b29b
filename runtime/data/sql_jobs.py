"""Continuous SQL jobs (``kind = "sql"``): what a job's query reads and how its rows are keyed.

A sql job is one ``SELECT`` over streams by name, run by the analysis driver as a Spark
streaming query (jobs/sql_jobs.py). Its text passes the same check as ad-hoc SQL
(runtime/data/sql_check.py: no files, no reflection, no ``${``, joins related by a
condition) over the configured streams; what Spark can run incrementally is Spark's to say,
and the driver asks it before the job is wanted.

Its results go to ``results.<job>`` and the results KV one row per key, as every job's do.
The key of a row is, in this order:

- the query's ``key`` column;
- for a query that groups (``GROUP BY``, windows included), the values of its grouped
  columns, joined with ``|`` (a window by its start);
- otherwise (a projection, a join) the row itself: its batch, a digest of its values and
  its ordinal among equal rows of the batch, so a replayed batch keys its rows the same and
  equal rows of two batches are two rows.

Everything here is pure (sqlglot): the config and the CLI check a job without Spark.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from functools import lru_cache

import sqlglot
from sqlglot import exp

from runtime.data.sql_check import CheckedQuery, SqlRefused, check_select, parse_spark
from runtime.job_specs import JobSpec

__all__ = [
    "KEY_COLUMN",
    "SqlJobQuery",
    "check_tables",
    "job_streams",
    "sql_job_query",
    "sql_job_streams",
]

KEY_COLUMN = "key"

# nodes that make a query keep state between micro-batches
_STATEFUL: tuple[type[exp.Expression], ...] = (
    exp.Join,
    exp.Group,
    exp.AggFunc,
    exp.Distinct,
    exp.Window,
)


@dataclass(frozen=True)
class SqlJobQuery:
    """A sql job's checked query: the text to run, the streams it reads, whether it keeps
    state, and where its key comes from (`key_positions`: the output columns whose values
    make the key, by position; empty: the row's own digest)."""

    checked: CheckedQuery
    stateful: bool
    key_positions: tuple[int, ...]
    has_key: bool

    @property
    def streams(self) -> list[str]:
        return sorted(self.checked.tables)


def sql_job_query(sql: str, streams: Collection[str]) -> SqlJobQuery:
    """Check `sql` as a sql job over `streams` (SqlRefused says why not)."""
    return _checked(sql, tuple(sorted(streams)))


def sql_job_streams(sql: str) -> list[str]:
    """The streams a sql job's query names (its tables), without knowing which exist."""
    try:
        root = parse_spark(sql)[0]
    except (sqlglot.errors.SqlglotError, IndexError) as err:
        raise SqlRefused(f"not valid SQL: {str(err).splitlines()[0][:200]}") from None
    ctes = {cte.alias_or_name.lower() for cte in root.find_all(exp.CTE)}
    return sorted({t.name for t in root.find_all(exp.Table) if t.name.lower() not in ctes})


def check_tables(spec: JobSpec, query: SqlJobQuery, kv: Collection[str] = ()) -> None:
    """A sql job's `tables` are streams its query reads, and not all of them (`kv`: the
    KV tables, which a query reads as tables whatever `tables` says)."""
    unread = sorted(set(spec.tables) - set(query.streams))
    if unread:
        raise SqlRefused(f"tables {unread} are not read by the query (it reads {query.streams})")
    kv_named = sorted(set(spec.tables) & set(kv))
    if kv_named:
        raise SqlRefused(f"tables {kv_named} are KV tables, always read as tables: drop them")
    if set(query.streams) <= set(spec.tables) | set(kv):
        raise SqlRefused("a sql job reads at least one stream as a stream, not only tables")


def job_streams(spec: JobSpec, kv: Collection[str] = ()) -> list[str]:
    """The streams a job reads: a sql job's, but its KV tables (`kv`), else its one stream."""
    if spec.kind != "sql":
        return [spec.stream]
    return [s for s in sql_job_streams(spec.sql) if s not in kv]


@lru_cache(maxsize=256)
def _checked(sql: str, streams: tuple[str, ...]) -> SqlJobQuery:
    checked = check_select(sql, streams)
    if not checked.tables:
        raise SqlRefused("a sql job reads at least one stream: name one in FROM")
    root = parse_spark(checked.sql)[0]
    stateful = any(isinstance(n, _STATEFUL) for n in root.walk())
    select = root if isinstance(root, exp.Select) else None
    outputs = select.expressions if select is not None else []
    names = [e.alias_or_name.lower() for e in outputs]
    if KEY_COLUMN in names:
        return SqlJobQuery(checked, stateful, (names.index(KEY_COLUMN),), True)
    positions: tuple[int, ...] = ()
    if select is not None and select.args.get("group"):
        if any(isinstance(e, exp.Star) for e in outputs):
            raise SqlRefused("a grouped sql job names its columns (no *)")
        positions = tuple(i for i, e in enumerate(outputs) if not _aggregates(e))
    return SqlJobQuery(checked, stateful, positions, False)


def _aggregates(node: exp.Expression) -> bool:
    """`node` computes an aggregate (not inside an OVER window: that is per row)."""
    return any(
        isinstance(n, exp.AggFunc) and not isinstance(n.parent, exp.Window) for n in node.walk()
    )
