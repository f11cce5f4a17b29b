"""Autoscaling policy per role, modelled on Ray Serve's: a pure decision plus a small loop.

`decide(metrics, current, cfg, state, now)` is a pure function: the samples of one role's
load, its replica count now, its `AutoscalingConfig`, the `PolicyState` returned by the
previous call and the clock reading. It returns `Decision(desired, state, reason)`. The
decision goes through small steps, each its own function so each edge case is explained
and tested alone:

    window -> average -> raw desired -> factors -> bounds -> delays

`Controller` is the impure part: per tick it gathers each role's samples and replica count,
calls `decide`, and applies the decision when it differs from the current count.

What "load" means is the caller's choice, one number per sample for the whole role: in-flight
requests for collectors, pending log entries for loggers, in-flight publishes for bridges,
consumer lag or connected clients for gateways. `target_per_replica` is in the same unit.

Example:
    ```py
    cfg = validate(AutoscalingConfig(min_replicas=1, max_replicas=8, target_per_replica=100))
    d = decide([Sample(9.0, 350.0)], current=2, cfg=cfg, state=PolicyState(), now=10.0)
    # d.desired == 2 (an upscale to 4 must persist for upscale_delay_s first)
    d = decide([Sample(39.0, 350.0)], current=2, cfg=cfg, state=d.state, now=40.0)
    # d.desired == 4
    ```
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Annotated, Any, NamedTuple

import msgspec

__all__ = [
    "AutoscalingConfig",
    "Controller",
    "Decision",
    "PolicyState",
    "Sample",
    "apply_bounds",
    "apply_delays",
    "apply_factors",
    "average_load",
    "decide",
    "from_mapping",
    "raw_desired",
    "validate",
    "window",
]

_log = logging.getLogger(__name__)

# Float slack for comparisons of elapsed time against a delay and of load/target against an
# integer: 0.1 + 0.2 style rounding must not delay a decision by a tick or add a replica.
_EPS = 1e-9

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
PositiveF = Annotated[float, msgspec.Meta(gt=0)]
NonNegF = Annotated[float, msgspec.Meta(ge=0)]
DownFactor = Annotated[float, msgspec.Meta(gt=0, le=1)]


class AutoscalingConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One role's `[roles.<role>.autoscaling]` table.

    - `min_replicas`, `max_replicas`: hard bounds, enforced at once (no delay).
    - `target_per_replica`: load units one replica should carry (required: the unit differs
      per role).
    - `upscale_delay_s`, `downscale_delay_s`: how long a wish to scale in one direction must
      persist before it is acted on (Ray Serve's defaults: 30 s up, 600 s down).
    - `upscaling_factor`: multiplies each upscale step (2 = twice the suggested change,
      0.5 = half of it); `downscaling_factor` likewise for downscales, at most 1 so a
      downscale never drops below what the load needs (and up/down cannot oscillate).
    - `look_back_s`: the load is averaged over the samples of this last stretch of time.

    Fields are checked when decoded from TOML (msgspec constraints) and again, with the
    cross-field rules, by `validate`.
    """

    min_replicas: NonNegInt = 1
    max_replicas: PositiveInt
    target_per_replica: PositiveF
    upscale_delay_s: NonNegF = 30.0
    downscale_delay_s: NonNegF = 600.0
    upscaling_factor: PositiveF = 1.0
    downscaling_factor: DownFactor = 1.0
    look_back_s: PositiveF = 30.0


class Sample(NamedTuple):
    """The whole role's load at time `t` (on the same clock as `now`)."""

    t: float
    load: float


class PolicyState(NamedTuple):
    """What `decide` remembers between calls; immutable, start with `PolicyState()`.

    `direction` is the pending wish (+1 up, -1 down, 0 none) and `since` the clock reading
    when that wish began; `window` holds the samples of the last look-back period, so a
    metric source may hand over only its newest sample each tick.
    """

    direction: int = 0
    since: float | None = None
    window: tuple[Sample, ...] = ()


class Decision(NamedTuple):
    """`desired` replicas (== current when nothing is to change), the state to pass to the
    next call, and a one-line human reason."""

    desired: int
    state: PolicyState
    reason: str


# --------------------------------------------------------------------------- config


def validate(cfg: AutoscalingConfig, where: str = "autoscaling") -> AutoscalingConfig:
    """Return `cfg` if usable, else raise ValueError listing every problem by field name.

    msgspec checks constraints only when decoding, so a config built in Python is checked
    here field by field too. `min_replicas > max_replicas` is rejected rather than silently
    swapped: either bound may be the typo, and guessing would scale the wrong way.
    """
    problems: list[str] = []

    def need(ok: bool, field: str, rule: str) -> None:
        if not ok:
            problems.append(f"{where}.{field}: {rule}, got {getattr(cfg, field)!r}")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def is_num(v: Any) -> bool:
        return is_int(v) or (isinstance(v, float) and math.isfinite(v))

    need(is_int(cfg.min_replicas) and cfg.min_replicas >= 0, "min_replicas", "an int >= 0")
    need(is_int(cfg.max_replicas) and cfg.max_replicas >= 1, "max_replicas", "an int >= 1")
    need(
        is_num(cfg.target_per_replica) and cfg.target_per_replica > 0,
        "target_per_replica",
        "a number > 0",
    )
    for field in ("upscale_delay_s", "downscale_delay_s"):
        need(is_num(getattr(cfg, field)) and getattr(cfg, field) >= 0, field, "a number >= 0")
    need(
        is_num(cfg.upscaling_factor) and cfg.upscaling_factor > 0,
        "upscaling_factor",
        "a number > 0",
    )
    need(
        is_num(cfg.downscaling_factor) and 0 < cfg.downscaling_factor <= 1,
        "downscaling_factor",
        "a number in (0, 1]",
    )
    need(is_num(cfg.look_back_s) and cfg.look_back_s > 0, "look_back_s", "a number > 0")
    if not problems and cfg.min_replicas > cfg.max_replicas:
        problems.append(
            f"{where}.min_replicas: must be <= max_replicas ({cfg.max_replicas}), "
            f"got {cfg.min_replicas}"
        )
    if problems:
        raise ValueError("; ".join(problems))
    return cfg


def from_mapping(data: Mapping[str, Any], where: str = "autoscaling") -> AutoscalingConfig:
    """Decode a TOML table into a validated config; errors name `where.<field>`."""
    try:
        cfg = msgspec.convert(dict(data), AutoscalingConfig)
    except msgspec.ValidationError as err:
        text = str(err)
        text, _, path = text.partition(" - at `$")
        field = path.rstrip("`").lstrip(".")
        raise ValueError(f"{where}{'.' + field if field else ''}: {text}") from None
    return validate(cfg, where)


# --------------------------------------------------------------------------- steps


def window(
    old: Iterable[Sample], new: Iterable[Sample], now: float, look_back_s: float
) -> tuple[Sample, ...]:
    """The samples with `now - look_back_s < t <= now`, oldest first, one per timestamp.

    A new sample replaces a remembered one with the same `t`, so a source that returns its
    whole history each tick is not counted twice. Samples from after `now` are dropped: the
    clock passed in is the authority, and a sample from the future is a clock mismatch that
    must not steer the decision. Non-finite loads (NaN from a failed division, inf) are
    broken metrics and are dropped too.
    """
    by_t: dict[float, Sample] = {}
    for s in (*old, *new):
        s = Sample(float(s[0]), float(s[1]))
        if now - look_back_s < s.t <= now and math.isfinite(s.load):
            by_t[s.t] = s
    return tuple(by_t[t] for t in sorted(by_t))


def average_load(samples: Sequence[Sample]) -> float | None:
    """Mean load of the window, or None when it is empty.

    None means "no information", which the caller turns into a hold: treating missing
    metrics as zero load would scale a role down exactly when its metrics source is broken
    (often because the role is overloaded). Negative loads are clamped to 0 (a counter
    that went backwards is not negative work).
    """
    if not samples:
        return None
    return math.fsum(max(0.0, s.load) for s in samples) / len(samples)


def raw_desired(load: float, target_per_replica: float) -> int:
    """`ceil(load / target)`: the replicas that carry `load` at no more than `target` each.

    Zero load gives 0 here; the bounds step lifts it to `min_replicas`, so a role only
    reaches zero replicas when its config allows it. A quotient within float slack of an
    integer is not rounded up (300 / 100 computed as 3.0000000000000004 is 3, not 4).
    """
    return max(0, math.ceil(load / target_per_replica - _EPS))


def apply_factors(desired: int, current: int, cfg: AutoscalingConfig) -> int:
    """Scale the step `desired - current` by the up- or downscaling factor.

    The result rounds up, so an upscale with a small factor still moves by at least one.
    A downscale that the factor would round back to `current` moves down by one, else a
    small `downscaling_factor` would keep an idle role at its size forever (Ray Serve does
    the same). From zero replicas the factor is meaningless (the whole count would be the
    step and be amplified each tick), so `desired` is taken as is.
    """
    if current <= 0 or desired == current:
        return desired
    step = desired - current
    factor = cfg.upscaling_factor if step > 0 else cfg.downscaling_factor
    scaled = math.ceil(current + factor * step - _EPS)
    if step < 0 and scaled >= current:
        scaled = current - 1
    return scaled


def apply_bounds(desired: int, cfg: AutoscalingConfig) -> int:
    """Clamp to `[min_replicas, max_replicas]`.

    Applied before the delays, so a wish the bounds would cancel (more than max while at
    max) never starts a delay timer or shows as pending in the reason.
    """
    return max(cfg.min_replicas, min(cfg.max_replicas, desired))


def apply_delays(
    proposed: int, current: int, cfg: AutoscalingConfig, state: PolicyState, now: float
) -> tuple[int, PolicyState]:
    """Take `proposed` only once the wish to move in its direction has lasted the delay.

    The timer starts the first time a direction is wished for; a wish in the other
    direction, or no wish (proposed == current), resets it, so a load that wobbles around
    the threshold never scales. Exactly at the delay counts as elapsed. Once taken, the
    timer resets: the next step in the same direction waits a full delay again, which gives
    new replicas time to take load before the metrics are trusted. From zero replicas an
    upscale is immediate: nothing serves the load in the meantime. The window in `state` is
    passed through untouched.
    """
    if proposed == current:
        return current, state._replace(direction=0, since=None)
    direction = 1 if proposed > current else -1
    if current == 0 and direction > 0:
        return proposed, state._replace(direction=0, since=None)
    since = state.since if state.direction == direction and state.since is not None else now
    delay = cfg.upscale_delay_s if direction > 0 else cfg.downscale_delay_s
    if now - since + _EPS >= delay:
        return proposed, state._replace(direction=0, since=None)
    return current, state._replace(direction=direction, since=since)


# --------------------------------------------------------------------------- decision


def decide(
    metrics: Sequence[Sample],
    current: int,
    cfg: AutoscalingConfig,
    state: PolicyState,
    now: float,
) -> Decision:
    """One autoscaling decision for one role; pure, the clock is `now`.

    Order: a `current` outside the bounds is brought inside at once (the operator changed
    them; waiting would run the role outside what was configured). Otherwise the samples are
    merged into the look-back window; no sample in it means hold (and reset any pending
    wish, which has not been shown to persist). Else average -> raw desired -> factors ->
    bounds -> delays.
    """
    win = window(state.window, metrics, now, cfg.look_back_s)
    if current < cfg.min_replicas or current > cfg.max_replicas:
        desired = apply_bounds(current, cfg)
        reason = f"{current} is outside [{cfg.min_replicas}, {cfg.max_replicas}]: -> {desired}"
        return Decision(desired, PolicyState(window=win), reason)
    load = average_load(win)
    if load is None:
        reason = f"no metrics in the last {cfg.look_back_s:g}s: holding at {current}"
        return Decision(current, PolicyState(window=win), reason)
    raw = raw_desired(load, cfg.target_per_replica)
    proposed = apply_bounds(apply_factors(raw, current, cfg), cfg)
    desired, new_state = apply_delays(proposed, current, cfg, state._replace(window=win), now)
    basis = (
        f"load {load:g} (avg of {len(win)} over {cfg.look_back_s:g}s) / "
        f"{cfg.target_per_replica:g} per replica = {raw}"
    )
    if desired != current:
        verb = "up" if desired > current else "down"
        reason = f"scale {verb} {current} -> {desired}: {basis}"
    elif proposed != current:
        verb = "up" if proposed > current else "down"
        delay = cfg.upscale_delay_s if proposed > current else cfg.downscale_delay_s
        held = now - (new_state.since if new_state.since is not None else now)
        reason = (
            f"wait: {verb} to {proposed} wanted for {held:g}s of {delay:g}s; {basis}; "
            f"holding at {current}"
        )
    else:
        bounded = " (bounded)" if raw != current else ""
        reason = f"steady at {current}{bounded}: {basis}"
    return Decision(desired, new_state, reason)


# --------------------------------------------------------------------------- controller


class Controller:
    """Applies `decide` to several roles: gather -> decide -> apply, once per `tick`.

    `get_metrics(role)` returns that role's samples since (about) the last tick; older ones
    are remembered in the policy state. `get_replicas(role)` is the count now and
    `set_replicas(role, n)` changes it. `clock` must be the clock the samples are stamped
    with. A role whose metrics cannot be read is decided on no information: it holds, its
    remembered samples and pending wish are dropped (neither was seen to persist), bounds
    still apply. A role whose replica count cannot be read is skipped. A failed
    `set_replicas` keeps the previous state, so the same decision is retried next tick
    without waiting a new delay. One role's failure never stops the others.

    Example:
        ```py
        ctl = Controller({"collector": cfg}, metrics, replicas, scale, time.monotonic)
        threading.Thread(target=ctl.run, args=(stop, 5.0), daemon=True).start()
        ```
    """

    def __init__(
        self,
        policies: Mapping[str, AutoscalingConfig],
        get_metrics: Callable[[str], Sequence[Sample]],
        get_replicas: Callable[[str], int],
        set_replicas: Callable[[str, int], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policies = {
            role: validate(cfg, f"roles.{role}.autoscaling") for role, cfg in policies.items()
        }
        self._get_metrics = get_metrics
        self._get_replicas = get_replicas
        self._set_replicas = set_replicas
        self._clock = clock
        self.states: dict[str, PolicyState] = {role: PolicyState() for role in self.policies}
        self.last: dict[str, Decision] = {}
        self.errors: dict[str, str] = {}

    def tick(self) -> dict[str, Decision]:
        """One round over every role. Returns the decision of each role that could be
        decided (also kept in `last`); a role whose replica count could not be read is
        skipped, with the error kept in `errors` until it next succeeds."""
        out: dict[str, Decision] = {}
        for role, cfg in self.policies.items():
            decision = self._tick_role(role, cfg)
            if decision is not None:
                out[role] = decision
        self.last.update(out)
        return out

    def _tick_role(self, role: str, cfg: AutoscalingConfig) -> Decision | None:
        state = self.states[role]
        try:
            current = int(self._get_replicas(role))
        except Exception as err:
            _log.warning("autoscaling %s: cannot read replicas: %r", role, err)
            self.errors[role] = f"replica count unavailable: {err!r}"
            return None
        try:
            samples = list(self._get_metrics(role))
            self.errors.pop(role, None)
        except Exception as err:
            # No information: decide on an empty window, which holds (bounds still apply).
            _log.warning("autoscaling %s: cannot read metrics: %r", role, err)
            self.errors[role] = f"metrics unavailable: {err!r}"
            samples, state = [], PolicyState()
        decision = decide(samples, current, cfg, state, self._clock())
        if decision.desired != current:
            try:
                self._set_replicas(role, decision.desired)
            except Exception as err:
                _log.warning("autoscaling %s: scale to %d failed: %r", role, decision.desired, err)
                self.errors[role] = f"scale to {decision.desired} failed: {err!r}"
                return decision._replace(desired=current, reason=f"{decision.reason}; failed")
            _log.info("autoscaling %s: %s", role, decision.reason)
        self.states[role] = decision.state
        return decision

    def run(
        self, stop_event: threading.Event, interval_s: float, max_ticks: int | None = None
    ) -> int:
        """Tick every `interval_s` until `stop_event` is set (or `max_ticks`); returns the
        number of ticks. An unexpected error in a tick is logged, never ends the loop."""
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        ticks = 0
        while not stop_event.is_set() and (max_ticks is None or ticks < max_ticks):
            try:
                self.tick()
            except Exception:
                _log.exception("autoscaling tick failed")
            ticks += 1
            if stop_event.wait(interval_s):
                break
        return ticks
