"""The `tierflow` command line (typer + rich)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer
from rich.console import Console
from rich.table import Table

from cluster.chaos.cli import app as chaos_app
from runtime import runstate
from runtime.config import Config, ConfigError, dumps_toml, load

app = typer.Typer(
    help="tierflow: a streaming data pipeline runtime on Ray, NATS and Spark.", no_args_is_help=True
)
config_app = typer.Typer(help="Inspect the configuration.", no_args_is_help=True)
nats_app = typer.Typer(help="Run NATS servers on this machine.", no_args_is_help=True)
checkpoint_app = typer.Typer(help="LevelDB checkpoints of actors.", no_args_is_help=True)
logger_app = typer.Typer(help="The MessageLogger's stores.", no_args_is_help=True)
jobs_app = typer.Typer(help="Analysis jobs in the Spark driver actor.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(nats_app, name="nats")
app.add_typer(checkpoint_app, name="checkpoint")
app.add_typer(logger_app, name="logger")
app.add_typer(jobs_app, name="jobs")
app.add_typer(chaos_app, name="chaos")

console = Console()
err_console = Console(stderr=True)

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="tierflow.toml (default: ./tierflow.toml)")
]


def _load(config: Path | None) -> Config:
    try:
        return load(config)
    except ConfigError as err:
        err_console.print(f"[red]config error:[/red] {err}")
        raise typer.Exit(2) from None


def _where(info: dict[str, Any]) -> None:
    nats = info.get("nats", {})
    console.print(
        f"  NATS      {nats.get('url')}" + (f"  (pid {nats['pid']})" if nats.get("pid") else "")
    )
    if nats.get("monitor"):
        console.print(f"  NATS mon  {nats['monitor']}")
    console.print(
        f"  Ray       {info.get('ray', {}).get('address')}  namespace "
        f"{info.get('ray', {}).get('namespace')}"
    )
    console.print(f"  Spark     {info.get('spark', {}).get('master')}")
    console.print(f"  admin     {info.get('admin', {}).get('url')}/status  /metrics")
    if info.get("replay", {}).get("url"):
        console.print(f"  source    {info['replay']['url']}  (synthetic Meetup RSVPs)")
    if info.get("collector", {}).get("url"):
        console.print(f"  collector {info['collector']['url']}/v1/streams/<stream>/events")
    if info.get("gateway", {}).get("url"):
        console.print(
            f"  dashboard {info['gateway']['url']}/   (gateway: /v1/ws, /v1/sse, /v1/poll)"
        )
    if info.get("streams"):
        console.print(f"  streams   {', '.join(info['streams'])}")


# --------------------------------------------------------------------------- up / down


@app.command()
def up(
    config: ConfigOpt = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="run in the background")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait for a detached start")] = 120.0,
) -> None:
    """Start the services and the runtime's actors (foreground, or --detach)."""
    cfg = _load(config)
    existing = runstate.read_state(cfg)
    if existing and runstate.alive(existing["process"]["pid"], existing["process"]["create_time"]):
        err_console.print(
            f"[yellow]already running[/yellow] (pid {existing['process']['pid']}); "
            "`tierflow down` first"
        )
        raise typer.Exit(1)
    runstate.clear_state(cfg)
    if detach:
        _up_detached(cfg, config, timeout)
        return
    from cluster.launcher import serve_forever

    def ready(rt: Any, _stop: asyncio.Event) -> None:
        console.print("[green]tierflow is up[/green] (Ctrl-C stops it)")
        _where(rt.describe())

    asyncio.run(serve_forever(cfg, on_ready=ready))


def _up_detached(cfg: Config, config: Path | None, timeout: float) -> None:
    logs = cfg.state_path / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / "up.log"
    cmd = [sys.executable, "-m", "cluster.cli", "up"]
    if config:
        cmd += ["--config", str(config.resolve())]
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=os.getcwd(),
        )
    deadline = time.monotonic() + timeout
    with console.status("starting tierflow..."):
        while time.monotonic() < deadline:
            state = runstate.read_state(cfg)
            if state and state.get("ready") and state["process"]["pid"] == proc.pid:
                console.print(f"[green]tierflow is up[/green] (pid {proc.pid}, log {log_path})")
                _where(state)
                return
            if proc.poll() is not None:
                break
            time.sleep(0.2)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    tail = log_path.read_text(errors="replace")[-3000:]
    err_console.print(f"[red]tierflow did not start[/red]; the end of {log_path}:\n{tail}")
    raise typer.Exit(1)


@app.command()
def down(
    config: ConfigOpt = None,
    timeout: Annotated[float, typer.Option(help="seconds before SIGKILL")] = 60.0,
) -> None:
    """Stop a detached runtime: its own pids only, then check none is left."""
    cfg = _load(config)
    state = runstate.read_state(cfg)
    if not state:
        console.print("tierflow is not running")
        return
    with console.status("stopping tierflow..."):
        forced, left = runstate.stop_recorded(state, timeout)
    runstate.clear_state(cfg)
    if left:
        err_console.print(f"[red]processes still alive:[/red] {[p['pid'] for p in left]}")
        raise typer.Exit(1)
    if forced:
        err_console.print(f"[yellow]forced with SIGKILL:[/yellow] {[p['pid'] for p in forced]}")
    console.print("[green]tierflow is down[/green]")


# --------------------------------------------------------------------------- status


def _fetch_status(cfg: Config, state: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    from runtime.tls import client_ssl_context

    url = state["admin"]["url"] + "/status"
    with urllib.request.urlopen(url, timeout=timeout, context=client_ssl_context(cfg)) as resp:
        return json.loads(resp.read())


@app.command()
def status(
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    watch: Annotated[float, typer.Option(help="refresh every N seconds (0: once)")] = 0.0,
    count: Annotated[
        int, typer.Option(help="with --watch, stop after N refreshes (0: until Ctrl-C)")
    ] = 0,
) -> None:
    """Services, nodes, supervised actors and their restarts."""
    cfg = _load(config)
    n = 0
    while True:
        state = runstate.read_state(cfg)
        if not state or not runstate.alive(
            state["process"]["pid"], state["process"]["create_time"]
        ):
            if as_json:
                print(json.dumps({"running": False}))
            else:
                console.print("tierflow is not running")
            raise typer.Exit(3)
        try:
            snap = {"running": True, **_fetch_status(cfg, state)}
        except (urllib.error.URLError, OSError) as err:
            err_console.print(f"[red]admin endpoint did not answer:[/red] {err}")
            raise typer.Exit(1) from None
        if as_json:
            print(json.dumps(snap))
        else:
            _print_status(snap)
        n += 1
        if not watch or (count and n >= count):
            return
        time.sleep(watch)


def _print_status(snap: dict[str, Any]) -> None:
    console.print(f"[bold]tierflow[/bold] pid {snap['pid']}  up {snap['uptime_s']} s")
    services = Table("service", "healthy", "where", title="services")
    for name, svc in snap.get("services", {}).items():
        where = svc.get("url") or svc.get("address") or svc.get("master") or ""
        ok = {True: "[green]yes[/green]", False: "[red]no[/red]", None: "-"}[svc.get("healthy")]
        services.add_row(name, ok, str(where))
    console.print(services)
    nodes = Table("node", "address", "alive", "cpus", title="ray nodes")
    for node in snap.get("services", {}).get("ray", {}).get("nodes", []):
        nodes.add_row(node["node_id"][:12], node["address"], str(node["alive"]), str(node["cpus"]))
    console.print(nodes)
    children = Table("actor", "alive", "restarts", "pid", "node", title="supervised actors")
    for child in snap.get("children", []):
        children.add_row(
            child.get("name", "?"),
            str(child.get("alive")),
            str(child.get("restarts", 0)),
            str(child.get("pid", "")),
            str(child.get("node_id", ""))[:12],
        )
    console.print(children)
    _print_roles(snap)
    if snap.get("escalated"):
        console.print(f"[red]escalated:[/red] {snap['escalated']}")


def _print_roles(snap: dict[str, Any]) -> None:
    """Each role's replicas per node, load and rates; the autoscaler's view; query lag."""
    from cluster.roles import LOAD_FIELD

    roles = snap.get("roles") or {}
    auto = snap.get("autoscaling") or {}
    if roles:
        table = Table(
            "role", "replicas", "per node", "load", "rates /s", "autoscaling", title="roles"
        )
        for role, view in roles.items():
            rows = view.get("replicas", [])
            per_node: dict[str, int] = {}
            for r in rows:
                key = str(r.get("node") or "?")[:8]
                per_node[key] = per_node.get(key, 0) + 1
            down = sum(1 for r in rows if "error" in r)
            a = auto.get(role) or {}
            table.add_row(
                role,
                f"{len(rows)}" + (f" ([red]{down} not answering[/red])" if down else ""),
                " ".join(f"{n}:{c}" for n, c in sorted(per_node.items())),
                f"{view.get('load', 0):g} {LOAD_FIELD[role].replace('_', ' ')}",
                " ".join(f"{k} {v:g}" for k, v in (view.get("rates") or {}).items()),
                f"-> {a['desired']} ({a['reason']})" if a else "",
            )
        console.print(table)
    queries = (snap.get("analysis") or {}).get("queries") or []
    if queries:
        table = Table("query", "state", "committed seq", "lag (events)", title="analysis")
        for q in queries:
            cells = (q.get("state"), q.get("committed_seq"), q.get("lag"))
            table.add_row(q["name"], *(str(c) for c in cells))
        console.print(table)


@app.command()
def check() -> None:
    """Check the machine: Java 17+ for Spark and the nats-server binary."""
    from runtime.nats import nats_server_binary
    from runtime.services import EngineError, require_java

    try:
        java = require_java()
        binary = nats_server_binary()
    except (EngineError, RuntimeError) as err:
        err_console.print(f"[red]{err}[/red]")
        raise typer.Exit(1) from None
    console.print(f"java {java}, nats-server {binary}: ok")


@app.command()
def scale(
    role: Annotated[str, typer.Argument(help="collector, logger, bridge or gateway")],
    replicas: Annotated[int, typer.Argument(min=1)],
    config: ConfigOpt = None,
) -> None:
    """Resize a role of the running runtime; scale-down drains, nothing accepted is lost."""
    from runtime.tls import client_ssl_context

    cfg = _load(config)
    state = runstate.read_state(cfg)
    if not state or not runstate.alive(state["process"]["pid"], state["process"]["create_time"]):
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
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    def role_figures() -> tuple[int, float] | None:
        try:
            view = (_fetch_status(cfg, state, timeout=5).get("roles") or {}).get(role) or {}
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


# --------------------------------------------------------------------------- config / nats


@config_app.command("show")
def config_show(
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Print the effective config (file + TIERFLOW_* overrides + defaults); secrets redacted."""
    from runtime.config import redact

    cfg = _load(config)
    if as_json:
        print(json.dumps(redact(cfg.to_dict()), indent=2))
    else:
        print(dumps_toml(cfg, redacted=True), end="")


@app.command()
def certs(
    config: ConfigOpt = None,
    out: Annotated[
        Path | None, typer.Option(help="directory (default: <state_dir>/certs, where [tls] looks)")
    ] = None,
    name: Annotated[
        list[str] | None, typer.Option("--name", help="extra host name or IP for the server")
    ] = None,
    client: Annotated[bool, typer.Option(help="also a client certificate (mutual TLS)")] = True,
) -> None:
    """Make development certificates: a CA, a server certificate (127.0.0.1, localhost and
    each --name) and a client certificate. Keys are written 0600; reruns keep the CA."""
    from runtime.certs import make_dev_certs, server_names
    from runtime.tls import certs_dir

    made = make_dev_certs(out or certs_dir(_load(config)), name or [], client=client)
    console.print(f"[green]certificates in {made.dir}[/green]")
    console.print(f"  CA      {made.ca}  (clients trust this)")
    console.print(f"  server  {made.cert}  for {', '.join(server_names(made.cert))}")
    if client:
        console.print(f"  client  {made.client_cert}")
    console.print("  enable with \\[tls] enabled = true (or TIERFLOW_TLS__ENABLED=true)")


@nats_app.command("up")
def nats_up(
    config: ConfigOpt = None,
    nodes: Annotated[int, typer.Option(min=1, max=5, help="1, or a cluster of N")] = 1,
) -> None:
    """Run nats-server (one node, or an N-node JetStream cluster on loopback) until Ctrl-C."""
    from runtime.nats import NatsCluster
    from runtime.services import nats_store_dir, start_nats

    cfg = _load(config)
    if nodes == 1:
        # `nats up` always runs a local server, whatever nats.url says.
        local = msgspec.structs.replace(cfg, nats=msgspec.structs.replace(cfg.nats, url=""))
        cluster: Any = start_nats(local)
        urls = [cluster.url]
    else:
        cluster = NatsCluster(
            base_dir=nats_store_dir(cfg) / "cluster",
            nodes=nodes,
            sync_interval=cfg.nats.sync_interval,
        ).start()
        urls = cluster.urls
    console.print(f"[green]nats up[/green]: {','.join(urls)}  (Ctrl-C stops)")
    stop = {"flag": False}

    def _stop(*_: Any) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        while not stop["flag"]:
            time.sleep(0.2)
    finally:
        cluster.stop()
        console.print("nats stopped")


@app.command()
def replay(
    seed: Annotated[int, typer.Option(help="synthetic Meetup generator seed")] = 0,
    file: Annotated[Path | None, typer.Option("--file", help="replay an NDJSON file")] = None,
    rate: Annotated[float, typer.Option(help="events/s per connection (0: unpaced)")] = 100.0,
    count: Annotated[
        int | None, typer.Option(help="stop after N events (default: endless)")
    ] = None,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="0 picks a free port")] = 0,
    close_at_end: Annotated[bool, typer.Option(help="close connections after --count")] = False,
) -> None:
    """Serve RSVPs as a WebSocket stream: the stand-in for the retired Meetup RSVP API."""
    from cluster.replay import run_replay

    def ready(server: Any) -> None:
        console.print(
            f"replaying on {server.url}  (positioned: {server.stream_url}?from=N, "
            f"stats: http://{host}:{server.port}/stats)  Ctrl-C stops"
        )

    run_replay(
        seed=seed,
        ndjson=str(file) if file else None,
        rate=rate,
        count=count,
        host=host,
        port=port,
        close_at_end=close_at_end,
        on_ready=ready,
    )


@logger_app.command("inspect")
def logger_inspect(
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Pending (transient), failed and parked counts per logger replica: asked of the live
    replicas when tierflow runs, read from their LevelDB stores when it does not. Parked
    entries are never retried on their own: settle them with `tierflow logger settle`."""
    from actors.queue.logger import inspect

    cfg = _load(config)
    state = runstate.read_state(cfg)
    live = state and runstate.alive(state["process"]["pid"], state["process"]["create_time"])
    rows = _fetch_status(cfg, state).get("loggers", []) if live else inspect(cfg.state_path)
    if as_json:
        print(json.dumps(rows))
        return
    table = Table(
        "replica",
        "state",
        "pending",
        "failed",
        "parked",
        "bytes",
        "epoch",
        "catching up",
        title=f"logger stores under {cfg.state_path / 'logger'}",
    )
    for r in rows:
        table.add_row(
            str(r.get("replica")),
            str(r.get("state")),
            str(r.get("transient", "")),
            str(r.get("failed", "")),
            str(r.get("parked", "")),
            str(r.get("bytes", "")),
            str(r.get("epoch", "")),
            str(r.get("catching_up", "")),
        )
    console.print(table)
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
    from actors.queue.logger import LogStore, settle_parked
    from runtime.checkpoint import CheckpointLockedError

    cfg = _load(config)
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


def _jobs_call(fn_name: str, config: Path | None, *args: Any) -> list[dict[str, Any]]:
    from cluster import analysis

    cfg = _load(config)
    try:
        return getattr(analysis, fn_name)(cfg, *args)
    except analysis.JobsError as err:
        err_console.print(f"[red]{err}[/red]")
        raise typer.Exit(1) from None


def _jobs_table(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(rows, default=str))
        return
    cols = sorted({k for r in rows for k in r}, key=lambda k: (k != "name", k))
    table = Table(*cols, title="analysis jobs")
    for r in rows:
        table.add_row(*(str(r.get(c, "")) for c in cols))
    console.print(table)


@jobs_app.command("list")
def jobs_list(
    config: ConfigOpt = None, as_json: Annotated[bool, typer.Option("--json")] = False
) -> None:
    """Known and running jobs with their query numbers."""
    _jobs_table(_jobs_call("jobs_list", config), as_json)


@jobs_app.command("start")
def jobs_start(
    name: Annotated[str, typer.Argument(help="a job name, `meetup` (all five), or a spec")],
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Start job(s) in the analysis driver (starting the driver if needed)."""
    _jobs_table(_jobs_call("jobs_start", config, name), as_json)


@jobs_app.command("stop")
def jobs_stop(
    name: Annotated[str, typer.Argument(help="a job name or `meetup`")],
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Stop job(s); their checkpoints stay, so a later start resumes them."""
    _jobs_table(_jobs_call("jobs_stop", config, name), as_json)


@checkpoint_app.command("repair")
def checkpoint_repair(path: Path) -> None:
    """Repair a corrupt LevelDB checkpoint in place (what survives is kept)."""
    from runtime.checkpoint import CheckpointError, CheckpointStore

    try:
        CheckpointStore.repair(path)
        CheckpointStore(path, create=False).close()  # proves it opens again
        console.print(f"repaired {path}")
    except CheckpointError as err:
        err_console.print(f"[red]{err}[/red]")
        raise typer.Exit(1) from None


# --------------------------------------------------------------------------- demo


@app.command()
def demo(
    config: ConfigOpt = None,
    duration: Annotated[float, typer.Option(help="stop after N seconds (0: until Ctrl-C)")] = 0.0,
    rate: Annotated[float, typer.Option(help="synthetic Meetup RSVPs per second")] = 200.0,
) -> None:
    """The Meetup RSVP pipeline on this machine: a synthetic RSVP stream flows in."""
    cfg = _load(config)
    from cluster.launcher import serve_forever

    def ready(rt: Any, stop: asyncio.Event) -> None:
        console.print("[green]tierflow demo is up[/green] (Ctrl-C stops it)")
        _where(rt.describe())
        loop = asyncio.get_running_loop()
        if duration:
            loop.call_later(duration, stop.set)
        loop.create_task(_report_flow(rt, stop))

    asyncio.run(serve_forever(cfg, on_ready=ready, record_state=False, demo_rate=rate))
    console.print("tierflow demo stopped")


async def _report_flow(rt: Any, stop: asyncio.Event, every_s: float = 5.0) -> None:
    """A line every few seconds: how many RSVPs JetStream holds, and how fast they come."""
    last, last_t = 0, time.monotonic()
    while not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
        try:
            info = await rt.nc.jetstream().stream_info("meetup")
        except Exception as err:  # still starting, or stopping
            console.print(f"  meetup stream: {err!r}")
            continue
        now, n = time.monotonic(), info.state.messages
        console.print(f"  meetup stream: {n:,} RSVPs ({(n - last) / (now - last_t):,.0f}/s)")
        last, last_t = n, now


def main() -> None:
    app()


if __name__ == "__main__":
    main()
