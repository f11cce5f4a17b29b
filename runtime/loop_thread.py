"""A data-plane event loop on its own thread, started from an actor's `__init__`.

Ray reruns `__init__` on restart, so an actor that starts its servers and background
loops there serves again after a crash with no outside call. Running them on their own
loop also keeps data-plane work from queueing Ray's control calls (heartbeats, stats,
scaling) behind it. Ray methods hand work to this loop with `call` / `run`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """Runs `main(stop_event)` on a fresh event loop in a daemon thread.

    `main` sets things up, calls `ready()` once it serves, then waits on `stop_event`
    and cleans up. `start` returns when `ready()` was called (or raises what `main`
    raised before that), so an actor's `__init__` fails loudly on a bind error.
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
        main: Callable[[asyncio.Event, Callable[[], None]], Awaitable[None]],
        timeout: float = 30.0,
    ) -> None:
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
        if self._error is not None:
            raise RuntimeError(f"{self.name}: {self._error}") from self._error

    def call(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        assert self.loop is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await `coro` on the data-plane loop from another loop (a Ray async method)."""
        return await asyncio.wrap_future(self.call(coro))

    def stop(self, timeout: float = 30.0) -> bool:
        """Set the stop event and wait for `main` to finish its cleanup."""
        if self.loop is not None and self._stop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True
