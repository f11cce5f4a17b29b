"""Collector: the collection tier's front door (book ch. 2), one Ray actor per replica.

Every transport hands its events to one ingest path (`ingest.py`), which reads top to
bottom as the tier's data path:

    parse -> ids -> group commit -> MessageLogger (all k+1 replicas, synced)
          -> answer -> logic (validate, enrich, filter, route) -> BrokerBridge

Interaction patterns, and where each transport lives:
- request/response  `POST /v1/streams/{stream}/events` answers once the events are logged
  on every logger replica; `?wait=queued` answers once JetStream acknowledged them. With
  `logging.mode = "none"` there is no log, so every answer (any pattern) waits for
  JetStream's ack: nothing is called accepted before something durable holds it.
  (`http_routes.py`; over one WebSocket, a frame at a time: `websocket.py`)
- request/acknowledge `?ack=token` answers 202 with a token right after logging;
  `GET /v1/acks/{token}` tells logged / queued (with sequences) / failed. (`http_routes.py`)
- one-way  `POST /v1/streams/{stream}/fire` and UDP datagrams are answered (or not) before
  logging. Loss window: an event acknowledged with 204 (or sent by UDP) is lost if this
  replica dies before its group commit reaches the logger (a few ms); `oneway_lost`
  counts the ones whose logging failed while the replica lived. (`http_routes.py`, `udp.py`)
- publish/subscribe  core NATS `ingest.{stream}` (queue group `collectors`): logged like
  any producer's events, and answered when the message has a reply subject.
  (`nats_ingest.py`)
- stream  the collector as client of a source lives in `stream_ingest.py`; collectors
  process its buffer (`buffer_ingest.py`).
Group commit (`group_commit.py`) makes concurrent requests share one log write; the
hand-off to the BrokerBridge (`handoff.py`) makes one Ray call per batch, never per event.

Every refusal names its reason: 403 for a system stream (`results`, `deadletter`: only the
runtime writes them), 413 for an event JetStream could never take (the server's
`max_payload` less the headers, see `IngestPath.fit`), 503 with the assigned `ids` (and
`token`) when nothing was acknowledged, so the producer resends exactly those ids. A
browser's request from another site's page is refused before anything is read: 421 for a
host name this server does not answer to (DNS rebinding), 403 for another origin
(runtime/browsers.py, `[browsers]` in the config).

This module is the actor: its lifecycle, the control plane (endpoints, stats, shutdown) and
the routes table. The HTTP/UDP/NATS data plane runs on a `LoopThread` started in
`__init__`, so a replica Ray restarts serves again by itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web

from actors.collection.buffer_ingest import BufferIngest
from actors.collection.group_commit import GroupCommitPolicy, GroupCommitter
from actors.collection.handoff import BridgeHandoff
from actors.collection.http_routes import HttpProducers, reply
from actors.collection.ingest import COUNTERS, IngestPath
from actors.collection.nats_ingest import NatsIngest
from actors.collection.udp import UdpIngest
from actors.collection.websocket import WebSocketProducers
from actors.queue.logger import LoggerGroup
from runtime.binding import bind_failure, resolve, url_host
from runtime.browsers import BrowserGuard
from runtime.config import Config, validate
from runtime.loop_thread import LoopThread
from runtime.supervision.ray_actors import SupervisedActor, node_ip
from runtime.tls import http_scheme, server_ssl_context

log = logging.getLogger(__name__)

__all__ = ["Collector", "untokened_paths_off"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

DEFAULT_COMMIT = GroupCommitPolicy(max_events=2048, max_bytes=4 << 20, max_delay_ms=2.0)


def untokened_paths_off(cfg: Config, *, udp: bool, nats_ingest: bool) -> dict[str, str]:
    """With producer tokens, paths that carry no token must not reach a stream: UDP
    never (nothing in a datagram proves who sent it), NATS `ingest.*` only when NATS
    itself authenticates producers (per-role users: only `producer` may publish
    there). Returns path -> why it is off; logged loudly, shown in `stats`."""
    off: dict[str, str] = {}
    if not cfg.auth.producer_tokens:
        return off
    if udp:
        off["udp_off"] = "auth.producer_tokens is set and a datagram carries no token"
    if nats_ingest and not cfg.nats.role_users:
        off["nats_ingest_off"] = (
            "auth.producer_tokens is set but nats.role_users is off, so any NATS client "
            "could publish ingest.* without a token; set nats.role_users = true"
        )
    return off


class Collector(SupervisedActor):
    """Ray actor: accepts events over HTTP, WebSocket, UDP and NATS and logs them before
    answering. A thin front: the transports and the ingest path are built here, in
    `__init__`, and serve from the data plane's loop."""

    def __init__(
        self,
        state_dir: str,
        *,
        name: str,
        config: dict[str, Any],
        logger: LoggerGroup,
        bridges: Sequence[str],
        nats_url: str,
        host: str | None = None,
        port: int = 8000,
        udp_port: int = 0,
        nats_ingest: bool = True,
        namespace: str = "tierflow",
        max_body_bytes: int = 8 << 20,
        max_events: int = 10_000,
        max_event_bytes: int = 1 << 20,
        commit: GroupCommitPolicy | None = None,
        max_bridge_calls: int = 4,
        max_handoff_calls: int = 2,
        max_call_events: int = 4000,
        max_handoff_events: int = 50_000,
        start_timeout_s: float = 30.0,
        idle_timeout_s: float = 15.0,
        body_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(state_dir, name=name)
        self.cfg: Config = validate(config)
        # the config's `roles.collector.host` unless given (runtime/binding.py)
        self.binding = resolve(self.cfg.roles.collector.host if host is None else host, node_ip)
        self.host, self.port = self.binding.bind, port  # port 0: the bound one once serving
        self.max_body_bytes = max_body_bytes
        # a connection idle (or still sending its request head) this long is closed; a
        # body not received this long after its head is a 408 (http_routes.py)
        self.idle_timeout_s = idle_timeout_s
        self.off = untokened_paths_off(self.cfg, udp=bool(udp_port), nats_ingest=nats_ingest)
        for path, why in self.off.items():
            log.error("collector %s: %s: %s", self.name, path, why)
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.ingest = IngestPath(
            self.cfg,
            logger=logger,
            committer=GroupCommitter(logger.append, commit or DEFAULT_COMMIT),
            bridge=BridgeHandoff(
                bridges,
                namespace=namespace,
                logger_name=logger.name,
                counters=self.counters,
                max_bridge_calls=max_bridge_calls,
                max_handoff_calls=max_handoff_calls,
                max_call_events=max_call_events,
                max_handoff_events=max_handoff_events,
            ),
            counters=self.counters,
            max_events=max_events,
            max_event_bytes=max_event_bytes,
        )
        # runtime/browsers.py: another site's page may not produce (a WebSocket needs no
        # CORS); bodies are checked by type in parsing.py (415 for all but JSON/NDJSON)
        guard = BrowserGuard.build(
            scheme=http_scheme(self.cfg),
            bind_host=self.host,
            allowed_hosts=self.cfg.browsers.allowed_hosts,
            allowed_origins=self.cfg.browsers.allowed_origins,
            json_types=None,
        )
        self.http = HttpProducers(
            self.ingest,
            guard=guard,
            tokens=frozenset(self.cfg.auth.producer_tokens),  # empty: auth off
            max_body_bytes=max_body_bytes,
            body_timeout_s=body_timeout_s,
        )
        self.websocket = WebSocketProducers(self.ingest, max_msg_bytes=max_body_bytes)
        self.nats = NatsIngest(
            self.ingest,
            nats_url=nats_url,
            name=name,
            serve=nats_ingest and "nats_ingest_off" not in self.off,
        )
        self.udp: UdpIngest | None = None  # None: no UDP port, or producer tokens set
        if udp_port and "udp_off" not in self.off:
            self.udp = UdpIngest(self.ingest, host=self.host, port=udp_port)
        self.buffer = BufferIngest(self.ingest, nats_url=nats_url, name=name)
        self._dataplane = LoopThread(f"{name}-dataplane")
        self._dataplane.start(self._serve, start_timeout_s)

    def restore(self, store: Any) -> None:
        """Stateless by design: accepted events live in the MessageLogger, not here."""

    # ------------------------------------------------------------------ control plane (Ray)

    def endpoints(self) -> dict[str, Any]:
        return {
            "host": self.binding.advertise,
            "port": self.port,
            "udp_port": self.udp.port if self.udp is not None else 0,
            "url": f"{http_scheme(self.cfg)}://{url_host(self.binding.advertise)}:{self.port}",
        }

    def stats(self) -> dict[str, Any]:
        committer = self.ingest.committer
        return {
            **self.counters,
            "mode": self.ingest.mode,
            "in_flight": committer.pending_events,
            "requests_in_flight": self.http.requests_in_flight,
            # group commit: log flushes so far (accepted / flushes = events a flush)
            "log_flushes": committer.flushes,
            **self.off,
        }

    def shutdown(self) -> bool:
        """Stop taking work and finish what is in hand (drain), then stop serving."""
        return self._dataplane.stop()

    # ------------------------------------------------------------------ data plane thread

    def routes(self) -> list[tuple[str, str, Handler]]:
        """Every endpoint: (method, path, handler)."""
        return [
            ("POST", "/v1/streams/{stream}/events", self.http.post_events),
            ("POST", "/v1/streams/{stream}/fire", self.http.post_fire),
            ("GET", "/v1/streams/{stream}/ws", self.websocket.ws_producer),
            ("GET", "/v1/acks/{token}", self.http.get_ack),
            ("GET", "/healthz", self.healthz),
        ]

    async def healthz(self, _: web.Request) -> web.Response:
        return reply(200, {"ok": True, "name": self.name})

    async def _serve(self, stop: asyncio.Event, ready: Callable[[], None]) -> None:
        app = web.Application(
            client_max_size=self.max_body_bytes, middlewares=self.http.middlewares()
        )
        for method, path, handler in self.routes():
            if method == "GET":
                app.router.add_get(path, handler)  # answers HEAD too
            else:
                app.router.add_route(method, path, handler)
        runner = web.AppRunner(
            app, access_log=None, handle_signals=False, keepalive_timeout=self.idle_timeout_s
        )
        await runner.setup()
        ssl = server_ssl_context(self.cfg)  # None: plain HTTP (the default)
        site = web.TCPSite(runner, self.host, self.port, reuse_port=True, ssl_context=ssl)
        try:
            await site.start()
        except OSError as err:  # a taken port: PortTakenError, which the starter recognises
            raise bind_failure(self.name, self.host, self.port, err) from err
        self.port = runner.addresses[0][1]
        if self.udp is not None:
            await self.udp.start()
        await self.nats.start()
        await self.buffer.start(stop)
        ready()
        try:
            await stop.wait()
        finally:
            await runner.cleanup()  # stop accepting; in-flight handlers finish first
            await self.buffer.close()
            if self.udp is not None:
                self.udp.close()
            await self.nats.close()
            await self.ingest.drain()
