"""A producer with known ids: drives a collector and records exactly what was accepted.

A real producer retries what was refused (503, a reset connection, a timeout) with the
SAME ids, so a retry never creates a second event; the generator does the same until
its deadline. What it reports as acknowledged is only what a collector answered 2xx
for: the set the zero-loss verdict (`cluster.verify.judge`) holds the pipeline to.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from cluster.verify import payload_digest

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()


@dataclass
class LoadReport:
    sent: int = 0
    acknowledged: set[str] = field(default_factory=set)
    refused: int = 0  # 503 answers (backpressure), each retried
    errors: int = 0  # connection errors and timeouts, each retried
    rejected: dict[int, int] = field(default_factory=dict)  # other 4xx: not retried
    latencies_ms: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def rate(self) -> float:
        return len(self.acknowledged) / self.elapsed_s if self.elapsed_s else 0.0

    def quantile(self, q: float) -> float | None:
        if not self.latencies_ms:
            return None
        data = sorted(self.latencies_ms)
        return data[min(len(data) - 1, int(q * len(data)))]


def known_events(
    n: int, prefix: str = "ev", make: Callable[[int], dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """`n` events with ids `{prefix}-{i}`; `make(i)` supplies the body (default: tiny)."""
    return [{**(make(i) if make else {"n": i}), "id": f"{prefix}-{i}"} for i in range(n)]


async def drive(
    url: str | Sequence[str],
    stream: str,
    events: Sequence[dict[str, Any]],
    *,
    batch: int = 100,
    concurrency: int = 8,
    rate: float = 0.0,
    deadline_s: float = 120.0,
    query: str = "",
    on_batch: Callable[[int], None] | None = None,
    until: asyncio.Event | None = None,
    request_timeout_s: float = 30.0,
) -> LoadReport:
    """POST `events` in NDJSON batches with `concurrency` requests in flight.

    `url` is one collector or a list of them (one per host): requests in flight start
    spread over the list, and a request that is not answered (or answered 503) is resent,
    with the same ids, to the next one. `request_timeout_s` bounds an unanswered request:
    a host behind a partition answers nothing, it does not refuse.

    `rate` (events/s, 0 = as fast as answered) paces batch starts from a fixed schedule.
    A refused batch is retried with the same ids (short backoff) until `deadline_s`.
    Once `until` is set no new batch starts (a steady load for as long as something
    else takes); batches in flight still finish, retries included.
    """
    report = LoadReport()
    batches = [events[i : i + batch] for i in range(0, len(events), batch)]
    queue: asyncio.Queue[tuple[int, Sequence[dict[str, Any]]]] = asyncio.Queue()
    for item in enumerate(batches):
        queue.put_nowait(item)
    start = time.monotonic()
    stop_at = start + deadline_s
    urls = [url] if isinstance(url, str) else list(url)
    suffix = f"/v1/streams/{stream}/events{('?' + query) if query else ''}"
    targets = [f"{u}{suffix}" for u in urls]
    headers = {"Content-Type": "application/x-ndjson"}
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)

    async def worker(session: aiohttp.ClientSession, at: int) -> None:
        while not queue.empty() and time.monotonic() < stop_at:
            if until is not None and until.is_set():
                return
            idx, items = queue.get_nowait()
            if rate:
                due = start + idx * batch / rate
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                if until is not None and until.is_set():
                    return
            body = b"\n".join(_enc.encode(e) for e in items)
            attempt = 0
            while time.monotonic() < stop_at:
                t0 = time.monotonic()
                try:
                    target = targets[at % len(targets)]
                    async with session.post(target, data=body, headers=headers) as resp:
                        payload = await resp.read()
                        status = resp.status
                except (TimeoutError, aiohttp.ClientError):
                    report.errors += 1
                    status, payload = 0, b""
                report.sent += len(items)
                if 200 <= status < 300:
                    report.latencies_ms.append((time.monotonic() - t0) * 1000)
                    report.acknowledged.update(_dec.decode(payload)["ids"])
                    if on_batch:
                        on_batch(idx)
                    break
                if status == 503 or status == 0:
                    report.refused += status == 503
                    attempt += 1
                    at += 1  # the next collector, when there are several
                    await asyncio.sleep(min(1.0, 0.05 * 2**attempt))
                    continue
                report.rejected[status] = report.rejected.get(status, 0) + 1
                break

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session, i) for i in range(concurrency)))
    report.elapsed_s = time.monotonic() - start
    return report


# ----------------------------------------------------------------------------- mixed load

OK, NEAR_LIMIT, INVALID, OVERSIZED = "ok", "near-limit", "invalid", "oversized"
EXPECT_ACCEPTED = (OK, NEAR_LIMIT)
MAX_EVENT_BYTES = 1 << 20  # the collector's default per-event limit
# What the collector keeps free of the server's max_payload for headers (its
# HEADER_RESERVE plus the header frame and a Nats-Msg-Id); a near-limit event stays
# this much below max_payload, an oversized one goes past it.
NEAR_LIMIT_MARGIN = 2048


@dataclass
class Planned:
    """One event of a mixed load: where it goes, what it says, whether it must be taken.

    `id` None lets the collector assign one (the producer then learns it from the
    answer, also from an error answer, and resends under it). `raw` is the exact line
    sent when it is not the encoded body (malformed JSON)."""

    stream: str
    body: dict[str, Any]  # the payload, without "id"
    id: Any = None
    kind: str = OK
    raw: bytes | None = None

    def encode(self) -> bytes:
        if self.raw is not None:
            return self.raw
        return _enc.encode(self.body if self.id is None else {"id": self.id, **self.body})

    @property
    def digest(self) -> str:
        return payload_digest(self.body)


@dataclass
class MixedReport(LoadReport):
    """What a mixed load was told, per stream, for `cluster.verify.judge_streams`."""

    expected: int = 0  # events that must be acknowledged (ok + near-limit)
    acked: dict[str, dict[str, str]] = field(default_factory=dict)  # stream -> id -> digest
    refused_digests: dict[str, set[str]] = field(default_factory=dict)  # answered 4xx
    blind: dict[str, dict[str, int]] = field(default_factory=dict)  # resends with no answer
    adopted: int = 0  # events without id resent under the ids an error answer gave
    ws_requests: int = 0  # requests sent as a frame on a producer WebSocket
    retried: dict[int, int] = field(default_factory=dict)  # resent requests by status (0: none)
    wrongly_accepted: list[str] = field(default_factory=list)  # invalid/oversized taken
    wrongly_refused: list[str] = field(default_factory=list)  # valid events answered 4xx


def _padded(body: dict[str, Any], eid: Any, size: int) -> dict[str, Any]:
    """`body` with a `pad` field making its encoded line (with `eid`) `size` bytes."""
    probe = {"id": eid, **body, "pad": ""} if eid is not None else {**body, "pad": ""}
    return {**body, "pad": "x" * max(0, size - len(_enc.encode(probe)))}


def mixed_plan(
    n: int,
    streams: Sequence[str],
    prefix: str,
    *,
    max_payload: int,
    make: Callable[[int, str], dict[str, Any] | None] | None = None,
    special_streams: Sequence[str] | None = None,
    near_limit_every: int = 150,
) -> list[Planned]:
    """`n` valid events spread over `streams`, plus refusals sprinkled among them.

    Event i goes to `streams[i % len]` with id `{prefix}-{i // len}`: every id is reused
    on each stream (different payloads). Every fourth id slot sends no id. Every
    `near_limit_every`-th valid event is padded to just under what the server takes
    (`max_payload - NEAR_LIMIT_MARGIN`). On `special_streams` (default all) six events
    must be refused: an empty id, an id with a space, malformed JSON, a line that is not
    an object, one event just under the collector's per-event limit but over what the
    server takes with headers, one over the collector's limit. Every payload is unique
    (`u`), so a payload stored under two ids is a duplicate.
    """
    out: list[Planned] = []
    width = len(streams)
    for i in range(n):
        stream, slot = streams[i % width], i // width
        eid = None if slot % 4 == 3 else f"{prefix}-{slot}"
        body = (make(i, stream) if make else None) or {"n": i, "k": "a" if slot % 3 == 0 else "b"}
        body = {**body, "u": f"{prefix}:{stream}:{i}"}
        kind = OK
        if near_limit_every and i % near_limit_every == near_limit_every - 1 and not make:
            body, kind = _padded(body, eid, max_payload - NEAR_LIMIT_MARGIN), NEAR_LIMIT
        out.append(Planned(stream, body, eid, kind))
    targets = list(special_streams or streams)
    if not targets:
        return out
    gap = min(MAX_EVENT_BYTES, max_payload - 16)  # the collector's limit lets it in
    specials: list[tuple[Any, str, int, bytes | None]] = [
        ("", INVALID, 0, None),
        ("two words", INVALID, 0, None),
        (f"{prefix}-bad-json", INVALID, 0, b'{"id": "x", "u": '),
        (None, INVALID, 0, b'["not", "an", "object"]'),
        (f"{prefix}-gap", OVERSIZED, gap, None),
        (f"{prefix}-huge", OVERSIZED, MAX_EVENT_BYTES + 1024, None),
    ]
    for k, (eid, kind, size, raw) in enumerate(specials):
        stream = targets[k % len(targets)]
        body: dict[str, Any] = {"n": -1 - k, "k": "b", "u": f"{prefix}:{stream}:special-{k}"}
        if size:
            body = _padded(body, eid, size)
        pos = (k + 1) * len(out) // (len(specials) + 1)
        out.insert(pos, Planned(stream, body, eid, kind, raw))
    return out


def _units(plan: Sequence[Planned], batch: int) -> list[list[Planned]]:
    """Requests in plan order: valid events batched per stream, refusals alone (a bad
    event refuses its whole request, so it must not take valid ones with it)."""
    units: list[list[Planned]] = []
    pending: dict[str, list[Planned]] = {}
    for p in plan:
        if p.kind not in EXPECT_ACCEPTED:
            units.append([p])
            continue
        group = pending.setdefault(p.stream, [])
        group.append(p)
        if len(group) >= batch:
            units.append(pending.pop(p.stream))
    units.extend(g for g in pending.values() if g)
    return units


async def _ws_frame(
    session: aiohttp.ClientSession, url: str, items: Sequence[Planned]
) -> tuple[int, bytes]:
    """Send `items` as one JSON-array frame on a fresh producer WebSocket; (status, the
    answer) as for HTTP: 200 when accepted, the answer's `status` otherwise, 0 when no
    answer came."""
    target = f"{url}/v1/streams/{items[0].stream}/ws"
    frame = b"[" + b",".join(p.encode() for p in items) + b"]"
    try:
        async with session.ws_connect(target, max_msg_size=0) as ws:
            await ws.send_str(frame.decode())
            msg = await ws.receive(timeout=30)
    except (TimeoutError, aiohttp.ClientError):
        return 0, b""
    if msg.type != aiohttp.WSMsgType.TEXT:
        return 0, b""
    data = msg.data.encode()
    try:
        answer = _dec.decode(data)
    except msgspec.DecodeError:
        return 0, b""
    if "accepted" in answer:
        return 200, data
    return int(answer.get("status") or 0), data


async def drive_mixed(
    url: str,
    plan: Sequence[Planned],
    *,
    batch: int = 50,
    concurrency: int = 4,
    rate: float = 0.0,
    deadline_s: float = 120.0,
    on_batch: Callable[[int], None] | None = None,
    ws_every: int = 0,
) -> MixedReport:
    """Send `plan` as NDJSON requests, `concurrency` in flight, paced at `rate` events/s.

    A 5xx or a lost answer is resent until `deadline_s`. Events without an id adopt the
    `ids` an error answer carries (the collector assigned and maybe logged them), so the
    resend cannot store them twice; a resend after no answer at all is blind and
    counted per payload. A 4xx is final: its payloads must never be stored. `on_batch`
    gets the number of events each acknowledged request carried. With `ws_every` k,
    every k-th request of valid events goes as one frame on a producer WebSocket (its
    answer carries the same `ids` and `status`).
    """
    report = MixedReport()
    units = _units(plan, batch)
    report.expected = sum(1 for p in plan if p.kind in EXPECT_ACCEPTED)
    # A unit is due when its first event's turn in the plan comes, so the batches that
    # carry the same ids on different streams go out together (in flight at once).
    turn = {id(p): k for k, p in enumerate(plan)}
    units.sort(key=lambda u: turn[id(u[0])])
    starts = [turn[id(u[0])] for u in units]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for idx in range(len(units)):
        queue.put_nowait(idx)
    start = time.monotonic()
    stop_at = start + deadline_s
    headers = {"Content-Type": "application/x-ndjson"}

    def settle_ok(items: list[Planned], payload: bytes, t0: float) -> None:
        report.latencies_ms.append((time.monotonic() - t0) * 1000)
        for p, eid in zip(items, _dec.decode(payload)["ids"], strict=True):
            report.acked.setdefault(p.stream, {})[str(eid)] = p.digest
            report.acknowledged.add(f"{p.stream}/{eid}")
            if p.kind not in EXPECT_ACCEPTED:
                report.wrongly_accepted.append(f"{p.stream}/{p.kind}/{eid}")
        if on_batch:
            on_batch(len(items))

    def settle_refused(items: list[Planned], status: int, payload: bytes) -> None:
        report.rejected[status] = report.rejected.get(status, 0) + 1
        for p in items:
            report.refused_digests.setdefault(p.stream, set()).add(p.digest)
            if p.kind in EXPECT_ACCEPTED:
                report.wrongly_refused.append(f"{p.stream}/{p.id}: {status} {payload[:120]!r}")

    def adopt_or_count_blind(items: list[Planned], status: int, payload: bytes) -> None:
        ids = None
        if payload:
            with contextlib.suppress(msgspec.DecodeError, TypeError, AttributeError):
                ids = _dec.decode(payload).get("ids")
        for k, p in enumerate(items):
            if p.id is not None or p.raw is not None:
                continue
            if isinstance(ids, list) and len(ids) == len(items):
                p.id = ids[k]
                report.adopted += 1
            elif status == 0:  # no answer: it may be logged under an id we never saw
                blind = report.blind.setdefault(p.stream, {})
                blind[p.digest] = blind.get(p.digest, 0) + 1

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty() and time.monotonic() < stop_at:
            idx = queue.get_nowait()
            items = units[idx]
            if rate:
                await asyncio.sleep(max(0.0, start + starts[idx] / rate - time.monotonic()))
            target = f"{url}/v1/streams/{items[0].stream}/events"
            over_ws = bool(ws_every) and idx % ws_every == ws_every - 1
            over_ws = over_ws and all(p.kind in EXPECT_ACCEPTED for p in items)
            report.ws_requests += over_ws
            attempt = 0
            while time.monotonic() < stop_at:
                t0 = time.monotonic()
                if over_ws:
                    status, payload = await _ws_frame(session, url, items)
                else:
                    body = b"\n".join(p.encode() for p in items)  # adopted ids included
                    try:
                        async with session.post(target, data=body, headers=headers) as resp:
                            payload, status = await resp.read(), resp.status
                    except (TimeoutError, aiohttp.ClientError):
                        status, payload = 0, b""
                report.errors += status == 0
                report.sent += len(items)
                if 200 <= status < 300:
                    settle_ok(items, payload, t0)
                    break
                if status == 0 or status >= 500:
                    report.refused += status == 503
                    report.retried[status] = report.retried.get(status, 0) + 1
                    adopt_or_count_blind(items, status, payload)
                    attempt += 1
                    await asyncio.sleep(min(1.0, 0.05 * 2**attempt))
                    continue
                settle_refused(items, status, payload)
                break

    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    report.elapsed_s = time.monotonic() - start
    return report
