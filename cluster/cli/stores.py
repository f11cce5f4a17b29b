"""`tierflow logger inspect|settle` and `tierflow checkpoint repair`: the LevelDB stores the
runtime's actors keep under the state directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from cluster.cli.common import (
    ConfigOpt,
    JsonOpt,
    WideOpt,
    console,
    err_console,
    fetch_status,
    load_config,
    running_state,
)
from cluster.tables import Column, build, print_tables
from runtime.state.checkpoint import CheckpointError, CheckpointLockedError, CheckpointStore

logger_app = typer.Typer(help="The MessageLogger's stores.", no_args_is_help=True)
checkpoint_app = typer.Typer(help="LevelDB checkpoints of actors.", no_args_is_help=True)

LOGGER_COLUMNS = (
    Column("replica", flex=True),
    Column("state", max_width=24, flex=True),
    Column("transient", "pending", justify="right"),
    Column("failed", justify="right"),
    Column("parked", justify="right"),
    Column("bytes", justify="right"),
    Column("epoch", justify="right"),
    Column("catching_up", "catching up"),
    Column("pid", justify="right", wide_only=True),
    Column("error", wide_only=True),
    Column("path", wide_only=True),
)


@logger_app.command("inspect")
def logger_inspect(
    config: ConfigOpt = None, as_json: JsonOpt = False, wide: WideOpt = False
) -> None:
    """Pending (transient), failed and parked counts per logger replica: asked of the live
    replicas when tierflow runs, read from their LevelDB stores when it does not. Parked
    entries are never retried on their own: settle them with `tierflow logger settle`."""
    cfg = load_config(config)
    state = running_state(cfg)
    if state is not None:
        rows = fetch_status(cfg, state).get("loggers", [])
    else:
        # Imported here: the logger package loads Ray (about a second) for its live parts.
        from actors.queue.logger import inspect

        rows = inspect(cfg.state_path)
    if as_json:
        print(json.dumps(rows))
        return
    title = f"logger stores under {cfg.state_path / 'logger'}"
    print_tables(
        lambda w: [build(LOGGER_COLUMNS, rows, wide=wide, width=w, title=title)], wide=wide
    )
    if any(r.get("parked") for r in rows):
        console.print(
            "Parked entries are not retried on their own (poison dead-lettered with its body "
            "cut, or past the dedup window with absence unproven). With tierflow stopped: "
            "`tierflow logger settle GROUP --list`, then `--retry` (the bridge checks again "
            "and resends only what it proves absent) or `--forget` (seen stored, or given up)."
        )


@logger_app.command("settle")
def logger_settle(
    group: Annotated[str, typer.Argument(help="logger group, e.g. logger")],
    keys: Annotated[
        list[str] | None, typer.Argument(help="STREAM/ID of parked entries (default: all)")
    ] = None,
    retry: Annotated[bool, typer.Option("--retry", help="make them due now")] = False,
    forget: Annotated[bool, typer.Option("--forget", help="drop them from the log")] = False,
    list_only: Annotated[bool, typer.Option("--list", help="only list them")] = False,
    config: ConfigOpt = None,
) -> None:
    """List or settle the parked entries of a logger group in its stopped stores."""
    # Imported here: the logger package loads Ray (about a second) for its live parts.
    from actors.queue.logger import LogStore, settle_parked

    cfg = load_config(config)
    if list_only + retry + forget != 1:
        err_console.print("give exactly one of --list, --retry, --forget")
        raise typer.Exit(2)
    try:
        if list_only:
            rows: list[dict[str, Any]] = []
            root = cfg.state_path / "logger"
            for path in sorted(root.glob(f"{group}-*")):
                store = LogStore(path, max_events=1 << 62, max_bytes=1 << 62, open_timeout_s=1)
                try:
                    rows += [{"replica": path.name, **p} for p in store.parked(1 << 62)]
                finally:
                    store.close()
            print(json.dumps(rows))
            return
        chosen = [tuple(k.split("/", 1)) for k in keys] if keys else None
        if chosen is not None and any(len(k) != 2 for k in chosen):
            err_console.print("keys are STREAM/ID")
            raise typer.Exit(2)
        action = "retry" if retry else "forget"
        done = settle_parked(cfg.state_path, group, action, chosen)  # type: ignore[arg-type]
    except CheckpointLockedError:
        err_console.print("the logger stores are in use: stop tierflow first (tierflow down)")
        raise typer.Exit(3) from None
    except FileNotFoundError as err:
        err_console.print(str(err))
        raise typer.Exit(1) from None
    print(json.dumps(done))


@checkpoint_app.command("repair")
def checkpoint_repair(path: Path) -> None:
    """Repair a corrupt LevelDB checkpoint in place (what survives is kept)."""
    try:
        CheckpointStore.repair(path)
        CheckpointStore(path, create=False).close()  # proves it opens again
        console.print(f"repaired {path}")
    except CheckpointError as err:
        err_console.print(f"[red]{err}[/red]")
        raise typer.Exit(1) from None
