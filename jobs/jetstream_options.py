"""What the jetstream source reads, decided without I/O: options, schema, sequence offsets.

A streaming query's offset is ``{"seq": N, "skipped": K}``: N is the next stream sequence to
read, K how many sequences were skipped because they had aged out (``onAgedOut=skip``).
Partitions are sequence ranges (`SeqRange`). The options are listed in jobs/jetstream.py.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from pyspark.sql.datasource import InputPartition
from pyspark.sql.streaming.datasource import ReadLimit, ReadMaxRows, ReadMinRows
from pyspark.sql.types import StructType

from runtime.errors import TierflowError


def _nats_without_aiohttp() -> None:
    """Import nats-py without aiohttp in a process that has imported neither yet.

    nats-py imports aiohttp (100-400 ms) for its websocket transport only, and Spark starts
    a fresh process for every query's offsets and for new workers; the source connects
    over TCP. `websocket_ready` brings aiohttp back for a ``ws://`` / ``wss://`` URL."""
    if "nats.aio.transport" in sys.modules or "aiohttp" in sys.modules:
        return
    sys.modules["aiohttp"] = None  # type: ignore[assignment]  # import aiohttp: ImportError
    try:
        importlib.import_module("nats.aio.transport")
    finally:
        if sys.modules.get("aiohttp", 0) is None:
            del sys.modules["aiohttp"]


def websocket_ready(url: str) -> None:
    """Give nats-py its websocket transport back when `url` names a websocket server and
    `_nats_without_aiohttp` left it out of this process."""
    if "ws://" not in url and "wss://" not in url:
        return
    transport = importlib.import_module("nats.aio.transport")
    if getattr(transport, "aiohttp", None) is None:
        transport.aiohttp = importlib.import_module("aiohttp")  # type: ignore[attr-defined]


_nats_without_aiohttp()

from runtime.nats.endpoint import NatsEndpoint  # noqa: E402  (after the guard above)

log = logging.getLogger(__name__)

SCHEMA_DDL = (
    "seq BIGINT, subject STRING, ts TIMESTAMP, msg_id STRING, data STRING, "
    "valid BOOLEAN, error STRING, raw BINARY"
)
DEFAULT_PARTITION_SIZE = 20_000
DEFAULT_MIN_PARTITIONS = 2
# A range is not cut below this many sequences: each partition costs a consumer (created,
# pulled from, deleted) and a Python task; read one after another, a micro-batch of 5,000
# in two partitions took about twice as long as in one (docs/benchmarks.md)
MIN_SPLIT = 5_000
# Messages per pull, and so rows per Arrow batch handed to Spark: a micro-batch of 5,000
# as one batch spent 271-279 ms in the top-N's addBatch against 327-339 ms as 2,000 + 2,000
# + 1,000 (alternated A/B runs, docs/benchmarks.md). A pull holds this many events in the
# worker's memory at once (with the one being converted)
DEFAULT_FETCH_BATCH = 5_000
# Bytes per pull request (the server's ``max_bytes``): with fetchBatch 5,000 and events of up
# to a MiB (nats-server's default max_payload, which an operator may raise), a pull could
# otherwise hold gigabytes in a Spark Python worker. Uncapped, a pull of 1,000 events of 256
# KiB overran the server's per-client buffer (max_pending, 64 MiB by default): "Slow
# Consumer", the connection dropped, no answer, consumers re-created until the read failed.
# Reading those 1,000 events: 64 MiB 841-1,280 events/s, 461 MB peak RSS; 32 MiB 1,210-1,301,
# 300 MB; 16 MiB 1,311-1,371, 240 MB. Events under 3 KB fill fetchBatch first
DEFAULT_FETCH_MAX_BYTES = 16 * 1024 * 1024
# What the server counts for a delivery beyond its headers and payload: the subject (a
# publish's control line, 4 KiB by default) and the ack reply (stream and consumer names)
PULL_BYTES_SLACK = 16 * 1024
DEFAULT_TIMEOUT = 10.0
AGED_OUT_MODES = ("fail", "skip")
VALIDATE_MODES = ("json", "utf8", "none")


class JetStreamSourceError(TierflowError, RuntimeError):
    """A Spark job's JetStream source was misconfigured or could not read; the message says
    which."""


class AgedOutError(JetStreamSourceError):
    """The start sequence is below the stream's first sequence: those events are gone."""

    def __init__(self, stream: str, requested: int, first: int) -> None:
        self.stream, self.requested, self.first = stream, requested, first
        super().__init__(
            f"jetstream stream {stream!r}: start sequence {requested} has aged out; the first "
            f"sequence the stream still holds is {first} (up to {first - requested} events "
            f"lost to the stream's limits). Set option onAgedOut=skip to continue from "
            f"{first}, or start a new query."
        )


def schema() -> StructType:
    """The source's fixed schema, SCHEMA_DDL as a StructType (built without a JVM)."""
    from pyspark.sql.types import (
        BinaryType,
        BooleanType,
        LongType,
        StringType,
        StructField,
        TimestampType,
    )

    types = {
        "seq": LongType(),
        "subject": StringType(),
        "ts": TimestampType(),
        "msg_id": StringType(),
        "data": StringType(),
        "valid": BooleanType(),
        "error": StringType(),
        "raw": BinaryType(),
    }
    return StructType([StructField(name, t, True) for name, t in types.items()])


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class SourceOptions:
    """The parsed, validated options of one jetstream source."""

    nats: NatsEndpoint
    stream: str
    subjects: tuple[str, ...] = ()
    starting: str = "earliest"
    ending: str = "latest"
    max_events: int | None = None
    on_aged_out: str = "fail"
    validate: str = "json"
    invalid_only: bool = False
    partition_size: int = DEFAULT_PARTITION_SIZE
    min_partitions: int = DEFAULT_MIN_PARTITIONS
    fetch_batch: int = DEFAULT_FETCH_BATCH
    fetch_max_bytes: int = DEFAULT_FETCH_MAX_BYTES
    timeout: float = DEFAULT_TIMEOUT

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SourceOptions:
        if not options.get("url"):
            raise JetStreamSourceError(
                "jetstream source: option 'url' (the NATS server URL) is required"
            )
        stream = options.get("stream")
        if not stream:
            raise JetStreamSourceError("jetstream source: option 'stream' is required")
        subjects = tuple(s.strip() for s in (options.get("subject") or "").split(",") if s.strip())
        on_aged_out = (options.get("onAgedOut") or "fail").lower()
        if on_aged_out not in AGED_OUT_MODES:
            raise JetStreamSourceError(
                f"jetstream source: onAgedOut must be fail or skip, not {on_aged_out!r}"
            )
        validate = (options.get("validate") or "json").lower()
        if validate not in VALIDATE_MODES:
            raise JetStreamSourceError(
                f"jetstream source: validate must be one of {VALIDATE_MODES}, not {validate!r}"
            )
        invalid_only = _flag(options, "invalidOnly")
        if invalid_only and validate == "none":
            raise JetStreamSourceError(
                "jetstream source: invalidOnly needs validate json or utf8 (with none no "
                "event is malformed)"
            )
        max_events = options.get("maxEventsPerTrigger")
        return cls(
            nats=NatsEndpoint.from_options(options),
            stream=stream,
            subjects=subjects,
            starting=_offset_spec(options, "startingOffset", "earliest"),
            ending=_offset_spec(options, "endingOffset", "latest"),
            max_events=_positive_int(options, "maxEventsPerTrigger", 0) if max_events else None,
            on_aged_out=on_aged_out,
            validate=validate,
            invalid_only=invalid_only,
            partition_size=_positive_int(options, "partitionSize", DEFAULT_PARTITION_SIZE),
            min_partitions=_positive_int(options, "minPartitions", DEFAULT_MIN_PARTITIONS),
            fetch_batch=_positive_int(options, "fetchBatch", DEFAULT_FETCH_BATCH),
            fetch_max_bytes=_positive_int(options, "fetchMaxBytes", DEFAULT_FETCH_MAX_BYTES),
            timeout=_positive_float(options, "timeout", DEFAULT_TIMEOUT),
        )


def pull_max_bytes(option: int, max_payload: int) -> int:
    """The ``max_bytes`` of a pull request: the option, raised to what one event as big as
    the server accepts costs (`max_payload` from its INFO, plus `PULL_BYTES_SLACK`), so a
    pull always has room for its first event. (A stored event bigger than that, kept from
    before a lower max_payload or sourced from another server, ends a pull with nothing
    delivered; the reader then asks for that one event without a byte cap.)"""
    return max(option, max(0, max_payload) + PULL_BYTES_SLACK)


def _flag(options: Mapping[str, str], key: str) -> bool:
    raw = (options.get(key) or "false").strip().lower()
    if raw in ("true", "false"):
        return raw == "true"
    raise JetStreamSourceError(
        f"jetstream source: option {key!r} must be true or false, not {raw!r}"
    )


def _positive_int(options: Mapping[str, str], key: str, default: int) -> int:
    raw = options.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise JetStreamSourceError(
            f"jetstream source: option {key!r} must be a positive integer, not {raw!r}"
        )
    return value


def _positive_float(options: Mapping[str, str], key: str, default: float) -> float:
    raw = options.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise JetStreamSourceError(
            f"jetstream source: option {key!r} must be a positive number, not {raw!r}"
        )
    return value


def _offset_spec(options: Mapping[str, str], key: str, default: str) -> str:
    raw = (options.get(key) or default).strip().lower()
    if raw in ("earliest", "latest") or (raw.isdigit() and int(raw) >= 1):
        return raw
    raise JetStreamSourceError(
        f"jetstream source: option {key!r} must be earliest, latest or a stream sequence >= 1, "
        f"not {raw!r}"
    )


# --------------------------------------------------------------------------- offsets (pure)


@dataclass(frozen=True)
class Bounds:
    """A stream's state: first sequence held and last sequence written (0, 0 when new).

    `compacted`: the stream only ever lets a message go for a newer one of its subject
    (`only_compaction`), so sequences missing below `first` were compacted, not lost: a
    reader moves on to `first` and sees the latest event of every key, with nothing to
    report as aged out."""

    first: int
    last: int
    compacted: bool = False

    def aged_out(self, start: int) -> bool:
        """Whether sequences from `start` up to `first` were lost to the stream's limits."""
        return self.first > start and not self.compacted

    @property
    def earliest(self) -> int:
        return max(self.first, 1)

    @property
    def latest(self) -> int:
        """The next sequence the stream will write: an exclusive end."""
        return self.last + 1


def only_compaction(
    max_msgs_per_subject: int | None,
    max_age: float | None,
    max_msgs: int | None,
    max_bytes: int | None,
    discard: str | None,
) -> bool:
    """Whether a stream (by its JetStream limits) removes messages only by compaction: a
    per-subject limit, and no limit that removes old messages (an age; a count or size
    with discard old). A compacted stream with such a limit too may lose events to it, and
    a start below its first sequence counts as aged out, as on any stream. Purges (an
    archived stream's retention, jobs/retention.py) are not limits and are not seen here."""
    if not max_msgs_per_subject or max_msgs_per_subject < 1:
        return False
    if max_age:
        return False
    count_or_size = (max_msgs is not None and max_msgs >= 0) or (
        max_bytes is not None and max_bytes >= 0
    )
    return not count_or_size or str(discard or "old").lower() == "new"


def starting_sequence(spec: str, bounds: Bounds) -> int:
    """The first stream sequence a ``startingOffset`` (``earliest`` / ``latest`` / a
    number) names."""
    if spec == "earliest":
        return bounds.earliest
    if spec == "latest":
        return bounds.latest
    return int(spec)


def make_offset(seq: int, skipped: int = 0) -> dict[str, int]:
    return {"seq": seq, "skipped": skipped}


def next_offset(
    start: Mapping[str, int],
    bounds: Bounds,
    *,
    stream: str,
    on_aged_out: str,
    limit: ReadLimit,
    target: int | None = None,
) -> dict[str, int]:
    """The end offset of the next micro-batch from `start` (pure policy, no I/O).

    A start below the stream's first sequence fails (AgedOutError) or, with ``skip``, moves
    to the first sequence and adds the gap to ``skipped``; not on a stream that removes
    only by compaction (`Bounds.compacted`), whose gaps are superseded events.
    ``ReadMaxRows`` caps the sequence span, ``target`` (Trigger.AvailableNow) caps the end;
    returning `start` means no new data.
    """
    seq, skipped = int(start["seq"]), int(start.get("skipped", 0))
    base = seq
    if bounds.aged_out(seq):
        if on_aged_out != "skip":
            raise AgedOutError(stream, seq, bounds.first)
        skipped += bounds.first - seq
        base = bounds.first
        log.warning(
            "jetstream stream %r: sequences %d..%d aged out before they were read; skipping "
            "to %d (%d skipped in total)",
            stream,
            seq,
            bounds.first - 1,
            bounds.first,
            skipped,
        )
    latest = bounds.latest if target is None else min(bounds.latest, target)
    end = max(base, latest)
    if isinstance(limit, ReadMaxRows):
        end = min(end, base + max(1, limit.max_rows))
    elif isinstance(limit, ReadMinRows) and end - base < limit.min_rows:
        return make_offset(seq, int(start.get("skipped", 0)))  # wait for more
    return make_offset(end, skipped)


@dataclass
class SeqRange(InputPartition):
    """Stream sequences [start, end) read by one Spark task."""

    start: int
    end: int


def split_range(
    start: int, end: int, size: int, min_parts: int = 1, min_split: int = MIN_SPLIT
) -> list[SeqRange]:
    """[start, end) cut into consecutive ranges of at most `size` sequences (none when
    empty), and into at least `min_parts` of about equal size when each still holds
    `min_split` sequences or more, so a micro-batch is read by several tasks at once."""
    span = end - start
    if span <= 0:
        return []
    size = max(1, size)
    parts = min(min_parts, span // max(1, min_split))
    step = size if parts <= -(-span // size) else -(-span // parts)
    return [SeqRange(s, min(s + step, end)) for s in range(start, end, step)]


__all__ = [
    "SCHEMA_DDL",
    "AgedOutError",
    "Bounds",
    "JetStreamSourceError",
    "SeqRange",
    "SourceOptions",
    "make_offset",
    "websocket_ready",
    "next_offset",
    "only_compaction",
    "pull_max_bytes",
    "schema",
    "split_range",
    "starting_sequence",
]
