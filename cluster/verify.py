"""Read back what a JetStream stream holds, to prove nothing acknowledged was lost.

The zero-loss verdict is per stream, by (id, payload): every acknowledged event is in its
stream exactly once under its id AND with the bytes the producer sent (a hash of the
payload without its `id`, keys sorted: `payload_digest`); no id is stored twice; no
acknowledged payload is stored under a second id (a producer without ids that resent);
nothing refused (4xx) is stored at all. Ids are compared per stream because the same id
on two streams is two events. The stream is read with the `Nats-Msg-Id` header and the
data of every message, in bulk with an ordered ephemeral consumer (one round trip per
batch, not one per message).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

MSG_ID = "Nats-Msg-Id"

Record = tuple[str, str]  # (Nats-Msg-Id, payload_digest) of one stored message

_sorted = msgspec.json.Encoder(order="sorted")
T = TypeVar("T")


def payload_digest(payload: bytes | Mapping[str, Any]) -> str:
    """A hash of an event's payload without its `id`, independent of key order.

    The collector writes an assigned id into the JSON, so the digest leaves `id` out:
    the producer's body and the stored message hash alike. Bytes that are not a JSON
    object hash as they are.
    """
    if isinstance(payload, bytes | bytearray | memoryview):
        try:
            value = msgspec.json.decode(bytes(payload))
        except msgspec.DecodeError:
            value = None
        if not isinstance(value, dict):
            return "raw:" + hashlib.sha256(bytes(payload)).hexdigest()[:24]
    else:
        value = payload
    body = {k: v for k, v in value.items() if k != "id"}
    return hashlib.sha256(_sorted.encode(body)).hexdigest()[:24]


async def stream_ids(
    nc: Any, stream: str, subject: str | None = None, *, batch: int = 2000, timeout: float = 60.0
) -> Counter[str]:
    """How many times each `Nats-Msg-Id` occurs in `stream` (optionally one subject)."""
    found: Counter[str] = Counter()
    for eid, _ in await stream_records(
        nc, stream, subject, batch=batch, timeout=timeout, digest=lambda _: ""
    ):
        found[eid] += 1
    return found


async def stream_records(
    nc: Any,
    stream: str,
    subject: str | None = None,
    *,
    batch: int = 2000,
    timeout: float = 60.0,
    digest: Callable[[bytes], str] = payload_digest,
) -> list[Record]:
    """(`Nats-Msg-Id`, payload digest) of every message in `stream`, in stream order."""
    found: list[Record] = []

    def take(seq: int, eid: str, data: bytes) -> None:
        found.append((eid, digest(data)))

    await read_stream(nc, stream, take, subject, batch=batch, timeout=timeout)
    return found


async def read_stream(
    nc: Any,
    stream: str,
    on_message: Callable[[int, str, bytes], None],
    subject: str | None = None,
    *,
    start_seq: int = 1,
    batch: int = 2000,
    timeout: float = 60.0,
) -> None:
    """`on_message(seq, Nats-Msg-Id, data)` for every message of `stream` from `start_seq`
    on, in stream order (a message without the header gets a placeholder id)."""
    from nats.js.errors import ServiceUnavailableError

    js = nc.jetstream()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout

    async def settled(call: Callable[[], Awaitable[T]]) -> T:
        """`call`, again while it answers 503 or not in time: right after a partition heals
        or a node returns, the stream's group may still be electing its leader."""
        while True:
            try:
                return await call()
            except (ServiceUnavailableError, TimeoutError):
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.2)

    info = await settled(lambda: js.stream_info(stream))
    last = info.state.last_seq
    if info.state.messages == 0 or last < start_seq:
        return
    config = _ordered_from(max(start_seq, info.state.first_seq))
    sub = await settled(lambda: js.pull_subscribe(subject or ">", stream=stream, config=config))
    read = 0
    try:
        seq = 0
        while seq < last:
            if loop.time() > deadline:
                raise TimeoutError(f"read {read} of {stream} in {timeout} s")
            try:
                msgs = await sub.fetch(batch, timeout=2)
            except TimeoutError:
                if subject:  # a filtered read may end before the stream's last seq
                    break
                continue
            except ServiceUnavailableError:
                # 503 no responders: right after a node loss the new consumer's
                # assignment may not have reached its server; it answers once it has.
                await asyncio.sleep(0.1)
                continue
            for msg in msgs:
                seq = msg.metadata.sequence.stream
                eid = (msg.headers or {}).get(MSG_ID, f"<no id, seq {seq}>")
                on_message(seq, eid, msg.data)
                read += 1
    finally:
        await sub.unsubscribe()


class StreamTally:
    """How many times each id occurs in one stream, read on from where the last read ended:
    a check after each of many runs on one growing stream reads each message once, where
    `stream_ids` would reread everything (minutes per check at a million events).
    `on_new(id, data)` sees the first copy of each id, once."""

    def __init__(self, stream: str, on_new: Callable[[str, bytes], None] | None = None) -> None:
        self.stream = stream
        self.ids: Counter[str] = Counter()
        self.next_seq = 1
        self._on_new = on_new

    def _take(self, seq: int, eid: str, data: bytes) -> None:
        if self._on_new is not None and not self.ids[eid]:
            self._on_new(eid, data)
        self.ids[eid] += 1
        self.next_seq = seq + 1  # a read cut short by its deadline resumes after this one

    async def read(self, nc: Any, timeout: float = 60.0) -> Counter[str]:
        """Every id so far (the counter itself: copy it to keep a snapshot)."""
        await read_stream(nc, self.stream, self._take, start_seq=self.next_seq, timeout=timeout)
        return self.ids


def _ordered_from(start_seq: int) -> Any:
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    return ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=start_seq,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=30.0,
        max_waiting=1,
    )


@dataclass
class Verdict:
    """What a zero-loss check found."""

    acknowledged: int
    stored: int
    lost: list[str] = field(default_factory=list)
    duplicated: dict[str, int] = field(default_factory=dict)
    unexpected: int = 0  # stored ids no producer was told were accepted (allowed: see below)

    @property
    def ok(self) -> bool:
        return not self.lost and not self.duplicated

    def __str__(self) -> str:
        return (
            f"acknowledged {self.acknowledged}, stored {self.stored}, lost {len(self.lost)}, "
            f"duplicated {len(self.duplicated)}, unacknowledged-but-stored {self.unexpected}"
            + (f"; first lost {self.lost[:5]}" if self.lost else "")
            + (f"; first duplicated {list(self.duplicated.items())[:5]}" if self.duplicated else "")
        )


def judge(acknowledged: Iterable[str], stored: Counter[str]) -> Verdict:
    """Every acknowledged id exactly once; no id twice.

    An id stored but never acknowledged is legal (the producer timed out or got a 503
    after the log had it, and will retry with the same id): counted, not a failure.
    """
    acked = set(acknowledged)
    return Verdict(
        acknowledged=len(acked),
        stored=sum(stored.values()),
        lost=sorted(i for i in acked if stored[i] == 0),
        duplicated={i: n for i, n in stored.items() if n > 1},
        unexpected=sum(1 for i in stored if i not in acked),
    )


@dataclass
class StreamVerdict:
    """What the zero-loss check found in one stream, by (id, payload digest)."""

    stream: str
    acknowledged: int
    stored: int
    lost: list[str] = field(default_factory=list)  # acknowledged id not stored at all
    altered: list[str] = field(default_factory=list)  # id stored, never with its payload
    duplicated: dict[str, int] = field(default_factory=dict)  # id -> copies (> 1)
    duplicated_payloads: dict[str, list[str]] = field(default_factory=dict)  # digest -> ids
    refused_stored: list[str] = field(default_factory=list)  # ids of refused payloads
    unexpected: int = 0  # stored ids never acknowledged (legal once: see judge_stream)
    blind_duplicates: int = 0  # extra copies explained by a resend that had no answer

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.altered
            or self.duplicated
            or self.duplicated_payloads
            or self.refused_stored
        )

    def __str__(self) -> str:
        parts = [
            f"{self.stream}: acknowledged {self.acknowledged}, stored {self.stored}",
            f"lost {len(self.lost)}",
            f"altered {len(self.altered)}",
            f"duplicated {len(self.duplicated)}",
            f"duplicated payloads {len(self.duplicated_payloads)}",
            f"refused-but-stored {len(self.refused_stored)}",
            f"unacknowledged-but-stored {self.unexpected}",
        ]
        if self.blind_duplicates:
            parts.append(f"blind-resend copies {self.blind_duplicates}")
        for name in ("lost", "altered", "refused_stored"):
            if getattr(self, name):
                parts.append(f"first {name} {getattr(self, name)[:5]}")
        for name in ("duplicated", "duplicated_payloads"):
            if getattr(self, name):
                parts.append(f"first {name} {list(getattr(self, name).items())[:3]}")
        return ", ".join(parts)


def judge_stream(
    stream: str,
    acknowledged: Mapping[str, str],
    stored: Sequence[Record],
    *,
    refused: Iterable[str] = (),
    blind: Mapping[str, int] | None = None,
) -> StreamVerdict:
    """Judge one stream: `acknowledged` maps each acknowledged id to its payload digest;
    `stored` is every (id, digest) read back; `refused` are digests of events answered
    with a 4xx (never to be stored); `blind` counts, per digest, resends a producer
    without ids made after a request that got no answer (each may leave one more copy
    under an id nobody was told, which no server can avoid: counted, not a failure).

    An id stored but never acknowledged is legal once (the producer gave up, or was
    answered 503 after the log had it and resent under the same id).
    """
    ids = Counter(eid for eid, _ in stored)
    pairs = set(stored)
    by_digest: dict[str, set[str]] = {}
    for eid, dig in stored:
        by_digest.setdefault(dig, set()).add(eid)
    blind = blind or {}
    dup_payloads: dict[str, list[str]] = {}
    blind_copies = 0
    for dig in set(acknowledged.values()):
        holders = by_digest.get(dig, set())
        extra = len(holders) - 1
        if extra <= 0:
            continue
        allowed = min(extra, blind.get(dig, 0))
        blind_copies += allowed
        if extra > allowed:
            dup_payloads[dig] = sorted(holders)
    refused_set = set(refused)
    return StreamVerdict(
        stream=stream,
        acknowledged=len(acknowledged),
        stored=len(stored),
        lost=sorted(i for i in acknowledged if ids[i] == 0),
        altered=sorted(i for i, d in acknowledged.items() if ids[i] and (i, d) not in pairs),
        duplicated={i: n for i, n in ids.items() if n > 1},
        duplicated_payloads=dup_payloads,
        refused_stored=sorted({i for i, d in stored if d in refused_set}),
        unexpected=sum(1 for i in ids if i not in acknowledged),
        blind_duplicates=blind_copies,
    )


def judge_streams(
    acknowledged: Mapping[str, Mapping[str, str]],
    stored: Mapping[str, Sequence[Record]],
    *,
    refused: Mapping[str, Iterable[str]] | None = None,
    blind: Mapping[str, Mapping[str, int]] | None = None,
) -> dict[str, StreamVerdict]:
    """`judge_stream` for every stream named in any of the inputs."""
    refused, blind = refused or {}, blind or {}
    names = sorted(set(acknowledged) | set(stored) | set(refused))
    return {
        s: judge_stream(
            s,
            acknowledged.get(s, {}),
            stored.get(s, []),
            refused=refused.get(s, ()),
            blind=blind.get(s),
        )
        for s in names
    }
