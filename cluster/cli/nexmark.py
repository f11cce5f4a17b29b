"""`tierflow nexmark load|queries`: Nexmark events into a running tierflow, and its queries."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import typer

from cluster.cli.common import ConfigOpt, JsonOpt, err_console, load_config

nexmark_app = typer.Typer(
    help="The Nexmark benchmark's events and queries (docs/sql-jobs.md).", no_args_is_help=True
)


@nexmark_app.command("load")
def nexmark_load(
    events: Annotated[int, typer.Option(help="events to publish")] = 1_000_000,
    first: Annotated[int, typer.Option(help="the first event's number")] = 0,
    rate: Annotated[int, typer.Option(help="events per second of event time")] = 10_000,
    disorder: Annotated[int, typer.Option(help="events shuffled together (1: in order)")] = 100,
    seed: Annotated[int, typer.Option(help="the generator's seed")] = 0,
    prefix: Annotated[str, typer.Option(help="subjects <prefix>.person|auction|bid")] = "nexmark",
    config: ConfigOpt = None,
) -> None:
    """Publish Nexmark events straight into JetStream (the streams of `[streams.person]`,
    `auction` and `bid`, created when missing: cluster/nexmark/queries.py `nexmark_streams`)."""
    from rich.progress import Progress

    from cluster.history import NoNats, endpoint
    from cluster.nexmark.generator import Generator
    from cluster.nexmark.load import ensure_streams, load
    from cluster.nexmark.queries import nexmark_streams

    cfg = load_config(config)
    try:
        nats = endpoint(cfg, "admin", "tierflow-nexmark")
    except NoNats as err:
        err_console.print(f"[red]{err}[/red]")
        raise typer.Exit(1) from None
    gen = Generator(seed=seed, rate=rate, disorder=disorder)
    streams = {
        name: {**spec, "subjects": [f"{prefix}.{name}"]} for name, spec in nexmark_streams().items()
    }

    async def go() -> None:
        nc = await nats.connect()
        try:
            await ensure_streams(nc, streams)
            with Progress() as bar:
                task = bar.add_task("nexmark", total=events)
                report = await load(
                    nc, gen, first, events, prefix=prefix, on_batch=lambda n: bar.advance(task, n)
                )
            print(
                f"{report.events:,} events stored ({report.duplicates:,} already there) in "
                f"{report.seconds:.1f} s: {report.per_stream}"
            )
        finally:
            await nc.close()

    asyncio.run(go())


@nexmark_app.command("queries")
def nexmark_queries(as_json: JsonOpt = False) -> None:
    """The Nexmark queries tierflow runs as sql jobs, and why the others do not run."""
    from cluster.nexmark.queries import NOT_RUN, QUERIES

    if as_json:
        print(json.dumps({"queries": QUERIES, "not_run": NOT_RUN}))
        return
    for name, sql in QUERIES.items():
        print(f"{name}: {sql}")
    for name, why in NOT_RUN.items():
        print(f"{name}: not run: {why}")
