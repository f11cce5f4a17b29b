"""The Collector's HTTP producers: request/response, request/acknowledge and one-way.

Its own module because HTTP is one transport among five over the one ingest path
(ingest.py); what is HTTP's alone is here:

- `POST /v1/streams/{stream}/events`: 200 once the events are logged on every logger
  replica; `?wait=queued` 200 once JetStream acknowledged them (with sequences; 202 when
  logged but no bridge answered). With `logging.mode = "none"` every answer waits for
  JetStream: nothing is called accepted before something durable holds it.
- `?ack=token`: 202 with a token right after logging; `GET /v1/acks/{token}` tells logged /
  queued (with sequences) / failed, 404 for an unknown or expired token.
- `POST /v1/streams/{stream}/fire`: 204 before logging (the documented loss window).
- the body's limits: 413 over `max_body_bytes` (declared or received), 408 for a body not
  received within `body_timeout_s`.
- the middlewares in front of every route: Host and Origin (runtime/browsers.py: 421,
  403), the requests in hand (the collector's load figure for autoscaling), and producer
  tokens (401) before anything is parsed or logged.

Every refusal is a JSON `{"error", ...}`; a 503 carries `Retry-After` and the ids assigned
(and the token), so the producer resends exactly those.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
from aiohttp import web

from actors.collection.ingest import IngestPath
from actors.collection.parsing import BadInput
from actors.queue.logger import LogUnavailable
from runtime.browsers import BrowserGuard
from runtime.data.events import Event

__all__ = ["RETRY_AFTER_S", "HttpProducers", "ack_token", "bearer", "error", "reply"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

RETRY_AFTER_S = "1"
_json = msgspec.json.Encoder()


def reply(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status, body=_json.encode(body), content_type="application/json", headers=headers
    )


def error(status: int, reason: str, **extra: Any) -> web.Response:
    headers = {"Retry-After": RETRY_AFTER_S} if status == 503 else None
    return reply(status, {"error": reason, **extra}, headers)


def bearer(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    return header[7:] if header.startswith("Bearer ") else request.query.get("token", "")


def ack_token(key: str, stream: str, ids: Sequence[str]) -> str:
    """The `?ack=token` token of a request: the same producer resending the same ids gets
    the same token, so a retry whose ids the log already holds (under the first
    request's token) answers instead of 404. Keyed by the producer's bearer token, so
    nobody else can derive it from ids alone."""
    msg = "\0".join([stream, *ids]).encode()
    digest = hmac.new(key.encode(), msg, hashlib.sha256).digest()[:16]
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


class HttpProducers:
    """The HTTP routes' handlers and middlewares of one Collector replica."""

    def __init__(
        self,
        ingest: IngestPath,
        *,
        guard: BrowserGuard,
        tokens: frozenset[str],
        max_body_bytes: int,
        body_timeout_s: float,
    ) -> None:
        self.ingest = ingest
        self.counters = ingest.counters
        self.guard = guard
        self.tokens = tokens  # empty: auth off
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.requests_in_flight = 0  # the collector's load figure (cluster/roles.py)

    def middlewares(self) -> list[Any]:
        return [self._browsers, self._count_requests, self._authenticate]

    # ------------------------------------------------------------------ routes

    async def post_events(self, request: web.Request) -> web.Response:
        """Request/response and request/acknowledge."""
        self.counters["requests"] += 1
        stream = request.match_info["stream"]
        events: list[Event] = []
        token = ""
        try:
            events = await self._receive(request, stream)
            if request.query.get("ack") == "token":
                token = ack_token(bearer(request), stream, [e.id for e in events])
                events = [msgspec.structs.replace(e, token=token) for e in events]
            processed = await self.ingest.log_and_process(events)
        except BadInput as bad:
            self.counters["rejected"] += 1
            return error(bad.status, bad.reason, **bad.extra)
        except Exception as err:  # noqa: BLE001 - every one answered 503 with the ids
            # ids were assigned (and may be on some replicas): the producer resends them
            extra: dict[str, Any] = {"ids": [e.id for e in events]}
            if token:
                extra["token"] = token
            return error(503, self.ingest.refused(err), **extra)
        ids = [e.id for e in events]
        if request.query.get("wait") == "queued":
            return await self._answer_queued(processed, ids)
        self.ingest.hand_off(processed, accepted=len(ids))
        if token:
            return reply(202, {"accepted": len(ids), "ids": ids, "token": token})
        return reply(200, {"accepted": len(ids), "ids": ids})

    async def _answer_queued(self, processed: list[Event], ids: list[str]) -> web.Response:
        """Answer once JetStream acknowledged: 200 with sequences. When nothing holds the
        events yet (mode none, and the queue refused them) the answer is 503."""
        result = await self.ingest.bridge.send(processed)
        if self.ingest.mode == "none" and (result is None or result["failed"]):
            self.counters["overloaded"] += 1
            failed = result["failed"] if result else ids
            return error(
                503,
                "the queue did not acknowledge; resend with the same ids",
                failed=failed,
                ids=ids,
            )
        self.counters["accepted"] += len(ids)
        if result is None:
            note = "logged; the bridge will publish it"
            return reply(202, {"accepted": len(ids), "ids": ids, "queued": False, "note": note})
        return reply(200, {"accepted": len(ids), "ids": ids, **result})

    async def post_fire(self, request: web.Request) -> web.Response:
        """One-way: answered before logging (the documented loss window)."""
        stream = request.match_info["stream"]
        try:
            events = await self._receive(request, stream)
        except BadInput as bad:
            self.counters["rejected"] += 1
            return error(bad.status, bad.reason, **bad.extra)
        self.ingest.one_way(events)
        return web.Response(status=204)

    async def get_ack(self, request: web.Request) -> web.Response:
        try:
            status = await self.ingest.logger.token_status(request.match_info["token"])
        except LogUnavailable as err:
            return error(503, f"cannot read the token's status now: {err}")
        if status is None:
            return error(404, "unknown or expired token")
        return reply(200, status)

    async def _receive(self, request: web.Request, stream: str) -> list[Event]:
        """Parse and identify; every refusal is a BadInput with a status and a reason."""
        self.ingest.check_stream(stream)
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
        return self.ingest.parse(request.headers.get("Content-Type"), body, stream)

    # ------------------------------------------------------------------ middlewares

    @web.middleware
    async def _browsers(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Host and Origin (runtime/browsers.py) before anything else: a refused WebSocket
        is never upgraded."""
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        local_ip = sock[0] if isinstance(sock, tuple) and sock else None
        refused = self.guard.check(request.method, request.path, request.headers, local_ip)
        if refused is None:
            return await handler(request)
        self.counters["refused_browser"] += 1
        return error(refused.status, refused.reason)

    @web.middleware
    async def _count_requests(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """HTTP requests in hand: the collector's load figure for autoscaling."""
        self.requests_in_flight += 1
        try:
            return await handler(request)
        finally:
            self.requests_in_flight -= 1

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Producers present `Authorization: Bearer <token>` (or `?token=` for browsers'
        WebSockets) when `auth.producer_tokens` is set; nothing is parsed or logged
        before that. UDP and NATS ingest carry no token: with tokens set, UDP is off and
        NATS ingest runs only where NATS authenticates producers (collector.py,
        `untokened_paths_off`)."""
        if not self.tokens or request.path == "/healthz":
            return await handler(request)
        token = bearer(request)
        if not token:
            self.counters["unauthorized"] += 1
            return error(401, "missing bearer token")
        if not self._known_token(token):
            self.counters["unauthorized"] += 1
            return error(401, "invalid bearer token")
        return await handler(request)

    def _known_token(self, token: str) -> bool:
        """Constant-time against every configured token (as the gateway does): how long
        the check takes tells nothing about how close a guess was."""
        given = token.encode()
        found = False
        for known in self.tokens:
            found |= hmac.compare_digest(given, known.encode())
        return found
