"""`LogWriter`: the pykka actor that owns a replica's `LogStore`, and `WriterClient`.

Blocking LevelDB work runs on the writer's thread, off the Ray actor's event loop; a
`LocalSupervisor` restarts the writer (reopening the store) when a store call fails.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pykka

from actors.queue.logger.errors import LogUnavailable
from actors.queue.logger.store import LogStore
from runtime.state.checkpoint import CheckpointError
from runtime.supervision.local import LocalSupervisor, Supervised
from runtime.supervision.policy import Backoff, ChildSpec, Intensity
from runtime.waiting import poll

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WriterOp:
    """A LogStore call for the writer thread: `getattr(store, method)(*args)`."""

    method: str
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class _Crash:
    reason: str


class WakingFuture(pykka.ThreadingFuture[Any]):
    """The writer's answer: a pykka future that also calls a waker once it is set (value,
    error, or pykka's ActorDeadError for a message a dying writer never handled), so an
    asyncio caller can await it without a thread blocked in `get`."""

    def __init__(self) -> None:
        super().__init__()
        self._wake_lock = threading.Lock()
        self._waker: Callable[[], None] | None = None
        self._is_set = False

    def set(self, value: Any | None = None) -> None:
        super().set(value)
        self._fire()

    def set_exception(self, exc_info: Any = None) -> None:
        super().set_exception(exc_info if exc_info is not None else sys.exc_info())
        self._fire()

    def _fire(self) -> None:
        with self._wake_lock:
            self._is_set = True
            waker = self._waker
        if waker is not None:
            waker()

    def when_set(self, waker: Callable[[], None]) -> None:
        """Call `waker` (from the setting thread, or here if already set) exactly once."""
        with self._wake_lock:
            self._waker = waker
            done = self._is_set
        if done:
            waker()


_WRITER_METHODS = frozenset(
    {
        "append",
        "parked",
        "parked_count",
        "settle",
        "forget",
        "fail",
        "import_",
        "put_meta",
        "get_meta",
        "reset",
        "pending",
        "due_failed",
        "failed_entry",
        "where",
        "token_status",
        "counts",
        "scan_counts",
        "export",
        "entry_keys",
        "holds",
        "describe",
    }
)


class LogWriter(Supervised, pykka.ThreadingActor):
    """Owns one LogStore; every LevelDB call of a replica runs on this actor's thread.

    Answers come back on the caller's future (LogFull, bad input). A store failure
    (`CheckpointError`) also makes the actor crash right after answering, so its
    `LocalSupervisor` starts a new one that reopens the store from disk.
    """

    @staticmethod
    def _create_future() -> WakingFuture:  # pykka's hook for an actor type's futures
        return WakingFuture()

    def __init__(self, path: str, store_kwargs: Mapping[str, Any]) -> None:
        super().__init__()
        self.store = LogStore(path, **dict(store_kwargs))  # opened here: a failed open is a
        # failed start the supervisor retries with backoff

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, _Crash):
            raise RuntimeError(f"log writer crashed: {message.reason}")
        if not isinstance(message, WriterOp) or message.method not in _WRITER_METHODS:
            raise ValueError(f"log writer cannot run {message!r}")
        try:
            return getattr(self.store, message.method)(*message.args)
        except CheckpointError as exc:
            self.actor_ref.tell(_Crash(repr(exc)))
            raise

    def on_stop(self) -> None:
        self.store.close()
        super().on_stop()

    def on_failure(self, exception_type: Any, exception_value: Any, traceback: Any) -> None:
        self.store.close()  # release the LOCK before the replacement opens it
        super().on_failure(exception_type, exception_value, traceback)


class WriterClient:
    """A supervised LogWriter and the way to reach its current incarnation.

    Calls are retried on a new incarnation when the old one died before handling them
    (pykka answers those with ActorDeadError, so nothing of them was applied).
    """

    CHILD = "writer"

    def __init__(
        self,
        path: str | os.PathLike[str],
        store_kwargs: Mapping[str, Any],
        *,
        label: str = "",
        on_escalate: Callable[[str], None] | None = None,
        intensity: Intensity = Intensity(5, 10.0),  # noqa: B008 - frozen value
        backoff: Backoff = Backoff(base_s=0.05, cap_s=2.0),  # noqa: B008 - frozen value
        sweep_interval_s: float = 1.0,
    ) -> None:
        self.label = label or str(path)
        self.escalated: str | None = None
        self._on_escalate = on_escalate
        spec = ChildSpec(self.CHILD, LogWriter, args=(str(path), dict(store_kwargs)))
        self.supervisor = LocalSupervisor.start(
            [spec],
            intensity=intensity,
            backoff=backoff,
            on_escalate=self._escalate,
            sweep_interval_s=sweep_interval_s,
        )
        self._sup = self.supervisor.proxy()
        self._ref: pykka.ActorRef[Any] | None = None

    def _escalate(self, reason: str) -> None:
        self.escalated = reason
        log.error("log writer %s escalated: %s", self.label, reason)
        if self._on_escalate is not None:
            self._on_escalate(reason)

    def cached(self) -> pykka.ActorRef[Any] | None:
        """The current writer if it is known and alive, without blocking."""
        ref = self._ref
        return ref if ref is not None and ref.is_alive() else None

    def current(self, timeout: float) -> pykka.ActorRef[Any]:
        """The live writer, waiting (bounded) while the supervisor restarts it. Blocking."""
        ref = self.cached()
        if ref is not None:
            return ref

        def probe() -> pykka.ActorRef[Any] | None:
            if self.escalated is not None:
                raise LogUnavailable(self.label, f"log writer gave up: {self.escalated}")
            try:
                child = self._sup.get_child(self.CHILD).get(timeout=timeout)
            except pykka.ActorDeadError:
                raise LogUnavailable(self.label, "log writer supervisor stopped") from None
            return child if child is not None and child.is_alive() else None

        ref = poll(probe, timeout)
        if ref is None:
            raise LogUnavailable(self.label, f"log writer not back within {timeout}s")
        self._ref = ref
        return ref

    def call(self, method: str, *args: Any, timeout: float = 30.0, attempts: int = 5) -> Any:
        """Run one store call and wait for it. Blocking: for `__init__` and tests."""
        for _ in range(attempts):
            ref = self.current(timeout)
            try:
                return ref.ask(WriterOp(method, args), timeout=timeout)
            except pykka.ActorDeadError:
                self._ref = None
        raise LogUnavailable(self.label, f"log writer kept dying ({attempts} attempts)")

    def stop(self, timeout: float = 10.0) -> None:
        with contextlib.suppress(pykka.ActorDeadError):
            self.supervisor.stop(block=True, timeout=timeout)
