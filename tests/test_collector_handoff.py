"""Background hand-offs to the bridge: few calls at once, each taking every batch waiting.

Unit test of `BridgeHandoff.handoff` with the bridge call faked (no Ray, no HTTP).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from actors.collection.handoff import BridgeHandoff
from runtime.data.events import Event


def _events(tag: str, n: int) -> list[Event]:
    return [Event(f"{tag}-{i}", "s", "raw.s", b"{}", 0) for i in range(n)]


class _FakeBridge(BridgeHandoff):
    """Records each call's ids and the most calls at once; a call takes 10 ms."""

    def __init__(self, max_bridge_calls: int, max_handoff_calls: int) -> None:
        super().__init__(
            ["bridge-0"],
            namespace="test",
            logger_name="logger-0",
            counters={"handoffs": 0, "bridge_errors": 0, "handoffs_deferred": 0},
            max_bridge_calls=max_bridge_calls,
            max_handoff_calls=max_handoff_calls,
        )
        self.calls: list[list[str]] = []
        self.now = 0
        self.peak = 0

    async def call(self, events: list[Event], *, detail: bool = True) -> dict[str, Any] | None:
        assert not detail  # a hand-off reads no per-id answer
        self.now += 1
        self.peak = max(self.peak, self.now)
        self.calls.append([e.id for e in events])
        await asyncio.sleep(0.01)
        self.now -= 1
        return {"failed": []}


@pytest.mark.unit
@pytest.mark.parametrize(("handoff_calls", "peak"), [(2, 2), (1, 1), (8, 4)])
async def test_handoffs_use_at_most_max_handoff_calls_and_lose_nothing(
    handoff_calls: int, peak: int
) -> None:
    bridge = _FakeBridge(max_bridge_calls=4, max_handoff_calls=handoff_calls)
    calls = bridge.calls
    sent = [_events(f"b{b}", 100) for b in range(40)]
    for batch in sent:  # a request answered every 2 ms; a bridge call takes 10 ms
        bridge.handoff(batch)
        await asyncio.sleep(0.002)
    await asyncio.wait_for(bridge.drain(), 10)
    assert not bridge.tasks and bridge.waiting_events == 0 and bridge.senders == 0
    assert bridge.peak == peak  # never more calls at once than allowed (nor the slots)
    ids = [i for call in calls for i in call]
    assert sorted(ids) == sorted(e.id for batch in sent for e in batch)  # each once
    assert len(ids) == len(set(ids))
    if peak == 1:  # one sender: calls go out in hand-off order, batches joined
        assert ids == [e.id for batch in sent for e in batch]
        assert len(calls) < len(sent)
