"""`tierflow check`, `certs`, `config show`, `nats up` and `replay`: this machine's
prerequisites, its configuration, and the servers it can run on its own."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer

from cluster.cli.common import ConfigOpt, console, err_console, load_config
from cluster.replay import run_replay
from jobs.class_training import build as build_class_archive
from jobs.jvm_source import build as build_jvm_source
from runtime.certs import make_dev_certs, server_names
from runtime.config import dumps_toml, redact
from runtime.engines.class_archive import archive_path
from runtime.engines.services import EngineError, nats_store_dir, require_java, start_nats
from runtime.geo.sites import LEAF_AUTH_FILE, NatsSites
from runtime.nats.server import NatsCluster, nats_server_binary
from runtime.tls import certs_dir

config_app = typer.Typer(help="Inspect the configuration.", no_args_is_help=True)
nats_app = typer.Typer(help="Run NATS servers on this machine.", no_args_is_help=True)


def check(
    class_archive: Annotated[
        bool,
        typer.Option(
            help="build Spark's class archive when this venv has none (once, ~1.5 min): "
            "every later Spark JVM starts ~5 s sooner"
        ),
    ] = True,
) -> None:
    """Check the machine: Java 17+ for Spark and the nats-server binary; build the JVM
    jetstream source's jar (seconds, once per change of its sources)."""
    try:
        java = require_java()
        binary = nats_server_binary()
    except (EngineError, RuntimeError) as err:
        err_console.print(f"[red]{err}[/red]")
        raise typer.Exit(1) from None
    console.print(f"java {java}, nats-server {binary}: ok")
    # neither is fatal: without the jar streams are read through the Python source, and
    # without the archive Spark starts more slowly
    _build("jvm jetstream source", "no JVM jetstream source", build_jvm_source)
    if class_archive:
        if (path := archive_path()) is not None and not path.is_file():
            console.print("building Spark's class archive (once per venv)...")
        _build("spark class archive", "no class archive", build_class_archive)


def _build(name: str, missing: str, build: Callable[[], Any]) -> None:
    """Build one of `check`'s artifacts and say where it is, or why there is none."""
    try:
        built = build()
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        err_console.print(f"[yellow]{missing}: {err}[/yellow]")
    else:
        state = f"built in {built.seconds:.0f} s" if built.fresh else "present"
        console.print(f"{name} {built.path}: {state}")


@config_app.command("show")
def config_show(
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Print the effective config (file + TIERFLOW_* overrides + defaults); secrets redacted."""
    cfg = load_config(config)
    if as_json:
        print(json.dumps(redact(cfg.to_dict()), indent=2))
    else:
        print(dumps_toml(cfg, redacted=True), end="")


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
    made = make_dev_certs(out or certs_dir(load_config(config)), name or [], client=client)
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
    sites: Annotated[
        int, typer.Option(min=1, max=5, help="N sites of --nodes each, joined by leaf nodes")
    ] = 1,
) -> None:
    """Run nats-server (one node, an N-node JetStream cluster, or several such sites in their
    own JetStream domains joined by leaf nodes: docs/geo.md) on loopback until Ctrl-C."""
    # handlers first: a SIGTERM while the servers start (or right after sites.json is
    # written) must stop them, not kill this process and leave them running
    stop = {"flag": False}

    def _stop(*_: Any) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    cfg = load_config(config)
    if sites > 1:
        # leaf links: a user and password made for this run (kept 0600 next to sites.json),
        # TLS with the runtime's CA when [tls] is on; clients as for one server (users, TLS)
        cluster: Any = NatsSites.from_config(
            cfg, nats_store_dir(cfg) / "sites", sites=sites, nodes=nodes
        ).start()
        state = cluster.write_state()
        for site in cluster.members:
            console.print(f"[green]{site.name}[/green] (JetStream domain {site.name}): {site.url}")
        links = "TLS, " if cluster.tls is not None else ""
        console.print(f"sites: {state}; leaf links: {links}auth in {state.parent / LEAF_AUTH_FILE}")
        urls = [s.url for s in cluster.members]
    elif nodes == 1:
        # `nats up` always runs a local server, whatever nats.url says.
        local = msgspec.structs.replace(cfg, nats=msgspec.structs.replace(cfg.nats, url=""))
        cluster = start_nats(local)
        urls = [cluster.url]
    else:
        cluster = NatsCluster(
            base_dir=nats_store_dir(cfg) / "cluster",
            nodes=nodes,
            sync_interval=cfg.nats.sync_interval,
        ).start()
        urls = cluster.urls
    console.print(f"[green]nats up[/green]: {','.join(urls)}  (Ctrl-C stops)")
    try:
        while not stop["flag"]:
            time.sleep(0.2)
    finally:
        cluster.stop()
        console.print("nats stopped")


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
