"""The Collector's UDP producers: one event per datagram, `stream <json>`.

Its own module because UDP is one-way by nature: nobody can be answered, so a datagram's
events are logged after the fact (the ingest path's `one_way`, with the loss window that
implies) and a bad datagram is only counted (`rejected`). Replicas share the port
(`SO_REUSEPORT`). A datagram carries no token: with producer tokens set the collector
does not open UDP at all (collector.py, `untokened_paths_off`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from actors.collection.ingest import IngestPath
from actors.collection.parsing import BadInput

__all__ = ["UdpIngest"]


class _Datagrams(asyncio.DatagramProtocol):
    def __init__(self, udp: UdpIngest) -> None:
        self.udp = udp

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.udp.datagram(data)


class UdpIngest:
    """One Collector replica's UDP socket; `port` is the bound one once started."""

    def __init__(self, ingest: IngestPath, *, host: str, port: int) -> None:
        self.ingest = ingest
        self.counters = ingest.counters
        self.host = host
        self.port = port
        self._transport: asyncio.DatagramTransport | None = None

    async def start(self) -> int:
        """Bind (port 0: any free one) and return the port."""
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: _Datagrams(self), local_addr=(self.host, self.port), reuse_port=True
        )
        self._transport = transport
        self.port = transport.get_extra_info("sockname")[1]
        return self.port

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def datagram(self, data: bytes) -> None:
        """UDP: `stream <json>` per datagram; one-way by nature (no one to answer)."""
        stream, _, payload = data.partition(b" ")
        try:
            name = stream.decode("ascii")
            self.ingest.check_stream(name)
            events = self.ingest.parse("application/json", payload, name, max_events=1)
        except (BadInput, UnicodeDecodeError):
            self.counters["rejected"] += 1
            return
        self.counters["udp"] += 1
        self.ingest.one_way(events)
