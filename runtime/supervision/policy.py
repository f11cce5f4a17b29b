"""Supervision policy, OTP style: child specs, restart strategies, restart intensity, backoff
and heartbeat deadlines.

Everything here is a pure function of its arguments (the clock and the random draw are passed
in), so the supervisors that apply it (`runtime.supervision.local` for pykka actors inside
one process, `runtime.supervision.ray_actors` for Ray actors) hold no policy of their own
and tests drive every branch without sleeping.

Example:
    ```py
    specs = {"w": ChildSpec("w", "actors.writer:Writer")}
    d = decide(["w"], "w", Exit.ABNORMAL, specs, Strategy.ONE_FOR_ONE, RestartHistory(),
               Intensity(3, 5.0), now=10.0, attempt=0, rand=0.5)
    # d.restart == ("w",), d.delay_s == the backoff, d.escalate is False
    ```
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.hooks import resolve

__all__ = [
    "Backoff",
    "ChildSpec",
    "Decision",
    "Exit",
    "HeartbeatState",
    "Intensity",
    "Restart",
    "RestartHistory",
    "Seen",
    "Strategy",
    "affected_children",
    "attribute_restart",
    "backoff_delay",
    "decide",
    "index_specs",
    "load_start",
    "observe",
    "overdue",
    "recent_restarts",
    "record_restart",
    "should_restart",
]


class Restart(enum.Enum):
    """When a child that exited is started again (OTP restart types)."""

    PERMANENT = "permanent"  # always
    TRANSIENT = "transient"  # only after an abnormal exit
    TEMPORARY = "temporary"  # never


class Strategy(enum.Enum):
    """Which children restart when one of them fails."""

    ONE_FOR_ONE = "one_for_one"  # only the failed child
    ONE_FOR_ALL = "one_for_all"  # every child, in start order, after stopping the others


class Exit(enum.Enum):
    """How a child ended, as far as its supervisor can tell."""

    NORMAL = "normal"  # it stopped itself on purpose
    ABNORMAL = "abnormal"  # it raised or its process died
    KILLED = "killed"  # something (often its supervisor, for a missed heartbeat) killed it


@dataclass(frozen=True)
class ChildSpec:
    """One child of a supervisor, as data.

    `start` is a callable (a pykka actor class, a Ray actor class) or an importable
    ``"module:Attr"`` string; it is started with `args`/`kwargs`. `shutdown_s` bounds how long a
    clean stop may take. `ray_options` are merged into the Ray options of a Ray child.
    """

    id: str
    start: Callable[..., Any] | str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    restart: Restart = Restart.PERMANENT
    shutdown_s: float = 5.0
    ray_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"ChildSpec.id must be a non-empty string, got {self.id!r}")
        if isinstance(self.start, str):
            module, sep, attr = self.start.partition(":")
            if not (module and sep and attr):
                raise ValueError(
                    f"ChildSpec {self.id!r}: start must be 'module:Attr', got {self.start!r}"
                )
        elif not callable(self.start):
            raise ValueError(f"ChildSpec {self.id!r}: start must be callable or 'module:Attr'")
        if not isinstance(self.restart, Restart):
            raise ValueError(
                f"ChildSpec {self.id!r}: restart must be a Restart, got {self.restart!r}"
            )
        if not self.shutdown_s >= 0:
            raise ValueError(
                f"ChildSpec {self.id!r}: shutdown_s must be >= 0, got {self.shutdown_s}"
            )
        if not isinstance(self.args, tuple):
            object.__setattr__(self, "args", tuple(self.args))


def index_specs(specs: Sequence[ChildSpec]) -> dict[str, ChildSpec]:
    """Specs by id, in start order; a duplicate id is a configuration error, not a silent
    overwrite, because two children would then fight over one name (and one Ray actor)."""
    out: dict[str, ChildSpec] = {}
    for spec in specs:
        if spec.id in out:
            raise ValueError(f"duplicate child id {spec.id!r} in supervisor specs")
        out[spec.id] = spec
    return out


def load_start(start: Callable[..., Any] | str) -> Any:
    """Resolve a spec's `start`: a ``"module:Attr.sub"`` string is imported (runtime/hooks.py;
    importing is the only side effect in this module), anything else is returned as is."""
    if not isinstance(start, str):
        return start
    return resolve(start, "start")


# --------------------------------------------------------------------------- intensity


@dataclass(frozen=True)
class Intensity:
    """At most `max_restarts` restarts within any `period_s` window; one more escalates."""

    max_restarts: int
    period_s: float

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"Intensity.max_restarts must be >= 0, got {self.max_restarts}")
        if not self.period_s > 0:
            raise ValueError(f"Intensity.period_s must be > 0, got {self.period_s}")


@dataclass(frozen=True)
class RestartHistory:
    """Times of the restarts still inside the intensity window, oldest first."""

    times: tuple[float, ...] = ()


def _in_window(times: tuple[float, ...], now: float, period_s: float) -> tuple[float, ...]:
    """Restarts at or after `now - period_s`. The boundary is inclusive, as in OTP's
    supervisor (a restart exactly `period_s` ago still counts), so a crash loop timed to the
    period cannot slip through."""
    threshold = now - period_s
    return tuple(t for t in times if t >= threshold)


def recent_restarts(history: RestartHistory, now: float, period_s: float) -> int:
    """How many restarts fall in the window ending at `now`; the natural backoff `attempt`,
    which grows in a crash loop and falls back to zero once the child has been quiet."""
    return len(_in_window(history.times, now, period_s))


def record_restart(
    history: RestartHistory, now: float, intensity: Intensity
) -> tuple[bool, RestartHistory]:
    """Add a restart at `now`: (still within intensity, new history).

    Sliding window with OTP semantics: the restart is counted first, then more than
    `max_restarts` inside the window means exceeded. So `Intensity(0, p)` escalates on the
    first failure and `Intensity(3, p)` allows three restarts and escalates on the fourth.
    Entries older than the window are dropped, keeping the history bounded.
    """
    times = (*_in_window(history.times, now, intensity.period_s), now)
    return len(times) <= intensity.max_restarts, RestartHistory(times)


# --------------------------------------------------------------------------- backoff


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: `base_s * factor**attempt`, capped at `cap_s`, with `jitter` in
    [0, 1] as the fraction of the delay that is randomised (0 none, 1 full jitter)."""

    base_s: float = 0.1
    factor: float = 2.0
    cap_s: float = 30.0
    jitter: float = 0.5


def backoff_delay(
    attempt: int, *, base: float, factor: float, cap: float, jitter: float, rand: float
) -> float:
    """Delay before restart number `attempt` (0-based), always within [0, cap].

    `raw = min(cap, base * factor**attempt)`; jitter takes away up to `jitter * raw`
    (`raw * (1 - jitter * rand)`), so restarts of many children spread out instead of
    hammering a shared dependency in step. Without jitter the delay never decreases as the
    attempt grows (factor >= 1). A huge attempt saturates at `cap` instead of overflowing.
    """
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    if base < 0 or cap < 0:
        raise ValueError(f"base and cap must be >= 0, got base={base} cap={cap}")
    if factor < 1:
        raise ValueError(f"factor must be >= 1 (a shrinking backoff is a bug), got {factor}")
    if not 0 <= jitter <= 1:
        raise ValueError(f"jitter must be in [0, 1], got {jitter}")
    if not 0 <= rand < 1:
        raise ValueError(f"rand must be in [0, 1), got {rand}")
    raw = _capped_exponential(attempt, base, factor, cap)
    return min(cap, max(0.0, raw * (1.0 - jitter * rand)))


def _capped_exponential(attempt: int, base: float, factor: float, cap: float) -> float:
    """`min(cap, base * factor**attempt)` computed in log space once it would pass the cap,
    because `factor**attempt` overflows a float long before a crash loop gives up."""
    if base == 0 or factor == 1:
        return min(cap, base)
    if base >= cap:
        return cap
    if attempt * math.log(factor) >= math.log(cap) - math.log(base):
        return cap
    return min(cap, base * factor**attempt)


# --------------------------------------------------------------------------- heartbeat


def overdue(last_seen: float, now: float, deadline_s: float) -> bool:
    """True once more than `deadline_s` has passed since `last_seen`. Exactly at the deadline
    is still on time, and a clock that seems to run backwards (`now < last_seen`) never makes a
    child overdue: killing a healthy child is worse than noticing a hang one round later."""
    return now - last_seen > deadline_s


def hung(
    *,
    ray_alive: bool,
    last_seen: float | None,
    killed_at: float | None,
    now: float,
    deadline_s: float,
    grace_s: float,
) -> bool:
    """Does a child that just missed a heartbeat count as hung (to be killed)?

    - Ray says it is not running (restarting, pending, dead): not a hang.
    - The supervisor killed it less than `grace_s` ago and its restart has not answered yet:
      the silence is that restart, not a new hang. Killing it again would count a second
      restart for one failure (and a restart slowed by a loaded box would never end).
    - It answered within `deadline_s`: one slow answer, not yet a hang.
    """
    if not ray_alive:
        return False
    if killed_at is not None and now - killed_at <= grace_s:
        return False
    return last_seen is None or overdue(last_seen, now, deadline_s)


class Seen(enum.Enum):
    """What one heartbeat answer says about a child."""

    FIRST = "first"  # first answer since the supervisor started watching
    SAME = "same"  # the same incarnation as the previous answer
    NEW_INCARNATION = "new_incarnation"  # the process was restarted since the last answer


@dataclass(frozen=True)
class HeartbeatState:
    """The last incarnation id a child reported and when."""

    incarnation: str
    last_seen: float


def observe(
    state: HeartbeatState | None, incarnation: str, now: float
) -> tuple[Seen, HeartbeatState]:
    """Fold one heartbeat answer into the state.

    A changed incarnation id means the child's constructor ran again: its process was
    restarted (by Ray, or recreated by the supervisor) since the previous answer, even if the
    supervisor never saw it down. `last_seen` never moves backwards.
    """
    if state is None:
        return Seen.FIRST, HeartbeatState(incarnation, now)
    seen = Seen.SAME if state.incarnation == incarnation else Seen.NEW_INCARNATION
    return seen, HeartbeatState(incarnation, max(now, state.last_seen))


def attribute_restart(
    killed_at: float | None, started_at: float, now: float, grace_s: float
) -> tuple[bool, float | None]:
    """Is a newly seen incarnation one the supervisor caused by killing the child at
    `killed_at` (hung, or a ONE_FOR_ALL sibling)? Returns (caused by us, killed_at to keep).

    - No kill pending, or the kill is more than `grace_s` old: not ours, a new failure. The
      grace bounds how long a kill that never landed can hide a real crash.
    - The incarnation started before the kill: a restart the supervisor did not see happened
      in between, and the kill ended it anyway; absorbed (OTP likewise discards the exit of a
      child it is terminating), and the restart caused by the kill is still to come.
    - Started at or after the kill: the restart we asked for; the kill is settled.
    """
    if killed_at is None or now - killed_at > grace_s:
        return False, None
    if started_at < killed_at:
        return True, killed_at
    return True, None


# --------------------------------------------------------------------------- decision


@dataclass(frozen=True)
class Decision:
    """What a supervisor does about one child exit.

    Apply in this order: stop `stop` (reverse start order, already-dead ones are skipped),
    forget `drop`, then after `delay_s` start `restart` in the order given. If `escalate`,
    stop everything and report to the parent instead; `restart` is then empty.
    """

    restart: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()
    drop: tuple[str, ...] = ()
    delay_s: float = 0.0
    escalate: bool = False
    history: RestartHistory = RestartHistory()
    reason: str = ""


def should_restart(restart: Restart, exit: Exit) -> bool:
    """OTP restart types. KILLED counts as abnormal: a child killed for hanging, or by an
    operator, did not finish its work, so a transient child must come back."""
    if restart is Restart.PERMANENT:
        return True
    if restart is Restart.TRANSIENT:
        return exit is not Exit.NORMAL
    return False


def affected_children(order: Sequence[str], failed_id: str, strategy: Strategy) -> tuple[str, ...]:
    """The children a restart concerns, in start order: ONE_FOR_ALL takes them all because
    its children depend on each other's state and must start again from a common point."""
    if strategy is Strategy.ONE_FOR_ONE:
        return (failed_id,)
    return tuple(order)


def _split_temporary(
    ids: Sequence[str], failed_id: str, specs: Mapping[str, ChildSpec]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(restart, drop): temporary siblings stopped by a ONE_FOR_ALL restart are dropped, not
    restarted, as in OTP: a temporary child is never started twice, whatever the cause."""
    restart = tuple(i for i in ids if i == failed_id or specs[i].restart is not Restart.TEMPORARY)
    drop = tuple(i for i in ids if i not in restart)
    return restart, drop


def decide(
    order: Sequence[str],
    failed_id: str,
    exit: Exit,
    specs: Mapping[str, ChildSpec],
    strategy: Strategy,
    history: RestartHistory,
    intensity: Intensity,
    now: float,
    attempt: int,
    rand: float,
    backoff: Backoff | None = None,
) -> Decision:
    """Decide what to do after child `failed_id` exited with `exit`.

    `order` is the ids currently supervised in start order; `specs` maps ids to specs;
    `attempt` feeds the backoff (usually `recent_restarts(history, now, period)`); `rand` in
    [0, 1) is the jitter draw; `backoff` defaults to `Backoff()`. A child that is not to be
    restarted is dropped without touching the history: only restarts count towards
    intensity, as in OTP.
    """
    if failed_id not in specs or failed_id not in order:
        raise KeyError(f"unknown child {failed_id!r}; supervised: {list(order)}")
    spec = specs[failed_id]
    if not should_restart(spec.restart, exit):
        why = "temporary" if spec.restart is Restart.TEMPORARY else "transient, exited normally"
        return Decision(drop=(failed_id,), history=history, reason=f"{failed_id}: {why}")
    within, new_history = record_restart(history, now, intensity)
    if not within:
        return Decision(
            stop=tuple(reversed(order)),
            escalate=True,
            history=new_history,
            reason=(
                f"{failed_id} exited ({exit.value}): more than {intensity.max_restarts} "
                f"restarts in {intensity.period_s}s"
            ),
        )
    ids = affected_children(order, failed_id, strategy)
    restart, drop = _split_temporary(ids, failed_id, specs)
    backoff = backoff or Backoff()
    delay = backoff_delay(
        attempt,
        base=backoff.base_s,
        factor=backoff.factor,
        cap=backoff.cap_s,
        jitter=backoff.jitter,
        rand=rand,
    )
    return Decision(
        restart=restart,
        stop=tuple(reversed([i for i in ids if i != failed_id])),
        drop=drop,
        delay_s=delay,
        history=new_history,
        reason=f"{failed_id} exited ({exit.value}); restarting {', '.join(restart)}",
    )
