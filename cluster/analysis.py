"""``tierflow jobs list|start|stop``: the operator's side of the analysis driver.

Joins the running tierflow's Ray, finds the named `AnalysisDriver` (or starts one) and
changes its wanted jobs. The catalog of named jobs lives here, above the analysis tier,
because it includes the Meetup demo's queries when a `meetup` stream is configured.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
import ray

from cluster.demo.meetup import QUERIES, STREAM, meetup_jobs
from cluster.deploy.analysis import start_driver
from jobs.driver import DRIVER_NAME, AnalysisDriverError
from runtime import runstate
from runtime.config import Config
from runtime.data.sql_jobs import job_streams
from runtime.engines.services import join_ray
from runtime.job_specs import JobSpec, decode_spec, parse_job


def connect_ray(cfg: Config) -> None:
    """Join `ray.address`, the running tierflow's Ray (its run-state file), or the cluster
    ``RAY_ADDRESS`` names (set by ``ray job submit``)."""
    if ray.is_initialized():
        return

    state = runstate.read_state(cfg) or {}
    ray_state = state.get("ray") or {}
    address = cfg.ray.address or ray_state.get("address") or os.environ.get("RAY_ADDRESS", "")
    if not address:
        raise AnalysisDriverError(
            "no Ray to join: start tierflow with `tierflow up --detach`, set ray.address, or "
            "run under `ray job submit`"
        )
    join_ray(address, cfg.ray.namespace, ray_state.get("auth_mode", ""))


def runtime_nats_url(cfg: Config) -> str:
    """``nats.url``, or the URL of the running tierflow's embedded server."""
    url = runstate.nats_url(cfg)
    if not url:
        raise AnalysisDriverError("no NATS URL: set nats.url, or start tierflow with `tierflow up`")
    return url


def get_driver(cfg: Config, name: str = DRIVER_NAME) -> Any | None:
    try:
        return ray.get_actor(name, namespace=cfg.ray.namespace)
    except ValueError:
        return None


def catalog(cfg: Config) -> dict[str, JobSpec]:
    """Jobs known by name: the Meetup queries (when a ``meetup`` stream is configured) and
    a ``jobs`` list in the config, once the config has one."""

    out: dict[str, JobSpec] = {}
    if STREAM in cfg.streams:
        out.update({s.name: s for s in meetup_jobs()})
    for raw in getattr(cfg, "jobs", None) or []:
        spec = decode_spec(raw)
        out[spec.name] = spec
    return out


def resolve_jobs(cfg: Config, name: str) -> list[JobSpec]:
    """`name` as jobs: a catalog name, ``meetup`` (all five), or an inline spec."""
    known = catalog(cfg)
    if name in known:
        return [known[name]]
    if name == "meetup":
        return [known[q] for q in QUERIES if q in known]
    if "=" in name or name.lstrip().startswith("{"):
        return [parse_job(name)]
    raise AnalysisDriverError(
        f"unknown job {name!r}: known are {sorted(known) or 'none'}; or give a spec such as "
        "'name=topics kind=topn stream=meetup field=group.group_topics[].topic_name'"
    )


def _call(ref: Any, timeout: float) -> Any:
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError as err:
        raise AnalysisDriverError(f"the analysis driver did not answer within {timeout} s") from err


def jobs_list(cfg: Config) -> list[dict[str, Any]]:
    """Every known or running job: name, kind, stream, state and the query's numbers."""
    connect_ray(cfg)
    driver = get_driver(cfg)
    status = _call(driver.status.remote(), 30) if driver is not None else {"queries": {}}
    rows = []
    for name, q in sorted(status["queries"].items()):
        rows.append({"name": name, **q})
    running = set(status["queries"])
    for name, spec in sorted(catalog(cfg).items()):
        if name not in running:
            rows.append(
                {
                    "name": name,
                    "kind": spec.kind,
                    "stream": ",".join(job_streams(spec)),
                    "state": "available",
                }
            )
    return rows


def jobs_start(cfg: Config, name: str) -> list[dict[str, Any]]:
    """Start job(s) `name` (see `resolve_jobs`) in the driver, starting the driver if needed."""
    specs = resolve_jobs(cfg, name)
    connect_ray(cfg)
    driver = get_driver(cfg) or start_driver(cfg, runtime_nats_url(cfg))
    out = []
    for spec in specs:
        row = _call(driver.start.remote(msgspec.to_builtins(spec), 120.0), 180)
        out.append({"name": spec.name, **(row or {"state": "starting"})})
    return out


def jobs_explain(cfg: Config, name: str) -> dict[str, Any]:
    """A running sql job's plan, mode, key, watermarks and state (jobs/sql_jobs.py)."""
    connect_ray(cfg)
    driver = get_driver(cfg)
    if driver is None:
        raise AnalysisDriverError("the analysis driver is not running")
    return dict(_call(driver.explain.remote(name), 120))


def jobs_stop(cfg: Config, name: str) -> list[dict[str, Any]]:
    """Stop job(s) `name` (a job name or ``meetup``); their checkpoints stay."""
    connect_ray(cfg)
    driver = get_driver(cfg)
    if driver is None:
        raise AnalysisDriverError("the analysis driver is not running")
    names = list(QUERIES) if name == "meetup" else [name]
    return [_call(driver.stop.remote(n, 60.0), 90) for n in names]


def jobs_recompute(cfg: Config, name: str, timeout_s: float = 3600.0) -> list[dict[str, Any]]:
    """Recompute job `name` as a batch view over its stream's history; its live view is
    then served merged with it (jobs/batch_view.py). Waits up to `timeout_s`."""
    connect_ray(cfg)
    driver = get_driver(cfg)
    if driver is None:
        raise AnalysisDriverError("the analysis driver is not running")
    try:
        return [_call(driver.recompute.remote(name, 120.0), timeout_s)]
    except ray.exceptions.RayTaskError as err:
        cause = err.cause if isinstance(err.cause, Exception) else err
        raise AnalysisDriverError(str(cause).strip().splitlines()[-1]) from None
