"""`tierflow status` and `tierflow scale`: reading and resizing the running runtime through
its admin endpoint (never by joining Ray: a Ray driver costs seconds to start)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table
from rich.text import Text

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
from cluster.roles import LOAD_FIELD
from cluster.tables import Column, build, print_tables
from runtime.config import Config
from runtime.tls import client_ssl_context

Roles = Annotated[str, typer.Argument(help="collector, logger, bridge or gateway")]


def status(
    config: ConfigOpt = None,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    watch: Annotated[float, typer.Option(help="refresh every N seconds (0: once)")] = 0.0,
    count: Annotated[
        int, typer.Option(help="with --watch, stop after N refreshes (0: until Ctrl-C)")
    ] = 0,
) -> None:
    """Services, nodes, supervised actors and their restarts, roles, analysis lag."""
    cfg = load_config(config)
    n = 0
    while True:
        state = running_state(cfg)
        if state is None:
            if as_json:
                print(json.dumps({"running": False}))
            else:
                console.print("tierflow is not running")
            raise typer.Exit(3)
        try:
            snap = {"running": True, **fetch_status(cfg, state)}
        except (urllib.error.URLError, OSError) as err:
            err_console.print(f"[red]admin endpoint did not answer:[/red] {err}")
            raise typer.Exit(1) from None
        if as_json:
            print(json.dumps(snap))
        else:
            print_status(snap, wide=wide)
        n += 1
        if not watch or (count and n >= count):
            return
        time.sleep(watch)


def print_status(snap: Mapping[str, Any], *, wide: bool = False) -> None:
    console.print(f"[bold]tierflow[/bold] pid {snap['pid']}  up {snap['uptime_s']} s")
    print_tables(lambda width: status_tables(snap, wide=wide, width=width), wide=wide)
    if snap.get("escalated"):
        console.print(f"[red]escalated:[/red] {snap['escalated']}")


# --------------------------------------------------------------------------- status tables


def _yes_no(value: Any) -> Text:
    if value is None:
        return Text("-")
    return Text("yes", style="green") if value else Text("no", style="red")


SERVICE_COLUMNS = (
    Column("service"),
    Column("healthy", show=_yes_no),
    Column("where", flex=True),
)
NODE_COLUMNS = (
    Column("node_id", "node", max_width=12),
    Column("address", flex=True),
    Column("alive"),
    Column("cpus", justify="right"),
)
CHILD_COLUMNS = (
    Column("name", "actor", flex=True),
    Column("state", wide_only=True),
    Column("alive"),
    Column("restarts", justify="right"),
    Column("pid", justify="right"),
    Column("node_id", "node", max_width=12),
)
ROLE_COLUMNS = (
    Column("role"),
    Column("replicas", show=lambda v: v),
    Column("per_node", "per node", wide_only=True),
    Column("load", max_width=16),
    Column("rates", "rates /s", flex=True),
    Column("autoscaling", "auto"),
    Column("reason", "autoscaling reason", wide_only=True),
)
# What a role's load counts, short enough for the narrow table (`LOAD_FIELD` names the field).
LOAD_UNIT = {
    "collector": "requests",
    "logger": "pending",
    "bridge": "in flight",
    "gateway": "clients",
}

QUERY_COLUMNS = (
    Column("name", "query", flex=True),
    Column("state"),
    Column("committed_seq", "committed seq", justify="right"),
    Column("lag", "lag (events)", justify="right"),
)

REPLICATION_COLUMNS = (
    Column("stream"),
    Column("site"),
    Column("from", "from site"),
    Column("lag", "lag (events)", justify="right"),
    Column("active_s", "last heard (s)", justify="right", wide_only=True),
    Column("error", flex=True),
)


def replication_rows(snap: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per stream copy and origin site (runtime/geo/replication.py `lag_rows`)."""
    return [
        {**r, "error": r.get("error") or ("" if r.get("up") else "copy does not answer")}
        for r in snap.get("replication") or []
    ]


def role_rows(snap: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row a role: replicas (and how many did not answer), per node, load, rates, and
    how many replicas the autoscaler wants and why."""
    auto = snap.get("autoscaling") or {}
    out = []
    for role, view in (snap.get("roles") or {}).items():
        rows = view.get("replicas", [])
        per_node: dict[str, int] = {}
        for r in rows:
            key = str(r.get("node") or "?")[:8]
            per_node[key] = per_node.get(key, 0) + 1
        down = sum(1 for r in rows if "error" in r)
        replicas = Text(str(len(rows)))
        if down:
            replicas.append(f" ({down} silent)", style="red")
        a = auto.get(role) or {}
        out.append(
            {
                "role": role,
                "replicas": replicas,
                "per_node": " ".join(f"{n}:{c}" for n, c in sorted(per_node.items())),
                "load": f"{view.get('load', 0):g} {LOAD_UNIT.get(role, LOAD_FIELD[role])}",
                "rates": " ".join(f"{k} {v:g}" for k, v in (view.get("rates") or {}).items()),
                "autoscaling": f"-> {a['desired']}" if a else "",
                "reason": a.get("reason", ""),
            }
        )
    return out


def status_tables(snap: Mapping[str, Any], *, wide: bool = False, width: int = 80) -> list[Table]:
    """The tables of `tierflow status` (pure: a /status snapshot in, tables out)."""
    services = [
        {
            "service": name,
            "healthy": svc.get("healthy"),
            "where": svc.get("url") or svc.get("address") or svc.get("master") or "",
        }
        for name, svc in (snap.get("services") or {}).items()
    ]
    nodes = (snap.get("services") or {}).get("ray", {}).get("nodes", [])
    tables = [
        build(SERVICE_COLUMNS, services, wide=wide, width=width, title="services"),
        build(NODE_COLUMNS, nodes, wide=wide, width=width, title="ray nodes"),
        build(
            CHILD_COLUMNS,
            snap.get("children", []),
            wide=wide,
            width=width,
            title="supervised actors",
        ),
    ]
    if snap.get("roles"):
        tables.append(build(ROLE_COLUMNS, role_rows(snap), wide=wide, width=width, title="roles"))
    queries = (snap.get("analysis") or {}).get("queries") or []
    if queries:
        tables.append(build(QUERY_COLUMNS, queries, wide=wide, width=width, title="analysis"))
    if snap.get("replication"):
        rows = replication_rows(snap)
        tables.append(build(REPLICATION_COLUMNS, rows, wide=wide, width=width, title="geo"))
    return tables


# --------------------------------------------------------------------------- scale


def scale(
    role: Roles, replicas: Annotated[int, typer.Argument(min=1)], config: ConfigOpt = None
) -> None:
    """Resize a role of the running runtime; scale-down drains, nothing accepted is lost."""
    cfg = load_config(config)
    state = running_state(cfg)
    if state is None:
        err_console.print("tierflow is not running")
        raise typer.Exit(3)
    req = urllib.request.Request(
        state["admin"]["url"] + "/scale",
        data=json.dumps({"role": role, "replicas": replicas}).encode(),
        headers={"Content-Type": "application/json"},
    )
    result: dict[str, Any] = {}

    def post() -> None:
        try:
            with urllib.request.urlopen(req, timeout=900, context=client_ssl_context(cfg)) as r:
                result["body"] = json.loads(r.read())
        except urllib.error.HTTPError as err:
            result["error"] = json.loads(err.read()).get("error", str(err))
        except OSError as err:
            result["error"] = str(err)

    worker = threading.Thread(target=post, name="tierflow-scale", daemon=True)
    worker.start()
    _show_scaling(cfg, state, role, replicas, worker)
    if "error" in result:
        err_console.print(f"[red]{result['error']}[/red]")
        raise typer.Exit(1)
    body = result["body"]
    console.print(f"{role}: {len(body['replicas'])} replicas ({', '.join(body['replicas'])})")


def _show_scaling(
    cfg: Config, state: dict[str, Any], role: str, target: int, worker: threading.Thread
) -> None:
    """Progress bars while a resize runs (it may take minutes: each new replica must serve,
    each leaving one drains): replicas moved so far and, for loggers, the log entries
    still to hand over to JetStream. Read from /status every half second."""

    def role_figures() -> tuple[int, float] | None:
        try:
            view = (fetch_status(cfg, state, timeout=5).get("roles") or {}).get(role) or {}
        except (urllib.error.URLError, OSError, ValueError):
            return None
        return len(view.get("replicas", [])), float(view.get("load") or 0)

    first = role_figures()
    start = first[0] if first else target
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        moved = progress.add_task(f"{role} {start} -> {target}", total=max(1, abs(target - start)))
        pending = None
        if role == "logger" and first and first[1]:
            pending = progress.add_task("log entries to hand over", total=first[1])
        for _ in range(3600):  # bounded: the POST itself times out after 900 s
            worker.join(0.5)
            now = role_figures()
            if now is not None:
                progress.update(moved, completed=min(abs(now[0] - start), abs(target - start)))
                if pending is not None:
                    progress.update(pending, completed=max(0.0, first[1] - now[1]))
            if not worker.is_alive():
                progress.update(moved, completed=max(1, abs(target - start)))
                break
