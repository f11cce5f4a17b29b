"""The console's feed: every few seconds, the runtime's status as the console shows it
(cluster/console/view.py), put in the KV bucket ``tierflow_status``.

The launcher owns the status (Ray calls, stream infos); the gateways serve browsers,
possibly on other hosts. The bucket between them keeps Ray out of the gateway's requests,
and a gateway started later finds the latest view at once. One put per period, whatever
the number of browsers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError

from cluster.console.view import console_view, stream_record
from runtime.nats.roles import STATUS_BUCKET, STATUS_KEY, VERIFIER_KEY

log = logging.getLogger(__name__)

PERIOD_S = 2.0
StatusFn = Callable[[], Awaitable[dict[str, Any]]]


async def status_bucket(js: Any) -> Any:
    """The bucket, made when missing: one value, in memory (a view is stale in seconds)."""
    try:
        return await js.key_value(STATUS_BUCKET)
    except BucketNotFoundError:
        return await js.create_key_value(
            KeyValueConfig(bucket=STATUS_BUCKET, history=1, storage=StorageType.MEMORY)
        )


async def last_verdict(kv: Any) -> dict[str, Any] | None:
    """The last audit's verdict (cluster/audit.py), if one ran."""
    try:
        entry = await kv.get(VERIFIER_KEY)
    except KeyNotFoundError:
        return None
    return msgspec.json.decode(entry.value) if entry.value else None


async def stream_records(js: Any, configs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every stream but KV buckets and object stores, with its figures."""
    out = []
    for info in await js.streams_info():
        name = info.config.name
        if name.startswith(("KV_", "OBJ_")):
            continue
        out.append(stream_record(info, configs.get(name)))
    return out


class StatusFeed:
    """Puts the console's view every `period_s` until stopped; a failed round is logged and
    the next one tries again (the console shows the view's age)."""

    def __init__(
        self, nc: Any, status: StatusFn, configs: Mapping[str, Any], period_s: float = PERIOD_S
    ) -> None:
        self.nc, self.status, self.configs, self.period_s = nc, status, configs, period_s
        self.last: dict[str, Any] | None = None
        self.rounds = 0
        self.errors = 0

    async def once(self) -> dict[str, Any]:
        js = self.nc.jetstream()
        status = await self.status()
        streams = await stream_records(js, self.configs)
        kv = await status_bucket(js)
        status["verifier"] = await last_verdict(kv)
        view = console_view(status, streams, self.last, time.time())
        await kv.put(STATUS_KEY, msgspec.json.encode(view))
        self.last = view
        self.rounds += 1
        return view

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.once()
            except Exception as err:  # NATS away, a status probe failing: next round
                self.errors += 1
                log.warning("console feed: %r", err)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.period_s)
