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
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.deploy.spec import RoleSpec, Start
from jobs.driver import (
    DRIVER_NAME,
    MAX_CONCURRENCY,
    RECOMPUTE_GROUP,
    RECOMPUTE_THREADS,
    SQL_GROUP,
    AnalysisDriver,
    default_master,
)
from jobs.sql_admission import SQL_WAITING, sql_slots
from jobs.standby import standby_name
from runtime.config import Config
from runtime.errors import JobError
from runtime.job_specs import JobSpec, decode_spec
from runtime.nats.endpoint import NatsEndpoint
from runtime.supervision.policy import ChildSpec
from runtime.supervision.ray_actors import supervised_options

ROLE = "analysis"
START = "jobs.driver:AnalysisDriver"


def driver_kwargs(
    cfg: Config,
    nats_url: str,
    jobs: Sequence[JobSpec | Mapping[str, Any]] = (),
    *,
    master: str | None = None,
    state_dir: str | os.PathLike[str] | None = None,
    peer: str | None = None,
) -> dict[str, Any]:
    """The constructor arguments of an AnalysisDriver (plain data, for Ray or a ChildSpec);
    `peer`: the other driver of a warm pair (jobs/standby.py)."""
    specs = [
        msgspec.to_builtins(decode_spec(j if isinstance(j, JobSpec) else dict(j))) for j in jobs
    ]
    return {
        "state_dir": str(state_dir or cfg.state_path),
        "config": cfg.to_dict(),
        "nats_url": nats_url,
        "jobs": specs,
        "master": master,
        "peer": peer,
    }


def driver_ray_options(cfg: Config) -> dict[str, Any]:
    """Threaded, no CPU reserved; on a node with `spark.driver_resource` when configured
    (a token amount of it, so several drivers may share the node)."""
    extra: dict[str, Any] = {}
    if cfg.spark.driver_resource:
        extra["resources"] = {cfg.spark.driver_resource: 0.001}
    return {"num_cpus": 0, "max_concurrency": MAX_CONCURRENCY, **extra}


def driver_groups(cfg: Config) -> dict[str, int]:
    """The driver's Ray concurrency groups besides the default one (`MAX_CONCURRENCY`
    threads for the control methods): ad-hoc SQL gets `sql_slots` threads to run queries
    plus `SQL_WAITING` that answer 429 at once when the slots are taken; recomputes (minutes
    each) their own. Ray takes groups only where the class is made remote (`driver_class`),
    never in `.options()`."""
    return {SQL_GROUP: sql_slots(cfg) + SQL_WAITING, RECOMPUTE_GROUP: RECOMPUTE_THREADS}


def driver_class(cfg: Config) -> Any:
    """AnalysisDriver as a Ray actor class with `driver_groups` (its `sql` and `recompute`
    name their groups: Ray refuses to create it without them)."""
    return ray.remote(concurrency_groups=driver_groups(cfg))(AnalysisDriver)


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
    """One driver, a detached actor Ray restarts (it restores its wanted jobs itself); with
    `spark.standby`, the first of a warm pair (`start_standby` starts the second). Started
    by `start_driver`, not the generic deployer: its class needs `driver_groups`."""
    peer = standby_name(name) if cfg.spark.standby else None
    child = ChildSpec(
        name,
        START,
        kwargs=driver_kwargs(cfg, nats_url, jobs, master=master, state_dir=state_dir, peer=peer),
        ray_options=driver_ray_options(cfg),
    )
    return RoleSpec(role=ROLE, children=(child,), start=Start.DETACHED)


class DriverConflict(JobError):
    """A driver of that name already runs in a way the caller did not ask for."""


def jobs_to_add(
    name: str,
    status: Mapping[str, Any],
    wanted: Mapping[str, Mapping[str, Any]],
    asked: Sequence[JobSpec],
    *,
    nats_url: str,
    master: str,
) -> list[JobSpec]:
    """The jobs a running driver (`status` and `wanted` are its own answers) must start to
    run `asked` too; DriverConflict when it cannot: it reads another NATS or runs
    another Spark master (its queries and checkpoints are elsewhere), or runs a job of the
    same name with another spec (a changed query needs a new name: its checkpoint holds the
    old one's state). Without this, starting a driver under a taken name returned the
    running one silently, with none of the caller's jobs."""
    theirs = {"nats_url": status.get("nats_url"), "master": status.get("master")}
    for key, mine in (("nats_url", nats_url), ("master", master)):
        if theirs[key] != mine:
            raise DriverConflict(
                f"analysis driver {name!r} already runs with {key} {theirs[key]!r}, not "
                f"{mine!r}: stop it first, or give this one another name"
            )
    have = {n: decode_spec(dict(s)) for n, s in wanted.items()}
    add: list[JobSpec] = []
    for spec in asked:
        if spec.name not in have:
            add.append(spec)
        elif have[spec.name] != spec:
            raise DriverConflict(
                f"analysis driver {name!r} already runs job {spec.name!r} with another spec: "
                "stop the job first, or give the changed query a new name (its checkpoint "
                "holds the old query's state)"
            )
    return add


def start_driver(
    cfg: Config,
    nats_url: str,
    jobs: Sequence[JobSpec | Mapping[str, Any]] = (),
    *,
    name: str = DRIVER_NAME,
    master: str | None = None,
    state_dir: str | os.PathLike[str] | None = None,
) -> Any:
    """Start the named driver with `jobs`; when it already runs, start on it those of
    `jobs` it lacks (`jobs_to_add`, which refuses a driver on another NATS or master).
    A new driver restores its own wanted jobs: a configured job stopped earlier stays
    stopped until started by name."""
    try:
        ray.get_actor(name, namespace=cfg.ray.namespace)
        existed = True
    except ValueError:
        existed = False
    spec = analysis_role(cfg, nats_url, jobs, name=name, master=master, state_dir=state_dir)
    (child,) = spec.children  # started as the deployer starts a detached role, with groups
    options = supervised_options(child.id, cfg.ray.namespace, **(child.ray_options or {}))
    driver = driver_class(cfg).options(**options).remote(*child.args, **child.kwargs)
    if cfg.spark.standby:
        start_standby(cfg, driver, spec.children[0].kwargs, name=name)
    if not existed:
        return driver
    asked = [decode_spec(j if isinstance(j, JobSpec) else dict(j)) for j in jobs]
    status, wanted = ray.get([driver.status.remote(), driver.jobs.remote()], timeout=120)
    endpoint = NatsEndpoint.from_config(cfg, "analysis", url=nats_url)
    add = jobs_to_add(
        name, status, wanted, asked, nats_url=endpoint.url, master=master or default_master(cfg)
    )
    for job in add:  # wait_s 0: the job's query starts in the driver's own time
        ray.get(driver.start.remote(msgspec.to_builtins(job), 0.0), timeout=120)
    return driver


def start_standby(
    cfg: Config, driver: Any, driver_args: Mapping[str, Any], *, name: str = DRIVER_NAME
) -> Any:
    """The second driver of a warm pair (jobs/standby.py), with `driver`'s constructor
    arguments, on its node: the two share the state directory, and the checkpoint store's
    lock, which decides which one is active, holds only on one node. Ray restarts it
    there; a lost node is the active driver's restart by Ray, as without a standby."""
    node = ray.get(driver.heartbeat.remote(), timeout=120)["node_id"]
    # its peer is the first driver, and its checkpoint store the same one
    kwargs = {**driver_args, "peer": name, "name": name}
    options = supervised_options(
        standby_name(name),
        cfg.ray.namespace,
        **driver_ray_options(cfg),
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    )
    return driver_class(cfg).options(**options).remote(**kwargs)


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
    """Stop the queries and Spark cleanly, then remove the actor for good; with a standby
    (jobs/standby.py), both, the standing-by one first (else it would take over)."""

    def role(d: Any, wait_s: float) -> dict[str, Any]:
        try:
            return dict(ray.get(d.role_info.remote(), timeout=wait_s))
        except Exception:  # not answering: try to stop it cleanly anyway
            return {}

    first = role(driver, 30)
    pair = [(first, driver)]
    with contextlib.suppress(Exception):
        if first.get("peer"):
            peer = ray.get_actor(first["peer"], namespace=first["namespace"])
            pair.append((role(peer, 10), peer))
    for info, d in sorted(pair, key=lambda p: p[0].get("role") == "active"):
        if info.get("role") != "standby":  # a standby holds no state to close: just ended
            with contextlib.suppress(Exception):
                ray.get(d.shutdown.remote(timeout), timeout=timeout + 10)
        ray.kill(d, no_restart=True)
