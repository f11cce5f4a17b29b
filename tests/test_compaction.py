"""Per-key compaction, the pure parts (runtime/data/compaction.py): key tokens, subjects, the
config table and the logic that derives each event's subject."""

from __future__ import annotations

import pickle
import re
from decimal import Decimal
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.config import ConfigError, dumps_toml, load
from runtime.data.compaction import (
    MAX_TOKEN,
    CompactingLogic,
    KeyReader,
    NoKey,
    check_update,
    event_token,
    key_token,
    max_msgs_per_subject,
    stream_logic,
    stream_subjects,
    target_subject,
    token_key,
    token_of,
)
from runtime.data.events import Event
from runtime.nats.roles import role_permissions
from tests.strategies import json_value

pytestmark = pytest.mark.unit

# a NATS subject token: no dots, wildcards or whitespace, not empty
SUBJECT_TOKEN = re.compile(r"^[^.*>\s]+$")

scalar = (
    st.booleans()
    | st.integers(-(2**80), 2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=300)
)


def streams(**compact: object) -> dict[str, object]:
    return {"planes": {"subjects": ["raw.planes"], "compact": compact}}


def cfg_with(body: dict[str, object]) -> object:
    return load(environ={}, overrides={"streams": body})


def ev(data: object, i: int = 0, subject: str = "raw.planes", processed: bool = False) -> Event:
    body = data if isinstance(data, bytes) else msgspec.json.encode(data)
    return Event(f"id-{i}", "planes", subject, body, 1000 + i, processed)


# ---- tokens ------------------------------------------------------------------------------


def test_token_forms_are_readable_where_they_can_be() -> None:
    assert key_token("N10156") == "N10156"
    assert key_token("a_b-C9") == "a_b-C9"
    assert key_token(42) == "=42"
    assert key_token(-7) == "=-7"
    assert key_token(42.0) == "=42"  # numbers key by value
    assert key_token("42") == "42"  # a string stays a string: not the number 42's token
    assert key_token("a.b") == "~ImEuYiI"
    assert key_token(True) == "~dHJ1ZQ"
    assert key_token(1.5) == "~MS41"
    long = key_token("x" * 1000)
    assert long.startswith("~~") and len(long) == 45


@settings(max_examples=400, deadline=None)
@given(scalar, scalar)
def test_tokens_are_subject_safe_short_stable_and_one_per_key(a: object, b: object) -> None:
    ta, tb = key_token(a), key_token(b)  # type: ignore[arg-type]
    assert SUBJECT_TOKEN.match(ta) and len(ta) <= MAX_TOKEN
    assert key_token(a) == ta  # type: ignore[arg-type]
    same = _canon(a) == _canon(b)
    assert (ta == tb) == same, (a, b, ta, tb)
    known, back = token_key(ta)
    if known:
        assert _canon(back) == _canon(a)
    else:
        assert ta.startswith("~~")


def _canon(v: object) -> object:
    """The key identity the module doc promises: numbers by value, types kept apart."""
    if isinstance(v, bool):
        return ("b", v)
    if isinstance(v, float) and v.is_integer():
        return ("n", int(v))
    if isinstance(v, int | float):
        return ("n", v)
    return ("s", v)


@pytest.mark.parametrize(
    "value",
    [
        "with space",
        "a*b",
        "a>b",
        "tab\tin",
        "ünïcødé",
        "日本",
        "",
        "~x",
        "=1",
        "~~",
        "-",
        "x" * 128,
    ],
)
def test_strange_strings_round_trip(value: str) -> None:
    token = key_token(value)
    assert SUBJECT_TOKEN.match(token) and len(token) <= MAX_TOKEN
    assert token_key(token) == (True, value)


@settings(max_examples=400, deadline=None)
@given(
    st.decimals(allow_nan=False, allow_infinity=False, places=None),
    st.decimals(allow_nan=False, allow_infinity=False, places=None),
)
def test_json_numbers_key_by_their_exact_value(a: Decimal, b: Decimal) -> None:
    """Two JSON numbers share a key exactly when they are the same number, however many
    digits they carry: a binary float in between would merge 2**53 + 1 with 2**53."""
    ta = event_token(b'{"k":%s}' % str(a).encode(), ("k",))
    tb = event_token(b'{"k":%s}' % format(b, "e").encode(), ("k",))
    assert (ta == tb) == (a == b), (a, b, ta, tb)
    assert KeyReader(("k",)).token(b'{"k":%s}' % str(a).encode()) == ta
    known, back = token_key(ta)
    assert not known or Decimal(str(back)) == a


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (b"9007199254740993.0", b"9007199254740992"),
        (b"9007199254740993.0", b"9007199254740992.0"),
        (b"0.10000000000000000001", b"0.1"),
        (b"1e999999999", b"1e999999998"),
        (b"0.1000000000000000000000000000001", b"0.1000000000000000000000000000002"),
    ],
)
def test_numbers_past_a_floats_precision_are_distinct_keys(one: bytes, other: bytes) -> None:
    path = ("k",)
    assert event_token(b'{"k":%s}' % one, path) != event_token(b'{"k":%s}' % other, path)


@pytest.mark.parametrize(
    ("one", "other"),
    [(b"9007199254740993.0", b"9007199254740993"), (b"1.0", b"1"), (b"1.50", b"1.5e0")],
)
def test_one_number_written_two_ways_is_one_key(one: bytes, other: bytes) -> None:
    path = ("k",)
    assert event_token(b'{"k":%s}' % one, path) == event_token(b'{"k":%s}' % other, path)


def test_size_limits_switch_to_the_hash_exactly_past_128() -> None:
    assert key_token("x" * 128) == "x" * 128
    assert key_token("x" * 129).startswith("~~")  # base64 of 131 bytes: 175 characters
    spaced = "x " * 46  # JSON text of 94 bytes: "~" + 126 characters of base64 still fit
    assert key_token(spaced).startswith("~") and token_key(key_token(spaced)) == (True, spaced)
    assert key_token(spaced + "yy").startswith("~~")  # 96 bytes: 129 characters
    assert key_token(10**126) == "=" + "1" + "0" * 126  # 128 characters
    assert key_token(10**127).startswith("~~")  # 129: too long for any readable form


def test_event_token_reasons() -> None:
    path = ("plane", "tailnum")
    assert event_token(b'{"plane":{"tailnum":"N1"}}', path) == "N1"
    for body, why in [
        (b'{"plane":{}}', "missing (or null) field plane.tailnum"),
        (b'{"plane":{"tailnum":null}}', "missing (or null)"),
        (b'{"plane":{"tailnum":{"a":1}}}', "is a JSON object, not a scalar"),
        (b'{"plane":{"tailnum":[1]}}', "is a JSON array"),
        (b"[1,2]", "is a JSON array, not an object"),
        (b"{nope", "not JSON"),
    ]:
        with pytest.raises(NoKey, match=re.escape(why)):
            event_token(body, path)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["k", "a", "tail-num"]),
        json_value | st.dictionaries(st.sampled_from(["k", "b"]), json_value, max_size=2),
        max_size=3,
    )
    | json_value,
    st.sampled_from([("k",), ("a", "k"), ("tail-num",), ("a", "b", "k")]),
)
def test_the_fast_key_reader_answers_as_the_full_decode(data: object, path: tuple) -> None:
    body = msgspec.json.encode(data)
    try:
        want: str | None = event_token(body, path)
    except NoKey as why:
        want, reason = None, str(why)
    reader = KeyReader(path)
    if want is None:
        with pytest.raises(NoKey) as info:
            reader.token(body)
        assert str(info.value) == reason
    else:
        assert reader.token(body) == want


def test_the_fast_key_reader_on_bodies_that_are_not_json() -> None:
    reader = KeyReader(("k",))
    for body in (b"{nope", b"\xff\xfe", b"", b'{"k": "\xff"}'):
        with pytest.raises(NoKey):
            reader.token(body)


# ---- config ------------------------------------------------------------------------------


def test_config_table_and_its_errors() -> None:
    cfg = cfg_with(streams(key="tailnum"))
    sc = cfg.streams["planes"]  # type: ignore[attr-defined]
    assert sc.compact.key == "tailnum" and sc.compact.keep == 1
    assert max_msgs_per_subject(sc) == 1
    assert stream_subjects(sc, "planes") == ["raw.planes.*"]
    assert max_msgs_per_subject(cfg.streams["results"]) == -1  # type: ignore[attr-defined]
    assert cfg_with(streams(key="a.b", keep=3)).streams["planes"].compact.keep == 3  # type: ignore[attr-defined]
    for bad, where in [
        (streams(key="a..b"), "streams.planes.compact"),
        (streams(key=""), "streams.planes.compact"),
        (streams(key="k", keep=0), "streams.planes.compact.keep"),
        (streams(key="k", nope=1), "streams.planes.compact"),
        (streams(keep=2), "streams.planes.compact"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(where)):
            cfg_with(bad)


def test_the_table_survives_config_show_and_the_environment(tmp_path: Path) -> None:
    cfg = cfg_with(streams(key="plane.tail", keep=2))
    path = tmp_path / "tierflow.toml"
    path.write_text(dumps_toml(cfg))  # type: ignore[arg-type]
    assert "[streams.planes.compact]" in path.read_text()
    assert load(path, environ={}) == cfg
    env = {"TIERFLOW_STREAMS__PLANES__COMPACT__KEEP": "5"}
    assert load(path, environ=env).streams["planes"].compact.keep == 5  # type: ignore[union-attr]


def test_compaction_is_not_turned_on_over_stored_events() -> None:
    sc = cfg_with(streams(key="tailnum")).streams["planes"]  # type: ignore[attr-defined]
    check_update("planes", sc, -1, 0)  # empty: fine
    check_update("planes", sc, 1, 500)  # already compacted: fine (keep may change)
    with pytest.raises(ConfigError, match=r"streams\.planes\.compact: .* holds 500 events"):
        check_update("planes", sc, -1, 500)
    plain = cfg_with({"plain": {}}).streams["plain"]  # type: ignore[attr-defined]
    check_update("plain", plain, -1, 500)  # not compacted: nothing to check


def test_a_subject_ending_in_gt_is_refused() -> None:
    cfg = cfg_with({"wide": {"subjects": ["raw.wide.>"], "compact": {"key": "k"}}})
    sc = cfg.streams["wide"]  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"streams\.wide\.compact: subject 'raw\.wide\.>'"):
        stream_subjects(sc, "wide")
    with pytest.raises(ConfigError, match="ends in '>'"):
        stream_logic("wide", sc)


def test_the_bridge_may_publish_every_key_subject() -> None:
    cfg = load(
        environ={},
        overrides={"streams": streams(key="tailnum"), "nats": {"role_users": True}},
    )
    allowed = role_permissions(cfg)["bridge"]["publish"]["allow"]  # type: ignore[arg-type]
    assert "raw.planes.*" in allowed and "raw.planes" not in allowed


# ---- logic -------------------------------------------------------------------------------


def logic_for(**extra: object) -> CompactingLogic:
    cfg = cfg_with({"planes": {"subjects": ["raw.planes"], "compact": {"key": "tailnum"}, **extra}})
    logic = stream_logic("planes", cfg.streams["planes"])  # type: ignore[attr-defined]
    assert isinstance(logic, CompactingLogic)
    return logic


def test_logic_derives_the_subject_and_dead_letters_what_has_no_key() -> None:
    logic = logic_for()
    events = [
        ev({"tailnum": "N1", "v": 1}, 0),
        ev({"v": 2}, 1),
        ev({"tailnum": "N 2", "v": 3}, 2),
        ev({"tailnum": ["x"]}, 3),
        ev(b"not json", 4),
    ]
    result = logic.apply(events)
    assert [(e.id, e.subject, e.processed) for e in result.kept] == [
        ("id-0", "raw.planes.N1", True),
        ("id-2", f"raw.planes.{key_token('N 2')}", True),
    ]
    reasons = {e.id: r for e, r in result.invalid}
    assert reasons["id-1"] == "compaction key: missing (or null) field tailnum"
    assert "not a scalar" in reasons["id-3"] and "not JSON" in reasons["id-4"]
    # invalid events go back as received (raw), so the bridge settles them as dead letters
    assert all(not e.processed and e.subject == "raw.planes" for e, _ in result.invalid)
    assert not result.dropped


def test_replay_is_deterministic_and_processed_events_pass_unchanged() -> None:
    logic = logic_for()
    e = ev({"tailnum": "N1"}, 7)
    first = logic.apply([e]).kept[0]
    again = pickle.loads(pickle.dumps(logic)).apply([e]).kept[0]  # a restarted bridge
    assert first == again
    # the bridge sees the collector's processed event: it must not get a second token
    assert logic.apply([first]).kept == [first]
    # processed on the bare subject (logged before compaction was configured): derived now
    bare = ev({"tailnum": "N1"}, 7, processed=True)
    assert logic.apply([bare]).kept[0].subject == "raw.planes.N1"


def test_logic_runs_first_and_its_route_keeps_the_key_last() -> None:
    logic = logic_for(
        logic={"filter": "v > 0", "enrich": ["received_at"], "route": "raw.planes"},
    )
    result = logic.apply([ev({"tailnum": "N1", "v": 1}, 0), ev({"tailnum": "N1", "v": 0}, 1)])
    assert [e.subject for e in result.kept] == ["raw.planes.N1"]
    assert msgspec.json.decode(result.kept[0].data)["received_at"] == 1000
    assert [e.id for e in result.dropped] == ["id-1"]


def test_target_subject_is_one_placeholder_per_compacted_stream() -> None:
    compacted = frozenset({"planes"})
    a = ev({"tailnum": "A"}, 0, subject="raw.planes.A")
    b = ev({"tailnum": "B"}, 1, subject="raw.planes.B")
    assert target_subject(a, compacted) == target_subject(b, compacted) == "raw.planes._"
    other = Event("x", "meetup", "raw.meetup", b"{}", 0)
    assert target_subject(other, compacted) == "raw.meetup"
    assert token_of("raw.planes.~ImEuYiI") == "~ImEuYiI"


def test_listings_say_a_stream_is_compacted() -> None:
    from cluster.cli.lifecycle import _stream_label

    cfg = cfg_with(
        {
            "planes": {"compact": {"key": "tailnum"}},
            "fleet": {"compact": {"key": "plane.tail", "keep": 2}},
            "plain": {},
        }
    )
    labels = [_stream_label(n, cfg) for n in ("planes", "fleet", "plain", "gone")]  # type: ignore[arg-type]
    assert labels == [
        "planes (compacted by tailnum)",
        "fleet (compacted by plane.tail, keep 2)",
        "plain",
        "gone",
    ]
    assert _stream_label("planes", None) == "planes"
