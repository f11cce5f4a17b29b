"""The stream's history from the operator's side: `tierflow sql` and `tierflow archive status`.

Both read what the analysis tier wrote (the archive's Parquet and its checkpoint) and what
JetStream still holds; neither needs the running pipeline, only NATS. `tierflow sql`
starts its own local Spark session (a cold start of a few seconds) and runs one checked
query (jobs/sql.py) over the tables the config names: every stream, `results` included.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
from typing import TYPE_CHECKING, Any

from jobs.archive import archive_position, archive_query_name, owned_root, queries_root
from jobs.copies import CopyError, acurrent_copy, current_copy, read_copy
from jobs.sql import SqlResult, StreamTable, run_sql, tables_for
from runtime import runstate
from runtime.config import Config
from runtime.data.sql_check import check_select
from runtime.errors import TierflowError
from runtime.nats.server import NatsEndpoint

if TYPE_CHECKING:
    from nats.aio.client import Client
    from pyspark.sql import SparkSession

__all__ = ["NoNats", "archive_rows", "archive_status", "endpoint", "query", "sql_tables"]


class NoNats(TierflowError, RuntimeError):
    """No NATS to read from: neither `nats.url` nor a running tierflow names one."""


def endpoint(cfg: Config, role: str, name: str) -> NatsEndpoint:
    url = runstate.nats_url(cfg)
    if not url:
        raise NoNats("no NATS URL: set nats.url, or start tierflow with `tierflow up`")
    return NatsEndpoint.from_config(cfg, role, url=url, name=name)


def sql_tables(cfg: Config) -> dict[str, StreamTable]:
    """One table per configured stream, archives read where the driver keeps them."""
    return tables_for(cfg, queries_root(cfg))


def on_this_copy(
    tables: dict[str, StreamTable], nats: NatsEndpoint, spark: SparkSession | None = None
) -> dict[str, StreamTable]:
    """`tables` with each archive read from the directory of the copy `nats` reads
    (jobs/archive.py `owned_root`), and left out where its positions are another copy's or
    its checkpoint does not own that directory: then the table is the copy's own retained
    events, as the driver's /v1/sql reads it (docs/geo.md). `spark` reaches a remote
    archive's owner record."""
    out = dict(tables)
    for name, t in tables.items():
        if t.archive_root is None or t.checkpoint_root is None:
            continue
        root = owned_root(t.archive_root, name, t.checkpoint_root, current_copy(nats, name), spark)
        if root is None:
            out[name] = dataclasses.replace(t, archive_root=None, checkpoint_root=None)
        else:
            out[name] = dataclasses.replace(t, archive_root=root)
    return out


def query(
    cfg: Config,
    text: str,
    *,
    limit: int = 1_000,
    timeout_s: float = 60.0,
    spark: SparkSession | None = None,
) -> SqlResult:
    """Run one query (SqlRefused / SqlTimeout say why not) in `spark` or a local session."""
    from jobs.jetstream import register
    from runtime.engines.services import spark_session

    tables = sql_tables(cfg)
    check_select(text, tables)  # a refusal costs no Spark start
    nats = endpoint(cfg, "analysis", "tierflow-sql")
    own = spark is None
    session = spark if spark is not None else spark_session(cfg, app_name="tierflow-sql")
    try:
        if own:
            register(session)
        tables = on_this_copy(tables, nats, session)
        return run_sql(session, nats, text, tables, limit=limit, timeout_s=timeout_s)
    finally:
        if own:
            session.stop()


def archive_rows(
    cfg: Config, states: dict[str, Any], now: dt.datetime | None = None
) -> list[dict[str, Any]]:
    """Per archived stream: archived up to which sequence, what the stream holds, and the
    lag in events and seconds (`states[name]`: first/last sequence and the time of the
    first event not archived yet, as `archive_status` reads them)."""
    now = now or dt.datetime.now(dt.UTC)
    ckpt = queries_root(cfg)
    rows = []
    for name, s in cfg.streams.items():
        if s.archive is None:
            continue
        st = states.get(name, {})
        pos = archive_position(ckpt, name, copy=st.get("copy"))
        next_seq = pos.next_seq if pos else 1
        last = int(st.get("last_seq", 0))
        oldest: dt.datetime | None = st.get("oldest_unarchived")
        rows.append(
            {
                "stream": name,
                "path": cfg.archive_root(name),
                "archived_to_seq": next_seq - 1,
                "stream_first_seq": st.get("first_seq"),
                "stream_last_seq": last,
                "lag_events": max(0, last - (next_seq - 1)),
                "lag_s": round((now - oldest).total_seconds(), 1) if oldest else 0.0,
                "lost_before_archive": pos.skipped if pos else 0,
                "batches": pos.batch_id + 1 if pos else 0,
                "other_copy": bool(st.get("other_copy")),
            }
        )
    return rows


async def _stream_states(nc: Client, cfg: Config) -> dict[str, Any]:
    from nats.js.errors import NotFoundError

    js = nc.jetstream()
    ckpt = queries_root(cfg)
    out: dict[str, Any] = {}
    for name, s in cfg.streams.items():
        if s.archive is None:
            continue
        try:
            state = (await js.stream_info(name)).state
        except NotFoundError:
            continue
        try:
            copy = await acurrent_copy(nc, name)
        except CopyError:
            copy = None
        recorded = read_copy(ckpt / archive_query_name(name))
        pos = archive_position(ckpt, name, copy=copy)
        next_seq = max(pos.next_seq if pos else 1, state.first_seq)
        oldest = None
        if next_seq <= state.last_seq:
            with contextlib.suppress(NotFoundError):
                msg = await js.get_msg(name, seq=next_seq, subject=">", next=True)
                oldest = msg.time
        out[name] = {
            "first_seq": state.first_seq,
            "last_seq": state.last_seq,
            "oldest_unarchived": oldest,
            "copy": copy,
            "other_copy": recorded is not None and copy is not None and recorded != copy,
        }
    return out


def archive_status(cfg: Config) -> list[dict[str, Any]]:
    """`archive_rows` with the streams' state read from NATS now."""

    async def read() -> dict[str, Any]:
        nc = await endpoint(cfg, "admin", "tierflow-archive").connect()
        try:
            return await _stream_states(nc, cfg)
        finally:
            await nc.close()

    return archive_rows(cfg, asyncio.run(read()))
