"""Placement policy (pure): spread a role's replicas over nodes, re-plan off a dead node."""

from __future__ import annotations

import pytest

from runtime.state.placement import NODE_HINT, affinity, plan, resolve, spread_node, strategy

pytestmark = pytest.mark.unit


def test_spread_picks_the_node_with_fewest_replicas_first_on_ties() -> None:
    assert spread_node({}, ["a", "b", "c"]) == "a"
    assert spread_node({"a": 1}, ["a", "b", "c"]) == "b"
    assert spread_node({"a": 1, "b": 1}, ["a", "b", "c"]) == "c"
    assert spread_node({"a": 2, "b": 1, "c": 1}, ["a", "b", "c"]) == "b"
    assert spread_node({"gone": 0}, ["a", "b"]) == "a"  # counts of dead nodes do not matter


@pytest.mark.parametrize("alive", [[], ["only"]])
def test_no_choice_without_two_nodes(alive: list[str]) -> None:
    assert spread_node({}, alive) is None
    assert plan(3, alive) == [None, None, None]


def test_plan_lays_a_role_out_round_the_nodes_around_what_runs() -> None:
    assert plan(3, ["a", "b", "c"]) == ["a", "b", "c"]
    assert plan(4, ["a", "b"]) == ["a", "b", "a", "b"]
    assert plan(2, ["a", "b", "c"], placed=["a", "a", None]) == ["b", "c"]


def test_resolve_keeps_a_live_hint_and_re_plans_a_dead_one() -> None:
    alive = ["a", "b", "c"]
    assert resolve("b", alive, ["a", "c"]) == "b"
    assert resolve("dead", alive, ["a", "b"]) == "c"  # the node without a sibling
    assert resolve("dead", alive, ["a", "dead"]) == "b"
    assert resolve("dead", ["a"], ["a"]) is None  # one node left: anywhere
    assert resolve(None, alive, ["a"]) is None  # no hint, no preference


def test_hint_and_strategy() -> None:
    node = "ab" * 28  # Ray node ids are 28 bytes of hex
    assert affinity(None) == {} and strategy(None) == {}
    assert affinity(node) == {NODE_HINT: node}
    s = strategy(node)["scheduling_strategy"]
    assert s.node_id == node and s.soft is False
