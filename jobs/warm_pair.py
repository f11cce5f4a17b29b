"""One analysis driver's side of a warm pair (jobs/standby.py): its role, the pair's lease,
taking the queries over, and handing calls to the active peer.

Exists so that the warm-standby protocol is one part with one state (`role`, the lease
keeper, what the lease was last seen as, `took_over`) instead of being spread over the
driver's methods: the driver (jobs/driver.py) asks it whether to yield, to stand by and to
take over from its reconcile thread, and hands it the Ray calls a standby cannot answer
itself (`forward`, `forward_sql`). The rules it follows (when to wait, when a holder is
gone, ending the old JVM) are jobs/standby.py's; the lease is runtime/nats/lease.py's.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from jobs.sink import set_fence
from jobs.standby import (
    EXIT_FENCED,
    LEASE_TTL_S,
    WARM_UP_BATCHES,
    YIELD_MAX_S,
    Take,
    end_old_jvm,
    holder_info,
    holder_running,
    host_id,
    lease_key,
    record_jvm,
    should_yield,
    step_down,
    takeover,
    takeover_action,
    try_take,
)
from runtime.nats.lease import LeaseKeeper
from runtime.supervision.ray_actors import actor_state

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from runtime.nats.server import NatsEndpoint
    from runtime.state.checkpoint import CheckpointStore

log = logging.getLogger(__name__)

__all__ = ["FORWARD_TIMEOUT_S", "WarmPair", "own_wait", "read_one", "warm_up"]

FORWARD_TIMEOUT_S = 30.0  # added to a forwarded call's own wait


def own_wait(method: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> float:
    """How long a call may wait by its own arguments (``wait_s``, ``timeout``,
    ``timeout_s``, passed or defaulted), so a forwarded call is not cut short."""
    try:
        bound = inspect.signature(method).bind(None, *args, **kwargs)
    except TypeError:
        return 0.0
    bound.apply_defaults()
    for key in ("wait_s", "timeout", "timeout_s"):
        if isinstance(bound.arguments.get(key), int | float):
            return float(bound.arguments[key])
    return 0.0


class WarmPair:
    """This driver's role in its pair; a driver without a peer is active from the start and
    uses none of the rest.

    Args:
        name: this driver's name (its logs, its lease holder's name).
        peer: the Ray name of the other driver of the pair, or None.
        namespace: the Ray namespace both drivers live in.
        nats: where the pair's lease bucket is.
        incarnation: this process's incarnation (part of the lease holder's name).
        store_path: the checkpoint store the pair shares (its lock is the local guard).
        closing: set when the driver shuts down: every wait here ends on it.
        adopt: hands the store to the driver once this one holds it.
        jvm_pid: this driver's JVM, if it has one (ended with it when fenced).
        error: the exception a caller of the driver gets when no driver can answer.
    """

    def __init__(
        self,
        *,
        name: str,
        peer: str | None,
        namespace: str,
        nats: NatsEndpoint,
        incarnation: str,
        store_path: Path,
        closing: threading.Event,
        adopt: Callable[[CheckpointStore], None],
        jvm_pid: Callable[[], int | None],
        error: Callable[[str], Exception],
    ) -> None:
        self.name, self.peer, self.namespace = name, peer, namespace
        self.nats, self.incarnation, self.store_path = nats, incarnation, store_path
        self._closing, self._adopt, self._jvm_pid, self._error = closing, adopt, jvm_pid, error
        self.role = "active" if peer is None else "standby"
        self.took_over: dict[str, Any] | None = None
        # the pair's lease: made by the first try, renewed once held
        self._lease: LeaseKeeper | None = None
        self._lease_seen: dict[str, Any] | None = None

    # ---- becoming active (the reconcile thread) -----------------------------------------

    def yield_to_peer(self) -> None:
        """Wait before starting Spark (a JVM and session, about 15 s of CPU) while the
        peer is starting its own queries: after a takeover, the first batches of the new
        active driver (`should_yield`, jobs/standby.py); at most `YIELD_MAX_S`."""
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        deadline = time.monotonic() + YIELD_MAX_S
        while not self._closing.is_set() and time.monotonic() < deadline:
            if not should_yield(self.peer_info(), restarted=restarted):
                return
            self._closing.wait(1.0)

    def stand_by(
        self, warm_up: Callable[[Callable[[], bool]], None], set_state: Callable[[str], None]
    ) -> None:
        """Take the store and the pair's lease now if both are free (the pair's first
        start, or a peer that is gone): a driver that runs the queries at once does not
        warm up. Else `warm_up` (ended early once they are free) and stand by for them
        (`take_over`)."""
        freed: list[CheckpointStore] = []

        def lock_freed() -> bool:
            """The store and the lease are this driver's now (the queries cannot wait for
            a warm-up), or this driver is shutting down."""
            if not freed and (got := try_take(self.store_path, self.held_elsewhere)):
                freed.append(got)
            return bool(freed) or self._closing.is_set()

        started = time.monotonic()
        if not lock_freed():
            set_state("warming up")
            warm_up(lock_freed)
        if freed:
            self._become_active(freed[0], started, time.monotonic())
            return
        set_state("standby")

    def take_over(self) -> bool:
        """Wait, Spark up, until this driver holds the checkpoint store and the pair's
        lease; then make sure the previous holder's JVM is gone before any query starts
        (jobs/standby.py). False when the driver shut down meanwhile."""
        started = time.monotonic()
        store = takeover(self.store_path, self._closing, self.held_elsewhere)
        if store is None:
            self.release_lease()  # shut down while standing by: its connection only
            return False
        self._become_active(store, started, time.monotonic())
        return True

    def _become_active(self, store: CheckpointStore, started: float, locked: float) -> None:
        """Hold `store` from now on; the previous holder's JVM is ended first. The lease
        taken with it guards every result sink of this process from here on."""
        assert self._lease is not None and self._lease.epoch
        set_fence(self._lease)
        jvm = end_old_jvm(self.store_path)
        self._adopt(store)
        self.role = "active"
        self.took_over = {
            "at": time.time(),
            "waited_s": round(locked - started, 3),
            "old_jvm": jvm,
            "fence_s": round(time.monotonic() - locked, 3),
            "epoch": self._lease.epoch,
        }
        log.warning("analysis driver %s: took the queries over: %s", self.name, self.took_over)

    def record_jvm(self, pid: int | None) -> None:
        """Record the active driver's JVM next to the store, for the next holder to end."""
        if self.peer is not None and pid is not None:
            record_jvm(self.store_path, pid)

    # ---- the pair's lease ---------------------------------------------------------------

    def _keeper(self) -> LeaseKeeper:
        if self._lease is None:
            actor = ray.get_runtime_context().get_actor_name() or self.name
            self._lease = LeaseKeeper(
                lambda: self.nats.connect(name=f"analysis-lease-{self.name}"),
                lease_key(self.name),
                f"{actor}/{self.incarnation}",
                ttl_s=LEASE_TTL_S,
                info=holder_info(os.getpid()),
            ).start()
        return self._lease

    def held_elsewhere(self) -> bool:
        """Try to take the pair's lease (`takeover_action`); True while another driver
        holds it or the bucket does not answer. Once taken, it is renewed from now on."""
        try:
            keeper = self._keeper()
            seen = keeper.read()
            here = host_id()
            running = holder_running(seen.info, here) if seen is not None else None
            action = takeover_action(seen, keeper.holder, here, running)
            self._lease_seen = {
                "at": time.time(),
                "holder": seen.holder if seen else None,
                "epoch": seen.epoch if seen else None,
                "action": action.value,
            }
            if action is Take.WAIT:
                return True
            if action is Take.ACQUIRE or seen is None:
                got = keeper.acquire()
            else:  # its holder's process is gone: take it at the revision just read
                got = keeper.take(seen.revision)
        except Exception as err:  # NATS away: nobody can be shown to be gone, so wait
            error = repr(err)[:300]
            again = (self._lease_seen or {}).get("error") == error
            log.log(
                logging.DEBUG if again else logging.WARNING,
                "analysis driver %s: the pair's lease: %s",
                self.name,
                error,
            )
            self._lease_seen = {"at": time.time(), "error": error}
            return True
        if got:
            keeper.keep(self._fenced)
            log.warning(
                "analysis driver %s: holds the pair's lease %s, epoch %d (%s)",
                self.name,
                keeper.key,
                keeper.epoch,
                action.value,
            )
        return not got

    def _fenced(self, why: str) -> None:
        """The lease is lost for good: another driver may run the queries now. Every sink
        refuses already (it is not fresh); end this process and its JVM at once, so no
        query of this one runs on, and Ray restarts it as the standby."""
        log.error("analysis driver %s: %s: stepping down (exit %d)", self.name, why, EXIT_FENCED)
        step_down(self._jvm_pid())

    def release_lease(self) -> None:
        """The queries are stopped: give the lease up, so the standby need not wait."""
        keeper, self._lease = self._lease, None
        if keeper is not None:
            set_fence(None)
            keeper.close()

    def lease_info(self) -> dict[str, Any]:
        """The lease as last seen, and this driver's own epoch (0: not held)."""
        return {
            **(self._lease_seen or {}),
            "mine": self._lease.epoch if self._lease is not None else 0,
            "fresh": self._lease is not None and self._lease.fresh(),
        }

    # ---- the peer -----------------------------------------------------------------------

    def peer_handle(self) -> Any:
        return ray.get_actor(self.peer, namespace=self.namespace)

    @staticmethod
    def peer_down(peer: Any) -> str | None:
        """Ray's state of `peer` when Ray has it not alive (restarting, dead): a call to it
        would wait, silently, for its restart. None when alive or unknown."""
        state = actor_state(peer)
        return None if state in (None, "ALIVE") else state

    def peer_info(self) -> dict[str, Any] | None:
        """The peer's `role_info`, or None when it is not up to answer. Asked only when Ray
        has it alive: a call to an actor Ray is restarting waits for the restart."""
        try:
            peer = self.peer_handle()
            if self.peer_down(peer) is not None:
                return None
            return dict(ray.get(peer.role_info.remote(), timeout=2.0))
        except Exception:  # gone, restarting or not answering
            return None

    def forward(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], wait: float
    ) -> Any:
        """Hand a call this standby cannot answer to the active peer's `from_standby`;
        `wait`: the call's own wait (`own_wait`), added to `FORWARD_TIMEOUT_S`."""
        try:
            peer = self.peer_handle()
            # a call to a peer Ray is restarting would wait, silently, for the restart
            # (seconds): while it is down, this standby is about to take over
            down = self.peer_down(peer)
            if down is not None:
                raise self._error(
                    f"analysis driver {self.name!r} is a standby and its peer {self.peer!r} "
                    f"is {down.lower()}: no driver is active yet"
                )
            # not retried: a peer that dies under the call is restarted as a standby, and
            # Ray would hold the retry until then; the caller hears at once instead
            ref = peer.from_standby.options(max_task_retries=0).remote(method, args, kwargs)
            return ray.get(ref, timeout=float(wait) + FORWARD_TIMEOUT_S)
        except (ValueError, ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as err:
            raise self._error(
                f"analysis driver {self.name!r} is a standby and its active peer "
                f"{self.peer!r} did not answer: {err}"
            ) from None

    def forward_sql(
        self,
        sql: str,
        limit: int,
        timeout_s: float,
        allowed: Sequence[str] | None,
        forwarded: bool,
    ) -> dict[str, Any]:
        """Hand an ad-hoc query to the active peer's `sql` (its SQL threads, never the
        control methods' as `from_standby` would), marked forwarded: never handed on."""
        if forwarded or self.peer is None:
            return {"status": 503, "error": "no analysis driver is active yet"}
        try:
            peer = self.peer_handle()
            down = self.peer_down(peer)  # a call would wait, silently, for its restart
            if down is not None:
                return {"status": 503, "error": f"the active analysis driver is {down}"}
            ref = peer.sql.remote(sql, limit, timeout_s, allowed, forwarded=True)
            return dict(ray.get(ref, timeout=timeout_s + FORWARD_TIMEOUT_S))
        except Exception as err:  # gone or not answering
            return {"status": 503, "error": f"the active analysis driver: {err!r}"[:500]}


def warm_up(
    spark: SparkSession,
    work: Path,
    abort: Callable[[], bool],
    streams: Callable[[], Sequence[str]],
    nats: NatsEndpoint,
    name: str,
) -> bool:
    """Run the top-N plan for a few micro-batches over an in-memory Python source in
    `spark`'s JVM (under `work`, removed after), then read one event of the first of
    `streams` (`read_one`), so that a takeover's first batch finds Spark's streaming code
    compiled and a Python worker started (jobs/standby.py); `abort` ends it early. Whether
    the batches ran to the end."""
    from jobs.class_training import register_source, run_jobs, training_jobs

    try:
        register_source(spark)
        done = run_jobs(spark, training_jobs()[:1], work, batches=WARM_UP_BATCHES, abort=abort)
        if done and not abort():
            read_one(spark, nats, streams(), name)
        return bool(done)
    except Exception:  # a standby that did not warm up still takes over
        log.exception("analysis driver %s: warm-up", name)
        return False
    finally:
        shutil.rmtree(work, ignore_errors=True)


def read_one(spark: SparkSession, nats: NatsEndpoint, streams: Sequence[str], name: str) -> None:
    """Read one event through the jetstream source, so that Spark starts the Python
    processes it keeps for the source (daemons for its lookup, its read planning and its
    reads: each a new interpreter importing pyspark) here, not in a takeover's first query
    (the first query of a fresh JVM started ~2.5 s later than the next ones). Any stream
    serves: the processes are the source's, whichever stream it reads."""
    if not streams:
        return
    reader = spark.read.format("jetstream").options(**nats.to_options())
    try:
        reader.option("stream", streams[0]).load().limit(1).collect()
    except Exception as err:  # e.g. no such stream yet: its lookup still warmed up
        log.info("analysis driver %s: source warm-up read: %s", name, err)
