"""The in-sync set of a logger group as pure policy: which configuration holders adopt,
when a silent replica may be dropped, and the fence that lets one configuration win an
epoch."""

from __future__ import annotations

from itertools import combinations
from typing import Any

import pytest

from actors.queue.logger.in_sync import Config, extra_replicas, members, newest, with_, without
from runtime.state.replication import Fence, FencedError

pytestmark = pytest.mark.unit


def st(epoch: int, primary: int | None, in_sync: list[int] | None = None) -> dict[str, Any]:
    return {"epoch": epoch, "primary": primary, "in_sync": in_sync}


DOWN: dict[str, Any] = {"error": "no answer"}


def test_a_set_counts_only_once_every_member_reports_it() -> None:
    half = [st(3, 0, [0, 1]), DOWN, st(2, 0)]
    assert newest(half, 3) == Config(2, 0, None)  # member 1 did not confirm epoch 3
    whole = [st(3, 0, [0, 1]), st(3, 0, [0, 1]), DOWN]
    assert newest(whole, 3) == Config(3, 0, (0, 1))


def test_rival_sets_for_one_epoch_are_neither_adopted() -> None:
    split = [st(4, 0, [0, 2]), st(4, 1, [1, 2]), st(3, 0, [0, 1, 2])]
    assert newest(split, 3) is None  # epoch 3's member 0 and 1 moved on: not whole either
    older = [st(4, 0, [0, 2]), st(4, 1, [1, 2]), st(3, 0, [0, 1, 2]), st(2, 0)]
    assert newest(older, 4) == Config(2, 0, None)


def test_every_replica_configuration_needs_only_agreement() -> None:
    assert newest([st(5, 1), DOWN, st(5, 1)], 3) == Config(5, 1, None)
    assert newest([DOWN, DOWN], 2) is None
    assert newest([st(0, None), st(0, None)], 2) is None  # a new group: nothing announced


def test_a_silent_replica_is_dropped_only_while_k_plus_one_remain() -> None:
    start = Config(7, 0, None)
    assert without(start, [2], 3, need=2) == Config(8, 0, (0, 1))
    assert without(start, [1, 2], 3, need=2) is None
    assert without(Config(8, 0, (0, 1)), [1], 3, need=2) is None
    assert without(start, [1], 2, need=2) is None  # k+1 replicas: nothing to spare


def test_a_dropped_primary_hands_over_to_a_caught_up_member() -> None:
    start = Config(7, 0, None)
    assert without(start, [0], 3, need=2) == Config(8, 1, (1, 2))
    assert without(start, [0], 3, need=2, catching_up=[1]) == Config(8, 2, (1, 2))
    assert without(start, [0], 3, need=2, catching_up=[1, 2]) is None


def test_a_rejoining_replica_comes_back_under_the_next_epoch() -> None:
    assert with_(Config(8, 1, (1, 2)), 0, 3) == Config(9, 1, (0, 1, 2))
    assert members(Config(9, 1, None), 3) == (0, 1, 2)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_any_two_sets_of_k_plus_one_share_a_replica_with_up_to_k_extra(k: int) -> None:
    size = 2 * k + 1  # k extra replicas: the most `logging.extra_replicas` allows
    sets = list(combinations(range(size), k + 1))
    assert all(set(a) & set(b) for a in sets for b in sets)


def test_the_fence_lets_one_configuration_win_an_epoch() -> None:
    fence = Fence(3, 0)
    fence.advance(4, 0, [0, 1])
    fence.advance(4, 0, [1, 0])  # the same set, announced again
    with pytest.raises(ValueError, match="already names primary 0"):
        fence.advance(4, 1, [1, 2])
    with pytest.raises(ValueError, match="in-sync"):
        fence.advance(4, 0, [0, 2])
    with pytest.raises(FencedError):
        fence.advance(3, 0)
    assert Fence.from_bytes(fence.to_bytes()) == fence
    assert fence.in_sync == (0, 1)


def test_a_write_of_a_newer_epoch_forgets_the_set_until_announced() -> None:
    fence = Fence(4, 0, [0, 1])
    assert fence.admit(5)
    assert (fence.primary, fence.in_sync) == (None, None)
    fence.advance(5, 1, [1, 2])
    assert (fence.epoch, fence.primary, fence.in_sync) == (5, 1, (1, 2))


def test_a_fence_saved_without_a_set_still_loads() -> None:
    assert Fence.from_bytes(b'{"epoch":2,"primary":1}') == Fence(2, 1)


def test_auto_keeps_a_replica_more_only_where_a_host_can_be_lost() -> None:
    assert extra_replicas("auto", 1, 3) == 1  # three hosts, k=1: a cut host leaves two
    assert extra_replicas("auto", 1, 2) == 0  # two hosts: a third replica shares one
    assert extra_replicas("auto", 1, 1) == 0  # one machine
    assert extra_replicas("auto", 0, 5) == 0  # k=0: no two sets of one would share
    assert extra_replicas("auto", 2, 4) == 1
    assert extra_replicas(0, 1, 3) == 0  # as configured
