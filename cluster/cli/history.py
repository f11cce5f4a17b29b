"""`tierflow sql "SELECT ..."`, `tierflow archive status` and `tierflow audit`: the streams'
history, and what they hold judged.

SQL prints a readable table by default, ``--json`` (one object a row) or ``--csv``; a
query that is refused or runs past ``--timeout`` exits 1 with the reason on stderr.
"""

from __future__ import annotations

import asyncio
import csv
import json
import sys
from typing import Annotated, Any

import typer

from cluster.cli.common import ConfigOpt, JsonOpt, WideOpt, console, err_console, load_config
from cluster.tables import Column, build, print_tables

archive_app = typer.Typer(help="The streams' long-term archive (Parquet).", no_args_is_help=True)

ARCHIVE_COLUMNS = (
    Column("stream", max_width=20),
    Column("archived_to_seq", "archived to", justify="right"),
    Column("stream_last_seq", "stream last", justify="right"),
    Column("lag_events", "lag events", justify="right"),
    Column("lag_s", "lag s", justify="right"),
    Column("lost_before_archive", "lost", justify="right"),
    Column("path", flex=True),
)


def sql(
    query: Annotated[str, typer.Argument(help="one SELECT over the streams (and `results`)")],
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="CSV with a header row")] = False,
    limit: Annotated[int, typer.Option("--limit", min=1, help="rows at most")] = 1000,
    timeout: Annotated[float, typer.Option("--timeout", min=0.1, help="seconds")] = 120.0,
    wide: WideOpt = False,
) -> None:
    """Ad-hoc Spark SQL over every stream (archive plus live tail) and the results."""
    from cluster.history import NoNats
    from cluster.history import query as run
    from jobs.sql import SqlTimeout, plain
    from runtime.data.sql_check import SqlRefused

    cfg = load_config(config)
    try:
        result = run(cfg, query, limit=limit, timeout_s=timeout)
    except (SqlRefused, SqlTimeout, NoNats) as err:
        err_console.print(f"[red]{err}[/red]")
        raise typer.Exit(1) from None
    rows = [dict(zip(result.columns, map(plain, r), strict=True)) for r in result.rows]
    if as_json:
        print(json.dumps(rows))
    elif as_csv:
        out = csv.writer(sys.stdout)
        out.writerow(result.columns)
        for r in rows:
            out.writerow(json.dumps(v) if isinstance(v, dict | list) else v for v in r.values())
    else:
        columns = [Column(c, c, max_width=40) for c in result.columns]
        print_tables(lambda w: [build(columns, rows, wide=wide, width=w)], wide=wide)
    if result.truncated:
        err_console.print(f"[yellow]more rows than --limit {limit}; the first {limit} shown")


@archive_app.command("status")
def archive_status(
    config: ConfigOpt = None, as_json: JsonOpt = False, wide: WideOpt = False
) -> None:
    """Per archived stream: archived up to which sequence, and the lag."""
    from cluster.history import NoNats
    from cluster.history import archive_status as read

    cfg = load_config(config)
    try:
        rows = read(cfg)
    except NoNats as err:
        err_console.print(f"[red]{err}[/red]")
        raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(rows, default=str))
        return
    if not rows:
        err_console.print("no stream has an archive: add [streams.<name>.archive] to the config")
        return
    print_tables(
        lambda w: [build(ARCHIVE_COLUMNS, rows, wide=wide, width=w, title="archive")], wide=wide
    )
    for row in rows:
        if row.get("other_copy"):
            err_console.print(
                f"[yellow]{row['stream']}: the archive holds positions of another copy of the "
                "stream (another site, or the stream was recreated); the driver will not resume "
                "it here (docs/geo.md, Analysis on another copy)[/yellow]"
            )


AUDIT_COLUMNS = (
    Column("stream", max_width=20),
    Column("events", justify="right"),
    Column("without_id", "without id", justify="right"),
    Column("ids_stored_twice", "ids stored twice", justify="right"),
)


def audit(
    config: ConfigOpt = None,
    stream: Annotated[
        list[str] | None, typer.Option("--stream", "-s", help="these streams (default: every one)")
    ] = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """Read back every stream of the running tierflow: no event id stored twice. The
    verdict also goes to the console's "last verifier run"; exit 1 unless ok."""
    from cluster.audit import SYSTEM
    from cluster.audit import audit as run_audit
    from cluster.history import NoNats, endpoint

    cfg = load_config(config)
    names = list(stream or [s for s in cfg.streams if s not in SYSTEM])
    unknown = sorted(set(names) - set(cfg.streams))
    if unknown:
        err_console.print(f"[red]no stream {unknown} in the config[/red]")
        raise typer.Exit(2)

    async def go() -> dict[str, Any]:
        nc = await endpoint(cfg, "admin", "tierflow-audit").connect()
        try:
            return await run_audit(nc, names)
        finally:
            await nc.close()

    try:
        verdict = asyncio.run(go())
    except NoNats as err:
        err_console.print(f"[red]{err}[/red]")
        raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(verdict, default=str))
    else:
        rows = [{"stream": n, **s} for n, s in verdict["streams"].items()]
        print_tables(
            lambda w: [build(AUDIT_COLUMNS, rows, wide=wide, width=w, title="audit")], wide=wide
        )
        console.print(f"verdict: {verdict['verdict']} {verdict['why']}")
    if verdict["verdict"] != "ok":
        raise typer.Exit(1)
