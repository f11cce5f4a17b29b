"""The Collector's WebSocket producers: `GET /v1/streams/{stream}/ws`.

Its own module because a WebSocket producer is request/response per frame on one long
connection, answered in its own frames rather than HTTP statuses: each text or binary frame
is a JSON object or array, answered `{"frame": n, "accepted", "ids"}` once its events are
logged (the ingest path, ingest.py). A refused frame is answered `{"frame", "error",
"status", ...}` and the connection goes on; under backpressure (or any failure after ids
were assigned) the answer is a slow-down, `"slow_down": true` with `retry_after_ms` and the
frame's ids, and the producer resends that frame with the same ids. The route sits behind
the HTTP middlewares (http_routes.py): a refused browser or token is never upgraded, and an
unknown or system stream is an HTTP 404 / 403 before the upgrade.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from actors.collection.http_routes import RETRY_AFTER_S, error
from actors.collection.ingest import IngestPath
from actors.collection.parsing import BadInput
from runtime.data.events import Event

__all__ = ["WebSocketProducers"]

_json = msgspec.json.Encoder()


class WebSocketProducers:
    """The WebSocket route's handler of one Collector replica."""

    def __init__(self, ingest: IngestPath, *, max_msg_bytes: int) -> None:
        self.ingest = ingest
        self.counters = ingest.counters
        self.max_msg_bytes = max_msg_bytes

    async def ws_producer(self, request: web.Request) -> web.StreamResponse:
        """Request/response over one WebSocket: a JSON object or array per frame, answered
        per frame after logging; under backpressure the answer is a slow-down message and
        the producer resends that frame (same ids) after `retry_after_ms`."""
        stream = request.match_info["stream"]
        try:
            self.ingest.check_stream(stream)
        except BadInput as bad:
            self.counters["rejected"] += 1
            return error(bad.status, bad.reason)
        ws = web.WebSocketResponse(max_msg_size=self.max_msg_bytes, heartbeat=30)
        await ws.prepare(request)
        frame = 0
        async for msg in ws:
            if msg.type not in (web.WSMsgType.TEXT, web.WSMsgType.BINARY):
                break  # errors and closes end the loop; aiohttp sends the close code
            frame += 1
            data = msg.data.encode() if msg.type == web.WSMsgType.TEXT else msg.data
            await ws.send_str(_json.encode(await self._frame(frame, stream, data)).decode())
        return ws

    async def _frame(self, frame: int, stream: str, data: bytes) -> dict[str, Any]:
        """One frame through the ingest path, and its answer."""
        answer: dict[str, Any] = {"frame": frame}
        events: list[Event] = []
        try:
            events = self.ingest.parse("application/json", data, stream)
            await self.ingest.accept(events)
            answer.update(accepted=len(events), ids=[e.id for e in events])
        except BadInput as bad:
            self.counters["rejected"] += 1
            answer.update(error=bad.reason, status=bad.status, **bad.extra)
        except Exception as err:  # noqa: BLE001 - every one answered 503 with the ids
            answer.update(
                slow_down=True,
                retry_after_ms=int(RETRY_AFTER_S) * 1000,
                error=f"{self.ingest.refused(err)} (resend this frame)",
                status=503,
                ids=[e.id for e in events],
            )
        return answer
