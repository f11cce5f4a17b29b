"""The chaos load's mixed producer: what it sends, and how it resends after errors.

`drive_mixed` runs against a small fake collector here (a unit test may fake its
neighbour); the chaos short form runs it against the real tier.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import pytest_asyncio
from aiohttp import web

from cluster.loadgen import (
    EXPECT_ACCEPTED,
    INVALID,
    MAX_EVENT_BYTES,
    NEAR_LIMIT,
    NEAR_LIMIT_MARGIN,
    OK,
    OVERSIZED,
    Planned,
    _units,
    drive_mixed,
    mixed_plan,
)
from cluster.verify import judge_streams

pytestmark = pytest.mark.unit

MAX_PAYLOAD = 1 << 20
STREAMS = ("s1", "s2", "s3")


def test_mixed_plan_reuses_ids_across_streams_and_sprinkles_refusals() -> None:
    plan = mixed_plan(300, STREAMS, "p", max_payload=MAX_PAYLOAD)
    valid = [p for p in plan if p.kind in EXPECT_ACCEPTED]
    assert len(valid) == 300
    assert Counter(p.stream for p in valid) == {"s1": 100, "s2": 100, "s3": 100}
    ids = {s: {p.id for p in valid if p.stream == s and p.id is not None} for s in STREAMS}
    assert ids["s1"] == ids["s2"] == ids["s3"] and len(ids["s1"]) == 75  # reused on each
    assert sum(1 for p in valid if p.id is None) == 75  # a quarter send no id
    assert len({p.digest for p in plan}) == len(plan)  # every payload unique
    near = [p for p in plan if p.kind == NEAR_LIMIT]
    assert len(near) == 2
    assert all(len(p.encode()) == MAX_PAYLOAD - NEAR_LIMIT_MARGIN for p in near if p.id)
    bad = [p for p in plan if p.kind not in EXPECT_ACCEPTED]
    assert Counter(p.kind for p in bad) == {INVALID: 4, OVERSIZED: 2}
    assert {p.stream for p in bad} == set(STREAMS)
    sizes = sorted(len(p.encode()) for p in bad if p.kind == OVERSIZED)
    assert sizes == [MAX_PAYLOAD - 16, MAX_EVENT_BYTES + 1024]
    assert plan[0].kind == OK and plan[-1].kind in EXPECT_ACCEPTED  # sprinkled inside


def test_units_batch_per_stream_and_send_refusals_alone() -> None:
    plan = mixed_plan(90, STREAMS, "u", max_payload=MAX_PAYLOAD)
    units = _units(plan, 10)
    assert sorted(p.digest for u in units for p in u) == sorted(p.digest for p in plan)
    for u in units:
        assert len({p.stream for p in u}) == 1
        if any(p.kind not in EXPECT_ACCEPTED for p in u):
            assert len(u) == 1


# --------------------------------------------------------------------------- fake collector


class FakeCollector:
    """Assigns ids like the collector; answers the first request holding an event
    without id with 503 + the assigned ids (they are 'logged'), drops the connection of
    the second such request without an answer, refuses `bad` payloads with 400."""

    def __init__(self) -> None:
        self.stored: dict[str, list[tuple[str, bytes]]] = {}
        self.no_id_requests = 0
        self.ws_frames = 0
        self.next_id = 0

    def _assign(self, line: dict[str, Any]) -> str:
        if line.get("id") is None:
            self.next_id += 1
            line["id"] = f"srv-{self.next_id}"
        return str(line["id"])

    async def post(self, request: web.Request) -> web.StreamResponse:
        stream = request.match_info["stream"]
        lines = (await request.read()).split(b"\n")
        try:
            items = [msgspec.json.decode(raw) for raw in lines]
        except msgspec.DecodeError:
            return web.json_response({"error": "malformed"}, status=400)
        if any(not isinstance(i, dict) or i.get("id") == "" for i in items):
            return web.json_response({"error": "bad id"}, status=400)
        without = any(i.get("id") is None for i in items)
        ids = [self._assign(i) for i in items]
        log = self.stored.setdefault(stream, [])
        known = {eid for eid, _ in log}
        log.extend(
            (eid, msgspec.json.encode(i))
            for eid, i in zip(ids, items, strict=True)
            if eid not in known
        )
        if without:
            self.no_id_requests += 1
            if self.no_id_requests == 1:
                return web.json_response({"error": "busy", "ids": ids}, status=503)
            if self.no_id_requests == 2:
                assert request.transport is not None
                request.transport.close()  # logged, never answered
                return web.Response(status=500)
        return web.json_response({"accepted": len(ids), "ids": ids})

    async def ws(self, request: web.Request) -> web.StreamResponse:
        """One frame per connection: a 503 answer with the assigned ids the first time a
        frame holds an event without id (they are 'logged'), else accepted."""
        stream = request.match_info["stream"]
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        msg = await ws.receive()
        items = msgspec.json.decode(msg.data)
        without = any(i.get("id") is None for i in items)
        ids = [self._assign(i) for i in items]
        log = self.stored.setdefault(stream, [])
        known = {eid for eid, _ in log}
        log.extend(
            (e, msgspec.json.encode(i)) for e, i in zip(ids, items, strict=True) if e not in known
        )
        self.ws_frames += 1
        if without:
            await ws.send_json({"frame": 1, "status": 503, "error": "busy", "ids": ids})
        else:
            await ws.send_json({"frame": 1, "accepted": len(ids), "ids": ids})
        await ws.close()
        return ws


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[tuple[str, FakeCollector]]:
    fc = FakeCollector()
    app = web.Application(client_max_size=16 << 20)
    app.router.add_post("/v1/streams/{stream}/events", fc.post)
    app.router.add_get("/v1/streams/{stream}/ws", fc.ws)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", fc
    finally:
        await runner.cleanup()


async def test_producers_without_ids_resend_under_the_ids_an_error_gave(
    fake: tuple[str, FakeCollector],
) -> None:
    """After a 503 carrying ids the resend reuses them (one copy); after no answer the
    resend is blind (a second copy the verdict explains); refusals stay refused."""
    url, fc = fake
    plan = [
        Planned("s1", {"u": "a"}, None),
        Planned("s1", {"u": "b"}, "x-1"),
        Planned("s2", {"u": "c"}, None),
        Planned("s2", {"u": "d"}, "", INVALID),
        Planned("s2", {"u": "e"}, "x-1"),  # the same id on another stream
    ]
    rep = await drive_mixed(url, plan, batch=2, concurrency=1, deadline_s=60)
    assert rep.expected == 4 and len(rep.acknowledged) == 4
    assert rep.adopted == 1 and rep.errors == 1
    assert rep.blind == {"s2": {plan[2].digest: 1}}
    assert rep.rejected == {400: 1} and not rep.wrongly_accepted and not rep.wrongly_refused
    from cluster.verify import payload_digest

    stored = {s: [(i, payload_digest(b)) for i, b in log] for s, log in fc.stored.items()}
    verdicts = judge_streams(rep.acked, stored, refused=rep.refused_digests, blind=rep.blind)
    assert all(v.ok for v in verdicts.values()), {s: str(v) for s, v in verdicts.items()}
    assert verdicts["s1"].stored == 2  # the 503's ids were reused: no second copy
    assert verdicts["s2"].stored == 3 and verdicts["s2"].blind_duplicates == 1
    # had the producer resent the 503'd event under a fresh id, that is a duplicate:
    dup = {**stored, "s1": [*stored["s1"], ("srv-99", plan[0].digest)]}
    assert not judge_streams(rep.acked, dup, blind=rep.blind)["s1"].ok


@pytest.mark.parametrize("kind", [OVERSIZED, INVALID])
async def test_a_refusal_accepted_is_reported(fake: tuple[str, FakeCollector], kind: str) -> None:
    url, _ = fake
    rep = await drive_mixed(url, [Planned("s1", {"u": "z"}, "fine-id", kind)], deadline_s=30)
    assert rep.wrongly_accepted == [f"s1/{kind}/fine-id"]


async def test_producer_websocket_frames_adopt_the_ids_of_a_503(
    fake: tuple[str, FakeCollector],
) -> None:
    """Every request of valid events as a WebSocket frame: the 503 answer's ids are
    reused by the resend, so each event is stored once."""
    url, fc = fake
    plan = [Planned("s1", {"u": "a"}, None), Planned("s1", {"u": "b"}, "w-1")]
    rep = await drive_mixed(url, plan, batch=2, concurrency=1, deadline_s=60, ws_every=1)
    assert rep.ws_requests == 1 and fc.ws_frames == 2 and fc.no_id_requests == 0
    assert rep.adopted == 1 and rep.retried == {503: 1} and len(rep.acknowledged) == 2
    from cluster.verify import payload_digest

    stored = [(i, payload_digest(b)) for i, b in fc.stored["s1"]]
    assert len(stored) == 2 and judge_streams(rep.acked, {"s1": stored})["s1"].ok
