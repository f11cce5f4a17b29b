"""Autoscaling policy (pure: time passed in, no sleeping) and its Controller loop (with
fakes). The cluster/ settings (Ray YAML, NATS template, Spark defaults) are
tests/test_cluster_config.py."""

from __future__ import annotations

import math
import threading
from typing import Any

import msgspec
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from runtime.supervision.autoscaling import (
    AutoscalingConfig,
    Controller,
    PolicyState,
    Sample,
    apply_bounds,
    apply_delays,
    apply_factors,
    average_load,
    decide,
    from_mapping,
    raw_desired,
    validate,
    window,
)

pytestmark = pytest.mark.unit


def cfg_(**kw: Any) -> AutoscalingConfig:
    """A config with short, distinct delays unless overridden."""
    base: dict[str, Any] = {
        "min_replicas": 1,
        "max_replicas": 10,
        "target_per_replica": 100.0,
        "upscale_delay_s": 10.0,
        "downscale_delay_s": 60.0,
        "look_back_s": 30.0,
    }
    base.update(kw)
    return validate(AutoscalingConfig(**base))


def at(t: float, load: float) -> list[Sample]:
    return [Sample(t, load)]


# --------------------------------------------------------------------------- config


def test_config_defaults_follow_ray_serve_and_the_unit_fields_are_required() -> None:
    cfg = from_mapping({"max_replicas": 4, "target_per_replica": 50})
    assert (cfg.min_replicas, cfg.upscale_delay_s, cfg.downscale_delay_s) == (1, 30.0, 600.0)
    assert (cfg.upscaling_factor, cfg.downscaling_factor, cfg.look_back_s) == (1.0, 1.0, 30.0)
    with pytest.raises(ValueError, match="missing required field `target_per_replica`"):
        from_mapping({"max_replicas": 4})
    with pytest.raises(AttributeError):
        cfg.min_replicas = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"max_replicas": 0}, r"roles\.gateway\.autoscaling\.max_replicas: Expected `int` >= 1"),
        ({"min_replicas": -1}, r"roles\.gateway\.autoscaling\.min_replicas: Expected `int` >= 0"),
        ({"target_per_replica": 0}, r"\.target_per_replica: Expected `float` > 0"),
        ({"upscale_delay_s": -1}, r"\.upscale_delay_s: Expected `float` >= 0"),
        ({"downscaling_factor": 1.5}, r"\.downscaling_factor: Expected `float` <= 1"),
        ({"upscaling_factor": 0}, r"\.upscaling_factor: Expected `float` > 0"),
        ({"look_back_s": 0}, r"\.look_back_s: Expected `float` > 0"),
        ({"look_back": 10}, r"roles\.gateway\.autoscaling: Object contains unknown field"),
        ({"min_replicas": 5, "max_replicas": 2}, r"\.min_replicas: must be <= max_replicas \(2\)"),
    ],
)
def test_from_mapping_rejects_bad_tables_naming_the_field(table: dict, message: str) -> None:
    data = {"max_replicas": 4, "target_per_replica": 10, **table}
    with pytest.raises(ValueError, match=message):
        from_mapping(data, "roles.gateway.autoscaling")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("min_replicas", -1, "min_replicas: an int >= 0"),
        ("min_replicas", 1.5, "min_replicas: an int >= 0"),
        ("max_replicas", 0, "max_replicas: an int >= 1"),
        ("target_per_replica", 0.0, "target_per_replica: a number > 0"),
        ("target_per_replica", math.nan, "target_per_replica: a number > 0"),
        ("downscale_delay_s", -0.5, "downscale_delay_s: a number >= 0"),
        ("upscaling_factor", -1.0, "upscaling_factor: a number > 0"),
        ("downscaling_factor", 2.0, r"downscaling_factor: a number in \(0, 1\]"),
        ("look_back_s", math.inf, "look_back_s: a number > 0"),
    ],
)
def test_validate_checks_structs_built_in_python_naming_the_field(
    field: str, value: object, message: str
) -> None:
    kw = {"max_replicas": 4, "target_per_replica": 10.0, field: value}
    with pytest.raises(ValueError, match=f"autoscaling\\.{message}, got"):
        validate(AutoscalingConfig(**kw))  # type: ignore[arg-type]


def test_min_greater_than_max_is_rejected_not_swapped() -> None:
    with pytest.raises(ValueError, match=r"x\.min_replicas: must be <= max_replicas \(2\), got 3"):
        validate(AutoscalingConfig(min_replicas=3, max_replicas=2, target_per_replica=1), "x")
    assert validate(cfg_(min_replicas=2, max_replicas=2)).max_replicas == 2


def test_config_decodes_from_toml_as_part_of_a_bigger_file() -> None:
    import tomllib

    text = "[autoscaling]\nmin_replicas = 2\nmax_replicas = 6\ntarget_per_replica = 500\n"
    cfg = from_mapping(tomllib.loads(text)["autoscaling"])
    assert (cfg.min_replicas, cfg.max_replicas, cfg.target_per_replica) == (2, 6, 500.0)
    assert msgspec.to_builtins(cfg)["upscale_delay_s"] == 30.0


# --------------------------------------------------------------------------- steps


def test_window_keeps_the_look_back_drops_the_future_and_broken_samples() -> None:
    old = (Sample(50.0, 1.0), Sample(71.0, 2.0), Sample(80.0, 3.0))
    new = [Sample(80.0, 30.0), Sample(90.0, math.nan), Sample(95.0, 5.0), Sample(101.0, 9.0)]
    # look-back 30 at now=100: (70, 100]; t=80 replaced by the newer value; NaN and future out
    assert window(old, new, now=100.0, look_back_s=30.0) == (
        Sample(71.0, 2.0),
        Sample(80.0, 30.0),
        Sample(95.0, 5.0),
    )
    assert window([], [Sample(70.0, 1.0)], now=100.0, look_back_s=30.0) == ()  # boundary out
    assert window([], [(100.0, 4)], now=100.0, look_back_s=30.0) == (Sample(100.0, 4.0),)


@pytest.mark.parametrize(
    ("loads", "expected"),
    [([], None), ([100.0], 100.0), ([0.0, 300.0], 150.0), ([-50.0, 100.0], 50.0)],
)
def test_average_load(loads: list[float], expected: float | None) -> None:
    assert average_load([Sample(float(i), x) for i, x in enumerate(loads)]) == expected


@pytest.mark.parametrize(
    ("load", "target", "expected"),
    [
        (0.0, 100.0, 0),
        (1.0, 100.0, 1),
        (100.0, 100.0, 1),
        (100.5, 100.0, 2),
        (300.0, 100.0, 3),
        (0.1 + 0.2, 0.1, 3),  # 0.30000000000000004 / 0.1 is not 4 replicas
        (950.0, 100.0, 10),
    ],
)
def test_raw_desired_is_ceil_of_load_over_target(load: float, target: float, expected: int) -> None:
    assert raw_desired(load, target) == expected


@pytest.mark.parametrize(
    ("desired", "current", "up", "down", "expected"),
    [
        (8, 4, 1.0, 1.0, 8),
        (8, 4, 0.5, 1.0, 6),  # half the step up
        (5, 4, 0.1, 1.0, 5),  # a small factor still moves by one
        (8, 4, 2.0, 1.0, 12),  # an aggressive factor overshoots on purpose
        (2, 6, 1.0, 0.5, 4),  # half the step down
        (5, 6, 1.0, 0.1, 5),  # ceil would stay at 6: forced down by one
        (1, 10, 1.0, 0.01, 9),
        (4, 4, 3.0, 0.5, 4),  # no step, no change
        (7, 0, 0.5, 1.0, 7),  # from zero the factor is not applied
    ],
)
def test_apply_factors(desired: int, current: int, up: float, down: float, expected: int) -> None:
    cfg = cfg_(upscaling_factor=up, downscaling_factor=down)
    assert apply_factors(desired, current, cfg) == expected


@pytest.mark.parametrize(
    ("desired", "lo", "hi", "expected"),
    [(0, 1, 5, 1), (0, 0, 5, 0), (3, 1, 5, 3), (9, 1, 5, 5), (2, 2, 2, 2)],
)
def test_apply_bounds(desired: int, lo: int, hi: int, expected: int) -> None:
    assert apply_bounds(desired, cfg_(min_replicas=lo, max_replicas=hi)) == expected


UP, DOWN = 10.0, 60.0


@pytest.mark.parametrize(
    ("proposed", "current", "state", "now", "desired", "direction", "since"),
    [
        # up: the wish starts the timer
        (4, 2, PolicyState(), 100.0, 2, 1, 100.0),
        # up: not before the delay
        (4, 2, PolicyState(1, 100.0), 109.999, 2, 1, 100.0),
        # up: exactly at the delay counts
        (4, 2, PolicyState(1, 100.0), 110.0, 4, 0, None),
        # up: after the delay
        (4, 2, PolicyState(1, 100.0), 500.0, 4, 0, None),
        # down uses its own (longer) delay
        (1, 3, PolicyState(-1, 100.0), 150.0, 3, -1, 100.0),
        (1, 3, PolicyState(-1, 100.0), 160.0, 1, 0, None),
        # a flip of direction resets the timer even if the old wish was long overdue
        (4, 2, PolicyState(-1, 0.0), 1000.0, 2, 1, 1000.0),
        (1, 3, PolicyState(1, 0.0), 1000.0, 3, -1, 1000.0),
        # no wish resets too
        (2, 2, PolicyState(1, 0.0), 1000.0, 2, 0, None),
        # from zero replicas an upscale does not wait
        (3, 0, PolicyState(), 5.0, 3, 0, None),
    ],
)
def test_apply_delays(
    proposed: int,
    current: int,
    state: PolicyState,
    now: float,
    desired: int,
    direction: int,
    since: float | None,
) -> None:
    cfg = cfg_(upscale_delay_s=UP, downscale_delay_s=DOWN)
    got, new = apply_delays(proposed, current, cfg, state, now)
    assert (got, new.direction, new.since) == (desired, direction, since)


def test_apply_delays_tolerates_float_drift_at_the_boundary() -> None:
    cfg = cfg_(upscale_delay_s=0.3)
    # 0.1 + 0.2 - 0.0 == 0.30000000000000004 but 0.7 - 0.4 == 0.29999999999999993
    got, _ = apply_delays(4, 2, cfg, PolicyState(1, 0.4), 0.7)
    assert got == 4


# --------------------------------------------------------------------------- decide


def run_ticks(
    cfg: AutoscalingConfig, load: float, current: int, times: list[float]
) -> list[tuple[float, int, str]]:
    """Tick at `times` with a constant load, applying each decision; (t, desired, reason)."""
    state, out = PolicyState(), []
    for t in times:
        d = decide(at(t, load), current, cfg, state, t)
        out.append((t, d.desired, d.reason))
        current, state = d.desired, d.state
    return out


def test_step_up_waits_the_upscale_delay_then_takes_the_whole_step() -> None:
    got = run_ticks(cfg_(), load=350.0, current=2, times=[0.0, 5.0, 9.0, 10.0, 11.0])
    assert [d for _, d, _ in got] == [2, 2, 2, 4, 4]
    assert got[0][2].startswith("wait: up to 4 wanted for 0s of 10s")
    assert got[3][2].startswith("scale up 2 -> 4: load 350")
    assert got[4][2].startswith("steady at 4")


def test_step_down_waits_the_downscale_delay() -> None:
    times = [0.0, 30.0, 59.0, 60.0, 61.0]
    got = run_ticks(cfg_(look_back_s=5.0), load=50.0, current=5, times=times)
    assert [d for _, d, _ in got] == [5, 5, 5, 1, 1]
    assert "scale down 5 -> 1" in got[3][2]


def test_zero_load_goes_to_min_not_zero_unless_min_is_zero() -> None:
    times = [0.0, 60.0]
    assert run_ticks(cfg_(min_replicas=2), 0.0, 4, times)[-1][1] == 2
    assert run_ticks(cfg_(min_replicas=0), 0.0, 4, times)[-1][1] == 0


def test_load_beyond_max_is_clamped_and_starts_no_timer_at_max() -> None:
    cfg = cfg_(max_replicas=5)
    assert run_ticks(cfg, 10_000.0, 2, [0.0, 10.0])[-1][1] == 5
    d = decide(at(0.0, 10_000.0), 5, cfg, PolicyState(), 0.0)
    assert d.desired == 5 and d.state.direction == 0
    assert d.reason.startswith("steady at 5 (bounded)")


def test_current_outside_the_bounds_is_corrected_at_once() -> None:
    cfg = cfg_(min_replicas=2, max_replicas=4)
    hi = decide(at(0.0, 1000.0), 9, cfg, PolicyState(1, -100.0), 0.0)
    assert (hi.desired, hi.state.direction) == (4, 0)
    assert "outside [2, 4]" in hi.reason
    assert decide([], 0, cfg, PolicyState(), 0.0).desired == 2  # even without metrics


def test_missing_metrics_hold_and_reset_a_pending_wish() -> None:
    cfg = cfg_()
    d = decide(at(0.0, 900.0), 2, cfg, PolicyState(), 0.0)
    assert d.state.direction == 1
    # the only sample is now older than the look-back: no information
    held = decide([], 2, cfg, d.state, 31.0)
    assert held.desired == 2 and held.state == PolicyState()
    assert held.reason == "no metrics in the last 30s: holding at 2"
    # the wish must persist again from scratch once metrics return
    again = decide(at(32.0, 900.0), 2, cfg, held.state, 32.0)
    assert (again.desired, again.state.since) == (2, 32.0)


def test_the_window_is_carried_in_the_state_and_averaged() -> None:
    """A source giving only its newest sample each tick: the average spans the look-back."""
    cfg = cfg_(upscale_delay_s=0.0, look_back_s=30.0)
    state = PolicyState()
    for t, load in [(0.0, 100.0), (10.0, 100.0)]:
        state = decide(at(t, load), 1, cfg, state, t).state
    d = decide(at(20.0, 400.0), 1, cfg, state, 20.0)  # avg 200 -> 2, not 4
    assert d.desired == 2 and len(d.state.window) == 3
    assert "avg of 3 over 30s" in d.reason


def test_a_wobbling_load_never_scales() -> None:
    cfg = cfg_(upscale_delay_s=10.0, downscale_delay_s=10.0, look_back_s=1.0)
    state, current = PolicyState(), 3
    for i in range(100):
        load = 450.0 if i % 2 else 150.0  # wants 5, then 2, ... each wish lasts one tick
        d = decide(at(i * 6.0, load), current, cfg, state, i * 6.0)
        assert d.desired == 3
        state = d.state


# --------------------------------------------------------------------------- properties


@st.composite
def configs(draw: st.DrawFn, max_delay: float = 600.0) -> AutoscalingConfig:
    lo = draw(st.integers(0, 8))
    return validate(
        AutoscalingConfig(
            min_replicas=lo,
            max_replicas=draw(st.integers(max(lo, 1), 20)),
            target_per_replica=draw(st.floats(0.5, 1000.0)),
            upscale_delay_s=draw(st.floats(0.0, max_delay)),
            downscale_delay_s=draw(st.floats(0.0, max_delay)),
            upscaling_factor=draw(st.floats(0.05, 3.0)),
            downscaling_factor=draw(st.floats(0.05, 1.0)),
            look_back_s=draw(st.floats(0.5, 60.0)),
        )
    )


any_load = st.floats(allow_nan=True, allow_infinity=True, width=64)
states = st.builds(
    PolicyState,
    st.sampled_from([-1, 0, 1]),
    st.one_of(st.none(), st.floats(-1e3, 1e3)),
    st.lists(st.builds(Sample, st.floats(-1e3, 1e3), any_load), max_size=5).map(tuple),
)


@given(
    cfg=configs(),
    samples=st.lists(st.builds(Sample, st.floats(-1e3, 1e3), any_load), max_size=8),
    current=st.integers(0, 40),
    state=states,
    now=st.floats(-1e3, 1e3),
)
def test_desired_is_always_within_the_bounds(
    cfg: AutoscalingConfig, samples: list[Sample], current: int, state: PolicyState, now: float
) -> None:
    d = decide(samples, current, cfg, state, now)
    assert cfg.min_replicas <= d.desired <= cfg.max_replicas
    assert d.state.direction in (-1, 0, 1)


@settings(max_examples=60, deadline=None)
@given(
    cfg=configs(max_delay=60.0),
    load=st.floats(0.0, 5000.0),
    current=st.integers(0, 25),
    interval=st.floats(1.0, 10.0),
)
def test_constant_load_converges_and_stays(
    cfg: AutoscalingConfig, load: float, current: int, interval: float
) -> None:
    expected = apply_bounds(raw_desired(load, cfg.target_per_replica), cfg)
    per_step = math.ceil(max(cfg.upscale_delay_s, cfg.downscale_delay_s) / interval) + 2
    ticks = 60 * per_step  # each step moves >= 1 replica; the range is < 30 replicas
    got = run_ticks(cfg, load, current, [i * interval for i in range(ticks)])
    desired = [d for _, d, _ in got]
    assert expected in desired, f"never reached {expected}: {desired[-5:]}"
    first = desired.index(expected)
    assert set(desired[first:]) == {expected}


@settings(max_examples=100, deadline=None)
@given(
    cfg=configs(),
    load=st.floats(0.0, 20_000.0),
    current=st.integers(1, 20),
    offsets=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=20),
)
def test_no_change_while_inside_the_delays(
    cfg: AutoscalingConfig, load: float, current: int, offsets: list[float]
) -> None:
    current = apply_bounds(current, cfg)
    raw = raw_desired(load, cfg.target_per_replica)
    proposed = apply_bounds(apply_factors(raw, current, cfg), cfg)
    assume(proposed != current and current > 0)  # a wish, and not the from-zero fast path
    delay = cfg.upscale_delay_s if proposed > current else cfg.downscale_delay_s
    assume(delay > 1e-3)  # a zero delay is taken on the first tick
    # every sample stays in the window, so the wish is the same on every tick
    cfg = msgspec.structs.replace(cfg, look_back_s=max(cfg.look_back_s, delay + 1))
    times = sorted({0.0, *(o * delay * (1 - 1e-6) for o in offsets)})
    got = run_ticks(cfg, load, current, [*times, delay])
    assert [d for _, d, _ in got[:-1]] == [current] * len(times)
    assert got[-1][1] == proposed  # and exactly at the delay it is taken


# --------------------------------------------------------------------------- controller


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeCluster:
    """A metric source and a scaler that records its calls."""

    def __init__(self, clock: FakeClock, replicas: dict[str, int], loads: dict[str, float]):
        self.clock, self.replicas, self.loads = clock, dict(replicas), dict(loads)
        self.calls: list[tuple[str, int]] = []
        self.fail_set = 0
        self.fail_metrics: set[str] = set()
        self.fail_replicas: set[str] = set()

    def metrics(self, role: str) -> list[Sample]:
        if role in self.fail_metrics:
            raise ConnectionError(f"{role} metrics down")
        return [Sample(self.clock.now, self.loads[role])]

    def get(self, role: str) -> int:
        if role in self.fail_replicas:
            raise TimeoutError("actor busy")
        return self.replicas[role]

    def set(self, role: str, n: int) -> None:
        self.calls.append((role, n))
        if self.fail_set:
            self.fail_set -= 1
            raise RuntimeError("placement group pending")
        self.replicas[role] = n


def controller(
    **loads: float,
) -> tuple[Controller, FakeCluster, FakeClock]:
    clock = FakeClock()
    fake = FakeCluster(clock, dict.fromkeys(loads, 2), loads)
    policies = {role: cfg_(upscale_delay_s=10.0, downscale_delay_s=60.0) for role in loads}
    return Controller(policies, fake.metrics, fake.get, fake.set, clock), fake, clock


def test_controller_scales_only_after_the_delay_and_only_when_it_changes() -> None:
    ctl, fake, clock = controller(collector=350.0, bridge=200.0)
    for t in range(10):
        clock.now = float(t)
        decisions = ctl.tick()
        assert decisions["collector"].desired == 2 and decisions["bridge"].desired == 2
    assert fake.calls == []
    clock.now = 10.0
    assert ctl.tick()["collector"].desired == 4
    assert fake.calls == [("collector", 4)]
    for t in range(11, 30):
        clock.now = float(t)
        ctl.tick()
    assert fake.calls == [("collector", 4)]  # no repeat once applied, bridge never touched
    assert ctl.last["collector"].reason.startswith("steady at 4")


def test_controller_retries_a_failed_scale_next_tick_without_a_new_delay() -> None:
    ctl, fake, clock = controller(collector=350.0)
    fake.fail_set = 1
    for t in (0.0, 10.0, 11.0):
        clock.now = t
        ctl.tick()
    assert fake.calls == [("collector", 4), ("collector", 4)]
    assert fake.replicas["collector"] == 4
    assert "collector" not in ctl.errors  # cleared by the next good round


def test_controller_records_a_failed_scale_and_keeps_the_pending_wish() -> None:
    ctl, fake, clock = controller(collector=350.0)
    fake.fail_set = 5
    ctl.tick()
    clock.now = 10.0
    d = ctl.tick()["collector"]
    assert d.desired == 2 and d.reason.endswith("; failed")
    assert "scale to 4 failed" in ctl.errors["collector"]
    assert ctl.states["collector"].since == 0.0  # still the old wish: retried at once


def test_controller_holds_a_role_whose_metrics_fail_and_keeps_the_others_going() -> None:
    ctl, fake, clock = controller(collector=350.0, logger=900.0)
    ctl.tick()
    fake.fail_metrics.add("collector")
    clock.now = 10.0
    decisions = ctl.tick()
    assert decisions["collector"].desired == 2
    assert "metrics down" in ctl.errors["collector"]
    assert decisions["logger"].desired == 9
    assert fake.calls == [("logger", 9)]
    fake.fail_metrics.clear()
    clock.now = 11.0
    assert ctl.tick()["collector"].desired == 2  # the wish starts over after the gap
    assert "collector" not in ctl.errors
    clock.now = 21.0
    assert ctl.tick()["collector"].desired == 4


def test_controller_skips_a_role_whose_replica_count_cannot_be_read() -> None:
    ctl, fake, _ = controller(collector=350.0, gateway=100.0)
    fake.fail_replicas.add("collector")
    decisions = ctl.tick()
    assert set(decisions) == {"gateway"}
    assert "replica count unavailable" in ctl.errors["collector"]


def test_controller_rejects_a_bad_policy_naming_the_role() -> None:
    bad = AutoscalingConfig(min_replicas=3, max_replicas=2, target_per_replica=1)
    with pytest.raises(ValueError, match=r"roles\.logger\.autoscaling\.min_replicas"):
        Controller({"logger": bad}, list, int, print)


def test_run_ticks_until_stopped_and_survives_errors() -> None:
    clock = FakeClock()
    fake = FakeCluster(clock, {"collector": 2}, {"collector": 350.0})
    stop = threading.Event()
    reads: list[float] = []

    def metrics(role: str) -> list[Sample]:
        clock.now += 5.0  # the fake clock advances one step per tick
        reads.append(clock.now)
        if len(reads) == 2:
            raise OSError("one bad read")
        return fake.metrics(role)

    def scale(role: str, n: int) -> None:
        fake.set(role, n)
        stop.set()

    ctl = Controller({"collector": cfg_()}, metrics, fake.get, scale, clock)
    ticks = ctl.run(stop, interval_s=0.001, max_ticks=1000)
    assert stop.is_set() and fake.calls == [("collector", 4)]
    # read 1 starts the wish, read 2 fails (wish reset), reads 3..5 span the 10 s delay
    assert ticks == len(reads) == 5


def test_run_is_bounded_by_max_ticks_and_a_preset_stop() -> None:
    ctl, _, _ = controller(collector=100.0)
    assert ctl.run(threading.Event(), 0.001, max_ticks=3) == 3
    stopped = threading.Event()
    stopped.set()
    assert ctl.run(stopped, 0.001) == 0
    with pytest.raises(ValueError, match="interval_s"):
        ctl.run(threading.Event(), 0)
