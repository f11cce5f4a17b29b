"""`tierflow up`, `down` and `demo`: starting and stopping the runtime on this machine."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from cluster.cli.common import ConfigOpt, console, err_console, load_config
from runtime import runstate
from runtime.config import Config
from runtime.data.compaction import describe


def where(info: dict[str, Any], cfg: Config | None = None) -> None:
    """Where each part of a started runtime answers (its `describe()` or run-state); with
    the config, how each stream keeps its events (compacted by which key)."""
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
    for name, stream in (cfg.streams if cfg is not None else {}).items():
        if stream.source.url:
            console.print(f"  source    {stream.source.url}  (read into stream {name!r})")
    if info.get("collector", {}).get("url"):
        console.print(f"  collector {info['collector']['url']}/v1/streams/<stream>/events")
    if info.get("gateway", {}).get("url"):
        url = info["gateway"]["url"]
        console.print(f"  console   {url}/   (gateway: /v1/ws, /v1/sse, /v1/poll)")
        for view in cfg.gateway.views if cfg is not None else {}:
            console.print(f"  view      {url}/{view}/")
    if info.get("streams"):
        console.print(f"  streams   {', '.join(_stream_label(n, cfg) for n in info['streams'])}")


def _stream_label(name: str, cfg: Config | None) -> str:
    how = describe(cfg.streams.get(name)) if cfg is not None else ""
    return f"{name} ({how})" if how else name


def up(
    config: ConfigOpt = None,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="run in the background")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait for a detached start")] = 120.0,
) -> None:
    """Start the services and the runtime's actors (foreground, or --detach)."""
    cfg = load_config(config)
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
    # Imported here: the launcher loads Ray (about a second) that other commands never need.
    from cluster.launcher import serve_forever

    def ready(rt: Any, _stop: asyncio.Event) -> None:
        console.print("[green]tierflow is up[/green] (Ctrl-C stops it)")
        where(rt.describe(), cfg)

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
                where(state, cfg)
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


def down(
    config: ConfigOpt = None,
    timeout: Annotated[float, typer.Option(help="seconds before SIGKILL")] = 60.0,
) -> None:
    """Stop a detached runtime: its own pids only, then check none is left."""
    cfg = load_config(config)
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


def demo(
    config: ConfigOpt = None,
    duration: Annotated[float, typer.Option(help="stop after N seconds (0: until Ctrl-C)")] = 0.0,
    rate: Annotated[float, typer.Option(help="synthetic Meetup RSVPs per second")] = 200.0,
) -> None:
    """The Meetup RSVP pipeline on this machine: a synthetic RSVP stream flows in."""
    # Imported here: the launcher loads Ray (about a second) that other commands never need.
    from cluster.demo import run_demo

    cfg = load_config(config)

    def ready(rt: Any, stop: asyncio.Event) -> None:
        console.print("[green]tierflow demo is up[/green] (Ctrl-C stops it)")
        where(rt.describe(), rt.cfg)
        loop = asyncio.get_running_loop()
        if duration:
            loop.call_later(duration, stop.set)
        loop.create_task(_report_flow(rt, stop))

    asyncio.run(run_demo(cfg, rate=rate, on_ready=ready, record_state=False))
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
