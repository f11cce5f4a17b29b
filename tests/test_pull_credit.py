"""PullCredit: the gateway reader's overlapping pull requests stay within twice a batch of
messages owed or buffered, ask again as soon as a fetch's worth is read, and never wait on
a request that has ended without an answer."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.access.reader import PullCredit

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_second_request_opens_while_the_first_is_read() -> None:
    credit = PullCredit(512, 1.0, Clock())
    assert credit.want(0) == 512
    assert credit.want(0) == 0  # a whole batch owed: enough
    credit.delivered(100)  # a batch arrived and the fetch took it
    assert credit.want(0) == 512  # the next is asked for before the feed dispatches
    assert credit.credit == 412 + 512


def test_a_slow_reader_is_not_sent_more() -> None:
    credit = PullCredit(100, 1.0, Clock())
    assert credit.want(0) == 100
    credit.delivered(100)
    assert credit.want(buffered=100) == 0  # nothing owed, but a batch unread
    assert credit.want(buffered=0) == 100


def test_an_expired_request_is_no_longer_owed() -> None:
    credit = PullCredit(512, 1.0, Clock())
    credit.want(0)
    credit.delivered(10)
    credit.want(0)
    credit.ended(502)  # the first expired (408 with what it still owed)
    assert credit.credit == 512
    credit.ended(10_000)  # a late answer for credit already dropped
    assert credit.credit == 0


def test_credit_left_past_every_request_s_expiry_is_dropped() -> None:
    clock = Clock()
    credit = PullCredit(512, 1.0, clock)
    assert credit.want(0) == 512
    assert credit.want(0) == 0
    clock.t += 1.2  # expired, its 408 not seen yet: it may still come
    assert credit.want(0) == 0
    clock.t += 0.5  # past the grace: the answer was lost (a reconnect), ask again
    assert credit.want(0) == 512


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 600)), max_size=60))
def test_owed_and_buffered_never_exceed_two_batches(steps: list[tuple[int, int]]) -> None:
    """Whatever the server answers (deliveries up to what is owed, expiries) and however
    much the reader leaves unread, what it may hold stays within two batches."""
    clock = Clock()
    batch = 512
    credit = PullCredit(batch, 1.0, clock)
    buffered = 0
    for op, n in steps:
        if op == 0:
            credit.want(buffered)  # ask; nothing arrives yet
        elif op == 1:
            got = min(n, credit.credit)
            credit.delivered(got)
            buffered += got
        elif op == 2:
            buffered -= min(n, buffered)  # the reader takes some
        else:
            credit.ended(min(n, credit.credit))
            clock.t += 0.3
        assert buffered + credit.credit <= 2 * batch
