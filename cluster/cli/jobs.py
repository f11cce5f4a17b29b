"""`tierflow jobs list|start|stop|recompute`: analysis jobs in the Spark driver actor."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from cluster.cli.common import ConfigOpt, JsonOpt, WideOpt, err_console, load_config
from cluster.tables import Column, build, print_tables
from runtime.errors import JobError

jobs_app = typer.Typer(help="Analysis jobs in the Spark driver actor.", no_args_is_help=True)

# The narrow view: what an operator looks at first. --wide shows every field a row has.
JOB_COLUMNS = (
    Column("name", max_width=24),
    Column("stream", max_width=12),
    Column("state"),
    Column("committed_seq", "committed", justify="right"),
    Column("was_running", "was running"),
    Column("stopped"),
    Column("error", flex=True),
)


def job_columns(rows: Sequence[dict[str, Any]], wide: bool) -> Sequence[Column]:
    """Narrow: `JOB_COLUMNS`; wide: every key any row has, the name first."""
    if not wide:
        return JOB_COLUMNS
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k != "name", k))
    return [Column(k, k) for k in keys]


def print_jobs(rows: list[dict[str, Any]], *, as_json: bool = False, wide: bool = False) -> None:
    if as_json:
        print(json.dumps(rows, default=str))
        return
    columns = job_columns(rows, wide)
    print_tables(
        lambda w: [build(columns, rows, wide=wide, width=w, title="analysis jobs")], wide=wide
    )


def _call(fn_name: str, config: Path | None, *args: Any) -> list[dict[str, Any]]:
    # Imported here: it loads Ray and the analysis tier (about two seconds).
    from cluster import analysis

    cfg = load_config(config)
    try:
        return getattr(analysis, fn_name)(cfg, *args)
    except (analysis.AnalysisDriverError, JobError) as err:
        err_console.print(f"[red]{err}[/red]")
        raise typer.Exit(1) from None


@jobs_app.command("list")
def jobs_list(config: ConfigOpt = None, as_json: JsonOpt = False, wide: WideOpt = False) -> None:
    """Known and running jobs with their query numbers."""
    print_jobs(_call("jobs_list", config), as_json=as_json, wide=wide)


@jobs_app.command("start")
def jobs_start(
    name: Annotated[str, typer.Argument(help="a job name, `meetup` (all five), or a spec")],
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """Start job(s) in the analysis driver (starting the driver if needed)."""
    print_jobs(_call("jobs_start", config, name), as_json=as_json, wide=wide)


@jobs_app.command("stop")
def jobs_stop(
    name: Annotated[str, typer.Argument(help="a job name or `meetup`")],
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """Stop job(s); their checkpoints stay, so a later start resumes them."""
    print_jobs(_call("jobs_stop", config, name), as_json=as_json, wide=wide)


@jobs_app.command("explain")
def jobs_explain(
    name: Annotated[str, typer.Argument(help="a running sql job's name")],
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A sql job's plan: output mode, key, event time and watermark per stream, and while it
    runs its state per operator, watermark and late events."""
    out: Any = _call("jobs_explain", config, name)
    if as_json:
        print(json.dumps(out, default=str))
        return
    plan = out.pop("plan", "")
    for key, value in out.items():
        shown = value if isinstance(value, str) else json.dumps(value, default=str)
        print(f"{key}: {shown}")
    print("plan:")
    print(plan)


RECOMPUTE_COLUMNS = (
    Column("name", max_width=24),
    Column("kind"),
    Column("high_water", "high water", justify="right"),
    Column("events", justify="right"),
    Column("keys", justify="right"),
    Column("seconds", justify="right"),
    Column("state"),
)


@jobs_app.command("recompute")
def jobs_recompute(
    name: Annotated[str, typer.Argument(help="a running job's name")],
    config: ConfigOpt = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the batch job")] = 3600.0,
    as_json: JsonOpt = False,
) -> None:
    """Recompute a job over its stream's whole history (archive and tail) as a batch view;
    the live view is served merged with it from then on (topn, count, distinct)."""
    rows = _call("jobs_recompute", config, name, timeout)
    if as_json:
        print(json.dumps(rows, default=str))
        return
    print_tables(lambda w: [build(RECOMPUTE_COLUMNS, rows, width=w, title="batch view")])
