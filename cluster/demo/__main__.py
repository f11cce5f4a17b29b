"""``python -m cluster.demo``: the book's Meetup RSVP pipeline, every tier, on one config.

What ``ray job submit -- python -m cluster.demo --config ...`` runs; the queries themselves
are `cluster/demo/meetup.py` and the synthetic RSVPs `cluster/demo/rsvps.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import msgspec

from cluster.analysis import connect_ray, runtime_nats_url
from cluster.demo import run_demo
from cluster.demo.meetup import meetup_jobs
from cluster.deploy.analysis import start_driver, wait_running
from runtime.config import load


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cluster.demo``: the whole Meetup pipeline (collectors, loggers, bridges,
    gateways and these analyses) on the configured Ray, NATS and Spark, until SIGTERM.

    This is what ``ray job submit -- python -m cluster.demo --config ...`` and ``ray submit
    cluster/ray-cluster.yaml cluster/demo/__main__.py -- --config ...`` run; ``ray job stop`` sends
    SIGTERM, on which collectors drain, loggers hand over and every actor is removed.
    ``--attach`` instead adds only the analyses to an already running tierflow.
    """
    parser = argparse.ArgumentParser(prog="python -m cluster.demo", description=main.__doc__)
    parser.add_argument("--config", "-c", help="tierflow.toml (default: ./tierflow.toml)")
    parser.add_argument("--attach", action="store_true", help="analyses only, in a running one")
    parser.add_argument("--nats-url", default="", help="--attach: default the running one's")
    parser.add_argument("--wait", type=float, default=120.0, help="--attach: seconds for Spark")
    parser.add_argument("--demo-rate", type=float, default=0.0, help="synthetic RSVPs per s")
    parser.add_argument("--duration", type=float, default=0.0, help="stop after N s (0: never)")
    args = parser.parse_args(argv)
    cfg = load(args.config)
    if args.attach:
        return _attach(cfg, args.nats_url, args.wait)
    return run_pipeline(cfg, demo_rate=args.demo_rate, duration=args.duration)


def run_pipeline(cfg: Any, *, demo_rate: float = 0.0, duration: float = 0.0) -> int:
    """Run every tier until SIGTERM/SIGINT (or `duration`); joins ``RAY_ADDRESS`` when set
    (a Ray job's driver), else `ray.address`, else starts a local Ray."""
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        cfg = msgspec.structs.replace(cfg, ray=msgspec.structs.replace(cfg.ray, address=address))

    def ready(rt: Any, stop: asyncio.Event) -> None:
        print(json.dumps({"tierflow": "ready", **rt.describe()}, default=str), flush=True)
        if duration:
            asyncio.get_running_loop().call_later(duration, stop.set)

    asyncio.run(run_demo(cfg, rate=demo_rate, on_ready=ready))
    print(json.dumps({"tierflow": "stopped"}), flush=True)
    return 0


def _attach(cfg: Any, nats_url: str, wait: float) -> int:

    connect_ray(cfg)
    driver = start_driver(cfg, nats_url or runtime_nats_url(cfg), jobs=meetup_jobs())
    status = wait_running(driver, wait) if wait else {}
    print(json.dumps(status, indent=2, default=str))
    return 0 if not wait or status.get("state") == "running" else 1


if __name__ == "__main__":
    sys.exit(main())
