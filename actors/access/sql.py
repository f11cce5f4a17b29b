"""`POST /v1/sql`: ad-hoc SQL for consumers (book ch. 8), run by the analysis tier's Spark.

The gateway holds no Spark: it checks the request here (the token, one read-only SELECT
parsed with sqlglot by `runtime.data.sql_check`, the token allowed on every stream the query
names) and hands the query to the analysis driver, which runs it over each stream's
archive plus live tail (jobs/sql.py) and checks it again. Every refusal is a 400/401/403
naming the problem, before anything is read; an unknown table's refusal lists only the
streams the token may read.

A query that names no table (``SELECT 1``, ``SELECT current_timestamp()``) reads no stream,
so no stream's permission covers it: it runs only for a token allowed on every stream (with
auth off, everyone), else 403. It cannot read anything a stream holds, but what a bare
expression can reach is the driver's own, so it is for whom the gateway trusts with all.

The driver runs a bounded number of queries at once; when they all run it answers at once
with 429 and ``Retry-After`` (seconds until the first running query's timeout at most).

Body: ``{"sql": "SELECT ...", "limit": 1000, "timeout_s": 30}``; answer:
``{"columns": [...], "rows": [[...], ...], "truncated": false, "tables": [...]}``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from actors.access.auth import request_token
from actors.access.plane import DataPlane
from actors.access.protocol import Problem, refusal, reply, stream_ref
from runtime.data.sql_check import MAX_SQL_CHARS, SqlRefused, check_select

__all__ = ["MAX_ROWS", "MAX_TIMEOUT_S", "SqlRequest", "SqlRoutes"]

MAX_ROWS = 10_000
MAX_TIMEOUT_S = 300.0
# what the analysis driver answers: {"status": 200, "columns"...} or {"status", "error"}
Runner = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class SqlRequest(msgspec.Struct, forbid_unknown_fields=True):
    sql: str
    limit: int = 1000
    timeout_s: float = 30.0


class SqlRoutes:
    """The `/v1/sql` endpoint of one replica; `run` reaches the analysis driver."""

    def __init__(self, plane: DataPlane, run: Runner) -> None:
        self.plane = plane
        self.run = run

    async def sql(self, request: web.Request) -> web.Response:
        plane = self.plane
        token = request_token(request)
        try:
            plane.access.authenticate(token)
            req = _decode(await request.read())
            refs = [stream_ref(s.config.name) for s in await plane.js.streams_info()]
            tables = {ref.public: ref for ref in refs if not ref.kv}  # KV buckets are no tables
            readable = sorted(n for n, ref in tables.items() if plane.access.may_read(token, ref))
            checked = check_select(req.sql, tables, listed=readable)
            for name in sorted(checked.tables):
                plane.access.authorize(token, stream_ref(name))
            public = [n for n, ref in tables.items() if ref.js not in plane.access.internal]
            if not checked.tables and len(readable) < len(public):
                raise Problem(
                    403,
                    "a query that names no table needs a token allowed on every stream: "
                    "name the streams it is about",
                )
        except SqlRefused as err:
            return self._refuse(Problem(400, str(err)))
        except Problem as p:
            return self._refuse(p)
        plane.counters["sql_queries"] = plane.counters.get("sql_queries", 0) + 1
        answer = await self.run(
            {
                "sql": req.sql,
                "limit": req.limit,
                "timeout_s": req.timeout_s,
                # none named: the token may read every stream (checked above)
                "allowed": sorted(checked.tables) if checked.tables else None,
            }
        )
        status = int(answer.pop("status", 500))
        if status in (429, 503) and "retry_after_s" in answer:  # busy, or a purge got past
            wait = max(1, int(answer.get("retry_after_s", 1)))
            busy = self._refuse(Problem(status, str(answer.get("error")), retry_after_s=wait))
            busy.headers["Retry-After"] = str(wait)
            return busy
        if status != 200:
            return self._refuse(Problem(status, str(answer.get("error", "query failed"))))
        return reply(200, answer)

    def _refuse(self, p: Problem) -> web.Response:
        self.plane.count(p)
        return refusal(p)


def _decode(body: bytes) -> SqlRequest:
    """The request, or Problem 400 naming what is wrong with it."""
    if len(body) > MAX_SQL_CHARS + 1024:
        raise Problem(400, f"the body is over {MAX_SQL_CHARS + 1024} bytes")
    try:
        req = msgspec.json.decode(body, type=SqlRequest)
    except (msgspec.DecodeError, UnicodeDecodeError) as err:
        raise Problem(400, f'the body must be JSON {{"sql": "SELECT ..."}}: {err}') from None
    if not 1 <= req.limit <= MAX_ROWS:
        raise Problem(400, f"limit must be 1 to {MAX_ROWS}")
    if not 0 < req.timeout_s <= MAX_TIMEOUT_S:
        raise Problem(400, f"timeout_s must be over 0 and at most {MAX_TIMEOUT_S:g}")
    return req
