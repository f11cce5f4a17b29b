"""The bridge's parts without Ray or NATS: the data path (`BridgePath`) from a logged batch
to its completion in a fake logger group, the `Replayer`'s passes and heals, and the
`stats` answer's keys.

The real publisher, logger and server are exercised by test_bridge_retries.py,
test_bridge_streams.py and the tier tests; these pin the wiring between the parts: HML
logic after logging, acks forgotten only through the `Forgetter` and only after the
publisher reported them, failures in the failed store before the call returns, the same
counters.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from actors.queue.bridge_link import NatsLink
from actors.queue.bridge_path import PARKED, BridgePath, dead_letter_id
from actors.queue.bridge_status import COUNTERS, bridge_stats, new_counters
from actors.queue.replayer import HEAL_EVERY, Replayer
from runtime.clock import now_ms
from runtime.config import validate
from runtime.data.events import Event
from runtime.nats.publisher import Failed, Outgoing, Published

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

CONFIG = {
    "streams": {
        "s": {"subjects": ["raw.s"], "logic": {"validate": {"n": "int"}, "filter": "n > 0"}},
    }
}


class FakeNc:
    is_connected = True
    max_payload = 1 << 20


class FakePub:
    """Stores what it is given; `refuse` ids fail (retryable unless listed in `poison`)."""

    def __init__(self, refuse: set[str] = frozenset(), poison: set[str] = frozenset()) -> None:
        self.refuse, self.poison = set(refuse), set(poison)
        self.atomic: list[tuple[str | None, list[str]]] = []
        self.each: list[Outgoing] = []
        self.seq = 0

    def _outcomes(self, items: Sequence[Outgoing], stream: str) -> tuple[list, list]:
        ok: list[Published] = []
        bad: list[Failed] = []
        for o in items:
            if o.id in self.refuse or o.id in self.poison:
                bad.append(Failed(o.id, "refused", o.id not in self.poison))
            else:
                self.seq += 1
                ok.append(Published(o.id, stream, self.seq, False))
        return ok, bad

    async def publish_atomic(self, items: Sequence[Outgoing], *, stream: str) -> tuple:
        self.atomic.append((stream, [o.id for o in items]))
        return self._outcomes(items, stream)

    async def publish_batch(self, items: Sequence[Outgoing]) -> tuple:
        self.each.extend(items)
        return self._outcomes(items, "deadletter")


class FakeGroup:
    def __init__(self, name: str = "g", entries: Sequence[Event] = ()) -> None:
        self.name = name
        self.entries = list(entries)
        self.forgotten: list[tuple[str, str]] = []
        self.failed: list[tuple[str, str, bool]] = []
        self.heals = 0

    async def forget(self, keys: Sequence[tuple[str, str]], seqs: Any) -> None:
        self.forgotten += [tuple(k) for k in keys]

    async def fail(self, items: Sequence[tuple[Event, str]], now: int, park: bool = False) -> None:
        self.failed += [(e.id, err, park) for e, err in items]

    async def pending(self, older_than_ms: int, now: int, limit: int) -> list[Event]:
        taken, self.entries = self.entries[:limit], self.entries[limit:]
        return taken

    async def due_failed(self, now: int, limit: int) -> list[Event]:
        return []

    async def heal(self) -> dict[int, int]:
        self.heals += 1
        return {}


def path_with(pub: FakePub) -> BridgePath:
    cfg = validate(CONFIG)
    link = NatsLink(cfg, "nats://unused", name="test-bridge", counters=new_counters())
    link.pub, link.nc = pub, FakeNc()  # type: ignore[assignment]
    now = asyncio.get_running_loop().time()
    link._targets = {
        "raw.s": ("s", 120.0, now),
        "deadletter.s": ("deadletter", 120.0, now),
    }
    path = BridgePath(cfg, link, link.counters)
    path.atomic = True
    return path


def ev(id_: str, body: bytes, *, processed: bool = False) -> Event:
    return Event(id_, "s", "raw.s", body, now_ms(), processed=processed)


async def test_a_logged_batch_runs_the_logic_publishes_and_completes_in_the_log() -> None:
    pub = FakePub()
    path = path_with(pub)
    group = FakeGroup()
    batch = [
        ev("done", b'{"n": 1}', processed=True),  # the collector ran the logic
        ev("raw", b'{"n": 2}'),  # HML: logged before its logic
        ev("dropped", b'{"n": 0}'),  # the filter drops it
        ev("invalid", b'{"x": 1}'),  # dead-lettered
    ]
    answer = await path.run(group, batch)  # type: ignore[arg-type]
    assert set(answer["published"]) == {"done", "raw"}
    assert answer["failed"] == {} and answer["deadlettered"] == {}  # logic rejects: not asked
    assert pub.atomic == [("s", ["done", "raw"])]  # one atomic batch, in order
    (record,) = pub.each
    assert record.id == dead_letter_id("s", "invalid") and record.subject == "deadletter.s"
    assert "missing field n" in record.headers["Tf-Error"]
    # dropped and dead-lettered are forgotten on the path; acks through the Forgetter
    assert ("s", "dropped") in group.forgotten and ("s", "invalid") in group.forgotten
    await path.flush_forgets()
    assert {("s", "done"), ("s", "raw")} <= set(group.forgotten)
    c = path.counters
    assert (c["published"], c["dropped"], c["deadlettered"], c["failed"]) == (2, 1, 1, 0)


async def test_failures_reach_the_failed_store_before_the_call_returns() -> None:
    pub = FakePub(refuse={"b"}, poison={"c"})
    path = path_with(pub)
    group = FakeGroup()
    batch = [ev(i, b'{"n": 1}', processed=True) for i in ("a", "b", "c")]
    answer = await path.run(group, batch, detail=False)  # type: ignore[arg-type]
    assert answer == {"published": 1, "failed": 1, "deadlettered": 1}
    assert ("b", "refused", False) in group.failed  # retryable: the replayer resends it
    await path.flush_forgets()
    assert ("s", "a") in group.forgotten and ("s", "b") not in group.forgotten
    assert path.counters["failed"] == 2  # the retryable one and the poison one


async def test_past_the_horizon_with_no_stream_answering_stays_failed_unsent() -> None:
    pub = FakePub()
    path = path_with(pub)
    path.link._targets.clear()
    path.link.nc.is_connected = False  # no lookup possible: the smallest window counts
    group = FakeGroup()
    old = Event("old", "s", "raw.s", b'{"n": 1}', now_ms() - 3_600_000, processed=True)
    answer = await path.run(group, [old])  # type: ignore[arg-type]
    assert "past the blind-retry horizon" in answer["failed"]["old"]
    assert pub.atomic == [] and pub.each == []  # nothing of it sent
    assert [f[0] for f in group.failed] == ["old"] and not group.failed[0][2]
    assert not group.failed[0][1].startswith(PARKED)


async def test_replay_passes_carry_on_past_a_broken_group_and_heal_every_fifth() -> None:
    pub = FakePub()
    path = path_with(pub)
    good = FakeGroup("good", [ev("o1", b'{"n": 1}'), ev("o2", b'{"n": 2}')])

    class Broken(FakeGroup):
        async def pending(self, *args: Any) -> list[Event]:
            raise RuntimeError("down")

    broken = Broken("broken")
    counters = path.counters
    groups: dict[str, Any] = {"broken": broken, "good": good}
    replayer = Replayer(path, groups, counters, name="t", every_s=0.0, batch=10)
    assert await replayer.replay_once() == 2
    assert counters["replayed"] == 2 and counters["replay_errors"] == 1
    task = asyncio.ensure_future(replayer.run())
    try:
        for _ in range(200):  # bounded: a few passes
            if counters["replay_errors"] > 1 + HEAL_EVERY:
                break
            await asyncio.sleep(0.001)
    finally:
        task.cancel()
    passes = counters["replay_errors"] - 1
    assert good.heals >= 2 and good.heals == broken.heals
    assert good.heals <= passes // HEAL_EVERY + 1


def test_stats_answer_keeps_its_keys() -> None:
    stats = bridge_stats(new_counters(), None, atomic=True, forgetters=[], loggers={"b", "a"})
    assert list(stats)[: len(COUNTERS)] == list(COUNTERS)
    assert set(stats) - set(COUNTERS) == {
        "in_flight",
        "ack_p50_ms",
        "ack_p99_ms",
        "atomic_batches",
        "forgets_pending",
        "forget_calls",
        "forget_errors",
        "forgets_left",
        "loggers",
    }
    assert stats["loggers"] == ["a", "b"] and stats["in_flight"] == 0
    assert COUNTERS == (
        "batches",
        "published",
        "duplicates",
        "failed",
        "replayed",
        "deadlettered",
        "dropped",
        "reconnects",
        "verified",
        "found_stored",
        "unverified",
        "parked",
        "replay_errors",
    )
