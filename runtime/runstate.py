"""The run-state file of a detached `tierflow up`, and stopping exactly the pids it names.

`tierflow down` must stop what `up` started and nothing else (never a kill by
process name), so `up` records its own pid and every descendant it spawned (nats-server,
Ray's processes) and `down` stops those pids alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil

from runtime.config import Config
from runtime.state.files import write_atomic


def state_file(cfg: Config) -> Path:
    return cfg.state_path / "run" / "tierflow.json"


def write_state(cfg: Config, state: dict[str, Any]) -> Path:
    """Write atomically (temp file + rename) so a reader never sees half a file."""
    path = state_file(cfg)
    write_atomic(path, msgspec.json.encode(state), durable=False)
    return path


def read_state(cfg: Config) -> dict[str, Any] | None:
    path = state_file(cfg)
    try:
        return msgspec.json.decode(path.read_bytes())
    except FileNotFoundError:
        return None


def clear_state(cfg: Config) -> None:
    state_file(cfg).unlink(missing_ok=True)


def nats_url(cfg: Config) -> str:
    """``nats.url``, or the URL of the running tierflow's embedded server ('' if neither)."""
    if cfg.nats.url:
        return cfg.nats.url
    return str(((read_state(cfg) or {}).get("nats") or {}).get("url") or "")


def descendants(pid: int) -> list[int]:
    """Pids of every live descendant of `pid` (empty when it is gone)."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def alive(pid: int, started_at: float | None = None) -> bool:
    """True when `pid` runs and, if given, was created at `started_at` (guards pid reuse)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return started_at is None or abs(proc.create_time() - started_at) < 1.0
    except psutil.NoSuchProcess:
        return False


def process_identity(pid: int) -> dict[str, Any]:
    return {"pid": pid, "create_time": psutil.Process(pid).create_time()}


def wait_gone(pids: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    """Wait until all listed processes exit; return those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p["pid"], p.get("create_time"))]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if alive(p["pid"], p.get("create_time"))]
    return left


def signal_all(pids: list[dict[str, Any]], sig: signal.Signals) -> None:
    for p in pids:
        if alive(p["pid"], p.get("create_time")):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p["pid"], sig)


def stop_recorded(
    state: dict[str, Any], timeout: float = 30.0
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """SIGTERM the `up` process, wait, then SIGKILL whatever recorded pid remains.

    Returns (processes that needed SIGKILL, processes that survived even that).
    """
    main = state["process"]
    recorded = [main, *state.get("children", [])]
    if alive(main["pid"], main.get("create_time")):
        # Workers Ray spawned after start-up are ours too; catch them before SIGTERM.
        known = {p["pid"] for p in recorded}
        for pid in descendants(main["pid"]):
            if pid not in known:
                with contextlib.suppress(psutil.NoSuchProcess):
                    recorded.append(process_identity(pid))
    signal_all([main], signal.SIGTERM)
    forced = wait_gone(recorded, timeout)
    if not forced:
        return [], []
    signal_all(forced, signal.SIGKILL)
    return forced, wait_gone(forced, 5.0)
