"""Gateway: the data access tier (book ch. 7-9), one Ray actor per replica.

Serves any JetStream stream (raw events, results) and KV bucket to clients, per the wire
protocol in docs/contracts.md. Where each part lives:

- `protocol.py`: close codes, refusals, stream names, client messages, start positions;
- `auth.py`: tokens, the streams a token may read, who owns what it makes;
- `websocket.py`: `/v1/ws` (subscribe, client acks, slow-down, several subscriptions per
  connection) and the book's `/streaming` (the latest top-N list on every change);
- `sse.py`: `/v1/sse/{stream}` (`id:` is the stream sequence, `Last-Event-ID` resumes);
- `rest.py`: long polling, latest, `?since=`, KV snapshots and the webhook registry;
- `plane.py`: the steps they share (stream lookup, filters, start positions, cursors, lag
  policy) and the replica's NATS connection, feeds, cursors and webhooks;
- `fanout.py`: one JetStream consumer per stream feeds every client of this replica, with
  a bounded lag per client and the stream's policy past it (`drop_oldest` or 4408);
- `messages.py`, `reader.py`: a stream message as clients are sent it, read from JetStream;
- `cursors.py`: server-side resume points; `webhooks.py`: signed, retried callbacks;
- `pages.py`: the operations console at `/` (`console.py`: its view) and configured views;
- `runtime/browsers.py`: which browser requests are served at all (`Host` one of this
  server's names, `Origin` its own or an allowed one, bodies declared `application/json`),
  checked by one middleware in front of every route but `/healthz`.

This module is the actor: its lifecycle, the control plane (endpoints, stats, shutdown)
and the HTTP app with its routes table. Replicas share a port with SO_REUSEPORT; a
restarted replica serves again by itself (the data plane starts in `__init__`). Starting,
scaling and stopping replicas is cluster/deploy/gateway.py.

Positions are stream sequences. `"from": N` is inclusive, `"after": N` (and
`Last-Event-ID: N`) starts after N, so a client that kept the seq L of the last event it
processed resumes with `"after": L` and gets no gap and no repeat, on any replica.
`"from": "cursor"` resumes from the server-side cursor, which belongs to the token that
made it: with client acks, at-least-once (repeats limited to what was acknowledged in the
last flush interval before a crash); without acks the cursor is the last seq written to the
connection, so a crash may also skip what was still in flight. A cursor that is named but
missing is a 410 naming the oldest sequence still held, never a silent "new".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import nats.errors
from aiohttp import web

from actors.access.auth import request_token
from actors.access.compacted import CompactedRoutes
from actors.access.console import ConsoleRoutes
from actors.access.pages import page_paths, page_routes
from actors.access.plane import DataPlane
from actors.access.protocol import Problem, refusal, reply
from actors.access.rest import RestRoutes
from actors.access.sql import SqlRoutes
from actors.access.sse import SseRoutes
from actors.access.websocket import WebSocketRoutes
from runtime.binding import bind_failure, resolve, url_host
from runtime.browsers import BrowserGuard, cors_headers
from runtime.config import Config, GatewayOptions, validate
from runtime.loop_thread import LoopThread
from runtime.roles import ANALYSIS_DRIVER
from runtime.supervision.ray_actors import SupervisedActor, node_ip
from runtime.tls import http_scheme, server_ssl_context

log = logging.getLogger(__name__)

__all__ = ["Gateway"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# served to anyone whatever Host or Origin it names: it returns no data (health probes
# reach a replica by its pod or node address)
BROWSER_EXEMPT = ("/healthz",)
_CORS_ORIGIN = "tierflow.cors_origin"


class Gateway(SupervisedActor):
    """Ray actor: one data-access replica. Replicas share a port with SO_REUSEPORT; a
    restarted replica serves again by itself (the data plane starts in `__init__`).

    `options` default to the config's `[gateway.options]` (checked when it loaded)."""

    def __init__(
        self,
        state_dir: str,
        *,
        name: str,
        config: dict[str, Any],
        nats_url: str,
        host: str | None = None,
        port: int | None = None,
        named_filters: Mapping[str, str] | None = None,
        token_streams: Mapping[str, Sequence[str]] | None = None,
        options: GatewayOptions | None = None,
        start_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(state_dir, name=name)
        self.cfg: Config = validate(config)
        # the config's `roles.gateway.host` unless given (runtime/binding.py)
        self.binding = resolve(self.cfg.roles.gateway.host if host is None else host, node_ip)
        self.host = self.binding.bind
        self.port = self.cfg.roles.gateway.port if port is None else port
        self.options = self.cfg.gateway.options if options is None else options
        self.instance = f"{name}:{self.incarnation[:8]}"
        self.plane = DataPlane(
            self.cfg,
            self.options,
            name=name,
            instance=self.instance,
            nats_url=nats_url,
            named_filters=named_filters,
            token_streams=token_streams,
        )
        self.guard = BrowserGuard.build(
            scheme=http_scheme(self.cfg),
            bind_host=self.host,
            allowed_hosts=self.cfg.browsers.allowed_hosts,
            allowed_origins=self.cfg.browsers.allowed_origins,
            exempt=BROWSER_EXEMPT,
            pages=page_paths(self.cfg.gateway.views),
        )
        self._loop_thread = LoopThread(f"{name}-dataplane")
        self._loop_thread.start(self._serve, start_timeout_s)

    def restore(self, store: Any) -> None:
        """Stateless: positions live in the cursor bucket, webhooks in theirs."""

    # ------------------------------------------------------------------ control plane

    def endpoints(self) -> dict[str, Any]:
        host = self.binding.advertise
        return {
            "host": host,
            "port": self.port,
            "url": f"{http_scheme(self.cfg)}://{url_host(host)}:{self.port}",
        }

    def stats(self) -> dict[str, Any]:
        return self._loop_thread.call(self._stats()).result(10)

    def shutdown(self) -> bool:
        """Close every client (1001, cursors flushed), hand webhook leases over, stop."""
        return self._loop_thread.stop()

    async def _stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "instance": self.instance,
            "pid": self.pid,
            "port": self.port,
            **self.plane.stats(),
        }

    # ------------------------------------------------------------------ data plane

    def routes(self) -> list[tuple[str, str, Handler]]:
        """Every endpoint: (method, path, handler). The pages add `/`, `/static/` and views."""
        ws = WebSocketRoutes(self.plane)
        sse = SseRoutes(self.plane)
        rest = RestRoutes(self.plane)
        sql = SqlRoutes(self.plane, self._run_sql)
        compacted = CompactedRoutes(self.plane, rest.latest)
        console = ConsoleRoutes(self.plane)
        return [
            ("GET", "/healthz", self.healthz),
            ("GET", "/v1/ws", ws.ws),
            ("GET", "/streaming", ws.streaming),
            ("GET", "/v1/sse/{stream}", sse.sse),
            ("GET", "/v1/poll/{stream}", rest.poll),
            ("GET", "/v1/streams", rest.list_streams),
            ("GET", "/v1/streams/{stream}", rest.since),
            ("GET", "/v1/streams/{stream}/latest", compacted.latest),  # rest.latest w/o key
            ("GET", "/v1/streams/{stream}/keys", compacted.keys),
            ("GET", "/v1/kv/{bucket}", rest.kv_snapshot),
            ("POST", "/v1/webhooks", rest.webhook_register),
            ("GET", "/v1/webhooks", rest.webhook_list),
            ("GET", "/v1/webhooks/{id}", rest.webhook_get),
            ("DELETE", "/v1/webhooks/{id}", rest.webhook_delete),
            ("GET", "/v1/stats", self.http_stats),
            ("POST", "/v1/sql", sql.sql),
            ("GET", "/v1/console", console.console),
        ]

    async def _serve(self, stop: asyncio.Event, ready: Callable[[], None]) -> None:
        await self.plane.start()
        app = web.Application(
            client_max_size=1 << 20, middlewares=[browsers(self.guard, self.plane), _errors]
        )
        for method, path, handler in self.routes():
            if method == "GET":
                app.router.add_get(path, handler)  # answers HEAD too
            else:
                app.router.add_route(method, path, handler)
        page_routes(app, self.cfg.gateway.views)
        app.on_response_prepare.append(_cors)
        runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            shutdown_timeout=5,
            keepalive_timeout=self.options.idle_timeout_s,
        )
        await runner.setup()
        site = web.TCPSite(
            runner, self.host, self.port, reuse_port=True, ssl_context=server_ssl_context(self.cfg)
        )
        try:
            await site.start()
        except OSError as err:  # a taken port: PortTakenError, which the starter recognises
            raise bind_failure(self.name, self.host, self.port, err) from err
        self.port = runner.addresses[0][1]
        ready()
        try:
            await stop.wait()
        finally:
            await self.plane.close_clients()
            await runner.cleanup()
            await self.plane.stop()

    async def _run_sql(self, request: dict[str, Any]) -> dict[str, Any]:
        """`/v1/sql`'s query, run by the analysis driver (the gateway holds no Spark): one
        control-plane call per query, never per event."""
        import ray

        try:
            driver = await asyncio.to_thread(
                ray.get_actor, ANALYSIS_DRIVER, namespace=self.cfg.ray.namespace
            )
        except ValueError:
            return {"status": 503, "error": "no analysis driver runs: start tierflow or a job"}
        timeout = float(request.get("timeout_s", 30.0)) + 30.0
        try:
            return dict(await asyncio.wait_for(driver.sql.remote(**request), timeout))
        except (TimeoutError, ray.exceptions.RayError) as err:
            return {"status": 503, "error": f"the analysis driver did not answer: {err!r}"}

    # ------------------------------------------------------------------ HTTP basics

    async def healthz(self, _: web.Request) -> web.Response:
        return reply(200, {"ok": True, "name": self.name, "instance": self.instance})

    async def http_stats(self, request: web.Request) -> web.Response:
        """The replica's figures as this token may see them (plane.visible_stats)."""
        token = request_token(request)
        try:
            self.plane.access.authenticate(token)
        except Problem as p:
            self.plane.count(p)
            return refusal(p)
        head = {"name": self.name, "instance": self.instance, "pid": self.pid, "port": self.port}
        return reply(200, {**head, **self.plane.visible_stats(token)})


def browsers(guard: BrowserGuard, plane: DataPlane) -> Any:
    """Every route behind runtime/browsers.py's rules (Host, Origin, JSON bodies), before
    its handler runs: a refused WebSocket is never upgraded, a refused query never read."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        local_ip = sock[0] if isinstance(sock, tuple) and sock else None
        refused = guard.check(request.method, request.path, request.headers, local_ip)
        if refused is not None:
            plane.counters["refused_browser"] += 1
            return reply(refused.status, {"error": refused.reason})
        origin = request.headers.get("Origin")
        if origin is not None and request.path not in BROWSER_EXEMPT:
            if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
                return web.Response(status=204, headers=cors_headers(origin, preflight=True))
            request[_CORS_ORIGIN] = origin  # answered with CORS headers (_cors below)
        return await handler(request)

    return check


async def _cors(request: web.Request, response: web.StreamResponse) -> None:
    """An allowed page reads its answer, a stream's (SSE) too: set before it is sent."""
    origin = request.get(_CORS_ORIGIN)
    if origin is not None:
        response.headers.update(cors_headers(origin))


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Nothing unexpected leaves as a bare 500 page: NATS trouble is a 503 to retry, a bug a
    JSON 500 (and a log line); the gateway itself stays up either way."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except (nats.errors.Error, TimeoutError) as err:
        log.warning("%s %s: NATS: %r", request.method, request.path, err)
        return reply(
            503, {"error": f"NATS unavailable, retry later: {err!r}"}, {"Retry-After": "1"}
        )
    except Exception as err:
        log.exception("%s %s failed", request.method, request.path)
        return reply(500, {"error": f"internal error: {type(err).__name__}"})
