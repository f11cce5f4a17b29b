"""`tierflow chaos list|run`: the fault-injection suite from the command line."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from cluster.chaos import report, scenarios
from cluster.cli.common import JsonOpt, WideOpt, console
from cluster.tables import Column, build, print_tables

app = typer.Typer(help="Fault injection with a zero-loss verdict.", no_args_is_help=True)

SCENARIO_COLUMNS = (
    Column("scenario"),
    Column("what", flex=True),
    Column("schedule", flex=True),
)


@app.command("list")
def list_(
    seed: Annotated[int, typer.Option(help="show the schedule this seed gives")] = 1,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """The scenarios and the faults each applies for SEED (fractions of the load window)."""
    rows = [
        {
            "scenario": s.name,
            "what": s.summary,
            "schedule": scenarios.schedule_text(s, seed),
        }
        for s in scenarios.SCENARIOS.values()
    ]
    if as_json:
        print(json.dumps(rows))
        return
    title = f"chaos scenarios (seed {seed})"
    print_tables(
        lambda w: [build(SCENARIO_COLUMNS, rows, wide=wide, width=w, title=title)], wide=wide
    )


@app.command()
def run(
    scenario: Annotated[
        str, typer.Option("--scenario", "-s", help="a name (tierflow chaos list) or all")
    ] = "all",
    events: Annotated[int, typer.Option(help="events with known ids per scenario")] = 2000,
    rate: Annotated[float, typer.Option(help="events per second (slowed to fit faults)")] = 500.0,
    seed: Annotated[int, typer.Option(help="the schedule is a function of scenario+seed")] = 1,
    report_dir: Annotated[Path, typer.Option(help="where the JSON and table go")] = Path("reports"),
    workdir: Annotated[
        Path | None, typer.Option(help="keep state here (default: temporary)")
    ] = None,
    wide: WideOpt = False,
) -> None:
    """Deploy, load, inject the scenario's faults, verify; exit 1 unless every scenario
    lost and duplicated nothing acknowledged. The report's files hold every column."""
    # Imported here: the runner loads Ray, NATS and the whole pipeline.
    from cluster.chaos.runner import RunOptions, run_all

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("cluster.chaos").setLevel(logging.INFO)
    try:
        chosen = scenarios.resolve(scenario)
    except KeyError as err:
        console.print(f"[red]{err.args[0]}[/red]")
        raise typer.Exit(2) from None
    opts = RunOptions(events=events, rate=rate, seed=seed, workdir=workdir)
    reports = asyncio.run(run_all(chosen, opts))
    print_tables(lambda w: [report.table(reports, wide=wide, width=w)], wide=wide)
    path = report.write(reports, report_dir)
    console.print(f"report: {path} (table: {path.with_suffix('.txt')})")
    if not all(r.ok for r in reports):
        raise typer.Exit(1)
