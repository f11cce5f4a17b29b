"""What a user might pick instead of the collection tier: a Ray Serve deployment that takes
the same POST body (NDJSON or a JSON array) and publishes every event to JetStream, answering
once JetStream acknowledged them all, like tierflow's `logging.mode = "none"`.

Written the way the Serve and nats-py docs suggest (one connection per replica, every
publish in flight together, then every ack awaited); no message log, no group commit.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import msgspec

_dec = msgspec.json.Decoder()
_enc = msgspec.json.Encoder()


class JetStreamIngest:
    """A Serve deployment body: `POST /v1/streams/<stream>/events` -> JetStream."""

    def __init__(self, nats_url: str, subjects: dict[str, str]) -> None:
        self.nats_url = nats_url
        self.subjects = subjects
        self.js: Any = None
        self._lock = asyncio.Lock()

    async def _jetstream(self) -> Any:
        async with self._lock:
            if self.js is None:
                import nats

                nc = await nats.connect(self.nats_url, name="serve-ingest")
                self.js = nc.jetstream()
        return self.js

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        stream = request.url.path.strip("/").split("/")[2]
        subject = self.subjects.get(stream)
        if subject is None:
            return JSONResponse({"error": f"unknown stream {stream!r}"}, status_code=404)
        body = await request.body()
        if body.lstrip().startswith(b"["):
            events = _dec.decode(body)
        else:
            events = [_dec.decode(line) for line in body.split(b"\n") if line.strip()]
        js = await self._jetstream()
        ids = [str(e.get("id") or uuid.uuid4()) for e in events]
        futures = [
            await js.publish_async(subject, _enc.encode(e), headers={"Nats-Msg-Id": i})
            for e, i in zip(events, ids, strict=True)
        ]
        try:
            await asyncio.gather(*futures)
        except Exception as err:  # the producer retries with the same ids
            return JSONResponse({"error": repr(err)}, status_code=503)
        return JSONResponse({"accepted": len(ids), "ids": ids})


def deploy(nats_url: str, subjects: dict[str, str], port: int, replicas: int = 1) -> str:
    """Start Serve's HTTP proxy on 127.0.0.1:`port` and the deployment; returns its URL."""
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = serve.deployment(
        JetStreamIngest,
        name="jetstream-ingest",
        num_replicas=replicas,
        max_ongoing_requests=64,
        ray_actor_options={"num_cpus": 0},
    ).bind(nats_url, subjects)
    serve.run(app, name="bench-ingest", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def undeploy() -> None:
    from ray import serve

    serve.shutdown()
