"""tests/ordering.py: make test hands its workers the costliest modules first."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import ordering
from tests.ordering import costliest_first, costs_from_junit, load_costs, module_of

pytestmark = pytest.mark.unit

IDS = [
    "tests/test_a.py::test_one",
    "tests/test_b.py::test_one",
    "tests/test_a.py::test_two",
    "tests/test_c.py::test_one[x]",
    "tests/test_new.py::test_one",
    "tests/test_c.py::test_one[y]",
]


def test_modules_costliest_first_unknown_before_all_order_within_kept() -> None:
    costs = {"tests/test_a.py": 5.0, "tests/test_b.py": 90.0, "tests/test_c.py": 20.0}
    assert costliest_first(IDS, module_of, costs) == [
        "tests/test_new.py::test_one",
        "tests/test_b.py::test_one",
        "tests/test_c.py::test_one[x]",
        "tests/test_c.py::test_one[y]",
        "tests/test_a.py::test_one",
        "tests/test_a.py::test_two",
    ]


def test_without_costs_modules_stay_grouped_in_first_seen_order() -> None:
    out = costliest_first(IDS, module_of, {})
    assert sorted(out) == sorted(IDS)
    assert [module_of(i) for i in out] == [
        "tests/test_a.py",
        "tests/test_a.py",
        "tests/test_b.py",
        "tests/test_c.py",
        "tests/test_c.py",
        "tests/test_new.py",
    ]


def test_junit_times_summed_per_module_classes_included() -> None:
    xml = """<testsuites><testsuite>
      <testcase classname="tests.test_a" name="test_one" time="1.25"/>
      <testcase classname="tests.test_a.TestThing" name="test_two" time="2.5"/>
      <testcase classname="tests.test_b" name="test_one" time="40"/>
      <testcase classname="" name="collect" time="3"/>
    </testsuite></testsuites>"""
    costs = costs_from_junit(xml)
    assert costs == {"tests/test_b.py": 40.0, "tests/test_a.py": 3.8}
    assert list(costs) == ["tests/test_b.py", "tests/test_a.py"]


def test_unreadable_costs_are_no_costs(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("[1, 2")
    assert load_costs(tmp_path / "bad.json") == {}
    assert load_costs(tmp_path / "absent.json") == {}
    assert isinstance(load_costs(ordering.COSTS), dict)
