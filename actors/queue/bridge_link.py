"""`NatsLink`: the bridge's NATS connection, its publisher, and which stream takes a subject.

Its own part because the connection is replaceable under the data path: the watchdog swaps
a client that stays down for a fresh one, so the data path (`bridge_path.BridgePath`)
reads `link.nc` and `link.pub` at each call instead of holding them. The stream lookup
(`target`) lives here because it is a question to this connection, cached across calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from runtime.config import Config
from runtime.engines.services import connect_nats, ensure_streams
from runtime.nats.publisher import JetStreamPublisher

log = logging.getLogger(__name__)

_STREAM_CACHE_S = 30.0


class NatsLink:
    """The connection as the bridge role and a started publisher on it; see the module doc.

    `counters` is the bridge's (`bridge_status.COUNTERS`): the watchdog counts
    `reconnects` in it."""

    def __init__(
        self,
        cfg: Config,
        nats_url: str,
        *,
        name: str,
        counters: dict[str, int],
        max_in_flight: int = 4096,
        ack_timeout_s: float = 5.0,
        reconnect_deadline_s: float = 20.0,
    ) -> None:
        self.cfg = cfg
        self.nats_url = nats_url
        self.name = name
        self.counters = counters
        self.max_in_flight = max_in_flight
        self.ack_timeout_s = ack_timeout_s
        self.reconnect_deadline_s = reconnect_deadline_s
        self.nc: Any = None
        self.pub: JetStreamPublisher | None = None
        # subject -> (JetStream stream or None, its duplicate window s, when looked up)
        self._targets: dict[str, tuple[str | None, float, float]] = {}
        windows = [s.duplicate_window_s for s in cfg.streams.values()]
        self.fallback_window_s = min(windows, default=120.0)

    async def open(self, *, ensure: bool = False) -> None:
        """Connect and start the publisher (first making sure the configured streams
        exist, when `ensure`)."""
        self.nc, self.pub = await self._connect(ensure=ensure)

    async def close(self) -> None:
        assert self.pub is not None
        await self.pub.close()
        await self.nc.close()

    async def _connect(self, *, ensure: bool = False) -> tuple[Any, JetStreamPublisher]:
        nc = await connect_nats(self.cfg, self.nats_url, name=f"bridge-{self.name}", role="bridge")
        if ensure:
            await ensure_streams(nc, self.cfg)
        pub = JetStreamPublisher(nc, self.max_in_flight, self.ack_timeout_s)
        await pub.start()
        return nc, pub

    async def watch(self) -> None:
        """Replace a NATS connection that stays down past `reconnect_deadline_s`.

        Seen under the chaos proxy's connection resets: nats-py's client stopped trying to
        reconnect and sat "not connected" for good, while the log filled with entries it
        could not publish (nothing lost, nothing moving). A fresh client is the cure; a
        server that is really down only costs a failed attempt per deadline until it is
        back. Publishes in flight on the old client fail and the replayer resends them.
        """
        loop = asyncio.get_running_loop()
        down_since: float | None = None
        while True:  # bounded by cancellation when the bridge stops
            await asyncio.sleep(1.0)
            if self.nc.is_connected:
                down_since = None
                continue
            down_since = down_since if down_since is not None else loop.time()
            if loop.time() - down_since < self.reconnect_deadline_s:
                continue
            log.error(
                "%s: NATS not connected for %.0f s; replacing the client",
                self.name,
                loop.time() - down_since,
            )
            self.counters["reconnects"] += 1
            try:
                await self._replace()
                down_since = None
            except Exception as err:  # still unreachable: try again after another deadline
                log.warning("%s: new NATS connection failed: %r", self.name, err)
                down_since = loop.time()

    async def _replace(self) -> None:
        nc, pub = await self._connect()
        old_nc, old_pub = self.nc, self.pub
        self.nc, self.pub = nc, pub
        assert old_pub is not None
        for closing in (old_pub.close(), old_nc.close()):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(closing, 5.0)

    async def target(self, subject: str) -> tuple[str | None, float]:
        """(JetStream stream capturing `subject`, its duplicate window in s), cached for a
        while; (None, the smallest configured window) when the server cannot say."""
        loop = asyncio.get_running_loop()
        hit = self._targets.get(subject)
        if hit is not None and loop.time() - hit[2] < _STREAM_CACHE_S:
            return hit[0], hit[1]
        if not self.nc.is_connected:  # nothing to ask; the publish fails at once anyway
            return None, self.fallback_window_s
        try:
            js = self.nc.jetstream()
            stream = await asyncio.wait_for(js.find_stream_name_by_subject(subject), 5.0)
            info = await asyncio.wait_for(js.stream_info(stream), 5.0)
            window = float(info.config.duplicate_window or 120.0)
        except Exception as err:  # noqa: BLE001 - unknown target: the caller decides
            log.debug("%s: no stream for %r: %r", self.name, subject, err)
            return None, self.fallback_window_s
        self._targets[subject] = (stream, window, loop.time())
        return stream, window
