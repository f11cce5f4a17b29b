"""runtime/loop_thread.py: a loop thread with no `main` serving sync callers (`run_sync`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

import pytest

from runtime.loop_thread import LoopThread

pytestmark = pytest.mark.unit


def test_run_sync_runs_on_the_loop_thread_which_keeps_running_between_calls() -> None:
    lt = LoopThread("test-serve")
    lt.start()
    try:

        async def where() -> str:
            return threading.current_thread().name

        assert lt.run_sync(where(), 5.0) == "test-serve"
        ticks: list[int] = []

        async def tick() -> None:  # a background task, like a client's pings
            while True:
                ticks.append(1)
                await asyncio.sleep(0.01)

        task = lt.run_sync(_spawn(tick()), 5.0)
        done = threading.Event()
        assert lt.loop is not None
        lt.loop.call_later(0.2, done.set)
        assert done.wait(5.0)  # no caller was waiting meanwhile, and the loop ran on
        assert len(ticks) > 3
        task.cancel()
    finally:
        assert lt.stop(5.0)


def test_run_sync_cancels_and_raises_at_its_timeout() -> None:
    lt = LoopThread("test-timeout")
    lt.start()
    cancelled = threading.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    try:
        with pytest.raises(TimeoutError):
            lt.run_sync(slow(), 0.2)
        assert cancelled.wait(5.0)

        async def fails() -> None:
            raise KeyError("x")

        with pytest.raises(KeyError):
            lt.run_sync(fails(), 5.0)
    finally:
        assert lt.stop(5.0)


async def _spawn(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    return asyncio.get_running_loop().create_task(coro)
