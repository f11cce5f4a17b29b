"""The admin endpoint of a running `tierflow up`: `/status` (JSON), `/metrics`, `/healthz`.

`tierflow status` reads `/status` instead of joining Ray itself (a Ray driver costs
seconds to start); Prometheus scrapes `/metrics`. It binds loopback unless the config
says otherwise, because it reveals the topology.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from cluster.roles import LOAD_FIELD

StatusFn = Callable[[], Awaitable[dict[str, Any]]]
ScaleFn = Callable[[str, int], Awaitable[list[str]]]


class StatusMetrics:
    """Prometheus gauges refreshed from a status snapshot at each scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.up = Gauge("tierflow_up", "1 while the runtime runs", registry=self.registry)
        self.uptime = Gauge("tierflow_uptime_seconds", "Runtime uptime", registry=self.registry)
        self.service_healthy = Gauge(
            "tierflow_service_healthy",
            "1 when an engine answers",
            ["service"],
            registry=self.registry,
        )
        self.ray_nodes = Gauge(
            "tierflow_ray_nodes_alive", "Alive Ray nodes", registry=self.registry
        )
        self.child_restarts = Gauge(
            "tierflow_child_restarts",
            "Restarts seen by the supervisor",
            ["child"],
            registry=self.registry,
        )
        self.child_alive = Gauge(
            "tierflow_child_alive",
            "1 when the child answered its last heartbeat",
            ["child"],
            registry=self.registry,
        )

        self.role_replicas = Gauge(
            "tierflow_role_replicas", "Replicas of a role", ["role"], registry=self.registry
        )
        self.role_load = Gauge(
            "tierflow_role_load",
            "A role's load: collector requests in flight, logger pending entries, bridge "
            "publishes awaiting ack, gateway clients",
            ["role"],
            registry=self.registry,
        )
        self.role_rate = Gauge(
            "tierflow_role_rate",
            "Per-second rate of a role's counter since the previous status",
            ["role", "counter"],
            registry=self.registry,
        )
        self.replica_load = Gauge(
            "tierflow_replica_load",
            "One replica's load",
            ["role", "replica"],
            registry=self.registry,
        )
        self.query_lag = Gauge(
            "tierflow_analysis_lag_events",
            "Events in the stream the query has not committed",
            ["query"],
            registry=self.registry,
        )
        self.query_late = Gauge(
            "tierflow_analysis_late_events",
            "Events a query dropped as later than its watermark, since the driver started",
            ["query"],
            registry=self.registry,
        )
        self.replication_lag = Gauge(
            "tierflow_replication_lag_events",
            "Events a stream's copy on `site` has not yet sourced from `origin` (docs/geo.md)",
            ["stream", "site", "origin"],
            registry=self.registry,
        )
        self.replication_kicks = Gauge(
            "tierflow_replication_source_kicks",
            "Leader changes this runtime asked of its site's copies stalled on nats-server's "
            "source retry backoff (runtime/geo/replication.py SourceWatch)",
            registry=self.registry,
        )
        self.replication_up = Gauge(
            "tierflow_replication_copy_up",
            "1 when a stream's copy on `site` answers",
            ["stream", "site"],
            registry=self.registry,
        )

    def update(self, status: dict[str, Any]) -> None:
        self.up.set(1)

        for role, view in status.get("roles", {}).items():
            self.role_replicas.labels(role).set(len(view.get("replicas", [])))
            self.role_load.labels(role).set(view.get("load", 0))
            for counter, rate in (view.get("rates") or {}).items():
                self.role_rate.labels(role, counter).set(rate)
            for r in view.get("replicas", []):
                if "error" not in r:
                    self.replica_load.labels(role, r["name"]).set(r.get(LOAD_FIELD[role]) or 0)
        for q in (status.get("analysis") or {}).get("queries", []):
            if q.get("lag") is not None:
                self.query_lag.labels(q["name"]).set(q["lag"])
            if q.get("late_events") is not None:
                self.query_late.labels(q["name"]).set(q["late_events"])
        if "replication_kicks" in status:
            self.replication_kicks.set(status["replication_kicks"])
        for r in status.get("replication") or []:
            self.replication_up.labels(r["stream"], r["site"]).set(1 if r.get("up") else 0)
            if r.get("lag") is not None:
                self.replication_lag.labels(r["stream"], r["site"], r["from"]).set(r["lag"])
        self.uptime.set(status.get("uptime_s", 0))
        for name, svc in status.get("services", {}).items():
            self.service_healthy.labels(name).set(1 if svc.get("healthy") else 0)
        nodes = status.get("services", {}).get("ray", {}).get("nodes", [])
        self.ray_nodes.set(sum(1 for n in nodes if n.get("alive")))
        for child in status.get("children", []):
            self.child_restarts.labels(child["name"]).set(child.get("restarts", 0))
            self.child_alive.labels(child["name"]).set(1 if child.get("alive") else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def make_app(status_fn: StatusFn, scale_fn: ScaleFn | None = None) -> web.Application:
    metrics = StatusMetrics()

    async def status(_: web.Request) -> web.Response:
        body = await status_fn()
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    async def prom(_: web.Request) -> web.Response:
        metrics.update(await status_fn())
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True, "time": time.time()})

    async def scale(request: web.Request) -> web.Response:
        if scale_fn is None:
            return web.json_response({"error": "scaling is not available"}, status=501)
        try:
            body = await request.json()
            role, n = str(body["role"]), int(body["replicas"])
            replicas = await scale_fn(role, n)
        except (KeyError, TypeError, ValueError) as err:
            return web.json_response({"error": str(err)}, status=400)
        return web.json_response({"role": role, "replicas": replicas})

    app = web.Application()
    app.router.add_post("/scale", scale)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", prom)
    app.router.add_get("/healthz", healthz)
    return app


async def serve(
    status_fn: StatusFn,
    host: str,
    port: int,
    scale_fn: ScaleFn | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> tuple[web.AppRunner, int]:
    """Start the admin app; returns the runner (to clean up) and the bound port.

    `ssl_context` (runtime.tls.server_ssl_context) serves HTTPS only; None is plain HTTP.
    """
    runner = web.AppRunner(make_app(status_fn, scale_fn), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    bound = runner.addresses[0][1]
    return runner, bound
