"""The book's Meetup RSVP pipeline, as a config and its generator: nothing below `cluster/`
knows it. `demo_config(cfg)` adds to any config the `meetup` stream, the five Meetup
queries (cluster/demo/meetup.py), the demo's page at `/demo/` (`view/`) and its
`/streaming` top-N; `run_demo` serves the synthetic RSVPs (cluster/replay.py, the retired
Meetup API's stand-in) that the stream's ingest nodes read, then runs `tierflow up` on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from cluster.demo.meetup import STREAM, meetup_jobs

__all__ = ["VIEW", "VIEW_DIR", "demo_config", "run_demo"]

VIEW_DIR = Path(__file__).with_name("view")
VIEW = "demo"
SUBJECT = f"raw.{STREAM}"
TOPN_SUBJECT = "results.meetup_topn"  # `/streaming`: the all-time top-N query's rows


def demo_config(cfg: Any, source_url: str = "") -> Any:
    """`cfg` with the Meetup pipeline in it (checked again, as a file would be): the
    `meetup` stream unless the file has one (reading `source_url` when given), the Meetup
    queries whose names the file does not use, the demo's page and its `/streaming`."""
    from runtime.config import validate

    data = msgspec.to_builtins(cfg)
    streams = data.setdefault("streams", {})
    meetup = streams.setdefault(STREAM, {"subjects": [SUBJECT]})
    if source_url:
        source = meetup.setdefault("source", {})
        source.update({"url": source_url, "kind": "ws"})
    mine = {j.get("name") for j in data.get("jobs", [])}
    ours = [msgspec.to_builtins(s) for s in meetup_jobs() if s.name not in mine]
    data["jobs"] = ours + list(data.get("jobs", []))
    gateway = data.setdefault("gateway", {})
    gateway.setdefault("views", {}).setdefault(VIEW, str(VIEW_DIR))
    options = gateway.setdefault("options", {})
    if not options.get("topn_subject"):
        options["topn_subject"] = TOPN_SUBJECT
    return validate(data)


async def run_demo(
    cfg: Any,
    *,
    rate: float,
    on_ready: Callable[[Any, asyncio.Event], None] | None = None,
    record_state: bool = True,
) -> None:
    """The synthetic RSVP source at `rate` per second (none at 0), then every tier of the
    demo's config until SIGTERM/SIGINT; the source stops after the runtime."""
    from cluster.launcher import serve_forever
    from cluster.replay import ReplayServer

    replay = ReplayServer(0, rate=rate) if rate else None
    if replay is not None:
        await replay.start()
    try:
        demo = demo_config(cfg, replay.stream_url if replay else "")
        await serve_forever(demo, on_ready=on_ready, record_state=record_state)
    finally:
        if replay is not None:
            await replay.stop()
