"""The Collector's NATS connection and its publish/subscribe producers: core NATS `ingest.*`.

Its own module because the connection has two jobs: it tells the ingest path the server's
`max_payload` (ingest.py, `fit`), so it opens whether or not NATS ingest is on; and with
NATS ingest on it serves `ingest.{stream}` in the queue group `collectors`, so each message
goes to one replica. A message is logged like any producer's events (the ingest path) and,
when it has a reply subject, answered after that: `{"accepted", "ids"}`, or `{"error",
"status", ...}` for bad input, or a 503 with the ids to resend. With producer tokens set it
is served only where NATS itself authenticates producers (collector.py,
`untokened_paths_off`): a NATS message carries no token.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actors.collection.ingest import IngestPath
from actors.collection.parsing import BadInput
from runtime.data.events import Event
from runtime.engines.services import connect_nats

__all__ = ["NatsIngest"]

_json = msgspec.json.Encoder()


class NatsIngest:
    """One Collector replica's NATS connection; `serve` subscribes to `ingest.*`."""

    def __init__(self, ingest: IngestPath, *, nats_url: str, name: str, serve: bool) -> None:
        self.ingest = ingest
        self.counters = ingest.counters
        self.nats_url = nats_url
        self.name = name
        self.serve = serve

    async def start(self) -> None:
        """Connect (the ingest path reads `max_payload` from then on) and subscribe."""
        nc = await connect_nats(
            self.ingest.cfg, self.nats_url, name=f"collector-{self.name}", role="collector"
        )
        self.ingest.nats = nc
        if self.serve:
            await nc.subscribe("ingest.*", queue="collectors", cb=self.on_message)

    async def close(self) -> None:
        """Answer the messages in hand, then close the connection."""
        nc = self.ingest.nats
        if nc is not None:
            await nc.drain()

    async def on_message(self, msg: Any) -> None:
        """Pub/sub ingest: logged before any reply, exactly like an HTTP producer."""
        name = msg.subject.split(".", 1)[1]
        events: list[Event] = []
        try:
            self.ingest.check_stream(name)
            ctype = (msg.headers or {}).get("Content-Type", "application/json")
            events = self.ingest.parse(ctype, msg.data, name)
            await self.ingest.accept(events)
        except BadInput as bad:
            self.counters["rejected"] += 1
            if msg.reply:
                answer = {"error": bad.reason, "status": bad.status, **bad.extra}
                await msg.respond(_json.encode(answer))
            return
        except Exception as err:  # noqa: BLE001 - every one answered 503 with the ids
            reason = self.ingest.refused(err)
            if msg.reply:
                ids = [e.id for e in events]
                await msg.respond(_json.encode({"error": reason, "status": 503, "ids": ids}))
            return
        self.counters["nats"] += len(events)
        if msg.reply:
            await msg.respond(
                _json.encode({"accepted": len(events), "ids": [e.id for e in events]})
            )
