"""The analysis role: the AnalysisDriver actor (it hosts the Spark driver) as a `RoleSpec`,
started through `cluster.deploy.deployer`; waiting for Spark and stopping it."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import ray

from cluster.deploy.deployer import deploy
from cluster.deploy.spec import RoleSpec, Start
from jobs.driver import DRIVER_NAME, MAX_CONCURRENCY
from jobs.specs import JobSpec, decode_spec
from runtime.config import Config
from runtime.ray_supervisor import supervised_options
from runtime.supervision import ChildSpec

ROLE = "analysis"
START = "jobs.driver:AnalysisDriver"


def driver_kwargs(
    cfg: Config,
    nats_url: str,
    jobs: Sequence[JobSpec | Mapping[str, Any]] = (),
    *,
    master: str | None = None,
    state_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """The constructor arguments of an AnalysisDriver (plain data, for Ray or a ChildSpec)."""
    specs = [
        msgspec.to_builtins(decode_spec(j if isinstance(j, JobSpec) else dict(j))) for j in jobs
    ]
    return {
        "state_dir": str(state_dir or cfg.state_path),
        "config": cfg.to_dict(),
        "nats_url": nats_url,
        "jobs": specs,
        "master": master,
    }


def driver_ray_options(cfg: Config) -> dict[str, Any]:
    """Threaded, no CPU reserved; on a node with `spark.driver_resource` when configured
    (a token amount of it, so several drivers may share the node)."""
    extra: dict[str, Any] = {}
    if cfg.spark.driver_resource:
        extra["resources"] = {cfg.spark.driver_resource: 0.001}
    return {"num_cpus": 0, "max_concurrency": MAX_CONCURRENCY, **extra}


def driver_options(cfg: Config, name: str = DRIVER_NAME) -> dict[str, Any]:
    """Ray options: detached, named, restarted forever (`supervised_options`), plus
    `driver_ray_options`."""
    return supervised_options(name, cfg.ray.namespace, **driver_ray_options(cfg))


def analysis_role(
    cfg: Config,
    nats_url: str,
    jobs: Sequence[JobSpec | Mapping[str, Any]] = (),
    *,
    name: str = DRIVER_NAME,
    master: str | None = None,
    state_dir: str | os.PathLike[str] | None = None,
) -> RoleSpec:
    """One driver, a detached actor Ray restarts (it restores its wanted jobs itself)."""
    child = ChildSpec(
        name,
        START,
        kwargs=driver_kwargs(cfg, nats_url, jobs, master=master, state_dir=state_dir),
        ray_options=driver_ray_options(cfg),
    )
    return RoleSpec(role=ROLE, children=(child,), start=Start.DETACHED)


def start_driver(
    cfg: Config,
    nats_url: str,
    jobs: Sequence[JobSpec | Mapping[str, Any]] = (),
    *,
    name: str = DRIVER_NAME,
    master: str | None = None,
    state_dir: str | os.PathLike[str] | None = None,
) -> Any:
    """Start the named driver, or return the running one (its configured jobs unchanged:
    use `start` on it to add jobs)."""
    spec = analysis_role(cfg, nats_url, jobs, name=name, master=master, state_dir=state_dir)
    (deployed,) = deploy([spec], namespace=cfg.ray.namespace, state_dir=str(cfg.state_path))
    return deployed.actors[0]


def wait_running(driver: Any, timeout: float = 120.0) -> dict[str, Any]:
    """The driver's status once Spark runs (or failed), or the last status at the deadline."""
    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        with contextlib.suppress(ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            status = ray.get(driver.status.remote(), timeout=10)
            if status.get("state") in ("running", "failed"):
                return status
        time.sleep(0.5)
    return status


def stop_driver(driver: Any, timeout: float = 60.0) -> None:
    """Stop the queries and Spark cleanly, then remove the actor for good."""
    with contextlib.suppress(Exception):
        ray.get(driver.shutdown.remote(timeout), timeout=timeout + 10)
    ray.kill(driver, no_restart=True)
