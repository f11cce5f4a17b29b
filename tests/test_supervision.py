"""Pure supervision policy: every branch, time passed in, no sleeping, no Ray, no threads."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime.errors import ConfigError
from runtime.supervision.policy import (
    Backoff,
    ChildSpec,
    Exit,
    HeartbeatState,
    Intensity,
    Restart,
    RestartHistory,
    Seen,
    Strategy,
    affected_children,
    attribute_restart,
    backoff_delay,
    decide,
    hung,
    index_specs,
    load_start,
    observe,
    overdue,
    recent_restarts,
    record_restart,
    should_restart,
)

pytestmark = pytest.mark.unit

NO_JITTER = Backoff(base_s=1.0, factor=2.0, cap_s=10.0, jitter=0.0)


def _specs(**restarts: Restart) -> dict[str, ChildSpec]:
    return index_specs(
        [ChildSpec(i, "runtime.supervision.policy:Exit", restart=r) for i, r in restarts.items()]
    )


# --------------------------------------------------------------------------- specs


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"id": "", "start": "a:B"}, "non-empty"),
        ({"id": "x", "start": "no_colon"}, "module:Attr"),
        ({"id": "x", "start": ":B"}, "module:Attr"),
        ({"id": "x", "start": "a:"}, "module:Attr"),
        ({"id": "x", "start": 42}, "callable"),
        ({"id": "x", "start": "a:B", "restart": "permanent"}, "Restart"),
        ({"id": "x", "start": "a:B", "shutdown_s": -1}, "shutdown_s"),
    ],
)
def test_child_spec_rejects_bad_fields_naming_them(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChildSpec(**kwargs)


def test_child_spec_is_frozen_data_and_args_become_a_tuple() -> None:
    spec = ChildSpec("x", "a:B", args=[1, 2])  # type: ignore[arg-type]
    assert spec.args == (1, 2)
    assert spec.restart is Restart.PERMANENT
    with pytest.raises(AttributeError):
        spec.id = "y"  # type: ignore[misc]


def test_index_specs_keeps_order_and_rejects_duplicates() -> None:
    specs = [ChildSpec("b", "a:B"), ChildSpec("a", "a:B")]
    assert list(index_specs(specs)) == ["b", "a"]
    with pytest.raises(ValueError, match="duplicate child id 'a'"):
        index_specs([*specs, ChildSpec("a", "a:C")])


def test_load_start_imports_dotted_attributes_and_passes_callables_through() -> None:
    assert load_start("runtime.supervision.policy:Restart.PERMANENT") is Restart.PERMANENT
    assert load_start(math.floor) is math.floor
    with pytest.raises(
        ConfigError, match="start: 'runtime.supervision.policy' has no attribute 'Nope'"
    ):
        load_start("runtime.supervision.policy:Nope")


# --------------------------------------------------------------------------- restart types


@pytest.mark.parametrize(
    ("restart", "exit", "expected"),
    [
        (Restart.PERMANENT, Exit.NORMAL, True),
        (Restart.PERMANENT, Exit.ABNORMAL, True),
        (Restart.PERMANENT, Exit.KILLED, True),
        (Restart.TRANSIENT, Exit.NORMAL, False),
        (Restart.TRANSIENT, Exit.ABNORMAL, True),
        (Restart.TRANSIENT, Exit.KILLED, True),
        (Restart.TEMPORARY, Exit.NORMAL, False),
        (Restart.TEMPORARY, Exit.ABNORMAL, False),
        (Restart.TEMPORARY, Exit.KILLED, False),
    ],
)
def test_should_restart_follows_otp_restart_types(
    restart: Restart, exit: Exit, expected: bool
) -> None:
    assert should_restart(restart, exit) is expected


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [(Strategy.ONE_FOR_ONE, ("b",)), (Strategy.ONE_FOR_ALL, ("a", "b", "c"))],
)
def test_affected_children(strategy: Strategy, expected: tuple[str, ...]) -> None:
    assert affected_children(["a", "b", "c"], "b", strategy) == expected


# --------------------------------------------------------------------------- intensity


@pytest.mark.parametrize(
    ("times", "now", "intensity", "within", "kept"),
    [
        ((), 0.0, Intensity(0, 5.0), False, (0.0,)),  # zero restarts allowed: first escalates
        ((), 0.0, Intensity(1, 5.0), True, (0.0,)),
        ((1.0, 2.0), 3.0, Intensity(3, 5.0), True, (1.0, 2.0, 3.0)),
        ((1.0, 2.0, 3.0), 4.0, Intensity(3, 5.0), False, (1.0, 2.0, 3.0, 4.0)),  # the 4th
        (
            (1.0, 2.0, 3.0),
            6.0,
            Intensity(3, 5.0),
            False,
            (1.0, 2.0, 3.0, 6.0),
        ),  # 1.0 is on the edge
        ((1.0, 2.0, 3.0), 6.5, Intensity(3, 5.0), True, (2.0, 3.0, 6.5)),  # 1.0 slid out
        ((1.0, 2.0, 3.0), 100.0, Intensity(3, 5.0), True, (100.0,)),  # all forgotten
    ],
)
def test_record_restart_sliding_window(
    times: tuple[float, ...],
    now: float,
    intensity: Intensity,
    within: bool,
    kept: tuple[float, ...],
) -> None:
    ok, history = record_restart(RestartHistory(times), now, intensity)
    assert ok is within
    assert history.times == kept


def test_record_restart_does_not_mutate_the_old_history() -> None:
    old = RestartHistory((1.0,))
    record_restart(old, 2.0, Intensity(3, 5.0))
    assert old.times == (1.0,)


def test_recent_restarts_counts_only_the_window() -> None:
    history = RestartHistory((1.0, 4.0, 5.0))
    assert recent_restarts(history, 6.0, 5.0) == 3
    assert recent_restarts(history, 9.0, 5.0) == 2  # 4.0 is on the edge: still counted
    assert recent_restarts(history, 99.0, 5.0) == 0


@pytest.mark.parametrize(("max_restarts", "period_s"), [(-1, 5.0), (1, 0.0), (1, -2.0)])
def test_intensity_validates(max_restarts: int, period_s: float) -> None:
    with pytest.raises(ValueError, match="Intensity"):
        Intensity(max_restarts, period_s)


# --------------------------------------------------------------------------- backoff


@pytest.mark.parametrize(
    ("attempt", "jitter", "rand", "expected"),
    [
        (0, 0.0, 0.0, 1.0),
        (1, 0.0, 0.9, 2.0),  # no jitter: rand is ignored
        (3, 0.0, 0.0, 8.0),
        (4, 0.0, 0.0, 10.0),  # capped
        (10_000, 0.0, 0.0, 10.0),  # no overflow
        (2, 1.0, 0.0, 4.0),  # full jitter, lowest draw keeps the whole delay
        (2, 1.0, 0.75, 1.0),
        (2, 0.5, 0.5, 3.0),  # partial jitter removes at most half
        (10_000, 1.0, 0.5, 5.0),
    ],
)
def test_backoff_delay_table(attempt: int, jitter: float, rand: float, expected: float) -> None:
    got = backoff_delay(attempt, base=1.0, factor=2.0, cap=10.0, jitter=jitter, rand=rand)
    assert got == pytest.approx(expected)


@pytest.mark.parametrize(
    ("base", "factor", "cap", "expected"),
    [(0.0, 2.0, 10.0, 0.0), (3.0, 1.0, 10.0, 3.0), (3.0, 2.0, 0.0, 0.0), (20.0, 2.0, 10.0, 10.0)],
)
def test_backoff_delay_degenerate_parameters(
    base: float, factor: float, cap: float, expected: float
) -> None:
    for attempt in (0, 1, 50):
        got = backoff_delay(attempt, base=base, factor=factor, cap=cap, jitter=0.0, rand=0.0)
        assert got == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attempt": -1}, "attempt"),
        ({"base": -1.0}, "base"),
        ({"cap": -1.0}, "cap"),
        ({"factor": 0.5}, "factor"),
        ({"jitter": 1.5}, "jitter"),
        ({"rand": 1.0}, "rand"),
        ({"rand": -0.1}, "rand"),
    ],
)
def test_backoff_delay_rejects_bad_arguments(kwargs: dict, message: str) -> None:
    args = {"attempt": 0, "base": 1.0, "factor": 2.0, "cap": 10.0, "jitter": 0.0, "rand": 0.0}
    args.update(kwargs)
    attempt = args.pop("attempt")
    with pytest.raises(ValueError, match=message):
        backoff_delay(attempt, **args)


finite = {"allow_nan": False, "allow_infinity": False}


@given(
    attempt=st.integers(min_value=0, max_value=100_000),
    base=st.floats(min_value=0, max_value=1e6, **finite),
    factor=st.floats(min_value=1, max_value=1e3, **finite),
    cap=st.floats(min_value=0, max_value=1e6, **finite),
    jitter=st.floats(min_value=0, max_value=1, **finite),
    rand=st.floats(min_value=0, max_value=1, exclude_max=True, **finite),
)
def test_backoff_is_within_zero_and_cap(
    attempt: int, base: float, factor: float, cap: float, jitter: float, rand: float
) -> None:
    d = backoff_delay(attempt, base=base, factor=factor, cap=cap, jitter=jitter, rand=rand)
    assert 0.0 <= d <= cap


@given(
    attempt=st.integers(min_value=0, max_value=100_000),
    base=st.floats(min_value=0, max_value=1e6, **finite),
    factor=st.floats(min_value=1, max_value=1e3, **finite),
    cap=st.floats(min_value=0, max_value=1e6, **finite),
)
def test_backoff_without_jitter_never_decreases(
    attempt: int, base: float, factor: float, cap: float
) -> None:
    kw = {"base": base, "factor": factor, "cap": cap, "jitter": 0.0, "rand": 0.0}
    assert backoff_delay(attempt, **kw) <= backoff_delay(attempt + 1, **kw)


# --------------------------------------------------------------------------- heartbeat


@pytest.mark.parametrize(
    ("last_seen", "now", "deadline", "expected"),
    [
        (10.0, 10.5, 1.0, False),
        (10.0, 11.0, 1.0, False),  # exactly at the deadline is on time
        (10.0, 11.01, 1.0, True),
        (10.0, 5.0, 1.0, False),  # clock went backwards: not overdue
    ],
)
def test_overdue(last_seen: float, now: float, deadline: float, expected: bool) -> None:
    assert overdue(last_seen, now, deadline) is expected


def test_observe_first_same_and_new_incarnation() -> None:
    seen, state = observe(None, "inc-1", 1.0)
    assert (seen, state) == (Seen.FIRST, HeartbeatState("inc-1", 1.0))
    seen, state = observe(state, "inc-1", 2.0)
    assert (seen, state) == (Seen.SAME, HeartbeatState("inc-1", 2.0))
    seen, state = observe(state, "inc-2", 3.0)
    assert (seen, state) == (Seen.NEW_INCARNATION, HeartbeatState("inc-2", 3.0))
    seen, state = observe(state, "inc-2", 0.5)  # a late answer does not move last_seen back
    assert (seen, state.last_seen) == (Seen.SAME, 3.0)


@pytest.mark.parametrize(
    ("killed_at", "started_at", "now", "expected"),
    [
        (None, 5.0, 6.0, (False, None)),  # nothing pending: a new failure
        (1.0, 5.0, 100.0, (False, None)),  # the kill is too old to explain it
        (4.0, 3.0, 6.0, (True, 4.0)),  # started before the kill: absorbed, keep waiting
        (4.0, 4.0, 6.0, (True, None)),  # started at the kill: the restart we asked for
        (4.0, 5.0, 14.0, (True, None)),  # exactly at the grace edge still counts as ours
    ],
)
def test_attribute_restart(
    killed_at: float | None,
    started_at: float,
    now: float,
    expected: tuple[bool, float | None],
) -> None:
    assert attribute_restart(killed_at, started_at, now, grace_s=10.0) == expected


# --------------------------------------------------------------------------- decide

INTENSITY = Intensity(2, 10.0)
ORDER = ["a", "b", "c"]


def _decide(
    failed: str,
    exit: Exit,
    specs: dict[str, ChildSpec],
    strategy: Strategy = Strategy.ONE_FOR_ONE,
    history: RestartHistory = RestartHistory(),  # noqa: B008 - frozen, safe as a default
    attempt: int = 0,
):
    return decide(
        list(specs),
        failed,
        exit,
        specs,
        strategy,
        history,
        INTENSITY,
        now=100.0,
        attempt=attempt,
        rand=0.0,
        backoff=NO_JITTER,
    )


ALL_PERMANENT = _specs(a=Restart.PERMANENT, b=Restart.PERMANENT, c=Restart.PERMANENT)


@pytest.mark.parametrize(
    ("failed", "exit", "specs", "strategy", "restart", "stop", "drop"),
    [
        ("b", Exit.ABNORMAL, ALL_PERMANENT, Strategy.ONE_FOR_ONE, ("b",), (), ()),
        ("b", Exit.NORMAL, ALL_PERMANENT, Strategy.ONE_FOR_ONE, ("b",), (), ()),
        ("b", Exit.ABNORMAL, ALL_PERMANENT, Strategy.ONE_FOR_ALL, ("a", "b", "c"), ("c", "a"), ()),
        (
            "b",
            Exit.KILLED,
            _specs(a=Restart.TEMPORARY, b=Restart.TRANSIENT, c=Restart.TRANSIENT),
            Strategy.ONE_FOR_ALL,
            ("b", "c"),
            ("c", "a"),
            ("a",),  # a temporary sibling is stopped and dropped, never restarted
        ),
        (
            "b",
            Exit.NORMAL,
            _specs(a=Restart.PERMANENT, b=Restart.TRANSIENT, c=Restart.PERMANENT),
            Strategy.ONE_FOR_ALL,
            (),
            (),
            ("b",),  # transient normal exit: siblings untouched even under one_for_all
        ),
        (
            "c",
            Exit.ABNORMAL,
            _specs(a=Restart.PERMANENT, b=Restart.PERMANENT, c=Restart.TEMPORARY),
            Strategy.ONE_FOR_ALL,
            (),
            (),
            ("c",),
        ),
        (
            "a",
            Exit.ABNORMAL,
            _specs(a=Restart.TRANSIENT, b=Restart.PERMANENT, c=Restart.PERMANENT),
            Strategy.ONE_FOR_ONE,
            ("a",),
            (),
            (),
        ),
    ],
)
def test_decide_restart_stop_drop(
    failed: str,
    exit: Exit,
    specs: dict[str, ChildSpec],
    strategy: Strategy,
    restart: tuple[str, ...],
    stop: tuple[str, ...],
    drop: tuple[str, ...],
) -> None:
    d = _decide(failed, exit, specs, strategy)
    assert (d.restart, d.stop, d.drop, d.escalate) == (restart, stop, drop, False)
    if restart:
        assert d.history.times == (100.0,)
        assert d.delay_s == 1.0
    else:  # a drop is not a restart: the history is untouched and nothing waits
        assert d.history == RestartHistory()
        assert d.delay_s == 0.0
    assert failed in d.reason


@pytest.mark.parametrize("strategy", list(Strategy))
def test_decide_escalates_past_intensity_and_stops_everyone(strategy: Strategy) -> None:
    d = _decide("b", Exit.ABNORMAL, ALL_PERMANENT, strategy, RestartHistory((95.0, 99.0)))
    assert d.escalate
    assert d.restart == ()
    assert d.stop == ("c", "b", "a")
    assert d.history.times == (95.0, 99.0, 100.0)
    assert "more than 2 restarts in 10.0s" in d.reason


def test_decide_old_restarts_do_not_escalate() -> None:
    d = _decide("b", Exit.ABNORMAL, ALL_PERMANENT, history=RestartHistory((80.0, 85.0)))
    assert not d.escalate
    assert d.history.times == (100.0,)


def test_decide_temporary_never_counts_towards_intensity() -> None:
    specs = _specs(a=Restart.TEMPORARY)
    full = RestartHistory((99.0, 99.5))
    d = _decide("a", Exit.ABNORMAL, specs, history=full)
    assert not d.escalate
    assert d.drop == ("a",)
    assert d.history == full


@pytest.mark.parametrize(("attempt", "delay"), [(0, 1.0), (1, 2.0), (2, 4.0), (9, 10.0)])
def test_decide_delay_follows_attempt(attempt: int, delay: float) -> None:
    assert _decide("a", Exit.ABNORMAL, ALL_PERMANENT, attempt=attempt).delay_s == delay


def test_decide_unknown_child_is_an_error() -> None:
    with pytest.raises(KeyError, match="unknown child 'z'"):
        _decide("z", Exit.ABNORMAL, ALL_PERMANENT)


@pytest.mark.parametrize(
    ("ray_alive", "last_seen", "killed_at", "now", "expected"),
    [
        (True, 10.0, None, 12.0, True),  # silent past the deadline while Ray says ALIVE
        (True, 10.0, None, 11.0, False),  # one slow answer within the deadline
        (True, None, None, 12.0, True),  # never answered at all
        (False, 10.0, None, 12.0, False),  # Ray is restarting (or it is gone): not a hang
        (True, 10.0, 11.0, 12.0, False),  # our own kill's restart is still on its way
        (True, 10.0, 11.0, 21.0, False),  # ... up to the grace, inclusive
        (True, 10.0, 11.0, 21.5, True),  # a kill that never landed hides a hang no longer
    ],
)
def test_hung(
    ray_alive: bool,
    last_seen: float | None,
    killed_at: float | None,
    now: float,
    expected: bool,
) -> None:
    verdict = hung(
        ray_alive=ray_alive,
        last_seen=last_seen,
        killed_at=killed_at,
        now=now,
        deadline_s=1.5,
        grace_s=10.0,
    )
    assert verdict is expected
