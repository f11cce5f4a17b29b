"""Bounded waiting on a condition: the one polling loop for the runtime and its tests.

Every wait in tierflow has a deadline (a loop that could spin forever is a bug), and
tests wait on conditions rather than sleeping and hoping.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

from runtime.errors import TierflowError

T = TypeVar("T")


class WaitTimeout(TierflowError, TimeoutError):
    """The condition did not hold before the deadline.

    A TimeoutError, not an AssertionError: product code waits too. A test that lets it
    propagate still fails with its message; code that expects to run out of time catches
    `WaitTimeout`.
    """


def _probe(pred: Callable[[], T], swallow: bool) -> tuple[T | None, BaseException | None]:
    try:
        return pred(), None
    except Exception as err:
        if not swallow:
            raise
        return None, err


def _timeout(what: str, timeout: float, last: BaseException | None) -> WaitTimeout:
    tail = f" (last error: {last!r})" if last else ""
    return WaitTimeout(f"{what or 'condition'} not met within {timeout} s{tail}")


def poll(
    pred: Callable[[], T],
    timeout: float,
    interval: float = 0.05,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    on_tick: Callable[[], None] | None = None,
) -> T | None:
    """Poll `pred` until truthy; return its value, or None at the deadline.

    `on_tick` runs before each probe and may raise to abort early (a process that died).
    """
    deadline = clock() + timeout
    while True:
        if on_tick is not None:
            on_tick()
        value = pred()
        if value:
            return value
        if clock() >= deadline:
            return None
        sleep(interval)


def wait_until(
    pred: Callable[[], T],
    timeout: float = 30.0,
    interval: float = 0.05,
    what: str = "",
    *,
    swallow: bool = False,
) -> T:
    """Poll `pred` until truthy and return its value; raise WaitTimeout at the deadline.

    With `swallow`, an exception from `pred` counts as "not yet" (an actor not yet
    registered, a server not yet listening) and is named in the timeout message.
    """
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        value, err = _probe(pred, swallow)
        last = err or last
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timeout(what, timeout, last)
        time.sleep(interval)


async def await_until(
    pred: Callable[[], Any],
    timeout: float = 30.0,
    interval: float = 0.05,
    what: str = "",
    *,
    swallow: bool = False,
) -> Any:
    """`wait_until` for the event loop: `pred` may be sync or return an awaitable."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        value, err = _probe(pred, swallow)
        if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
            try:
                value = await value
            except Exception as exc:
                if not swallow:
                    raise
                value, err = None, exc
        last = err or last
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timeout(what, timeout, last)
        await asyncio.sleep(interval)
