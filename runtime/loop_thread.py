"""A data-plane event loop on its own thread, started from an actor's `__init__`.

Ray reruns `__init__` on restart, so an actor that starts its servers and background
loops there serves again after a crash with no outside call. Running them on their own
loop also keeps data-plane work from queueing Ray's control calls (heartbeats, stats,
scaling) behind it. Ray methods hand work to this loop with `call` / `run`.

Sync code that drives an async client (the Spark source's readers) starts one with no
`main`: the loop then only runs what it is handed, and `run_sync` blocks for the answer.
The loop keeps running between calls, so the client answers pings and buffers what it
reads next.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from runtime.errors import TierflowError

T = TypeVar("T")


class LoopThread:
    """Runs `main(stop_event)` on a fresh event loop in a daemon thread.

    `main` sets things up, calls `ready()` once it serves, then waits on `stop_event`
    and cleans up. `start` returns when `ready()` was called (or raises what `main`
    raised before that: a `TierflowError` as it is, since it says what happened, anything
    else as a RuntimeError naming the thread), so an actor's `__init__` fails loudly on a
    bind error, and a taken port as `runtime.binding.PortTakenError`.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(
        self,
        main: Callable[[asyncio.Event, Callable[[], None]], Awaitable[None]] | None = None,
        timeout: float = 30.0,
    ) -> None:
        """Start the thread; with no `main` the loop serves `call` / `run_sync` until `stop`."""
        main = main or _serve_until_stopped

        def run() -> None:
            async def body() -> None:
                self.loop = asyncio.get_running_loop()
                self._stop = asyncio.Event()
                await main(self._stop, self._ready.set)

            try:
                asyncio.run(body())
            except BaseException as err:
                self._error = err
                self._ready.set()

        self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError(f"{self.name}: did not start within {timeout} s")
        if isinstance(self._error, TierflowError):
            raise self._error
        if self._error is not None:
            raise RuntimeError(f"{self.name}: {self._error}") from self._error

    def call(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        assert self.loop is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on the data-plane loop from another loop (a Ray async method)."""
        return await asyncio.wrap_future(self.call(coro))

    def run_sync(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Block this thread (never the loop's own) until `coro`, run on the loop, returns;
        after `timeout` s (None: no limit) it is cancelled and TimeoutError raised."""
        fut = self.call(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def stop(self, timeout: float = 30.0) -> bool:
        """Set the stop event and wait for `main` to finish its cleanup."""
        if self.loop is not None and self._stop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True


async def _serve_until_stopped(stop: asyncio.Event, ready: Callable[[], None]) -> None:
    """The `main` of a loop that only runs the coroutines handed to it."""
    ready()
    await stop.wait()
