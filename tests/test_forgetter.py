"""Forgetter (acked keys forgotten off the publish path), the bridge hand-off group commit
(`take_batches`) and the atomic-batch rule (`atomic_batches_enabled`): pure units, with a
fake logger group's `forget`."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.collection.group_commit import take_batches
from actors.queue.forgetter import Forgetter
from runtime.config import atomic_batches_enabled, load
from runtime.data.events import Event


class FakeGroup:
    """Records forget calls; can be made to refuse a number of calls, or to hold each call
    until released (to see what a call in flight lets pile up)."""

    def __init__(self, refuse: int = 0, hold: bool = False) -> None:
        self.calls: list[tuple[list[Any], dict[Any, Any]]] = []
        self.refuse = refuse
        self.gate = asyncio.Event()
        if not hold:
            self.gate.set()

    async def forget(self, keys: list[Any], seqs: dict[Any, Any]) -> None:
        await self.gate.wait()
        if self.refuse > 0:
            self.refuse -= 1
            raise RuntimeError("log unavailable")
        self.calls.append((list(keys), dict(seqs)))


def keys(n: int, start: int = 0) -> list[tuple[str, str]]:
    return [("s", f"e{i}") for i in range(start, start + n)]


async def no_sleep(_: float) -> None:
    return None


async def test_keys_added_while_a_forget_is_in_flight_go_together_in_the_next() -> None:
    group = FakeGroup(hold=True)
    f = Forgetter(group.forget, max_keys=1000, max_pending=1000, linger_s=0)
    await f.add(keys(3), {k: ("S", i + 1) for i, k in enumerate(keys(3))})
    await asyncio.sleep(0)  # the first forget is now in flight, held
    for i in range(5):
        await f.add(keys(10, 3 + 10 * i))
    assert f.pending == 53
    group.gate.set()
    await asyncio.wait_for(f.flush(), 5)
    assert [len(k) for k, _ in group.calls] == [3, 50]  # one call for the five adds
    assert group.calls[0][1] == {
        ("s", "e0"): ("S", 1),
        ("s", "e1"): ("S", 2),
        ("s", "e2"): ("S", 3),
    }
    assert [k for c, _ in group.calls for k in c] == keys(53)  # each once, in order
    assert f.pending == 0 and f.forgotten == 53


async def calls_reach(group: FakeGroup, n: int, timeout: float = 5.0) -> None:
    """Bounded wait until the fake group has taken `n` forget calls."""
    async with asyncio.timeout(timeout):
        while len(group.calls) < n:
            await asyncio.sleep(0.001)


async def test_a_forget_waits_for_min_keys_then_goes_at_once() -> None:
    group = FakeGroup()
    f = Forgetter(group.forget, min_keys=30, linger_s=3600)  # only the size can send it
    for i in range(2):
        await f.add(keys(10, 10 * i))
        for _ in range(5):  # let the sender run: it lingers, below min_keys
            await asyncio.sleep(0)
        assert group.calls == []
    await f.add(keys(10, 20))  # 30 waiting: sent without waiting out the linger
    await calls_reach(group, 1)
    assert [len(k) for k, _ in group.calls] == [30]  # one call for the three adds
    assert f.pending == 0 and f.forgotten == 30


async def test_a_forget_below_min_keys_goes_once_its_oldest_key_lingered() -> None:
    group = FakeGroup()
    f = Forgetter(group.forget, min_keys=10_000, linger_s=0.02)
    await f.add(keys(5))
    await f.add(keys(5, 5))
    await calls_reach(group, 1)  # sent by the time bound, never reaching min_keys
    assert group.calls == [(keys(10), {})] and f.pending == 0


async def test_flush_cuts_the_linger_short() -> None:
    group = FakeGroup()
    f = Forgetter(group.forget, min_keys=10_000, linger_s=3600)
    await f.add(keys(4))
    await asyncio.sleep(0)  # the sender is lingering
    await asyncio.wait_for(f.flush(), 5)  # would take an hour if flush lingered
    assert group.calls == [(keys(4), {})]
    await f.add(keys(2, 4))  # lingers again once the flush is over
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(group.calls) == 1 and f.pending == 2
    f.cancel()


def test_linger_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="linger_s"):
        Forgetter(FakeGroup().forget, linger_s=-1)


async def test_only_added_keys_are_forgotten_and_nothing_before_add() -> None:
    group = FakeGroup()
    f = Forgetter(group.forget)
    await f.flush()  # nothing added: returns at once, forgets nothing
    assert group.calls == []
    await f.add(keys(2))
    await asyncio.wait_for(f.flush(), 5)
    assert group.calls == [(keys(2), {})]


async def test_a_refused_forget_is_retried_until_taken() -> None:
    group = FakeGroup(refuse=2)
    f = Forgetter(group.forget, attempts=4, sleep=no_sleep)
    await f.add(keys(7))
    await asyncio.wait_for(f.flush(), 5)
    assert [k for c, _ in group.calls for k in c] == keys(7)
    assert f.errors == 2 and f.left == 0 and f.forgotten == 7


async def test_past_its_attempts_a_forget_is_left_to_the_replayer_and_later_keys_go_on() -> None:
    group = FakeGroup(refuse=3)
    f = Forgetter(group.forget, attempts=3, sleep=no_sleep)
    await f.add(keys(4))
    await asyncio.wait_for(f.flush(), 5)
    assert group.calls == [] and f.left == 4  # still logged: resent, acked as duplicates
    await f.add(keys(2, 10))
    await asyncio.wait_for(f.flush(), 5)
    assert group.calls == [(keys(2, 10), {})]


async def test_calls_are_cut_at_max_keys_and_add_waits_for_room() -> None:
    group = FakeGroup(hold=True)
    f = Forgetter(group.forget, max_keys=10, max_pending=20)
    await f.add(keys(10))
    await asyncio.sleep(0)  # 10 in flight (held), none waiting
    await f.add(keys(20, 10))  # fills the waiting room
    blocked = asyncio.ensure_future(f.add(keys(5, 30)))
    await asyncio.sleep(0.01)
    assert not blocked.done()  # over max_pending: waits
    group.gate.set()
    await asyncio.wait_for(blocked, 5)
    await asyncio.wait_for(f.flush(), 5)
    assert all(len(k) <= 10 for k, _ in group.calls)
    assert [k for c, _ in group.calls for k in c] == keys(35)


def ev(i: int) -> Event:
    return Event(f"e{i}", "s", "raw.s", b"{}", 0)


@given(st.lists(st.integers(1, 30), max_size=20), st.integers(1, 60))
def test_take_batches_keeps_order_and_whole_batches(sizes: list[int], limit: int) -> None:
    n = 0
    waiting: deque[list[Event]] = deque()
    for size in sizes:
        waiting.append([ev(n + j) for j in range(size)])
        n += size
    taken: list[list[Event]] = []
    for _ in range(len(sizes) + 1):  # bounded: each take empties at least one batch
        if not waiting:
            break
        first = len(waiting[0])
        call = take_batches(waiting, limit)
        assert len(call) <= max(limit, first)  # the first batch always, however big
        taken.append(call)
    assert not waiting
    assert [e.id for call in taken for e in call] == [f"e{i}" for i in range(n)]


@pytest.mark.parametrize(
    ("setting", "sync", "on"),
    [
        ("auto", "always", True),
        ("auto", "2m", False),
        ("auto", "100ms", False),
        ("on", "2m", True),
        ("off", "always", False),
    ],
)
def test_atomic_batches_auto_rule(setting: str, sync: str, on: bool) -> None:
    assert atomic_batches_enabled(setting, sync) is on


def test_atomic_batches_setting_is_validated() -> None:
    assert load(environ={}).nats.atomic_batches == "auto"
    assert load(environ={"TIERFLOW_NATS__ATOMIC_BATCHES": "off"}).nats.atomic_batches == "off"
    with pytest.raises(Exception, match="atomic_batches"):
        load(environ={}, overrides={"nats": {"atomic_batches": "sometimes"}})
    with pytest.raises(ValueError):
        atomic_batches_enabled("sometimes", "always")
