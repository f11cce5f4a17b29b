"""Collector: the collection tier's front door (book ch. 2), one Ray actor per replica.

The path of one request, top to bottom in this module:

    parse -> ids -> group commit -> MessageLogger (all k+1 replicas, synced)
          -> answer -> logic (validate, enrich, filter, route) -> BrokerBridge

Interaction patterns:
- request/response  `POST /v1/streams/{stream}/events` answers once the events are logged
  on every logger replica; `?wait=queued` answers once JetStream acknowledged them. With
  `logging.mode = "none"` there is no log, so every answer (any pattern) waits for
  JetStream's ack: nothing is called accepted before something durable holds it.
- request/acknowledge `?ack=token` answers 202 with a token right after logging;
  `GET /v1/acks/{token}` tells logged / queued (with sequences) / failed.
- one-way  `POST /v1/streams/{stream}/fire` and UDP datagrams are answered (or not) before
  logging. Loss window: an event acknowledged with 204 (or sent by UDP) is lost if this
  replica dies before its group commit reaches the logger (a few ms); `oneway_lost`
  counts the ones whose logging failed while the replica lived.
- publish/subscribe  core NATS `ingest.{stream}` (queue group `collectors`): logged like
  any producer's events, and answered when the message has a reply subject.
The stream pattern (the collector as client of a source) lives in
`actors/collection/stream_ingest.py`; collectors process its buffer (`_buffered`).

Every refusal names its reason: 403 for a system stream (`results`, `deadletter`: only the
runtime writes them), 413 for an event JetStream could never take (the server's
`max_payload` less the headers, see `_fit`), 503 with the assigned `ids` (and `token`)
when nothing was acknowledged, so the producer resends exactly those ids. A browser's
request from another site's page is refused before anything is read: 421 for a host name
this server does not answer to (DNS rebinding), 403 for another origin (runtime/browsers.py,
`[browsers]` in the config).

The HTTP/UDP/NATS data plane runs on a `LoopThread` started in `__init__`, so a
replica Ray restarts serves again by itself.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import ray
from aiohttp import web

from actors.collection.buffer import ensure_buffer_stream
from actors.collection.buffer_consumer import BufferConsumer, BufferedFrame
from actors.collection.group_commit import (
    GroupCommitPolicy,
    GroupCommitter,
    Overloaded,
    take_batches,
)
from actors.collection.parsing import MAX_ID_CHARS, BadInput, parse_events
from actors.queue.logger import LogFull, LoggerGroup, LogUnavailable
from runtime.binding import resolve, url_host
from runtime.browsers import BrowserGuard
from runtime.clock import now_ms
from runtime.compaction import CompactingLogic, stream_logic
from runtime.config import Config, system_streams, validate
from runtime.events import Event, encode_batch
from runtime.inline import inline_parts
from runtime.logic import StreamLogic
from runtime.loop_thread import LoopThread
from runtime.publisher import MSG_ID_HEADER, header_bytes
from runtime.ray_supervisor import SupervisedActor, node_ip
from runtime.replication import FencedError
from runtime.services import connect_nats
from runtime.tls import http_scheme, server_ssl_context

log = logging.getLogger(__name__)

RETRY_AFTER_S = "1"
_json = msgspec.json.Encoder()
# The NATS server counts a message's headers in `max_payload` (the subject travels in the
# control line, outside it). The bridge sends `Nats-Msg-Id: <id>`; the reserve leaves room
# for the headers it adds when it dead-letters an event (`Tf-Error`, up to 200 characters
# of UTF-8) or others it may add, so an accepted event can always be published somewhere.
HEADER_RESERVE = 1024


def wire_overhead(event_id: str) -> int:
    """Bytes besides the event's JSON that count against the server's `max_payload`: the
    headers the bridge sends (counted as the publisher counts them) and a reserve."""
    return header_bytes({MSG_ID_HEADER: event_id}) + HEADER_RESERVE


_LONGEST_ID_OVERHEAD = wire_overhead("x" * MAX_ID_CHARS)

# Streams the runtime writes (analysis results, dead letters): no producer path may.
SYSTEM_STREAMS = frozenset(system_streams())
_SYSTEM_PREFIXES = tuple(
    subj.removesuffix(">") for sc in system_streams().values() for subj in sc["subjects"]
)


def is_system_stream(cfg: Config, stream: str) -> bool:
    """A stream the runtime owns: by name, or by capturing a system subject."""
    sc = cfg.streams.get(stream)
    subjects = sc.subjects if sc is not None else []
    return stream in SYSTEM_STREAMS or any(s.startswith(_SYSTEM_PREFIXES) for s in subjects)


def ack_token(key: str, stream: str, ids: Sequence[str]) -> str:
    """The `?ack=token` token of a request: the same producer resending the same ids gets
    the same token, so a retry whose ids the log already holds (under the first
    request's token) answers instead of 404. Keyed by the producer's bearer token, so
    nobody else can derive it from ids alone."""
    msg = "\0".join([stream, *ids]).encode()
    digest = hmac.new(key.encode(), msg, hashlib.sha256).digest()[:16]
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _bearer(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    return header[7:] if header.startswith("Bearer ") else request.query.get("token", "")


class QueueRefused(Exception):
    """Mode none only: JetStream did not acknowledge, and no log holds the events."""


def _reply(
    status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status, body=_json.encode(body), content_type="application/json", headers=headers
    )


def _error(status: int, reason: str, **extra: Any) -> web.Response:
    headers = {"Retry-After": RETRY_AFTER_S} if status == 503 else None
    return _reply(status, {"error": reason, **extra}, headers)


def _refusal(err: Exception) -> tuple[str, str]:
    """(counter, reason) of an error from logging or queueing: every one is a 503 the
    producer answers by resending the same ids later (nothing was acknowledged)."""
    if isinstance(err, LogFull | Overloaded):
        return "overloaded", f"overloaded, resend with the same ids later: {err}"
    if isinstance(err, FencedError):
        return "fenced", f"message log changed primary ({err}); resend with the same ids"
    if isinstance(err, LogUnavailable | QueueRefused):
        return "overloaded", f"not persisted, resend with the same ids later: {err}"
    log.error("unexpected error while logging events", exc_info=err)
    return "errors", f"not acknowledged ({type(err).__name__}); resend with the same ids later"


class Collector(SupervisedActor):
    """Ray actor: accepts events over HTTP, UDP and NATS and logs them before answering."""

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
        self.mode = self.cfg.logging.mode
        self.logger = logger
        self.bridge_names = list(bridges)
        self.namespace = namespace
        self.nats_url = nats_url
        # the config's `roles.collector.host` unless given (runtime/binding.py)
        self.binding = resolve(self.cfg.roles.collector.host if host is None else host, node_ip)
        self.host, self.port, self.udp_port = self.binding.bind, port, udp_port
        self.nats_ingest = nats_ingest
        self.max_body_bytes = max_body_bytes
        # a connection idle (or still sending its request head) this long is closed;
        # a body not received this long after its head is a 408
        self.idle_timeout_s, self.body_timeout_s = idle_timeout_s, body_timeout_s
        self.max_events, self.max_event_bytes = max_events, max_event_bytes
        self.tokens = frozenset(self.cfg.auth.producer_tokens)  # empty: auth off
        self.off = self._untokened_paths_off()
        self.logic: dict[str, StreamLogic | CompactingLogic] = {
            s: stream_logic(s, sc) for s, sc in self.cfg.streams.items()
        }
        self.counters: dict[str, int] = {
            "requests": 0,
            "accepted": 0,
            "rejected": 0,
            "overloaded": 0,
            "oneway_accepted": 0,
            "oneway_lost": 0,
            "udp": 0,
            "nats": 0,
            "bridge_errors": 0,
            "buffered": 0,
            "handoffs_deferred": 0,
            "unauthorized": 0,
            "handoffs": 0,
            "fenced": 0,
            "too_big": 0,
            "errors": 0,
            "refused_browser": 0,
        }
        self._commit_policy = commit or GroupCommitPolicy(
            max_events=2048, max_bytes=4 << 20, max_delay_ms=2.0
        )
        self._max_bridge_calls = max_bridge_calls
        # of those, background hand-offs: fewer calls at once make each one bigger (the
        # bridge publishes a call's events as atomic batches, cheaper per event when big)
        self._max_handoff_calls = max(1, min(max_handoff_calls, max_bridge_calls))
        # hand-offs waiting for a bridge call go together, up to this many events a call
        self.max_call_events = max_call_events
        self._handoffs: deque[list[Event]] = deque()
        self._handoff_senders = 0
        self.max_handoff_events = max_handoff_events
        self._handoff_events = 0
        self._rr = 0
        self._refreshing: asyncio.Future[Any] | None = None
        self._nc: Any = None  # NATS: ingest, and the server's max_payload
        # runtime/browsers.py: another site's page may not produce (a WebSocket needs no
        # CORS); bodies are checked by type in parsing.py (415 for all but JSON/NDJSON)
        self.guard = BrowserGuard.build(
            scheme=http_scheme(self.cfg),
            bind_host=self.host,
            allowed_hosts=self.cfg.browsers.allowed_hosts,
            allowed_origins=self.cfg.browsers.allowed_origins,
            json_types=None,
        )
        self._dataplane = LoopThread(f"{name}-dataplane")
        self._dataplane.start(self._serve, start_timeout_s)

    def _untokened_paths_off(self) -> dict[str, str]:
        """With producer tokens, paths that carry no token must not reach a stream: UDP
        never (nothing in a datagram proves who sent it), NATS `ingest.*` only when NATS
        itself authenticates producers (per-role users: only `producer` may publish
        there). Returns path -> why it is off; logged loudly, shown in `stats`."""
        off: dict[str, str] = {}
        if not self.tokens:
            return off
        if self.udp_port:
            off["udp_off"] = "auth.producer_tokens is set and a datagram carries no token"
        if self.nats_ingest and not self.cfg.nats.role_users:
            off["nats_ingest_off"] = (
                "auth.producer_tokens is set but nats.role_users is off, so any NATS client "
                "could publish ingest.* without a token; set nats.role_users = true"
            )
        for path, why in off.items():
            log.error("collector %s: %s: %s", self.name, path, why)
        if "udp_off" in off:
            self.udp_port = 0
        return off

    def restore(self, store: Any) -> None:
        """Stateless by design: accepted events live in the MessageLogger, not here."""

    # ------------------------------------------------------------------ control plane (Ray)

    def endpoints(self) -> dict[str, Any]:
        return {
            "host": self.binding.advertise,
            "port": self.port,
            "udp_port": self.udp_port,
            "url": f"{http_scheme(self.cfg)}://{url_host(self.binding.advertise)}:{self.port}",
        }

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            "mode": self.mode,
            "in_flight": self._in_flight(),
            "requests_in_flight": self._requests_in_flight,
            # group commit: log flushes so far (accepted / flushes = events a flush)
            "log_flushes": self._committer.flushes if hasattr(self, "_committer") else 0,
            **self.off,
        }

    def shutdown(self) -> bool:
        """Stop taking work and finish what is in hand (drain), then stop serving."""
        return self._dataplane.stop()

    _requests_in_flight = 0

    def _in_flight(self) -> int:
        return self._committer.pending_events if hasattr(self, "_committer") else 0

    # ------------------------------------------------------------------ data plane thread

    async def _serve(self, stop: asyncio.Event, ready: Callable[[], None]) -> None:
        self._committer = GroupCommitter(self.logger.append, self._commit_policy)
        self._bridge_slots = asyncio.Semaphore(self._max_bridge_calls)
        self._background: set[asyncio.Task[Any]] = set()
        app = web.Application(
            client_max_size=self.max_body_bytes,
            middlewares=[self._browsers, self._count_requests, self._authenticate],
        )
        app.router.add_post("/v1/streams/{stream}/events", self.post_events)
        app.router.add_post("/v1/streams/{stream}/fire", self.post_fire)
        app.router.add_get("/v1/streams/{stream}/ws", self.ws_producer)
        app.router.add_get("/v1/acks/{token}", self.get_ack)
        app.router.add_get("/healthz", self.healthz)
        runner = web.AppRunner(
            app, access_log=None, handle_signals=False, keepalive_timeout=self.idle_timeout_s
        )
        await runner.setup()
        ssl = server_ssl_context(self.cfg)  # None: plain HTTP (the default)
        site = web.TCPSite(runner, self.host, self.port, reuse_port=True, ssl_context=ssl)
        await site.start()
        self.port = runner.addresses[0][1]
        udp = await self._start_udp()
        nc = self._nc = await self._start_nats_ingest()
        consumers = await self._start_buffer_consumers(stop)
        ready()
        try:
            await stop.wait()
        finally:
            await runner.cleanup()  # stop accepting; in-flight handlers finish first
            for consumer, task in consumers:
                await task
                await consumer.close()
            if udp is not None:
                udp.close()
            if nc is not None:
                await nc.drain()
            await asyncio.gather(*self._background, return_exceptions=True)

    # ------------------------------------------------------------------ one request

    async def post_events(self, request: web.Request) -> web.Response:
        """Request/response and request/acknowledge."""
        self.counters["requests"] += 1
        stream = request.match_info["stream"]
        events: list[Event] = []
        token = ""
        try:
            events = await self._receive(request, stream)
            if request.query.get("ack") == "token":
                token = ack_token(_bearer(request), stream, [e.id for e in events])
                events = [msgspec.structs.replace(e, token=token) for e in events]
            processed = await self._log_and_process(events)
        except BadInput as bad:
            self.counters["rejected"] += 1
            return _error(bad.status, bad.reason, **bad.extra)
        except Exception as err:  # noqa: BLE001 - every one answered 503 with the ids
            # ids were assigned (and may be on some replicas): the producer resends them
            _, reason = self._refused(err)
            extra: dict[str, Any] = {"ids": [e.id for e in events]}
            if token:
                extra["token"] = token
            return _error(503, reason, **extra)
        ids = [e.id for e in events]
        if request.query.get("wait") == "queued":
            return await self._answer_queued(processed, ids)
        self.counters["accepted"] += len(ids)
        if token:
            self._handoff(processed)
            return _reply(202, {"accepted": len(ids), "ids": ids, "token": token})
        self._handoff(processed)
        return _reply(200, {"accepted": len(ids), "ids": ids})

    async def _answer_queued(self, processed: list[Event], ids: list[str]) -> web.Response:
        """Answer once JetStream acknowledged: 200 with sequences. When nothing holds the
        events yet (mode none, and the queue refused them) the answer is 503."""
        result = await self._send_to_bridge(processed)
        if self.mode == "none" and (result is None or result["failed"]):
            self.counters["overloaded"] += 1
            failed = result["failed"] if result else ids
            return _error(
                503,
                "the queue did not acknowledge; resend with the same ids",
                failed=failed,
                ids=ids,
            )
        self.counters["accepted"] += len(ids)
        if result is None:
            note = "logged; the bridge will publish it"
            return _reply(202, {"accepted": len(ids), "ids": ids, "queued": False, "note": note})
        return _reply(200, {"accepted": len(ids), "ids": ids, **result})

    async def post_fire(self, request: web.Request) -> web.Response:
        """One-way: answered before logging (the documented loss window)."""
        stream = request.match_info["stream"]
        try:
            events = await self._receive(request, stream)
        except BadInput as bad:
            self.counters["rejected"] += 1
            return _error(bad.status, bad.reason, **bad.extra)
        self._one_way(events)
        return web.Response(status=204)

    async def ws_producer(self, request: web.Request) -> web.StreamResponse:
        """Request/response over one WebSocket: a JSON object or array per frame, answered
        per frame after logging; under backpressure the answer is a slow-down message and
        the producer resends that frame (same ids) after `retry_after_ms`."""
        stream = request.match_info["stream"]
        try:
            self._check_stream(stream)
        except BadInput as bad:
            self.counters["rejected"] += 1
            return _error(bad.status, bad.reason)
        ws = web.WebSocketResponse(max_msg_size=self.max_body_bytes, heartbeat=30)
        await ws.prepare(request)
        subject = self.cfg.streams[stream].subjects[0]
        frame = 0
        async for msg in ws:
            if msg.type not in (web.WSMsgType.TEXT, web.WSMsgType.BINARY):
                break  # errors and closes end the loop; aiohttp sends the close code
            frame += 1
            data = msg.data.encode() if msg.type == web.WSMsgType.TEXT else msg.data
            answer: dict[str, Any] = {"frame": frame}
            events: list[Event] = []
            try:
                events = self._fit(
                    parse_events(
                        "application/json",
                        data,
                        stream,
                        subject,
                        now_ms(),
                        max_events=self.max_events,
                        max_event_bytes=self.max_event_bytes,
                    )
                )
                self._handoff(await self._log_and_process(events))
                self.counters["accepted"] += len(events)
                answer.update(accepted=len(events), ids=[e.id for e in events])
            except BadInput as bad:
                self.counters["rejected"] += 1
                answer.update(error=bad.reason, status=bad.status, **bad.extra)
            except Exception as err:  # noqa: BLE001 - every one answered 503 with the ids
                _, reason = self._refused(err)
                answer.update(
                    slow_down=True,
                    retry_after_ms=int(RETRY_AFTER_S) * 1000,
                    error=f"{reason} (resend this frame)",
                    status=503,
                    ids=[e.id for e in events],
                )
            await ws.send_str(_json.encode(answer).decode())
        return ws

    async def get_ack(self, request: web.Request) -> web.Response:
        try:
            status = await self.logger.token_status(request.match_info["token"])
        except LogUnavailable as err:
            return _error(503, f"cannot read the token's status now: {err}")
        if status is None:
            return _error(404, "unknown or expired token")
        return _reply(200, status)

    @web.middleware
    async def _browsers(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Host and Origin (runtime/browsers.py) before anything else: a refused WebSocket
        is never upgraded."""
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        local_ip = sock[0] if isinstance(sock, tuple) and sock else None
        refused = self.guard.check(request.method, request.path, request.headers, local_ip)
        if refused is None:
            return await handler(request)
        self.counters["refused_browser"] += 1
        return _error(refused.status, refused.reason)

    @web.middleware
    async def _count_requests(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """HTTP requests in hand: the collector's load figure for autoscaling."""
        self._requests_in_flight += 1
        try:
            return await handler(request)
        finally:
            self._requests_in_flight -= 1

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Producers present `Authorization: Bearer <token>` (or `?token=` for browsers'
        WebSockets) when `auth.producer_tokens` is set; nothing is parsed or logged
        before that. UDP and NATS ingest carry no token: with tokens set, UDP is off and
        NATS ingest runs only where NATS authenticates producers (`_untokened_paths_off`)."""
        if not self.tokens or request.path == "/healthz":
            return await handler(request)
        token = _bearer(request)
        if not token:
            self.counters["unauthorized"] += 1
            return _error(
                401,
                "missing bearer token",
            )
        if not self._known_token(token):
            self.counters["unauthorized"] += 1
            return _error(401, "invalid bearer token")
        return await handler(request)

    def _known_token(self, token: str) -> bool:
        """Constant-time against every configured token (as the gateway does): how long
        the check takes tells nothing about how close a guess was."""
        given = token.encode()
        found = False
        for known in self.tokens:
            found |= hmac.compare_digest(given, known.encode())
        return found

    def _refused(self, err: Exception) -> tuple[str, str]:
        """Count a 503 refusal; a fenced write also makes this collector adopt the log's
        new epoch (in the background) so the producer's resend can succeed."""
        counter, reason = _refusal(err)
        self.counters[counter] += 1
        if isinstance(err, FencedError):
            self._refresh_logger()
        return counter, reason

    def _refresh_logger(self) -> None:
        if self._refreshing is not None and not self._refreshing.done():
            return

        async def refresh() -> None:
            try:
                epoch = await self.logger.refresh()
                log.warning("message log %s moved to epoch %d", self.logger.name, epoch)
            except Exception as err:  # noqa: BLE001 - the next fenced write tries again
                log.warning("could not adopt the message log's epoch: %r", err)

        self._refreshing = asyncio.ensure_future(refresh())
        self._background.add(self._refreshing)
        self._refreshing.add_done_callback(self._background.discard)

    async def healthz(self, _: web.Request) -> web.Response:
        return _reply(200, {"ok": True, "name": self.name})

    async def _receive(self, request: web.Request, stream: str) -> list[Event]:
        """Parse and identify; every refusal is a BadInput with a status and a reason."""
        self._check_stream(stream)
        declared = request.content_length
        if declared is not None and declared > self.max_body_bytes:  # before it arrives
            raise BadInput(413, f"body of {declared} bytes over {self.max_body_bytes} bytes")
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise BadInput(413, f"body over {self.max_body_bytes} bytes") from None
        except TimeoutError:
            raise BadInput(408, f"body not received within {self.body_timeout_s:g} s") from None
        return self._fit(
            parse_events(
                request.headers.get("Content-Type"),
                body,
                stream,
                self.cfg.streams[stream].subjects[0],
                now_ms(),
                max_events=self.max_events,
                max_event_bytes=self.max_event_bytes,
            )
        )

    def _check_stream(self, stream: str) -> None:
        """404 for an unknown stream, 403 for one only the runtime writes."""
        if stream not in self.cfg.streams:
            raise BadInput(404, f"unknown stream {stream!r}")
        if is_system_stream(self.cfg, stream):
            raise BadInput(403, f"{stream!r} is a system stream: producers may not write to it")

    def _fit(self, events: list[Event]) -> list[Event]:
        """413 for an event JetStream could never take: the NATS server counts headers in
        its `max_payload` and resets the connection (failing every publish in flight)
        for a message over it, so the limit is read from the server, less the headers."""
        nc = self._nc
        max_payload = int(getattr(nc, "max_payload", 0) or 0) if nc is not None else 0
        if not max_payload:
            return events
        # The headers grow with the id, and ids are at most MAX_ID_CHARS ASCII characters:
        # a batch whose largest event fits beside the longest id needs no check per event.
        if max((len(e.data) for e in events), default=0) <= max_payload - _LONGEST_ID_OVERHEAD:
            return events
        for e in events:
            limit = max_payload - wire_overhead(e.id)
            if len(e.data) > limit:
                self.counters["too_big"] += 1
                raise BadInput(
                    413,
                    f"event {e.id!r} is {len(e.data)} bytes; the NATS server's max_payload is "
                    f"{max_payload} bytes with headers, so this event may carry {limit} bytes",
                    max_payload=max_payload,
                    limit=limit,
                    id=e.id,
                )
        return events

    async def _log_and_process(self, events: list[Event]) -> list[Event]:
        """Log per the mode, run the logic; returns what goes to the bridge.

        rbml: log raw, then logic. sbml: logic, then log what goes out. hml: log raw while
        the logic runs; the answer still waits for the log. none: no log at all.
        """
        if self.mode == "none":
            # No log: JetStream's ack is the only persistence, so wait for it here.
            out = self._apply_logic(events)
            result = await self._send_to_bridge(out)
            if result is None or result["failed"]:
                raise QueueRefused(f"{len(result['failed']) if result else len(out)} events")
            return []  # already in JetStream: nothing left to hand off
        if self.mode == "rbml":
            await self._committer.submit(events)
            return self._apply_logic(events)
        if self.mode == "sbml":
            out = self._apply_logic(events)
            await self._committer.submit(out)
            return out
        # In the batch (or refused, nothing taken) before the logic runs, so the batch's
        # delay counts down meanwhile; `ensure_future(submit(...))` would not have run
        # before the logic returned. The Ray call itself goes out from the flusher's task
        # (this loop), at the batch's turn: under load one is always in flight anyway.
        logged = self._committer.enqueue(events)
        try:
            out = self._apply_logic(events)
        finally:
            await logged
        return out

    def _apply_logic(self, events: list[Event]) -> list[Event]:
        """Kept events come back processed; rejects go on raw so the bridge settles them
        (dead letter or forget) through the one path replay uses too."""
        by_stream: dict[str, list[Event]] = {}
        first = events[0].stream if events else ""
        if all(e.stream == first for e in events):  # one request: one stream
            if events:
                by_stream[first] = events
        else:
            for e in events:
                by_stream.setdefault(e.stream, []).append(e)
        out: list[Event] = []
        for stream, items in by_stream.items():
            result = self.logic[stream].apply(items)
            out.extend(result.kept)
            out.extend(e for e, _ in result.invalid)
            out.extend(result.dropped)
        return out

    # ------------------------------------------------------------------ to the bridge

    def _bridge(self) -> Any:
        self._rr = (self._rr + 1) % len(self.bridge_names)
        return ray.get_actor(self.bridge_names[self._rr], namespace=self.namespace)

    async def _send_to_bridge(self, events: list[Event]) -> dict[str, Any] | None:
        """One Ray call per batch; None if no bridge answered (the log still holds it)."""
        async with self._bridge_slots:
            return await self._call_bridge(events)

    async def _call_bridge(
        self, events: list[Event], *, detail: bool = True
    ) -> dict[str, Any] | None:
        """The Ray call itself; the caller holds a bridge slot. `detail=False`: the answer
        is counts only (a hand-off reads none of it)."""
        try:
            self.counters["handoffs"] += 1
            # parts Ray sends inline in the call, not through the object store
            first, *more = inline_parts(encode_batch(events))
            return await self._bridge().publish.remote(first, self.logger.name, detail, *more)
        except Exception as err:
            self.counters["bridge_errors"] += 1
            log.warning("bridge call failed; the replayer will publish: %r", err)
            return None

    def _handoff(self, events: list[Event]) -> None:
        """Hand a logged batch to a bridge in the background. Past `max_handoff_events`
        in memory the batch is left to the log: the bridge's replayer publishes it once
        it is stale, so memory stays bounded while nothing is lost.

        Group commit: up to `max_handoff_calls` senders; each, once it holds a bridge slot,
        takes every batch waiting (oldest first, up to `max_call_events`) into one call, so
        a backlog makes calls bigger rather than longer queues of small ones."""
        if not events:
            return
        if self._handoff_events + len(events) > self.max_handoff_events:
            self.counters["handoffs_deferred"] += len(events)
            return
        self._handoff_events += len(events)
        self._handoffs.append(events)
        if self._handoff_senders < self._max_handoff_calls:
            self._handoff_senders += 1
            self._spawn(self._send_handoffs())

    async def _send_handoffs(self) -> None:
        try:
            while self._handoffs:  # bounded: each pass takes at least one batch out
                async with self._bridge_slots:
                    events = take_batches(self._handoffs, self.max_call_events)
                    if not events:  # another sender took them meanwhile
                        break
                    try:
                        await self._call_bridge(events, detail=False)
                    finally:
                        self._handoff_events -= len(events)
        finally:
            self._handoff_senders -= 1

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _one_way(self, events: list[Event]) -> None:
        self.counters["oneway_accepted"] += len(events)

        async def log_then_send() -> None:
            try:
                self._handoff(await self._log_and_process(events))
            except Exception as err:
                self.counters["oneway_lost"] += len(events)
                log.warning("one-way events lost (%d): %r", len(events), err)

        self._spawn(log_then_send())

    # ------------------------------------------------------------------ UDP and NATS ingest

    async def _start_udp(self) -> asyncio.DatagramTransport | None:
        if not self.udp_port:
            return None
        collector = self

        class Datagrams(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: Any) -> None:
                collector._datagram(data)

        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            Datagrams, local_addr=(self.host, self.udp_port), reuse_port=True
        )
        self.udp_port = transport.get_extra_info("sockname")[1]
        return transport

    def _datagram(self, data: bytes) -> None:
        """UDP: `stream <json>` per datagram; one-way by nature (no one to answer)."""
        stream, _, payload = data.partition(b" ")
        try:
            name = stream.decode("ascii")
            self._check_stream(name)
            events = self._fit(
                parse_events(
                    "application/json",
                    payload,
                    name,
                    self.cfg.streams[name].subjects[0],
                    now_ms(),
                    max_events=1,
                    max_event_bytes=self.max_event_bytes,
                )
            )
        except (BadInput, UnicodeDecodeError):
            self.counters["rejected"] += 1
            return
        self.counters["udp"] += 1
        self._one_way(events)

    # ------------------------------------------------------------------ stream pattern

    async def _start_buffer_consumers(
        self, stop: asyncio.Event
    ) -> list[tuple[BufferConsumer, asyncio.Future[None]]]:
        """Processing side of the buffering layer: every collector shares one durable
        consumer per stream-pattern stream, so buffered frames spread across replicas."""
        streams = [s for s, sc in self.cfg.streams.items() if sc.source.url]
        for s in [s for s in streams if is_system_stream(self.cfg, s)]:
            log.error("stream %r is a system stream: its source is not collected", s)
            streams.remove(s)
        if not streams:
            return []
        nc = await connect_nats(
            self.cfg, self.nats_url, name=f"collector-{self.name}-buffer", role="collector"
        )
        await ensure_buffer_stream(nc, streams)
        out = []
        for stream in streams:
            consumer = BufferConsumer(nc, stream, lambda f, s=stream: self._buffered(s, f))
            await consumer.start()
            out.append((consumer, asyncio.ensure_future(consumer.run(stop))))
        return out

    async def _buffered(self, stream: str, frames: list[BufferedFrame]) -> None:
        """Raw frames from the buffer: the frame's dedup id becomes the event id, so a
        redelivered frame is the same event. Raising (log full) leaves them unacked:
        the buffer redelivers later, which is the backpressure of this pattern."""
        subject = self.cfg.streams[stream].subjects[0]
        now = now_ms()
        events = [Event(f.msg_id, stream, subject, f.data, now) for f in frames]
        try:
            processed = await self._log_and_process(events)
        except FencedError:
            self._refresh_logger()  # the buffer redelivers once this replica writes again
            raise
        self._handoff(processed)
        self.counters["buffered"] += len(events)
        self.counters["accepted"] += len(events)

    async def _start_nats_ingest(self) -> Any:
        """The collector's NATS connection: it tells the server's `max_payload` (see
        `_fit`), and serves `ingest.*` when NATS ingest is on."""
        nc = await connect_nats(
            self.cfg, self.nats_url, name=f"collector-{self.name}", role="collector"
        )
        if self.nats_ingest and "nats_ingest_off" not in self.off:
            await nc.subscribe("ingest.*", queue="collectors", cb=self._nats_message)
        return nc

    async def _nats_message(self, msg: Any) -> None:
        """Pub/sub ingest: logged before any reply, exactly like an HTTP producer."""
        name = msg.subject.split(".", 1)[1]
        events: list[Event] = []
        try:
            self._check_stream(name)
            ctype = (msg.headers or {}).get("Content-Type", "application/json")
            events = self._fit(
                parse_events(
                    ctype,
                    msg.data,
                    name,
                    self.cfg.streams[name].subjects[0],
                    now_ms(),
                    max_events=self.max_events,
                    max_event_bytes=self.max_event_bytes,
                )
            )
            processed = await self._log_and_process(events)
        except BadInput as bad:
            self.counters["rejected"] += 1
            if msg.reply:
                answer = {"error": bad.reason, "status": bad.status, **bad.extra}
                await msg.respond(_json.encode(answer))
            return
        except Exception as err:  # noqa: BLE001 - every one answered 503 with the ids
            _, reason = self._refused(err)
            if msg.reply:
                ids = [e.id for e in events]
                await msg.respond(_json.encode({"error": reason, "status": 503, "ids": ids}))
            return
        self.counters["nats"] += len(events)
        self.counters["accepted"] += len(events)
        self._handoff(processed)
        if msg.reply:
            await msg.respond(
                _json.encode({"accepted": len(events), "ids": [e.id for e in events]})
            )
