"""What every command group of the `tierflow` CLI shares: consoles, the --config option,
loading the config, and reaching the running tierflow's admin endpoint."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from runtime import runstate
from runtime.config import Config, ConfigError, load
from runtime.tls import client_ssl_context

console = Console()
err_console = Console(stderr=True)

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="tierflow.toml (default: ./tierflow.toml)")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
WideOpt = Annotated[
    bool, typer.Option("--wide", help="every column, nothing cut (wider than the terminal)")
]


def load_config(config: Path | None) -> Config:
    """The config, or exit 2 naming what is wrong in it."""
    try:
        return load(config)
    except ConfigError as err:
        err_console.print(f"[red]config error:[/red] {err}")
        raise typer.Exit(2) from None


def running_state(cfg: Config) -> dict[str, Any] | None:
    """The run-state of a tierflow that runs now (None when none does, or it died)."""
    state = runstate.read_state(cfg)
    if state and runstate.alive(state["process"]["pid"], state["process"]["create_time"]):
        return state
    return None


def fetch_status(cfg: Config, state: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """GET the running tierflow's `/status` (the admin endpoint its run-state names)."""
    url = state["admin"]["url"] + "/status"
    with urllib.request.urlopen(url, timeout=timeout, context=client_ssl_context(cfg)) as resp:
        return json.loads(resp.read())
