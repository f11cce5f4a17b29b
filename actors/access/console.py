"""`GET /v1/console`: the operations console's view, as the token may see it.

The view is made by tierflow itself every few seconds (cluster/console/feed.py) and kept
in the KV bucket ``tierflow_status``; a replica reads it at most once a second, whatever
the number of browsers. A token restricted to some streams sees only those streams, and
only the jobs that read nothing else; the pipeline's tiers (counts and rates, no names of
streams) are shown to every token that may connect. The raw bucket is internal
(actors/access/auth.py), so this filter is the only way out.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web
from nats.js.errors import BucketNotFoundError, KeyNotFoundError

from actors.access.auth import request_token
from actors.access.plane import DataPlane
from actors.access.protocol import Problem, refusal, reply, stream_ref
from runtime.nats.roles import STATUS_BUCKET, STATUS_KEY

__all__ = ["ConsoleRoutes", "visible_view"]

CACHE_S = 1.0


def visible_view(view: dict[str, Any], may_read: Any) -> dict[str, Any]:
    """`view` without the streams `may_read(name)` refuses, nor the jobs reading them."""
    streams = [s for s in view.get("streams", []) if may_read(s["name"])]
    jobs = [j for j in view.get("jobs", []) if all(may_read(s) for s in j.get("streams", []))]
    dead = sum(int(s.get("dead_letters") or 0) for s in streams)
    return {**view, "streams": streams, "jobs": jobs, "dead_letters": dead}


class ConsoleRoutes:
    """The console's view endpoint of one replica."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self._cached: tuple[float, dict[str, Any] | None] = (0.0, None)

    async def _view(self) -> dict[str, Any] | None:
        at, view = self._cached
        if time.monotonic() - at < CACHE_S:
            return view
        try:
            kv = await self.plane.js.key_value(STATUS_BUCKET)
            entry = await kv.get(STATUS_KEY)
            view = msgspec.json.decode(entry.value) if entry.value else None
        except (BucketNotFoundError, KeyNotFoundError):
            view = None
        self._cached = (time.monotonic(), view)
        return view

    async def console(self, request: web.Request) -> web.Response:
        plane = self.plane
        token = request_token(request)
        try:
            plane.access.authenticate(token)
        except Problem as p:
            plane.count(p)
            return refusal(p)
        view = await self._view()
        if view is None:
            return reply(
                503,
                {
                    "error": "no console view yet: `tierflow up` puts one every 2 s "
                    "(a gateway started alone has none)"
                },
            )

        def may_read(name: str) -> bool:
            return plane.access.may_read(token, stream_ref(name))

        out = visible_view(view, may_read)
        out["age_s"] = round(max(0.0, time.time() - float(view.get("at") or 0)), 1)
        out["views"] = sorted(plane.cfg.gateway.views)  # the pages beside the console
        return reply(200, out)
