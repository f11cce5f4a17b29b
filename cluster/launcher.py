"""What `tierflow up` runs: engines, streams, the root supervisor and the admin endpoint.

One process owns one runtime. Started in the foreground it stops on Ctrl-C; detached
(`up --detach`) it is a daemon that records its pid and its children's pids in the
run-state file, so `tierflow down` stops exactly those.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, NotFoundError

from cluster.admin import serve
from cluster.console.feed import StatusFeed
from cluster.deploy.analysis import start_driver, stop_driver
from cluster.deploy.deployer import deploy
from cluster.deploy.gateway import scale_gateways, start_gateways, stop_gateways
from cluster.deploy.spec import RoleSpec, Start, SupervisorSpec
from cluster.pipeline import start_collection_tier
from cluster.roles import RoleView, load, rates, scalars
from runtime import runstate
from runtime.config import Config
from runtime.engines.services import Services, connect_nats, ensure_streams
from runtime.geo.replication import SourceWatch, local_site, replication_lag
from runtime.job_specs import decode_spec
from runtime.roles import SCALABLE_ROLES
from runtime.supervision.autoscaling import Controller, Sample
from runtime.supervision.policy import Intensity
from runtime.tls import http_scheme, server_ssl_context

log = logging.getLogger(__name__)

ROOT_SUPERVISOR = "tierflow-root"


class Runtime:
    """The engines and actors of one `tierflow up`, with the status they report."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.analysis = bool(cfg.jobs)  # the driver starts with the file's `[[jobs]]`
        self.services: Services | None = None
        self.root: Any = None
        self.nc: Any = None
        self.admin_runner: Any = None
        self.admin_url = ""
        self.started_at = time.time()
        self.streams: list[str] = []
        self.tier: Any = None
        self.gateways: list[str] = []
        self.gateway_url = ""
        self.driver: Any = None
        self._scaling = asyncio.Lock()
        self.roles: Any = None  # cluster.roles.RoleView
        self.autoscaler: Any = None  # runtime.supervision.autoscaling.Controller
        self._auto_stop = threading.Event()
        self._auto_thread: threading.Thread | None = None
        self._snap: tuple[float, dict[str, list[dict[str, Any]]]] = (0.0, {})
        self.geo_watch: SourceWatch | None = None
        self._geo_stop = asyncio.Event()
        self._geo_task: asyncio.Task[None] | None = None
        self._rates: dict[str, dict[str, float]] = {}
        self.feed: StatusFeed | None = None
        self._feed_stop = asyncio.Event()
        self._feed_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.services = await loop.run_in_executor(None, Services.start, self.cfg)
        self.nc = await connect_nats(self.cfg, self.services.nats_url, name="tierflow-up")
        self.streams = await ensure_streams(self.nc, self.cfg)
        await ensure_results_bucket(self.nc)
        await self._start_geo_watch()
        self.root = await loop.run_in_executor(None, start_root_supervisor, self.cfg)
        self.tier = await loop.run_in_executor(
            None, lambda: start_collection_tier(self.cfg, nats_url=self.services.nats_url)
        )
        await loop.run_in_executor(None, self._start_gateways)
        self.roles = RoleView(self.cfg.ray.namespace, self.tier, self.gateways)
        if self.analysis:
            await loop.run_in_executor(None, self._start_analysis)
        self._start_autoscaler(loop)
        self.admin_runner, port = await serve(
            self.status,
            self.cfg.admin.host,
            self.cfg.admin.port,
            self.scale,
            ssl_context=server_ssl_context(self.cfg),
        )
        self.admin_url = f"{http_scheme(self.cfg)}://{self.cfg.admin.host}:{port}"
        # the operations console's view, for the gateways (cluster/console/feed.py)
        self.feed = StatusFeed(self.nc, self.status, self.cfg.streams)
        self._feed_task = asyncio.create_task(
            self.feed.run(self._feed_stop), name="tierflow-console-feed"
        )

    async def _start_geo_watch(self) -> None:
        """This site's stream copies kicked off nats-server's source retry backoff once a
        lost origin answers again (runtime/geo/replication.py `SourceWatch`)."""
        groups = [s.replicate for s in self.cfg.streams.values() if s.replicate is not None]
        if not groups:
            return
        here = await local_site(self.nc, groups[0].site)
        self.geo_watch = SourceWatch(sites=frozenset({here}))
        self._geo_task = asyncio.create_task(
            self.geo_watch.run(self.nc, self.cfg, self._geo_stop), name="tierflow-geo-watch"
        )

    def _start_gateways(self) -> None:
        """The data access tier: gateways sharing one port (the console at `/`)."""
        self.gateways = start_gateways(
            self.cfg,
            self.services.nats_url,
            named_filters=self.cfg.gateway.filters,
            token_streams=self.cfg.auth.consumer_streams,
            options=self.cfg.gateway.options,
        )
        ep = ray.get(
            ray.get_actor(self.gateways[0], namespace=self.cfg.ray.namespace).endpoints.remote(),
            timeout=60,
        )
        self.gateway_url = ep.get("url") or f"http://{ep['host']}:{ep['port']}"

    def _start_autoscaler(self, loop: asyncio.AbstractEventLoop) -> None:
        """The controller loop of every role with a `[roles.<role>.autoscaling]` table, on
        its own thread: it reads the roles' load (Ray calls) and resizes through `scale`,
        the same path as `tierflow scale`, one resize at a time."""
        policies = {r: getattr(self.cfg.roles, r).autoscaling for r in SCALABLE_ROLES}
        policies = {r: p for r, p in policies.items() if p is not None}
        if not policies:
            return

        def metrics(role: str) -> list[Sample]:
            return [Sample(time.monotonic(), load(role, self._snapshot(max_age_s=0.5)[role]))]

        def resize(role: str, n: int) -> None:
            asyncio.run_coroutine_threadsafe(self.scale(role, n), loop).result(timeout=900)

        self.autoscaler = Controller(policies, metrics, self.roles.replicas, resize)
        tick = max(0.5, min(2.0, min(p.look_back_s for p in policies.values()) / 4))
        self._auto_thread = threading.Thread(
            target=self.autoscaler.run,
            args=(self._auto_stop, tick),
            name="tierflow-autoscaler",
            daemon=True,
        )
        self._auto_thread.start()

    def _snapshot(self, max_age_s: float = 0.0) -> dict[str, list[dict[str, Any]]]:
        """The roles' figures, re-read unless the last read is younger than `max_age_s`;
        rates are computed between consecutive reads."""
        t, snap = self._snap
        now = time.monotonic()
        if snap and now - t < max_age_s:
            return snap
        fresh = self.roles.snapshot()
        if snap:
            self._rates = rates(snap, fresh, now - t)
        self._snap = (now, fresh)
        return fresh

    def _start_analysis(self) -> None:
        """The analyses in the Spark driver actor (its first query takes ~10 s): the
        config's `[[jobs]]`."""
        specs = [decode_spec(j) for j in self.cfg.jobs]
        self.driver = start_driver(self.cfg, self.services.nats_url, specs)

    async def stop(self) -> None:
        self._auto_stop.set()
        self._geo_stop.set()
        self._feed_stop.set()
        if self._feed_task is not None:  # a round in progress is bounded by its probes
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._feed_task, 30)
            self._feed_task = None
        if self._geo_task is not None:  # a look in progress ends within its 2-s bound
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._geo_task, 10)
            self._geo_task = None
        if self._auto_thread is not None:  # a resize in progress finishes first
            await asyncio.get_running_loop().run_in_executor(None, self._auto_thread.join, 900)
            self._auto_thread = None
        if self.admin_runner is not None:
            await self.admin_runner.cleanup()
            self.admin_runner = None
        loop = asyncio.get_running_loop()
        if self.driver is not None:
            await loop.run_in_executor(None, stop_driver, self.driver)
            self.driver = None
        if self.gateways:
            await loop.run_in_executor(None, stop_gateways, self.cfg, self.gateways)
            self.gateways = []
        if self.tier is not None:  # collectors drain first, then bridges, then loggers
            await asyncio.get_running_loop().run_in_executor(None, self.tier.stop)
            self.tier = None
        if self.root is not None:
            try:
                await asyncio.wait_for(self.root.stop.remote(), timeout=10)
            except Exception as err:  # a dying cluster must not block the rest of shutdown
                log.warning("root supervisor did not stop cleanly: %s", err)
            with contextlib.suppress(Exception):
                ray.kill(self.root, no_restart=True)
            self.root = None
        if self.services is not None:
            await loop.run_in_executor(None, sweep_named_actors, self.cfg.ray.namespace)
        if self.nc is not None:
            await self.nc.close()
            self.nc = None
        if self.services is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.services.stop)
            self.services = None

    async def scale(self, role: str, n: int) -> list[str]:
        """Resize a role while it runs (blocking Ray calls, so off the event loop); one
        resize at a time, so an operator's `tierflow scale` and the autoscaler never
        interleave their steps."""
        if role not in SCALABLE_ROLES:
            raise ValueError(f"unknown role {role!r}: one of {', '.join(SCALABLE_ROLES)}")
        loop = asyncio.get_running_loop()
        async with self._scaling:
            if role == "gateway":
                if not self.gateways:
                    raise ValueError("the gateways are not running")
                return await loop.run_in_executor(None, scale_gateways, self.cfg, self.gateways, n)
            if self.tier is None:
                raise ValueError("the collection tier is not running")
            return await loop.run_in_executor(None, self.tier.scale, role, n)

    def describe(self) -> dict[str, Any]:
        assert self.services is not None
        return {
            **self.services.describe(),
            "admin": {"url": self.admin_url},
            "streams": self.streams,
            "collector": {"url": self.tier.url if self.tier else None},
            "gateway": {"url": self.gateway_url or None, "replicas": self.gateways},
        }

    async def status(self) -> dict[str, Any]:
        """A snapshot for `tierflow status` and /metrics; every probe is bounded in time."""
        svc = self.services
        out: dict[str, Any] = {
            "pid": os.getpid(),
            "started_at": self.started_at,
            "uptime_s": round(time.time() - self.started_at, 1),
            "services": {},
            "children": [],
            "escalated": None,
        }
        if svc is None:
            return out
        desc = svc.describe()
        nats_ok = bool(self.nc and self.nc.is_connected)
        out["services"]["nats"] = {**desc["nats"], "healthy": nats_ok}
        nodes = [
            {
                "node_id": n["NodeID"],
                "alive": n["Alive"],
                "address": n["NodeManagerAddress"],
                "cpus": n.get("Resources", {}).get("CPU", 0),
            }
            for n in ray.nodes()
        ]
        out["services"]["ray"] = {
            **desc["ray"],
            "healthy": any(n["alive"] for n in nodes),
            "nodes": nodes,
        }
        out["services"]["spark"] = {**desc["spark"], "healthy": None}
        if self.root is not None:
            try:
                sup = await asyncio.wait_for(self.root.status.remote(), timeout=5)
                out["children"] = [
                    {"name": sup["name"], "state": "running", "alive": True, "restarts": 0},
                    *(
                        {"name": cid, "alive": c["state"] == "running", **c}
                        for cid, c in sup["children"].items()
                    ),
                ]
                out["escalated"] = sup["escalation_reason"]
                out["escalations"] = sup.get("escalations", [])
            except Exception as err:
                out["supervisor_error"] = repr(err)
        if self.tier is not None:
            out["loggers"] = await self._logger_status()
        if self.roles is not None:
            out["roles"] = await self._roles_status()
        if self.autoscaler is not None:
            out["autoscaling"] = {
                role: {
                    "desired": d.desired,
                    "reason": d.reason,
                    "error": self.autoscaler.errors.get(role),
                }
                for role, d in self.autoscaler.last.items()
            }
        if self.driver is not None:
            out["analysis"] = await self._analysis_status()
        if self.nc is not None and any(s.replicate for s in self.cfg.streams.values()):
            out["replication"] = await replication_lag(self.nc, self.cfg)  # bounded: 2 s
            if self.geo_watch is not None:
                out["replication_kicks"] = self.geo_watch.kicked
        return out

    async def _roles_status(self) -> dict[str, Any]:
        snap = await asyncio.get_running_loop().run_in_executor(None, self._snapshot)
        return {
            role: {
                "replicas": rows,
                "load": load(role, rows),
                "rates": self._rates.get(role, {}),
                "nodes": sorted({r["node"] for r in rows if r.get("node")}),
            }
            for role, rows in snap.items()
        }

    async def _analysis_status(self) -> dict[str, Any]:
        """The driver's queries with their lag: events in the stream not yet committed."""
        try:
            st = await asyncio.wait_for(self.driver.status.remote(), timeout=10)
        except Exception as err:
            return {"state": "unreachable", "error": repr(err)}
        js = self.nc.jetstream()
        lasts: dict[str, int | None] = {}  # one look per stream: its jobs, scan and archive
        queries = []
        for name, q in (st.get("queries") or {}).items():
            stream = q["stream"]
            if stream not in lasts:
                try:
                    lasts[stream] = (await js.stream_info(stream)).state.last_seq
                except Exception:  # the stream is not there yet
                    lasts[stream] = None
            last = lasts[stream]
            lag = None if last is None else max(0, last - int(q.get("committed_seq") or 0))
            queries.append({"name": name, **scalars(q), "lag": lag})
        # with a warm standby (spark.standby): which process runs the queries, and its
        # takeover when it took them over from the other
        return {
            "state": st.get("state"),
            "pid": st.get("pid"),
            "took_over": st.get("took_over"),
            "queries": queries,
            "dead_letters": st.get("dead_letters") or {},
        }

    async def _logger_status(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for group in self.tier.loggers:
            try:
                replicas = await asyncio.wait_for(group.status(), timeout=10)
            except Exception as err:
                replicas = [{"name": group.name, "error": repr(err)}]
            for r in replicas:
                c = r.get("counts") or {}
                rows.append(
                    {
                        "replica": r.get("name"),
                        "state": "error" if "error" in r else "running",
                        "transient": c.get("transient"),
                        "failed": c.get("failed"),
                        "parked": r.get("parked"),
                        "bytes": c.get("bytes"),
                        "epoch": r.get("epoch"),
                        "catching_up": r.get("catching_up"),
                        "pid": r.get("pid"),
                        "error": r.get("error"),
                    }
                )
        return rows


def sweep_named_actors(namespace: str) -> list[str]:
    """Kill whatever named actor of ours the orderly stop left (a replica restarting at that
    moment, a stream-ingest standby): on a shared cluster detached actors outlive the job
    that made them, so stopping must not rely on every earlier step having succeeded."""
    if not ray.is_initialized():
        return []
    killed: list[str] = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") != namespace:
            continue
        try:
            ray.kill(ray.get_actor(entry["name"], namespace=namespace), no_restart=True)
            killed.append(entry["name"])
        except Exception as err:  # gone in between
            log.info("sweep %s: %r", entry["name"], err)
    if killed:
        log.warning("stopped actors the orderly shutdown left: %s", ", ".join(sorted(killed)))
    return killed


async def ensure_results_bucket(nc: Any, bucket: str = "results") -> None:
    """The in-memory store tier: latest result per key. Made at start-up so readers
    (the dashboard's snapshot, `kv:results` subscriptions) find it before the first
    analysis batch lands."""
    js = nc.jetstream()
    try:
        await js.key_value(bucket)
    except (BucketNotFoundError, NotFoundError):  # the same config jobs/sink.py would make
        await js.create_key_value(
            KeyValueConfig(bucket=bucket, history=1, storage=StorageType.FILE)
        )


def root_role() -> RoleSpec:
    """The top of the supervision tree: no children of its own, 5 restarts a minute."""
    supervisor = SupervisorSpec(ROOT_SUPERVISOR, intensity=Intensity(max_restarts=5, period_s=60.0))
    return RoleSpec(role="root", children=(), start=Start.SUPERVISED, supervisor=supervisor)


def start_root_supervisor(cfg: Config) -> Any:
    """Start (or get) the root supervisor."""
    (root,) = deploy([root_role()], namespace=cfg.ray.namespace, state_dir=str(cfg.state_path))
    return root.supervisor


async def serve_forever(
    cfg: Config,
    *,
    on_ready: Callable[[Runtime, asyncio.Event], None] | None = None,
    record_state: bool = True,
) -> None:
    """Run until SIGTERM/SIGINT (or `stop` is set); the run-state file exists while it runs."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def handle_signals() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

    handle_signals()
    rt = Runtime(cfg)
    try:
        await rt.start()
        # ray.init installs its own SIGTERM handler, which skips our cleanup: take it back.
        handle_signals()
        if record_state:
            me = os.getpid()
            runstate.write_state(
                cfg,
                {
                    "process": runstate.process_identity(me),
                    "children": [runstate.process_identity(p) for p in runstate.descendants(me)],
                    "ready": True,
                    **rt.describe(),
                },
            )
        if on_ready:
            on_ready(rt, stop)
        await stop.wait()
    finally:
        try:
            await rt.stop()
        finally:
            if record_state:
                runstate.clear_state(cfg)
