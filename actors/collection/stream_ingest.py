"""The stream pattern's ingest node (book ch. 2, "scaling the stream pattern").

One long-lived source connection is pinned to one node. That node does no business logic:
it pushes raw frames into a durable JetStream buffer as fast as it can, and a separate,
horizontally scaled set of processing collectors consumes the buffer.

    source --(one connection)--> StreamIngest [active]  --> JetStream `buffer`, `buffer.{stream}`
                                 StreamIngest [standby] x k       |
                                                                  v
                                         BufferConsumer x n (one shared durable, work queue)

The pieces, each usable alone:

- `actors/collection/buffer.py`: `BufferWriter` (frames -> `buffer.{stream}`, batched, with
  `{source_id}:{pos}` dedup ids) and `resume_position` (where a new active node resumes).
- `runtime/nats/lease.py`: one active node among k+1, by a `KvLease` on `ingest.{stream}` in the
  KV bucket `tierflow_leases` (per-key TTL). The holder renews every ttl/3 with a
  revision-checked write; a standby tries to create the key every ttl/6. A failed renewal
  (another holder, or any error) stops the ingest work at once, and the writer refuses to
  publish once the last successful renewal is older than 2/3 of the TTL (the lease's
  `fresh` fence): a deposed node stops writing BEFORE its key can expire and a standby can
  take over. Only publishes already on the wire can land after that, and they carry the
  same `source:pos` ids as the new leader's, so JetStream keeps one copy (within the
  buffer's duplicate window): a brief overlap is harmless.
- here, `StreamIngest`: the Ray actor (a `SupervisedActor`) running the above for one
  source; `cluster/deploy/stream_ingest.py` starts k+1 named, detached replicas. A replica
  Ray restarted stays out of the lease race for two TTLs, so a dead leader's lease goes to a
  standby that stayed up (measured here: about 2.5-3.3 s from SIGKILL to the first frame
  buffered by the standby, with a 3 s TTL).
- `actors/collection/buffer_consumer.py`: `BufferConsumer`, the processing side.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import ray
from nats.aio.client import Client

from actors.collection.buffer import (
    BufferWriter,
    check_stream_name,
    ensure_buffer_stream,
    resume_position,
)
from actors.collection.sources import StreamSource, source_from_url
from runtime.config import Config, validate
from runtime.engines.services import connect_nats
from runtime.loop_thread import LoopThread
from runtime.nats.lease import KvLease, Leadership, Term, ensure_lease_bucket
from runtime.supervision.policy import backoff_delay
from runtime.supervision.ray_actors import SupervisedActor

__all__ = [
    "IngestTerm",
    "StreamIngest",
    "lease_key",
]

log = logging.getLogger(__name__)

_SUMMED = ("frames", "reconnects", "failures", "gaps", "missed", "repeats", "malformed")
_SUMMED_F = ("downtime_s", "est_missed")
_WRITER_SUMMED = ("written", "duplicates", "batches")


def lease_key(stream: str) -> str:
    """The stream's key in the lease bucket: one active ingest node per stream."""
    return f"ingest.{check_stream_name(stream)}"


@dataclass
class IngestTerm(Term):
    """One period as the active node, with where it resumed and when it first wrote."""

    resume_from: int | None = None
    first_write_at: float | None = None


def _restarted_by_ray() -> bool:
    """Whether this actor's process is a Ray restart (False if Ray cannot tell)."""
    try:
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - unknown: behave as a first start
        return False


class StreamIngest(SupervisedActor):
    """The ingest node of one stream-pattern source, active or standby by the lease.

    Active: resume the source at `resume_position` (positioned sources) and pump its frames
    into `buffer.{stream}`. Standby: try for the lease. A Ray restart reruns `__init__` with
    a new incarnation, hence a new lease holder id: it cannot reclaim the old lease and waits
    as a standby until the lease is free. All of it runs on a `LoopThread` started in
    `__init__`, so Ray's calls (heartbeat, stats, stop) never queue behind the data plane.

    Args:
        stream: the stream's name (subject token).
        url, kind: the source (see `actors.collection.sources.source_from_url`).
        nats_url: NATS server(s).
        config: the tierflow config (`Config.to_dict()`): NATS credentials (role `ingest`)
            and TLS; None connects with the defaults (no credentials, no TLS).
        state_dir: root of the actor's checkpoint store (SupervisedActor).
        source_id: prefix of the frames' dedup ids; the same for every replica (default the
            stream name), so replicas re-reading a position produce the same id.
        positioned: override the source's default.
        lease_ttl_s: lease TTL in whole seconds; a crashed leader is replaced in about this.
        max_batch, max_delay_ms: writer batching; `max_batch` is also the resume overlap.
        restart_delay_s: after a Ray restart, how long to stay out of the lease race
            (default two TTLs). A standby that stayed up acquires a dead leader's lease within
            a TTL plus a poll, so it wins: the lease goes to the replica that has been healthy,
            and a crash-looping replica cannot keep winning it back.
        source_options: more keywords for the source (backoff, read_timeout_s, ...).
    """

    def __init__(
        self,
        stream: str,
        url: str,
        kind: str = "auto",
        *,
        nats_url: str,
        state_dir: str,
        config: dict[str, Any] | None = None,
        source_id: str | None = None,
        positioned: bool | None = None,
        lease_ttl_s: int = 3,
        max_batch: int = 256,
        max_delay_ms: float = 5.0,
        restart_delay_s: float | None = None,
        source_options: dict[str, Any] | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(state_dir, name=name)
        self.stream = check_stream_name(stream)
        self.url = url
        self.kind = kind
        self.nats_url = nats_url
        self.cfg: Config = validate(config or {})
        self.source_id = source_id or stream
        self._positioned = positioned
        self._ttl_s = lease_ttl_s
        self._max_batch = max_batch
        self._max_delay_s = max_delay_ms / 1000
        self._source_options = dict(source_options or {})
        if restart_delay_s is None:
            restart_delay_s = 2.0 * lease_ttl_s
        self._initial_delay_s = restart_delay_s if _restarted_by_ray() else 0.0
        self.holder = f"{self.name}/{self.incarnation}"
        self._nc: Client | None = None
        self._leadership: Leadership[IngestTerm] | None = None
        self._source: StreamSource | None = None
        self._writer: BufferWriter | None = None
        self._term: IngestTerm | None = None
        self._totals: dict[str, float] = dict.fromkeys(_SUMMED + _SUMMED_F + _WRITER_SUMMED, 0)
        self._last_written: int | None = None
        self._position: int | None = None
        self._error: str | None = None
        self._dataplane = LoopThread(f"{self.name}-dataplane")
        self._dataplane.start(self._run)

    # ---- remote methods ---------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        """Role, lease, terms and counters summed over every source connection and term."""
        return await self._dataplane.run(self._stats())

    async def stop(self) -> None:
        """Stop ingesting and release the lease (a standby takes over without waiting)."""
        await asyncio.to_thread(self._dataplane.stop, 15.0)

    # ---- internals (on the data-plane loop) ---------------------------------------------

    async def _stats(self) -> dict[str, Any]:
        totals = dict(self._totals)
        if self._source is not None:
            s = self._source.stats()
            for k in _SUMMED + _SUMMED_F:
                totals[k] += s[k]
        if self._writer is not None:
            self._note_progress(self._writer, self._term)
            w = self._writer.stats()
            for k in _WRITER_SUMMED:
                totals[k] += w[k]
        lead = self._leadership
        return {
            **self.heartbeat(),
            "stream": self.stream,
            "holder": self.holder,
            "role": lead.role if lead else "starting",
            "restart_delay_s": self._initial_delay_s,
            "lease_revision": lead.lease.revision if lead else None,
            "lease_lost": lead.lost if lead else 0,
            "work_failures": lead.work_failures if lead else 0,
            "last_error": (lead.last_error if lead else None) or self._error,
            "terms": [asdict(t) for t in lead.terms] if lead else [],
            "position": self._source.position if self._source else self._position,
            "last_written_pos": self._last_written,
            **{k: int(v) if k not in _SUMMED_F else v for k, v in totals.items()},
        }

    async def _run(self, stop: asyncio.Event, ready: Callable[[], None]) -> None:
        """The data plane: ready at once (NATS may come later), then serve until `stop`."""
        ready()
        attempt = 0
        while not stop.is_set():
            try:
                await self._serve(stop)
                return
            except Exception as err:  # noqa: BLE001 - NATS unreachable: retry with backoff
                self._error = f"{type(err).__name__}: {err}"
                log.warning("stream ingest %s: %s", self.name, self._error)
            await self._close_nc()
            delay = backoff_delay(
                attempt, base=0.2, factor=2.0, cap=5.0, jitter=0.5, rand=random.random()
            )
            attempt += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)

    async def _serve(self, stop: asyncio.Event) -> None:
        self._nc = await connect_nats(
            self.cfg, self.nats_url, name=f"tierflow-ingest-{self.name}", role="ingest"
        )
        await ensure_buffer_stream(self._nc, [self.stream])
        kv = await ensure_lease_bucket(self._nc.jetstream())
        lease = KvLease(self._nc, kv, lease_key(self.stream), self.holder, ttl_s=self._ttl_s)
        self._leadership = Leadership(
            lease, self._ingest, new_term=IngestTerm, initial_delay_s=self._initial_delay_s
        )
        try:
            await self._leadership.run(stop)
        finally:
            await self._close_nc()

    async def _close_nc(self) -> None:
        nc, self._nc = self._nc, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await nc.close()

    async def _ingest(self) -> None:
        """One run of the active role: resume the source from the buffer, pump frames."""
        assert self._nc is not None and self._leadership is not None
        lease = self._leadership.lease
        source = source_from_url(
            self.url, self.kind, positioned=self._positioned, **self._source_options
        )
        start = None
        if source.positioned:
            start = await resume_position(self._nc.jetstream(), self.stream, self._max_batch)
            source.seek(start)
        writer = BufferWriter(
            self._nc,
            self.stream,
            self.source_id,
            max_batch=self._max_batch,
            max_delay_s=self._max_delay_s,
            fence=lease.fresh,
        )
        term = self._leadership.term
        if term is not None and term.resume_from is None:
            term.resume_from = start
        self._source, self._writer, self._term = source, writer, term
        try:
            await writer.pump(source)
        finally:
            source.stop()
            await writer.close()
            self._fold(source, writer, term)

    def _fold(self, source: StreamSource, writer: BufferWriter, term: IngestTerm | None) -> None:
        """Add a finished source's and writer's counters to the totals."""
        s, w = source.stats(), writer.stats()
        for k in _SUMMED + _SUMMED_F:
            self._totals[k] += s[k]
        for k in _WRITER_SUMMED:
            self._totals[k] += w[k]
        self._position = source.position
        self._note_progress(writer, term)
        self._source, self._writer, self._term = None, None, None

    def _note_progress(self, writer: BufferWriter, term: IngestTerm | None) -> None:
        if writer.last_pos is not None:
            self._last_written = writer.last_pos
        if term is not None and term.first_write_at is None:
            term.first_write_at = writer.first_write_at
