"""Background hand-offs to the bridge: few calls at once, each taking every batch waiting.

Unit test of `Collector._handoff` with the bridge call faked (no Ray, no HTTP): the
collector object is built without its `__init__`, which would start the data plane.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import pytest

from actors.collection.collector import Collector
from runtime.events import Event


def _events(tag: str, n: int) -> list[Event]:
    return [Event(f"{tag}-{i}", "s", "raw.s", b"{}", 0) for i in range(n)]


def _collector(max_bridge_calls: int, max_handoff_calls: int) -> tuple[Collector, list[Any]]:
    c = Collector.__new__(Collector)
    c._max_bridge_calls = max_bridge_calls
    c._max_handoff_calls = max(1, min(max_handoff_calls, max_bridge_calls))
    c.max_call_events = 4000
    c.max_handoff_events = 50_000
    c._handoffs = deque()
    c._handoff_senders = 0
    c._handoff_events = 0
    c.counters = {"handoffs_deferred": 0}
    c._background = set()
    calls: list[Any] = []
    state = {"now": 0, "peak": 0}

    async def call_bridge(events: list[Event], *, detail: bool = True) -> dict[str, Any]:
        assert not detail  # a hand-off reads no per-id answer
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        calls.append([e.id for e in events])
        await asyncio.sleep(0.01)
        state["now"] -= 1
        return {"failed": []}

    c._call_bridge = call_bridge  # type: ignore[method-assign]
    c._bridge_slots = asyncio.Semaphore(max_bridge_calls)
    calls.append(state)
    return c, calls


@pytest.mark.unit
@pytest.mark.parametrize(("handoff_calls", "peak"), [(2, 2), (1, 1), (8, 4)])
async def test_handoffs_use_at_most_max_handoff_calls_and_lose_nothing(
    handoff_calls: int, peak: int
) -> None:
    c, calls = _collector(max_bridge_calls=4, max_handoff_calls=handoff_calls)
    state = calls.pop(0)
    sent = [_events(f"b{b}", 100) for b in range(40)]
    for batch in sent:  # a request answered every 2 ms; a bridge call takes 10 ms
        c._handoff(batch)
        await asyncio.sleep(0.002)
    await asyncio.wait_for(asyncio.gather(*list(c._background)), 10)
    assert not c._background and c._handoff_events == 0 and c._handoff_senders == 0
    assert state["peak"] == peak  # never more calls at once than allowed (nor the slots)
    ids = [i for call in calls for i in call]
    assert sorted(ids) == sorted(e.id for batch in sent for e in batch)  # each once
    assert len(ids) == len(set(ids))
    if peak == 1:  # one sender: calls go out in hand-off order, batches joined
        assert ids == [e.id for batch in sent for e in batch]
        assert len(calls) < len(sent)
