"""The analysis driver's self-restart policy (jobs/escalation.py), driven without a clock."""

from __future__ import annotations

import pytest

from jobs.escalation import ESCALATE_AFTER, ESCALATE_EVERY_S, should_escalate

pytestmark = pytest.mark.unit


def test_only_when_every_query_keeps_failing() -> None:
    assert not should_escalate({}, None, 0.0)
    assert not should_escalate({"top": ESCALATE_AFTER, "dl": ESCALATE_AFTER - 1}, None, 0.0)
    assert not should_escalate({"top": 99, "dl": 0}, None, 0.0)  # one bad job: restart it alone
    assert should_escalate({"top": ESCALATE_AFTER, "dl": ESCALATE_AFTER + 4}, None, 0.0)
    assert should_escalate({"only": ESCALATE_AFTER}, None, 0.0)


def test_at_most_once_per_interval_across_restarts() -> None:
    failing = {"top": 10, "dl": 10}
    assert not should_escalate(failing, 1000.0, 1000.0 + ESCALATE_EVERY_S - 1)
    assert should_escalate(failing, 1000.0, 1000.0 + ESCALATE_EVERY_S)
    assert should_escalate(failing, 1000.0, 2000.0, every_s=60.0)
    assert not should_escalate({"top": 2}, None, 0.0, after=3)
